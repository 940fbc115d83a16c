"""Corpus input and output checks that need no Ray: the input's encoding and lines, malformed lines keyed by their
line number, usage errors refused before Ray starts (exit 2, one line), a row's failures as one line, the clean-up
of a local instance's leftovers, SIGTERM handled like Ctrl-C. The runs on a real local Ray are in test_corpus.py."""

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

from higgs_onnx import corpus
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
    assert errors == {"a": "empty or missing text", "b": "unknown field(s) speed",
                      "c": "seed must be an integer, got 'abc'",
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

class FakeRequest:
    def __init__(self, n):
        self.n, self.stop_reason = n, "eoc"
        self.generated = np.zeros((n, 8), np.int64)


def fake_worker(tmp_path: Path, samples: int = 960):
    w = corpus.Worker.__new__(corpus.Worker)
    facts = SimpleNamespace(num_codebooks=8, sample_rate=24000)
    w.tts = SimpleNamespace(facts=facts, decode_rows=lambda rows: np.zeros(samples, np.float32))
    w.out, w.fmt, w.name = tmp_path, "wav", "test:1"
    return w


def test_a_generation_without_audio_is_a_failed_row(tmp_path):
    w = fake_worker(tmp_path)
    with pytest.raises(NoAudioError, match="ended after 7 rows .* without one audio frame"):
        w.finish({"id": "a"}, FakeRequest(7), 0.0)
    with pytest.raises(NoAudioError, match="without audio"):
        fake_worker(tmp_path, samples=0).finish({"id": "a"}, FakeRequest(8), 0.0)
    entry = w.failure({"id": "a"}, NoAudioError("the generation ended after 7 rows (eoc) without one audio frame"))
    assert entry["error"] == "NoAudioError: the generation ended after 7 rows (eoc) without one audio frame"
    assert not list(tmp_path.iterdir())  # nothing written
    ok = w.finish({"id": "a"}, FakeRequest(8), 0.0)
    assert ok["error"] is None and (tmp_path / "a.wav").is_file()


def test_a_write_error_is_one_line_without_errno(tmp_path, monkeypatch):
    import higgs_onnx.audio

    def full(path, wav, sr):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(higgs_onnx.audio, "write_audio", full)
    w = fake_worker(tmp_path)
    with pytest.raises(corpus.RowWriteError) as e:
        w.finish({"id": "a"}, FakeRequest(20), 0.0)
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
            if corpus.processes_using(str(folder)):
                break
            time.sleep(0.05)
        assert corpus.processes_using(str(folder)) == [inside.pid]
        named = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(folder)])  # names it
        assert sorted(corpus.stop_leftovers(str(folder), grace_s=5)) == sorted([inside.pid, named.pid])
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
    folder = corpus.ray_temp_dir()
    try:
        # Ray's longest socket: <folder>/session_2026-12-01_09-41-37_125043_1234567/sockets/plasma_store
        assert Path(folder).name.startswith("higgs-ray-") and len(folder) + 66 <= 107, folder
    finally:
        os.rmdir(folder)


def test_sigterm_is_handled_like_ctrl_c():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = corpus.StopSignal()
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
        corpus.check_address("ray://head:10001")
    corpus.check_address("auto")  # needs no client
    with pytest.raises(ValueError, match="--address is empty"):
        corpus.check_address(" ")


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

