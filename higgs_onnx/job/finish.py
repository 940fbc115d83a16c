"""A job's finish, written once for every door: loudness (`level`; a take's chunks `leveled`, a recording
`level_file`), then word timing (`time_words`; a stream of pieces `with_words`, a recording's cues `file_words`).

Word timing runs the forced aligner (`captions.timed`) in one lower-priority process (`job.aligner`) off the event
loop, with one failure rule: an aligner that raises is logged once and the cue comes back with no words and a
`words_reason` that says so (`words=()`); only a cancellation propagates. The audio is never held back by it.

`job` stands one floor above `runtime`: `runtime` imports nothing from here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..longform.captions import Cue
from ..loudness import Loudness, normalise
from .aligner import Aligner, AlignerEnded, failed_cue, timed_apart

log = logging.getLogger(__name__)

ALIGNER_NICE = 10  # below the decoder's threads: word timing can slow its own stream's words, not the others' audio
ALIGNER = Aligner(ALIGNER_NICE)  # the server's one aligner process (job.aligner), started at its first piece
_queue: ThreadPoolExecutor | None = None  # the one thread that waits on it: pieces queue here, cancellable
_aligning = 0  # pieces submitted to the aligner and not yet timed (event loop only)


def close_aligner() -> None:
    """End the aligner process (the server's end); pieces still queued are dropped."""
    global _queue
    if _queue is not None:
        _queue.shutdown(wait=False, cancel_futures=True)
        _queue = None
    ALIGNER.close()


async def time_words(cue: Cue, samples: np.ndarray, sample_rate: int, language: str) -> Cue:
    """`cue` with its words timed on `samples` (its own, from `cue.start`) in `language` (`timed_piece`), in the
    server's one aligner process (`job.aligner`: one piece at a time, lower priority, the GIL its own), never on
    the event loop nor in the default executor that the text steps and voice uploads share: 8 word-timed streams
    queue their pieces here instead of taking every core from the decoder. An aligner failure, its process's death
    included, comes back as a cue without words (the one failure rule, logged once; a new process takes the next
    piece); only a cancellation propagates."""
    global _queue, _aligning
    if _queue is None:
        _queue = ThreadPoolExecutor(1, thread_name_prefix="higgs-align")
    _aligning += 1
    try:
        try:
            got, failure = await asyncio.get_running_loop().run_in_executor(_queue, ALIGNER.time, cue, samples,
                                                                            sample_rate, language)
        except AlignerEnded as e:
            got, failure = failed_cue(cue, e), str(e)
        return _logged(got, failure)
    finally:
        _aligning -= 1


def timed_piece(cue: Cue, samples: np.ndarray, sample_rate: int, language: str) -> Cue:
    """`captions.timed` with the one failure rule (`aligner.timed_apart`), in this process: an aligner exception is
    logged once (with its traceback) and the cue comes back with `words` () and `words_reason` "word timing failed
    (<exception type>)"."""
    return _logged(*timed_apart(cue, samples, sample_rate, language))


def _logged(cue: Cue, failure: str | None) -> Cue:
    """`cue`, its failure (a traceback, or why the aligner process ended) logged once."""
    if failure:
        log.error("word timing of piece %d failed: %s", cue.index, failure)
    return cue


def file_words(path, cues: list[Cue], language: str) -> tuple[list[Cue], int, str]:
    """The piece cues of the recording at `path` made a cue per word, each piece timed on its own samples
    (`timed_piece`); a piece that cannot be timed keeps its cue. (cues, pieces kept whole, the first one's reason)."""
    from ..audio import read_audio

    samples, rate = read_audio(path)
    samples = samples[:, 0]  # the recording is mono
    out, kept, why = [], 0, ""
    for cue in cues:
        got = timed_piece(cue, samples[cue.start:cue.end], rate, language)
        if got.words:
            out += got.words
        else:
            out.append(cue)
            kept, why = kept + 1, why or got.words_reason
    return out, kept, why


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


# -- loudness -----------------------------------------------------------------------------------------------------
def level(wav: np.ndarray, sample_rate: int, lufs: float | None) -> tuple[np.ndarray, Loudness | None]:
    """`wav` brought to `lufs` (EBU R128, one gain, the peak held under -1 dBFS) and what was done; `wav` itself and
    None without a target. Every door's loudness is this call: the sync driver's take, the async driver's chunks
    (`leveled`), a written recording (`level_file`) and a corpus row."""
    if lufs is None:
        return wav, None
    return normalise(wav, sample_rate, lufs)


def leveled(done: list, sample_rate: int, lufs: float | None) -> tuple[list, Loudness | None]:
    """A whole take's chunks brought to `lufs` together (one gain; a long input's piece cues stay where they are),
    and the record; unchanged without a target or audio."""
    audio = [c for c in done if not isinstance(c, Cue)]
    if lufs is None or not audio:
        return done, None
    wav, lv = level(np.concatenate([c.samples for c in audio]), sample_rate, lufs)
    ends = np.cumsum([c.samples.size for c in audio])
    made = iter([dataclasses.replace(c, samples=wav[e - c.samples.size:e])
                 for c, e in zip(audio, ends, strict=True)])
    return [c if isinstance(c, Cue) else next(made) for c in done], lv


def level_file(path, lufs: float | None) -> Loudness | None:
    """A written recording brought to `lufs` in place (one gain: its pieces keep their balance), atomically (a
    temporary file renamed over it); None without a target."""
    if lufs is None:
        return None
    import soundfile as sf

    from ..audio import write_audio

    wav, sr = sf.read(path, dtype="float32")
    wav, lv = level(wav, sr, lufs)
    write_audio(path, wav, sr)
    return lv


def aligner_pending() -> int:
    """Pieces waiting for, or in, the aligner process (the metrics' aligner queue)."""
    return _aligning


def joined(samples: list) -> np.ndarray:
    """Chunks' samples as one array (an empty float32 one for none)."""
    return np.concatenate(samples) if samples else np.zeros(0, np.float32)
