"""`text_embed`: token ids -> text embeddings (the checkpoint's text embedding table, a plain Gather).

    input_ids [B, L] int64 -> embeddings [B, L, D]
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import TEXT_EMBED
from . import FACTS, BuildJob, olive
from .common import facts, tensor

NAME = "text_embed"
INPUTS, OUTPUTS = list(FACTS[NAME].inputs), list(FACTS[NAME].outputs)


class TextEmbed(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Embedding.from_pretrained(weight, freeze=True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table(input_ids)


def load(model_path: str) -> torch.nn.Module:
    return TextEmbed(tensor(model_path, TEXT_EMBED)).eval()


def io_config(model_path: str) -> dict:
    return {"input_names": INPUTS, "output_names": OUTPUTS,
            "dynamic_axes": {"input_ids": {0: "batch", 1: "sequence"}, "embeddings": {0: "batch", 1: "sequence"}}}


def dummy_inputs(model_path: str) -> tuple:
    return (torch.arange(5, dtype=torch.int64).view(1, 5) % facts(model_path).vocab_size,)


BUILD_VERSION = olive.BUILD_VERSION


def build(job: BuildJob) -> Path:
    """Olive: conversion from the hooks above, then the precision's pass (see `parts.olive`). At fp16 the weights
    are loaded and exported in fp16 directly: the same rounding as a float16 pass, without an fp32 copy."""
    return olive.build(NAME, job, fp16_in_torch=True)
