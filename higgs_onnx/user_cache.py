"""The user's cache of higgs-onnx: what the runtime keeps about folders it must never write to (a download in the
Hub cache, a community export): the manifest it derived for a foreign layout, a decoder graph rewritten for the CPU
provider. `$HIGGS_CACHE` moves it (default: `$XDG_CACHE_HOME/higgs-onnx`, else `~/.cache/higgs-onnx`).

    cache_dir("adopted", key)      # <root>/adopted/<key>/, made on first use
    with cache_writes(folder):     # an OSError of the writes inside becomes the CacheError line
        ...
    read_kept(path, max_bytes)     # a file a cache keeps, as text; None when it is not one a cache could have written

A cache that cannot be written (a read-only filesystem, a folder of another user, `$HIGGS_CACHE` naming a file) is a
`CacheError` (a ValueError: the CLIs print its one line and exit 2) naming the cache, `$HIGGS_CACHE` and the fix.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE_ENV = "HIGGS_CACHE"


class CacheError(ValueError):
    """The user's cache cannot be made or written; str() is the one line a command prints."""


def cache_root() -> Path:
    """The cache's root folder (not made here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "higgs-onnx"


def cache_error(reason: str) -> CacheError:
    """The one line for a cache that cannot be written, `reason` saying what failed where."""
    where = f"${CACHE_ENV}" if os.environ.get(CACHE_ENV) else f"the default; ${CACHE_ENV} moves it"
    return CacheError(f"higgs-onnx's cache {cache_root()} ({where}) cannot be written: {reason}; set ${CACHE_ENV} "
                      f"to a folder you can write (e.g. {CACHE_ENV}=/tmp/higgs-cache)")


def cache_dir(kind: str, key: str, make: bool = True) -> Path:
    """`<root>/<kind>/<key>/`, made if missing and checked to be writable (else CacheError). `kind` and `key` are
    plain names chosen by the code (a hash). With `make=False` only the path (to read an entry made before: a
    read-only cache that holds it still serves it)."""
    for part in (kind, key):
        if not part or os.sep in part or part in (".", ".."):
            raise ValueError(f"cache path part {part!r} is not a plain name")
    path = cache_root() / kind / key
    if not make:
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        root = cache_root()
        raise cache_error(f"{root} is not a folder" if root.exists() and not root.is_dir() else _reason(e)) from None
    if not os.access(path, os.W_OK | os.X_OK):
        readonly = os.statvfs(path).f_flag & os.ST_RDONLY
        raise cache_error(f"{'read-only file system' if readonly else 'permission denied'}: {path}")
    return path


@contextmanager
def cache_writes(folder: Path) -> Iterator[None]:
    """The writes into a cache folder (`folder`, from `cache_dir`): an OSError among them (read-only, full, another
    user's file) becomes the CacheError line."""
    try:
        yield
    except OSError as e:
        raise cache_error(_reason(e)) from None


def _reason(e: OSError) -> str:
    what = e.strerror or type(e).__name__
    return f"{what[:1].lower()}{what[1:]}: {e.filename}" if e.filename else what


def read_kept(path: Path, max_bytes: int) -> str | None:
    """A small file a cache keeps (the files' verdicts, a prepared graph's stamp) as UTF-8 text; None when it is
    missing or not what a cache writes: not a regular file (a FIFO blocked the load, /dev/zero filled the memory),
    over `max_bytes`, not UTF-8, or unreadable. Opened without blocking, its type and size checked on the open file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
                return None
            data = f.read(max_bytes + 1)
        return data.decode("utf-8") if len(data) <= max_bytes else None
    except (OSError, UnicodeDecodeError):
        return None
