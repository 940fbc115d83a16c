"""One voice speaking segments of text in order, each continuing the KV context of the one before.

Used by the WebSocket text-in stream (`/v1/audio/speech/stream`) and by Wyoming's streaming synthesis. Segment i + 1
is submitted with `continues=` segment i's job (kept by the scheduler), so its prompt is the earlier segments' text
and rows, and only its own text is prefilled: voice, pace and prosody carry across segments, as in long-form. When
the context (the pool's slot) would not hold the next segment and its row budget, the session starts again from
the voice alone. Each segment's row budget is `len(text) * ROWS_PER_CHAR + 100` (long-form's), capped by the
request's `max_rows`; its seed is the session's seed + its index.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from ..generation.contract import ContractError
from ..generation.options import GenerationOptions
from ..generation.stream import AudioChunk
from ..longform.render import LongFormOptions, piece_rows

ROWS_PER_CHAR = LongFormOptions().rows_per_char


class SpeechSession:
    def __init__(self, scheduler, voice=None, options: GenerationOptions | None = None, stream_options=None,
                 continuation: bool = True, prefix: str = "", read=None):
        """`prefix`: text every segment starts with (the job's lead: instructions' and speed tags); `read`: the
        job's text steps (`SpeechOptions.read`) as text -> text, run on each segment (None: as written)."""
        self.scheduler, self.voice, self.stream_options = scheduler, voice, stream_options
        self.prefix, self.read = prefix, read
        self.options = options or GenerationOptions()
        self.continuation = continuation
        self.index = 0
        self.continued = 0  # segments that continued the one before
        self.prev = None  # the last segment's job, its cache kept for the next
        self.history: list = []  # (text, rows) of the segments in the current context
        self.job = None  # the segment being spoken
        self.last_continued = False  # the last segment continued the one before
        self.read_text: str | None = None  # the last segment as the model read it (after the text steps)

    def _options(self, text: str) -> GenerationOptions:
        return dataclasses.replace(self.options, seed=self.options.seed + self.index,
                                   max_rows=piece_rows(text, self.options.max_rows, ROWS_PER_CHAR))

    def would_continue(self, text: str) -> bool:
        """Whether `text`, submitted next, would continue the kept context (False: it would start again from the
        voice). A dry run of the contract's check: nothing is submitted."""
        if self.prev is None:
            return False
        turns = [*self.history, (self.prev.request.text, self.prev.request.generated)]
        try:
            self.scheduler.tts.request(text, voice=self.voice, options=self._options(text), history=turns,
                                       slot=self.scheduler.slot_positions, continues=self.prev.request)
        except ContractError as e:
            if e.code != "context_length_exceeded":
                raise
            return False
        return True

    def submit(self, text: str):
        """Submit the next segment (the one before must have ended); returns its job. Raises the scheduler's and
        the contract's errors (a segment that cannot fit even alone)."""
        options, job = self._options(text), None
        self.last_continued = False
        if self.prev is not None:
            turns = [*self.history, (self.prev.request.text, self.prev.request.generated)]
            try:
                job = self.scheduler.submit(text, voice=self.voice, options=options, keep=True, history=turns,
                                            continues=self.prev, stream_options=self.stream_options)
                self.history, self.continued, self.last_continued = turns, self.continued + 1, True
            except ContractError as e:
                if e.code != "context_length_exceeded":
                    raise
            if job is None:  # the context is full: start again from the voice
                self.release()
        if job is None:
            self.history = []
            job = self.scheduler.submit(text, voice=self.voice, options=options, keep=self.continuation,
                                        stream_options=self.stream_options)
        self.prev = None  # a continued cache was handed over: it is the new job's now
        self.job, self.index = job, self.index + 1
        return job

    async def speak(self, text: str) -> AsyncIterator[AudioChunk]:
        """The segment's chunks as they are made; afterwards its cache waits for the next segment."""
        if self.read:  # the text steps, off the event loop (a segment may be up to the session's text bound)
            text = await asyncio.to_thread(self.read, text)
        self.read_text = text
        job = self.submit(self.prefix + text)
        try:
            async for chunk in job:
                yield chunk
        except BaseException:  # the reader stopped (cancelled, gone, stalled): nothing of this segment is kept
            self.job = None
            drop(job)
            raise
        self.job = None
        if self.continuation and job.outcome == "finished":
            self.prev = job

    def release(self) -> None:
        """Give back the kept cache (the session is over, or starts again)."""
        if self.prev is not None and self.prev.handle is not None:
            self.prev.handle.release()
        self.prev = None

    def close(self) -> None:
        if self.job is not None:  # a segment whose reader stopped: its job may have finished and kept its cache
            drop(self.job)
            self.job = None
        self.release()


def drop(job) -> None:
    """Cancel `job`, and give back the cache it keeps if it finished meanwhile (`keep=True`)."""
    job.cancel()
    if job.handle is not None:
        job.handle.release()
