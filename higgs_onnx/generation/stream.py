"""Streaming: a request's audio handed out in chunks while the engine is still generating its rows.

After every row the request's newly completed frames go to an incremental codec decoder (a `codec` with
`push(frames) -> [samples, ...]` and `flush() -> samples`: `generation.codec_stream`), whose final samples come out as
`AudioChunk`s. The last chunk carries the request's `GenerationStats`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .contract import NoAudioError
from .delay import reverse_delay
from .engine import Engine, GenerationStats, Request


class IncrementalCodec(Protocol):
    def push(self, frames: np.ndarray) -> list[np.ndarray]: ...  # (T, N) raw codes -> final sample chunks
    def flush(self) -> np.ndarray: ...  # every remaining sample, at the end of the utterance


@dataclass(frozen=True)
class AudioChunk:
    samples: np.ndarray  # (n,) float32 mono at `sample_rate`
    sample_rate: int
    index: int  # 0, 1, ... in order
    is_last: bool
    start_s: float  # where the chunk starts in the utterance
    elapsed_s: float  # since the call that made the request (includes making the voice)
    rows_done: int  # rows generated when the chunk was handed out
    stats: GenerationStats | None = None  # on the last chunk
    rows: np.ndarray | None = None  # on the last chunk: (L, N) delayed rows as generated (like `Speech.rows`)
    codes: np.ndarray | None = None  # on the last chunk: (T, N) codes the codec decoded (like `Speech.codes`)

    @property
    def seconds(self) -> float:
        return self.samples.size / self.sample_rate


class AudioStreamer:
    """One request's audio side: after each row, `poll` pushes the newly completed frames through the request's
    incremental codec and returns the chunks that became final (the last one, once the request is done, carries
    its stats, rows and codes). The scheduler keeps one per request in a batch; `stream_request` drives one alone."""

    def __init__(self, req: Request, codec: IncrementalCodec, sample_rate: int, codebook_size: int):
        self.req, self.codec, self.sample_rate, self.codebook_size = req, codec, sample_rate, codebook_size
        self.index = 0  # chunks handed out
        self.samples = 0  # samples handed out
        self.finished = False

    def poll(self) -> list[AudioChunk]:
        """Push the request's newly completed frames (in the thread that steps it)."""
        return self.push(self.req.new_frames(), self.req.done)

    def push(self, frames: np.ndarray, final: bool, rows_done: int | None = None) -> list[AudioChunk]:
        """`frames` (k, N) completed since the last push -> the chunks that became final; `final`: the request is
        done and these were its last frames; `rows_done`: the rows generated when they were taken (the request
        may be further on by now). Called from one thread at a time (the scheduler's codec worker)."""
        if self.finished:
            return []
        req = self.req
        t0, loads = time.perf_counter(), req.loads()
        pieces = self.codec.push(frames) if len(frames) else []
        if final:
            pieces.append(self.codec.flush())
        loaded = req.loads() - loads  # this thread's sessions made meanwhile: load, not codec time
        req.load_s += loaded
        req.codec_s += time.perf_counter() - t0 - loaded
        pieces = [p for p in pieces if p.size]
        if final:
            self.finished = True
            if not self.samples and not pieces:  # the contract makes this unreachable; never a silent success
                raise NoAudioError(f"the generation ended after {req.n} rows without one audio frame")
            pieces = pieces or [np.zeros(0, np.float32)]
        rows_done = req.n if rows_done is None else rows_done
        return [self._chunk(p, final and i == len(pieces) - 1, rows_done) for i, p in enumerate(pieces)]

    def _chunk(self, samples: np.ndarray, last: bool, rows_done: int) -> AudioChunk:
        req, sr = self.req, self.sample_rate
        req.audio_out(samples.size)
        extra = {}
        if last:
            rows = req.generated.copy()
            codes = reverse_delay(rows)
            extra = {"stats": req.stats(self.samples + samples.size, sr), "rows": rows,
                     "codes": np.where(codes >= self.codebook_size, 0, codes)}
        chunk = AudioChunk(samples=samples, sample_rate=sr, index=self.index, is_last=last,
                           start_s=self.samples / sr, elapsed_s=time.perf_counter() - req.started + req.voice_s,
                           rows_done=rows_done, **extra)
        self.index += 1
        self.samples += samples.size
        return chunk


def stream_request(engine: Engine, req: Request, codec: IncrementalCodec, sample_rate: int, codebook_size: int,
                   on_row: Callable[[int], None] | None = None) -> Iterator[AudioChunk]:
    """Run `req` on `engine`, yielding its audio as it becomes final. Closing the iterator early stops the request
    and frees its cache."""
    rows = engine.rows(req)
    audio = AudioStreamer(req, codec, sample_rate, codebook_size)
    try:
        for n in rows:
            if on_row:
                on_row(n)
            yield from audio.poll()
            if req.done:
                break
    finally:
        rows.close()
        req.release()
