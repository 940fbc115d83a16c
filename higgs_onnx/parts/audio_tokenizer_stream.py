"""Export part ``audio_tokenizer_stream``: the codec DECODER as a stateful stream, new code frames -> new samples.

The codec decoder (RVQ embedding sum -> ``fc2`` -> DAC decoder) is not causal: every conv pads ``p`` zeros on both
sides, so output ``t`` needs input ``t + p``. Here every layer runs *delayed* instead: a conv keeps its last ``2p``
inputs as state and runs unpadded over ``concat(state, new)``, which gives exactly one output per new input: the
original outputs, ``p`` positions late. A ConvTranspose (kernel ``2r``, stride ``r``) keeps its last input; of the
unpadded transposed conv over ``concat(last, new)`` the middle ``r * new`` outputs are complete, the original ones
``padding`` samples late (``output_padding = 2 * padding - r`` makes the original length exactly ``r * L``). A
residual unit keeps ``2p`` inputs of its dilated conv, and its skip reads the same buffer ``p`` positions late.
Pointwise ops (Snake, k1 convs, ``fc2``, the codebook sums) need no state. Zero padding is reproduced by masking:
each conv input's position in original coordinates follows from ``start`` and the layer's delay, and positions
``< 0`` or ``>= end * rate`` are set to 0 before the conv (Snake(0) = 0), so the result does not depend on the
initial state (zeros by convention) and the stream is exact at both ends. The delays add up to ``delay_samples``
at the output rate (9458 samples, 9.85 frames, for the real codec): the caller drops that many samples at the start
and, at the end, pushes ``ceil(delay / hop)`` dummy frames with ``end`` = the true frame count (see
`generation.codec_stream.StatefulCodecStream`). Every frame is decoded once: the total work is one one-shot decode.

Graph I/O (names are the ONNX input/output names):

- ``audio_codes``: int64 ``[batch, num_codebooks, frames]``, the new frames, codes in ``[0, codebook_size)``.
- ``start``: int64 ``[batch]``, frames pushed before this call; ``end``: int64 ``[batch]``, the utterance's frame
  count, or any larger value (e.g. ``2**62``) while it is unknown.
- ``state_in.{i}`` / ``state_out.{i}``: float32 ``[batch, C_i, S_i]``, i = 0..K-1 (22 for the 5-block DAC decoder),
  all zeros at ``start`` = 0.
- ``waveform``: float32 ``[batch, 1, hop * frames]``: original samples ``[start * hop - delay, ...)``.

Model metadata (``metadata_props``, ``session.get_modelmeta().custom_metadata_map``): ``delay_samples``, ``hop``.
``batch`` and ``frames`` are dynamic; every width, kernel and stride is read from the loaded codec. Positions are
computed with ``end`` clamped to ``start + frames`` first, so ``end * rate`` cannot overflow int64.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..generation.codec_stream import END_UNKNOWN
from . import FACTS, BuildJob, olive
from .common import checkpoint_dir, facts

NAME = "audio_tokenizer_stream"
INPUTS, OUTPUTS = list(FACTS[NAME].inputs), list(FACTS[NAME].outputs)  # + state_in/out.{k}
STATE_IN, STATE_OUT = "state_in.{}", "state_out.{}"
DUMMY_FRAMES = 10  # any count works; tests run others to prove the axis is dynamic


class StreamingDecoder(torch.nn.Module):
    """``forward(audio_codes, start, end, *states) -> (waveform, *states)``; see the module docstring.

    Attributes from the codec: ``hop`` (samples per frame), ``delay`` (samples the output lags the original by),
    ``state_shapes`` (``(channels, length)`` per state, in input order).
    """

    def __init__(self, codec: torch.nn.Module):
        super().__init__()
        self.codec = codec
        dec = codec.acoustic_decoder
        self.state_shapes: list[tuple[int, int]] = []
        rate, delay = 1, 0  # samples per frame and lag (in those samples) of the current layer's input
        self.conv1, delay = self._conv_plan(dec.conv1, rate, delay)
        self.blocks: list[tuple[tuple[int, int, int], list[tuple[int, int, int]]]] = []  # convT plan, unit plans
        for block in dec.block:
            m = block.conv_t1
            r, k, pad, out_pad = m.stride[0], m.kernel_size[0], m.padding[0], m.output_padding[0]
            if k != 2 * r or out_pad != 2 * pad - r or m.dilation[0] != 1 or m.groups != 1:
                raise ValueError(f"unsupported ConvTranspose1d geometry: k={k} stride={r} padding={pad} "
                                 f"output_padding={out_pad}")
            up = (len(self.state_shapes), rate, delay)
            self.state_shapes.append((m.in_channels, 1))
            rate, delay = rate * r, delay * r + pad
            units = []
            for unit in (block.res_unit1, block.res_unit2, block.res_unit3):
                if unit.conv2.kernel_size[0] != 1:
                    raise ValueError("residual unit's second conv must be pointwise")
                plan, delay = self._conv_plan(unit.conv1, rate, delay)
                units.append(plan)
            self.blocks.append((up, units))
        self.conv2, delay = self._conv_plan(dec.conv2, rate, delay)
        self.hop, self.delay = rate, delay

    def _conv_plan(self, m: torch.nn.Conv1d, rate: int, delay: int) -> tuple[tuple[int, int, int], int]:
        """Register the state of stride-1 conv ``m``; returns ``(state index, rate, input delay)`` and the new delay."""
        k, dil, pad = m.kernel_size[0], m.dilation[0], m.padding[0]
        if m.stride[0] != 1 or m.groups != 1 or 2 * pad != dil * (k - 1) or m.padding_mode != "zeros":
            raise ValueError(f"unsupported Conv1d geometry: k={k} dilation={dil} padding={pad} stride={m.stride}")
        self.state_shapes.append((m.in_channels, 2 * pad))
        return (len(self.state_shapes) - 1, rate, delay), delay + pad

    @staticmethod
    def _window(state: torch.Tensor, x: torch.Tensor, start: torch.Tensor, end: torch.Tensor, rate: int,
                delay: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``concat(state, x)`` and its validity mask ``[B, 1, L]`` (``x[..., 0]`` is at original position
        ``start * rate - delay``)."""
        buf = torch.cat([state, x], -1)
        pos = (start[:, None] * rate - (delay + state.shape[-1])) + torch.arange(buf.shape[-1])[None]
        return buf, ((pos >= 0) & (pos < end[:, None] * rate))[:, None]

    def forward(self, audio_codes: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                *states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        codec, dec = self.codec, self.codec.acoustic_decoder
        end = torch.minimum(end, start + audio_codes.shape[2])  # no overflow of end * rate; same mask
        new: list[torch.Tensor] = [torch.empty(0)] * len(states)

        def conv(m: torch.nn.Conv1d, plan: tuple[int, int, int], x: torch.Tensor,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            """The buffer ``concat(state, x)`` and the valid conv of its masked activation (one output per x)."""
            i, rate, delay = plan
            buf, valid = self._window(states[i], x, start, end, rate, delay)
            new[i] = buf[..., buf.shape[-1] - states[i].shape[-1]:]
            h = act(buf).masked_fill(~valid, 0.0)
            return buf, F.conv1d(h, m.weight, m.bias, dilation=m.dilation)

        x = codec.quantizer.decode(audio_codes.transpose(0, 1))
        x = codec.fc2(x.transpose(1, 2)).transpose(1, 2)
        _, x = conv(dec.conv1, self.conv1, x, lambda h: h)
        for block, ((i, rate, delay), units) in zip(dec.block, self.blocks, strict=True):
            buf, valid = self._window(states[i], x, start, end, rate, delay)
            new[i] = buf[..., buf.shape[-1] - 1:]
            h = block.snake1(buf).masked_fill(~valid, 0.0)
            m = block.conv_t1
            r = m.stride[0]
            x = F.conv_transpose1d(h, m.weight, m.bias, stride=r)[..., r:-r]  # the complete outputs
            for unit, plan in zip((block.res_unit1, block.res_unit2, block.res_unit3), units, strict=True):
                buf, h = conv(unit.conv1, plan, x, unit.snake1)
                pad = unit.conv1.padding[0]  # the skip: x delayed like the conv branch
                x = buf[..., pad:buf.shape[-1] - pad] + unit.conv2(unit.snake2(h))
        _, x = conv(dec.conv2, self.conv2, x, dec.snake1)
        return (dec.tanh(x), *new)


def metadata(model: StreamingDecoder) -> dict[str, str]:
    """The graph's ``metadata_props``: what the runtime needs without torch."""
    return {"delay_samples": str(model.delay), "hop": str(model.hop)}


def write_metadata(path: Path, props: dict[str, str]) -> None:
    """Set ``props`` in the ONNX file's metadata_props in place (its external data file is not touched)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False)
    kept = [p for p in graph.metadata_props if p.key not in props]
    del graph.metadata_props[:]
    graph.metadata_props.extend(kept + [onnx.StringStringEntryProto(key=k, value=v) for k, v in props.items()])
    onnx.save(graph, str(path))


def load(model_path: str) -> StreamingDecoder:
    """The streaming decoder of checkpoint folder ``model_path``, fp32, eval."""
    from ..reference.model import load_codec

    return StreamingDecoder(load_codec(checkpoint_dir(model_path))).eval()


def _meta_codec(model_path: str) -> torch.nn.Module:
    """The codec of ``model_path`` without weights (meta device): its geometry alone, in milliseconds."""
    from transformers import HiggsAudioV2TokenizerConfig

    from ..checkpoint import codec_config
    from ..reference.model import codec_kwargs
    from ..reference.torchaudio_shim import load_codec_class

    cfg = HiggsAudioV2TokenizerConfig(**codec_kwargs(codec_config(checkpoint_dir(model_path))))
    with torch.device("meta"):
        return load_codec_class()(cfg)


def _state_shapes(model_path: str) -> list[tuple[int, int]]:
    """The ``(channels, length)`` of each state, in input order."""
    return StreamingDecoder(_meta_codec(model_path)).state_shapes


def io_config(model_path: str) -> dict:
    """Olive ``PyTorchModel`` io_config: names, dummy shapes/types, dynamic batch and frame axes."""
    f, shapes = facts(model_path), _state_shapes(model_path)
    ins = INPUTS + [STATE_IN.format(i) for i in range(len(shapes))]
    outs = OUTPUTS + [STATE_OUT.format(i) for i in range(len(shapes))]
    axes = {name: {0: "batch"} for name in ins[1:] + outs[1:]}
    return {
        "input_names": ins,
        "input_shapes": [[1, f.num_codebooks, DUMMY_FRAMES], [1], [1]] + [[1, c, s] for c, s in shapes],
        "input_types": ["int64", "int64", "int64"] + ["float32"] * len(shapes),
        "output_names": outs,
        "dynamic_axes": axes | {"audio_codes": {0: "batch", 2: "frames"}, "waveform": {0: "batch", 2: "samples"}},
    }


def dummy_inputs(model_path: str) -> tuple:
    """Positional tracing inputs: random valid codes ``[1, N, DUMMY_FRAMES]``, a mid-stream start, an unknown end,
    random states."""
    f = facts(model_path)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, f.codebook_size, (1, f.num_codebooks, DUMMY_FRAMES), generator=gen, dtype=torch.int64)
    states = tuple(torch.randn(1, c, s, generator=gen) for c, s in _state_shapes(model_path))
    return (codes, torch.tensor([3]), torch.tensor([END_UNKNOWN]), *states)


BUILD_VERSION = olive.BUILD_VERSION


def build(job: BuildJob) -> Path:
    """Olive: conversion from the hooks above, then the precision's pass (see `parts.olive`); then the metadata."""
    path = olive.build(NAME, job)
    model = StreamingDecoder(_meta_codec(str(job.ckpt)))
    write_metadata(path, metadata(model))
    return path
