"""`audio_embed`: one frame of 8 codebook codes -> the sum of their rows of the fused audio matrix (spec §4).

    audio_codes [B, L, N] int64 (values in [0, V), BOC/EOC included) -> embeddings [B, L, D]
The per-codebook row offset (c * V) is a constant inside the graph. The 8 rows are summed in float32 whatever the
table's dtype (an fp16 table gives fp32 embeddings): the step graph (`llm_step`) sums them so too, since ONNX
Runtime drops a cast pair around the sum there, and the two paths must give the same codes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import AUDIO_EMBED
from . import FACTS, BuildJob, olive
from .common import facts, tensor

NAME = "audio_embed"
INPUTS, OUTPUTS = list(FACTS[NAME].inputs), list(FACTS[NAME].outputs)


class AudioEmbed(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, num_codebooks: int, codebook_vocab: int):
        super().__init__()
        self.table = torch.nn.Embedding.from_pretrained(weight, freeze=True)
        self.register_buffer("offsets", torch.arange(num_codebooks, dtype=torch.int64) * codebook_vocab,
                             persistent=False)

    def forward(self, audio_codes: torch.Tensor) -> torch.Tensor:
        return self.table(audio_codes + self.offsets).float().sum(dim=-2)


def load(model_path: str) -> torch.nn.Module:
    f = facts(model_path)
    return AudioEmbed(tensor(model_path, AUDIO_EMBED), f.num_codebooks, f.codebook_vocab).eval()


def io_config(model_path: str) -> dict:
    return {"input_names": INPUTS, "output_names": OUTPUTS,
            "dynamic_axes": {"audio_codes": {0: "batch", 1: "sequence"}, "embeddings": {0: "batch", 1: "sequence"}}}


def dummy_inputs(model_path: str) -> tuple:
    f = facts(model_path)
    return (torch.arange(3 * f.num_codebooks, dtype=torch.int64).view(1, 3, f.num_codebooks) * 37 % f.codebook_vocab,)


BUILD_VERSION = f"{olive.BUILD_VERSION}.1"  # .1: float32 sum and output


def build(job: BuildJob) -> Path:
    """Olive: conversion from the hooks above, then the precision's pass (see `parts.olive`). At fp16 the weights
    are loaded and exported in fp16 directly: the same rounding as a float16 pass, without an fp32 copy."""
    return olive.build(NAME, job, fp16_in_torch=True)
