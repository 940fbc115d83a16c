"""A long speech `input`, read piece by piece: one response, one voice, a cue per piece for read-along players.

Which inputs: one longer than `ONE_REQUEST_CHARS` (4096, OpenAI's limit for one request), or one that the request
contract refuses as a single request because it does not fit a batch slot (413 `context_length_exceeded` on
`input`: its speech needs more rows than fit after its prompt) and that splits into two or more pieces. Every other
input is one request, exactly as before (`plan_pieces` returns None). Bounds (`limits.py`): `MAX_INPUT_CHARS`
characters (checked by the app) and `MAX_PIECES` pieces; every piece is checked against the contract before any
work, so a piece that cannot be a request of its own is refused up front, naming it, and nothing is cut.

How: the input is split like long-form's (`longform.split.split_text`, whole sentences near 300 characters, never
across a paragraph) and the pieces are spoken in order by one `SpeechSession` (`textstream.py`): each piece
continues the KV context of the ones before it, so voice, pace and prosody carry; when the slot would not hold the
next piece the session starts again from the voice (zero-shot: from the first piece's own text and codes, made into
a voice then, as long-form does, so the recording keeps the voice that piece chose). Each piece's row budget is
long-form's (`piece_rows`: 4 rows a character + 100, capped by the request's `max_rows`), its seed `seed + index`.

The stream is piece 0's audio, its pause, piece 1's audio, ...: long-form's joins (`LongFormOptions`: 0.3 s of
silence, 0.7 s after a paragraph, an 8 ms raised-cosine fade at each piece's edges; no pause after the last).
`PieceReader` yields that stream as `AudioChunk`s, and a `captions.Cue` when a piece's first samples are handed out
(`end` None) and when its last are (`end` set): `start` is the stream position of the piece's first sample, `end`
the position just past its last, so `[start, end)` is exactly the piece's samples and the pauses lie between the
cues. `job.run.with_words` times each finished piece's words on those samples (`"caption_level": "word"`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np

from ..generation.contract import LONG_FORM_HINT, ContractError, NoAudioError
from ..generation.stream import AudioChunk
from ..longform.captions import Cue
from ..longform.joins import Edges
from ..longform.render import LongFormOptions, piece_rows
from ..longform.split import Piece, split_text
from .limits import MAX_PIECES
from .scheduler import QueueFull

log = logging.getLogger(__name__)

ONE_REQUEST_CHARS = 4096  # OpenAI's limit for one request: a longer input is always read in pieces
JOIN = LongFormOptions()  # long-form's piece sizes, row budget, pauses and fades
# A piece after the first continues a kept cache, so it needs no free slot, only a place in the queue: when other
# clients fill the queue meanwhile, it waits (polling) this long before the stream fails with the queue's error.
QUEUE_WAIT_S, QUEUE_POLL_S = 30.0, 0.1


def piece_options(options, text: str):
    """A piece's options as its `SpeechSession` submits them (the seed aside): long-form's row budget."""
    return dataclasses.replace(options, max_rows=piece_rows(text, options.max_rows, JOIN.rows_per_char))


def plan_pieces(tts, slot: int, text: str, tag: str | None, voice, options) -> list[Piece] | None:
    """The pieces `text` (a request's `input`; `tag` the speed tag put before it) is read in, or None: it is one
    request, as every input that fits one. Raises ContractError (the app's 4xx) for more than `MAX_PIECES` pieces
    or a piece that cannot be a request of its own (named, with the contract's reason)."""
    lead = tag or ""
    if len(text) <= ONE_REQUEST_CHARS and _fits_one(tts, slot, lead + text, voice, options):
        return None
    pieces = split_text(text, JOIN.target_chars, JOIN.max_chars)
    if len(text) <= ONE_REQUEST_CHARS and len(pieces) < 2:
        return None  # one piece is the one request: the contract's own refusal says why
    if len(pieces) > MAX_PIECES:
        raise ContractError(f"input is read in {len(pieces)} pieces (whole sentences, a new one at each paragraph); "
                            f"the limit is {MAX_PIECES} pieces: send fewer paragraphs or split it into several "
                            f"requests", "input", "too_many_pieces")
    for i, piece in enumerate(pieces):
        said = lead + piece.text
        try:
            tts.request(said, voice=voice, options=piece_options(options, said), slot=slot)
        except ContractError as e:
            reason = str(e).replace(f"; {LONG_FORM_HINT}", "")
            fit = e.code == "context_length_exceeded"
            hint = ("; a piece may make up to 4 rows a character + 100: use a voice with a shorter reference or "
                    "transcript" if fit else "")
            param = e.param if options.max_rows is not None or not fit else "input"
            raise ContractError(f"input is read in {len(pieces)} pieces, but piece {i + 1} ({len(piece.text)} "
                                f"characters: {piece.text[:40]!r}...) cannot be a request of its own: {reason}{hint}",
                                param, e.code, e.status if param == e.param else 413) from None
    return pieces


def _fits_one(tts, slot: int, text: str, voice, options) -> bool:
    """Whether the contract takes `text` as one request (any refusal but "its speech does not fit" counts as
    fitting: the request itself then gets that refusal, as before)."""
    try:
        tts.request(text, voice=voice, options=options, slot=slot)
    except ContractError as e:
        return not (e.code == "context_length_exceeded" and e.param == "input")
    except ValueError:  # any other bad request: the request itself is refused for it, as before
        return True
    return True


class Timeline:
    """A stream made of pieces, as its chunks are handed out: stream positions, chunk numbers, and the whole
    stream's figures (`total_stats` of every piece's) on its last chunk. Both readers of pieces (`PieceReader`,
    `dialogue_reader.DialogueReader`) make their chunks here."""

    def __init__(self, sample_rate: int):
        self.sample_rate, self.pos, self.count, self.stats = sample_rate, 0, 0, []
        self.t0 = time.perf_counter()

    def chunk(self, samples: np.ndarray, last: AudioChunk, final: bool = False) -> AudioChunk:
        sr = self.sample_rate
        out = AudioChunk(samples, sr, self.count, False, self.pos / sr, last.elapsed_s, last.rows_done)
        self.pos, self.count = self.pos + samples.size, self.count + 1
        if final:  # the whole stream's figures on its last chunk, as a single request's
            out = dataclasses.replace(out, is_last=True,
                                      stats=total_stats(self.stats, self.pos / sr, time.perf_counter() - self.t0))
        return out

    def pause(self, last: AudioChunk, seconds: float) -> AudioChunk:
        """The silence between two pieces."""
        return self.chunk(np.zeros(int(seconds * self.sample_rate), np.float32), last)


def pause_after(join: LongFormOptions, paragraph_end: bool, turn_end: bool = False) -> float:
    """The silence after a piece: a turn's end (a dialogue), a paragraph's, or a sentence's."""
    return join.turn_pause_s if turn_end else join.paragraph_pause_s if paragraph_end else join.pause_s


async def restart_when_full(session, text: str, first: AudioChunk | None, first_text: str, clone) -> bool:
    """Long-form's rule, for a zero-shot session: when its slot would not hold `text` after the context it keeps,
    it starts again from a voice made of its first piece's own codes (`first`), so the recording keeps the voice
    that piece chose. True when it did."""
    if first is None or clone is None or session.voice is not None or session.would_continue(text):
        return False
    session.release()
    session.voice = await clone(first.codes, first_text)
    return True


def no_audio(i: int, n: int, who: str = "") -> NoAudioError:
    return NoAudioError(f"piece {i + 1} of {n}{who} ended without audio")


class PieceReader:
    """A long input's pieces spoken in order by one `SpeechSession`, as one job: iterate it (async) for the
    stream's `AudioChunk`s (fades and pauses in; the last carries the stats of all pieces) and a `captions.Cue` as each
    piece starts and ends; `cancel()` stops it and gives back the kept cache. `clone(codes, text)` makes a voice from
    the first piece (zero-shot requests: the voice a restart starts from)."""

    def __init__(self, session, pieces: list[Piece], sample_rate: int, tag: str | None = None,
                 clone: Callable[[np.ndarray, str], Awaitable] | None = None, join: LongFormOptions = JOIN):
        self.session, self.pieces, self.sample_rate = session, pieces, sample_rate
        self.tag, self.clone, self.join = tag or "", clone, join
        self.cancelled = False
        self.first_job = self.piece_job = None  # piece 0's job (the id of the whole), the piece's being spoken

    @property
    def id(self):
        return self.first_job.id if self.first_job is not None else "-"

    def cancel(self) -> None:
        self.cancelled = True
        self.session.close()

    async def __aiter__(self) -> AsyncIterator[AudioChunk | Cue]:
        sr, n = self.sample_rate, len(self.pieces)
        fade = int(self.join.fade_ms * sr / 1000)
        line, first = Timeline(sr), None
        try:
            for i, piece in enumerate(self.pieces):
                said = self.tag + piece.text
                if i and await restart_when_full(self.session, said, first, self.pieces[0].text, self.clone):
                    log.info("request %s: the context is full at piece %d of %d: started again from the first "
                             "piece's voice", self.id, i + 1, n)
                edges, start, last = Edges(fade), None, None
                async for c in self._speak(said, wait=i > 0):
                    last = c
                    if (out := edges.push(c.samples)).size:
                        if start is None:
                            start = line.pos
                            yield Cue(start, None, piece.text, index=i)
                        yield line.chunk(out, c)
                if self.cancelled:
                    return
                if last is None or not last.is_last:
                    raise no_audio(i, n)
                # a continued piece's prompt holds the pieces before it, already in the cache: only its new
                # positions count, so the usage is the prompt tokens of the whole input once
                req = self.piece_job.request
                new = len(req.prompt) - req.cached if self.session.last_continued else len(req.prompt)
                line.stats.append(dataclasses.replace(last.stats, prompt_tokens=new))
                if first is None:
                    first = last
                out = edges.finish()
                if start is None:  # a piece shorter than its two fades: handed out whole at its end
                    start = line.pos
                    yield Cue(start, None, piece.text, index=i)
                yield line.chunk(out, last, final=i == n - 1)
                yield Cue(start, line.pos, piece.text, index=i)
                if i < n - 1:
                    yield line.pause(last, pause_after(self.join, piece.paragraph_end))
        finally:
            self.session.close()

    async def _speak(self, text: str, wait: bool) -> AsyncIterator[AudioChunk]:
        """One piece's chunks (`speak_waiting`); the first piece's job names the whole."""
        self.piece_job = None
        async for c in speak_waiting(self.session, text, wait):
            if self.piece_job is None:
                self.piece_job = self.session.job
                if self.first_job is None:
                    self.first_job = self.piece_job
            yield c


async def speak_waiting(session, text: str, wait: bool = True) -> AsyncIterator[AudioChunk]:
    """`session.speak(text)`'s chunks; with `wait`, a full queue is waited out (polling, for up to QUEUE_WAIT_S)
    before its QueueFull is raised."""
    deadline = time.monotonic() + QUEUE_WAIT_S
    while True:
        chunks = aiter(session.speak(text))
        try:
            c = await anext(chunks, None)
        except QueueFull:
            if not wait or time.monotonic() > deadline:
                raise
            await asyncio.sleep(QUEUE_POLL_S)
            continue
        break
    while c is not None:
        yield c
        c = await anext(chunks, None)


def total_stats(stats: list, audio_s: float, wall_s: float):
    """One `GenerationStats` for the pieces: sums of their counts (prompt tokens: each piece's new ones) and phases,
    the first piece's latencies, the whole stream's audio (pauses included) and wall time; the stop reason is "eoc"
    unless a piece stopped otherwise."""
    sums = {k: sum(getattr(s, k) for s in stats) for k in ("prompt_tokens", "rows", "frames", "voice_s",
                                                            "prefill_s", "decode_s", "codec_s", "chunks")}
    stop = next((s.stop_reason for s in stats if s.stop_reason != "eoc"), "eoc")
    return dataclasses.replace(stats[0], **sums, audio_s=audio_s, wall_s=wall_s, stop_reason=stop)
