"""Streaming: a request's audio handed out in chunks while the engine is still generating its rows.

After every row the request's newly completed frames go to an incremental codec decoder (a `codec` with
`push(frames) -> [samples, ...]` and `flush() -> samples`: `runtime.stream`), whose final samples come out as
`AudioChunk`s. The last chunk carries the request's `GenerationStats`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

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


def stream_request(engine: Engine, req: Request, codec: IncrementalCodec, sample_rate: int, codebook_size: int,
                   on_row: Callable[[int], None] | None = None) -> Iterator[AudioChunk]:
    """Run `req` on `engine`, yielding its audio as it becomes final. Closing the iterator early stops the request
    and frees its cache."""
    rows = engine.rows(req)
    done = 0  # samples handed out

    def chunk(samples: np.ndarray, index: int, last: bool) -> AudioChunk:
        nonlocal done
        req.audio_out(samples.size)
        out = AudioChunk(samples=samples, sample_rate=sample_rate, index=index, is_last=last,
                         start_s=done / sample_rate, elapsed_s=time.perf_counter() - req.started + req.voice_s,
                         rows_done=req.n, **(final(done + samples.size) if last else {}))
        done += samples.size
        return out

    def final(samples: int) -> dict:
        rows = req.generated.copy()
        codes = reverse_delay(rows)
        return {"stats": req.stats(samples, sample_rate), "rows": rows,
                "codes": np.where(codes >= codebook_size, 0, codes)}

    def decode(push: bool) -> list[np.ndarray]:
        t0 = time.perf_counter()
        frames = req.new_frames()
        out = codec.push(frames) if len(frames) else []
        if not push:
            out.append(codec.flush())
        req.codec_s += time.perf_counter() - t0
        return [c for c in out if c.size] or ([] if push else [np.zeros(0, np.float32)])

    index = 0
    try:
        for n in rows:
            if on_row:
                on_row(n)
            if req.done:
                break
            for samples in decode(push=True):
                yield chunk(samples, index, False)
                index += 1
        tail = decode(push=False)
        for i, samples in enumerate(tail):
            yield chunk(samples, index, i == len(tail) - 1)
            index += 1
    finally:
        rows.close()
        req.release()
