"""Dialogue scripts: who says what, in order (stdlib only).

Two formats, told apart by the first non-blank character (`{` is JSONL):

    plain   Alice: Hello there.               a line `Name: text` starts a turn of speaker Name
            It is good to see you.            lines without a name continue the turn (multi-line turns)
                                              a blank line inside a turn is a paragraph break (a longer pause)
            [Bob laughs]                      square-bracketed stage directions are skipped, whole lines or inline
            Bob: <|emotion:elation|>Me too!   inline control tags work per turn
            # a comment                       lines starting with '#' are skipped
    jsonl   {"speaker": "Alice", "text": "Hello there."}   one turn per line (blank lines skipped)

A name is 1-40 characters: letters, digits, spaces, `_ - . '`, starting with a letter or digit, followed by a
colon and a space (so `10:30` or a URL never starts a turn). Every fault is one `ScriptError` naming the line:
text before the first speaker, an empty turn, a malformed JSONL line, a name that is not a name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

SPEAKER_LINE = re.compile(r"^\s*(?P<name>[^\W_][\w .'\-]{0,39}?)\s*:(?:\s+(?P<text>.*))?$")
STAGE = re.compile(r"\[[^\[\]\n]*\]")  # [laughs], [music fades]: skipped
NAME = re.compile(r"[^\W_][\w .'\-]{0,39}")
MAX_TURNS = 10_000


class ScriptError(ValueError):
    """A dialogue script that cannot be spoken; the message names the line."""


@dataclass(frozen=True)
class Turn:
    speaker: str
    text: str  # paragraphs separated by a blank line, stage directions removed
    line: int  # 1-based line of the script where the turn starts


def parse_script(text: str, where: str = "the script") -> list[Turn]:
    """The turns of a script (plain or JSONL, see the module docstring), in order."""
    if not isinstance(text, str):
        raise ScriptError(f"{where} must be text, got {type(text).__name__}")
    text = text.lstrip("\ufeff")
    first = text.lstrip()[:1]
    turns = _jsonl(text, where) if first == "{" else _plain(text, where)
    if not turns:
        raise ScriptError(f"{where} has no turns: write one `Name: text` line per turn (or JSONL {{\"speaker\": "
                          f"..., \"text\": ...}})")
    if len(turns) > MAX_TURNS:
        raise ScriptError(f"{where} has {len(turns)} turns; at most {MAX_TURNS}: split it into episodes")
    return turns


def turns_from_json(items, where: str = "turns") -> list[Turn]:
    """Turns given as a list of {"speaker", "text"} objects (the server's request); same checks as a script."""
    if not isinstance(items, list) or not items:
        raise ScriptError(f"{where} must be a non-empty list of {{\"speaker\": ..., \"text\": ...}} objects")
    if len(items) > MAX_TURNS:
        raise ScriptError(f"{where} has {len(items)} turns; at most {MAX_TURNS}")
    return [_turn_of(item, f"{where}[{i}]", i) for i, item in enumerate(items)]


def _turn_of(item, where: str, line: int) -> Turn:
    if not isinstance(item, dict):
        raise ScriptError(f"{where} must be an object with \"speaker\" and \"text\", got {type(item).__name__}")
    extra = sorted(set(item) - {"speaker", "text"})
    if extra:
        raise ScriptError(f"{where} has unknown field{'s' if len(extra) > 1 else ''} {', '.join(extra)}: a turn is "
                          f"{{\"speaker\": ..., \"text\": ...}}")
    speaker, text = item.get("speaker"), item.get("text")
    if not isinstance(speaker, str) or not NAME.fullmatch(speaker.strip()):
        raise ScriptError(f"{where}: \"speaker\" must be a name of 1-40 letters, digits, spaces or _-.' (got "
                          f"{speaker!r})")
    if not isinstance(text, str):
        raise ScriptError(f"{where}: \"text\" must be a string, got {type(text).__name__}")
    spoken = _clean(text)
    if not spoken:
        raise ScriptError(f"{where}: the turn of {speaker.strip()} is empty" +
                          (" (only stage directions)" if text.strip() else ""))
    return Turn(speaker.strip(), spoken, line)


def _jsonl(text: str, where: str) -> list[Turn]:
    turns = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError as e:
            raise ScriptError(f"{where}, line {n}: malformed JSON ({e.msg}); each line is {{\"speaker\": ..., "
                              f"\"text\": ...}}") from None
        turns.append(_turn_of(item, f"{where}, line {n}", n))
    return turns


def _plain(text: str, where: str) -> list[Turn]:
    turns: list[Turn] = []
    speaker, start, lines = None, 0, []

    def close() -> None:
        if speaker is None:
            return
        body = _clean("\n".join(lines))
        if not body:
            raw = "\n".join(lines).strip()
            raise ScriptError(f"{where}, line {start}: the turn of {speaker} is empty" +
                              (" (only stage directions)" if raw else ""))
        turns.append(Turn(speaker, body, start))

    for n, raw in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), 1):
        stripped = raw.strip()
        if stripped.startswith("#"):
            continue
        m = SPEAKER_LINE.match(raw) if not stripped.startswith(("[", "<|")) else None
        if m:
            close()
            speaker, start, lines = m.group("name").strip(), n, [m.group("text") or ""]
            continue
        if speaker is None:
            if stripped and _clean(stripped):
                raise ScriptError(f"{where}, line {n}: text before the first speaker ({stripped[:40]!r}): start each "
                                  f"turn with `Name: `")
            continue
        lines.append(raw)
    close()
    return turns


def _clean(text: str) -> str:
    """A turn's text: stage directions removed, paragraphs kept (blank lines), other whitespace collapsed."""
    text = re.sub(r"[^\S\n]*\x00[^\S\n]*(?=[,.;:!?…])", "", STAGE.sub("\x00", text.replace("\x00", "")))
    paragraphs = re.split(r"\n[^\S\n]*\n", text.replace("\x00", " "))
    kept = [" ".join(p.split()) for p in paragraphs]
    return "\n\n".join(p for p in kept if p)


def speakers(turns: list[Turn]) -> list[str]:
    """The speakers in order of their first turn."""
    return list(dict.fromkeys(t.speaker for t in turns))


def parse_voice_map(spec: str, flag: str = "--voices-map") -> dict[str, str]:
    """`alice=voices/alice.npz,bob=default` -> {"alice": "voices/alice.npz", "bob": "default"}."""
    if not isinstance(spec, str) or not spec.strip():
        raise ScriptError(f"{flag} is empty: give NAME=VOICE pairs, e.g. alice=voices/alice.npz,bob=default")
    out: dict[str, str] = {}
    for part in spec.split(","):
        name, eq, voice = part.partition("=")
        name, voice = name.strip(), voice.strip()
        if not eq or not name or not voice:
            raise ScriptError(f"{flag}: {part.strip()!r} is not NAME=VOICE (e.g. alice=voices/alice.npz or "
                              f"bob=default)")
        if not NAME.fullmatch(name):
            raise ScriptError(f"{flag}: {name!r} is not a speaker name (1-40 letters, digits, spaces or _-.')")
        if name in out:
            raise ScriptError(f"{flag}: {name} is given twice")
        out[name] = voice
    return out


def check_cast(turns: list[Turn], voices: dict[str, object], where: str = "the script",
               flag: str = "--voices-map", single: str = "--text-file with --out (long-form)") -> None:
    """Every speaker of the script has a voice, and there are at least two speakers. `flag` "voices": the server's
    request (turns are numbered from 0 there, `turns[i]`)."""
    cast = speakers(turns)
    for t in turns:
        if t.speaker not in voices:
            known = ", ".join(voices) or "none"
            at, add = (f"{where}[{t.line}]", f'"{t.speaker}": VOICE to voices') if flag == "voices" else \
                (f"{where}, line {t.line}", f"{t.speaker}=VOICE")
            raise ScriptError(f"{at}: speaker {t.speaker!r} has no voice in {flag} (it has {known}); add {add} (a "
                              f"saved voice, or default for the model's own)")
    if len(cast) < 2:
        raise ScriptError(f"{where} has one speaker ({cast[0]}): a dialogue needs two or more; for one voice use "
                          f"{single}")
