"""Captions of a long-form or dialogue recording: one cue per piece, timed by the samples actually written.

A piece's cue starts at its first sample in the recording (every piece and pause before it counted) and ends at
its last sample before its pause, so a cue is exactly the span of the piece's audio; the times are those sample
positions divided by the sample rate, rounded to the millisecond the formats carry. Dialogue cues name their
speaker (SubRip: `Alice: text`, WebVTT: a `<v Alice>` voice span). Control tags (`<|...|>`) are not shown.

Word-level cues (`--caption-level word`) come from a forced aligner on the written audio (`speak.word_cues`,
`align.py`); they are never guessed.
The files are written with `srt` (SubRip) and `webvtt-py` (WebVTT), atomically.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..outputs import check_output_file, write_atomic
from .split import TAG

FORMATS = (".srt", ".vtt")


@dataclass(frozen=True)
class Cue:
    start: int  # first sample
    end: int  # one past the last sample
    text: str
    speaker: str | None = None


def check_path(path: str | os.PathLike, flag: str = "--captions") -> Path:
    """A writable .srt or .vtt file name (checked before any work; nothing is created)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"{flag} {path}: captions are .srt (SubRip) or .vtt (WebVTT), got "
                         f"{path.suffix or 'no extension'!r}")
    return check_output_file(path, flag, FORMATS, "captions.srt")


def cue_of(piece) -> Cue:
    """The cue of a `render.PieceResult`."""
    text = " ".join(TAG.sub(" ", piece.text).split())
    return Cue(piece.start_sample, piece.start_sample + piece.speech_samples, text, piece.speaker)


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


__all__ = ["FORMATS", "Cue", "check_path", "cue_of", "render", "write"]
