"""One scheduler for every job: requests in, rows and audio out, batching a property of the engine.

    sched = Scheduler(backend, codec, slots=4, positions=3072)     # one slot pool for the scheduler's life
    h = sched.submit(request, audio="stream")                       # -> Handle; nothing runs yet
    for chunk in h.chunks(): ...                                    # caller-driven: iterating drives the steps
    sched.start()                                                   # or: a thread of its own steps the loop

The scheduler owns the waiting and running requests and the slot pool (vLLM v1's split of add / schedule /
update, written for this model). One `step()`:

1. **admit**: waiting requests take free slots, in order (a request that continues a finished one's KV cache takes
   over that slot instead, `submit(..., after=handle)`); an `exclusive` request waits for an empty batch and runs
   alone (bit-reproducible);
2. **prefill one chunk**: the oldest request still prefilling gets the next `PrefillPolicy.size()` prompt positions,
   so a long prompt (a voice clone) never stops the running requests: with others decoding the chunk is sized by
   time (about one decode step), alone it is the whole prompt;
3. **decode**: every prefilled request advances one row in one decoder call (`Engine.step`);
4. **retire**: finished requests give their slot back (or keep it for a continuation) and their frames go to the
   codec worker.

Codec work never runs on the decoder loop: a `CodecWorker` thread turns each request's finished frames into audio
(`audio="stream"`: `AudioChunk`s from an incremental codec as rows are made; `audio="speech"`: one decode at the
end, a `Speech`), so the decoder never waits for a codec call. `audio=None` leaves the rows to the caller.

With `idle_unload` seconds, the loop's thread lets the model go when nothing has been in flight, queued or kept
(a kept KV context is a stream that will go on) for that long: the slot pool, the backend and every ONNX Runtime
session (`HiggsTTS.unload`; voices stay), and makes them again before it admits the next request, which waits for
it (`model_state`: loaded, unloading, unloaded, loading). Streams' codecs are then made when a request is admitted,
on the loop's thread, never by `submit`'s caller (a server's event loop).

A `Handle` is what `submit` returns: `chunks()`, `speech()`, `wait()` block (driving the steps themselves when no
thread runs the loop), `cancel()` frees the slot at the next step. Each request samples with its own seeded RNG,
so its codes do not depend on its batch-mates (up to the rounding of batched kernels, see `serve.scheduler`).
"""

from __future__ import annotations

import _thread
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .contract import NoAudioError
from .engine import Engine, Request
from .stream import AudioChunk, AudioStreamer

log = logging.getLogger(__name__)
AUDIO_MODES = (None, "stream", "speech")


class Cancelled(RuntimeError):
    """The request was cancelled before it finished."""


class QueueFull(RuntimeError):
    """Too many requests waiting; try again later."""


@dataclass
class PrefillPolicy:
    """How many prompt positions one prefill chunk takes while other requests decode.

    `chunk`: a fixed number, applied always (deterministic: the batch jobs use it, so the same inputs give the same
    calls whatever else is running), or None to size chunks by time: `share` x the measured decode step, divided
    by the measured cost of one prefill position (on an AVX2 EPYC one position of the 4b model costs ~140 ms
    against a ~216 ms step; a VNNI machine far less); sized by time, a request alone (nothing decoding) prefills
    its whole prompt in one call."""

    chunk: int | None = None
    share: float = 1.0  # a chunk costs about this many decode steps: running streams advance at 1 / (1 + share)
    first: int = 32  # the first chunk, before anything is measured
    least: int = 8
    most: int = 1024
    step_s: float | None = None  # running averages
    position_s: float | None = None

    def __post_init__(self) -> None:
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"a prefill chunk must be >= 1 position, got {self.chunk}")

    def size(self, others_decoding: bool) -> int | None:
        if self.chunk is not None:
            return self.chunk
        if not others_decoding:
            return None  # the whole prompt: nobody waits for it
        if self.step_s is None or self.position_s is None:
            return self.first
        return int(min(self.most, max(self.least, self.share * self.step_s / self.position_s)))

    def saw_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    def saw_prefill(self, seconds: float, positions: int) -> None:
        per = seconds / max(positions, 1)
        self.position_s = per if self.position_s is None else 0.8 * self.position_s + 0.2 * per


class Handle:
    """One submitted request. Blocking calls drive the scheduler's steps when no thread runs its loop."""

    _ids = itertools.count(1)

    def __init__(self, sched: Scheduler, request: Request, audio: str | None, keep: bool, exclusive: bool,
                 after: Handle | None, on_row: Callable[[int], None] | None, sink: Callable[[Any], None] | None):
        self.id = next(self._ids)
        self.sched, self.request, self.audio = sched, request, audio
        self.keep, self.exclusive, self.after, self.on_row = keep, exclusive, after, on_row
        self.state = "waiting"  # -> "running" (prefill, decode) -> "done" | "failed" | "cancelled"
        self.widest = 0  # the largest batch it was stepped in
        self.error: BaseException | None = None
        self.result: Any = None  # Speech (audio="speech"), the last AudioChunk ("stream"), the Request (None)
        self.finished = threading.Event()  # everything done, the codec's part included
        self._cancel = threading.Event()
        self._events = Mailbox()
        self._sink = sink  # called (from the scheduler's / codec's thread) with each event instead of queueing it
        self.streamer: AudioStreamer | None = None
        self.stream_options = None  # audio="stream": the codec's chunking (a redrawn take gets a fresh streamer)
        self.retry = None  # guard.RetryPolicy: a degenerate take is drawn again (`Scheduler._retake`)
        self.takes: list[dict] = []  # every take judged so far (guard.take_record)
        self.verdict = None  # the guard's verdict of the last take judged
        self.drawn: list[np.ndarray] = []  # audio="stream" with retry: this take's samples so far, for its verdict

    # -- the consumer's side --------------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the request: its slot is freed at the next step (a request already finished is left alone)."""
        self._cancel.set()
        self.sched._poke()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def events(self) -> Iterator[Any]:
        """Every event in order: AudioChunks (audio="stream"), then the final result; raises the request's error."""
        while True:
            item = self._next()
            if item is END:
                if self.error is not None:
                    raise self.error
                return
            yield item

    def chunks(self) -> Iterator[AudioChunk]:
        """The request's audio as it is made (audio="stream"). Closing the iterator early cancels the request."""
        if self.audio != "stream":
            raise ValueError("chunks() needs a request submitted with audio='stream'")
        try:
            yield from self.events()
        finally:
            if not self.finished.is_set():
                self.cancel()
                self.wait(raise_error=False)

    def drain(self) -> tuple[list[Any], bool]:
        """The events handed over so far, without waiting or stepping: (items, ended). `ended`: the request (and
        its codec work) is over; its `error` is then set if it failed."""
        items, ended = [], False
        while True:
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                return items, ended
            if item is END:
                ended = True
            else:
                items.append(item)

    def wait(self, raise_error: bool = True) -> Any:
        """Block until the request (and its codec work) is done; returns `result`."""
        for _ in self.events() if raise_error else self._quiet():
            pass
        return self.result

    def _quiet(self) -> Iterator[Any]:
        try:
            yield from self.events()
        except BaseException:  # noqa: BLE001 - the caller asked not to hear it
            return

    def speech(self):
        """The finished request's `Speech` (audio="speech")."""
        if self.audio != "speech":
            raise ValueError("speech() needs a request submitted with audio='speech'")
        return self.wait()

    def _next(self) -> Any:
        while True:
            try:
                return self._events.get_nowait()
            except queue.Empty:
                pass
            if self.sched.threaded or not self.sched.step():
                try:  # the loop's thread or the codec worker will hand it over
                    return self._events.get(timeout=0.05 if not self.sched.threaded else 1.0)
                except queue.Empty:
                    self.sched._check_progress(self)

    def _emit(self, item: Any) -> None:
        if self._sink is not None:
            self._sink(item)
        else:
            self._events.put(item)
        self.sched._poke()

    def _end(self, error: BaseException | None = None) -> None:
        """The request is over (done, failed or cancelled), its codec work too; counted once, here."""
        if self.finished.is_set():
            return
        self.error = error
        self.state = "failed" if error is not None and not isinstance(error, Cancelled) else \
            "cancelled" if error is not None else "done"
        self.sched._count({"done": "finished"}.get(self.state, self.state))
        self.finished.set()
        self.streamer = None  # its codec session is not held by a handle kept after its end (an idle unload frees it)
        self._emit(END)

    def release(self) -> None:
        """Give back the cache a finished `keep=True` request holds (when it will not be continued)."""
        self.sched._release_kept(self)


END = object()  # the last event of every handle


@dataclass(frozen=True)
class Redrawn:
    """The event after a redrawn take's chunks (audio="stream" with retry): the guard found that take degenerate
    (`take`: its `guard.take_record`) and a new draw follows; a consumer drops the chunks before it."""

    take: dict


class Mailbox:
    """A FIFO between threads that a Ctrl-C cannot wedge. `queue.Queue` takes its lock in Python code, so a
    KeyboardInterrupt landing in the main thread between the acquire and the `try` leaves it held, and the next
    `put` (closing the scheduler hands every handle its end) waits forever. Here the items live in a deque (append
    and popleft are atomic) and a waiter sleeps on a bare lock used as a doorbell: `put` only ever releases it,
    and a waiter interrupted after taking it leaves it as it found it, rung or not."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._bell = _thread.allocate_lock()
        self._bell.acquire()  # held: nothing new

    def put(self, item: Any) -> None:
        self._items.append(item)
        try:
            self._bell.release()
        except RuntimeError:  # already rung
            pass

    def get(self, timeout: float | None = None) -> Any:
        """The oldest item; `queue.Empty` when none came within `timeout` seconds (None: wait for one)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._items.popleft()
            except IndexError:
                pass
            left = -1 if deadline is None else deadline - time.monotonic()
            if deadline is not None and left <= 0:
                raise queue.Empty
            self._bell.acquire(timeout=left)

    def get_nowait(self) -> Any:
        try:
            return self._items.popleft()
        except IndexError:
            raise queue.Empty from None


class CodecWorker:
    """A thread that turns finished frames into audio, off the decoder loop, in submission order."""

    def __init__(self, decode_audio: Callable[[np.ndarray], np.ndarray], sample_rate: int, codebook_size: int):
        self.decode_audio, self.sample_rate, self.codebook_size = decode_audio, sample_rate, codebook_size
        self._tasks = Mailbox()
        self._thread: threading.Thread | None = None
        self.busy_s = 0.0

    def put(self, handle: Handle, frames: np.ndarray, final: bool) -> None:
        """Queue `handle`'s frames completed so far (`final`: its last); taken with the row count of now."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="higgs-codec", daemon=True)
            self._thread.start()
        self._tasks.put((handle, frames, final, handle.request.n))

    def stop(self) -> None:
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            handle, frames, final, rows_done = task
            if handle.finished.is_set():
                continue
            t0 = time.perf_counter()
            try:
                if handle.audio == "stream":
                    for chunk in handle.streamer.push(frames, final, rows_done):
                        handle._emit(chunk)
                        if handle.retry is not None:
                            handle.drawn.append(chunk.samples)
                        if chunk.is_last:
                            handle.result = chunk
                    if final and handle.retry is not None and handle.sched._retake(handle, np.concatenate(
                            handle.drawn)):
                        continue  # a degenerate take, drawn again: not the end
                elif final:  # "speech": one decode of every frame, judged by the guard
                    speech = self._speech(handle.request, frames)
                    if handle.sched._retake(handle, speech.waveform):  # a degenerate take, drawn again
                        continue
                    if handle.verdict is not None:
                        speech.verdict, speech.takes = handle.verdict, list(handle.takes)
                    handle.result = speech
            except Exception as e:  # noqa: BLE001 - this request fails (its slot is freed at the next step)
                if not isinstance(e, NoAudioError):
                    log.error("request %d failed in the codec: %s", handle.id, e,  # the caller says it too
                              exc_info=log.isEnabledFor(logging.DEBUG))
                handle._end(e)
                handle.sched._poke()
                continue
            finally:
                self.busy_s += time.perf_counter() - t0
            if final:
                handle._end()

    def _speech(self, req: Request, raw: np.ndarray):
        from .pipeline import speech_from

        return speech_from(req, raw, self.decode_audio, self.sample_rate, self.codebook_size)


def check_idle_unload(seconds: float | None) -> float | None:
    """The idle time before the model is unloaded: seconds > 0 (a finite number), or None (never); ValueError names
    the rule (the one bound of `--idle-unload` at every door)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise ValueError(f"the idle time before unloading must be a number of seconds > 0, got {seconds!r}")
    return float(seconds)


class Scheduler:
    """Owns the waiting and running requests and one slot pool (see the module docstring).

    `backend`: the generation backend; `codec`: what makes audio (`decode_audio(codes)`, `codec_stream(options)`,
    `facts`), e.g. a `HiggsTTS`; `slots`: requests decoded together; `positions`: positions of one slot (None: no
    pool, every request a cache of its own sized for it, stepped one by one: a batch of one). `max_waiting` bounds
    the queue (`QueueFull` beyond it; None: unbounded). `idle_unload`: seconds idle after which the loop's thread
    unloads the model (see the module docstring); `codec` is then the model (`unload()`, `load()` -> the backend,
    `loaded`, `loaded_at`: a `HiggsTTS`)."""

    def __init__(self, backend, codec, slots: int = 1, positions: int | None = None,
                 prefill: PrefillPolicy | None = None, max_waiting: int | None = None, name: str = "higgs-engine",
                 idle_unload: float | None = None):
        if slots < 1:
            raise ValueError(f"a scheduler needs >= 1 slot, got {slots}")
        self.idle_unload = check_idle_unload(idle_unload)
        if self.idle_unload is not None and not callable(getattr(codec, "unload", None)):
            raise TypeError("idle_unload needs a model that can unload (a HiggsTTS as the scheduler's codec)")
        self.model_state = "loaded"  # -> "unloading" -> "unloaded" (idle) -> "loading" (a request came) -> "loaded"
        self.unloads = self.reloads = 0
        self.reload_s: float | None = None  # how long the last load took
        self._quiet_since = time.monotonic()  # when the loop last saw work (the idle clock)
        self.backend, self.codec, self.slots, self.name = backend, codec, slots, name
        self.pool = None if positions is None else backend.pool(slots, positions)
        self.engine = Engine(backend, self.pool)
        self.positions = positions
        self.prefill_policy = prefill or PrefillPolicy()
        self.max_waiting = max_waiting
        facts = codec.facts
        self.codec_worker = CodecWorker(codec.decode_audio, facts.sample_rate, facts.codebook_size)
        self._waiting: deque[Handle] = deque()
        self._running: list[Handle] = []  # admitted: prefilling or decoding
        self._kept: list[Handle] = []  # finished, holding their cache for a continuation
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wedged = False  # close() found the lock held for good (a Ctrl-C left it so)
        self._stepping = threading.Lock()  # one step at a time (a caller-driven scheduler shared by threads)
        # submitted, started, retired (decoded to its end), and how each handle ended: finished, failed, cancelled
        self.counts = {k: 0 for k in ("submitted", "started", "retired", "finished", "failed", "cancelled",
                                      "exclusive", "retried")}
        self.steps = self.batch_rows = 0  # decoder steps, and the rows they advanced (mean batch = ratio)
        self.prefill_calls = self.prefill_positions = 0
        self.decode_s = self.prefill_s = 0.0  # time in decoder steps and in prefill calls
        self.longest_stall_s = 0.0  # the longest prefill chunk run while others were decoding
        self.exclusive_widest = 0
        # called after every decoder step with the requests it advanced (the loop's thread): per-step figures
        self.on_step: Callable[[list[Request]], None] | None = None

    # -- submitting -----------------------------------------------------------------------------------------------
    @property
    def threaded(self) -> bool:
        return self._thread is not None

    @property
    def capacity(self) -> int | None:
        """Positions of one slot (None: caches of their own)."""
        return self.positions

    def submit(self, request: Request, audio: str | None = None, stream_options=None, *, keep: bool = False,
               exclusive: bool = False, after: Handle | None = None, on_row: Callable[[int], None] | None = None,
               sink: Callable[[Any], None] | None = None, retry=None) -> Handle:
        """Queue `request`; returns its `Handle`. `audio`: None (rows only), "stream" (AudioChunks while it is made,
        sized by `stream_options`), "speech" (one `Speech` at the end). `keep`: hold the cache when done, for a
        request that continues it (`after=` that handle: its prompt starts with the finished one's prompt and rows,
        and only the rest is prefilled). `exclusive`: run alone. `on_row(n)` is called after each row (from the
        loop's thread). `sink(event)` receives the events instead of the handle's queue (the server's event loop).
        `retry` (a `guard.RetryPolicy`): a take the guard finds degenerate is drawn again, with a new seed and a
        cooler temperature, up to its retries (`_retake`, the one redraw driver); the `Speech` lists every take
        (`takes`); a stream's consumer gets each redrawn take's chunks, then a `Redrawn` event, then the next draw's
        (`handle.takes` lists them all). A voice blend (`request.width` > 1) takes a slot per voice: it waits for
        that many, and one wider than the scheduler is refused here."""
        if audio not in AUDIO_MODES:
            raise ValueError(f"audio must be one of {AUDIO_MODES}, got {audio!r}")
        if request.width > self.slots:
            raise ValueError(f"a blend of {request.width} voices needs {request.width} batch slots, but this "
                             f"scheduler has {self.slots}")
        if request.width > 1 and (keep or after is not None):
            raise ValueError("a voice blend cannot keep or continue a KV cache (one per voice)")
        if after is not None and (after.sched is not self or not after.keep):
            raise ValueError("after= must be a handle of this scheduler submitted with keep=True")
        if retry is not None and (audio is None or keep or after is not None):
            raise ValueError("retry= is for requests with audio that neither keep nor continue a cache (a redraw "
                             "starts again from the same prompt; long-form retries its pieces in their lanes)")
        handle = Handle(self, request, audio, keep, exclusive, after, on_row, sink)
        handle.retry = retry
        if audio == "stream":
            from .codec_stream import StreamOptions

            handle.stream_options = stream_options or StreamOptions()
            if self.idle_unload is None:  # else made at admission, on the loop's thread, once the model is loaded
                handle.streamer = self._streamer(request, handle.stream_options)
        with self._wake:
            if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting")
            self._waiting.append(handle)
            self.counts["submitted"] += 1
            self._wake.notify_all()
        return handle

    def _streamer(self, request: Request, stream_options) -> AudioStreamer:
        f = self.codec.facts
        return AudioStreamer(request, self.codec.codec_stream(stream_options), f.sample_rate, f.codebook_size)

    def _retake(self, handle: Handle, samples: np.ndarray) -> bool:
        """The one redraw driver of a whole take, for every door (the command line, corpus rows and the Python API
        with audio="speech"; the server's jobs with audio="stream"): judge the finished take on its `samples` (the
        codec's thread), record it (`handle.verdict`, `handle.takes`); a degenerate one of a handle with retries
        left is queued again as a new draw (first in line) and True returned."""
        from ..guard import GuardOptions, judge, take_record

        req, f = handle.request, self.codec.facts
        if req.text is None:  # a request not made from a text (the guard has nothing to measure it against)
            return False
        g = req.watch.options if req.watch is not None else GuardOptions()
        verdict = handle.verdict = judge(req.generated, req.text, f.frame_rate, f.num_codebooks, req.stop_reason,
                                         samples, f.hop, g)
        handle.takes.append(take_record(req.options, req.n, req.stop_reason, verdict))
        if handle.retry is None or handle.cancelled:
            return False
        options = handle.retry.after(verdict, req.options, len(handle.takes))
        if options is None:
            return False
        log.info("request %d: take %d is %s (%s); drawing again with seed %d, temperature %.2f", handle.id,
                 len(handle.takes), verdict.name, verdict.reason, options.seed, options.temperature)
        handle.request = req.redraw(options)
        if handle.audio == "stream":  # the next draw's chunks come from a fresh codec stream, after the marker
            handle.drawn, handle.streamer = [], self._streamer(handle.request, handle.stream_options)
            handle._emit(Redrawn(handle.takes[-1]))
        with self._wake:
            handle.state = "waiting"
            self._waiting.appendleft(handle)
            self.counts["retried"] += 1
            self._wake.notify_all()
        return True

    def _count(self, what: str) -> None:
        if self._wedged:  # closing with the lock held for good: nothing else runs to race the count
            self.counts[what] += 1
            return
        with self._lock:
            self.counts[what] += 1

    def _poke(self) -> None:
        """Wake the loop and anyone waiting. Never blocks for long: a Ctrl-C in the caller's thread may have left
        the lock held (see Mailbox), and the close that follows pokes once per handle."""
        if not self._wedged and self._lock.acquire(timeout=1.0):
            try:
                self._wake.notify_all()
            finally:
                self._lock.release()

    # -- the loop ----------------------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        """Run the loop in a thread of its own (the server, the corpus actor); `stop()` ends it."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """End the loop's thread; requests still waiting or running fail ("shutting down"). The loop ends after its
        current step, and between the prompts it prefills; a step (one ORT call: a long prompt on a big model) that
        outlasts `timeout` is left to finish in its daemon thread while everything is failed and freed here, so a
        server's shutdown keeps its grace period."""
        self._stop.set()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                log.warning("the scheduler's step outlasted %.0f s: shutting down without waiting for it", timeout)
            self._thread = None
        self.close(RuntimeError("the scheduler is shutting down"))

    def close(self, error: BaseException | None = None) -> None:
        """Fail what is left, free every slot, stop the codec worker. Never blocks for long: a Ctrl-C that landed
        while the lock was being taken may have left it held, and closing must still end."""
        got = self._lock.acquire(timeout=2)
        self._wedged = not got  # then nobody waits on it any more: pokes are skipped, not each timed out
        try:
            left, self._waiting = list(self._waiting), deque()
        finally:
            if got:
                self._lock.release()
        for h in left + self._running:
            h.request.release()
            h._end(error or RuntimeError("the scheduler was closed"))
        self._running = []
        for h in self._kept:
            h.request.release()
        self._kept = []
        self.codec_worker.stop()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc) -> None:
        if self.threaded:
            self.stop()
        else:
            self.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                worked = self.step()
                if worked:
                    self._quiet_since = time.monotonic()
                else:
                    self._unload_if_idle()
            except Exception:  # noqa: BLE001 - step handles request errors; this is a bug, keep serving
                log.exception("scheduler step failed")
                worked = False
            if not worked:
                with self._wake:
                    if not self._waiting and not self._stop.is_set():
                        self._wake.wait(timeout=0.5)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    @property
    def _busy(self) -> bool:
        """Anything in flight (waiting, running, or its codec work not done) or kept for a continuation."""
        c = self.counts
        return bool(self._waiting or self._running or self._kept) or \
            c["submitted"] > c["finished"] + c["failed"] + c["cancelled"]

    def _unload_if_idle(self) -> None:
        """(the loop's thread, nothing stepped) Unload the model once nothing has been busy, and no session made
        (a voice), for `idle_unload` seconds: the pool, the engine, the backend, then every session."""
        if self.idle_unload is None:
            return
        now = time.monotonic()
        if self._busy:
            self._quiet_since = now
            return
        quiet = now - max(self._quiet_since, self.codec.loaded_at)
        if quiet < self.idle_unload or (self.engine is None and not self.codec.loaded):
            return
        with self._stepping:
            with self._lock:  # a request submitted meanwhile keeps it loaded
                if self._busy:
                    return
                self.model_state = "unloading"
                self.backend = self.pool = self.engine = None
            parts = self.codec.unload()
            self.unloads += 1
            self.model_state = "unloaded"  # its memory is back with the system now
        log.info("nothing to do for %.0f s: the model is unloaded (%d sessions let go); the next request loads it",
                 quiet, len(parts))

    def _reload(self) -> bool:
        """(under `_stepping`) Load the model again for the requests waiting (they wait for it); a load that fails
        fails them with its error, and the next request tries again."""
        self.model_state = "loading"
        t0 = time.perf_counter()
        try:
            backend = self.codec.load()
            pool = None if self.positions is None else backend.pool(self.slots, self.positions)
        except Exception as e:  # noqa: BLE001 - the waiting requests fail with it; the server goes on
            self.model_state = "unloaded"
            log.error("loading the model again failed: %s", e, exc_info=log.isEnabledFor(logging.DEBUG))
            with self._lock:
                left, self._waiting = list(self._waiting), deque()
            for h in left:
                h._end(e)
            return False
        self.backend, self.pool, self.engine = backend, pool, Engine(backend, pool)
        self.reload_s = time.perf_counter() - t0
        self.reloads += 1
        self.model_state = "loaded"
        log.info("the model is loaded again in %.2f s", self.reload_s)
        return True

    def step(self) -> bool:
        """One iteration: admit, one prefill chunk, one decode step, retire. Returns False when there was nothing
        to do (the caller may wait)."""
        with self._stepping:
            self._retire_cancelled()
            if self.engine is None and (not self._waiting or not self._reload()):
                return False  # unloaded: loaded again only for a request
            self._admit()
            if not self._running:
                return False
            self._prefill_chunk()
            self._decode()
            return True

    def wait_for_codec(self, timeout: float = 0.05) -> None:
        """Caller-driven: nothing left to step, but the codec worker is still making audio; wait a little."""
        with self._wake:
            self._wake.wait(timeout)

    def run_until_idle(self) -> None:
        """Caller-driven: step until nothing waits or runs."""
        while self.step():
            pass

    # -- the parts of a step ---------------------------------------------------------------------------------
    def _retire_cancelled(self) -> None:
        """Cancelled requests, and requests whose codec work failed while they were still decoding, leave the
        batch and give their slot back."""
        for h in [h for h in self._running if h.cancelled or h.finished.is_set()]:
            self._running.remove(h)
            h.request.release()
            h._end(Cancelled(f"request {h.id} was cancelled"))
        with self._lock:
            gone = [h for h in self._waiting if h.cancelled]
            for h in gone:
                self._waiting.remove(h)
        for h in gone:
            if h.after is not None:  # step holds _stepping: _release_kept would take it again (a deadlock)
                self._drop_kept(h.after)
            h._end(Cancelled(f"request {h.id} was cancelled"))

    def _free_slots(self) -> int:
        return self.slots - sum(h.request.width for h in self._running) - len(self._kept)

    @property
    def starved(self) -> bool:
        """A request waits for a slot while finished requests keep theirs (a kept cache given back would let it in).
        """
        with self._lock:
            return bool(self._kept) and any(h.after is None for h in self._waiting) and self._free_slots() <= 0

    def _admit(self) -> None:
        """Waiting requests into the batch: in order while slots are free; a request that continues a kept cache
        needs no new slot, so it never waits behind one that does."""
        while True:
            with self._lock:
                if not self._waiting or any(h.exclusive for h in self._running):
                    return
                head = next((h for h in self._waiting if h.after is not None), None)
                if head is None:
                    head = self._waiting[0]
                    if head.exclusive and self._running:
                        return  # the batch drains first; the ones behind it wait too
                    if self._free_slots() < head.request.width:  # a voice blend: a slot per voice
                        return
                self._waiting.remove(head)
            cache = None
            try:
                if head.after is not None:
                    prev = head.after
                    if prev not in self._kept:
                        raise ValueError(f"request {prev.id} is not finished or did not keep its cache")
                    self._kept.remove(prev)
                    cache = prev.request.hand_over()
                if head.audio == "stream" and head.streamer is None:  # `submit` left it to the loop (idle_unload)
                    head.streamer = self._streamer(head.request, head.stream_options)
                self.engine.admit(head.request, cache)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                if cache is not None and head.request.cache is None:
                    head.request.cache = cache
                head.request.release()
                head._end(e)
                continue
            head.state = "running"
            self._running.append(head)
            self.counts["started"] += 1
            if head.exclusive:
                self.counts["exclusive"] += 1
                return

    def _prefill_chunk(self) -> None:
        """One chunk of the oldest prompt still prefilling; while nothing decodes, every waiting prompt to its end
        (nobody waits for them; in fixed chunks when the policy has them)."""
        decoding = any(x.request.decoding for x in self._running)
        while not self._stop.is_set():  # stopping: not another prompt
            waiting = [h for h in self._running if h.request.prefilling]
            if not waiting:
                return
            self._prefill_one(waiting[0], decoding)
            if decoding:
                return

    def _prefill_one(self, h: Handle, decoding: bool) -> None:
        limit = self.prefill_policy.size(decoding)
        t0 = time.perf_counter()
        try:
            n = self.engine.prefill(h.request, limit)
        except Exception as e:  # noqa: BLE001 - this request fails (its slot is back), the others go on
            log.error("request %d failed in prefill: %s", h.id, e,  # the caller says it too: a traceback at DEBUG
                      exc_info=log.isEnabledFor(logging.DEBUG))
            self._running.remove(h)
            h._end(e)
            return
        spent = time.perf_counter() - t0
        self.prefill_policy.saw_prefill(spent, n)
        self.prefill_s += spent
        self.prefill_calls += 1
        self.prefill_positions += n
        if decoding:
            self.longest_stall_s = max(self.longest_stall_s, spent)

    def _decode(self) -> None:
        live = [h for h in self._running if h.request.decoding]
        if not live:
            return
        keep = frozenset(id(h.request) for h in live if h.keep)
        t0 = time.perf_counter()
        try:
            self.engine.step([h.request for h in live], keep)
        except Exception as e:  # noqa: BLE001 - a failed step fails its batch; the scheduler goes on
            log.error("decoder step failed: %s", e, exc_info=log.isEnabledFor(logging.DEBUG))  # its callers say it
            for h in live:
                self._running.remove(h)
                h.request.release()
                h._end(e)
            return
        spent = time.perf_counter() - t0
        self.prefill_policy.saw_step(spent)
        self.decode_s += spent
        self.steps += 1
        rows = sum(h.request.width for h in live)  # batch rows: a voice blend is a row per voice
        self.batch_rows += rows
        if self.on_step is not None:
            self.on_step([h.request for h in live])
        for h in live:
            h.widest = max(h.widest, rows)
            if h.exclusive:
                self.exclusive_widest = max(self.exclusive_widest, rows)
            req = h.request
            if h.on_row is not None:
                try:
                    h.on_row(req.n)
                except Exception as e:  # noqa: BLE001 - a consumer's callback failing stops its own request
                    req.stop_reason = req.stop_reason or "cancelled"
                    self._running.remove(h)
                    req.release()
                    h._end(e)
                    continue
            if h.audio == "stream":
                frames = req.new_frames()
                if len(frames) or req.done:
                    self.codec_worker.put(h, frames, req.done)
            if req.done:
                self._running.remove(h)
                self.counts["retired"] += 1
                if h.keep:
                    self._kept.append(h)
                if h.audio == "speech":
                    self.codec_worker.put(h, req.new_frames(), True)
                elif h.audio is None:
                    h.result = req
                    h._end()

    def _check_progress(self, handle: Handle) -> None:
        """Caller-driven: a request that can never start (every slot held by kept requests) is an error, not a
        hang."""
        if (not self.threaded and handle.state == "waiting" and not self._running and handle.after is None
                and self._free_slots() < handle.request.width):
            raise RuntimeError(f"request {handle.id} cannot start: all {self.slots} slots are held by finished "
                               f"requests kept for a continuation (release or continue them)")

    def _release_kept(self, handle: Handle) -> None:
        with self._stepping:
            self._drop_kept(handle)

    def _drop_kept(self, handle: Handle) -> None:
        """Give back a kept context (its slot and KV rows); the caller holds `_stepping`."""
        if handle in self._kept:
            self._kept.remove(handle)
            handle.request.release()

    # -- figures ----------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        mean = self.batch_rows / self.steps if self.steps else 0.0
        running = list(self._running)
        return {"slots": self.slots, "slot_positions": self.positions, "waiting": len(self._waiting),
                "active": len(running), "prefilling": sum(h.request.prefilling for h in running),
                "kept": len(self._kept), "decoder_steps": self.steps,
                "rows": self.batch_rows, "mean_batch": round(mean, 3), "prefill_calls": self.prefill_calls,
                "prefill_positions": self.prefill_positions, "decode_s": round(self.decode_s, 3),
                "prefill_s": round(self.prefill_s, 3), "longest_stall_s": round(self.longest_stall_s, 4),
                "codec_busy_s": round(self.codec_worker.busy_s, 3), **self.counts,
                "exclusive_widest_batch": self.exclusive_widest, "model_state": self.model_state,
                "idle_unload_s": self.idle_unload, "unloads": self.unloads, "reloads": self.reloads,
                "reload_s": None if self.reload_s is None else round(self.reload_s, 3)}


_GAINS: dict[tuple[int, tuple[int, ...]], dict[int, float]] = {}


def measure_batch_gain(backend, sizes=(1, 2, 4), steps: int = 3, prompt: int = 16) -> dict[int, float]:
    """This machine's batch gain G(B) = rows/s decoding B requests together / rows/s decoding one, from a few
    decoder steps of a small pool (a second or two on the 4b model; measured once per backend and process).

    Batching is ISA-dependent (the same 4b step: 2.97x at B=4 on an AVX-512 EPYC, 1.04x on an AVX2-only one, where
    int8-activation matmuls turn compute-bound at M >= 2), so jobs that choose a batch size ask the machine."""
    key = (id(backend), tuple(sizes))
    if key in _GAINS:
        return _GAINS[key]
    embeds = backend.embed_text(np.arange(prompt, dtype=np.int64) % 100 + 10)
    per_row = {}
    for b in sorted(set(sizes) | {1}):
        pool = backend.pool(b, prompt + steps + 2)
        slots = [pool.acquire(prompt + steps + 2) for _ in range(b)]
        try:
            for s in slots:
                backend.prefill(s, embeds)
            step = np.repeat(embeds[-1:], b, axis=0)
            best = float("inf")
            for k in range(steps + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                if b == 1:
                    backend.decode(slots[0], step)
                else:
                    backend.decode_batch(slots, step)
                if k:
                    best = min(best, time.perf_counter() - t0)
            per_row[b] = best / b
        finally:
            for s in slots:
                s.free()
    gains = {b: per_row[1] / per_row[b] for b in per_row}
    _GAINS[key] = gains
    return gains


def choose_batch(gains: dict[int, float], pays: float = 1.3) -> int:
    """The batch size worth running: the largest B whose gain is at least `pays` x that of the next smaller size
    measured (1 where batching does not pay)."""
    best = 1
    for b in sorted(gains):
        if b > best and gains[b] >= pays * gains[best]:
            best = b
    return best
