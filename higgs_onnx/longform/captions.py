"""Captions of a long-form or dialogue recording: one cue per piece, timed by the samples actually written.

A piece's cue starts at its first sample in the recording (every piece and pause before it counted) and ends at
its last sample before its pause, so a cue is exactly the span of the piece's audio; the times are those sample
positions divided by the sample rate, rounded to the millisecond the formats carry. Dialogue cues name their
speaker (SubRip: `Alice: text`, WebVTT: a `<v Alice>` voice span). Control tags (`<|...|>`) are not shown.

Word-level cues (`--caption-level word`, and `"caption_level": "word"` on the server's SSE piece events) come from a
forced aligner on each piece's own samples (`timed`, `align.py`); they are never guessed.
The one `Cue` is also the server's piece cue (`serve/pieces.py`: `end` None while the piece is being made).
The files are written with `srt` (SubRip) and `webvtt-py` (WebVTT), atomically.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..outputs import check_output_file, write_atomic
from .split import TAG

FORMATS = (".srt", ".vtt")


PIECE_EVENT, PIECE_START_EVENT = "audio.speech.piece", "audio.speech.piece.start"


@dataclass(frozen=True)
class Cue:
    """Samples `[start, end)` of a stream or recording and what is said there: a piece, or one word of it.
    `index`: the piece's number; `words`: its word cues (stream positions) once timed, `words_reason` why they could
    not be (`timed`); both None when no word timing was asked."""

    start: int  # first sample
    end: int | None  # one past the last sample (None: the piece is still being made)
    text: str
    speaker: str | None = None
    index: int = 0
    words: tuple[Cue, ...] | None = None
    words_reason: str | None = None

    def span(self, sample_rate: int) -> dict:
        """Its times in seconds (rounded to the microsecond) and in samples."""
        sr = sample_rate
        return {"start_s": round(self.start / sr, 6), "end_s": None if self.end is None else round(self.end / sr, 6),
                "start_sample": self.start, "end_sample": self.end}

    def as_dict(self, sample_rate: int) -> dict:
        out = {"index": self.index, "text": self.text, **self.span(sample_rate),
               **({"speaker": self.speaker} if self.speaker is not None else {})}
        if self.words is not None:
            out["words"] = [{"text": w.text, **w.span(sample_rate)} for w in self.words]
            if self.words_reason:
                out["words_reason"] = self.words_reason
        return out

    def event(self, request_id: str, sample_rate: int) -> dict:
        """The SSE event: `audio.speech.piece.start` when the piece starts, `audio.speech.piece` once it is whole."""
        kind = PIECE_START_EVENT if self.end is None else PIECE_EVENT
        return {"type": kind, "object": kind, "id": request_id, **self.as_dict(sample_rate)}


def timed(cue: Cue, samples, sample_rate: int, language: str = "en") -> Cue:
    """`cue` with its words forced-aligned on `samples` (its own, `cue.start` onwards) in `language` (a piece mostly
    in Han characters counts as zh): `words` the word cues at stream positions; `words` () and `words_reason` one
    line when the aligner cannot time it (not English, no alignment)."""
    from ..align import AlignUnavailable, word_cues
    from ..text.normalize import language_of

    text = shown(cue.text)
    try:
        said = "zh" if language_of(text) == "zh" else language
        words = word_cues(samples, sample_rate, text, said)
    except AlignUnavailable as e:
        return dataclasses.replace(cue, words=(), words_reason=str(e))
    return dataclasses.replace(cue, words=tuple(Cue(cue.start + a, cue.start + max(b, a + 1), w, cue.speaker)
                                                for a, b, w in words), words_reason=None)


def check_path(path: str | os.PathLike, flag: str = "--captions") -> Path:
    """A writable .srt or .vtt file name (checked before any work; nothing is created)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"{flag} {path}: captions are .srt (SubRip) or .vtt (WebVTT), got "
                         f"{path.suffix or 'no extension'!r}")
    return check_output_file(path, flag, FORMATS, "captions.srt")


def shown(text: str) -> str:
    """A piece's text as a cue shows it: control tags out, spaces collapsed."""
    return " ".join(TAG.sub(" ", text).split())


def cue_of(piece) -> Cue:
    """The cue of a `render.PieceResult`."""
    return Cue(piece.start_sample, piece.start_sample + piece.speech_samples, shown(piece.text), piece.speaker,
               piece.index)


def _delta(samples: int, sample_rate: int) -> datetime.timedelta:
    return datetime.timedelta(milliseconds=round(samples * 1000 / sample_rate))


def _vtt_time(samples: int, sample_rate: int) -> str:
    ms = round(samples * 1000 / sample_rate)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}.{ms:03d}"


def render(cues: list[Cue], sample_rate: int, fmt: str) -> str:
    """The captions file's text (`fmt` ".srt" or ".vtt")."""
    shown = [c for c in cues if c.text]
    if fmt == ".srt":
        import srt

        subs = [srt.Subtitle(k, _delta(c.start, sample_rate), _delta(c.end, sample_rate),
                             f"{c.speaker}: {c.text}" if c.speaker else c.text) for k, c in enumerate(shown, 1)]
        return srt.compose(subs, reindex=False)
    if fmt == ".vtt":
        import webvtt

        vtt = webvtt.WebVTT()
        for c in shown:
            text = re.sub(r"[<>&]", lambda m: {"<": "&lt;", ">": "&gt;", "&": "&amp;"}[m.group()], c.text)
            voice = re.sub(r"[<>&\s]+", " ", c.speaker).strip() if c.speaker else None
            vtt.captions.append(webvtt.Caption(_vtt_time(c.start, sample_rate), _vtt_time(c.end, sample_rate),
                                               f"<v {voice}>{text}</v>" if voice else text))
        return vtt.content
    raise ValueError(f"captions are .srt or .vtt, got {fmt!r}")


def write(path: str | os.PathLike, cues: list[Cue], sample_rate: int) -> Path:
    """Write the captions to `path` (its extension says the format) through a temporary file and a rename."""
    path = Path(path)
    text = render(cues, sample_rate, path.suffix.lower())
    write_atomic(path, text)
    return path


__all__ = ["FORMATS", "PIECE_EVENT", "PIECE_START_EVENT", "Cue", "check_path", "cue_of", "render", "timed", "write"]
