"""Long-form: a text file becomes one recording in one voice; resumable after a kill; bad files refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from higgs_onnx.longform.render import LongForm, LongFormOptions, generate_long
from higgs_onnx.runtime.model import HiggsTTS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

CHAPTER = """The first paragraph opens the chapter. It has a few sentences, and Dr. Smith arrives at 7:45 with 3.5 kilos
of apples. Nobody expected him so early.

The second paragraph goes on. <|emotion:elation|>Everyone was happy to see him! They talked for hours, and then...
nothing happened for a while. "Stop," he said. Then he left.

A third, short paragraph ends it."""


def cli(*args, **kw):
    return subprocess.run([sys.executable, str(ROOT / "inference.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "CI": "1"}, timeout=600, **kw)


@pytest.fixture(scope="module")
def tts(builds):
    return HiggsTTS(builds["int4"], verify=False)


SMALL = LongFormOptions(target_chars=80, max_chars=160)


def test_one_recording_in_pieces_with_history(tts, tmp_path):
    out = tmp_path / "chapter.wav"
    job = LongForm(tts, CHAPTER, out, lf=SMALL)
    assert len(job.pieces) >= 4 and job.pieces[-1].paragraph_end
    seen = []
    original = tts.request

    def spy(text, **kw):  # record what each piece is conditioned on
        seen.append((text, kw.get("voice"), [t for t, _ in kw.get("history", [])]))
        return original(text, **kw)

    tts.request = spy
    try:
        pieces = list(job.run())
    finally:
        del tts.request
    job.write()  # again: every piece from the work folder
    assert out.is_file() and not job.work.exists()
    audio, sr = sf.read(out)
    assert sr == tts.facts.sample_rate
    assert abs(audio.size - sum(p.waveform.size for p in pieces)) <= 1  # PCM16 file = the joined pieces
    assert all(p.stop_reason == "eoc" for p in pieces)
    # piece 1 is zero-shot; every later piece is cloned from piece 1's own codes and hears the previous piece
    assert seen[0][1] is None and not seen[0][2]
    first_voice = seen[1][1]
    assert first_voice is not None and first_voice.ref_text == job.pieces[0].text
    assert all(v is first_voice for _, v, _ in seen[1:])
    assert seen[2][2] == [job.pieces[1].text]
    # joins: silence between pieces, faded edges (no step at a join)
    w = pieces[0].waveform
    pause = int(SMALL.pause_s * sr) if not job.pieces[0].paragraph_end else int(SMALL.paragraph_pause_s * sr)
    assert not w[-pause:].any() and abs(w[-pause - 1]) < 0.05 * max(np.abs(w).max(), 1e-6)


def test_python_api_with_a_voice(tts, tmp_path):
    voice = tts.make_voice(DATA / "ref_en_24k.wav", (DATA / "ref_en_24k.txt").read_text().strip())
    out = generate_long(tts, CHAPTER, tmp_path / "v.wav", voice=voice, lf=SMALL)
    assert sf.info(out).duration > 1.0


def test_cli_kill_and_resume_gives_the_same_file(builds, tmp_path):
    text = tmp_path / "chapter.txt"
    text.write_text((CHAPTER + "\n\n") * 3)
    whole = tmp_path / "whole.wav"
    r = cli("--model-path", builds["int4"], "--text-file", text, "--out", whole, "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "piece 1/" in r.stderr and "ETA" in r.stderr
    cut = tmp_path / "cut.wav"
    proc = subprocess.Popen([sys.executable, str(ROOT / "inference.py"), "--model-path", str(builds["int4"]),
                             "--text-file", str(text), "--out", str(cut), "--seed", "3"], cwd=ROOT,
                            env={**os.environ, "CI": "1"}, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    work = cut.with_name("cut.wav.work")
    deadline = time.monotonic() + 300
    while len(list(work.glob("piece-*.npz"))) < 2 and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not cut.exists() and work.is_dir()
    r = cli("--model-path", builds["int4"], "--text-file", text, "--out", cut, "--seed", "3")
    assert r.returncode == 2 and "--resume" in r.stderr  # never overwrites an unfinished job silently
    r = cli("--model-path", builds["int4"], "--text-file", text, "--out", cut, "--seed", "3", "--resume")
    assert r.returncode == 0, r.stderr
    assert "from the work folder" in r.stderr
    assert cut.read_bytes() == whole.read_bytes() and not work.exists()


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"), (b"  \n\n ", "is empty"), (b"\x00\x01binary\x00", "binary file"),
    ("caf\u00e9 cr\u00e8me".encode("latin-1"), "is not UTF-8 text")], ids=["empty", "blank", "binary", "latin-1"])
def test_bad_text_files(builds, tmp_path, content, message):
    path = tmp_path / "t.txt"
    path.write_bytes(content)
    r = cli("--model-path", builds["int4"], "--text-file", path, "--out", tmp_path / "o.wav")
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "o.wav").exists()


def test_only_tags_is_refused(builds, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("<|emotion:elation|> <|prosody:pause|>")
    r = cli("--model-path", builds["int4"], "--text-file", path, "--out", tmp_path / "o.wav")
    assert r.returncode == 2 and "only control tags" in r.stderr, r.stderr
