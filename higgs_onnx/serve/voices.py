"""The server's voice store: one `<name>.npz` (written by `Voice.save`) per voice in a folder, loaded on first use.

Names are `[A-Za-z0-9_-]{1,64}`, so a name is always a plain file name inside the folder (no `/`, `..` or dots);
"default" is reserved for zero-shot speech. Names are unique ignoring case (`Bob` cannot join `bob`: on a
case-insensitive file system they are one file, and to a listener one voice). A voice is the export's own prefill
state, so a file made with another export is refused (with that reason) when it is used; it is still listed, so it
can be deleted. Loaded voices stay in a small LRU cache keyed by the file's mtime: a voice replaced on disk is read
again. A voice may be saved with the languages it is offered for (`check_languages`, in its file's meta; read
alone, without loading the voice, for the listing and Wyoming's describe); one without them is offered for the
server's.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

from ..runtime.model import Voice, VoiceFileError
from ..runtime.voice import VoiceError, check_languages, read_voice_meta

__all__ = ["DEFAULT", "UnknownVoice", "VoiceError", "VoiceExists", "VoiceStore", "check_languages", "check_name"]

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEFAULT = "default"
CACHE_SIZE = 16  # a 4b-model voice holds the KV cache of its prompt prefix: tens of MB each


class UnknownVoice(VoiceError):
    pass


class VoiceExists(VoiceError):
    pass


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise VoiceError(f"voice name {name!r} is not allowed: use 1-64 letters, digits, '_' or '-'")
    if name.lower() == DEFAULT:
        raise VoiceError(f"voice name {name!r} is reserved for zero-shot speech (no reference)")
    return name


class VoiceStore:
    """Voices of one export in `folder`. Thread-safe: the server loads and saves voices in worker threads."""

    def __init__(self, folder: str | os.PathLike, model_id: str, cache_size: int = CACHE_SIZE):
        self.folder, self.model_id, self.cache_size = Path(folder), model_id, cache_size
        self.folder.mkdir(parents=True, exist_ok=True)
        self._cache: OrderedDict[str, tuple[int, Voice]] = OrderedDict()
        self._languages: dict[str, tuple[int, tuple[str, ...]]] = {}  # name -> (mtime_ns, its own languages)
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        return self.folder / f"{check_name(name)}.npz"

    def names(self) -> list[str]:
        """Saved voices, sorted (leftover `Voice.save` temp files and foreign files are not voices)."""
        return sorted(p.stem for p in self.folder.glob("*.npz") if NAME.fullmatch(p.stem) and p.stem != DEFAULT)

    def describe(self, name: str) -> dict:
        """The listing entry, from the file alone (listing does not load voices: a 4b voice is tens of MB)."""
        st = self.path(name).stat()
        entry = {"id": name, "object": "voice", "created": int(st.st_mtime), "bytes": st.st_size}
        if languages := self.languages(name, st.st_mtime_ns):
            entry["languages"] = list(languages)
        return entry

    def languages(self, name: str, mtime_ns: int | None = None) -> tuple[str, ...]:
        """The languages the voice's file says it is offered for (only its small meta is read, once per version of
        the file); () when it names none (a file saved before voices had languages, a damaged one): the server's.
        FileNotFoundError when the voice is gone."""
        path = self.path(name)
        mtime = path.stat().st_mtime_ns if mtime_ns is None else mtime_ns
        hit = self._languages.get(name)
        if hit is not None and hit[0] == mtime:
            return hit[1]
        try:
            found = check_languages(read_voice_meta(path).get("languages") or ())
        except (VoiceFileError, VoiceError):
            found = ()
        with self._lock:
            self._languages[name] = (mtime, found)
        return found

    def get(self, name: str) -> Voice:
        """The voice saved as `name` (cached); UnknownVoice lists what exists, VoiceError says why one is unusable."""
        path = self.path(name)
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            raise UnknownVoice(self.unknown_message(name)) from None
        with self._lock:
            hit = self._cache.get(name)
            if hit is not None and hit[0] == mtime:
                self._cache.move_to_end(name)
                return hit[1]
        try:
            voice = Voice.load(path, self.model_id)
        except FileNotFoundError:
            raise UnknownVoice(self.unknown_message(name)) from None
        except VoiceFileError:
            raise VoiceError(f"voice {name!r} is damaged (not a voice file); delete it and upload it again") from None
        except ValueError:
            raise VoiceError(f"voice {name!r} was made with another export of the model; delete it and upload "
                             f"the reference again") from None
        self._remember(name, mtime, voice)
        return voice

    def find(self, name: str) -> str | None:
        """The saved voice whose name equals `name` ignoring case, if any."""
        check_name(name)
        return next((n for n in self.names() if n.lower() == name.lower()), None)

    @staticmethod
    def exists_message(name: str, taken: str) -> str:
        same = f"voice {name!r} exists" if name == taken else \
            f"voice {taken!r} exists (voice names are unique ignoring case)"
        return f"{same}; delete it first (DELETE /v1/voices/{taken})"

    def add(self, name: str, voice: Voice, languages=()) -> dict:
        """Save a new voice, offered for `languages` (`check_languages`; none: the server's); VoiceExists if the name
        is taken, ignoring case (delete it first)."""
        path = self.path(name)
        languages = check_languages(languages)
        with self._lock:
            if (taken := self.find(name)) is not None:
                raise VoiceExists(self.exists_message(name, taken))
            voice.save(path, languages)
        self._remember(name, path.stat().st_mtime_ns, voice)
        return {**self.describe(name), "ref_text": voice.ref_text, "reference_rows": int(len(voice.rows))}

    def delete(self, name: str):
        """Remove the voice's file; the loaded voice it had in this store's cache (None if none), for the caller to
        drop from the model's voice cache too."""
        path = self.path(name)
        with self._lock:
            hit = self._cache.pop(name, None)
            self._languages.pop(name, None)
            try:
                path.unlink()
            except FileNotFoundError:
                raise UnknownVoice(self.unknown_message(name)) from None
        return None if hit is None else hit[1]

    def unknown_message(self, name: str) -> str:
        names = [DEFAULT, *self.names()]
        return f"unknown voice {name!r}; available: {', '.join(names)} (upload one with POST /v1/voices)"

    def _remember(self, name: str, mtime: int, voice: Voice) -> None:
        with self._lock:
            self._cache[name] = (mtime, voice)
            self._cache.move_to_end(name)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

