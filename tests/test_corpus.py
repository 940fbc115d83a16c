"""Corpus synthesis on a real local Ray instance with 2 workers: bad rows recorded, reruns skip, a killed job
finishes on rerun with identical audio, duplicate ids refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def corpus(*args, **kw):
    return subprocess.run([sys.executable, "-m", "higgs_onnx.corpus", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "CI": "1"}, timeout=600, **kw)


def write_rows(path: Path, rows: list, malformed: bool = True) -> Path:
    lines = [json.dumps(r) for r in rows]
    if malformed:
        lines.insert(5, '{"id": "broken", "text": ')
    path.write_text("\n".join(lines) + "\n")
    return path


ROWS = [{"id": f"r{i:02d}", "text": f"Corpus row number {i} says a few more words than the last one.", "seed": i}
        for i in range(10)]


def manifest(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]


def test_rows_bad_rows_and_rerun(builds, tmp_path):
    src = write_rows(tmp_path / "in.jsonl", ROWS + [{"id": "nov", "text": "Who am I?", "voice": "nobody"}])
    out = tmp_path / "out"
    r = corpus("--model-path", builds["fp32"], "--input", src, "--out", out, "--workers", 2, "--batch", 2)
    assert r.returncode == 1, r.stderr  # a row failed: the exit code says so
    wavs = sorted(p.name for p in out.glob("*.wav"))
    assert wavs == [f"r{i:02d}.wav" for i in range(10)]
    entries = {e["id"]: e for e in manifest(out)}
    assert len(entries) == 12 and list(entries)[:5] == [f"r{i:02d}" for i in range(5)]  # input order
    assert "malformed JSON on line 6" in entries["line-6"]["error"]
    assert "unknown voice 'nobody'" in entries["nov"]["error"]
    ok = [e for e in entries.values() if e["error"] is None]
    assert len(ok) == 10 and all(e["duration_s"] > 0 and e["rows"] > 0 and e["stop_reason"] == "eoc" for e in ok)
    assert len({e["worker"] for e in ok}) == 2  # both actors worked
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.wav")}
    r = corpus("--model-path", builds["fp32"], "--input", src, "--out", out, "--workers", 2, "--batch", 2)
    assert r.returncode == 1 and "10 done before" in r.stderr, r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.wav")} == before  # nothing made again


def test_kill_and_rerun_gives_identical_audio(builds, tmp_path):
    src = write_rows(tmp_path / "in.jsonl", ROWS, malformed=False)
    whole = tmp_path / "whole"
    r = corpus("--model-path", builds["fp32"], "--input", src, "--out", whole, "--workers", 2, "--batch", 1)
    assert r.returncode == 0, r.stderr
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "higgs_onnx.corpus", "--model-path", str(builds["fp32"]),
                             "--input", str(src), "--out", str(cut), "--workers", "2", "--batch", "1"], cwd=ROOT,
                            env={**os.environ, "CI": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    log = cut / "manifest.jsonl"
    while not (log.is_file() and len(log.read_text().splitlines()) >= 2) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray processes it started
    proc.wait()
    r = corpus("--model-path", builds["fp32"], "--input", src, "--out", cut, "--workers", 2, "--batch", 1)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in cut.glob("*.wav")) == sorted(p.name for p in whole.glob("*.wav"))
    for p in whole.glob("*.wav"):
        assert (cut / p.name).read_bytes() == p.read_bytes(), p.name
    assert len(manifest(cut)) == 10


def test_duplicate_ids_are_refused_before_anything_starts(builds, tmp_path):
    src = write_rows(tmp_path / "in.jsonl", ROWS[:3] + [ROWS[1]], malformed=False)
    r = corpus("--model-path", builds["fp32"], "--input", src, "--out", tmp_path / "out")
    assert r.returncode == 2 and "duplicate id 'r01' on lines 2 and 4" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
