"""Long-form: a text file becomes one recording in one voice; resumable after a kill, and after damaged pieces; one
job per output; the final write failing says where the audio is; streamed audio equals the file's; every piece's
fit in the context is known before any work; bad files refused."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from higgs_onnx.audio import GrowingAudioFile, pcm16
from higgs_onnx.generation.contract import ContractError
from higgs_onnx.generation.options import GenerationOptions
from higgs_onnx.longform.files import JobLockedError
from higgs_onnx.longform.render import LongForm, LongFormOptions, generate_long
from higgs_onnx.outputs import OutputError
from higgs_onnx.runtime.model import HiggsTTS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

CHAPTER = """The first paragraph opens the chapter. It has a few sentences, and Dr. Smith arrives at 7:45 with 3.5 kilos
of apples. Nobody expected him so early.

The second paragraph goes on. <|emotion:elation|>Everyone was happy to see him! They talked for hours, and then...
nothing happened for a while. "Stop," he said. Then he left.

A third, short paragraph ends it."""


def digest(path: Path) -> str:
    """A file's sha256: compared instead of its bytes (pytest's diff of two multi-MB byte strings takes minutes)."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def same(a: bytes, b: bytes) -> bool:
    """Two files' bytes are equal (compared by hash, so a failure does not make pytest diff megabytes)."""
    import hashlib

    return hashlib.sha256(a).digest() == hashlib.sha256(b).digest()


def cli(*args, **kw):
    return subprocess.run([sys.executable, str(ROOT / "inference.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "CI": "1"}, timeout=600, **kw)


SMALL = LongFormOptions(target_chars=80, max_chars=160)


def test_one_recording_in_pieces_with_history(tts, tmp_path):
    out = tmp_path / "chapter.wav"
    job = LongForm(tts, CHAPTER, out, lf=SMALL, lanes=1)
    assert len(job.pieces) >= 4 and job.pieces[-1].paragraph_end
    seen = []
    original = tts.request

    def spy(text, **kw):  # record what each piece is conditioned on
        seen.append((text, kw.get("voice"), [t for t, _ in kw.get("history", [])], kw.get("continues")))
        return original(text, **kw)

    tts.request = spy
    try:
        pieces = list(job.run())
    finally:
        del tts.request
    stats = dict(job.stats)
    job.write()  # again: every piece from the work folder
    assert out.is_file() and not job.work.exists()
    audio, sr = sf.read(out)
    assert sr == tts.facts.sample_rate
    assert abs(audio.size - sum(p.waveform.size for p in pieces)) <= 1  # PCM16 file = the joined pieces
    assert all(p.stop_reason == "eoc" for p in pieces)
    # one lane: piece 1 is zero-shot; every later piece continues the KV cache of the pieces before it (its prompt
    # is theirs, their rows and its text), since the whole chapter fits one slot here
    texts = [p.text for p in job.pieces]
    assert seen[0][1] is None and not seen[0][2] and seen[0][3] is None
    for i, (_, voice, history, continues) in enumerate(seen[1:], 1):
        assert voice is None and history == texts[:i] and continues is not None
    assert stats["lanes"] == 1 and stats["positions_prefilled"] < stats["rows_generated"] / 2
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
    # int4 (the default build): a resumed piece replays the prefill calls that built the cache it continues, as
    # int4 rounds a long prefill differently from rows fed one by one (docs/longform.md); one lane, given: with
    # several, a step's batch-mates (their lengths) change the batched attention's rounding, and a resumed job's
    # lanes meet other batch-mates than the uninterrupted one's (test_longform_lanes checks what lanes keep)
    r = cli("--model-path", builds["int4"], "--text-file", text, "--out", whole, "--seed", "3", "--lanes", "1")
    assert r.returncode == 0, r.stderr
    assert "piece 1/" in r.stderr and "ETA" in r.stderr
    cut = tmp_path / "cut.wav"
    proc = subprocess.Popen([sys.executable, str(ROOT / "inference.py"), "--model-path", str(builds["int4"]),
                             "--text-file", str(text), "--out", str(cut), "--seed", "3", "--lanes", "1"], cwd=ROOT,
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
    assert "from the work folder" in r.stderr and "in 1 lane " in r.stderr  # the planned lane count
    assert digest(cut) == digest(whole) and not work.exists()


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


# -- resume after damage, the lock, the output, streaming, the context ------------------------------------------------
_WHOLE: dict[tuple, bytes] = {}


def whole_file(tts, tmp_path, name="ref.wav", **kw) -> bytes:
    """The file an uninterrupted job writes for CHAPTER / SMALL (seed 0), made once per set of options in this module
    (the same export, options and seed give the same bytes: what each test asserts its resumed job gives again)."""
    key = tuple(sorted(kw.items()))
    if key not in _WHOLE:
        _WHOLE[key] = generate_long(tts, CHAPTER, tmp_path / name, lf=SMALL, **kw).read_bytes()
    return _WHOLE[key]


class RequestCounter:
    """Counts (and records) tts.request calls while installed."""

    def __init__(self, tts):
        self.tts, self.calls, self.original = tts, [], tts.request

    def __enter__(self):
        def spy(text, **kw):
            self.calls.append((text, [t for t, _ in kw.get("history", [])]))
            return self.original(text, **kw)

        self.tts.request = spy
        return self

    def __exit__(self, *exc):
        del self.tts.request


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "wrong-shape", "out-of-range", "cut-codes",
                                    "another-piece"])
def test_a_damaged_piece_is_made_again_on_resume(tts, tmp_path, damage):
    """Two lanes, pinned (the automatic choice follows the machine's measured batch gain): pieces 0-1 and 2-4. The
    damaged piece ends the first lane, so only it and the pieces never made are made again."""
    want = whole_file(tts, tmp_path, lanes=2)
    out = tmp_path / "cut.wav"
    job = LongForm(tts, CHAPTER, out, lf=SMALL, lanes=2)
    for p in job.run():  # stop after three pieces, as a kill would
        if p.index == 2:
            break
    job.close()
    pieces = sorted(job.work.glob("piece-*.npz"))
    assert len(pieces) == 3
    victim = pieces[1]
    if damage == "empty":
        victim.write_bytes(b"")  # a full disk
    elif damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:len(victim.read_bytes()) // 2])  # a crash mid-write
    elif damage == "garbage":
        victim.write_bytes(b"PK\x03\x04" + os.urandom(300))
    elif damage == "wrong-shape":
        np.savez(victim, codes=np.zeros((3, 2), np.int64), rows=3, stop="eoc", retried=False)
    else:  # a valid archive with the wrong content: codes out of range, cut, or piece 1's file copied over it
        with np.load(victim) as z:
            fields = {k: z[k] for k in z.files}
        if damage == "out-of-range":
            fields["codes"] = fields["codes"] + 5000
        elif damage == "cut-codes":
            fields["codes"] = fields["codes"][:3]
        else:
            fields = {k: v for k, v in np.load(pieces[0]).items()}
        np.savez(victim, **fields)
    with RequestCounter(tts) as spy:
        path = LongForm(tts, CHAPTER, out, lf=SMALL, resume=True).write()
    assert same(path.read_bytes(), want)  # the same file as an uninterrupted run
    assert [t for t, _ in spy.calls] == [p.text for p in job.pieces[1:2] + job.pieces[3:]]  # only the damaged and
    assert not job.work.exists()  # the missing pieces were made


def test_a_damaged_plan_is_written_again_and_its_pieces_kept(tts, tmp_path):
    want = whole_file(tts, tmp_path)
    out = tmp_path / "cut.wav"
    job = LongForm(tts, CHAPTER, out, lf=SMALL)
    for p in job.run():
        if p.index == 1:
            break
    job.close()
    saved = len(list(job.work.glob("piece-*.npz")))  # pieces 1-2, and what other lanes finished meanwhile
    (job.work / "plan.json").write_bytes(b'{"version": 2, "text_sha')  # cut off
    with RequestCounter(tts) as spy:
        path = LongForm(tts, CHAPTER, out, lf=SMALL, resume=True).write()
    assert same(path.read_bytes(), want)
    assert saved >= 2 and len(spy.calls) == len(job.pieces) - saved  # the saved pieces carried this job's stamp


HOLDER = """
import sys
from higgs_onnx.longform.render import LongForm, LongFormOptions
from higgs_onnx.runtime.model import HiggsTTS
job = LongForm(HiggsTTS(sys.argv[1], verify=False), open(sys.argv[2]).read(), sys.argv[3],
               lf=LongFormOptions(target_chars=80, max_chars=160))
print("locked", flush=True)
sys.stdin.read()
"""


def test_two_jobs_on_one_output(builds, tts, tmp_path):
    text = tmp_path / "chapter.txt"
    text.write_text(CHAPTER)
    out = tmp_path / "o.wav"
    # in one process: a second job object on the same output refuses, the first one's close lets it go
    first = LongForm(tts, CHAPTER, out, lf=SMALL)
    with pytest.raises(JobLockedError, match="another long-form job is writing"):
        LongForm(tts, CHAPTER, out, lf=SMALL, resume=True)
    first.close()
    LongForm(tts, CHAPTER, out, lf=SMALL, resume=True).close()
    shutil.rmtree(out.with_name("o.wav.work"))
    # across processes: another process holds the job; then it is SIGKILLed, and the lock goes with it
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(builds["fp32"]), str(text), str(out)], cwd=ROOT,
                              env={**os.environ, "CI": "1"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with RequestCounter(tts) as spy, pytest.raises(JobLockedError, match=r"o\.wav right now"):
            LongForm(tts, CHAPTER, out, lf=SMALL, resume=True)
        assert not spy.calls
        r = cli("--model-path", builds["fp32"], "--text-file", text, "--out", out, "--resume")
        assert r.returncode == 2 and "another long-form job is writing" in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        r = cli("--model-path", builds["fp32"], "--text", "Hello.", "--out", out)  # a one-shot run on that file
        assert r.returncode == 2 and "a long-form job is writing this file right now" in r.stderr, r.stderr
        assert not out.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out.with_name("o.wav.work") / "lock").exists()  # left behind by the kill, but no longer held
    job = LongForm(tts, CHAPTER, out, lf=SMALL, resume=True)
    assert job.write() == out and out.is_file()


def test_the_final_rename_failing_says_where_the_audio_is(tts, tmp_path):
    want = whole_file(tts, tmp_path)
    out = tmp_path / "o.wav"
    job = LongForm(tts, CHAPTER, out, lf=SMALL)

    def sabotage(p):  # the output's name is taken by a folder while the job runs
        if p.index == p.total - 1:
            out.mkdir()

    with pytest.raises(OutputError) as e:
        job.write(sabotage)
    message = str(e.value)
    partial = tmp_path / "o.wav.partial"
    assert f"cannot write {out} (" in message and str(partial) in message and str(job.work) in message, message
    assert "--resume" in message and "[Errno" not in message and "\n" not in message
    assert same(partial.read_bytes(), want)  # the whole recording, under the partial name
    out.rmdir()
    assert same(LongForm(tts, CHAPTER, out, lf=SMALL, resume=True).write().read_bytes(), want)


def test_a_full_disk_while_writing_keeps_the_pieces(tts, tmp_path, monkeypatch):
    want = whole_file(tts, tmp_path)
    out = tmp_path / "o.wav"
    calls = []
    original = GrowingAudioFile.write

    def full(self, samples):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(self, samples)

    monkeypatch.setattr(GrowingAudioFile, "write", full)
    with pytest.raises(OutputError) as e:
        LongForm(tts, CHAPTER, out, lf=SMALL).write()
    message = str(e.value)
    assert f"cannot write {out} (No space left on device) after " in message and "o.wav.partial" in message
    assert "o.wav.work" in message and "--resume" in message and "[Errno" not in message, message
    assert len(list((tmp_path / "o.wav.work").glob("piece-*.npz"))) == 3 and not out.exists()
    monkeypatch.setattr(GrowingAudioFile, "write", original)
    with RequestCounter(tts) as spy:
        assert same(LongForm(tts, CHAPTER, out, lf=SMALL, resume=True).write().read_bytes(), want)
    assert len(spy.calls) == 2  # pieces 4 and 5 only


def test_output_and_work_folder_are_checked_before_any_work(tts, tmp_path):
    cases = []
    (tmp_path / "w.wav.work").write_text("a file where the work folder goes")
    cases.append((tmp_path / "w.wav", NotADirectoryError, "work folder"))
    cases.append((tmp_path / "missing" / "o.wav", FileNotFoundError, "does not exist"))
    cases.append((tmp_path / "o.mp3", ValueError, "unsupported format"))
    (tmp_path / "d.wav").mkdir()
    cases.append((tmp_path / "d.wav", IsADirectoryError, "is a folder"))
    with RequestCounter(tts) as spy:
        for out, error, message in cases:
            with pytest.raises(error, match=message):
                LongForm(tts, CHAPTER, out, lf=SMALL)
    assert not spy.calls and not (tmp_path / "missing").exists() and not (tmp_path / "o.mp3.work").exists()


def test_stream_comes_early_and_equals_the_file(tts, tmp_path):
    made, original = [], tts.scheduler

    def spy(*a, **kw):  # the job's scheduler: its decoder rows so far, of every lane
        made.append(original(*a, **kw))
        return made[-1]

    done: list = []
    tts.scheduler = spy
    try:
        chunks = LongForm(tts, CHAPTER, tmp_path / "s.wav", lf=SMALL).stream(done.append)
        first = next(chunks)
        rows_at_first = made[0].batch_rows
        rest = list(chunks)
    finally:
        del tts.scheduler
    # audio before the first piece's last row (zero-shot, the other lanes wait for it: these rows are its own)
    assert len(made) == 1 and first.size and 0 < rows_at_first < done[0].rows
    assert len(rest) > 2 * len(done) and len(done) == 5  # several chunks per piece
    streamed = np.concatenate([first, *rest])
    assert not (tmp_path / "s.wav.work").exists()  # a finished stream cleans up
    # the same job written to a file: the same pieces, the same float samples, the file its PCM16 (±1 LSB)
    out = tmp_path / "f.wav"
    job = LongForm(tts, CHAPTER, out, lf=SMALL)
    pieces = []
    job.write(pieces.append)
    assert [p.rows for p in pieces] == [p.rows for p in done]
    assert np.array_equal(streamed, np.concatenate([p.waveform for p in pieces]))
    for a, b in zip(done, pieces, strict=True):
        assert np.array_equal(a.waveform, b.waveform)
    written, _ = sf.read(out, dtype="int16")
    assert np.abs(written.astype(int) - np.frombuffer(pcm16(streamed), "<i2")).max() <= 1


def test_stream_fades_each_piece_like_the_file():
    from higgs_onnx.longform.joins import Edges, fade_edges

    rng = np.random.default_rng(0)
    for size, k, cuts in ((1000, 50, [7, 300, 301, 999]), (60, 50, [10, 30]), (3, 2, [1]), (500, 0, [100])):
        wav = rng.standard_normal(size).astype(np.float32)
        edges, out = Edges(k), []
        for part in np.split(wav, cuts):
            out.append(edges.push(part))
        out.append(edges.finish())
        assert np.array_equal(np.concatenate(out), fade_edges(wav.copy(), k)), (size, k)


def small_context(builds, positions: int) -> HiggsTTS:
    """The tiny export with a smaller context (the graphs take any length; the contract reads facts)."""
    t = HiggsTTS(builds["int4"], verify=False)
    t.facts = dataclasses.replace(t.facts, max_positions=positions)
    return t


def test_a_lane_starts_again_when_its_context_is_full(builds, tmp_path):
    """800 positions: every piece fits with its voice, but a lane cannot keep continuing its KV cache: when the
    lane's prompt plus the next piece's budget would pass the slot, it starts again from the voice and the last
    piece (and drops that too while it does not fit). Every request fits; none is refused or cut."""
    t = small_context(builds, 800)
    made, original = [], t.request

    def spy(text, **kw):
        req = original(text, **kw)  # a ContractError here fails the test
        made.append((len(kw.get("history", [])), kw.get("continues") is not None, kw.get("voice") is not None,
                     len(req.prompt) + req.max_rows))
        return req

    t.request = spy
    job = LongForm(t, CHAPTER, tmp_path / "h.wav", lf=SMALL, lanes=1)
    path = job.write()
    assert sf.info(path).duration > 1 and len(made) == len(job.pieces) == 5
    assert all(n <= 800 for *_, n in made)
    restarts = [m for m in made[1:] if not m[1]]
    assert restarts and all(voice and history <= SMALL.history for history, _, voice, _ in restarts)
    assert any(m[1] for m in made[1:])  # and it continued where it could
    assert job.stats["positions_prefilled"] > 0


def test_a_piece_that_cannot_fit_is_refused_before_any_work(builds, tts, tmp_path):
    voice = tts.make_voice(DATA / "ref_en_24k.wav", (DATA / "ref_en_24k.txt").read_text().strip())
    t = small_context(builds, 400)
    with RequestCounter(t) as spy, pytest.raises(ContractError, match="piece 2 of 5 .* does not fit even without "
                                                                      "history") as e:
        LongForm(t, CHAPTER, tmp_path / "o.wav", voice=voice, lf=SMALL)
    assert e.value.code == "context_length_exceeded" and "400 positions" in str(e.value)
    assert not spy.calls and not (tmp_path / "o.wav.work").exists()
    # zero-shot, the later pieces' voice is the first piece's audio: checked as soon as it exists
    t = small_context(builds, 300)
    with RequestCounter(t) as spy, pytest.raises(ContractError, match="piece 2 of 5 .* does not fit even without "
                                                                      "history"):
        LongForm(t, CHAPTER, tmp_path / "z.wav", lf=SMALL).write()
    assert len(spy.calls) == 1  # piece 1 only
    # a --max-rows below what a piece needs: refused up front too
    with pytest.raises(ContractError, match="needs at least .* rows, but max_rows is 40"):
        LongForm(tts, CHAPTER, tmp_path / "m.wav", options=GenerationOptions(max_rows=40), lf=SMALL)


def test_a_utf16_text_file(builds, tmp_path):
    """What Windows Notepad saves as "Unicode": read by the CLI (every encoding is tested in
    test_longform_text.py)."""
    path = tmp_path / "t.txt"
    path.write_bytes("Caf\u00e9 au lait. A short line.".encode("utf-16"))  # with its byte-order mark
    r = cli("--model-path", builds["int4"], "--text-file", path, "--out", tmp_path / "o.wav")
    assert r.returncode == 0, r.stderr
    assert sf.info(tmp_path / "o.wav").duration > 0.1


def test_cli_stdout_is_the_stream(builds, tts, tmp_path):
    """`--text-file F --out -`: raw PCM16 on stdout, the same samples `LongForm.stream` hands out (and `write` puts
    in a file) for the same seed and settings."""
    text = tmp_path / "chapter.txt"
    text.write_text(CHAPTER)
    r = subprocess.run([sys.executable, str(ROOT / "inference.py"), "--model-path", str(builds["fp32"]),
                        "--text-file", str(text), "--out", "-", "--seed", "2", "--lanes", "2"], capture_output=True,
                       cwd=ROOT,
                       env={**os.environ, "CI": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr.decode()
    job = LongForm(tts, CHAPTER, tmp_path / "s.wav", options=GenerationOptions(seed=2, max_rows=2048), lanes=2)
    assert r.stdout == b"".join(pcm16(c) for c in job.stream())
