"""Codec export parts (`audio_tokenizer` decoder, `audio_encoder` encoder): TorchScript ONNX export, run in
onnxruntime, compared with the PyTorch reference on the tiny synthetic checkpoint.

Decoder tolerance: the tiny random decoder ends in a conv that maps activations of ~1e3 to a waveform of ~0.3, so
fp32 itself is only good to ~5e-5 of the output's max abs here (torch fp32 vs fp64 measures 1e-5..8e-5); the ONNX
graph is as close to fp64 as the torch reference is, and graph vs reference stays within 1e-4 for these codes
(measured max 6.1e-5 at T=7). Encoder: codes must be identical.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from higgs_onnx.audio import load_reference
from higgs_onnx.checkpoint import load_facts
from higgs_onnx.parts import audio_encoder, audio_tokenizer

DATA = Path(__file__).resolve().parent / "data"
ENCODER_LENGTHS = (24000, 24001, 24959, 25000, 30000, 47000, 48961)


def _export(part, ckpt: Path, out: Path):
    """Export one part as the exporter does (TorchScript, opset 17, dynamic axes) and open it in onnxruntime."""
    import onnxruntime as ort

    model, io = part.load(str(ckpt)), part.io_config(str(ckpt))
    path = out / f"{part.NAME}.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings of the (always-false) DAC crop test, legacy-exporter notice
        torch.onnx.export(model, part.dummy_inputs(str(ckpt)), str(path), dynamo=False, opset_version=17,
                          external_data=False, input_names=io["input_names"], output_names=io["output_names"],
                          dynamic_axes=io["dynamic_axes"])
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), path


@pytest.fixture(scope="module")
def decoder(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    return _export(audio_tokenizer, tiny_ckpt, tmp_path_factory.mktemp("audio_tokenizer"))


@pytest.fixture(scope="module")
def encoder(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    return _export(audio_encoder, tiny_ckpt, tmp_path_factory.mktemp("audio_encoder"))


def _dims(path: Path) -> dict[str, list]:
    """Graph input/output name -> dims (int, or the dim_param name of a dynamic axis)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(graph.input) + list(graph.output)}


# -- decoder ----------------------------------------------------------------------------------------------------


def test_decoder_io_and_dynamic_axes(decoder, tiny_ckpt: Path):
    _, path = decoder
    f = load_facts(tiny_ckpt)
    dims = _dims(path)
    assert dims["audio_codes"] == ["batch", f.num_codebooks, "frames"]
    assert dims["waveform"] == ["batch", 1, "samples"]
    (dummy,) = audio_tokenizer.dummy_inputs(str(tiny_ckpt))
    assert dummy.dtype == torch.int64 and dummy.shape[2] not in (1, 7, 33)  # tests below run other lengths


@pytest.mark.parametrize("frames", [1, 7, 33])
def test_decoder_matches_reference(decoder, reference, frames: int):
    session, _ = decoder
    f = reference.facts
    codes = np.random.default_rng(0).integers(0, f.codebook_size, (2, f.num_codebooks, frames), dtype=np.int64)
    (wave,) = session.run(None, {"audio_codes": codes})
    assert wave.dtype == np.float32 and wave.shape == (2, 1, f.hop * frames)
    ref = np.stack([reference.decode_audio(codes[i:i + 1]) for i in range(len(codes))])
    rel = np.abs(wave[:, 0] - ref).max() / np.abs(ref).max()
    print(f"decoder T={frames}: max abs diff {rel:.2e} of the output max abs")
    assert rel <= 1e-4, f"max abs diff {rel:.2e} of the output max abs"


# -- encoder ----------------------------------------------------------------------------------------------------


def _encode(session, wavs: np.ndarray) -> np.ndarray:
    (codes,) = session.run(None, {"waveform": np.ascontiguousarray(wavs, np.float32)})
    return codes


def test_encoder_io_and_dynamic_axes(encoder, tiny_ckpt: Path):
    _, path = encoder
    f = load_facts(tiny_ckpt)
    dims = _dims(path)
    assert dims["waveform"] == ["batch", "samples"]
    assert dims["audio_codes"] == ["batch", f.num_codebooks, "frames"]
    (dummy,) = audio_encoder.dummy_inputs(str(tiny_ckpt))
    assert dummy.dtype == torch.float32 and dummy.shape[1] % f.hop != 0
    assert dummy.shape[1] not in ENCODER_LENGTHS  # every length below differs from the traced one


@pytest.mark.parametrize("length", ENCODER_LENGTHS)
def test_encoder_codes_identical(encoder, reference, length: int):
    session, _ = encoder
    wav = (0.1 * np.random.default_rng(length).standard_normal(length)).astype(np.float32)
    codes = _encode(session, wav[None])
    ref = reference.encode_audio(wav)  # (T, N)
    assert codes.dtype == np.int64 and codes.shape == (1, reference.facts.num_codebooks, len(ref))
    np.testing.assert_array_equal(codes[0].T, ref)


@pytest.mark.parametrize("name", ["ref_en_24k.wav", "ref_de_22k_stereo.wav"])
def test_encoder_real_recordings(encoder, reference, name: str):
    session, _ = encoder
    wav = load_reference(DATA / name, reference.facts.sample_rate)
    assert len(wav) % reference.facts.hop != 0  # odd lengths: the padded-acoustic path or its twin
    codes = _encode(session, wav[None])
    ref = reference.encode_audio(wav)
    assert codes.dtype == np.int64 and codes.shape == (1, reference.facts.num_codebooks, len(ref))
    np.testing.assert_array_equal(codes[0].T, ref)


def test_encoder_batch(encoder, reference):
    session, _ = encoder
    rng = np.random.default_rng(7)
    wavs = (0.1 * rng.standard_normal((2, 30001))).astype(np.float32)
    codes = _encode(session, wavs)
    assert codes.dtype == np.int64 and codes.shape[:2] == (2, reference.facts.num_codebooks)
    for i in range(2):
        np.testing.assert_array_equal(codes[i].T, reference.encode_audio(wavs[i]))


def test_encoder_lengths_cover_both_acoustic_paths(reference):
    """The lengths above include both sides of encode()'s branch (acoustic encoder on the plain / hop-padded wave)."""
    codec = reference.codec
    padded = {codec._get_conv1d_output_lengths(n, codec.acoustic_encoder) != len(reference.encode_audio(
        np.zeros(n, np.float32))) for n in ENCODER_LENGTHS}
    assert padded == {False, True}
