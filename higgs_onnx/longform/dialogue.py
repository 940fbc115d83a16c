"""A dialogue script -> one recording: several speakers, each with a voice and a context of its own.

A long-form job (`render.LongForm`) whose pieces are the script's turns (a long turn split at sentence ends like a
chapter) and whose lanes are its speakers: speaker k's turns are lane k, so each turn continues that speaker's own
KV context (its voice, then its earlier turns, within the slot; when full, the lane starts again from the voice
and its last `history` turns) and the speakers render concurrently, one decoder call per step for all of them.
Turns are joined in script order with `turn_pause_s` of silence between speakers. Resume, the work folder, the
lock, retries and streaming are long-form's. A speaker whose voice is None speaks zero-shot: the model's own
voice, chosen by its first turn and kept for its later turns (cloned from that turn's own audio).
"""

from __future__ import annotations

import json
import os

from ..generation.options import GenerationOptions
from .render import LongForm, LongFormOptions, voice_digest
from .script import ScriptError, Turn, check_cast, speakers
from .split import Piece, split_text

MAX_SPEAKERS = 8  # one lane (a KV slot: ~450 MB at the real geometry with the int8 cache) each


class Dialogue(LongForm):
    """`turns` (from `script.parse_script` / `turns_from_json`) spoken by `voices` {speaker: Voice or None} into
    `out`. Everything knowable is checked first (the cast, every turn's fit), as `LongForm` does."""

    def __init__(self, tts, turns: list[Turn], out: str | os.PathLike, voices: dict[str, object],
                 options: GenerationOptions | None = None, lf: LongFormOptions | None = None, resume: bool = False,
                 stream_options=None, where: str = "the script", flag: str = "--voices-map"):
        check_cast(turns, voices, where, flag)
        self.turns, self.cast = list(turns), speakers(turns)
        if len(self.cast) > MAX_SPEAKERS:
            raise ScriptError(f"{where} has {len(self.cast)} speakers; at most {MAX_SPEAKERS} (each renders in a "
                              f"lane of its own)")
        for name in self.cast:
            if getattr(voices[name], "width", 1) > 1:
                raise ScriptError(f"{flag}: {name}'s voice is a blend of voices, which a dialogue does not support "
                                  f"(each turn continues its speaker's KV cache); save one voice per speaker")
        self.cast_voices = [voices[name] for name in self.cast]
        self._turn_of: list[int] = []  # piece -> turn
        text = json.dumps([[t.speaker, t.text] for t in self.turns], ensure_ascii=False)
        super().__init__(tts, text, out, None, options, lf, resume, stream_options, lanes=1)

    def _split(self, text: str) -> list[Piece]:
        pieces = []
        for k, turn in enumerate(self.turns):
            parts = split_text(turn.text, self.lf.target_chars, self.lf.max_chars)
            if not parts:
                raise ScriptError(f"line {turn.line}: the turn of {turn.speaker} is empty")
            parts[-1] = Piece(parts[-1].text, True)  # a turn ends a paragraph
            pieces += parts
            self._turn_of += [k] * len(parts)
        return pieces

    def _name(self, i: int) -> str:
        turn = self.turns[self._turn_of[i]]
        return f"the turn of {turn.speaker} on line {turn.line}"

    def _where(self, i: int) -> str:
        return f"piece {i + 1} of {len(self.pieces)}, {self._name(i)}"

    def _layout(self, voice, lanes, resume):
        group = [self.cast.index(self.turns[t].speaker) for t in self._turn_of]
        lanes = [[i for i, g in enumerate(group) if g == k] for k in range(len(self.cast))]
        return list(self.cast_voices), group, lanes

    def _plan_extra(self) -> dict:
        return {"speakers": self.cast, "voices": [None if v is None else voice_digest(v) for v in self.cast_voices],
                "turns": [self._turn_of[i] for i in range(len(self.pieces))]}

    def _speaker(self, i: int) -> str:
        return self.turns[self._turn_of[i]].speaker

    def _pause_s(self, i: int) -> float:
        nxt = i + 1
        if nxt < len(self.pieces) and self._turn_of[nxt] != self._turn_of[i]:
            return self.lf.turn_pause_s  # the next turn
        return super()._pause_s(i)


__all__ = ["MAX_SPEAKERS", "Dialogue"]
