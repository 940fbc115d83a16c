"""What every HTTP route of the speech server shares: OpenAI's error body (`ApiError`), the request bodies
(`SpeechRequest`, `DialogueRequest`), reading JSON and multipart bodies within their limits, uploaded audio, the
streaming `JobResponse` (its job cancelled however it ends, one log line for a client that leaves) and the Host
guard."""

from __future__ import annotations

import base64
import contextvars
import io
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from ..audio import AudioError, check_format, check_recording
from ..job.options import SAMPLING, TEXT
from .limits import (
    COUNTERS,
    DRAIN_LIMIT,
    MAX_JSON_BYTES,
    MAX_UPLOAD_BYTES,
    BodyTimeout,
    ClientGone,
    error_type,
)

log = logging.getLogger(__name__)

ALIASES = ("higgs-tts-3", "higgs-audio-v3-tts")  # Boson's hosted API names
OPENAI_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")  # so a stock OpenAI client config works unchanged
# OpenAI's built-in voice names (clients default to "alloy"): each is the server's default voice (--default-voice)
# unless a saved voice has that name
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")
# what an uploaded reference must be (checked from the header, before decoding, where the header says it)
STATIC = Path(__file__).resolve().parent / "static"
PAGE_CSP = ("default-src 'self'; media-src 'self' blob:; img-src 'self' data:; object-src 'none'; "
            "frame-ancestors 'none'; base-uri 'none'")


class ApiError(Exception):
    """An error for the client; becomes OpenAI's error body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type(status), "param": param, "code": code}},
                        status, headers=headers)


class VoiceRef(BaseModel):
    """OpenAI's custom-voice object, `{"id": "name"}`."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr


class OutputFields(BaseModel):
    """What the speech and the dialogue bodies share: the model, the audio's format and the sampling fields."""

    model: StrictStr
    response_format: StrictStr = "mp3"
    stream_format: StrictStr = "audio"
    # the job's fields are typed by job.options (one sentence for a wrong type at every door): Any here
    temperature: Any = None
    top_k: Any = None
    top_p: Any = None
    seed: Any = None
    max_rows: Any = None


class SpeechRequest(OutputFields):
    """The JSON body of `/v1/audio/speech`. Fields OpenAI defines plus our extras; others are ignored. Types are
    strict: `"5"` or `true` is not an integer, `"0.8"` not a number (a float field takes an integer)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    input: StrictStr
    # a saved voice's name, OpenAI's {"id": name}, or a blend: "alice:0.7,bob:0.3" or [{"voice", "weight"}, ...]
    voice: StrictStr | VoiceRef | list[Any] | None = None
    blend_mode: Any = None  # how a blend mixes its voices: "mixture" (default) or "product"
    instructions: Any = None
    speed: Any = None
    # run alone (a batch of one): the audio equals the same request made alone, to the bit (see `Scheduler`)
    deterministic: Any = None
    # the guard's retries (docs/guard.md): the response waits for a good take (at most this many redraws, each with
    # a new seed and a cooler temperature) and is then sent whole; 0 (the default): audio streams as it is made
    retries: Any = None
    # best of n takes (docs/guard.md): n draws of the request batched with everything else, each judged, the best
    # sent whole (1, the default: one take, streamed)
    takes: Any = None
    # EBU R128 integrated loudness in LUFS (docs/audio.md): the take is measured whole, brought to it and then sent
    # whole (None, the default: as generated, streamed)
    loudness: Any = None
    # Boson's and sglang-omni's raw PCM stream (needs response_format "pcm"; every format streams without it)
    stream: StrictBool = False
    # what the model would read and its prompt, as JSON; the request is checked as for real, nothing is generated
    dry_run: Any = None
    # the text steps (docs/text.md), checked by job.options (one bound and message for every door): None = the
    # server's default (serve --normalize ...), which is off
    normalize: Any = None
    ssml: Any = None  # the input is an SSML document (a subset: docs/text.md)
    markdown: Any = None
    emoji: Any = None
    stage_directions: Any = None
    lexicon: Any = None
    # "word": each piece event of the SSE stream carries its words, timed by a forced aligner (docs/captions.md)
    caption_level: Any = None
    caption_language: Any = None  # the language of those words (the aligner times English; job.options)


class DialogueRequest(OutputFields):
    """The JSON body of `/v1/audio/dialogue` (docs/dialogue.md); unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    turns: list[Any]
    voices: dict[StrictStr, StrictStr]  # speaker -> a saved voice's name, or "default" (zero-shot)


# the body's fields that are `job.options.OPTIONS` (references: `shapes.normalise`)
JOB_FIELDS = ("voice", "blend_mode", *SAMPLING, "speed", "takes", "retries", "loudness", "deterministic",
              "dry_run", *TEXT, "caption_level", "caption_language")
# what a session.config may hold beyond WS_ONLY: the speech fields (refused by name where the WebSocket cannot
# honour them), the reference shapes and the output format
WS_FIELDS = {"model", *JOB_FIELDS, "response_format", "stream_format", "stream", "ref_audio", "ref_text", "references",
             "speaker", "max_new_tokens"}
WS_ONLY = ("type", "session", "split_granularity", "stream_audio", "input", "continuation")  # not speech fields


def validation_message(e: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """The first problem of a pydantic error as one line, and the field it is about."""
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    if param is None:
        return err.get("msg", "invalid body"), None
    if err.get("type") == "missing":
        return f"{param} is required", param
    return f"{param}: {err.get('msg', 'invalid value')}", param


def media_type(value: str) -> tuple[str, dict[str, str]]:
    """A Content-Type header -> (type/subtype in lower case, parameters); ("", {}) when there is none or it is not
    of the form type/subtype."""
    from email.message import Message

    if not value.strip():
        return "", {}
    m = Message()
    m["content-type"] = value
    if "/" not in value.split(";", 1)[0]:
        return "", {}
    params = {k.lower(): v for k, v in (m.get_params() or [])[1:]}
    return m.get_content_type(), params


def is_json_type(value: str) -> bool:
    """application/json or a `+json` type (application/vnd.api+json ...), in UTF-8 (JSON's only encoding)."""
    kind, params = media_type(value)
    main, _, sub = kind.partition("/")
    charset = params.get("charset", "utf-8").lower()
    return main == "application" and (sub == "json" or sub.endswith("+json")) and charset in ("utf-8", "utf8")


async def limited(stream: AsyncIterator[bytes], limit: int, what: str) -> AsyncIterator[bytes]:
    """`stream`, refused with 413 past `limit` bytes; the rest is read and dropped (up to DRAIN_LIMIT) first, so a
    client still sending its body reads the 413 instead of a reset connection."""
    total = 0
    async for chunk in stream:
        total += len(chunk)
        if total > limit:
            try:
                async for more in stream:
                    total += len(more)
                    if total > DRAIN_LIMIT:
                        break
            except (BodyTimeout, ClientGone, ClientDisconnect):
                pass  # the answer is the 413 all the same
            COUNTERS["too_large"] += 1
            raise ApiError(413, f"{what} is larger than the limit of {limit // (1 << 20)} MB", code="too_large",
                           headers={"Connection": "close"})
        yield chunk


def bad_audio(message: str) -> ApiError:
    return ApiError(400, message, param="file", code="invalid_audio")


def read_upload_audio(data: bytes) -> tuple[Any, int]:
    """Uploaded bytes -> (samples, channels) float32 and the rate; 400 if libsndfile cannot read them, or the clip
    is not a plausible recording (`audio.check_format` from the header, before decoding: a small file can claim
    hours; then `audio.check_recording` on the samples)."""
    import soundfile as sf

    if not data:
        raise bad_audio("the uploaded audio file is empty")
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            rate, channels, frames = f.samplerate, f.channels, f.frames
            try:  # from the header, before decoding
                check_format(rate, channels, frames)
            except AudioError as e:
                raise bad_audio(str(e)) from None
            wav = f.read(dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:  # ApiError passes: not one of these
        reason = str(e).split(": ", 1)[-1].rstrip(". ") or type(e).__name__
        raise bad_audio(f"cannot read the uploaded audio ({reason}); send a WAV, FLAC, OGG or MP3 file") from None
    try:  # the same rules as every other job's references (`audio.check_recording`)
        check_recording(wav, rate)
    except AudioError as e:
        raise bad_audio(str(e)) from None
    return wav, rate


FORM_NUMBERS = {"temperature": float, "top_p": float, "speed": float, "loudness": float, "repetition_penalty": float,
                "top_k": int, "seed": int, "max_rows": int, "max_new_tokens": int, "retries": int, "takes": int}
FORM_FLAGS = ("stream", "deterministic")


def form_value(key: str, value: str):
    """A multipart text field as the JSON value it stands for (forms carry only text)."""
    if key in FORM_NUMBERS:
        try:
            return FORM_NUMBERS[key](value)
        except ValueError:
            raise ApiError(400, f"{key} must be a number, got {value!r}", key, "invalid_value") from None
    if key in FORM_FLAGS:
        if value.lower() not in ("true", "false"):
            raise ApiError(400, f"{key} must be true or false, got {value!r}", key, "invalid_value")
        return value.lower() == "true"
    return value


def client_of(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "a client"


GONE = object()  # the client left before the first audio (`opening`)


class StreamCut(Exception):
    """The job failed after audio went out in an audio format: the connection is cut (a client must not take the
    truncated audio for the whole), and the failure was logged once."""


CUT = contextvars.ContextVar("higgs_stream_cut", default=False)  # this request's cut was logged already


class LoggedCut(logging.Filter):
    """Drops uvicorn's own line for a response the app cut on purpose (`StreamCut`): one line per request."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (CUT.get() and record.getMessage().startswith("ASGI callable returned without completing"))


class JobResponse(StreamingResponse):
    """A streaming response that cancels its job however the response ends (done, client gone, server stopping),
    with one log line, never a traceback, for a client that left mid-audio or a stream cut by a failure."""

    def __init__(self, job, content: AsyncIterator[bytes], **kw):
        super().__init__(self._tracked(content), **kw)
        self.job, self.complete = job, False

    async def _tracked(self, content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for data in content:
            yield data
        self.complete = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
            if not self.complete:  # the disconnect ended the body (Starlette cancels it, no error)
                log.info("request %s: the client left mid-audio; its job is cancelled", self.job.id)
        except (ClientDisconnect, OSError) as e:
            log.info("request %s: the client left mid-audio (%s); its job is cancelled", self.job.id,
                     type(e).__name__)
        except StreamCut:
            CUT.set(True)  # uvicorn closes the connection: the client sees the body end early
        finally:
            self.job.cancel()


class HostGuard:
    """Pure ASGI (streaming and disconnects pass through untouched): refuse requests whose Host header is not one
    of this server's names, so a page on a DNS-rebound name cannot reach a loopback server."""

    def __init__(self, app, names: list[str]):
        self.app, self.names = app, {n.lower() for n in names}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
            name = host if host.endswith("]") else host.rsplit(":", 1)[0]
            if name not in self.names and scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": "Host is not this server's name"})
                return
            if name not in self.names:
                await error_response(400, f"Host {host!r} is not this server's name; use one of "
                                     f"{', '.join(sorted(self.names))}", None, "invalid_host")(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_json(request: Request) -> dict:
    ctype = request.headers.get("content-type", "")
    if not is_json_type(ctype):
        raise ApiError(415, f"send the body as JSON with Content-Type: application/json (got {ctype or 'none'})",
                       code="invalid_content_type")
    body = b"".join([c async for c in limited(request.stream(), MAX_JSON_BYTES, "the JSON body")])
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:  # [[[[... : Python's parser recurses per level
        raise ApiError(400, "the body is not a usable JSON object: it is nested too deeply",
                       code="invalid_json") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits (Python's conversion limit)
        raise ApiError(400, f"the body is not usable JSON ({e})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


async def read_form(request: Request) -> dict:
    """A multipart speech request (Boson's form: the reference as a file) as the JSON body it stands for: text
    fields typed (numbers, booleans), the file `ref_audio` as base64."""
    stream = limited(request.stream(), MAX_UPLOAD_BYTES, "the upload")
    try:
        form = await MultiPartParser(request.headers, stream, max_files=1, max_fields=32).parse()
    except MultiPartException as e:
        raise ApiError(400, f"malformed multipart body: {e.message}", code="invalid_multipart") from None
    body: dict = {}
    try:
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key != "ref_audio":
                    raise ApiError(400, f"the file field {key!r} is not one this request takes; send the "
                                   "reference as ref_audio", key, "invalid_value")
                body[key] = base64.b64encode(await value.read()).decode()
            else:
                body[key] = form_value(key, value)
    finally:
        await form.close()
    return body
