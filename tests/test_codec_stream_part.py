"""Stateful streaming codec decoder (`audio_tokenizer_stream`): new frames + per-layer states -> new samples.

Every frame is decoded once, and the concatenated stream equals the one-shot `codec.decode` up to fp32 noise. On the
tiny codec fp32 itself is good to only ~1e-4 of the output's peak (see tests/test_codec_parts.py): measured over 9
random inputs of 7..200 frames, one-shot fp32 vs fp64 4e-5..1.2e-4, stream vs fp64 4e-5..1.4e-4, stream vs one-shot
fp32 2e-5..1.2e-4 (2e-5..7.4e-5 for the inputs below). Two fp32 paths may each sit that far from fp64, so the bound
is 2e-4 of the peak; a wrong delay, state or mask gives errors of the order of the peak.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from higgs_onnx.checkpoint import load_facts
from higgs_onnx.generation.codec_stream import END_UNKNOWN, StatefulCodecStream, StreamOptions
from higgs_onnx.generation.delay import codes_for_codec
from higgs_onnx.parts import audio_tokenizer_stream as part
from higgs_onnx.runtime.session import Part

pytestmark = pytest.mark.slow  # exports a graph
REL = 2e-4  # of the peak, see the module docstring


@pytest.fixture(scope="module")
def model(tiny_ckpt: Path) -> part.StreamingDecoder:
    return part.load(str(tiny_ckpt))


@pytest.fixture(scope="module")
def exported(model, tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Part:
    """The graph as the exporter makes it (TorchScript, opset 17, dynamic axes, metadata), in onnxruntime."""
    io, path = part.io_config(str(tiny_ckpt)), tmp_path_factory.mktemp("stream") / f"{part.NAME}.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarning of the (static) codebook loop, legacy-exporter notice
        torch.onnx.export(model, part.dummy_inputs(str(tiny_ckpt)), str(path), dynamo=False, opset_version=17,
                          external_data=False, input_names=io["input_names"], output_names=io["output_names"],
                          dynamic_axes=io["dynamic_axes"])
    part.write_metadata(path, part.metadata(model))
    return Part(part.NAME, path)


def _one_shot(model, codes: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.codec.decode(torch.from_numpy(codes), return_dict=False)[:, 0].numpy()


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / np.abs(want).max())


def _pieces(total: int, pattern: list[int]) -> list[int]:
    """`pattern` repeated until it covers `total` frames (the last piece cut to fit)."""
    out: list[int] = []
    while sum(out) < total:
        out.append(min(pattern[len(out) % len(pattern)], total - sum(out)))
    return out


@pytest.mark.parametrize("pieces", [[45], [1] * 45, [3, 17, 1, 19, 5]])
def test_torch_stream_equals_one_shot(model, tiny_ckpt: Path, pieces: list[int]):
    f = load_facts(tiny_ckpt)
    total, lag = sum(pieces), math.ceil(model.delay / model.hop)
    codes = np.random.default_rng(0).integers(0, f.codebook_size, (1, f.num_codebooks, total))
    states, out, at = [torch.zeros(1, c, s) for c, s in model.state_shapes], [], 0
    with torch.no_grad():
        for n, end in [(n, END_UNKNOWN) for n in pieces] + [(lag, total)]:  # the flush: lag dummy frames
            chunk = torch.from_numpy(codes[..., at:at + n]) if at < total else torch.zeros(1, f.num_codebooks, n,
                                                                                             dtype=torch.int64)
            wav, *states = model(chunk, torch.tensor([at]), torch.tensor([end]), *states)
            assert wav.shape == (1, 1, n * model.hop)
            out.append(wav[0, 0].numpy())
            at += n
    got = np.concatenate(out)[model.delay:model.delay + total * model.hop]
    rel = _rel(got, _one_shot(model, codes)[0])
    print(f"torch stream {pieces[:5]}: max abs diff {rel:.2e} of the peak")
    assert rel <= REL


def test_io_names_shapes_and_metadata(exported, model, tiny_ckpt: Path):
    f, sess = load_facts(tiny_ckpt), exported.session
    ins = {i.name: i.shape for i in sess.get_inputs()}
    k = len(model.state_shapes)
    assert list(ins) == ["audio_codes", "start", "end"] + [f"state_in.{i}" for i in range(k)]
    assert [o.name for o in sess.get_outputs()] == ["waveform"] + [f"state_out.{i}" for i in range(k)]
    assert ins["audio_codes"] == ["batch", f.num_codebooks, "frames"] and ins["start"] == ins["end"] == ["batch"]
    assert all(ins[f"state_in.{i}"] == ["batch", c, s] for i, (c, s) in enumerate(model.state_shapes))
    meta = sess.get_modelmeta().custom_metadata_map
    assert meta == {"delay_samples": str(model.delay), "hop": str(f.hop)} and model.hop == f.hop
    # conv1 k7, then per block: delay * stride + ceil(stride / 2) + 3 * (1 + 3 + 9), then conv2 k7
    delay = 3
    for r in model.codec.config.acoustic_model_config.upsampling_ratios:
        delay = delay * r + math.ceil(r / 2) + 39
    assert model.delay == delay + 3


@pytest.mark.parametrize("frames", [1, 2, 7, 60])
@pytest.mark.parametrize("pattern, options", [([1], StreamOptions()), ([1], StreamOptions(1, 1)),
                                              ([3, 17, 1, 30], StreamOptions(3, 7)), ([1000], StreamOptions())])
def test_onnx_stream_equals_one_shot(exported, model, tiny_ckpt: Path, frames: int, pattern: list[int],
                                     options: StreamOptions):
    f = load_facts(tiny_ckpt)
    raw = np.random.default_rng(frames).integers(0, f.codebook_size, (frames, f.num_codebooks))
    raw[-1, 3], raw[0, 1] = f.eoc, f.boc  # leftover special codes: mapped to 0 like the one-shot path does
    want = _one_shot(model, codes_for_codec(raw, f.codebook_size))[0]
    stream, chunks, at = StatefulCodecStream(exported, f.hop, f.codebook_size, options), [], 0
    for n in _pieces(frames, pattern):
        got = stream.push(raw[at:at + n])
        at += n
        assert stream.emitted == (0 if at < options.first_frames + stream.lag else  # a chunk as soon as possible
                                  options.first_frames + (at - options.first_frames - stream.lag)
                                  // options.chunk_frames * options.chunk_frames)
        chunks += got
    chunks.append(stream.flush())
    rel = _rel(np.concatenate(chunks), want)
    print(f"onnx stream T={frames} {pattern} {options.first_frames}/{options.chunk_frames}: max abs diff {rel:.2e}")
    assert rel <= REL
    sizes = [c.size // f.hop for c in chunks[:-1]]
    assert sizes[:1] in ([], [options.first_frames]) and all(s == options.chunk_frames for s in sizes[1:])
    assert all(c.size % f.hop == 0 for c in chunks)
    assert stream.emitted == frames and stream.flush().size == 0


def test_batch_rows_are_independent(exported, model, tiny_ckpt: Path):
    """Two rows at different starts and ends in one call give each row's own single-row result; row 0's end falls
    inside the call (its last frames are masked), row 1's is unknown."""
    f, sess = load_facts(tiny_ckpt), exported.session
    rng = np.random.default_rng(3)
    codes = rng.integers(0, f.codebook_size, (2, f.num_codebooks, 12))

    def run(c: np.ndarray, start: list[int], end: list[int], states: list[np.ndarray]) -> list[np.ndarray]:
        feeds = {"audio_codes": c, "start": np.array(start), "end": np.array(end)}
        return sess.run(None, feeds | {f"state_in.{i}": s for i, s in enumerate(states)})

    zeros = [np.zeros((1, c, s), np.float32) for c, s in model.state_shapes]
    _, *warm = run(rng.integers(0, f.codebook_size, (1, f.num_codebooks, 5)), [0], [END_UNKNOWN], zeros)
    both = run(codes, [0, 5], [9, END_UNKNOWN], [np.concatenate(p) for p in zip(zeros, warm, strict=True)])
    rows = [run(codes[:1], [0], [9], zeros), run(codes[1:], [5], [END_UNKNOWN], warm)]
    for r, single in enumerate(rows):
        for got, want in zip(both, single, strict=True):
            np.testing.assert_allclose(got[r], want[0], rtol=0, atol=REL * np.abs(want).max())
    assert not np.allclose(rows[0][0], run(codes[:1], [0], [END_UNKNOWN], zeros)[0])  # the end mask mattered


class _Counting:
    """A `Part` stand-in that counts the frames it decodes."""

    def __init__(self, inner: Part):
        self.inner, self.session, self.name, self.frames = inner, inner.session, inner.name, 0

    def __call__(self, **feeds: np.ndarray) -> dict[str, np.ndarray]:
        self.frames += feeds["audio_codes"].shape[2]
        return self.inner(**feeds)


@pytest.mark.parametrize("pieces", [[1] * 50, [8, 25, 17], [50]])
def test_each_frame_is_decoded_once(exported, model, tiny_ckpt: Path, pieces: list[int]):
    f, counting = load_facts(tiny_ckpt), _Counting(exported)
    raw = np.random.default_rng(5).integers(0, f.codebook_size, (sum(pieces), f.num_codebooks))
    stream, at = StatefulCodecStream(counting, f.hop, f.codebook_size), 0
    for n in pieces:
        stream.push(raw[at:at + n])
        at += n
    stream.flush()
    assert stream.lag == math.ceil(model.delay / f.hop)
    assert counting.frames == sum(pieces) + stream.lag  # only the flush's dummy frames come on top
    with pytest.raises(RuntimeError, match="flushed"):
        stream.push(raw[:1])
