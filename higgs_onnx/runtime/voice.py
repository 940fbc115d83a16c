"""`Voice`: a reference voice ready to reuse (its delayed code rows and the decoder's KV state after its prompt
prefix), its file format (an .npz without pickle: `Voice.save` / `Voice.load`), and `prefill_voice`, which makes
one from reference rows on a backend.

A voice belongs to the export that made it (`model_id`: the hashes of the parts its state depends on); loading it
for another export is refused. The bounded in-memory cache of voices is `runtime.voice_cache.VoiceCache`.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..generation.contract import ContractError, min_rows
from ..generation.engine import prompt_embeddings
from ..generation.prompt import build_prefix
from ..outputs import atomic

VOICE_FILE = "a voice file is the .npz written by inference.py --save-voice (or HiggsTTS.make_voice(...).save(path))"
# what np.load / reading an archive member raises on a file that is not an intact .npz
_NPZ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


LANGUAGE = re.compile(r"([A-Za-z]{2,3})(?:-([A-Za-z]{2}|[0-9]{3}))?")  # en, yue, en-US, es-419
MAX_LANGUAGES = 16


class VoiceError(ValueError):
    """A voice name or file that cannot be used; the message is meant for the client."""


def check_languages(value, what: str = "languages") -> tuple[str, ...]:
    """The language codes a voice is offered for, from a comma-separated string or a list of strings: each a 2-3
    letter language with an optional region (`en`, `de`, `en-US`, `pt_BR`: `_` becomes `-`; written `pt-BR`), at
    most MAX_LANGUAGES, none twice; () for none given. VoiceError (one sentence naming the bad one) otherwise."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
        raise VoiceError(f"{what} must be language codes separated by commas, e.g. en,de")
    out: list[str] = []
    for raw in (x.strip() for x in value):
        if not raw:
            continue
        m = LANGUAGE.fullmatch(raw.replace("_", "-"))
        if m is None:
            raise VoiceError(f"{what}: {raw[:40]!r} is not a language code: use a 2-3 letter language with an "
                             f"optional region, e.g. en, de, zh, en-US or pt_BR")
        code = m[1].lower() + (f"-{m[2].upper()}" if m[2] else "")
        if code in out:
            raise VoiceError(f"{what}: {code!r} is given twice")
        out.append(code)
    if len(out) > MAX_LANGUAGES:
        raise VoiceError(f"{what}: {len(out)} language codes given, at most {MAX_LANGUAGES} are allowed")
    return tuple(out)


class VoiceFileError(ValueError):
    """A file given as a voice that `Voice.save` did not write (or that was damaged since)."""


def _open_npz(path: Path):
    """The .npz archive at `path` (lazy: members are read when asked for); VoiceFileError when it is not one."""
    try:
        npz = np.load(path, allow_pickle=False)
    except _NPZ_ERRORS:
        raise VoiceFileError("not an .npz archive") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise VoiceFileError("a single .npy array, not an .npz archive")
    return npz


def read_voice(path: Path) -> dict:
    """The fields of a `Voice` from an .npz written by `Voice.save`, checked; VoiceFileError says what is wrong."""
    npz = _open_npz(path)
    with npz:
        missing = [k for k in ("rows", "prefix", "meta") if k not in npz.files]
        if not any(k.startswith("kv:") for k in npz.files):
            missing.append("kv:* (the prefill state)")
        if missing:
            raise VoiceFileError(f"missing {', '.join(missing)}")
        try:
            a = {k: npz[k] for k in npz.files}
        except _NPZ_ERRORS:
            raise VoiceFileError("a damaged or non-numeric array inside") from None
    meta = _check_meta(a["meta"])
    ref_text, model_id = meta["ref_text"], meta["model_id"]
    rows, prefix, state = a["rows"], a["prefix"], {k[3:]: v for k, v in a.items() if k.startswith("kv:")}
    if rows.ndim != 2 or rows.dtype.kind not in "iu":
        raise VoiceFileError(f"rows must be integer codes (R, N), got {rows.dtype} {rows.shape}")
    if prefix.ndim != 1 or prefix.dtype.kind not in "iu":
        raise VoiceFileError(f"prefix must be integer token ids (P,), got {prefix.dtype} {prefix.shape}")
    for name, kv in state.items():  # (1, kv_heads, P, head_dim): the cache after the P prefix positions
        if not (kv.dtype.kind == "f" or kv.dtype == np.int8) or kv.ndim != 4 or kv.shape[2] != len(prefix):
            raise VoiceFileError(f"kv:{name} must be a float or int8 (1, H, {len(prefix)}, D) cache, got {kv.dtype} "
                                 f"{kv.shape}")
    return {"rows": rows.astype(np.int64), "ref_text": ref_text, "prefix": prefix.astype(np.int64).tolist(),
            "state": state, "model_id": model_id}


def _check_meta(array: np.ndarray) -> dict:
    """The JSON `meta` of a voice file: ref_text, model_id and, in files that have it, `languages` (a list of
    language codes, checked where they are used: `check_languages`); VoiceFileError otherwise."""
    try:
        meta = json.loads(str(array))
        ref_text, model_id, languages = meta["ref_text"], meta["model_id"], meta.get("languages")
        if not isinstance(model_id, str) or not isinstance(ref_text, (str, type(None))) or not (
                languages is None or isinstance(languages, list) and all(isinstance(x, str) for x in languages)):
            raise TypeError(meta)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise VoiceFileError("meta is not the JSON Voice.save writes") from None
    return meta


def read_voice_meta(path: Path) -> dict:
    """The `meta` of a voice file alone ({ref_text, model_id, languages?}): np.load of an .npz is lazy, so only
    that small member is read (a voice's KV state is tens of MB); VoiceFileError when it is not a voice file."""
    npz = _open_npz(path)
    with npz:
        if "meta" not in npz.files:
            raise VoiceFileError("missing meta")
        try:
            array = npz["meta"]
        except _NPZ_ERRORS:
            raise VoiceFileError("a damaged or non-numeric array inside") from None
    return _check_meta(array)


@dataclass
class Voice:
    """A reference voice, ready to reuse: its delayed code rows and the decoder state after its prompt prefix."""

    rows: np.ndarray  # (R, N) delayed reference rows
    ref_text: str | None
    prefix: list[int]  # prompt ids before <|text|>
    state: dict[str, np.ndarray]  # KV cache of the prefix, per past input name
    model_id: str  # the export it belongs to

    def save(self, path: str | os.PathLike, languages=None) -> Path:
        """An .npz (no pickle) with the rows, the prefix ids, the KV state and the owning export's id; `languages`
        (codes checked by the caller: `check_languages`) go in its meta, the languages the voice is
        offered for (None: the server's)."""
        path = Path(path)
        fields = {"ref_text": self.ref_text, "model_id": self.model_id}
        if languages:
            fields["languages"] = list(languages)
        meta = json.dumps(fields)
        with atomic(path, ".npz") as tmp:
            np.savez(tmp, rows=self.rows, prefix=np.asarray(self.prefix, np.int64), meta=np.asarray(meta),
                     **{f"kv:{n}": a for n, a in self.state.items()})
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model_id: str) -> Voice:
        """A voice saved by `save`; anything else is refused with what makes a voice file."""
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"voice file {path} is a folder; {VOICE_FILE}")
        if not path.is_file():
            raise FileNotFoundError(f"voice file {path} does not exist")
        try:
            voice = cls(**read_voice(path))
        except VoiceFileError as e:
            raise VoiceFileError(f"{path} is not a voice file ({e}); {VOICE_FILE}") from None
        if voice.model_id != model_id:
            raise ValueError(f"{path} was made with another export; make it again with --save-voice")
        return voice


def prefill_voice(backend, tokenizer, tokens, facts, rows: np.ndarray, ref_text: str | None, model_id: str) -> Voice:
    """A `Voice` from delayed reference `rows` (and their transcript): its prompt prefix prefilled once on `backend`
    (an `OnnxBackend`: `new_cache`, `prefill`, `snapshot`). A prefix that leaves no room for one frame in the
    model's context is a ContractError."""
    prefix = build_prefix(tokenizer, tokens, len(rows), ref_text)
    room = facts.max_positions - len(prefix)
    if room < min_rows(facts.num_codebooks) + 3:  # + <|text|>, one token, <|audio|>
        raise ContractError(f"the voice's prompt is {len(prefix)} positions ({len(rows)} reference rows and "
                            f"its transcript), but the model's context holds {facts.max_positions}: "
                            f"use a shorter reference clip or transcript", "ref_text" if ref_text else "file",
                            "context_length_exceeded")
    embeds = prompt_embeddings(backend, prefix, facts.placeholder, rows)
    cache = backend.new_cache(len(prefix))
    backend.prefill(cache, embeds)
    return Voice(rows=rows, ref_text=ref_text, prefix=prefix, state=backend.snapshot(cache), model_id=model_id)
