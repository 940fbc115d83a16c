"""The word aligner's own process: the server's word timing (`job.finish.time_words`) runs here, apart from the
server.

Why a process: pocketsphinx holds the GIL for a whole search (0.3 s on 30 s of audio, up to 7 searches a piece,
`align.SEARCHES`); in a thread of the server that froze the event loop, and every stream's audio with it, as long
(0.31-0.65 s seen). Why not `ProcessPoolExecutor`: a spawned worker runs the parent's main script again (as
`__mp_main__`): a user's unguarded script would speak again, or fail, in it. This is `python -m
higgs_onnx.job.aligner`, which imports only the aligner.

The protocol, over the child's stdin and stdout (the child's own prints go to stderr), is plain data, no pickle
(tests/test_security.py): in, a 4-byte length, a JSON header (the cue, the rate, the language, the samples' shape) and
the samples as little-endian float32; out, one JSON line (the words, why there are none, a failure's traceback). One
piece at a time (`Aligner.time` holds a lock; the caller queues in one thread). The child lowers its own priority
(`finish.ALIGNER_NICE`), and ends when its stdin closes: the server's end, or its death (a search under way is
finished first and its answer cannot be written). A child that dies is `AlignerEnded` for the piece it held, and the
next piece starts a new one, and so is one that takes over `PIECE_LIMIT_S` on a piece (killed); one that cannot start
(it exits before its ready line: an import that fails; not one killed) is not started again, and every later piece is
`AlignerEnded` at once (one ERROR line each, not a process and a traceback each). The child runs in a process group of
its own (a terminal's Ctrl-C reaches the server, which ends it, not the child in the middle of a search) and with `-P`
(the server's working directory is not on its path: a user's `json.py` there is neither imported nor run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import numpy as np

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding higgs_onnx: the child imports it
# The most one piece may take in the child, wall clock. The longest piece (2,048 rows, 82 s of audio) is ~7 s of
# CPU when every search fails; niced beside a loaded decoder the child gets ~5 % of a core: ~140 s. Past this the
# child is stopped or looping: it is killed, that piece has no words, the next piece starts a new one.
PIECE_LIMIT_S = 300.0
READY = b"ready\n"  # the child's first line: it started (its imports done)


def failed_cue(cue, e: BaseException):
    """`cue` with no words and why: the one failure rule's answer (`job.finish`)."""
    return dataclasses.replace(cue, words=(), words_reason=f"word timing failed ({type(e).__name__})")


def timed_apart(cue, samples, sample_rate: int, language: str) -> tuple:
    """`captions.timed` in the aligner process: the cue, and the failure's traceback for the server to log (None)."""
    from ..longform.captions import timed

    try:
        return timed(cue, samples, sample_rate, language), None
    except Exception as e:  # noqa: BLE001 - the one failure rule, logged by the server (finish.time_words)
        return failed_cue(cue, e), traceback.format_exc()


def _request(cue, samples, sample_rate: int, language: str) -> bytes:
    x = np.ascontiguousarray(samples, dtype="<f4")
    head = json.dumps({"cue": [cue.start, cue.end, cue.text, cue.speaker, cue.index], "rate": int(sample_rate),
                       "language": language, "shape": list(x.shape)}, default=_plain).encode()
    return struct.pack("<I", len(head)) + head + x.tobytes()


def _plain(value):
    """A NumPy number as JSON's (a sample position may be one)."""
    return value.item()


def _answer(cue, line: bytes) -> tuple:
    got = json.loads(line)
    words = None if got["words"] is None else tuple(type(cue)(a, b, t, sp) for a, b, t, sp in got["words"])
    return dataclasses.replace(cue, words=words, words_reason=got["reason"]), got["failure"]


class AlignerEnded(RuntimeError):
    """The aligner process ended while it held a piece."""


class Aligner:
    """The one aligner process (started at its first piece) and the pipe to it."""

    def __init__(self, nice: int):
        self.nice = nice
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.broken: str | None = None  # why no process can start (one ended before its ready line): none is tried
        self.limit_s = PIECE_LIMIT_S

    def time(self, *piece) -> tuple:
        """(cue, failure traceback or None) for `piece` = (cue, samples, sample_rate, language), from the child
        (blocking: call it off the event loop); AlignerEnded if it died."""
        with self.lock:
            if self.broken:
                raise AlignerEnded(self.broken)
            try:
                proc = self._started()
            except OSError as e:  # no process could be started (the executable gone, no memory, no pids)
                raise AlignerEnded(f"the aligner process could not start ({type(e).__name__}: {e})") from None
            overdue = threading.Event()

            def end_overdue() -> None:  # a child stopped or looping is ended
                overdue.set()
                proc.kill()

            watchdog = threading.Timer(self.limit_s, end_overdue)
            watchdog.daemon = True
            watchdog.start()
            try:
                proc.stdin.write(_request(*piece))
                proc.stdin.flush()
                line = proc.stdout.readline()
                if not line.endswith(b"\n"):
                    raise EOFError
                return _answer(piece[0], line)
            except (OSError, ValueError, EOFError) as e:  # ValueError: closed under it, or not its answer
                self._end(proc)
                code = proc.poll()
                if overdue.is_set():
                    raise AlignerEnded(f"the aligner process took over {self.limit_s:g} s on one piece and was "
                                       f"ended") from None
                raise AlignerEnded(f"the aligner process ended ({type(e).__name__}"
                                   f"{'' if code is None else f', exit code {code}'})") from None
            finally:
                watchdog.cancel()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH"))
                                                               if p))
            self.proc = subprocess.Popen([sys.executable, "-P", "-m", "higgs_onnx.job.aligner", str(self.nice)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, process_group=0)
            if self.proc.stdout.readline() != READY:
                self._end(self.proc)
                why = f"the aligner process could not start (exit code {self.proc.returncode})"
                if self.proc.returncode > 0:  # its own failure (an import), not a signal's (killed): never again
                    self.broken = why
                raise AlignerEnded(why)
        return self.proc

    def close(self) -> None:
        """End the child without waiting for the piece it may hold (the server's end, on its event loop): its stdin
        closed (not stdout: the queue's thread may be reading it), killed if it is not gone in 0.2 s; the piece's
        caller gets AlignerEnded."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self._end(proc, (proc.stdin,), 0.2)

    @staticmethod
    def _end(proc: subprocess.Popen, pipes=None, wait_s: float = 2.0) -> None:
        """Close `pipes` (default both), wait `wait_s` for the child to go, else kill it."""
        for pipe in pipes or (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except (OSError, ValueError):  # being written by the queue's thread
                pass
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    """The child: pieces from stdin, answers to stdout, until stdin closes."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else written to stdout (a library's print) goes to stderr, not into the answers
    sys.stdout = sys.stderr
    nice = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    try:
        os.nice(nice)  # below the server's own priority
    except (AttributeError, OSError):  # not a POSIX system, or not allowed: the server's priority
        pass
    from ..longform.captions import Cue

    out.write(READY)
    out.flush()
    source = sys.stdin.buffer
    while True:
        size = source.read(4)
        if len(size) < 4:  # the server closed the pipe (its end), or died
            return
        head = json.loads(source.read(struct.unpack("<I", size)[0]))
        shape = head["shape"]
        raw = source.read(4 * int(np.prod(shape)))
        samples = np.frombuffer(raw, "<f4").reshape(shape)
        cue, failure = timed_apart(Cue(*head["cue"]), samples, head["rate"], head["language"])
        words = None if cue.words is None else [[w.start, w.end, w.text, w.speaker] for w in cue.words]
        try:
            out.write(json.dumps({"words": words, "reason": cue.words_reason, "failure": failure},
                                 default=_plain).encode() + b"\n")
            out.flush()
        except BrokenPipeError:
            return


if __name__ == "__main__":
    main()
