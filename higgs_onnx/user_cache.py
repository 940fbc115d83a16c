"""The user's cache of higgs-onnx: what the runtime keeps about folders it must never write to (a download in the
Hub cache, a community export): the manifest it derived for a foreign layout, a decoder graph rewritten for the CPU
provider. `$HIGGS_CACHE` moves it (default: `$XDG_CACHE_HOME/higgs-onnx`, else `~/.cache/higgs-onnx`).

    cache_dir("adopted", key)      # <root>/adopted/<key>/, made on first use
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "HIGGS_CACHE"


def cache_root() -> Path:
    """The cache's root folder (not made here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "higgs-onnx"


def cache_dir(kind: str, key: str) -> Path:
    """`<root>/<kind>/<key>/`, made if missing. `kind` and `key` are plain names chosen by the code (a hash)."""
    for part in (kind, key):
        if not part or os.sep in part or part in (".", ".."):
            raise ValueError(f"cache path part {part!r} is not a plain name")
    path = cache_root() / kind / key
    path.mkdir(parents=True, exist_ok=True)
    return path
