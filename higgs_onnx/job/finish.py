"""A job's finish, written once for every door: word timing (`time_words`, `with_words`) and loudness.

Word timing runs the forced aligner (`captions.timed`) in one bounded, lower-priority thread pool off the event
loop, with one failure rule: an aligner that raises is logged once and the cue comes back with no words and a
`words_reason` that says so (`words=()`); only a cancellation propagates. The audio is never held back by it.

`job` stands one floor above `runtime`: `runtime` imports nothing from here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..longform.captions import Cue, timed

log = logging.getLogger(__name__)

ALIGNER_THREADS = 1  # word timing (0.5-1.3 s of CPU a piece) for every stream of the server, one at a time
ALIGNER_NICE = 10  # below the decoder's threads: word timing can slow its own stream's words, not the others' audio
_aligner: ThreadPoolExecutor | None = None
_aligning = 0  # pieces submitted to the aligner and not yet timed (event loop only)


def _lower_priority() -> None:
    """The aligner thread at a lower scheduling priority (Linux sets a nice value per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ALIGNER_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: it runs at the process's priority
        log.debug("the aligner thread keeps the process's priority")


async def aligned(cue: Cue, samples: np.ndarray, sample_rate: int, language: str) -> Cue:
    """`captions.timed` in one aligner pool (bounded, lower priority), not the default executor that the text steps
    and voice uploads share: 8 word-timed streams queue their pieces here instead of taking every core from the
    decoder. Raises what the aligner raises: callers use `time_words`, which has the failure rule."""
    global _aligner, _aligning
    if _aligner is None:
        _aligner = ThreadPoolExecutor(ALIGNER_THREADS, thread_name_prefix="higgs-align", initializer=_lower_priority)
    _aligning += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(_aligner, timed, cue, samples, sample_rate, language)
    finally:
        _aligning -= 1


async def time_words(cue: Cue, samples: np.ndarray, sample_rate: int, language: str) -> Cue:
    """`cue` with its words timed on `samples` (its own, from `cue.start`) in the aligner pool. The one failure
    rule: an aligner exception is logged once and the cue comes back with `words` () and `words_reason` "word
    timing failed (<exception type>)"; only a cancellation propagates."""
    try:
        return await aligned(cue, samples, sample_rate, language)
    except Exception as e:  # noqa: BLE001 - the words say so; the audio went on without them
        return untimed(cue, e)


def untimed(cue: Cue, e: Exception) -> Cue:
    """The failure rule's cue (and its one log line)."""
    log.error("word timing of piece %d failed", cue.index, exc_info=e)
    return dataclasses.replace(cue, words=(), words_reason=f"word timing failed ({type(e).__name__})")


async def with_words(first, items: AsyncIterator, text: str, sample_rate: int, language: str = "en"):
    """(first, rest) of a stream of `AudioChunk`s and piece `Cue`s (`first` the stream's first item, `items` the
    rest), with each finished piece's words timed on its own samples (`time_words`). A stream with no piece cues (one
    request) is one piece of `text`: its cue comes before its first chunk and after its last, as a long input's do."""

    async def stream():
        held, single = [], not isinstance(first, Cue)
        if single:
            yield Cue(0, None, text)
        item = first
        while item is not None:
            if isinstance(item, Cue):
                if item.end is None:
                    held = []
                else:
                    item = await time_words(item, joined(held), sample_rate, language)
            else:
                held.append(item.samples)
            yield item
            item = await anext(items, None)
        if single:
            samples = joined(held)
            yield await time_words(Cue(0, samples.size, text), samples, sample_rate, language)

    out = stream()
    return await anext(out), out


def aligner_pending() -> int:
    """Pieces waiting for, or in, the aligner thread (the metrics' aligner queue)."""
    return _aligning


def joined(samples: list) -> np.ndarray:
    """Chunks' samples as one array (an empty float32 one for none)."""
    return np.concatenate(samples) if samples else np.zeros(0, np.float32)
