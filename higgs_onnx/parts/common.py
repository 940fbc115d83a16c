"""Helpers shared by the Olive-built parts: checkpoint tensors as fp32 torch tensors, dims from the checkpoint.

Olive identifies an input model by hashing every file under its `model_path` (9.3 GB for the real checkpoint, once
per part: 232 s of a 576 s 4b build). `parts.olive` therefore hands Olive a small source folder holding only
`SOURCE_FILE`, which names the checkpoint and its digest; `checkpoint_dir` follows it (a checkpoint folder given
directly works too).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

SOURCE_FILE = "higgs_source.json"


def write_source(folder: Path, ckpt: Path, digest: str, dtype: str = "float32") -> Path:
    """A folder Olive can hash in microseconds that stands for checkpoint `ckpt` (identified by `digest`), with the
    dtype the part's weights are loaded in (`tensor`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SOURCE_FILE).write_text(json.dumps({"checkpoint": str(Path(ckpt).resolve()), "digest": digest,
                                                  "dtype": dtype}))
    return folder


def _source(model_path: str | Path) -> dict:
    path = Path(model_path)
    if (path / SOURCE_FILE).is_file():
        return json.loads((path / SOURCE_FILE).read_text())
    return {"checkpoint": str(path), "dtype": "float32"}


def checkpoint_dir(model_path: str | Path) -> Path:
    return Path(_source(model_path)["checkpoint"])


@lru_cache(maxsize=4)
def facts(model_path: str):
    from ..checkpoint import load_facts

    return load_facts(checkpoint_dir(model_path))


def tensor(model_path: str, name: str) -> torch.Tensor:
    """One checkpoint tensor in the source's dtype: float32 (the Olive passes apply the export precision), or
    float16 for an fp16 table/matrix exported as such (see `parts.olive`)."""
    from safetensors import safe_open

    from ..checkpoint import WEIGHTS

    with safe_open(checkpoint_dir(model_path) / WEIGHTS, "pt") as f:
        return f.get_tensor(name).to(getattr(torch, _source(model_path)["dtype"]))
