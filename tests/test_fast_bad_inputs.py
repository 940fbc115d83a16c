"""The README's bad-input rows that are refused before any model loads (argument checks of inference.py and
optimize.py): fast, no export. The rows that need a model folder are in test_bad_inputs.py (slow).

inference.py rows run against a model folder that does not exist: the right message (not "model folder ... does
not exist") shows the refusal came before the model was looked at."""

import shutil
from pathlib import Path

import pytest

import inference
import optimize

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def no_model(tmp_path):
    return tmp_path / "no-model"  # never created


def run_inference(capsys, model, *args, out=None):
    if out is None:
        out = Path("/tmp") / "higgs_bad_input_never_written.wav"
        out.unlink(missing_ok=True)
    code = inference.main(["--model-path", str(model), *map(str, args), "--out", str(out)])
    err = capsys.readouterr().err
    return code, err, out


TEXT_ROWS = [
    ("empty text", ["--text", "   "], "text is empty"),
    ("control characters", ["--text", "Hello\x07 there"], "control characters (U+0007)"),
    ("only tags", ["--text", "<|emotion:elation|><|prosody:pause|>"], "only control tags"),
    ("ref-text without ref-audio", ["--text", "Hi.", "--ref-text", "x"], "--ref-text needs --ref-audio"),
    ("negative temperature", ["--text", "Hi.", "--temperature", "-0.5"], "--temperature must be"),
    ("top-p outside (0, 1]", ["--text", "Hi.", "--top-p", "0"], "--top-p must be in (0, 1]"),
    ("top-k < 0", ["--text", "Hi.", "--top-k", "-1"], "--top-k must be >= 0"),
    ("negative threads", ["--text", "Hi.", "--threads", "-1"], "threads must be >= 0 (0 = ONNX Runtime's default"),
    ("save-codes is a folder", ["--text", "Hi.", "--save-codes", DATA],
     f"--save-codes {DATA} is a folder, not a file: name a file"),
    ("save-codes in a missing folder", ["--text", "Hi.", "--save-codes", "/no/such/rows.npy"],
     "--save-codes /no/such/rows.npy: folder /no/such does not exist"),
    ("stream chunk of 0 frames", ["--text", "Hi.", "--stream", "--first-frames", "0"], "first_frames must be >= 1"),
    ("retries beyond 10", ["--text", "Hi.", "--retries", "11"], "--retries must be from 0 to 10, got 11"),
    ("negative retries", ["--text", "Hi.", "--retries", "-1"], "--retries must be from 0 to 10, got -1"),
    ("stream chunk below 1", ["--text", "Hi.", "--stream", "--chunk-frames", "-2"], "chunk_frames must be >= 1"),
    ("save-voice is a folder", ["--text", "Hi.", "--ref-audio", str(DATA / "ref_en_24k.wav"), "--save-voice",
                                DATA], f"--save-voice {DATA} is a folder, not a file: name a file"),
]


@pytest.mark.parametrize("case, args, message", TEXT_ROWS, ids=[r[0] for r in TEXT_ROWS])
def test_text_and_option_rows(capsys, no_model, case, args, message):
    code, err, out = run_inference(capsys, no_model, *args)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("value", ["no", "false", "2"])
def test_a_higgs_prepared_that_is_neither_0_nor_1_is_refused_before_the_model_loads(capsys, no_model, monkeypatch,
                                                                                     value):
    """It was read as "on" unless exactly 0: HIGGS_PREPARED=no or false left the prepared graphs on, silently."""
    monkeypatch.setenv("HIGGS_PREPARED", value)
    code, err, out = run_inference(capsys, no_model, "--text", "Hi.")
    assert code == 2 and err == (f"error: $HIGGS_PREPARED must be 0 (load the original graphs) or 1 (prepare them, "
                                 f"the default), got {value!r}\n")


def test_takes_with_a_text_file_names_the_reason(capsys, no_model, tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("One line.\nAnother.\n")
    code, err, out = run_inference(capsys, no_model, "--text-file", lines, "--takes", "2")
    assert code == 2 and "--takes is for --text (one utterance" in err and "--stream" not in err, err
    assert not out.exists()


def output_rows(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    return [(tmp_path / "missing" / "x.wav", f"folder {tmp_path / 'missing'} does not exist"),
            (tmp_path / "a_file" / "x.wav", f"{tmp_path / 'a_file'} is a file, not a folder"),
            (Path("/proc/x.wav"), "cannot write in /proc"),  # probed by writing: refused even to root
            (tmp_path / "x.mp3", "unsupported format '.mp3'")]


def test_output_path_rows(capsys, no_model, tmp_path):
    for out, message in output_rows(tmp_path):
        code, err, _ = run_inference(capsys, no_model, "--text", "Hi.", out=out)
        assert code == 2 and "--out" in err and message in err, (out, err)
        assert err.count("\n") == 1 and "Traceback" not in err, (out, err)
        assert not out.exists()


def test_output_is_a_folder_row(capsys, no_model, tmp_path):
    folder = tmp_path / "out.d"  # a suffix that would read as an output format
    folder.mkdir()
    code = inference.main(["--model-path", str(no_model), "--text", "Hi.", "--out", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and f"--out {folder} is a folder, not an audio file" in err and "--out-dir" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err and not any(folder.iterdir())


TEXT_FILES = [("empty", b"", "is empty"), ("blank lines only", b"\n  \n\n", "is empty"),
              ("Latin-1", "caf\u00e9 au lait\n".encode("latin-1"), "is not UTF-8 text (byte 3"),
              ("binary", bytes(range(256)) * 20 + b"\x00" * 8, "is a binary file, not text")]


@pytest.mark.parametrize("case, data, message", TEXT_FILES, ids=[r[0] for r in TEXT_FILES])
def test_a_text_file_is_read_and_refused_before_the_model_loads(capsys, no_model, tmp_path, case, data, message):
    """--text-file is read as the job is built: an unreadable one is one line (exit 2) before the model folder is
    looked at, for a recording (--out) and for one file per line (--out-dir), and nothing is written."""
    text = tmp_path / "text.txt"
    text.write_bytes(data)
    for where in (["--out", str(tmp_path / "long.wav")], ["--out-dir", str(tmp_path / "lines")]):
        code = inference.main(["--model-path", str(no_model), "--text-file", str(text), *where])
        err = capsys.readouterr().err
        assert code == 2 and err == f"error: {text} {message}" + err.split(message, 1)[1], (where, err)
        assert err.count("\n") == 1 and "model folder" not in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]


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
    assert not any(tmp_path.iterdir())


def test_concurrent_build_row(capsys, tiny_ckpt, tmp_path):
    from filelock import FileLock

    (tmp_path / "onnx").mkdir()
    with FileLock(str(tmp_path / "onnx" / ".cpu_int4.lock")):
        code = optimize.main(["--model-dir", str(tiny_ckpt), "--output", str(tmp_path / "onnx")])
    err = capsys.readouterr().err
    assert code == 1 and "another optimize.py is building" in err
    assert not (tmp_path / "onnx" / "cpu_int4").exists()


def test_part_cache_rows(capsys, tiny_ckpt, tmp_path, monkeypatch):
    """`--part-cache` (or `$HIGGS_PART_CACHE`) that names a file, or a folder it cannot create, is one line before
    any work."""
    (tmp_path / "file").write_text("x")
    for where, message in ((tmp_path / "file", "is a file, not a folder"),
                           (tmp_path / "file" / "parts", "cannot create this folder")):
        code = optimize.main(["--model-dir", str(tiny_ckpt), "--output", str(tmp_path / "onnx"),
                              "--part-cache", str(where)])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, err
    monkeypatch.setenv("HIGGS_PART_CACHE", str(tmp_path / "file"))  # the same folder named by the environment
    code = optimize.main(["--model-dir", str(tiny_ckpt), "--output", str(tmp_path / "onnx")])
    err = capsys.readouterr().err
    assert code == 2 and "$HIGGS_PART_CACHE" in err and "is a file, not a folder" in err, err
    assert not (tmp_path / "onnx").exists()


def test_a_lexicon_that_is_no_regular_file_or_too_large_is_refused_at_once(capsys, no_model, tmp_path):
    """/dev/zero once ran until the OOM killer stopped it, a FIFO blocked for ever: each is refused by name in
    well under a second, before any model loads (the model path does not exist)."""
    import os
    import time

    from higgs_onnx.text.lexicon import MAX_FILE_BYTES

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.tsv"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing written
    rows = [(Path("/dev/zero"), "not a regular file (a device, a FIFO or a socket)"),
            (fifo, "not a regular file (a device, a FIFO or a socket)"),
            (big, f"{MAX_FILE_BYTES + 1:,} bytes; a lexicon file holds at most {MAX_FILE_BYTES:,}")]
    for path, message in rows:
        t0 = time.perf_counter()
        code, err, out = run_inference(capsys, no_model, "--text", "Hi.", "--lexicon", path)
        assert time.perf_counter() - t0 < 1.0, path
        assert code == 2 and f"--lexicon {path}: {message}" in err and err.count("\n") == 1, err
        assert "Traceback" not in err and not out.exists()
