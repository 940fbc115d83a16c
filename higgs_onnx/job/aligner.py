"""The word aligner's own process: the server's word timing (`job.finish.time_words`) runs here, apart from the
server.

Why a process: pocketsphinx holds the GIL for a whole search (0.3 s on 30 s of audio, up to 7 searches a piece,
`align.SEARCHES`); in a thread of the server that froze the event loop, and every stream's audio with it, as long
(0.31-0.65 s seen). Why not `ProcessPoolExecutor`: a spawned worker runs the parent's main script again (as
`__mp_main__`): a user's unguarded script would speak again, or fail, in it. This is `python -m
higgs_onnx.job.aligner`, which imports only the aligner.

The protocol is one pickle each way per piece over the child's stdin and stdout (the child's own prints go to
stderr): (cue, samples, sample_rate, language) in, (cue, failure traceback or None) out. One piece at a time
(`Aligner.time` holds a lock; the caller queues in one thread). The child lowers its own priority
(`finish.ALIGNER_NICE`), and ends when its stdin closes: the server's end, or its death (a search under way is
finished first and its answer cannot be written). A child that dies is `AlignerEnded` for the piece it held, and the
next piece starts a new one.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import threading
import traceback
from pathlib import Path

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding higgs_onnx: the child imports it


def failed_cue(cue, e: BaseException):
    """`cue` with no words and why: the one failure rule's answer (`job.finish`)."""
    return dataclasses.replace(cue, words=(), words_reason=f"word timing failed ({type(e).__name__})")


def timed_apart(cue, samples, sample_rate: int, language: str):
    """`captions.timed` in the aligner process: the cue, and the failure's traceback for the server to log (None)."""
    from ..longform.captions import timed

    try:
        return timed(cue, samples, sample_rate, language), None
    except Exception as e:  # noqa: BLE001 - the one failure rule, logged by the server (finish.time_words)
        return failed_cue(cue, e), traceback.format_exc()


class AlignerEnded(RuntimeError):
    """The aligner process ended while it held a piece."""


class Aligner:
    """The one aligner process (started at its first piece) and the pipe to it."""

    def __init__(self, nice: int):
        self.nice = nice
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def time(self, *piece):
        """The child's answer for `piece` (blocking: call it off the event loop); AlignerEnded if it died."""
        with self.lock:
            try:
                proc = self._started()
            except OSError as e:  # no process could be started (the executable gone, no memory, no pids)
                raise AlignerEnded(f"the aligner process could not start ({type(e).__name__}: {e})") from None
            try:
                pickle.dump(piece, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                proc.stdin.flush()
                return pickle.load(proc.stdout)
            except (OSError, ValueError, EOFError, pickle.UnpicklingError) as e:  # ValueError: closed under it
                self._end(proc)
                code = proc.poll()
                raise AlignerEnded(f"the aligner process ended ({type(e).__name__}"
                                   f"{'' if code is None else f', exit code {code}'})") from None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH"))
                                                               if p))
            self.proc = subprocess.Popen([sys.executable, "-m", "higgs_onnx.job.aligner", str(self.nice)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return self.proc

    def close(self) -> None:
        """End the child without waiting for the piece it may hold (the server's end, on its event loop): its stdin
        closed, killed if it is not gone in 0.2 s; the piece's caller gets AlignerEnded."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except (OSError, ValueError):  # being written by the queue's thread
            pass
        try:
            proc.wait(0.2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    @staticmethod
    def _end(proc: subprocess.Popen) -> None:
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            proc.wait(2)
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
    source = sys.stdin.buffer
    while True:
        try:
            piece = pickle.load(source)
        except EOFError:  # the server closed the pipe (its end), or died
            return
        try:
            pickle.dump(timed_apart(*piece), out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
        except BrokenPipeError:
            return


if __name__ == "__main__":
    main()
