"""Helpers shared by the Olive-built parts: checkpoint tensors as fp32 torch tensors, dims from the checkpoint."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=4)
def facts(model_path: str):
    from ..checkpoint import load_facts

    return load_facts(Path(model_path))


def tensor(model_path: str, name: str) -> torch.Tensor:
    """One checkpoint tensor, upcast to fp32 (the export precision is applied by the Olive passes)."""
    from safetensors import safe_open

    from ..checkpoint import WEIGHTS

    with safe_open(Path(model_path) / WEIGHTS, "pt") as f:
        return f.get_tensor(name).float()
