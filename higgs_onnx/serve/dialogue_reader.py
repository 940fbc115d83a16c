"""`POST /v1/audio/dialogue`: a script of turns spoken by several voices, as one response.

    {"model": "higgs-tts-3-4b", "turns": [{"speaker": "Alice", "text": "Hi!"}, {"speaker": "Bob", "text": "Hey."}],
     "voices": {"Alice": "alice", "Bob": "default"}, "response_format": "wav"}

Each speaker is one `SpeechSession` (`textstream.py`) on the server's scheduler, so a speaker's turns continue its
own KV context (voice, then its earlier turns, until the slot is full; then it starts again from the voice) and
the speakers' sessions run at once, batched with every other request. A long turn is split at sentence ends like
a long input (`longform.split`). The response is the turns in script order: each piece faded at its edges (8 ms),
0.3 s of silence between the pieces of a turn, `turn_pause_s` (0.4 s) between turns. A piece is handed out whole
once it is made (a later speaker's piece may be made first and waits its turn). The SSE stream carries a cue per
piece, as a long input's does (`captions.Cue`), with its speaker. A zero-shot speaker ("default") keeps the voice its
first piece chose: a restart of its context is cloned from that piece.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np

from ..generation.contract import LONG_FORM_HINT, ContractError
from ..generation.stream import AudioChunk
from ..job.finish import joined
from ..longform.captions import Cue
from ..longform.joins import fade_edges
from ..longform.script import Turn
from ..longform.split import split_text
from .pieces import JOIN, Timeline, no_audio, pause_after, piece_options, restart_when_full, speak_waiting

SPEAKER_SEED_STEP = 7919  # speaker k's pieces are seeded seed + k * this + their index in its session


@dataclasses.dataclass(frozen=True)
class Line:
    """One piece of the dialogue: its speaker, its text, whether the turn ends with it."""

    speaker: str
    text: str
    turn_end: bool
    paragraph_end: bool


def plan_lines(turns: list[Turn]) -> list[Line]:
    lines = []
    for t in turns:
        parts = split_text(t.text, JOIN.target_chars, JOIN.max_chars)
        for k, p in enumerate(parts):
            lines.append(Line(t.speaker, p.text, k == len(parts) - 1, p.paragraph_end))
    return lines


def check_lines(tts, slot: int, lines: list[Line], voices: dict, options, where: str = "turns") -> None:
    """Every piece can be a request of its own with its speaker's voice (before any work); ContractError names it."""
    for i, line in enumerate(lines):
        try:
            tts.request(line.text, voice=voices[line.speaker], options=piece_options(options, line.text), slot=slot)
        except ContractError as e:
            reason = str(e).replace(f"; {LONG_FORM_HINT}", "")
            raise ContractError(f"{where}: piece {i + 1} ({line.speaker}: {line.text[:40]!r}...) cannot be a request "
                                f"of its own: {reason}", where, e.code, e.status) from None


class DialogueReader:
    """The dialogue as one job: iterate it (async) for `AudioChunk`s in script order (the last one carries the
    figures of every piece) and a `captions.Cue` as each piece starts and ends; `cancel()` stops every speaker."""

    def __init__(self, sessions: dict, lines: list[Line], sample_rate: int,
                 clone: Callable[[np.ndarray, str], Awaitable] | None = None):
        self.sessions, self.lines, self.sample_rate, self.clone = sessions, lines, sample_rate, clone
        self.cancelled = False
        self.first_job = None
        self._tasks: list[asyncio.Task] = []

    @property
    def id(self):
        return self.first_job.id if self.first_job is not None else "-"

    def cancel(self) -> None:
        self.cancelled = True
        for t in self._tasks:
            t.cancel()
        for s in self.sessions.values():
            s.close()

    async def _speaker(self, name: str, futures: dict[int, asyncio.Future]) -> None:
        """Speak `name`'s pieces in order, each piece's audio and last chunk into its future."""
        session, first = self.sessions[name], None
        mine = [i for i, line in enumerate(self.lines) if line.speaker == name]
        try:
            for n, i in enumerate(mine):
                text = self.lines[i].text
                if n:  # the slot is full: start again from the speaker's first piece's voice
                    await restart_when_full(session, text, first, self.lines[mine[0]].text, self.clone)
                audio, last = [], None
                async for c in self._speak(session, text):
                    audio.append(c.samples)
                    last = c
                if last is None or not last.is_last:
                    raise no_audio(i, len(self.lines), f" ({name})")
                first = first or last
                futures[i].set_result((joined(audio), last))
        except BaseException as e:
            for i in mine:
                if not futures[i].done():
                    futures[i].set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
            if not isinstance(e, Exception):
                raise
        finally:
            session.close()

    async def _speak(self, session, text: str) -> AsyncIterator[AudioChunk]:
        """One piece's chunks (`pieces.speak_waiting`: a full queue, other speakers' or clients', is waited out)."""
        async for c in speak_waiting(session, text):
            if self.first_job is None:
                self.first_job = session.job
            yield c

    async def __aiter__(self) -> AsyncIterator[AudioChunk | Cue]:
        sr, n = self.sample_rate, len(self.lines)
        fade = int(JOIN.fade_ms * sr / 1000)
        loop = asyncio.get_running_loop()
        futures = {i: loop.create_future() for i in range(n)}
        self._tasks = [asyncio.ensure_future(self._speaker(name, futures)) for name in self.sessions]
        timeline = Timeline(sr)
        try:
            for i, line in enumerate(self.lines):
                audio, last = await futures[i]
                timeline.stats.append(last.stats)
                wav = fade_edges(np.array(audio, np.float32), fade)
                start = timeline.pos
                yield Cue(start, None, line.text, line.speaker, i)
                final = i == n - 1
                yield timeline.chunk(wav, last, final)
                yield Cue(start, timeline.pos, line.text, line.speaker, i)
                if not final:
                    yield timeline.pause(last, pause_after(JOIN, line.paragraph_end, line.turn_end))
        finally:
            for t in self._tasks:
                t.cancel()
            for s in self.sessions.values():
                s.close()
            for f in futures.values():  # a speaker that failed after the stream stopped: nobody reads its error
                if f.done() and not f.cancelled():
                    f.exception()


def speaker_options(options, k: int):
    return dataclasses.replace(options, seed=options.seed + k * SPEAKER_SEED_STEP)


__all__ = ["DialogueReader", "Line", "check_lines", "plan_lines", "speaker_options"]
