"""The scheduler: requests from any number of clients -> one engine thread that advances them in batches.

A `Job` is submitted from the server's event loop; its audio comes back as `AudioChunk`s through an asyncio queue
(`async for chunk in job`). The engine thread admits queued jobs into free batch slots between decoder steps
(continuous batching), steps every active job with one decoder call, decodes each job's finished frames with its
own incremental codec and hands the chunks over. A full queue refuses new jobs (`QueueFull` -> HTTP 429); a
cancelled job (client gone) leaves the batch at the next step and frees its slot.

Requests are built for the pool's slot (`slot_positions`: the model's context or `POOL_POSITIONS`, whichever is
smaller), so one that does not fit is refused at `submit`, never cut. Batched rows go through ONNX Runtime kernels
that can round differently from a lone row (M > 1 GEMMs, int4 MatMulNBits), so a seeded request may drift from the
same request made alone; an `exclusive` (deterministic) job runs as a batch of one: jobs are admitted in order,
it waits until the running batch has drained, runs alone, and the jobs behind it start once it is done. Its rows
and samples then equal the request made alone (`tts.stream`; `tts.generate` has the same rows, its one-shot codec
decode may differ in the last float bits).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import Counter, deque
from collections.abc import AsyncIterator

from ..generation.contract import NoAudioError
from ..generation.engine import Engine, Request
from ..generation.options import POOL_POSITIONS, GenerationOptions
from ..generation.stream import AudioChunk, AudioStreamer
from ..runtime.stream import StreamOptions

log = logging.getLogger(__name__)
_DONE = object()


class QueueFull(RuntimeError):
    """Too many jobs waiting; try again later."""


class Job:
    """One submitted utterance: iterate it (async) for its chunks; `cancel()` when the client goes away."""

    _ids = itertools.count(1)

    def __init__(self, request: Request, stream_options: StreamOptions, sample_rate: int,
                 loop: asyncio.AbstractEventLoop, exclusive: bool = False):
        self.id = next(self._ids)
        self.request, self.stream_options, self.sample_rate = request, stream_options, sample_rate
        self.loop, self.exclusive = loop, exclusive
        self.widest = 0  # the largest batch this job was stepped in (1: always alone)
        self.cancelled = threading.Event()
        self._out: asyncio.Queue = asyncio.Queue()
        self.error: BaseException | None = None
        self.audio: AudioStreamer | None = None  # made when the job enters the batch

    def cancel(self) -> None:
        self.cancelled.set()

    # engine thread -> event loop
    def _emit(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self._out.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        while True:
            item = await self._out.get()
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item


class Scheduler:
    """Owns the engine thread. `max_batch` requests share each decoder call; `max_queue` more may wait."""

    def __init__(self, tts, max_batch: int = 4, max_queue: int = 16):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        self.tts, self.max_batch, self.max_queue = tts, max_batch, max_queue
        # positions of one pool slot: what every request is built for, and what the pool is made with
        self.slot_positions = min(tts.facts.max_positions, POOL_POSITIONS)
        self._waiting: deque[Job] = deque()
        self._wake = threading.Condition()
        self._pending = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = self.batch_rows = 0  # decoder calls made, and the rows they advanced (mean batch = ratio)
        self.active = 0  # jobs in the batch now
        self.counts: Counter[str] = Counter()  # submitted, started, finished, failed, cancelled, exclusive
        self.exclusive_widest = 0  # the largest batch an exclusive job was ever stepped in (1: always alone)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="higgs-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, text: str, *, voice=None, options: GenerationOptions | None = None,
               stream_options: StreamOptions | None = None, exclusive: bool = False) -> Job:
        """A job for `text` (call from the event loop), built for one pool slot. A request that breaks the contract
        raises ContractError, other bad text/options ValueError, here; a full queue raises QueueFull. An
        `exclusive` job runs alone (a batch of one): reproducible to the bit, at the cost of draining the batch."""
        # a bad request is refused before a full queue
        req = self.tts.request(text, voice=voice, options=options, slot=self.slot_positions)
        with self._lock:
            if self._pending >= self.max_batch + self.max_queue:
                raise QueueFull(f"{self._pending} requests in flight; the server takes {self.max_batch} at a time "
                                f"and queues {self.max_queue}")
            job = Job(req, stream_options or StreamOptions(), self.tts.facts.sample_rate, asyncio.get_running_loop(),
                      exclusive)
            self._pending += 1
            self.counts["submitted"] += 1
        with self._wake:
            self._waiting.append(job)
            self._wake.notify()
        return job

    def stats(self) -> dict:
        mean = self.batch_rows / self.steps if self.steps else 0.0
        return {"in_flight": self._pending, "active": self.active, "waiting": len(self._waiting),
                "max_batch": self.max_batch, "max_queue": self.max_queue, "slot_positions": self.slot_positions,
                "decoder_steps": self.steps, "mean_batch": round(mean, 3), **{k: self.counts[k] for k in (
                    "submitted", "started", "finished", "failed", "cancelled", "exclusive")},
                "exclusive_widest_batch": self.exclusive_widest}

    def _finish(self, job: Job, error: BaseException | None = None) -> None:
        job.error = error
        job.request.release()  # gives its slot back to the pool
        with self._lock:
            self._pending -= 1
            self.counts["cancelled" if job.cancelled.is_set() and error is None else
                        "failed" if error is not None else "finished"] += 1
        job._emit(_DONE)

    def _next(self, active: list[Job]) -> Job | None:
        """The job to admit now, in order: none while an exclusive job runs; an exclusive job only into an empty
        batch (the ones behind it wait too, so it is never overtaken for good). Waits briefly when nothing runs."""
        with self._wake:
            if not self._waiting and not active and not self._stop.is_set():
                self._wake.wait(timeout=0.1)
            if not self._waiting or any(j.exclusive for j in active):
                return None
            head = self._waiting[0]
            if head.exclusive and active and not head.cancelled.is_set():
                return None  # the batch drains first
            return self._waiting.popleft()

    def _admit(self, engine: Engine, active: list[Job]) -> None:
        """Move waiting jobs into free slots (between decoder steps)."""
        while len(active) < self.max_batch:
            job = self._next(active)
            if job is None:
                return
            if job.cancelled.is_set():
                self._finish(job)
                continue
            try:
                f = self.tts.facts
                job.audio = AudioStreamer(job.request, self.tts.codec_stream(job.stream_options), f.sample_rate,
                                          f.codebook_size)
                engine.start(job.request)  # prefill into a slot of its own
            except Exception as e:  # noqa: BLE001 - this job fails, the others go on
                log.exception("job %d failed to start", job.id)
                self._finish(job, e)
                continue
            active.append(job)
            self.counts["started"] += 1
            if job.exclusive:
                self.counts["exclusive"] += 1
                return

    def _run(self) -> None:
        tts = self.tts
        engine = Engine(tts.backend, tts.backend.pool(self.max_batch, self.slot_positions))
        active: list[Job] = []
        while not self._stop.is_set():
            self._admit(engine, active)
            for job in [j for j in active if j.cancelled.is_set()]:  # the client went away: free its slot
                active.remove(job)
                self._finish(job)
            self.active = len(active)
            if not active:
                continue
            try:
                engine.step([j.request for j in active])  # one decoder call for the whole batch
            except Exception as e:  # noqa: BLE001 - a failed step fails its batch; the server goes on
                log.exception("decoder step failed")
                for job in active:
                    self._finish(job, e)
                active.clear()
                continue
            self.steps += 1
            self.batch_rows += len(active)
            for job in active:
                job.widest = max(job.widest, len(active))
                if job.exclusive:
                    self.exclusive_widest = max(self.exclusive_widest, len(active))
            for job in list(active):
                try:
                    for chunk in job.audio.poll():
                        job._emit(chunk)
                except Exception as e:  # noqa: BLE001
                    log.log(logging.ERROR if not isinstance(e, NoAudioError) else logging.WARNING,
                            "job %d failed in the codec: %s: %s", job.id, type(e).__name__, e,
                            exc_info=not isinstance(e, NoAudioError))
                    active.remove(job)
                    self._finish(job, e)
                    continue
                if job.request.done:
                    active.remove(job)
                    self._finish(job)
            self.active = len(active)
        for job in active:
            self._finish(job, RuntimeError("the server is shutting down"))
        with self._wake:
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            self._finish(job, RuntimeError("the server is shutting down"))
