"""Other servers' request shapes for `/v1/audio/speech`, so code written for them works by changing the base URL.

- Boson AI's hosted API (docs.boson.ai, "create speech"): `ref_audio` (base64 audio bytes or a data URI) with
  `ref_text` in the speech request itself; `voice` and `ref_audio` are exclusive; `stream: true` is raw PCM.
- sglang-omni's Higgs TTS (`sglang_omni/serve/protocol.py`, `CreateSpeechRequest`): `references: [{audio | ref_audio
  | data (+ media_type), text}]` (several, each with an optional `weight`: a blend of them, docs/voices.md),
  `speaker` for `voice`, `max_new_tokens` for `max_rows`, `stream: true` with `response_format: "pcm"`.

What this server cannot honour is a 400 naming the field, never silently dropped: a reference by URL or by a path
on the server's disk (the server fetches nothing and reads no client-named file: send the audio itself), more than
8 references (a blend takes at most 8), pre-encoded `vq_codes`, `x_vector_only_mode`, `token_count`, `duration_tokens`,
`initial_codec_chunk_frames`, `stage_params`, and a `repetition_penalty` other than 1 (the sampler has none).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from ..generation.blend import MAX_VOICES, parse_weight

MAX_REF_BYTES = 10 << 20  # Boson's limit for inline reference audio
UNSUPPORTED = {
    "x_vector_only_mode": "this model clones from the reference's codes, not a speaker vector",
    "token_count": "the length is the model's own (max_rows bounds it)",
    "duration_tokens": "the length is the model's own (max_rows bounds it)",
    "initial_codec_chunk_frames": "the stream's chunk sizes are the server's",
    "stage_params": "there are no pipeline stages to configure here",
}
_DATA_URI = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?:;[\w-]+=[^;,]*)*(?P<b64>;base64)?,", re.ASCII)


@dataclass(frozen=True)
class InlineReference:
    audio: bytes
    text: str | None
    param: str  # the field it came in, for errors
    weight: float | None = None  # its weight in a blend of several references (None: equal)


class ShapeError(ValueError):
    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


def decode_audio_field(value, param: str) -> bytes:
    """Base64 audio bytes or a data URI -> the bytes; URLs and paths are refused."""
    if not isinstance(value, str) or not value.strip():
        raise ShapeError(f"{param} must be base64 audio bytes or a data: URI", param)
    v = value.strip()
    if re.match(r"(?i)(https?|ftp|file)://", v):
        raise ShapeError(f"{param}: this server fetches no URLs; send the audio itself (base64 or a data: URI)",
                         param, "unsupported_parameter")
    if m := _DATA_URI.match(v):
        if not m["b64"]:
            raise ShapeError(f"{param}: a data: URI must be base64 (;base64,)", param)
        v = v[m.end():]
    if len(v) > MAX_REF_BYTES * 4 // 3 + 4:
        raise ShapeError(f"{param} is larger than {MAX_REF_BYTES >> 20} MB of audio", param, "too_large")
    try:
        data = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise ShapeError(f"{param} is not valid base64 (nor a data: URI); URLs and file paths are not accepted",
                         param) from None
    if not data:
        raise ShapeError(f"{param} holds no audio", param)
    return data


def normalise(body: dict) -> InlineReference | list[InlineReference] | None:
    """Rewrite Boson's and sglang-omni's fields of a speech request into this server's, in place; the inline
    reference, if any (several `references`: a list, to blend). ShapeError for a field that cannot be honoured."""
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise ShapeError(f"{name} is not supported: {why}", name, "unsupported_parameter")
        body.pop(name, None)
    penalty = body.pop("repetition_penalty", None)
    if penalty is not None and penalty != 1 and penalty != 1.0:
        raise ShapeError("repetition_penalty is not supported (the sampler has none); leave it out or send 1.0",
                         "repetition_penalty", "unsupported_parameter")
    if "speaker" in body:
        if "voice" in body:
            raise ShapeError("give voice or speaker (its other name), not both", "speaker")
        body["voice"] = body.pop("speaker")
    if "max_new_tokens" in body:
        if "max_rows" in body:
            raise ShapeError("give max_rows or max_new_tokens (its other name), not both", "max_new_tokens")
        body["max_rows"] = body.pop("max_new_tokens")
    refs = body.pop("references", None)
    ref_audio, ref_text = body.pop("ref_audio", None), body.pop("ref_text", None)
    if ref_text is not None and not isinstance(ref_text, str):
        raise ShapeError("ref_text must be text", "ref_text")
    if refs is not None:
        if ref_audio is not None:
            raise ShapeError("give references or ref_audio, not both", "references")
        if not isinstance(refs, list) or not all(isinstance(r, dict) for r in refs):
            raise ShapeError("references must be a list of objects ({audio | data, text})", "references")
        if len(refs) > MAX_VOICES:
            raise ShapeError(f"references holds {len(refs)} references; a blend takes at most {MAX_VOICES}",
                             "references", "unsupported_parameter")
        if not refs:  # never the default voice in place of the one the client meant to send
            raise ShapeError("references is empty: give at least one reference ({audio | data, text}), or leave the "
                             "field out", "references")
        made = [reference(ref, i, ref_text) for i, ref in enumerate(refs)]
        return made[0] if len(made) == 1 else made
    if ref_audio is None:
        if ref_text is not None:
            raise ShapeError("ref_text (the reference's transcript) needs ref_audio", "ref_text")
        return None
    if body.get("voice") not in (None, "default"):
        raise ShapeError("voice and ref_audio are exclusive: a request clones from ref_audio or speaks in a saved "
                         "voice", "voice")
    return InlineReference(decode_audio_field(ref_audio, "ref_audio"), ref_text, "ref_audio")


def reference(ref: dict, i: int, ref_text: str | None) -> InlineReference:
    """One entry of sglang-omni's `references`, checked."""
    where = f"references[{i}]"
    if ref.get("vq_codes") is not None:
        raise ShapeError(f"{where}.vq_codes is not supported: send the reference audio", "references",
                         "unsupported_parameter")
    if ref.get("audio_path") is not None:
        raise ShapeError(f"{where}.audio_path names a file on the server, which it does not read: send "
                         "the audio itself (audio or data)", "references", "unsupported_parameter")
    sources = [k for k in ("data", "audio", "ref_audio") if ref.get(k) is not None]
    if len(sources) != 1:
        raise ShapeError(f"{where} needs exactly one of data, audio or ref_audio (base64 audio)", "references")
    text = ref.get("text", ref_text)
    if text is not None and not isinstance(text, str):
        raise ShapeError(f"{where}.text must be text", "references")
    weight = ref.get("weight")
    if weight is not None:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ShapeError(f"{where}.weight must be a number, got {weight!r}", "references")
        try:
            weight = parse_weight(weight, where, "references")
        except ValueError as e:
            raise ShapeError(str(e), "references") from None
    return InlineReference(decode_audio_field(ref[sources[0]], "references"), text, "references", weight)
