"""`audio_heads`: hidden states -> per-codebook logits through the tied fused audio matrix (spec §4).

    hidden_states [B, L, D] -> logits [B, L, N, V]
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import AUDIO_EMBED
from . import FACTS, BuildJob, olive
from .common import facts, tensor

NAME = "audio_heads"
INPUTS, OUTPUTS = list(FACTS[NAME].inputs), list(FACTS[NAME].outputs)


class AudioHeads(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, num_codebooks: int, codebook_vocab: int):
        super().__init__()
        self.proj = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        self.proj.weight.data.copy_(weight)
        self.shape = (num_codebooks, codebook_vocab)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden_states).unflatten(-1, self.shape)


def load(model_path: str) -> torch.nn.Module:
    f = facts(model_path)
    return AudioHeads(tensor(model_path, AUDIO_EMBED), f.num_codebooks, f.codebook_vocab).eval()


def io_config(model_path: str) -> dict:
    return {"input_names": INPUTS, "output_names": OUTPUTS,
            "dynamic_axes": {"hidden_states": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}}


def dummy_inputs(model_path: str) -> tuple:
    return (torch.randn(1, 3, facts(model_path).hidden, generator=torch.Generator().manual_seed(0)),)


BUILD_VERSION = olive.BUILD_VERSION


def build(job: BuildJob) -> Path:
    """Olive: conversion from the hooks above, then the precision's pass (see `parts.olive`). At fp16 the weights
    are loaded and exported in fp16 directly: the same rounding as a float16 pass, without an fp32 copy."""
    return olive.build(NAME, job, fp16_in_torch=True)
