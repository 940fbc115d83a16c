"""The PyTorch reference on the tiny checkpoint: codec shapes, deterministic generation, self-stopping."""

from pathlib import Path

import numpy as np
import pytest
import torch

from higgs_onnx.audio import load_reference
from higgs_onnx.generation.sampling import GREEDY, SamplingOptions

DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("length", [960, 24000, 24001, 24959, 30000, 48961])
def test_codec_encode_decode_shapes(reference, length):
    wav = (np.random.default_rng(length).standard_normal(length) * 0.1).astype(np.float32)
    codes = reference.encode_audio(wav)
    assert codes.shape[1] == 8 and abs(codes.shape[0] - length / 960) <= 1.5
    assert codes.min() >= 0 and codes.max() < 1024
    audio = reference.decode_audio(np.ascontiguousarray(codes.T[None]))
    assert audio.shape == (960 * codes.shape[0],) and np.isfinite(audio).all()


def test_greedy_generation_stops_by_itself_and_grows_with_text(reference):
    short = reference.generate("Hello.", sampling=GREEDY, max_rows=1000)
    long = reference.generate("Hello there, how are you today? I hope the weather is fine.", sampling=GREEDY,
                              max_rows=1000)
    for sp in (short, long):
        assert sp.stop_reason == "eoc"
        assert sp.codes.shape == (len(sp.rows) - 7, 8) and sp.waveform.shape == (960 * len(sp.codes),)
        assert all(len(set(sp.codes[:, c])) > len(sp.codes) // 3 for c in range(8))  # varied codes
        assert np.abs(sp.waveform).max() < 1.0
    assert len(long.rows) > 2 * len(short.rows)


def test_sampled_generation_is_deterministic_per_seed(reference):
    opts = SamplingOptions()
    a = reference.generate("Hello there.", sampling=opts, seed=3, max_rows=200)
    b = reference.generate("Hello there.", sampling=opts, seed=3, max_rows=200)
    c = reference.generate("Hello there.", sampling=opts, seed=4, max_rows=200)
    np.testing.assert_array_equal(a.rows, b.rows)
    np.testing.assert_array_equal(a.waveform, b.waveform)
    assert a.rows.shape != c.rows.shape or (a.rows != c.rows).any()


def test_max_rows_ends_by_length(reference):
    sp = reference.generate("Hello there, how are you today?", sampling=GREEDY, max_rows=20)
    assert sp.stop_reason == "max_rows" and len(sp.rows) == 20 and len(sp.codes) == 13


@pytest.mark.parametrize("with_text", [False, True])
def test_clone_runs_with_and_without_transcript(reference, with_text):
    ref = load_reference(DATA / "ref_de_22k_stereo.wav", 24000)
    ref_text = (DATA / "ref_de_22k_stereo.txt").read_text().strip() if with_text else None
    sp = reference.generate("A new sentence in the same voice, spoken slowly and clearly.", ref_audio=ref,
                            ref_text=ref_text, sampling=GREEDY, max_rows=1000)
    n_ref = len(reference.encode_audio(ref)) + 7
    assert sp.stats.reference_rows == n_ref and sp.stop_reason == "eoc" and len(sp.codes) > 0


def test_streamed_body_equals_the_resident_one(tiny_ckpt):
    """Layer streaming (how a 4B reference fits in 8 GB) changes where weights live, not a single bit of output."""
    from higgs_onnx.reference.model import ReferenceModel

    resident, streamed = ReferenceModel(tiny_ckpt, stream=False), ReferenceModel(tiny_ckpt, stream=True)
    x = np.random.default_rng(3).standard_normal((9, resident.facts.hidden)).astype(np.float32)
    want = resident.hidden_states(x)
    assert np.array_equal(streamed.hidden_states(x), want)
    assert streamed.body.streamed and not resident.body.streamed
    assert all(p.device.type == "meta" for p in streamed.body.layers.parameters())  # dropped after the forward
    assert np.array_equal(streamed.hidden_states(x), want)  # and read again for the next one
    a = resident.generate("Hello there.", sampling=GREEDY, max_rows=40)
    b = streamed.generate("Hello there.", sampling=GREEDY, max_rows=40)  # step by step through the KV cache
    assert np.array_equal(a.codes, b.codes)


@pytest.mark.slow
def test_dequantized_body_streams_too(builds, tiny_ckpt):
    from higgs_onnx.manifest import load_manifest
    from higgs_onnx.parity import dequantized_body
    from higgs_onnx.reference.model import ReferenceModel

    path = load_manifest(builds["int4"], verify=False).part_file("llm_decoder")
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((1, 6, 64)).astype(np.float32))
    outs = []
    for stream in (False, True):
        body = dequantized_body(ReferenceModel(tiny_ckpt, stream=stream), path)
        with torch.no_grad():
            outs.append(body(inputs_embeds=x).last_hidden_state)
    plain = ReferenceModel(tiny_ckpt).hidden_states(x[0].numpy())
    assert torch.equal(outs[0], outs[1]) and not np.allclose(outs[0][0].numpy(), plain, atol=1e-3)
