"""An export folder of any layout this runtime runs, opened as a `Manifest`: ours (`manifest.load_manifest`: the
schema, its digest and the files' hashes checked) or another Higgs ONNX export of this model (`foreign.adopt`: the
community layout, its manifest derived into our cache). Every door that takes `--model-path` opens it here.

    manifest = load_export("onnx/cpu_int4")          # or a community folder; hf:// references are resolved first
"""

from __future__ import annotations

import os
from pathlib import Path

from .foreign import adopt, is_foreign
from .manifest import Manifest, load_manifest


def load_export(folder: str | os.PathLike, verify: bool = True) -> Manifest:
    """The folder's manifest: ours, or one derived for a community-layout export; `verify` checks every file's
    sha256."""
    path = Path(folder)
    if path.is_dir() and is_foreign(path):
        return adopt(path, verify)
    return load_manifest(path, verify=verify)
