"""inference.py / HiggsTTS on the tiny exports: parity with the reference, cloning, tags, CLI, guards."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from higgs_onnx.runtime.model import HiggsTTS

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
REF_DE = DATA / "ref_de_22k_stereo.wav"
REF_EN = DATA / "ref_en_24k.wav"
pytestmark = pytest.mark.slow


def cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "inference.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "CI": "1"}, timeout=600)


CASES = [("Hello there, how are you today?", None, None),
         ("A new sentence in the same voice.", REF_DE, (DATA / "ref_de_22k_stereo.txt").read_text().strip()),
         ("A new sentence in the same voice.", REF_DE, None)]


@pytest.mark.parametrize("text, ref_audio, ref_text", CASES, ids=["zero-shot", "clone+transcript", "clone"])
def test_fp32_greedy_codes_equal_the_reference(tts, reference, text, ref_audio, ref_text):
    from higgs_onnx.generation.sampling import GREEDY

    got = tts.generate(text, ref_audio=ref_audio, ref_text=ref_text, temperature=0)
    want = reference.generate(text, ref_audio=ref_audio, ref_text=ref_text, sampling=GREEDY)
    assert got.stop_reason == want.stop_reason == "eoc"
    np.testing.assert_array_equal(got.rows, want.rows)
    np.testing.assert_array_equal(got.codes, want.codes)
    # waveform: same codes through the fp32 codec graph; the tolerance is fp32 noise of the tiny codec (~1e-4)
    np.testing.assert_allclose(got.waveform, want.waveform, atol=2e-4)


def test_same_seed_same_wav_twice(tts4, tmp_path):
    a = tts4.generate("Sampling is seeded.", seed=5)
    b = tts4.generate("Sampling is seeded.", seed=5)
    c = tts4.generate("Sampling is seeded.", seed=6)
    np.testing.assert_array_equal(a.waveform, b.waveform)
    assert a.rows.shape != c.rows.shape or (a.rows != c.rows).any()


def expected_length(speech, hop=960):
    return hop * (len(speech.rows) - 7)


@pytest.mark.parametrize("ref", [REF_DE, REF_EN], ids=["22k-stereo", "24k-mono"])
def test_int4_cloning_with_real_recordings(tts4, ref):
    text = (ref.with_suffix(".txt")).read_text().strip()
    sp = tts4.generate("<|emotion:elation|>New words in my voice, spoken slowly.", ref_audio=ref, ref_text=text)
    ref_frames = len(tts4.encode_audio(tts4.reference(ref)))
    assert sp.stats.reference_rows == ref_frames + 7 and sp.waveform.size == expected_length(sp) > 0
    assert np.isfinite(sp.waveform).all() and sp.sample_rate == 24000


def test_reference_audio_from_memory_any_rate(tts4):
    data, sr = sf.read(REF_DE, dtype="float32")  # (L, 2) at 22.05 kHz
    a = tts4.generate("Same voice.", ref_audio=(data, sr), temperature=0)
    b = tts4.generate("Same voice.", ref_audio=REF_DE, temperature=0)
    np.testing.assert_array_equal(a.rows, b.rows)


def test_control_tags_are_single_tokens_and_change_the_prompt(tts4):
    plain_text, tagged_text = "Hello there friend.", "<|emotion:elation|>Hello there<|prosody:pause|> friend."
    plain = tts4.generate(plain_text, temperature=0)
    tagged = tts4.generate(tagged_text, temperature=0)
    assert tagged.stats.prompt_tokens == plain.stats.prompt_tokens + 2  # each tag is exactly one token
    ids = tts4.tokenizer.encode(tagged_text, add_special_tokens=False).ids
    tags = tts4.tokens.control_tags
    assert ids[0] == tags["<|emotion:elation|>"] and tags["<|prosody:pause|>"] in ids
    assert tagged.waveform.size == expected_length(tagged) and not np.array_equal(plain.rows, tagged.rows)


def test_bound_kv_cache_equals_the_simple_path(builds):
    # the route off: the host path has none (the int8 route shares the bound buffers: tests/test_route.py)
    a = HiggsTTS(builds["int4"], kv_cache="bound", route="off").generate("Zero copies of the cache.", seed=1)
    b = HiggsTTS(builds["int4"], kv_cache="host").generate("Zero copies of the cache.", seed=1)
    np.testing.assert_array_equal(a.rows, b.rows)


def test_runtime_imports_neither_torch_nor_transformers(builds):
    code = (f"import sys; from higgs_onnx.runtime.model import HiggsTTS; "
            f"s = HiggsTTS({str(builds['int4'])!r}).generate('No torch here.', ref_audio={str(REF_DE)!r}); "
            f"assert s.waveform.size > 0; bad = [m for m in ('torch', 'transformers', 'olive') if m in sys.modules]; "
            f"print('LEAKED', bad) if bad else print('CLEAN')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.stdout.strip() == "CLEAN", r.stdout + r.stderr


def test_cli_zero_shot_clone_text_file_codes(builds, tmp_path):
    m = builds["int4"]
    r = cli("--model-path", m, "--text", "Hello there.", "--out", tmp_path / "a.wav", "--save-codes",
            tmp_path / "a.npy", "--seed", "3")
    assert r.returncode == 0, r.stderr
    rows, raw = np.load(tmp_path / "a.npy"), np.load(tmp_path / "a.raw.npy")
    wav, sr = sf.read(tmp_path / "a.wav")
    assert sr == 24000 and len(wav) == 960 * len(raw) == 960 * (len(rows) - 7) and "RTF" in r.stdout
    r = cli("--model-path", m, "--codes", tmp_path / "a.npy", "--out", tmp_path / "b.wav")
    assert r.returncode == 0 and np.array_equal(sf.read(tmp_path / "b.wav")[0], wav)
    r = cli("--model-path", m, "--ref-audio", REF_DE, "--ref-text", "Guten Morgen.", "--text",
            "<|emotion:elation|>New words.", "--out", tmp_path / "c.flac")
    assert r.returncode == 0 and sf.info(tmp_path / "c.flac").format == "FLAC"
    (tmp_path / "lines.txt").write_text("First line.\n\nSecond, longer line of text.\n")
    r = cli("--model-path", m, "--text-file", tmp_path / "lines.txt", "--out-dir", tmp_path / "out")
    assert r.returncode == 0 and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0001.wav", "0002.wav"]
    r = cli("--model-path", m, "--selftest")
    assert r.returncode == 0 and "selftest OK" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--text", "hi", "--ref-text", "x"], "--ref-text needs --ref-audio"),
    (["--text", "hi", "--temperature", "-1"], "temperature"),
    (["--text", "hi", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--text", "hi", "--top-k", "-2"], "--top-k must be >= 0"),
    (["--text", "hi", "--ref-audio", "/no/such.wav"], "does not exist"),
    (["--text", "   "], "empty"),
    (["--text", "hi", "--provider", "cuda"], "built for CPUExecutionProvider"),
    (["--text", "hi", "--max-rows", "999999"], "context"),
])
def test_cli_bad_input_one_line_exit_2(builds, tmp_path, args, message):
    out = tmp_path / "x.wav"
    r = cli("--model-path", builds["int4"], *args, "--out", out)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()


def test_nan_and_zero_guards(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from higgs_onnx.runtime.decoder import _check
    from higgs_onnx.runtime.session import Part

    graph = helper.make_graph([helper.make_node("Div", ["x", "x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "nan.onnx")
    with pytest.raises(FloatingPointError, match="audio_heads produced NaN"):
        Part("audio_heads", tmp_path / "nan.onnx")(x=np.zeros(2, np.float32))
    with pytest.raises(FloatingPointError, match="all-zero"):
        _check(np.zeros((1, 4), np.float32))


def spy(monkeypatch, obj, name: str) -> list[tuple]:
    """Record every call of `obj.name` (still calling it): one (args, kwargs) per call."""
    calls, real = [], getattr(obj, name)

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, recorded)
    return calls


def test_cached_voice_gives_the_same_codes(builds, tmp_path, monkeypatch):
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.generation.pipeline import reference_rows
    from higgs_onnx.runtime.model import Voice

    # the int8 route off: the one-call prefill below is a longer call than the voice's suffix, and the route takes
    # calls by their length (tests/test_route.py checks new, cached and saved voices agree with the route on)
    tts = HiggsTTS(builds["int4"], route="off")
    encodes, prefills = spy(monkeypatch, tts, "encode_audio"), spy(monkeypatch, tts.backend, "prefill")
    ref_text = (DATA / "ref_de_22k_stereo.txt").read_text().strip()
    first = tts.generate("Cached voices are cheap.", ref_audio=REF_DE, ref_text=ref_text, seed=2)
    # a new voice: the reference is encoded once, then its prefix and the rest of the prompt are prefilled
    assert len(encodes) == 1 and len(prefills) == 2, (len(encodes), len(prefills))
    prefix_len = len(prefills[0][0][1])
    again = tts.generate("Cached voices are cheap.", ref_audio=REF_DE, ref_text=ref_text, seed=2)
    # the same reference again: no encoder run, no prefill of the voice's prefix; only the text's own prefill
    assert len(encodes) == 1 and len(prefills) == 3, (len(encodes), len(prefills))
    assert len(prefills[2][0][1]) == len(prefills[1][0][1])  # the same suffix as the first call's
    assert prefix_len == len(tts.make_voice(REF_DE, ref_text).prefix) and len(encodes) == 1  # from the cache
    synth = tts.synthesizer  # the whole prompt prefilled at once, reference included
    plain = synth.speak(synth.request("Cached voices are cheap.", GenerationOptions(seed=2), ref_text=ref_text,
                                      ref_rows=reference_rows(tts, tts.facts, tts.reference(REF_DE))))
    np.testing.assert_array_equal(first.rows, plain.rows)  # prefix state + suffix prefill == full prefill
    np.testing.assert_array_equal(again.rows, plain.rows)
    saved = tts.make_voice(REF_DE, ref_text).save(tmp_path / "v.npz")
    fresh = HiggsTTS(builds["int4"], route="off")
    loaded = fresh.generate("Cached voices are cheap.", voice=Voice.load(saved, fresh.model_id), seed=2)
    np.testing.assert_array_equal(loaded.rows, plain.rows)
    with pytest.raises(ValueError, match="another export"):
        Voice.load(saved, HiggsTTS(builds["fp32"]).model_id)


def test_cli_save_and_use_voice(builds, tmp_path):
    m = builds["int4"]
    r = cli("--model-path", m, "--ref-audio", REF_EN, "--text", "Hello.", "--out", tmp_path / "a.wav",
            "--save-voice", tmp_path / "me.npz", "--seed", "4")
    assert r.returncode == 0 and "voice saved" in r.stdout, r.stderr
    r = cli("--model-path", m, "--voice", tmp_path / "me.npz", "--text", "Hello.", "--out", tmp_path / "b.wav",
            "--seed", "4")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "b.wav").read_bytes()
