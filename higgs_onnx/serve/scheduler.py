"""The server's side of the one scheduler: jobs from the event loop -> `generation.scheduler.Scheduler` -> chunks back.

This module keeps no admit / step / retire loop of its own. `JobScheduler` wraps one core scheduler
(`tts.scheduler(max_batch, slot_positions, prefill)`, started in its own thread) that every speech request feeds:
it admits waiting requests into free slots between decoder steps (continuous batching), prefills a new prompt in
chunks interleaved with the running requests' decode steps (sized by time unless `prefill_chunk` fixes them), runs
one batched decoder call per step and turns each request's frames into audio on its codec worker thread, never on
the decoder loop.

A `Job` bridges one core `Handle` to asyncio: the handle's sink (called from the loop's and the codec's threads)
hands each `AudioChunk`, then the end, to the job's asyncio queue with `loop.call_soon_threadsafe`; the handler
reads them with `async for chunk in job`. A cancelled job (client gone) leaves its slot at the next step; a job that
ends without any chunk ends its iteration empty (the app answers that with a 500 `no_audio`); any other failure is
raised from the iteration.

What the server adds to the core: a limit on jobs in flight (`max_batch` running + `max_queue` waiting; beyond it
`QueueFull` -> HTTP 429), requests built for the pool's slot (`slot_positions`: the model's context or
`POOL_POSITIONS`, whichever is smaller, so one that does not fit is refused at `submit`, never cut), and the
outcome counts of the jobs as the clients saw them (a job is `finished` once its last chunk was handed over).

Batched rows go through ONNX Runtime kernels that can round differently from a lone row (M > 1 GEMMs, int4
MatMulNBits), so a seeded request may drift from the same request made alone; an `exclusive` (deterministic) job
runs as a batch of one: jobs are admitted in order, it waits until the running batch has drained, runs alone, and
the jobs behind it start once it is done. Its rows and samples then equal the request made alone (`tts.stream`;
`tts.generate` has the same rows, its one-shot codec decode may differ in the last float bits).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import threading
from collections import Counter
from collections.abc import AsyncIterator

from ..generation.codec_stream import StreamOptions
from ..generation.contract import ContractError
from ..generation.engine import Request
from ..generation.options import GenerationOptions
from ..generation.scheduler import END, Cancelled, Handle, PrefillPolicy, QueueFull, check_idle_unload
from ..generation.stream import AudioChunk

__all__ = ["Job", "QueueFull", "JobScheduler", "ShuttingDown", "add_idle_unload", "idle_note"]


STOP_GRACE_S = 5.0  # a shutdown waits this long for the decoder loop's current step (docs/server.md)


def idle_seconds(text: str) -> float:
    """`--idle-unload`'s value (argparse's type): the core's one bound (`check_idle_unload`), as one line, exit 2."""
    try:
        value: float | str = float(text)
    except ValueError:
        value = text
    try:
        return check_idle_unload(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def idle_note(seconds: float | None) -> str:
    """What a server's ready line says of `--idle-unload` (nothing without it)."""
    return f", unloaded after {seconds:g} s idle" if seconds else ""


def add_idle_unload(ap: argparse.ArgumentParser) -> None:
    """`--idle-unload SECONDS`, one definition for every server command (serve, serve --ray, the Wyoming server)."""
    ap.add_argument("--idle-unload", type=idle_seconds, metavar="SECONDS", help="unload the model (its ONNX Runtime "
                    "sessions: the memory they hold goes back to the system) after this many seconds with nothing in "
                    "flight, queued or kept, and load it again for the next request, which waits for it; voices "
                    "stay (default: never; docs/server.md, Idle unload)")


class ShuttingDown(RuntimeError):
    """The server stopped before the job ended (HTTP 503 for a job that had sent nothing yet)."""


class Job:
    """One submitted utterance: iterate it (async) for its chunks; `cancel()` when the client goes away."""

    _ids = itertools.count(1)

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop, exclusive: bool, done,
                 stopping: threading.Event):
        self.id = next(self._ids)
        self.request, self.loop, self.exclusive = request, loop, exclusive
        self.handle: Handle | None = None  # set by `JobScheduler.submit`
        self.error: BaseException | None = None  # the failure, once the job ended (None: done or cancelled)
        self.outcome: str | None = None  # "finished" | "failed" | "cancelled", once ended
        self._out: asyncio.Queue = asyncio.Queue()
        self._done = done  # the scheduler's bookkeeping, called once with the job when it ends
        self._stopping = stopping  # set by `JobScheduler.stop`: what fails from then on fails for that reason
        self._ended = threading.Lock()  # taken by the first end
        self._ready = threading.Event()  # `handle` is set (the core may end a job before `submit` returns)
        self.on_stats = None  # called (any thread) with the job's GenerationStats when its last chunk comes

    @property
    def widest(self) -> int:
        """The largest batch this job was stepped in (1: always alone)."""
        return self.handle.widest if self.handle is not None else 0

    @property
    def cancelled(self) -> bool:
        return self.handle is not None and self.handle.cancelled

    @property
    def takes(self) -> list[dict]:
        """Every take the guard judged (a job with `retry`), in order."""
        return list(self.handle.takes) if self.handle is not None else []

    def cancel(self) -> None:
        """Stop the job: its slot is freed at the next decoder step (a job that already ended is left alone)."""
        if self.handle is not None:
            self.handle.cancel()

    # the core's loop / codec threads -> the event loop
    def _sink(self, item) -> None:
        if item is END:
            if not self._ended.acquire(blocking=False):
                return  # ended already (the core ends a handle once; this guards a race between its threads)
            self._ready.wait(timeout=10)
            error = self.handle.error if self.handle is not None else None
            self.outcome = ("cancelled" if isinstance(error, Cancelled) else "failed" if error is not None else
                            "finished")
            if self._stopping.is_set() and error is not None and not isinstance(error, Cancelled):
                error = ShuttingDown("the server is shutting down")
            self.error = None if isinstance(error, Cancelled) else error
            if self.error is not None and self.handle is not None:
                self.handle.cancel()  # a codec failure mid-stream: its rows are of no use, free the slot
            self._done(self)
        elif self._ended.locked():
            return  # a codec chunk that raced the cancellation: nobody reads after the end
        elif self.on_stats is not None and getattr(item, "stats", None) is not None:
            self.on_stats(item.stats)
        try:
            self.loop.call_soon_threadsafe(self._out.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            if self.handle is not None:
                self.handle.cancel()

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        while True:
            item = await self._out.get()
            if item is END:
                if self.error is not None:
                    raise self.error
                return
            yield item


class JobScheduler:
    """The server's scheduler: `max_batch` requests share each decoder call, `max_queue` more may wait.

    `prefill_chunk`: prompt positions per prefill chunk while others decode (None: sized by time, about one decode
    step's worth; a fixed number makes the calls the same whatever the machine's speed). `idle_unload`: seconds
    with nothing in flight, queued or kept after which the scheduler's thread unloads the model, loaded again for
    the next job (`model_state`; None: never)."""

    def __init__(self, tts, max_batch: int = 4, max_queue: int = 16, prefill_chunk: int | None = None,
                 idle_unload: float | None = None):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        self.tts, self.max_batch, self.max_queue = tts, max_batch, max_queue
        # positions of one pool slot: what every request is built for, and what the pool is made with
        self.slot_positions = tts.slot_positions
        self.prefill = PrefillPolicy(chunk=prefill_chunk)  # ValueError for a chunk < 1
        self.core = tts.scheduler(max_batch, self.slot_positions, self.prefill, idle_unload=idle_unload)
        self._lock = threading.Lock()
        self._pending = 0  # jobs submitted and not ended
        self._stopping = threading.Event()
        self._started = False
        self.counts: Counter[str] = Counter()  # submitted, finished, failed, cancelled (as the clients saw them),
        # rejected (the queue was full)
        self.on_stats = None  # called with each finished job's GenerationStats (the metrics' histograms)

    def start(self) -> None:
        self._stopping.clear()
        self.core.start()
        self._started = True

    @property
    def ready(self) -> bool:
        """Started and not stopping (the server's readiness)."""
        return self._started and not self._stopping.is_set()

    @property
    def model_state(self) -> str:
        """"loaded", "unloading" then "unloaded" (idle: `idle_unload`), "loading" (a job came and waits for it)."""
        return self.core.model_state

    @property
    def starved(self) -> bool:
        """A job waits for a slot that a kept KV context holds (a session idle between segments gives it back)."""
        return self.core.starved

    @property
    def alive(self) -> bool:
        """The loop's thread runs (a Ray Serve replica's health check)."""
        thread = self.core._thread
        return thread is not None and thread.is_alive()

    def stop(self) -> None:
        """End the loop's thread after its current step (at most `STOP_GRACE_S`: a longer step is left to its daemon
        thread); jobs still waiting or running fail ("shutting down"), every slot is freed and the codec worker
        stops."""
        self._stopping.set()
        self.core.stop(timeout=STOP_GRACE_S)

    def submit(self, text: str, *, voice=None, options: GenerationOptions | None = None,
               stream_options: StreamOptions | None = None, exclusive: bool = False, keep: bool = False,
               history: list = (), continues: Job | None = None, retry=None) -> Job:
        """A job for `text` (call from the event loop), built for one pool slot. A request that breaks the contract
        raises ContractError, other bad text/options ValueError, here; a full queue raises QueueFull, a stopped
        scheduler ShuttingDown. An
        `exclusive` job runs alone (a batch of one): reproducible to the bit, at the cost of draining the batch.
        `keep`: its KV cache is held when it ends, for a job that `continues` it (KV continuation: `history` then
        ends with its (text, rows) turn, and only the new text is prefilled); a kept job nobody continues is given
        back with `job.handle.release()`. `retry` (a `guard.RetryPolicy`): a take the guard finds degenerate is
        drawn again by the core's one redraw driver; each redrawn take's chunks are followed by a
        `generation.scheduler.Redrawn` event (`job.takes` lists every take)."""
        if self._stopping.is_set():
            raise ShuttingDown("the server is shutting down")
        width = getattr(voice, "width", 1)  # a blend of voices (`generation.blend.Blend`): a batch slot per voice
        if width > self.max_batch:
            raise ContractError(f"a blend of {width} voices needs {width} batch slots, but this server runs "
                                f"{self.max_batch} at a time (--max-batch)", "voice")
        # a bad request is refused before a full queue
        req = self.tts.request(text, voice=voice, options=options, slot=self.slot_positions, history=history,
                               continues=None if continues is None else continues.request)
        job = Job(req, asyncio.get_running_loop(), exclusive, self._ended, self._stopping)
        job.on_stats = self.on_stats
        with self._lock:
            if self._pending >= self.max_batch + self.max_queue:
                self.counts["rejected"] += 1
                raise QueueFull(f"{self._pending} requests in flight; the server takes {self.max_batch} at a time "
                                f"and queues {self.max_queue}")
            self._pending += 1
            self.counts["submitted"] += 1
        try:
            job.handle = self.core.submit(req, "stream", stream_options or StreamOptions(), exclusive=exclusive,
                                          sink=job._sink, keep=keep, retry=retry,
                                          after=None if continues is None else continues.handle)
        except BaseException:
            with self._lock:
                self._pending -= 1
                self.counts["submitted"] -= 1
            raise
        finally:
            job._ready.set()
        return job

    def _ended(self, job: Job) -> None:
        with self._lock:
            self._pending -= 1
            self.counts[job.outcome] += 1

    def stats(self) -> dict:
        """The core's figures (slots, steps, batch, prefill, stalls, codec time) with the server's view of its jobs:
        `in_flight` (submitted, not ended), the limits, and the outcomes as the clients saw them. `active` jobs hold
        a slot (`prefilling` of them are still being prefilled); `slots_in_use` is the pool's own count."""
        core = self.core.stats()
        with self._lock:
            pending, counts = self._pending, dict(self.counts)
        pool = self.core.pool
        prefilling = core["prefilling"]
        return {"in_flight": pending, "active": core["active"], "prefilling": prefilling, "waiting": core["waiting"],
                "kept": core["kept"], "slots_in_use": pool.in_use if pool is not None else 0,
                "max_batch": self.max_batch, "max_queue": self.max_queue, "slot_positions": self.slot_positions,
                "prefill_chunk": self.prefill.chunk, "decoder_steps": core["decoder_steps"], "rows": core["rows"],
                "mean_batch": core["mean_batch"], "prefill_calls": core["prefill_calls"],
                "prefill_positions": core["prefill_positions"], "decode_s": core["decode_s"],
                "prefill_s": core["prefill_s"], "longest_stall_s": core["longest_stall_s"],
                "codec_busy_s": core["codec_busy_s"], "submitted": counts.get("submitted", 0),
                "started": core["started"],
                **{k: counts.get(k, 0) for k in ("finished", "failed", "cancelled", "rejected")},
                "exclusive": core["exclusive"], "exclusive_widest_batch": core["exclusive_widest_batch"],
                **{k: core[k] for k in ("model_state", "idle_unload_s", "unloads", "reloads", "reload_s")}}
