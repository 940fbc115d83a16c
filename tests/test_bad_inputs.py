"""Every row of the README's bad-input table that needs a model folder (the tiny int4 export): one clear line, the
right exit code, nothing written. The rows refused before any model loads are in test_fast_bad_inputs.py."""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import eval as eval_cli
import inference
import optimize
from higgs_onnx.manifest import rewrite_manifest

DATA = Path(__file__).resolve().parent / "data"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(builds, tmp_path_factory):
    return builds["int4"]


def run_inference(capsys, model, *args, out=None):
    out = out or Path("/tmp") / "higgs_bad_input_never_written.wav"
    out.unlink(missing_ok=True)
    code = inference.main(["--model-path", str(model), *map(str, args), "--out", str(out)])
    err = capsys.readouterr().err
    return code, err, out


def raw_file(path, data):
    path.write_bytes(data)
    return path


def wav_file(tmp_path, name, data, sr=24000, subtype="FLOAT"):
    path = tmp_path / name
    sf.write(path, data, sr, subtype=subtype)
    return path


TEXT_ROWS = [  # checked against the model (its tokenizer, context) or after it loads
    ("prompt longer than the context", ["--text", "word " * 5000],
     "but the model's context holds 4096 positions and the speech needs at least 8 more"),
    ("max-rows beyond the context", ["--text", "Hi.", "--max-rows", "5000"],
     "max_rows is 5000, but the model's context holds 4096 positions"),
    ("max-rows that does not fit beside the prompt", ["--text", "Hi.", "--max-rows", "4095"],
     "rows fit; lower max_rows or shorten the text"),
    ("max-rows below one audio frame", ["--text", "Hi.", "--max-rows", "3"],
     "max_rows is 3; at least 8 rows are needed for one audio frame"),
    ("missing reference audio", ["--text", "Hi.", "--ref-audio", "/no/such.wav"], "does not exist"),
    ("reference audio is a folder", ["--text", "Hi.", "--ref-audio", DATA], "is a folder, not an audio file"),
]


@pytest.mark.parametrize("case, args, message", TEXT_ROWS, ids=[r[0] for r in TEXT_ROWS])
def test_text_and_option_rows(capsys, model, case, args, message):
    code, err, out = run_inference(capsys, model, *args)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()


AUDIO_ROWS = [
    ("corrupt file", lambda p: raw_file(p / "bad.wav", b"RIFF\x00\x00garbage" * 10), "cannot read reference audio"),
    ("unsupported container", lambda p: raw_file(p / "clip.mp4", b"\x00\x00\x00\x18ftypmp42" + b"\0" * 64),
     "cannot read reference audio"),
    ("zero-length", lambda p: wav_file(p, "empty.wav", np.zeros(0, np.float32)), "reference audio is empty"),
    ("all silence", lambda p: wav_file(p, "silent.wav", np.zeros(48000, np.float32)), "reference audio is silent"),
    ("non-finite samples", lambda p: wav_file(p, "nan.wav", np.r_[np.ones(100), np.nan, np.ones(100)].astype(
        np.float32)), "NaN or infinite"),
    ("too long", lambda p: wav_file(p, "long.wav", np.full(8000 * 101, 0.1, np.float32), sr=8000),
     "101.0 s long; the limit is 100 s"),
]


@pytest.mark.parametrize("case, make, message", AUDIO_ROWS, ids=[r[0] for r in AUDIO_ROWS])
def test_reference_audio_rows(capsys, model, tmp_path, case, make, message):
    code, err, out = run_inference(capsys, model, "--text", "Hi.", "--ref-audio", make(tmp_path))
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.fixture(scope="module")
def voice(model, tmp_path_factory):
    """A real voice file of the int4 build (the one the damaged copies below start from)."""
    from higgs_onnx.runtime.model import HiggsTTS, Voice

    tts = HiggsTTS(model)
    path = tts.make_voice(DATA / "ref_en_24k.wav", "A reference.").save(tmp_path_factory.mktemp("voice") / "v.npz")
    Voice.load(path, tts.model_id)  # the intact file passes every check
    return path


def rewrite(voice, path, drop=(), **arrays):
    """A copy of `voice` without the arrays whose names start with one of `drop`, and with `arrays` replaced."""
    with np.load(voice) as f:
        kept = {k: f[k] for k in f.files if not k.startswith(tuple(drop))}
    np.savez(path, **{**kept, **arrays})
    return path


def first_kv(voice):
    with np.load(voice) as f:
        return next(k for k in f.files if k.startswith("kv:"))


def npy_as_npz(path):
    np.save(path.with_suffix(".npy"), np.zeros(3))
    return path.with_suffix(".npy").rename(path)


VOICE_ROWS = [
    ("text file named .npz", lambda v, p: raw_file(p / "x.npz", b"not a voice\n"), "not an .npz archive"),
    ("random bytes", lambda v, p: raw_file(p / "r.npz", np.random.default_rng(0).bytes(4096)), "not an .npz archive"),
    ("empty file", lambda v, p: raw_file(p / "e.npz", b""), "not an .npz archive"),
    ("zip header, then garbage", lambda v, p: raw_file(p / "z.npz", b"PK\x03\x04" + b"\x01" * 200),
     "not an .npz archive"),
    ("truncated voice", lambda v, p: raw_file(p / "t.npz", v.read_bytes()[: v.stat().st_size // 2]),
     "not an .npz archive"),
    ("a single .npy array", lambda v, p: npy_as_npz(p / "a.npz"), "a single .npy array"),
    ("missing keys", lambda v, p: rewrite(v, p / "m.npz", drop=("prefix", "meta")), "missing prefix, meta"),
    ("no prefill state", lambda v, p: rewrite(v, p / "k.npz", drop=("kv:",)), "missing kv:* (the prefill state)"),
    ("float rows", lambda v, p: rewrite(v, p / "f.npz", rows=np.zeros((4, 8), np.float32)),
     "rows must be integer codes"),
    ("pickled array", lambda v, p: rewrite(v, p / "o.npz", rows=np.array([{}, None], dtype=object)),
     "a damaged or non-numeric array inside"),
    ("meta not JSON", lambda v, p: rewrite(v, p / "j.npz", meta=np.asarray("{oops")), "meta is not the JSON"),
    ("state of another length", lambda v, p: rewrite(v, p / "s.npz", **{first_kv(v): np.zeros((1, 1, 3, 4))}),
     "must be a float or int8 (1, H,"),
]


@pytest.mark.parametrize("case, make, message", VOICE_ROWS, ids=[r[0] for r in VOICE_ROWS])
def test_voice_file_rows(capsys, model, voice, tmp_path, case, make, message):
    path = make(voice, tmp_path)
    code, err, out = run_inference(capsys, model, "--text", "Hi.", "--voice", path)
    assert code == 2 and f"{path} is not a voice file (" in err and message in err, err
    assert "the .npz written by inference.py --save-voice" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_voice_folder_row(capsys, model, tmp_path):
    code, err, out = run_inference(capsys, model, "--text", "Hi.", "--voice", tmp_path)
    assert code == 2 and f"voice file {tmp_path} is a folder" in err and "--save-voice" in err, err
    assert not out.exists()


def edit_manifest(folder, fn, digest=True):
    """Change manifest.json on purpose; with `digest` written back with a fresh manifest_sha256 (rewrite_manifest),
    so that the check under test, not the digest, refuses it."""
    m = json.loads((folder / "manifest.json").read_text())
    fn(m)
    if digest:
        rewrite_manifest(folder, m)
    else:
        (folder / "manifest.json").write_text(json.dumps(m))


def escape(manifest):
    entry = manifest["parts"]["audio_heads"]
    entry["files"]["../audio_heads.onnx"] = entry["files"].pop(entry["file"])
    entry["file"] = "../audio_heads.onnx"


MODEL_ROWS = [
    ("missing folder", lambda d: shutil.rmtree(d), "does not exist; build it with"),
    ("not a model folder", lambda d: (d / "manifest.json").unlink(), "has no manifest.json"),
    ("corrupt manifest", lambda d: (d / "manifest.json").write_text("{oops"), "manifest.json is corrupt"),
    ("manifest edited by hand", lambda d: edit_manifest(d, lambda m: m.update(precision="fp32"), digest=False),
     "was changed after it was written"),
    ("newer schema", lambda d: edit_manifest(d, lambda m: m.update(schema_version=99)), "newer than this toolkit"),
    ("part file missing", lambda d: (d / "audio_heads.onnx").unlink(), "audio_heads.onnx is missing"),
    ("part file truncated", lambda d: (d / "audio_heads.onnx").write_bytes(b"x"), "truncated or replaced"),
    ("sha256 mismatch", lambda d: (d / "audio_heads.onnx").write_bytes(
        bytes(b ^ 0xFF if i == 100 else b for i, b in enumerate((d / "audio_heads.onnx").read_bytes()))),
     "does not match its sha256"),
    ("built for another EP", lambda d: edit_manifest(d, lambda m: m.update(
        device="dml", execution_provider="DmlExecutionProvider")), "built for DmlExecutionProvider"),
    ("entry outside the folder", lambda d: edit_manifest(d, escape), "not a plain file name inside the model folder"),
    # the int8 route's entry: a crossover that is not a size (or none) used to run every call on int4 unseen
    *[(f"route {case}", lambda d, e=edit: edit_manifest(d, lambda m: e(m["decoder"]["route"])),
       f"manifest.json is malformed: {words} (rebuild with optimize.py --force)") for case, edit, words in (
        ("crossover 0", lambda r: r["crossover"].update(prefill=0),
         "'decoder.route.crossover.prefill' must be a whole number >= 1 or null (never), got 0"),
        ("crossover -3", lambda r: r["crossover"].update(batch=-3), "'decoder.route.crossover.batch' must be a "
         "whole number >= 1 or null (never), got -3"),
        ("crossover 'abc'", lambda r: r["crossover"].update(prefill="abc"), "'decoder.route.crossover.prefill' "
         "must be a whole number >= 1 or null (never), got 'abc'"),
        ("crossover size missing", lambda r: r["crossover"].pop("prefill"), "'decoder.route.crossover.prefill' "
         "must be a whole number >= 1 or null (never), it is missing"),
        ("crossover missing", lambda r: r.pop("crossover"), "'decoder.route.crossover' must be an object with "
         "prefill and batch, got None"),
        ("crossover null", lambda r: r.update(crossover=None), "'decoder.route.crossover' must be an object with "
         "prefill and batch, got None"),
        ("kind unknown", lambda r: r.update(kind="int9-gemm"), "'decoder.route.kind' must be one of int8-gemm, "
         "none, got 'int9-gemm'"),
        ("form unknown", lambda r: r.update(form="s9"), "'decoder.route.form' must be one of s7, s8 (the int8 "
         "weights' range), got 's9'"))],
]


@pytest.mark.parametrize("case, mutate, message", MODEL_ROWS, ids=[r[0] for r in MODEL_ROWS])
def test_model_folder_rows(capsys, model, tmp_path, case, mutate, message):
    folder = shutil.copytree(model, tmp_path / "m")
    mutate(folder)
    code, err, out = run_inference(capsys, folder, "--text", "Hi.", "--provider", "cpu")
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not out.exists()


def test_no_verify_skips_hashing(capsys, model, tmp_path):
    folder = shutil.copytree(model, tmp_path / "m")
    {case: mutate for case, mutate, _ in MODEL_ROWS}["sha256 mismatch"](folder)  # sizes agree, hashes do not
    code, err, _ = run_inference(capsys, folder, "--text", "Hi.", "--no-verify", out=tmp_path / "ok.wav")
    assert code in (0, 1)  # hashing skipped: the corrupt graph may still load (0) or fail to parse (1)
    assert "does not match its sha256" not in err
    assert code == 0 or "ONNX Runtime cannot load audio_heads.onnx" in err, err


def test_unknown_tag_warns_and_speaks(capsys, model, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        code, err, out = run_inference(capsys, model, "--text", "<|emotion:glee|>Hello there.", out=tmp_path / "a.wav")
    assert code == 0 and out.exists()
    assert "unknown tag(s) <|emotion:glee|> will be read as plain text" in caplog.text + err


def test_non_latin_text_passes(capsys, model, tmp_path):
    for i, text in enumerate(["Guten Morgen, schöne Grüße.", "你好，世界。", "Привет, мир.", "مرحبا بالعالم"]):
        code, err, out = run_inference(capsys, model, "--text", text, out=tmp_path / f"{i}.wav")
        assert code == 0 and out.exists(), err


def test_out_of_disk_row(capsys, tiny_ckpt, tmp_path, monkeypatch, builds):
    import errno

    from higgs_onnx import quantize

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = shutil.copytree(builds["int4"].parent, tmp_path / "onnx", symlinks=True)
    before = (out / "cpu_int4" / "manifest.json").read_text()
    monkeypatch.setattr(quantize, "quantize_model_int4", full_disk)
    code = optimize.main(["--model-dir", str(tiny_ckpt), "--output", str(out), "--force"])
    err = capsys.readouterr().err
    assert code == 1 and "out of disk space" in err and "needs about" in err and "GB free" in err
    assert (out / "cpu_int4" / "manifest.json").read_text() == before  # previous build intact


def test_eval_rejects_a_mismatched_checkpoint(capsys, builds, tmp_path):
    from higgs_onnx.synthetic import Plant, build

    other = build("tiny", tmp_path / "other", seed=0, plant=Plant(eoc_ratio=3.0), progress=False)
    (other / "config.json").write_text((other / "config.json").read_text().replace('"num_hidden_layers": 2',
                                                                                   '"num_hidden_layers": 1'))
    code = eval_cli.main(["--model-path", str(builds["fp32"]), "--checkpoint", str(other)])
    assert code == 2 and "does not match the export" in capsys.readouterr().err


def test_ctrl_c_during_generation_writes_nothing_half_done(model, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    lines = "\n".join(f"Line number {i} is a fairly long sentence so that the model keeps talking." for i in range(60))
    (tmp_path / "lines.txt").write_text(lines)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, str(root / "inference.py"), "--model-path", str(model), "--text-file",
                             str(tmp_path / "lines.txt"), "--out-dir", str(tmp_path / "out")], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "CI": "1"})
    for line in proc.stdout:
        if "0002.wav" in line:
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files and all(not f.startswith(".") for f in files)  # no temp file left behind
    for f in files:
        wav, sr = sf.read(tmp_path / "out" / f)  # every file that exists is complete
        assert sr == 24000 and len(wav) % 960 == 0 and len(wav) > 0
