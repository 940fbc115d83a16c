"""Export part ``audio_encoder``: the codec ENCODER, 24 kHz mono waveform of any length -> audio codes.

Graph I/O (names are the ONNX input/output names):

- ``waveform``: float32 ``[batch, samples]``, mono at the codec sample rate (24 kHz), any ``samples`` of at least
  one second (the runtime pads shorter clips).
- ``audio_codes``: int64 ``[batch, num_codebooks, frames]``; identical to
  ``HiggsAudioV2TokenizerModel.encode(waveform[:, None])``.

``batch`` and ``samples`` are dynamic axes. Exported with TorchScript tracing (``torch.onnx.export(..., dynamo=False)``,
opset 17): every step below is either shape-agnostic or computed with traced tensor arithmetic on the input shape,
so nothing length-dependent is frozen at trace time and no ONNX control flow (``If``/``Loop``) is needed.

What ``encode`` does and how each step is kept length-robust inside the graph:

1. Semantic branch. ``torchaudio.functional.resample(x, 24000, 16000)`` is re-done in the graph with the same
   polyphase windowed-sinc math as :mod:`higgs_onnx.reference.resample`: the ``[new, 1, 2*width + orig]`` kernel
   bank is computed once at load (fp32, torchaudio's rounding) and stored as a buffer; the graph pads, runs one
   strided ``Conv``, interleaves the phases and slices to ``ceil(new * samples / orig)``, a length computed from
   ``_shape_as_tensor(waveform)`` so it follows the runtime length. Then the fixed 160-sample pad transformers
   applies, HuBERT (all hidden states averaged), the ``[:, ::semantic_downsample_factor]`` subsampling and the
   semantic encoder give ``e_semantic`` with ``T_sem`` frames (read back as a shape tensor).
2. Acoustic branch. transformers compares the acoustic encoder's frame count for ``samples`` (the closed-form
   conv output length) with ``T_sem`` and, in a Python ``if``, re-runs the acoustic encoder on the waveform
   zero-padded by ``hop // 2`` on both sides when they differ. A trace would freeze that branch (an earlier export
   only worked for multiples of the hop). Here the same conv-length formula is evaluated in the graph from the
   acoustic encoder's own ``Conv1d`` layers (read at load, in module order), the mismatch becomes a 0/1 tensor,
   and the encoder runs ONCE on ``pad(waveform, (p, p))`` with ``p = (frames != T_sem) * (hop // 2)`` a traced
   tensor (ONNX ``Pad`` takes its pads as a runtime input). That is exactly the input transformers picks, so no
   second acoustic pass and no select/slice are needed.
3. ``fc`` on the concatenated features, then the residual vector quantizer, all of transformers' own code: the
   nearest code is ``argmax(-(|x|^2 - 2 x.e + |e|^2))`` with the same formula (ONNX ``ArgMax``, int64), so codes
   are identical unless two codes tie within float noise; the tests check odd lengths and real recordings.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..reference.resample import sinc_kernel
from . import FACTS, BuildJob, olive
from .common import checkpoint_dir, facts

NAME = "audio_encoder"
INPUTS, OUTPUTS = list(FACTS[NAME].inputs), list(FACTS[NAME].outputs)
DUMMY_SECONDS = 1.37  # odd length (not a multiple of the hop) so no frame arithmetic could pass by accident
SEMANTIC_PAD = 160  # transformers' _extract_semantic_features pads the 16 kHz wave by this constant on both sides
# torchaudio.functional.resample defaults, which transformers uses
LOWPASS_FILTER_WIDTH, ROLLOFF, RESAMPLING_METHOD = 6, 0.99, "sinc_interp_hann"


def _frames(n: torch.Tensor, convs: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """Output length of a chain of Conv1d (kernel, stride, padding, dilation) for an input of ``n`` samples."""
    for kernel, stride, padding, dilation in convs:
        n = (n + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    return n


class AudioCodecEncoder(torch.nn.Module):
    """``forward(waveform [B, L] float32) -> audio_codes [B, N, T] int64`` (= ``codec.encode(waveform[:, None])``)."""

    def __init__(self, codec: torch.nn.Module):
        super().__init__()
        cfg = codec.config
        self.codec = codec
        self.pad = int(codec.pad)  # hop // 2
        self.downsample = int(cfg.semantic_downsample_factor)
        self.bandwidth = cfg.target_bandwidths[-1]  # encode()'s default
        # convs whose output length transformers' _get_conv1d_output_lengths chains (nn.Module.modules() order)
        self.acoustic_convs = [(m.kernel_size[0], m.stride[0], m.padding[0], m.dilation[0])
                               for m in codec.acoustic_encoder.modules() if isinstance(m, torch.nn.Conv1d)]
        sr, ssr = int(cfg.sample_rate), int(cfg.semantic_sample_rate)
        self.resample_on = sr != ssr
        g = math.gcd(sr, ssr)
        self.orig, self.new = sr // g, ssr // g
        kernel, self.width = (sinc_kernel(self.orig, self.new, LOWPASS_FILTER_WIDTH, ROLLOFF, RESAMPLING_METHOD,
                                           None, torch.float32, torch.device("cpu"))
                              if self.resample_on else (torch.zeros(0), 0))
        self.register_buffer("resample_kernel", kernel, persistent=False)

    def resample(self, wav: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """[B, L] -> [B, ceil(new * L / orig)], torchaudio's resample with a traced output length."""
        if not self.resample_on:
            return wav
        padded = F.pad(wav, (self.width, self.width + self.orig))
        out = F.conv1d(padded[:, None], self.resample_kernel, stride=self.orig)  # [B, new (phase), frames]
        out = out.transpose(1, 2).reshape(wav.shape[0], -1)  # interleave phases -> time
        return out[:, :(self.new * n + self.orig - 1) // self.orig]

    def semantic_features(self, wav: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """transformers' ``_extract_semantic_features`` with the in-graph resample: [B, L] -> [B, T_sem, C]."""
        x = F.pad(self.resample(wav, n), (SEMANTIC_PAD, SEMANTIC_PAD))
        hidden = self.codec.semantic_model(x, output_hidden_states=True).hidden_states
        feats = torch.stack(list(hidden), dim=1).mean(dim=1)
        if self.downsample > 1:
            feats = feats[:, ::self.downsample, :]
        return feats

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        codec = self.codec
        n = torch._shape_as_tensor(waveform)[1]  # traced length, int64 scalar
        e_semantic = codec.encoder_semantic(self.semantic_features(waveform, n).transpose(1, 2))
        t_sem = torch._shape_as_tensor(e_semantic)[2]
        # encode()'s Python branch as data: pad by hop/2 on both sides iff the unpadded frame count misses T_sem
        p = (_frames(n, self.acoustic_convs) != t_sem).to(torch.int64) * self.pad
        e_acoustic = codec.acoustic_encoder(F.pad(waveform[:, None], (p, p)))
        embeddings = torch.cat([e_acoustic, e_semantic], dim=1)
        embeddings = codec.fc(embeddings.transpose(1, 2)).transpose(1, 2)
        codes = codec.quantizer.encode(embeddings, self.bandwidth)  # [N, B, T]
        return codes.transpose(0, 1)


def load(model_path: str) -> torch.nn.Module:
    """The encoder of checkpoint folder ``model_path``, fp32, eval."""
    from ..reference.model import load_codec

    return AudioCodecEncoder(load_codec(checkpoint_dir(model_path))).eval()


def io_config(model_path: str) -> dict:
    """Olive ``PyTorchModel`` io_config: names, dummy shape/type, dynamic batch and sample axes."""
    return {
        "input_names": list(INPUTS),
        "input_shapes": [list(dummy_inputs(model_path)[0].shape)],
        "input_types": ["float32"],
        "output_names": list(OUTPUTS),
        "dynamic_axes": {INPUTS[0]: {0: "batch", 1: "samples"}, OUTPUTS[0]: {0: "batch", 2: "frames"}},
    }


def dummy_inputs(model_path: str) -> tuple:
    """Positional tracing inputs: ``[1, round(DUMMY_SECONDS * sample_rate)]`` of quiet noise (an odd length)."""
    f = facts(model_path)
    gen = torch.Generator().manual_seed(0)
    return (0.1 * torch.randn(1, round(DUMMY_SECONDS * f.sample_rate), generator=gen),)


BUILD_VERSION = olive.BUILD_VERSION


def build(job: BuildJob) -> Path:
    """Olive: conversion from the hooks above, then the precision's pass (see `parts.olive`)."""
    return olive.build(NAME, job)
