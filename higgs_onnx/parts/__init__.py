"""One module per exported part, all of the same shape: `NAME`, `INPUTS`, `OUTPUTS`, `load(model_path)`,
`io_config(model_path)`, `dummy_inputs(model_path)` (Olive-built parts) or `build(...)` (the ModelBuilder decoder).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..manifest import PART_NAMES


def module(name: str) -> ModuleType:
    if name not in PART_NAMES:
        raise ValueError(f"unknown part {name!r}; parts: {', '.join(PART_NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")
