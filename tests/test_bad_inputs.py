"""Every row of the README's bad-input table: one clear line, the right exit code, nothing written."""

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


TEXT_ROWS = [
    ("empty text", ["--text", "   "], "text is empty"),
    ("control characters", ["--text", "Hello\x07 there"], "control characters (U+0007)"),
    ("only tags", ["--text", "<|emotion:elation|><|prosody:pause|>"], "only control tags"),
    ("prompt longer than the context", ["--text", "word " * 5000], "the model's context is 4096"),
    ("ref-text without ref-audio", ["--text", "Hi.", "--ref-text", "x"], "--ref-text needs --ref-audio"),
    ("negative temperature", ["--text", "Hi.", "--temperature", "-0.5"], "temperature must be"),
    ("top-p outside (0, 1]", ["--text", "Hi.", "--top-p", "0"], "top_p must be in (0, 1]"),
    ("top-k < 0", ["--text", "Hi.", "--top-k", "-1"], "top_k must be >= 0"),
    ("max-rows beyond the context", ["--text", "Hi.", "--max-rows", "5000"], "max_rows must be in [1, 4096)"),
    ("missing reference audio", ["--text", "Hi.", "--ref-audio", "/no/such.wav"], "does not exist"),
    ("reference audio is a folder", ["--text", "Hi.", "--ref-audio", DATA], "is a folder, not an audio file"),
    ("negative threads", ["--text", "Hi.", "--threads", "-1"], "threads must be >= 0 (0 = ONNX Runtime's default"),
    ("save-codes is a folder", ["--text", "Hi.", "--save-codes", DATA],
     f"--save-codes {DATA} is a folder: name a file"),
    ("save-codes in a missing folder", ["--text", "Hi.", "--save-codes", "/no/such/rows.npy"],
     "--save-codes: folder /no/such does not exist"),
    ("stream chunk of 0 frames", ["--text", "Hi.", "--stream", "--first-frames", "0"], "first_frames must be >= 1"),
    ("stream chunk below 1", ["--text", "Hi.", "--stream", "--chunk-frames", "-2"], "chunk_frames must be >= 1"),
    ("save-voice is a folder", ["--text", "Hi.", "--ref-audio", str(Path(DATA) / "ref_en_24k.wav"), "--save-voice",
                                DATA], f"--save-voice {DATA} is a folder: name a file"),
]


@pytest.mark.parametrize("case, args, message", TEXT_ROWS, ids=[r[0] for r in TEXT_ROWS])
def test_text_and_option_rows(capsys, model, case, args, message):
    code, err, out = run_inference(capsys, model, *args)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()


def test_output_path_rows(capsys, model, tmp_path):
    code, err, _ = run_inference(capsys, model, "--text", "Hi.", out=tmp_path / "missing" / "x.wav")
    assert code == 2 and "output folder" in err and "does not exist" in err
    code, err, _ = run_inference(capsys, model, "--text", "Hi.", out=tmp_path / "x.mp3")
    assert code == 2 and "unsupported output format '.mp3'" in err


def test_output_is_a_folder_row(capsys, model, tmp_path):
    folder = tmp_path / "out.d"  # a suffix that would read as an output format
    folder.mkdir()
    code = inference.main(["--model-path", str(model), "--text", "Hi.", "--out", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and f"--out {folder} is a folder, not an audio file" in err and "--out-dir" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err and not any(folder.iterdir())


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
     "must be a float (1, H,"),
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


def edit_manifest(folder, fn):
    m = json.loads((folder / "manifest.json").read_text())
    fn(m)
    (folder / "manifest.json").write_text(json.dumps(m))


def escape(manifest):
    entry = manifest["parts"]["audio_heads"]
    entry["files"]["../audio_heads.onnx"] = entry["files"].pop(entry["file"])
    entry["file"] = "../audio_heads.onnx"


MODEL_ROWS = [
    ("missing folder", lambda d: shutil.rmtree(d), "does not exist; build it with"),
    ("not a model folder", lambda d: (d / "manifest.json").unlink(), "has no manifest.json"),
    ("corrupt manifest", lambda d: (d / "manifest.json").write_text("{oops"), "manifest.json is corrupt"),
    ("newer schema", lambda d: edit_manifest(d, lambda m: m.update(schema_version=99)), "newer than this toolkit"),
    ("part file missing", lambda d: (d / "audio_heads.onnx").unlink(), "audio_heads.onnx is missing"),
    ("part file truncated", lambda d: (d / "audio_heads.onnx").write_bytes(b"x"), "truncated or replaced"),
    ("sha256 mismatch", lambda d: (d / "audio_heads.onnx").write_bytes(
        bytes(b ^ 0xFF if i == 100 else b for i, b in enumerate((d / "audio_heads.onnx").read_bytes()))),
     "does not match its sha256"),
    ("built for another EP", lambda d: edit_manifest(d, lambda m: m.update(
        device="cuda", execution_provider="CUDAExecutionProvider")), "built for CUDAExecutionProvider"),
    ("entry outside the folder", lambda d: edit_manifest(d, escape), "not a plain file name inside the model folder"),
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
    MODEL_ROWS[6][1](folder)  # flip a byte inside audio_heads.onnx: sizes agree, hash does not
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


CHECKPOINT_ROWS = [
    ("missing checkpoint", lambda d: shutil.rmtree(d), "does not exist"),
    ("missing file", lambda d: (d / "tokenizer.json").unlink(), "missing tokenizer.json"),
    ("corrupt safetensors header", lambda d: (d / "model.safetensors").write_bytes(b"\x10" * 64),
     "corrupt safetensors header"),
    ("config disagrees with tensors", lambda d: (d / "config.json").write_text(
        (d / "config.json").read_text().replace('"intermediate_size": 128', '"intermediate_size": 256')),
     "config.json implies"),
    ("unknown model_type", lambda d: (d / "config.json").write_text(
        (d / "config.json").read_text().replace("higgs_multimodal_qwen3", "llama")), "model_type 'llama'"),
]


@pytest.mark.parametrize("case, mutate, message", CHECKPOINT_ROWS, ids=[r[0] for r in CHECKPOINT_ROWS])
def test_checkpoint_rows(capsys, tiny_ckpt, tmp_path, case, mutate, message):
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    mutate(ckpt)
    code = optimize.main(["--model-dir", str(ckpt), "--output", str(tmp_path / "onnx")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "onnx" / "cpu_int4").exists()


def test_invalid_device_precision_row(capsys, tmp_path):
    assert optimize.main(["--synthetic", "tiny", "--device", "dml", "--precision", "fp32",
                          "--output", str(tmp_path)]) == 2
    assert "valid precisions on dml: gqa: int4, fp16" in capsys.readouterr().err


def test_concurrent_build_row(capsys, tiny_ckpt, tmp_path):
    from filelock import FileLock

    (tmp_path / "onnx").mkdir()
    with FileLock(str(tmp_path / "onnx" / ".cpu_int4.lock")):
        code = optimize.main(["--model-dir", str(tiny_ckpt), "--output", str(tmp_path / "onnx")])
    err = capsys.readouterr().err
    assert code == 1 and "another optimize.py is building" in err


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
