"""Corpus input and output checks that need no Ray: the input's encoding and lines, malformed lines keyed by their
line number, usage errors refused before Ray starts (exit 2, one line), a row's failures as one line, the clean-up
of a local instance's leftovers, SIGTERM handled like Ctrl-C, the worker's one scheduler in this process (calls
sharing it, failures mid-batch), its batch figures, a dead worker's temp files and reason, the benchmark's helpers.
The runs on a real local Ray are in test_corpus.py."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from higgs_onnx import corpus, ray_local
from higgs_onnx.generation.contract import NoAudioError


def write(path: Path, lines: list, prefix: bytes = b"", end: str = "\n") -> Path:
    path.write_bytes(prefix + "".join((x if isinstance(x, str) else json.dumps(x)) + end for x in lines).encode())
    return path


# -- reading the input ---------------------------------------------------------------------------------------------

def test_bom_crlf_and_line_separators_inside_a_text(tmp_path):
    src = write(tmp_path / "in.jsonl", [{"id": "a", "text": "First\u2028line."}, "", {"id": "b", "text": "Two."}],
                prefix=b"\xef\xbb\xbf", end="\r\n")
    rows = corpus.read_rows(src)
    assert [(r.id, r.line, r.error) for r in rows] == [("a", 1, None), ("b", 3, None)]  # the BOM row is kept
    assert rows[0].text == "First\u2028line."  # U+2028 in a JSON string does not end the line


def test_a_malformed_line_cannot_collide_with_a_real_id(tmp_path):
    src = write(tmp_path / "in.jsonl", [{"id": "line-3", "text": "A real row."}, '{"id": "x", "text": ',
                                        "[1, 2]", {"id": "line 2", "text": "Not a file name."},
                                        {"id": "line-2", "text": "Another real row."}])
    rows = corpus.read_rows(src)
    assert [r.key for r in rows] == ["line-3", "line 2", "line 3", "line 4", "line-2"]  # all distinct
    assert [r.id for r in rows] == ["line-3", None, None, None, "line-2"]
    assert rows[1].error.startswith("malformed JSON on line 2: ")
    assert rows[2].error == "malformed JSON on line 3: not a JSON object but list"
    assert rows[3].error.startswith("line 4: id 'line 2' must be 1-128 letters")
    assert rows[0].error is None and rows[4].error is None


def test_bad_fields_are_row_errors_found_before_ray(tmp_path):
    src = write(tmp_path / "in.jsonl", [{"id": "a", "text": " "}, {"id": "b", "text": "Hi.", "speed": 2},
                                        {"id": "c", "text": "Hi.", "seed": "abc"},
                                        {"id": "d", "text": "Hi.", "voice": 7}, {"id": 8, "text": "Hi."},
                                        {"id": True, "text": "Hi."}, {"id": "e", "text": "Hi.", "seed": None}])
    errors = {r.key: r.error for r in corpus.read_rows(src)}
    assert errors == {"a": "empty or missing text",
                      "b": "speed is not supported by a corpus row (python -m higgs_onnx.corpus): write the speed "
                           "tag in the row's text",
                      "c": "seed must be a whole number, got 'abc'",
                      "d": "voice 7 must be a voice file or a name in --voices", "8": None,
                      "line 6": "line 6: id True must be 1-128 letters, digits, '.', '_' or '-' (it names the output "
                                "file)", "e": None}


def test_latin1_binary_empty_folder_missing(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"id": "a", "text": "Caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"^--input .*latin.jsonl is not UTF-8 text .*iconv -f latin1 -t utf-8"):
        corpus.read_rows(latin)
    (tmp_path / "bin.jsonl").write_bytes(b'{"id": "a"}\x00\n')
    with pytest.raises(ValueError, match="is a binary file"):
        corpus.read_rows(tmp_path / "bin.jsonl")
    (tmp_path / "empty.jsonl").write_bytes(b"\xef\xbb\xbf\n\n")
    with pytest.raises(ValueError, match="is empty"):
        corpus.read_rows(tmp_path / "empty.jsonl")
    with pytest.raises(IsADirectoryError, match="is a folder"):
        corpus.read_rows(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus.read_rows(tmp_path / "nope.jsonl")


def test_manifest_entries_are_keyed_by_id_or_line(tmp_path):
    (tmp_path / corpus.MANIFEST).write_text("\n".join([
        json.dumps({"id": "line-2", "file": "line-2.wav", "error": None}),
        json.dumps({"id": None, "line": 2, "error": "malformed JSON on line 2: ..."}),
        json.dumps({"id": None, "error": "no line: unusable"}), "[1]", '{"id": "cut', ""]))
    done = corpus.read_manifest(tmp_path)
    assert set(done) == {"line-2", "line 2"} and done["line 2"]["error"].startswith("malformed")


# -- a row that fails inside a worker: one line ---------------------------------------------------------------------

def fake_speech(rows: int, samples: int = 960):
    return SimpleNamespace(waveform=np.zeros(samples, np.float32), rows=np.zeros((rows, 8), np.int64),
                           stop_reason="eoc")


def fake_worker(tmp_path: Path):
    w = corpus.Worker.__new__(corpus.Worker)
    w.tts = SimpleNamespace(facts=SimpleNamespace(num_codebooks=8, sample_rate=24000))
    w.out, w.fmt, w.name = tmp_path, "wav", "test:1"
    return w


def test_a_generation_without_audio_is_a_failed_row(tmp_path):
    w = fake_worker(tmp_path)
    with pytest.raises(NoAudioError, match=r"ended after 8 rows \(eoc\) without audio"):
        w.finish({"id": "a"}, fake_speech(8, samples=0), 0.0)
    # the codec worker's answer for rows without one frame: the row's entry is that one line
    entry = w.failure({"id": "a"}, NoAudioError("the generation ended after 7 rows without one audio frame"))
    assert entry["error"] == "NoAudioError: the generation ended after 7 rows without one audio frame"
    assert not list(tmp_path.iterdir())  # nothing written
    ok = w.finish({"id": "a"}, fake_speech(8), 0.0)
    assert ok["error"] is None and ok["rows"] == 8 and (tmp_path / "a.wav").is_file()


def test_a_write_error_is_one_line_without_errno(tmp_path, monkeypatch):
    import higgs_onnx.audio

    def full(path, wav, sr):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(higgs_onnx.audio, "write_audio", full)
    w = fake_worker(tmp_path)
    with pytest.raises(corpus.RowWriteError) as e:
        w.finish({"id": "a"}, fake_speech(20), 0.0)
    entry = w.failure({"id": "a"}, e.value)
    assert entry["error"] == f"cannot write {tmp_path / 'a.wav'}: No space left on device", entry
    other = w.failure({"id": "a"}, PermissionError(errno.EACCES, "Permission denied", "/v/x.npz"))
    assert other["error"] == "PermissionError: Permission denied (/v/x.npz)"


# -- the local Ray instance's leftovers and signals -----------------------------------------------------------------

@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="finds processes through /proc")
def test_leftovers_are_found_by_their_files_in_the_private_folder(tmp_path):
    folder = tmp_path / "ray"
    folder.mkdir()
    inside = subprocess.Popen(["sleep", "60"], cwd=folder)
    outside = subprocess.Popen(["sleep", "60"], cwd=tmp_path)
    try:
        for _ in range(100):  # the child may not have reached its folder yet: poll, bounded
            if ray_local.processes_using(str(folder)):
                break
            time.sleep(0.05)
        assert ray_local.processes_using(str(folder)) == [inside.pid]
        named = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(folder)])  # names it
        assert sorted(ray_local.stop_leftovers(str(folder), grace_s=5)) == sorted([inside.pid, named.pid])
        assert inside.wait(timeout=5) == -signal.SIGTERM and named.wait(timeout=5) == -signal.SIGTERM
        assert outside.poll() is None
    finally:
        for p in (inside, outside, locals().get("named")):
            if p is not None:
                p.kill()
                p.wait()


def test_the_private_ray_folder_is_short(monkeypatch, tmp_path):
    long = tmp_path / ("x" * 60)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    folder = ray_local.ray_temp_dir()
    try:
        # Ray's longest socket: <folder>/session_2026-12-01_09-41-37_125043_1234567/sockets/plasma_store
        assert Path(folder).name.startswith("higgs-ray-") and len(folder) + 66 <= 107, folder
    finally:
        os.rmdir(folder)


def test_sigterm_is_handled_like_ctrl_c():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = ray_local.StopSignal()
    stop.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        stop.shield()  # while Ray shuts down, a second signal is noted, not raised
        signal.raise_signal(signal.SIGTERM)
    finally:
        stop.restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_ray_client_address_needs_ray_client(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "grpc" else real(name, *a))
    with pytest.raises(ValueError, match=r'needs Ray Client, which is not installed: pip install "ray\[client\]==2\.60'
                                         r'\.0"'):
        ray_local.check_address("ray://head:10001")
    ray_local.check_address("auto")  # needs no client
    with pytest.raises(ValueError, match="--address is empty"):
        ray_local.check_address(" ")


# -- usage errors through the command: one line, exit 2, before Ray starts ------------------------------------------

@pytest.fixture
def no_ray(monkeypatch):
    def never(*a, **k):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(corpus, "generate_all", never)


def run_corpus(capsys, model, src, out, *extra) -> tuple[int, str]:
    code = corpus.main(["--model-path", str(model), "--input", str(src), "--out", str(out), *map(str, extra)])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.slow
@pytest.mark.parametrize("case", ["out-is-a-file", "out-under-a-file", "out-in-proc", "latin1", "ray-client",
                                  "input-folder"])
def test_usage_errors_are_one_line_before_ray(builds, tmp_path, capsys, no_ray, monkeypatch, case):
    src = write(tmp_path / "in.jsonl", [{"id": "a", "text": "Hello there."}])
    out, extra, expect = tmp_path / "out", [], None
    if case == "out-is-a-file":
        out.write_text("")
        expect = f"error: --out {out} is a file, not a folder"
    elif case == "out-under-a-file":
        (tmp_path / "f").write_text("")
        out = tmp_path / "f" / "out"
        expect = f"error: --out {out}: cannot create this folder"
    elif case == "out-in-proc":
        if not Path("/proc/self").is_dir():
            pytest.skip("needs /proc")
        out = Path("/proc/corpus")
        expect = "error: --out /proc/corpus: cannot create this folder"
    elif case == "latin1":
        src.write_bytes('{"id": "a", "text": "Caf\u00e9"}\n'.encode("latin-1"))
        expect = f"error: --input {src} is not UTF-8 text"
    elif case == "ray-client":
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "grpc" else real(n, *a))
        extra = ["--address", "ray://head:10001"]
        expect = 'error: --address ray://head:10001 needs Ray Client, which is not installed: pip install "ray[client]'
    elif case == "input-folder":
        src = tmp_path
        expect = f"error: --input {tmp_path} is a folder"
    code, err = run_corpus(capsys, builds["fp32"], src, out, *extra)
    assert code == 2 and err.startswith(expect) and err.count("\n") == 1, err
    assert "Traceback" not in err and "Errno" not in err
    if case in ("latin1", "ray-client", "input-folder"):
        assert not out.exists()  # refused before anything was written


@pytest.mark.slow
def test_only_bad_rows_exit_1_without_ray_and_reruns_report_them(builds, tmp_path, capsys, no_ray):
    src = write(tmp_path / "in.jsonl", ['{"id": ', {"id": "e", "text": ""}, {"id": "line-1", "text": " "}])
    out = tmp_path / "out"
    for _ in range(2):  # the rerun reports the same rows again
        code = corpus.main(["--model-path", str(builds["fp32"]), "--input", str(src), "--out", str(out)])
        captured = capsys.readouterr()
        assert code == 1 and "0 of 3 rows made" in captured.out and "3 failed: line 1, e, line-1" in captured.out
        entries = [json.loads(x) for x in (out / corpus.MANIFEST).read_text().splitlines()]
        assert [(e["id"], e["line"]) for e in entries] == [(None, 1), ("e", 2), ("line-1", 3)]



# -- the worker's one scheduler, without Ray ------------------------------------------------------------------------

def test_the_batch_trace_counts_the_steps_while_a_batch_of_rows_remained():
    class Req:  # compared by identity
        def __init__(self, left):
            self.left, self.done = left, False

    trace = corpus.BatchTrace(2)
    lengths = [3, 1, 2]  # rows each request still needs; two slots, the third request takes the first free one
    live, third = [Req(3), Req(1)], Req(2)
    while live:
        for r in live:
            r.left -= 1
            r.done = r.left == 0
        trace.saw(live)
        live = [r for r in live if not r.done]
        if third not in live and not third.done and len(live) < 2:
            live.append(third)
    # steps: [a, b] (b ends), [a, c], [a, c] (a and c end): the second row from the end ended in step 3
    assert (trace.steps, trace.rows, trace.finished) == (3, 6, 3) and sum(lengths) == 6
    assert trace.full() == (3, 6)
    assert corpus.BatchTrace(4).full() is None  # fewer rows than the batch: no such phase


def test_a_killed_workers_temp_files_are_removed_for_the_rows_made_again(tmp_path):
    # outputs.atomic's temp names: .<name>.<8 of mkstemp's>.partial<suffix>
    names = [".r01.wav.abcd_123.partial.wav", ".r01.flac.abcd_123.partial.flac", ".r02.wav.zzzzzzzz.partial.wav",
             "r01.wav", ".r01.wav", ".r01.wav.abcd_123.wav", "summary.json"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    corpus.remove_partials(tmp_path, {"r01"}, "wav")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - {".r01.wav.abcd_123.partial.wav"})


def test_a_dead_workers_reason_is_one_short_line():
    class ActorDiedError(Exception):
        pass

    e = ActorDiedError("The actor died unexpectedly before finishing this task.\n\tclass_name: Worker\n\tpid: 4242\n"
                       "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
                       "exit detail: Worker unexpectedly exits with a connection error code 2. End of file. Some ...")
    assert corpus.death_reason(e) == ("ActorDiedError (pid 4242): its worker process has died, exit type "
                                      "SYSTEM_ERROR, Worker unexpectedly exits with a connection error code 2")
    assert corpus.death_reason(ActorDiedError("")) == "ActorDiedError"


@pytest.mark.slow
def test_calls_share_one_scheduler_and_a_failure_mid_batch_fails_only_its_rows(builds, tmp_path):
    """A worker in this process (what the Ray actor runs): three calls at once and a later one share one scheduler
    and one slot pool; a codec failure fails its row only, a failed decoder step the rows of that step only, and the
    loop goes on for the rest."""
    import threading

    w = corpus.Worker(str(builds["int4"]), str(tmp_path), 4, 1, None, "wav")
    try:
        codec, real_codec = w.sched.codec_worker, w.sched.codec_worker.decode_audio

        def codec_fails(codes):  # the row of 30 rows: 23 frames
            if codes.shape[-1] == 30 - 8 + 1:
                raise RuntimeError("codec broke")
            return real_codec(codes)

        backend, calls = w.tts.backend, []
        batched = "decode_batch_codes" if backend.fused else "decode_batch"  # the step graph's batched call
        real_batch = getattr(backend, batched)

        def decoder_fails(caches, feed):
            calls.append(len(caches))
            if len(calls) == 40:
                raise RuntimeError("decoder broke")
            return real_batch(caches, feed)

        codec.decode_audio = codec_fails
        setattr(backend, batched, decoder_fails)
        rows = [{"id": f"x{i:02d}", "text": f"Row {i} of the batch.", "voice": None,
                 "options": {"seed": i, "max_rows": 30 + 17 * i}} for i in range(12)]
        results = []
        threads = [threading.Thread(target=lambda part: results.extend(w.run(part)), args=(rows[i::3],))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        later = w.run([{**rows[0], "id": "late", "options": {"seed": 1, "max_rows": 40}}])
        stats, sched = w.stats(), w.sched.stats()
    finally:
        w.sched.stop()
    by_id = {e["id"]: e for e in results + later}
    assert len(by_id) == 13 and len(results) == 12
    assert by_id["x00"]["error"] == "RuntimeError: codec broke"
    broke = [k for k, e in by_id.items() if e["error"] == "RuntimeError: decoder broke"]
    assert len(broke) == calls[39] and 2 <= len(broke) <= 4, (broke, calls[39])
    ok = {k: e for k, e in by_id.items() if e["error"] is None}
    assert len(ok) == 13 - 1 - len(broke) and by_id["late"]["error"] is None
    for k, e in ok.items():
        most = 40 if k == "late" else 30 + 17 * int(k[1:])
        assert (tmp_path / f"{k}.wav").is_file() and (e["rows"] == most or e["rows"] < most and
                                                       e["stop_reason"] == "eoc"), e
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left
    assert stats["pools"] == 1 and stats["decoder_steps"] == sched["decoder_steps"] > 0
    assert stats["made"] == len(ok) and stats["failed"] == 1 + len(broke)


def test_the_corpus_benchmark_makes_mixed_rows_and_reads_the_batch_gain(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("corpus_bench", Path(corpus.__file__).parent.parent / "benchmarks" /
                                                  "corpus.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.rows(24, 24, 260)
    lengths = [r["max_rows"] for r in rows]
    assert len(set(lengths)) == 24 and min(lengths) >= 24 and max(lengths) < 260  # mixed, none alike
    (tmp_path / "b.json").write_text(json.dumps({"batches": [{"batch": 1, "rows_per_s": 10.0},
                                                             {"batch": 4, "rows_per_s": 25.0}]}))
    assert bench.bench_gain(tmp_path / "b.json", 4) == 2.5 and bench.bench_gain(tmp_path / "b.json", 8) is None
    model, flags = bench.cpu()
    assert isinstance(model, str) and all(f in bench.FLAGS or f.startswith("amx") for f in flags)


def test_a_ctrl_c_swallowed_while_ray_starts_is_raised_again():
    """Ray starts its processes while a Ctrl-C may land in an at-fork hook, where Python swallows the
    KeyboardInterrupt ("Exception ignored in _resume_parent_after_fork": the job then ran to its end, exit 0).
    The signal is recorded by the handler, and `check` raises it again."""
    from higgs_onnx.corpus import StopSignal

    stop = StopSignal()
    stop.install()
    try:
        stop.check()  # nothing yet
        try:  # what the at-fork hook does with it
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        except KeyboardInterrupt:
            pass
        with pytest.raises(KeyboardInterrupt):
            stop.check()
        assert stop.signum == signal.SIGINT
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
