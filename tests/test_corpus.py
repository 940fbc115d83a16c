"""Corpus synthesis on a real local Ray instance with 2 workers: bad rows recorded (malformed lines by their line,
whatever the other ids; rows the request contract refuses; a file that cannot be written), reruns skip, a killed job
finishes on rerun with identical audio, SIGTERM / Ctrl-C to the driver alone stops every Ray process of its
instance, duplicate ids refused before anything starts, one worker's batch kept full by its one scheduler, workers
killed mid-job replaced without losing a row. Usage errors and the pieces without Ray:
tests/test_corpus_input.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from corpus_runs import corpus, manifest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def write_rows(path: Path, rows: list, malformed: bool = True, bom: bool = False) -> Path:
    lines = [json.dumps(r) for r in rows]
    if malformed:
        lines.insert(5, '{"id": "broken", "text": ')
    path.write_bytes(b"\xef\xbb\xbf" * bom + ("\n".join(lines) + "\n").encode())
    return path


ROWS = [{"id": f"r{i:02d}", "text": f"Corpus row number {i} says a few more words than the last one.", "seed": i}
        for i in range(10)]


# rows every one of which must fail, each for its own reason, in the same run as the good ones
BAD = [{"id": "nov", "text": "Who am I?", "voice": "nobody"},
       {"id": "long", "text": ("A long row of text that no single request of the pool can speak. " * 80)[:5000]},
       {"id": "short", "text": "Too few rows for one audio frame.", "max_rows": 1},
       {"id": "folder", "text": "Its file's name is taken by a folder.", "seed": 3}]
# a real row whose id is what the malformed line 6 was once recorded as: both must be reported, each for itself
TWIN = {"id": "line-6", "text": "A real row named like the malformed line.", "seed": 11}


def test_rows_bad_rows_and_rerun(builds, tmp_path):
    """One run with every kind of bad row beside the good ones (a UTF-8 BOM on line 1, under umask 027), then a
    rerun: it makes nothing again and reports the same failures, the malformed line by its line number."""
    src = write_rows(tmp_path / "in.jsonl", ROWS + BAD + [TWIN], bom=True)
    out = tmp_path / "out"
    (out / "folder.wav").mkdir(parents=True)  # the row's file cannot be written
    args = ("--model-path", builds["fp32"], "--input", src, "--out", out, "--workers", 2, "--batch", 2)
    r = corpus(*args, preexec_fn=lambda: os.umask(0o027))
    assert r.returncode == 1, r.stderr  # rows failed: the exit code says so
    wavs = sorted(p.name for p in out.glob("*.wav") if p.is_file())
    assert wavs == sorted([f"r{i:02d}.wav" for i in range(10)] + ["line-6.wav"])  # r00 is line 1, after the BOM
    entries = manifest(out)
    assert len(entries) == 16  # one per input line, in input order
    assert [e["id"] for e in entries[:5]] == [f"r{i:02d}" for i in range(5)]
    assert entries[5] == {"id": None, "line": 6, "error": entries[5]["error"]}
    assert entries[5]["error"].startswith("malformed JSON on line 6: ")
    by_id = {e["id"]: e for e in entries if e["id"] is not None}
    assert by_id["line-6"]["error"] is None and by_id["line-6"]["file"] == "line-6.wav"
    assert "unknown voice 'nobody'" in by_id["nov"]["error"]
    long = by_id["long"]["error"]  # refused for the pool's slot by the request contract, never cut to fit
    assert "the text is 5000 characters" in long and "3072 positions" in long and "long-form" in long, long
    assert by_id["short"]["error"].startswith("max_rows is 1; at least 8 rows are needed for one audio frame")
    folder = by_id["folder"]["error"]
    assert f"{out / 'folder.wav'} is a folder" in folder and "Errno" not in folder and "\n" not in folder, folder
    ok = [e for e in entries if e["error"] is None]
    assert len(ok) == 11 and all(e["duration_s"] > 0 and e["rows"] > 0 and e["stop_reason"] == "eoc" for e in ok)
    assert len({e["worker"] for e in ok}) == 2  # both actors worked
    assert "11 of 16 rows made" in r.stdout and "5 failed: line 6, nov, long, short, folder" in r.stdout, r.stdout
    for p in [out / "manifest.jsonl", *out.glob("*.wav")]:  # the umask, not mkstemp's 0600
        assert p.is_dir() or p.stat().st_mode & 0o777 == 0o640, (p, oct(p.stat().st_mode))
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.wav")}
    r = corpus(*args)
    assert r.returncode == 1 and "11 done before, 4 to make, 1 bad" in r.stderr, r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.wav")} == before  # nothing made again
    again = manifest(out)
    assert len(again) == 16 and again[5]["line"] == 6 and again[5]["id"] is None  # still reported
    assert "5 failed: line 6, nov, long, short, folder" in r.stdout, r.stdout


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
    tree = _descendants(proc.pid) if Path("/proc/self/stat").is_file() else {}
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray processes it started
    for pid in tree:  # a Ray worker outside the group would go on writing a row while the rerun makes it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    while any(_alive(pid, start) for pid, (start, _) in tree.items()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sessions = _sessions(tree)
    for folder in sessions:  # only a SIGKILL leaves the instance's private folder behind: tidy up after the test
        shutil.rmtree(folder, ignore_errors=True)
    r = corpus("--model-path", builds["fp32"], "--input", src, "--out", cut, "--workers", 2, "--batch", 1)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in cut.glob("*.wav")) == sorted(p.name for p in whole.glob("*.wav"))
    for p in whole.glob("*.wav"):
        assert (cut / p.name).read_bytes() == p.read_bytes(), p.name
    assert len(manifest(cut)) == 10


# mixed lengths: each row stops at its max_rows (the tiny model's own stop comes at ~260 rows), 24 to 259 rows
MIXED = [{"id": f"m{i:02d}", "text": f"Mixed row {i} says {'a few more words ' * (1 + i % 4)}for the batch.",
          "seed": i, "max_rows": 24 + (i * 53) % 236} for i in range(24)]


def test_one_worker_keeps_its_batch_full(builds, tmp_path):
    """24 rows of mixed lengths through one worker at batch 4: one scheduler and one slot pool for the actor's life,
    rows pulled as slots free, so every decoder step that began with 4 or more rows still to make advanced ~4 rows
    (static batching of 4-row units, as before, gives 2.37 on these lengths: each unit waits for its longest row)."""
    src = write_rows(tmp_path / "in.jsonl", MIXED, malformed=False)
    out = tmp_path / "out"
    r = corpus("--model-path", builds["int4"], "--input", src, "--out", out, "--workers", 1, "--batch", 4)
    assert r.returncode == 0, r.stderr
    entries = manifest(out)
    assert len(entries) == 24 and all(e["error"] is None for e in entries)
    assert len({e["rows"] for e in entries}) >= 12  # mixed lengths indeed
    summary = json.loads((out / "summary.json").read_text())
    [w] = summary["workers"]
    assert w["pools"] == 1 and w["made"] == 24  # 24 calls, one pool
    assert w["decoder_rows"] == sum(e["rows"] for e in entries)  # the scheduler's count: every generated row
    assert w["full_steps"] > 0 and w["full_mean_batch"] >= 0.95 * 4, w
    assert w["mean_batch"] <= w["full_mean_batch"] and w["rows_per_s"] > 0
    assert f"{w['worker']} mean batch {w['mean_batch']:.2f} ({w['full_mean_batch']:.2f} while >= 4 rows remained)" \
        in r.stdout and "rows/s in all" in r.stdout, r.stdout


def test_workers_that_die_mid_job_are_replaced_and_no_row_is_lost(builds, tmp_path):
    """SIGKILL of the worker's process (an out-of-memory kill, say) while it has rows in flight, then of the worker
    that took its place: the rows go to a new worker each time, a row in flight on both dead workers is recorded as
    failed (exit 1), nothing half-written is left, and a rerun makes exactly the failed rows."""
    import soundfile

    src = write_rows(tmp_path / "in.jsonl", MIXED, malformed=False)
    out = tmp_path / "out"
    args = ["--model-path", builds["int4"], "--input", src, "--out", out, "--workers", 1, "--batch", 4]
    proc = subprocess.Popen([sys.executable, "-m", "higgs_onnx.corpus", *map(str, args)], cwd=ROOT,
                            env={**os.environ, "CI": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    victims = []
    try:
        deadline, log = time.monotonic() + 300, out / "manifest.jsonl"
        for count in (3, 1):  # the first worker after 3 rows, its successor after its first row
            while proc.poll() is None:
                assert time.monotonic() < deadline
                names = [json.loads(x)["worker"] for x in log.read_text().splitlines()] if log.is_file() else []
                mine = [n for n in names if n not in victims]
                if len(mine) >= count:
                    victims.append(mine[0])
                    os.kill(int(mine[0].rsplit(":", 1)[1]), signal.SIGKILL)
                    break
                time.sleep(0.005)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert len(victims) == 2 and proc.returncode == 1, (victims, stderr)
    for victim in victims:
        assert f"worker {victim} died (ActorDiedError (pid {victim.rsplit(':', 1)[1]}): " in stderr, stderr
    assert "Traceback" not in stderr, stderr
    entries = manifest(out)
    assert [e["id"] for e in entries] == [r["id"] for r in MIXED]  # every row has its line
    twice = [e for e in entries if e["error"] is not None]
    assert twice and all(e["error"].startswith("the worker making it died, 2 times (ActorDiedError") and
                         e["worker"] == victims[1] for e in twice), twice
    made = [e for e in entries if e["error"] is None]
    assert len({e["worker"] for e in made} - set(victims)) == 1  # the third worker made the rest
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp file of a half-written row
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lost_workers"] == 2 and [w["pools"] for w in summary["workers"]] == [1]
    assert f"{len(made)} of 24 rows made" in stdout, stdout
    r = corpus(*args)
    assert r.returncode == 0 and f"{len(made)} done before, {len(twice)} to make" in r.stderr, r.stderr
    for e in manifest(out):  # every file whole: its length is the entry's
        assert e["error"] is None and soundfile.info(str(out / e["file"])).frames == round(e["duration_s"] * 24000)


def test_duplicate_ids_are_refused_before_anything_starts(builds, tmp_path):
    src = write_rows(tmp_path / "in.jsonl", ROWS[:3] + [ROWS[1]], malformed=False)
    r = corpus("--model-path", builds["fp32"], "--input", src, "--out", tmp_path / "out")
    assert r.returncode == 2 and "duplicate id 'r01' on lines 2 and 4" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of a live process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(root: int) -> dict[int, tuple[int, str]]:
    """Every process below `root`: pid -> (start time, command line)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            parents[int(name)] = st
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, (ppid, _, start) in parents.items():
            if ppid == pid and child not in found:
                found[child] = (start, _cmdline(child).replace(b"\0", b" ").decode(errors="replace"))
                frontier.append(child)
    return found


def _sessions(tree: dict[int, tuple[int, str]]) -> set[str]:
    """The private temp folders of the Ray instances in a process tree (from the raylet's arguments)."""
    return {m for _, cmd in tree.values() for m in re.findall(r"--raylet_socket_name=(\S+?)/session_", cmd)}


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == start and st[1] != "Z"  # the same process, not reused, not a zombie


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads the process tree from /proc")
@pytest.mark.parametrize("sig, when", [(signal.SIGTERM, "rows"), (signal.SIGINT, "start")],
                         ids=["SIGTERM-while-making-rows", "SIGINT-while-ray-starts"])
def test_signal_to_the_driver_stops_every_ray_process(builds, tmp_path, sig, when):
    """SIGTERM (like Ctrl-C) to the driver alone, while rows are being made or while Ray is still starting: the
    driver shuts Ray down and exits 143 / 130, no raylet, agent or worker of its instance outlives it by more than a
    few seconds, and its private session folder is gone (nothing is left under /tmp/ray)."""
    src = write_rows(tmp_path / "in.jsonl", ROWS, malformed=False)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "higgs_onnx.corpus", "--model-path", str(builds["fp32"]),
                             "--input", str(src), "--out", str(out), "--workers", "2", "--batch", "1"], cwd=ROOT,
                            env={**os.environ, "CI": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline, log, tree = time.monotonic() + 300, out / "manifest.jsonl", {}
        while proc.poll() is None:
            assert time.monotonic() < deadline
            tree = _descendants(proc.pid)
            raylet = any("/raylet " in cmd for _, cmd in tree.values())
            if raylet and (when == "start" or log.is_file() and log.read_text().count("\n") >= 1):
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the job ended before the signal"
        sessions = _sessions(tree)
        proc.send_signal(sig)  # the driver only: Ray's processes are its children, not signalled
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + sig, stderr
    assert "Ray is shut down" in stderr and "Traceback" not in stderr, stderr
    deadline = time.monotonic() + 10  # Ray's own fate-sharing takes ~60 s for the agents: this is not it
    while (left := {p: c for p, (s, c) in tree.items() if _alive(p, s)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"still running {time.monotonic() - deadline + 10:.0f} s after the driver: {left}"
    assert len(sessions) == 1, sessions
    folder = sessions.pop()
    assert Path(folder).name.startswith("higgs-ray-") and not Path(folder).exists(), folder  # private, removed
    late = {n: _cmdline(int(n))[:300] for n in os.listdir("/proc") if n.isdigit() and folder.encode() in
            _cmdline(int(n))}
    assert not late, f"processes of the instance started after the snapshot still run: {late}"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
