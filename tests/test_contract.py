"""The request contract (issue 20, classes 1-4 and 10) on the tiny int4 export: every refusal before any work, one
clear line and exit 2 in the CLI; what is accepted still speaks."""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import inference
from higgs_onnx.generation.contract import ContractError, NoAudioError
from higgs_onnx.generation.options import DEFAULT_MAX_ROWS
from higgs_onnx.runtime.model import HiggsTTS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def model(builds):
    return builds["int4"]


@pytest.fixture(scope="module")
def tts(model):
    return HiggsTTS(model)


def run_cli(capsys, *args):
    code = inference.main([*map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- class 1: control tokens ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, names", [
    ("Hello <|audio|> world <|text|> again.", "<|audio|>, <|text|>"),
    ("Stop here <|eoc|> please.", "<|eoc|>"),
    ("The end.<|endoftext|>", "<|endoftext|>"),
    ("<|im_start|>user hello", "<|im_start|>"),
    ("Call <tool_call> now.", "<tool_call>"),
    ("Not yet <|reserved_a|>.", "<|reserved_a|>"),
])
def test_special_tokens_in_text_are_refused_by_the_cli(capsys, model, tmp_path, text, names):
    out = tmp_path / "a.wav"
    code, _, err = run_cli(capsys, "--model-path", model, "--text", text, "--out", out)
    assert code == 2 and err.count("\n") == 1 and "special token" in err and names in err
    assert not out.exists()


def test_a_normal_tag_beside_is_spoken(capsys, model, tmp_path):
    out = tmp_path / "tag.wav"
    code, stdout, _ = run_cli(capsys, "--model-path", model, "--text", "<|emotion:elation|>Hello world.", "--out", out,
                              "--max-rows", 30)
    assert code == 0 and sf.info(out).frames > 0


def test_special_tokens_in_a_transcript_are_refused_before_encoding(tts, monkeypatch):
    calls = []
    monkeypatch.setattr(tts, "encode_audio", lambda wav: calls.append(wav))
    with pytest.raises(ContractError, match=r"reference transcript contains the special token <\|im_end\|>") as e:
        tts.make_voice(DATA / "ref_en_24k.wav", "Hello<|im_end|> there")
    assert e.value.param == "ref_text" and calls == []


def test_python_api_refuses_special_tokens(tts):
    with pytest.raises(ContractError) as e:
        tts.request("Say <|tts|> now.")
    assert e.value.code == "special_token" and e.value.status == 400


# -- class 2: nothing cut to fit -----------------------------------------------------------------------------------
def test_a_text_too_long_for_one_request_is_refused_with_the_numbers(capsys, model, tmp_path):
    text = "This sentence is spoken many times over. " * 190  # ~7,600 characters
    code, _, err = run_cli(capsys, "--model-path", model, "--text", text, "--out", tmp_path / "long.wav")
    assert code == 2 and "characters" in err and "rows" in err and "--text-file" in err
    assert not (tmp_path / "long.wav").exists()


def test_max_rows_that_does_not_fit_is_refused(tts):
    ctx = tts.facts.max_positions
    with pytest.raises(ContractError, match=f"max_rows asks for {ctx - 1} rows.*holds {ctx} positions") as e:
        tts.request("Hello.", max_rows=ctx - 1)
    assert e.value.param == "max_rows" and e.value.code == "context_length_exceeded"
    req = tts.request("Hello.", max_rows=ctx - 20)  # fits: kept as asked, not cut
    assert req.max_rows == ctx - 20


def test_a_request_for_a_pool_slot_must_fit_the_slot(tts):
    with pytest.raises(ContractError, match="a batch slot here holds 100 positions"):
        tts.request("Hello there.", max_rows=95, slot=100)
    assert tts.request("Hello there.", slot=300).max_rows <= 300 - 5  # default budget: what fits the slot


def test_default_budget_is_the_default_limit_or_what_fits(tts):
    assert tts.request("Hello.").max_rows == DEFAULT_MAX_ROWS
    text = "word " * 200  # needs >= 1,255 rows (~1,000 characters at 20 a second): fits the default limit
    assert tts.request(text).max_rows == DEFAULT_MAX_ROWS
    with pytest.raises(ContractError, match="only .* rows fit after its .*-position prompt") as e:
        tts.request(text, slot=1000)
    assert e.value.status == 413


def test_a_scheduler_never_cuts_a_request_to_its_pool(tts):
    sched = tts.scheduler(1, 64)
    req = tts.request("Hello.", max_rows=100)  # made for no slot: does not fit this pool's 64 positions
    handle = sched.submit(req)
    sched.run_until_idle()
    with pytest.raises(ContractError, match="slots hold 64 positions"):
        handle.wait()
    assert handle.state == "failed" and sched.pool.in_use == 0
    sched.close()


def test_a_voice_too_long_for_the_context_is_refused(tts, monkeypatch):
    f = tts.facts
    transcript = "word " * (f.max_positions // 2)
    with pytest.raises(ContractError, match="the voice's prompt is") as e:
        tts.make_voice(DATA / "ref_en_24k.wav", transcript)
    assert e.value.param == "ref_text"


# -- class 3: success with no audio ----------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_max_rows_below_one_frame_is_refused(capsys, model, tmp_path, rows):
    out = tmp_path / "few.wav"
    code, _, err = run_cli(capsys, "--model-path", model, "--text", "Hello.", "--max-rows", rows, "--out", out)
    assert code == 2 and "at least 8 rows are needed for one audio frame" in err and not out.exists()


def test_the_fewest_rows_give_one_frame(tts):
    speech = tts.generate("Hello.", max_rows=8, temperature=0)
    assert speech.waveform.size == tts.facts.hop


def test_a_generation_without_frames_is_an_error(tts, monkeypatch):
    req = tts.request("Hello.", max_rows=8)
    monkeypatch.setattr(req, "new_frames", lambda: np.zeros((0, tts.facts.num_codebooks), np.int64))
    with pytest.raises(NoAudioError, match="without one audio frame"):
        tts.run(req, "speech")


# -- class 4: outputs checked before the work, audio kept when the final write fails ------------------------------
@pytest.mark.parametrize("out, message", [
    ("/proc/x.wav", "cannot write in /proc"),
    ("{tmp}/missing/x.wav", "does not exist"),
    ("{tmp}/file.txt/x.wav", "is a file, not a folder"),
    ("{tmp}", "is a folder, not an audio file"),
    ("{tmp}/x.mp4", "unsupported format '.mp4'"),
])
def test_outputs_are_checked_before_the_model_loads(capsys, model, tmp_path, monkeypatch, out, message):
    (tmp_path / "file.txt").write_text("x")
    loaded = []
    monkeypatch.setattr(HiggsTTS, "__init__", lambda *a, **k: loaded.append(1))
    code, _, err = run_cli(capsys, "--model-path", model, "--text", "Hello.", "--out", out.format(tmp=tmp_path))
    assert code == 2 and message in err and loaded == []


@pytest.mark.parametrize("flag, name", [("--save-codes", "rows.txt"), ("--save-voice", "voice.wav")])
def test_side_outputs_are_checked_too(capsys, model, tmp_path, flag, name):
    extra = ["--ref-audio", DATA / "ref_en_24k.wav"] if flag == "--save-voice" else []
    code, _, err = run_cli(capsys, "--model-path", model, "--text", "Hello.", "--out", tmp_path / "a.wav", *extra,
                           flag, tmp_path / name)
    assert code == 2 and f"{flag} " in err and "unsupported format" in err


def test_a_failing_final_write_keeps_the_audio(capsys, model, tmp_path, monkeypatch):
    import higgs_onnx.speak

    def full_disk(path, wav, sr):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(higgs_onnx.speak, "write_audio", full_disk)  # the CLI's job writes through it
    out = tmp_path / "a.wav"
    code, _, err = run_cli(capsys, "--model-path", model, "--text", "Hello.", "--max-rows", 20, "--out", out)
    assert code == 1 and f"cannot write {out} (No space left on device)" in err and err.count("\n") == 1
    kept = Path(err.split("the audio is kept in ")[1].strip())
    try:
        assert sf.info(kept).frames == (20 - 7) * 960
    finally:
        kept.unlink()


def test_files_follow_the_umask_and_keep_an_overwritten_mode(capsys, model, tmp_path):
    out = tmp_path / "a.wav"
    old = os.umask(0o027)
    try:
        assert run_cli(capsys, "--model-path", model, "--text", "Hello.", "--max-rows", 20, "--out", out)[0] == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    out.chmod(0o644)
    assert run_cli(capsys, "--model-path", model, "--text", "Hello.", "--max-rows", 20, "--out", out)[0] == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


# -- class 10: CLI details ----------------------------------------------------------------------------------------
def test_bytes_that_are_not_utf8_are_named_as_such(model, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "inference.py"), "--model-path", str(model), "--text",
                          b"Hi \xff there", "--out", str(tmp_path / "a.wav")], capture_output=True, cwd=ROOT,
                         env={**os.environ, "CI": "1"}, timeout=300)
    assert out.returncode == 2 and b"not UTF-8" in out.stderr and b"control characters" not in out.stderr


def test_importing_the_runtime_writes_nothing_under_home(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"HOME": str(tmp_path)}
    env.pop("ORT_DISABLE_TELEMETRY", None)
    subprocess.run([sys.executable, "-c", "import higgs_onnx.runtime.session, onnxruntime"], check=True, env=env,
                   cwd=ROOT, timeout=120)
    assert list(tmp_path.rglob("*")) == []


# -- eval: its prompts go through the same contract ------------------------------------------------------------------
@pytest.mark.parametrize("prompts, extra, message", [
    ("Hello <|audio|> there.\nA fine line.\n", [], "prompt 1 ('Hello <|audio|> there.'): text contains the special "
                                                   "token <|audio|>"),
    (None, ["--max-rows", "4095"], "max_rows asks for 4095 rows"),
])
def test_eval_prompts_are_checked_before_the_reference_loads(model, tmp_path, monkeypatch, capsys, prompts, extra,
                                                             message):
    import eval as eval_cli
    from higgs_onnx.reference import model as reference

    if prompts:
        (tmp_path / "p.txt").write_text(prompts)
        extra = [*extra, "--prompts", str(tmp_path / "p.txt")]
    loaded = []
    monkeypatch.setattr(reference.ReferenceModel, "__init__", lambda *a, **k: loaded.append(1))
    code = eval_cli.main(["--model-path", str(model), *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and loaded == []


# -- what the hostile probe found (second round) ----------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("<|audio|>", "special token <|audio|>"),
    ("\u200b\u200b", "no letters or digits to speak"),
    ("\ufeff", "no letters or digits to speak"),
    ("...!?", "no letters or digits to speak"),
])
def test_text_without_words_or_only_a_special_token(capsys, model, tmp_path, text, message):
    code, _, err = run_cli(capsys, "--model-path", model, "--text", text, "--out", tmp_path / "a.wav")
    assert code == 2 and message in err


def test_a_text_file_from_a_pipe_is_read(model, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "inference.py"), "--model-path", str(model), "--text-file",
                          "/dev/stdin", "--out", str(tmp_path / "pipe.wav")], input="Hello from a pipe.",
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "CI": "1"}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert sf.info(tmp_path / "pipe.wav").frames > 0


@pytest.mark.parametrize("make, message", [
    (lambda: (np.full(48000, 0.5, np.float32), 24000), "constant (every sample is 0.5)"),
    (lambda: (np.array([0.1, -0.1], np.float32), 24000), "at least 1 s is needed"),
    (lambda: (np.random.default_rng(0).uniform(-0.3, 0.3, (24000, 1000)).astype(np.float32), 24000),
     "1000 channels"),
    (lambda: (np.random.default_rng(0).uniform(-0.3, 0.3, 48000).astype(np.float32), 1), "sample rate is 1 Hz"),
    (lambda: (np.tile(np.float32([0.2, -0.2]), 24000), 24000), "2 distinct sample values"),
])
def test_references_follow_the_servers_rules_everywhere(tts, make, message):
    from higgs_onnx.audio import AudioError

    with pytest.raises(AudioError, match=re.escape(message)):
        tts.make_voice(make())


def test_a_device_as_reference_audio(capsys, model, tmp_path):
    code, _, err = run_cli(capsys, "--model-path", model, "--text", "Hi.", "--ref-audio", "/dev/null", "--out",
                           tmp_path / "a.wav")
    assert code == 2 and "is not a regular file" in err


@pytest.mark.parametrize("make, message", [
    (lambda p: np.save(p, np.zeros((0, 8), np.int64)), "has no rows"),
    (lambda p: p.write_bytes((DATA / "ref_en_24k.wav").read_bytes()), "is not a NumPy .npy array of code rows"),
    (lambda p: np.save(p, np.full((20, 8), 5000, np.int64)), "codes must lie in [0, "),
])
def test_bad_code_files(capsys, model, tmp_path, make, message):
    path = tmp_path / "codes.npy"
    make(path)
    code, _, err = run_cli(capsys, "--model-path", model, "--codes", path, "--out", tmp_path / "a.wav")
    assert code == 2 and message in err


def test_argparse_errors_and_absurd_threads_are_one_line(capsys, model, tmp_path):
    with pytest.raises(SystemExit) as e:
        inference.main(["--model-path", str(model), "--text", "Hi.", "--max-rows", "abc", "--out", "a.wav"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "invalid int value: 'abc'" in err
    code, _, err = run_cli(capsys, "--model-path", model, "--text", "Hi.", "--threads", 100000, "--out",
                           tmp_path / "a.wav")
    assert code == 2 and "threads must be at most" in err


@pytest.mark.parametrize("args, message", [
    (["--prompts", "{tmp}"], "is a folder, not a text file"),
    (["--prompts", "{tmp}/latin1.txt"], "is not UTF-8 text"),
    (["--tolerance", "nan"], "--tolerance must be a finite number > 0"),
    (["--teacher-codes", "{tmp}/bad.npy"], "--teacher-codes"),
    (["--recordings", "{tmp}/latin1.txt"], "cannot read reference audio"),
])
def test_eval_inputs_are_checked_before_the_reference_loads(model, tmp_path, monkeypatch, capsys, args, message):
    import eval as eval_cli
    from higgs_onnx.reference import model as reference

    (tmp_path / "latin1.txt").write_bytes("Caf\xe9 au lait.\n".encode("latin-1"))
    np.save(tmp_path / "bad.npy", np.full((20, 8), 5000, np.int64))
    loaded = []
    monkeypatch.setattr(reference.ReferenceModel, "__init__", lambda *a, **k: loaded.append(1))
    code = eval_cli.main(["--model-path", str(model), *[a.format(tmp=tmp_path) for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and message in err and loaded == [], err


def test_a_corpus_text_that_is_not_a_string(tmp_path):
    from higgs_onnx.corpus import read_rows

    (tmp_path / "in.jsonl").write_text('{"id": "a", "text": 123}\n{"id": "b", "text": "Fine."}\n')
    rows = read_rows(tmp_path / "in.jsonl")
    assert rows[0].error == "text must be a string, got int 123" and rows[1].error is None
