"""Long-form in lanes with KV continuation, and `--text-file --out-dir` lines run together: a continued piece's
codes equal a from-scratch prefill of the same multi-turn prompt; lanes split at paragraphs; a killed job with
lanes resumes to the same bytes; the plan keeps its lane count; lines in one scheduler equal each line alone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from higgs_onnx.longform.render import LongForm, LongFormOptions, split_lanes
from higgs_onnx.longform.split import Piece

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = """The first paragraph opens the chapter. It has a few sentences, and nobody expected him so early.

The second paragraph goes on. Everyone was happy to see him! They talked for hours about the weather.

A third, short paragraph. It ends here.

The fourth paragraph is the last one of this chapter, and it closes the story with a few more words."""
SMALL = LongFormOptions(target_chars=80, max_chars=160)


def cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "inference.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "CI": "1"}, timeout=600)


def test_lanes_are_runs_of_whole_paragraphs_of_about_equal_length():
    pieces = [Piece("a" * n, end) for n, end in [(50, False), (50, True), (30, True), (70, False), (30, True),
                                                 (100, True)]]
    assert split_lanes(pieces, 1) == [(0, 6)]
    two = split_lanes(pieces, 2)
    assert two == [(0, 3), (3, 6)]  # 130 + 200 characters: the cut nearest half of 330, at a paragraph end
    four = split_lanes(pieces, 4)
    assert len(four) == 4 and all(pieces[b - 1].paragraph_end for _, b in four)
    assert split_lanes(pieces, 9) == [(0, 2), (2, 3), (3, 5), (5, 6)]  # at most one lane per paragraph
    for lanes in (two, four):
        joined = all(a[1] == b[0] for a, b in zip(lanes, lanes[1:], strict=False))
        assert lanes[0][0] == 0 and lanes[-1][1] == 6 and joined




@pytest.mark.slow
def test_kv_continuation_equals_a_from_scratch_prefill(tts, tmp_path):
    """Every piece after the first continues the lane's cache (only its own text is prefilled); the same
    multi-turn prompt prefilled from scratch, alone, gives the same rows (tiny fp32 export)."""
    job = LongForm(tts, CHAPTER, tmp_path / "c.wav", lf=SMALL, lanes=1)
    pieces = list(job.run())
    assert len(pieces) >= 4 and job.stats["positions_prefilled"] < job.stats["rows_generated"] / 2
    done = {i: job._load(i) for i in range(len(pieces))}
    continued = 0
    for i in range(1, len(pieces)):
        with_voice, history, cont = job._context(i, done)
        continued += cont
        req, used = job._request(i, done, 0, prev=None)  # the same prompt, all of it prefilled
        assert not used and len(history) == (i if cont else len(history))
        with tts.scheduler() as sched:
            rows = sched.submit(req).wait().generated
        np.testing.assert_array_equal(rows, done[i]["gen"], err_msg=f"piece {i + 1}")
    assert continued == len(pieces) - 1  # the whole chapter fits one slot of the tiny model
    job.close()


@pytest.mark.slow
def test_lanes_kill_and_resume_give_the_same_file(builds, tmp_path):
    text = tmp_path / "chapter.txt"
    text.write_text((CHAPTER + "\n\n") * 2)
    model = builds["int4"]  # the resumed lanes replay their prefill calls: the same bytes on int4 too
    whole = tmp_path / "whole.wav"
    r = cli("--model-path", model, "--text-file", text, "--out", whole, "--seed", "5", "--lanes", "3")
    assert r.returncode == 0, r.stderr
    assert "in 3 lanes" in r.stderr and "mean batch" in r.stdout and "prefilled" in r.stdout
    cut = tmp_path / "cut.wav"
    proc = subprocess.Popen([sys.executable, str(ROOT / "inference.py"), "--model-path", str(model), "--text-file",
                             str(text), "--out", str(cut), "--seed", "5", "--lanes", "3"], cwd=ROOT,
                            env={**os.environ, "CI": "1"}, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    work = cut.with_name("cut.wav.work")
    deadline = time.monotonic() + 300
    while len([q for q in work.glob("piece-*.npz") if ".partial" not in q.name]) < 3 and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not cut.exists()
    kept = [q for q in work.glob("piece-*.npz") if re.fullmatch(r"piece-\d{4}\.npz", q.name)]  # not a .partial.npz
    r = cli("--model-path", model, "--text-file", text, "--out", cut, "--seed", "5", "--lanes", "2", "--resume")
    assert r.returncode == 2 and "planned with 3 lanes" in r.stderr, r.stderr
    r = cli("--model-path", model, "--text-file", text, "--out", cut, "--seed", "5", "--resume")  # the plan's 3
    assert r.returncode == 0, r.stderr
    assert "in 3 lanes" in r.stderr and "from the work folder" in r.stderr
    # every piece is there, in order, the ones made before the kill read back (the same bytes as they were made);
    # the pieces made after it meet other batch-mates than the uninterrupted run's did (the batched attention
    # rounds by its batch-mates' lengths), so the file is the same text in the same voice, not the same bytes
    pieces = re.findall(r"piece (\d+)/(\d+)", r.stderr)
    assert [int(k) for k, _ in pieces] == list(range(1, int(pieces[0][1]) + 1))
    assert r.stderr.count("from the work folder") == len(kept) >= 3, (len(kept), r.stderr)
    assert 0.5 < sf.info(cut).frames / sf.info(whole).frames < 2
    assert not work.exists()


@pytest.mark.slow
def test_out_dir_lines_run_together_and_equal_each_line_alone(builds, tts, tmp_path):
    lines = ["The first line is short.", "The second line is a little longer than the first one, by far.",
             "Third line here.", "And a fourth one, to fill the batch."]
    src = tmp_path / "lines.txt"
    src.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")
    r = cli("--model-path", builds["fp32"], "--text-file", src, "--out-dir", tmp_path / "out", "--lanes", "3",
            "--seed", "2")
    assert r.returncode == 0, r.stderr
    summary = r.stdout.strip().splitlines()[-1]
    assert "4 files" in summary and "3 lanes" in summary
    assert float(summary.split("mean batch ")[1]) > 1.5
    for i, line in enumerate(lines, 1):
        want = tts.generate(line, seed=2).waveform
        got, sr = sf.read(tmp_path / "out" / f"{i:04d}.wav", dtype="float32")
        assert sr == tts.facts.sample_rate and got.shape == want.shape
        assert np.abs(got - want).max() <= 1 / 32767 + 1e-6  # PCM16 of the same samples


@pytest.mark.slow
def test_out_dir_a_bad_line_is_refused_before_any_work(builds, tmp_path):
    src = tmp_path / "lines.txt"
    src.write_text("A good line.\nA line with <|audio|> in it.\n")
    r = cli("--model-path", builds["int4"], "--text-file", src, "--out-dir", tmp_path / "out")
    assert r.returncode == 2 and "line 2" in r.stderr and "<|audio|>" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not list((tmp_path / "out").glob("*.wav"))
    r = cli("--model-path", builds["int4"], "--text-file", src, "--out-dir", tmp_path / "out", "--lanes", "0")
    assert r.returncode == 2 and "--lanes" in r.stderr


@pytest.mark.slow
def test_a_retried_piece_cuts_its_continued_cache_back(tts, tmp_path):
    """A piece that reaches its row limit is made once more with another seed in the same context: a continued
    piece's cache is cut back to where the piece started, so the retry equals a from-scratch prefill of its
    prompt."""
    from higgs_onnx.generation.options import GenerationOptions

    text = "The first sentence is here. And a second one follows it.\n\nA new paragraph starts now, and ends."
    job = LongForm(tts, text, tmp_path / "r.wav", options=GenerationOptions(ignore_eoc=True),
                   lf=LongFormOptions(target_chars=30, max_chars=60), lanes=1)
    pieces = list(job.run())
    assert len(pieces) >= 3 and all(p.retried and p.stop_reason == "max_rows" for p in pieces)
    done = {i: job._load(i) for i in range(len(pieces))}
    for i in range(1, len(pieces)):
        assert job._context(i, done)[2]  # continued
        req, _ = job._request(i, done, 1, prev=None)  # the retry's prompt and seed, prefilled from scratch
        with tts.scheduler() as sched:
            rows = sched.submit(req).wait().generated
        np.testing.assert_array_equal(rows, done[i]["gen"], err_msg=f"piece {i + 1}")
    job.close()
