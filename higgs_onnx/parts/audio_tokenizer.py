"""Export part ``audio_tokenizer``: the codec DECODER, audio codes -> 24 kHz waveform.

Graph I/O (names are the ONNX input/output names):

- ``audio_codes``: int64 ``[batch, num_codebooks, frames]``, each code in ``[0, codebook_size)`` (the caller maps
  BOC/EOC to 0 before decoding).
- ``waveform``: float32 ``[batch, 1, hop * frames]`` at the codec sample rate; equal to
  ``HiggsAudioV2TokenizerModel.decode(audio_codes)``.

``batch`` and ``frames`` are dynamic axes. The module is a thin wrapper around transformers' own ``decode`` (RVQ
embedding sum -> ``fc2`` -> DAC decoder), which has no data-dependent Python branches: the only loop runs over
the (static) codebooks, and the DAC residual units' crop test is false for every length, so TorchScript tracing
(``torch.onnx.export(..., dynamo=False)``, opset 17) records a graph valid for any ``frames`` and ``batch``. The codec
always runs in fp32 (ConvTranspose is unstable in bf16).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import FACTS, BuildJob, olive
from .common import checkpoint_dir, facts

NAME = "audio_tokenizer"
INPUTS, OUTPUTS = list(FACTS[NAME].inputs), list(FACTS[NAME].outputs)
DUMMY_FRAMES = 10  # any count works; tests run others to prove the axis is dynamic


class AudioTokenizerDecoder(torch.nn.Module):
    """``forward(audio_codes [B, N, T] int64) -> waveform [B, 1, hop*T] float32`` (= ``codec.decode``)."""

    def __init__(self, codec: torch.nn.Module):
        super().__init__()
        self.codec = codec

    def forward(self, audio_codes: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(audio_codes, return_dict=False)


def load(model_path: str) -> torch.nn.Module:
    """The decoder of checkpoint folder ``model_path``, fp32, eval."""
    from ..reference.model import load_codec

    return AudioTokenizerDecoder(load_codec(checkpoint_dir(model_path))).eval()


def io_config(model_path: str) -> dict:
    """Olive ``PyTorchModel`` io_config: names, dummy shape/type, dynamic batch and frame axes."""
    f = facts(model_path)
    return {
        "input_names": list(INPUTS),
        "input_shapes": [[1, f.num_codebooks, DUMMY_FRAMES]],
        "input_types": ["int64"],
        "output_names": list(OUTPUTS),
        "dynamic_axes": {INPUTS[0]: {0: "batch", 2: "frames"}, OUTPUTS[0]: {0: "batch", 2: "samples"}},
    }


def dummy_inputs(model_path: str) -> tuple:
    """Positional tracing inputs: random valid codes ``[1, N, DUMMY_FRAMES]``."""
    f = facts(model_path)
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, f.codebook_size, (1, f.num_codebooks, DUMMY_FRAMES), generator=gen, dtype=torch.int64),)


BUILD_VERSION = olive.BUILD_VERSION


def build(job: BuildJob) -> Path:
    """Olive: conversion from the hooks above, then the precision's pass (see `parts.olive`)."""
    return olive.build(NAME, job)
