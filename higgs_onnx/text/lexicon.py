"""A pronunciation lexicon: words respelled the way the model should say them ("Nguyen" -> "Win").

Rules:
- whole words only: "Ann" respells "Ann" and "Ann's", never "Anna" or "Hanna";
- case: an entry written in lower case matches any case ("nguyen" matches "Nguyen" and "NGUYEN"), and a match that
  starts with a capital gets a capital respelling; an entry with a capital letter matches that case only (so "US"
  does not touch "us");
- the longest entry wins where entries overlap ("New York City" before "New York");
- never inside the model's control tags (`<|emotion:elation|>`).

A lexicon comes from a file (`--lexicon FILE`: lines `word<TAB>respelling` or `word = respelling`, `#` comments;
or a JSON object) or from a request's `lexicon` object; a request's entries are laid over the server's.
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from ..tags import CONTROL_TAG, between_tags

MAX_ENTRIES = 10_000
MAX_WORD = 100
MAX_RESPELLING = 200
# a file of MAX_ENTRIES entries of the longest word and respelling, with separators, fits in 4 MiB
MAX_FILE_BYTES = 4 * 2**20


class LexiconError(ValueError):
    """A lexicon that cannot be used: one line naming the entry (or the file's line)."""


class Lexicon:
    """Checked entries and the one pattern that finds them."""

    def __init__(self, entries: Mapping[str, str]):
        self.entries = check_entries(entries)
        self.exact = {k: v for k, v in self.entries.items() if k != k.lower()}
        self.folded = {k: v for k, v in self.entries.items() if k == k.lower()}
        keys = sorted(self.entries, key=len, reverse=True)
        self.pattern = re.compile(r"(?<!\w)(?:" + "|".join(re.escape(k) for k in keys) + r")(?!\w)",
                                  re.IGNORECASE) if keys else None

    def __len__(self) -> int:
        return len(self.entries)

    def over(self, entries: Mapping[str, str] | None) -> Lexicon:
        """This lexicon with `entries` laid over it (theirs win)."""
        return self if not entries else Lexicon({**self.entries, **entries})

    def apply(self, text: str) -> str:
        return text if self.pattern is None else between_tags(text, self._words)

    def _words(self, text: str) -> str:
        def swap(m: re.Match) -> str:
            word = m.group()
            if word in self.exact:
                return self.exact[word]
            said = self.folded.get(word.lower())
            if said is None:
                return word
            return said[:1].upper() + said[1:] if word[:1].isupper() and said[:1].islower() else said

        return self.pattern.sub(swap, text)


def check_entries(entries, label: str = "lexicon") -> dict[str, str]:
    if not isinstance(entries, Mapping):
        raise LexiconError(f"{label} must be an object of word -> respelling, got {type(entries).__name__}")
    if len(entries) > MAX_ENTRIES:
        raise LexiconError(f"{label} has {len(entries)} entries; the limit is {MAX_ENTRIES}")
    out = {}
    for word, said in entries.items():
        if not isinstance(word, str) or not isinstance(said, str):
            raise LexiconError(f"{label}: every word and respelling must be a string, got {word!r}: {said!r}")
        word, said = word.strip(), " ".join(said.split())
        if not word or not said:
            raise LexiconError(f"{label}: an empty word or respelling ({word!r}: {said!r})")
        if len(word) > MAX_WORD or len(said) > MAX_RESPELLING:
            raise LexiconError(f"{label}: {word[:40]!r} is too long (a word at most {MAX_WORD} characters, a "
                               f"respelling at most {MAX_RESPELLING})")
        if CONTROL_TAG.search(word) or "<|" in said or "|>" in said:
            raise LexiconError(f"{label}: {word!r} -> {said!r}: a lexicon respells words; control tags go in the text")
        if not re.match(r"\w", word) or not re.search(r"\w$", word):
            raise LexiconError(f"{label}: {word!r} must start and end with a letter or digit (entries are whole words)")
        out[word] = said
    return out


def read_file(path: Path, label: str) -> str:
    """The file's text, checked before it is opened: a regular file (not a device such as /dev/zero, a FIFO that
    would block, a folder) of at most `MAX_FILE_BYTES`, and UTF-8; read with that bound, so a file that grows while
    it is read is refused too."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise LexiconError(f"{label} {path}: no such file") from None
    except OSError as e:
        raise LexiconError(f"{label} {path}: cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise LexiconError(f"{label} {path}: is a folder, not a lexicon file")
    if not stat.S_ISREG(st.st_mode):
        raise LexiconError(f"{label} {path}: not a regular file (a device, a FIFO or a socket); give a text file")
    if st.st_size > MAX_FILE_BYTES:
        raise LexiconError(f"{label} {path}: {st.st_size:,} bytes; a lexicon file holds at most {MAX_FILE_BYTES:,} "
                           f"({MAX_ENTRIES:,} entries)")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise LexiconError(f"{label} {path}: cannot be read ({e.strerror})") from None
    if len(data) > MAX_FILE_BYTES:
        raise LexiconError(f"{label} {path}: grew past {MAX_FILE_BYTES:,} bytes while it was read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise LexiconError(f"{label} {path}: not UTF-8 text") from None


def load(path: str | Path, label: str = "--lexicon") -> Lexicon:
    """A lexicon file: JSON (an object), or lines `word<TAB>respelling` / `word = respelling` with `#` comments."""
    path = Path(path)
    text = read_file(path, label)
    if path.suffix.lower() == ".json":
        try:
            return Lexicon(check_entries(json.loads(text), f"{label} {path}"))
        except json.JSONDecodeError as e:
            raise LexiconError(f"{label} {path}: not JSON ({e.msg} at line {e.lineno})") from None
    entries = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, sep, said = line.partition("\t") if "\t" in line else line.partition("=")
        if not sep:
            raise LexiconError(f"{label} {path}:{n}: write 'word<TAB>respelling' or 'word = respelling', "
                               f"got {line[:60]!r}")
        entries[word.strip()] = said.strip()
    return Lexicon(check_entries(entries, f"{label} {path}"))
