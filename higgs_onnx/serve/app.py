"""The FastAPI app: OpenAI's `POST /v1/audio/speech` (plus voices, models, tags, health and a web page).

Every speech response streams: the handler submits a job to the `Scheduler`, waits for its first chunk (so that
a failure before any audio still gets a proper JSON error, and a client that leaves while queued cancels it),
then returns a `StreamingResponse` that encodes each chunk as it comes (`formats`). Leaving the response early,
for whatever reason, cancels the job, which frees its batch slot.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, one clear line, never a traceback:
4xx for what the client sent, 401 for the API key, 408 for a body that stops arriving, 413 for one too large (or a
prompt that does not fit), 429 when the queue is full, 500 (server log has the details) for a failure of the server
itself, 503 for a request that had no audio yet when the server shut down. Every request is checked against the
request contract (`generation.contract`) before it is queued: a `ContractError` is answered with its own status,
param and code; a generation that ends without audio is an error, never a 200 with an empty body.

The OpenAPI schema is at `/openapi.json`; there is no `/docs` page (FastAPI's Swagger page loads its script from a
CDN, which a server on an offline machine cannot reach, and the page's CSP would refuse it).
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hmac
import io
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from ..audio import AudioError, check_format, check_recording
from ..generation.contract import ContractError, NoAudioError, min_rows
from ..generation.options import DEFAULT_MAX_ROWS, GenerationOptions
from ..job.options import SAMPLING, OptionError, SpeechOptions, speed_tag
from .formats import FORMATS, encoder
from .limits import (
    COUNTERS,
    DRAIN_LIMIT,
    MAX_INPUT_CHARS,
    MAX_JSON_BYTES,
    MAX_PIECES,
    MAX_UPLOAD_BYTES,
    BodyDeadline,
    BodyTimeout,
    ClientGone,
    Timeouts,
)
from .pieces import ONE_REQUEST_CHARS, Cue, PieceReader, plan_pieces
from .scheduler import QueueFull, ShuttingDown
from .shapes import InlineReference as InlineRef
from .voices import DEFAULT, UnknownVoice, VoiceError, VoiceExists, VoiceStore, check_name

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
    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(status) or \
        ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


class VoiceRef(BaseModel):
    """OpenAI's custom-voice object, `{"id": "name"}`."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr


class OutputFields(BaseModel):
    """What the speech and the dialogue bodies share: the model, the audio's format and the sampling fields."""

    model: StrictStr
    response_format: StrictStr = "mp3"
    stream_format: StrictStr = "audio"
    temperature: StrictFloat | None = None
    top_k: StrictInt | None = None
    top_p: StrictFloat | None = None
    seed: StrictInt | None = None
    max_rows: StrictInt | None = None


class SpeechRequest(OutputFields):
    """The JSON body of `/v1/audio/speech`. Fields OpenAI defines plus our extras; others are ignored. Types are
    strict: `"5"` or `true` is not an integer, `"0.8"` not a number (a float field takes an integer)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    input: StrictStr
    # a saved voice's name, OpenAI's {"id": name}, or a blend: "alice:0.7,bob:0.3" or [{"voice", "weight"}, ...]
    voice: StrictStr | VoiceRef | list[Any] | None = None
    blend_mode: StrictStr | None = None  # how a blend mixes its voices: "mixture" (default) or "product"
    instructions: StrictStr | None = None
    speed: StrictFloat = 1.0
    # run alone (a batch of one): the audio equals the same request made alone, to the bit (see `Scheduler`)
    deterministic: StrictBool = False
    # the guard's retries (docs/guard.md): the response waits for a good take (at most this many redraws, each with
    # a new seed and a cooler temperature) and is then sent whole; 0 (the default): audio streams as it is made
    retries: StrictInt = 0
    # best of n takes (docs/guard.md): n draws of the request batched with everything else, each judged, the best
    # sent whole (1, the default: one take, streamed)
    takes: StrictInt = 1
    # EBU R128 integrated loudness in LUFS (docs/audio.md): the take is measured whole, brought to it and then sent
    # whole (None, the default: as generated, streamed)
    loudness: StrictFloat | None = None
    # Boson's and sglang-omni's raw PCM stream (needs response_format "pcm"; every format streams without it)
    stream: StrictBool = False


class DialogueRequest(OutputFields):
    """The JSON body of `/v1/audio/dialogue` (docs/dialogue.md); unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    turns: list[Any]
    voices: dict[StrictStr, StrictStr]  # speaker -> a saved voice's name, or "default" (zero-shot)


JOB_FIELDS = ("voice", "blend_mode", *SAMPLING, "speed", "takes", "retries", "loudness", "deterministic",
              "instructions")  # the body's fields that are `job.options.OPTIONS` (references: `shapes.normalise`)
# what a session.config may hold beyond WS_ONLY: the speech fields (refused by name where the WebSocket cannot
# honour them), the reference shapes and the output format
WS_FIELDS = {"model", *JOB_FIELDS, "response_format", "stream_format", "stream", "ref_audio", "ref_text", "references",
             "speaker", "max_new_tokens"}
WS_ONLY = ("type", "session", "split_granularity", "stream_audio", "input", "continuation")  # not speech fields


async def _replay(items: list) -> AsyncIterator:
    """A list as an async iterator (the chunks of a take already made)."""
    for item in items:
        yield item


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


def _bad_audio(message: str) -> ApiError:
    return ApiError(400, message, param="file", code="invalid_audio")


def read_upload_audio(data: bytes) -> tuple[Any, int]:
    """Uploaded bytes -> (samples, channels) float32 and the rate; 400 if libsndfile cannot read them, or the clip
    is not a plausible recording (`audio.check_format` from the header, before decoding: a small file can claim
    hours; then `audio.check_recording` on the samples)."""
    import soundfile as sf

    if not data:
        raise _bad_audio("the uploaded audio file is empty")
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            rate, channels, frames = f.samplerate, f.channels, f.frames
            try:  # from the header, before decoding
                check_format(rate, channels, frames)
            except AudioError as e:
                raise _bad_audio(str(e)) from None
            wav = f.read(dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:  # ApiError passes: not one of these
        reason = str(e).split(": ", 1)[-1].rstrip(". ") or type(e).__name__
        raise _bad_audio(f"cannot read the uploaded audio ({reason}); send a WAV, FLAC, OGG or MP3 file") from None
    try:  # the same rules as every other job's references (`audio.check_recording`)
        check_recording(wav, rate)
    except AudioError as e:
        raise _bad_audio(str(e)) from None
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


class _LoggedCut(logging.Filter):
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


def create_app(tts, scheduler, voices_dir: str | Path, api_key: str | None = None, *,
               allowed_hosts: list[str] | None = None, timeouts: Timeouts | None = None,
               default_voice: str = DEFAULT, ws_idle_s: float = 30.0, wyoming: str | None = None) -> FastAPI:
    """The app for one loaded model. Its lifespan starts and stops `scheduler`. `api_key` (if set) is required as
    `Authorization: Bearer <key>` on every /v1 route; `allowed_hosts` (if set) refuses other Host headers (DNS
    rebinding: the server's own loopback names); `timeouts` bound the request bodies (`limits`); `default_voice` (a
    saved voice's name) speaks for requests that name no voice or one of OpenAI's (`OPENAI_VOICES`); "default" named
    is zero-shot speech."""
    timeouts = timeouts or Timeouts()
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _LoggedCut) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(_LoggedCut())
    model_id = Path(tts.manifest.folder).name
    models = [model_id, *ALIASES, *OPENAI_ALIASES]
    sample_rate = tts.facts.sample_rate
    store = VoiceStore(voices_dir, tts.model_id)
    voice_lock = asyncio.Lock()  # one reference encoding at a time: it competes with generation for the cores
    started = time.time()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        beside = None
        try:
            if wyoming is not None:  # Home Assistant's protocol on the same scheduler (higgs_onnx.wyoming)
                from ..wyoming import WyomingService, start

                beside = await start(wyoming, WyomingService(tts, scheduler, store, default_voice=default_voice,
                                                               send_s=timeouts.send_s))
                log.info("Wyoming server on %s", wyoming)
            yield
        finally:
            if beside is not None:
                beside.close()
            scheduler.stop()

    # no /docs page: Swagger UI loads from a CDN (offline machines, the page CSP); the schema stays at /openapi.json
    app = FastAPI(title="higgs-onnx speech server", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(BodyTimeout)
    async def _body_timeout(request: Request, e: BodyTimeout):
        log.warning("%s %s: %s; connection closed", client_of(request), request.url.path, e)
        return error_response(408, f"{e}; send the whole body at once", None, "body_timeout",
                              {"Connection": "close"})

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, e: Exception):  # one line, not a traceback: nobody reads the answer
        reason = str(e) if isinstance(e, ClientGone) else "the client left before the end of its request body"
        log.warning("%s %s: %s", client_of(request), request.url.path, reason)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        message, param = validation_message(e)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(e.status_code, message, code={404: "not_found"}.get(e.status_code),
                              headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):  # uvicorn logs the traceback; the client gets one line
        return error_response(500, "internal server error; the server log has the details", code="server_error")

    app.add_middleware(BodyDeadline, timeouts=timeouts)
    if allowed_hosts:
        app.add_middleware(HostGuard, names=allowed_hosts)

    def refusal(headers, cross_site_write: bool) -> ApiError | None:
        """Why a request must be refused: a write from a page of another origin (a browser sends Origin, and
        cannot set Authorization without a CORS preflight, which this server never grants), or a missing or wrong
        API key; None when it may go on. `cross_site_write`: the request writes (not GET/HEAD; a WebSocket always
        counts, its upgrade being a GET that a page may send anywhere)."""
        origin = headers.get("origin")
        if origin and cross_site_write and urlsplit(origin).netloc != headers.get("host"):
            return ApiError(403, f"cross-origin request from {origin} refused (the server allows no CORS)",
                            code="cross_origin")
        if api_key is None:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return ApiError(401, "this server needs an API key: send the header Authorization: Bearer <key>",
                            code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            return ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None

    async def guard(request: Request) -> None:
        """The API key, and no cross-site writes (`refusal`)."""
        if (e := refusal(request.headers, request.method not in ("GET", "HEAD"))) is not None:
            raise e

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(guard)])

    # -- speech ------------------------------------------------------------------------------------------------
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

    async def resolve_voice(voice: str | VoiceRef | list | None, mode: str | None = None):
        """The `voice` field -> a saved voice, None (zero-shot) or a `Blend` of them (`voice_blend`)."""
        if isinstance(voice, list) or isinstance(voice, str) and ("," in voice or ":" in voice):
            return await voice_blend(voice, mode)
        if mode is not None:
            raise ApiError(400, "blend_mode is for a blend of voices (voice \"alice:0.7,bob:0.3\")", "blend_mode",
                           "invalid_value")
        return await one_voice(voice)

    async def voice_blend(voice: str | list, mode: str | None):
        """A blend in the `voice` field (docs/voices.md): each name resolved as a voice of its own."""
        from ..generation.blend import Blend, normalise_weights, parse_members

        try:
            pairs = parse_members(voice, "voice")
            if len(pairs) > 1:  # the weights, before any voice is loaded
                normalise_weights([w for _, w in pairs], "voice")
        except ValueError as e:
            raise ApiError(400, str(e), "voice", "invalid_value") from None
        voices = [await one_voice(name) for name, _ in pairs]
        if len(voices) == 1:
            return voices[0]
        weights = None if pairs[0][1] is None else [w for _, w in pairs]
        try:
            return Blend.make(voices, weights, mode or "mixture", [n for n, _ in pairs])
        except ValueError as e:  # all weights 0, some given and some not
            raise ApiError(400, str(e).replace("the blend", "voice"), "voice", "invalid_value") from None

    async def one_voice(voice: str | VoiceRef | None):
        name = voice.id if isinstance(voice, VoiceRef) else voice
        if name is None or name.lower() in OPENAI_VOICES and store.find(name) is None:
            name = default_voice  # no voice named, or a stock client's "alloy": the server's default voice
        if name.lower() == DEFAULT:  # zero-shot, always, when named
            return None
        try:
            return await asyncio.to_thread(store.get, name)
        except UnknownVoice as e:
            raise ApiError(400, str(e), "voice", "voice_not_found") from None
        except VoiceError as e:
            raise ApiError(400, str(e), "voice", "invalid_voice") from None

    async def inline_voice(ref):
        """A reference sent in the speech request itself (Boson's ref_audio, sglang-omni's references): the voice,
        made once per clip and transcript (the model's voice cache keeps it)."""
        try:
            wav, sr = await asyncio.to_thread(read_upload_audio, ref.audio)
        except ApiError as e:
            raise ApiError(400, e.message.replace("uploaded audio", "reference audio"), ref.param, e.code) from None
        async with voice_lock:
            try:
                return await asyncio.to_thread(tts.make_voice, (wav, sr), ref.text)
            except ContractError as e:
                raise contract_error(e, {"ref_text": "ref_text"}) from None
            except ValueError as e:
                raise ApiError(400, str(e), ref.param, "invalid_value") from None

    async def inline_blend(refs: list, mode: str | None):
        """sglang-omni's `references` with several entries: each made a voice, blended by their `weight`."""
        from ..generation.blend import Blend

        voices = [await inline_voice(ref) for ref in refs]
        weights = None if all(ref.weight is None for ref in refs) else [ref.weight for ref in refs]
        try:
            return Blend.make(voices, weights, mode or "mixture", [f"references[{i}]" for i in range(len(refs))])
        except ValueError as e:
            raise ApiError(400, str(e).replace("the blend", "references"), "references", "invalid_value") from None

    def check_model(r: OutputFields) -> None:
        if r.model not in models:
            raise ApiError(400, f"model {r.model!r} is not served here; use one of {', '.join(models)}", "model",
                           "model_not_found")

    def check_output(r: OutputFields) -> GenerationOptions:
        """The formats and the sampling fields of a body (its model checked first); its options, or ApiError."""
        check_model(r)
        if r.response_format not in FORMATS:
            raise ApiError(400, f"response_format {r.response_format!r} is not supported; use one of "
                           f"{', '.join(FORMATS)}", "response_format", "unsupported_format")
        if r.stream_format not in ("audio", "sse"):
            raise ApiError(400, f"stream_format {r.stream_format!r} is not supported; use audio or sse",
                           "stream_format", "invalid_value")
        return job_options(r, SAMPLING, "http").generation

    def job_options(r, names, door: str) -> SpeechOptions:
        """The job's options from the body's fields `names` (`job.options`: bounds and rules defined once)."""
        try:
            return SpeechOptions.build({k: getattr(r, k) for k in names}, door)
        except OptionError as e:
            raise ApiError(400, e.message, e.param, e.code) from None

    def check_speech(r: SpeechRequest, door: str = "http") -> tuple[str, SpeechOptions, str | None]:
        """The text to submit (speed tag first), the job's options and the tag; ApiError for the first bad
        field (a field `door` cannot honour is refused by name)."""
        check_model(r)
        if not r.input.strip():
            raise ApiError(400, "input is empty: give the text to speak", "input", "invalid_value")
        if len(r.input) > MAX_INPUT_CHARS:
            raise ApiError(400, f"input is {len(r.input)} characters long; the limit is {MAX_INPUT_CHARS} (an input "
                           f"beyond one request is read in pieces, up to that)", "input", "string_above_max_length")
        check_output(r)
        job = job_options(r, JOB_FIELDS, door)
        tag = speed_tag(job.speed, tts.tokens.control_tags)
        return (tag or "") + r.input, job, tag

    async def opening(job, chunks: AsyncIterator, request: Request):
        """`first_chunk`, with its failures as the error response (no audio was sent yet); GONE: the client left."""
        try:
            return await first_chunk(job, chunks, request)
        except ConnectionAbortedError:
            return GONE
        except Exception as e:  # noqa: BLE001 - failed before any audio: a proper error response
            log.error("request %s failed before its first audio: %s: %s", job.id, type(e).__name__, e)
            raise failure(e) from None

    async def clone_voice(codes, text: str):
        """A voice from a zero-shot piece's own codes (a restart of its context speaks in the voice it chose)."""
        async with voice_lock:
            return await asyncio.to_thread(tts.voice_from_codes, codes, text)

    async def first_chunk(job, chunks: AsyncIterator, request: Request):
        """The job's first chunk (None: no audio at all); a client that leaves meanwhile cancels the job."""
        task = asyncio.ensure_future(anext(chunks, None))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ConnectionAbortedError
        finally:
            if not task.done():  # the client left, or this handler was cancelled (shutdown): nobody waits for it
                job.cancel()
                task.cancel()

    def failure(e: Exception) -> ApiError:
        if isinstance(e, ContractError):
            return contract_error(e)
        if isinstance(e, NoAudioError):
            return ApiError(500, f"{e}; no audio to send (try another seed or text)", None, "no_audio")
        if isinstance(e, ShuttingDown):
            return ApiError(503, f"{e}; try again shortly", None, "shutting_down", {"Retry-After": "1"})
        if isinstance(e, QueueFull):  # a long input's piece submitted while the server is full
            return ApiError(429, f"the server is busy ({e}); try again shortly", None, "rate_limit_exceeded",
                            {"Retry-After": "1"})
        if isinstance(e, ValueError):
            return ApiError(400, str(e), None, "invalid_value")
        return ApiError(500, "speech generation failed; the server log has the details", None, "server_error")

    def contract_error(e: ContractError, params: dict[str, str] | None = None) -> ApiError:
        """The contract's own answer: its status (400 or 413), field and code; `params` renames fields."""
        param = (params or {}).get(e.param, e.param)
        return ApiError(e.status, str(e), param, e.code)

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

    @v1.post("/audio/speech")
    async def speech(request: Request):
        from .shapes import ShapeError, normalise

        if media_type(request.headers.get("content-type", ""))[0] == "multipart/form-data":
            body = await read_form(request)
        else:
            body = await read_json(request)
        try:
            inline = normalise(body)  # Boson's and sglang-omni's fields (serve/shapes.py)
        except ShapeError as e:
            raise ApiError(400, str(e), e.param, e.code) from None
        try:
            r = SpeechRequest.model_validate(body)
        except ValidationError as e:
            message, param = validation_message(e)
            raise ApiError(400, message, param, "invalid_value") from None
        text, job_opts, tag = check_speech(r)
        options = job_opts.generation
        if r.stream and r.stream_format == "audio" and r.response_format != "pcm":
            raise ApiError(400, f"stream: true sends raw PCM: it needs response_format 'pcm', got "
                           f"{r.response_format!r} (every format streams here without it)", "stream", "invalid_value")
        if isinstance(inline, list):  # several references: a blend of them (docs/voices.md)
            voice = await inline_blend(inline, r.blend_mode)
        else:
            voice = await inline_voice(inline) if inline is not None else await resolve_voice(r.voice, r.blend_mode)
            if inline is not None and r.blend_mode is not None:
                raise ApiError(400, "blend_mode is for a blend of voices (several references)", "blend_mode",
                               "invalid_value")
        if r.model_extra:
            log.info("ignored fields: %s", ", ".join(sorted(r.model_extra)))
        try:  # an input beyond one request: read in pieces (serve/pieces.py); None: one request, as ever
            pieces = await asyncio.to_thread(plan_pieces, tts, scheduler.slot_positions, r.input, tag, voice, options)
        except ContractError as e:
            raise contract_error(e, {"ref_text": "voice"}) from None
        except ValueError as e:
            raise ApiError(400, str(e), "input", "invalid_value") from None
        if pieces is not None:
            check_pieces(job_opts, voice, len(pieces))
        takes = None
        if job_opts.takes > 1:
            job, done, takes = await best_take(text, voice, options, job_opts, request)
            if job is None:
                return Response(status_code=499)
            first, chunks = (done[0] if done else None), _replay(done[1:])
        elif job_opts.retries:
            job, done, takes = await judged_takes(text, voice, options, job_opts, request)
            if job is None:
                return Response(status_code=499)
            first, chunks = (done[0] if done else None), _replay(done[1:])
        elif job_opts.loudness is not None:  # measured whole: the take is collected, then sent
            job = read_pieces(pieces, voice, options, tag) if pieces else start_job(text, voice, options,
                                                                                     job_opts.deterministic)
            done = await collect(job, request)
            if done is None:
                return Response(status_code=499)
            first, chunks = (done[0] if done else None), _replay(done[1:])
        else:
            job = read_pieces(pieces, voice, options, tag) if pieces else start_job(text, voice, options,
                                                                                     job_opts.deterministic)
            chunks = aiter(job)
            first = await opening(job, chunks, request)
            if first is GONE:
                return Response(status_code=499)
        if first is None:  # ended without a chunk and without an error: never a 200 with no audio
            log.error("request %s ended without audio", job.id)
            raise ApiError(500, "the generation ended without audio; no audio to send", None, "no_audio")
        sse, level = r.stream_format == "sse", None
        if job_opts.loudness is not None and first is not None:
            done, level = leveled([first, *[c async for c in chunks]], job_opts.loudness)
            first, chunks = done[0], _replay(done[1:])
        body = stream_body(job, first, chunks, r.response_format, sse, len(r.input), tag, takes, level,
                           sglang=sse and r.stream)
        fmt = FORMATS[r.response_format]
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": str(job.id)}
        if r.response_format == "pcm":  # what sglang-omni's raw PCM stream says of itself
            headers.update({"X-Sample-Rate": str(sample_rate), "X-Channels": "1", "X-Bit-Depth": "16"})
        if pieces:
            headers["X-Pieces"] = str(len(pieces))
        if r.model_extra:  # other servers' fields, which clients written for them send: named, never silent
            headers["X-Ignored-Fields"] = ",".join(sorted(r.model_extra))[:512]
        if level is not None and level.reached is not None:
            headers["X-Loudness"] = f"{level.reached:.1f}"
        if takes:
            kept = next((t for t in takes if t.get("kept")), takes[-1])  # best of n: the kept one; retries: the last
            headers.update({"X-Takes": str(len(takes)), "X-Verdict": kept["verdict"]})
        return JobResponse(job, body, media_type="text/event-stream" if sse else fmt.media_type, headers=headers)

    def check_pieces(job_opts: SpeechOptions, voice, n: int) -> None:
        """What an input read in pieces cannot be combined with: a 400 that says why."""
        why = f"this input is read in {n} pieces (it does not fit one request), each continuing the one before"
        if job_opts.takes > 1 or job_opts.retries:
            field = "takes" if job_opts.takes > 1 else "retries"
            raise ApiError(400, f"{field} judge one whole take, but {why}; send it without {field}, or in shorter "
                           f"requests", field, "unsupported_parameter")
        if job_opts.deterministic:
            raise ApiError(400, f"deterministic runs one request alone, but {why}, which the scheduler batches; send "
                           f"it without deterministic, or in shorter requests", "deterministic",
                           "unsupported_parameter")
        if getattr(voice, "width", 1) > 1:  # a `Blend` runs a cache per voice and cannot continue one
            raise ApiError(400, f"a blend of voices cannot continue earlier speech, but {why}; use one voice, or "
                           f"shorter requests", "voice", "unsupported_parameter")

    def read_pieces(pieces: list, voice, options, tag: str | None) -> PieceReader:
        """The job of an input read in pieces: one `SpeechSession` speaking them in order (`pieces.PieceReader`).
        Zero-shot, a restart of the context speaks in the first piece's voice (made from its codes)."""
        from .textstream import SpeechSession

        return PieceReader(SpeechSession(scheduler, voice, options), pieces, sample_rate, tag,
                           clone_voice if voice is None else None)

    def start_job(text: str, voice, options, exclusive: bool):
        """Submit one job; the scheduler's refusals as OpenAI-style errors."""
        try:
            return scheduler.submit(text, voice=voice, options=options, exclusive=exclusive)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy ({e}); try again shortly", None, "rate_limit_exceeded",
                           {"Retry-After": "1"}) from None
        except ShuttingDown as e:
            raise failure(e) from None
        except ContractError as e:  # a stored voice's transcript is checked with the request: it is the voice's
            raise contract_error(e, {"ref_text": "voice"}) from None
        except ValueError as e:
            raise ApiError(400, str(e), next((k for k in SAMPLING if str(e).startswith(k)), "input"),
                           "invalid_value") from None

    async def judged_takes(text: str, voice, options, job_opts: SpeechOptions, request: Request):
        """(job, chunks, takes): whole takes, each judged by the guard, until a good one or the retries run out
        (the same `guard.RetryPolicy` as everywhere). (None, None, takes) when the client left meanwhile."""
        from ..guard import RetryPolicy

        policy, takes = RetryPolicy(retries=job_opts.retries), []
        while True:
            job = start_job(text, voice, options, job_opts.deterministic)
            done = await collect(job, request)
            if done is None:
                return None, None, takes
            if not done:
                return job, done, takes
            v = judged(text, done)
            takes.append(take_entry(options, done, v))
            nxt = policy.after(v, options, len(takes))
            if nxt is None:
                return job, done, takes
            log.info("request %s: take %d is %s (%s); drawing again", job.id, len(takes), v.name, v.reason)
            options = nxt

    async def collect(job, request: Request) -> list | None:
        """Every chunk of a job (None: the client left, and the job is cancelled)."""
        done = []
        try:
            async for chunk in job:
                done.append(chunk)
                if await request.is_disconnected():
                    job.cancel()
                    return None
        except Exception as e:  # noqa: BLE001 - a take that fails is the request's error
            log.error("request %s failed: %s: %s", job.id, type(e).__name__, e)
            raise failure(e) from None
        return done

    def judged(text: str, done: list):
        """The guard's verdict of a whole take."""
        import numpy as np

        from ..guard import GuardOptions, judge

        f, last = tts.facts, done[-1]
        return judge(last.rows, text, f.frame_rate, f.num_codebooks, last.stats.stop_reason,
                     np.concatenate([c.samples for c in done]), f.hop, tts.guard or GuardOptions())

    def take_entry(options, done: list, v) -> dict:
        from ..guard import take_record

        return take_record(options, len(done[-1].rows), done[-1].stats.stop_reason, v)

    async def best_take(text: str, voice, options, job_opts: SpeechOptions, request: Request):
        """(job, chunks, takes): `job_opts.takes` draws submitted together (they batch with every other request),
        each
        judged; the best (`runtime.model._take_scores`) is sent. (None, None, takes) when the client left."""
        import dataclasses

        from ..runtime.model import TAKE_SEED_STEP, _take_scores

        opts = [dataclasses.replace(options, seed=options.seed + i * TAKE_SEED_STEP) for i in range(job_opts.takes)]
        jobs = []
        try:
            for o in opts:
                jobs.append(start_job(text, voice, o, job_opts.deterministic))
        except BaseException:
            for j in jobs:
                j.cancel()
            raise
        made = []
        for j in jobs:
            done = await collect(j, request)
            if done is None:
                for other in jobs:
                    other.cancel()
                return None, None, []
            made.append(done)
        verdicts = [judged(text, d) if d else None for d in made]
        good = [v is not None and v.good for v in verdicts]
        scores = _take_scores([len(d[-1].rows) if d else 0 for d in made], good)
        best = max(range(len(made)), key=lambda i: (scores[i] if made[i] else -9.0, -i))
        takes = [{**(take_entry(o, d, v) if d else {"seed": o.seed, "verdict": "no_audio"}), "take": i + 1,
                  "score": round(scores[i], 4), "kept": i == best}
                 for i, (o, d, v) in enumerate(zip(opts, made, verdicts, strict=True))]
        return jobs[best], made[best], takes

    def leveled(done: list, lufs: float) -> tuple[list, object]:
        """A whole take's chunks brought to `lufs` together (one gain), and the `loudness.Loudness` record."""
        import dataclasses

        import numpy as np

        from ..loudness import normalise

        audio = [c for c in done if not isinstance(c, Cue)]  # a long input's piece cues stay where they are
        wav, level = normalise(np.concatenate([c.samples for c in audio]), sample_rate, lufs)
        ends = np.cumsum([c.samples.size for c in audio])
        made = iter([dataclasses.replace(c, samples=wav[e - c.samples.size:e])
                     for c, e in zip(audio, ends, strict=True)])
        return [c if isinstance(c, Cue) else next(made) for c in done], level

    async def stream_body(job, first, chunks: AsyncIterator, fmt: str, sse: bool, input_chars: int,
                          tag: str | None, takes: list | None = None, level=None,
                          sglang: bool = False) -> AsyncIterator[bytes]:
        """The response body. `sse`: OpenAI's speech.audio.delta / speech.audio.done events, or (`sglang`: `stream:
        true` with `stream_format: "sse"`) sglang-omni's audio.speech.chunk objects, the last with finish_reason
        and usage, then `data: [DONE]`. A long input's `pieces.Cue`s among the chunks become `audio.speech.piece.start`
        / `audio.speech.piece` events in both (each after the audio before it); the audio formats leave them out."""
        index = itertools.count()

        def event(obj: dict) -> bytes:
            return f"data: {json.dumps(obj)}\n\n".encode()

        def chunk_event(data: bytes | None, finish: str | None = None, usage: dict | None = None) -> dict:
            audio = None if data is None else {"data": base64.b64encode(data).decode(), "format": fmt,
                                                "mime_type": FORMATS[fmt].media_type, "sample_rate": sample_rate}
            return {"id": f"speech-{job.id}", "object": "audio.speech.chunk", "index": next(index), "audio": audio,
                    "finish_reason": finish, **({"usage": usage} if usage is not None else {})}

        def out(data: bytes) -> bytes:
            if not sse or not data:
                return data
            if sglang:
                return event(chunk_event(data))
            return event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

        enc, stats, chunk, cues = encoder(fmt, sample_rate), None, first, []
        try:
            while chunk is not None:
                if isinstance(chunk, Cue):
                    if sse:
                        yield event(chunk.event(f"speech-{job.id}"))
                    if chunk.end is not None:
                        cues.append(chunk.as_dict())
                else:
                    if data := out(enc.push(chunk.samples)):
                        yield data
                    if chunk.is_last:
                        stats = chunk.stats
                chunk = await anext(chunks, None)
            if data := out(enc.finish()):
                yield data
        except Exception as e:
            log.error("request %s failed while streaming: %s: %s", job.id, type(e).__name__, e)
            if not sse:
                raise StreamCut from None  # the connection is cut: a client must not take truncated audio for whole
            err = failure(e)
            yield event({"type": "error", "error": {"message": err.message, "type": "server_error", "param": None,
                                                    "code": err.code}})
            return
        if stats is not None:
            log.info("request %s: %.2f s audio (%s) in %.2f s, first audio after %.2f s, %d rows, stop %s", job.id,
                     stats.audio_s, fmt, stats.wall_s, stats.first_audio_s, stats.rows, stats.stop_reason)
        if sse and sglang:
            s = stats.as_dict() if stats is not None else {}
            stop = s.get("stop_reason")
            usage = {"prompt_tokens": s.get("prompt_tokens", 0), "completion_tokens": s.get("rows", 0)}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            yield event(chunk_event(None, "stop" if stop == "eoc" else "length" if stop == "max_rows" else stop,
                                    usage))
            yield b"data: [DONE]\n\n"
        elif sse:
            s = stats.as_dict() if stats is not None else {}
            usage = {"input_tokens": s.get("prompt_tokens", 0), "output_tokens": s.get("rows", 0)}
            done = {"type": "speech.audio.done", "usage": {**usage, "total_tokens": sum(usage.values())},
                    "input_characters": input_chars, "speed_tag": tag, "stop_reason": s.get("stop_reason"),
                    "stats": s}
            if takes is not None:
                done["takes"] = takes
            if level is not None:
                done["loudness"] = level.as_dict()
            if cues:
                done["pieces"] = cues
            yield event(done)

    # -- a dialogue: several voices, one response (serve/dialogue.py; docs/dialogue.md) ---------------------------
    @v1.post("/audio/dialogue")
    async def dialogue(request: Request):
        from ..longform.dialogue import MAX_SPEAKERS
        from ..longform.script import ScriptError, check_cast, speakers, turns_from_json
        from .dialogue import DialogueReader, check_lines, plan_lines, speaker_options
        from .textstream import SpeechSession

        body = await read_json(request)
        try:
            r = DialogueRequest.model_validate(body)
        except ValidationError as e:
            message, param = validation_message(e)
            raise ApiError(400, message, param, "invalid_value") from None
        options = check_output(r)
        try:
            turns = turns_from_json(r.turns, "turns")
            check_cast(turns, r.voices, "turns", "voices", "/v1/audio/speech")
        except ScriptError as e:
            raise ApiError(400, str(e), "voices" if "has no voice" in str(e) else "turns", "invalid_value") from None
        cast = speakers(turns)
        if len(cast) > MAX_SPEAKERS:
            raise ApiError(400, f"turns have {len(cast)} speakers; at most {MAX_SPEAKERS}", "turns", "invalid_value")
        chars = sum(len(t.text) for t in turns)
        if chars > MAX_INPUT_CHARS:
            raise ApiError(400, f"turns hold {chars} characters; the limit is {MAX_INPUT_CHARS}", "turns",
                           "string_above_max_length")
        voices = {}
        for name in cast:
            spec = r.voices[name]
            if "," in spec or ":" in spec:
                raise ApiError(400, f"voices: {name}'s voice {spec!r} is a blend, which a dialogue does not support "
                               f"(each turn continues its speaker's KV cache); give one saved voice", "voices",
                               "unsupported_parameter")
            try:
                voices[name] = await one_voice(spec)
            except ApiError as e:
                raise ApiError(e.status, f"voices: {name}: {e.message}", "voices", e.code) from None
        lines = plan_lines(turns)
        if len(lines) > MAX_PIECES:
            raise ApiError(400, f"turns are read in {len(lines)} pieces; the limit is {MAX_PIECES}", "turns",
                           "too_many_pieces")
        try:
            await asyncio.to_thread(check_lines, tts, scheduler.slot_positions, lines, voices, options)
        except ContractError as e:
            raise contract_error(e) from None
        sessions = {name: SpeechSession(scheduler, voices[name], speaker_options(options, k))
                    for k, name in enumerate(cast)}
        job = DialogueReader(sessions, lines, sample_rate, clone_voice)
        chunks = aiter(job)
        first = await opening(job, chunks, request)
        if first is GONE:
            return Response(status_code=499)
        sse = r.stream_format == "sse"
        body = stream_body(job, first, chunks, r.response_format, sse, chars, None)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": str(job.id),
                   "X-Pieces": str(len(lines)), "X-Speakers": str(len(cast))}
        return JobResponse(job, body, media_type="text/event-stream" if sse else FORMATS[r.response_format].media_type,
                           headers=headers)

    # -- text in, audio out: one WebSocket session (sglang-omni's message names; docs/integrations.md) -----------
    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(ws: WebSocket):
        from .textstream import SpeechSession
        from .wsproto import ConfigError, WsSession

        if (e := refusal(ws.headers, True)) is not None:  # closed before the session starts (code 1008)
            await ws.close(1008, e.message[:120])
            return
        await ws.accept()

        async def configure(cfg: dict):
            """(format, options, voice, speed tag) from a session.config; wsproto.ConfigError for the first field
            that is bad or that this door cannot honour (`job.options`: refused by name, never ignored)."""
            from .shapes import ShapeError, normalise

            body = {"model": model_id, **{k: v for k, v in cfg.items() if k not in WS_ONLY}}
            try:
                unknown = sorted(set(body) - WS_FIELDS)
                if unknown:
                    raise ConfigError(f"{unknown[0]} is not a session.config field here; the fields are "
                                      f"{', '.join(sorted(WS_FIELDS - {'model'}))}", unknown[0], "unknown_parameter")
                for name, value in (("stream_format", "audio"), ("stream", False)):
                    if body.get(name, value) != value:
                        raise ConfigError(f"{name} is not for the text-in WebSocket: audio always comes as binary "
                                          f"frames, as it is made", name, "unsupported_parameter")
                inline = normalise(body)  # Boson's ref_audio/ref_text, sglang-omni's references (serve/shapes.py)
                r = SpeechRequest.model_validate({**body, "input": "-"})
                _, job_opts, tag = check_speech(r, "websocket")
                if isinstance(inline, list):
                    raise ConfigError("references: a blend of several references is not supported on the text-in "
                                      "WebSocket (it continues one KV context across segments); send one reference",
                                      "references", "unsupported_parameter")
                voice = await inline_voice(inline) if inline is not None else await resolve_voice(r.voice, None)
                if getattr(voice, "width", 1) > 1:  # a `Blend`
                    raise ConfigError("voice: a blend of voices is not supported on the text-in WebSocket (it "
                                      "continues one KV context across sentences); use one voice",
                                      "voice", "unsupported_parameter")
                return r.response_format, job_opts.generation, voice, tag or ""
            except ValidationError as e:
                message, param = validation_message(e)
                raise ConfigError(message, param, "invalid_value") from None
            except ShapeError as e:
                raise ConfigError(str(e), e.param, e.code) from None
            except ApiError as e:
                raise ConfigError(e.message, e.param, e.code) from None

        await WsSession(ws, configure, lambda voice, options, prefix: SpeechSession(scheduler, voice, options,
                                                                                    prefix=prefix),
                        sample_rate, ws_idle_s, timeouts.send_s).run()

    # -- Open WebUI's lists (backend/open_webui/routers/audio.py reads {"models": [{"id"}]} and
    # {"voices": [{"id", "name"}]}); "data" too, for clients that read OpenAI's list shape
    @v1.get("/audio/models")
    async def audio_models():
        entries = [model_entry(m) for m in models]
        return {"object": "list", "models": [{"id": e["id"], "name": e["id"]} for e in entries], "data": entries}

    @v1.get("/audio/voices")
    async def audio_voices():
        saved = saved_voices()
        names = [DEFAULT, *(v["id"] for v in saved)]
        data = [{"voice": v["id"], "id": v["id"], "created_at": v["created"]} for v in saved]  # Boson's list shape
        return {"object": "list", "voices": [{"id": n, "name": n + (" (server default)" if n == default_voice else "")}
                                             for n in names], "data": data,
                "default": default_voice, "aliases": {v: default_voice for v in OPENAI_VOICES if store.find(v) is None}}

    @v1.post("/audio/voices")
    async def create_audio_voice(request: Request):
        """Boson's voice creation: JSON {ref_audio (base64 or data: URI), ref_text, description?} -> a saved voice
        whose id is derived from the clip ("voice_" + its sha256's first 32 hex digits): the same clip gives the same
        id (201 when new, 200 when it exists)."""
        import hashlib

        from .shapes import ShapeError, decode_audio_field

        body = await read_json(request)
        ref_text, description = body.get("ref_text"), body.get("description")
        try:
            audio = decode_audio_field(body.get("ref_audio"), "ref_audio")
        except ShapeError as e:
            raise ApiError(400, str(e), e.param, e.code) from None
        if not isinstance(ref_text, str) or not ref_text.strip():
            raise ApiError(400, "ref_text (what the reference says) is required", "ref_text", "missing_field")
        if description is not None and not isinstance(description, str):
            raise ApiError(400, "description must be text", "description", "invalid_value")
        vid = "voice_" + hashlib.sha256(audio).hexdigest()[:32]
        if store.find(vid) is not None:
            entry = store.describe(vid)
            return JSONResponse({"voice": vid, "ref_text": ref_text, "description": description,
                                 "created_at": entry["created"]}, 200)
        voice = await inline_voice(InlineRef(audio, ref_text.strip(), "ref_audio"))
        try:
            entry = await asyncio.to_thread(store.add, vid, voice)
        except VoiceExists:  # made meanwhile by the same clip
            entry = store.describe(vid)
        return JSONResponse({"voice": vid, "ref_text": ref_text, "description": description,
                             "created_at": entry["created"]}, 201)

    # -- voices ------------------------------------------------------------------------------------------------
    def saved_voices() -> list[dict]:
        """The listing entries of the saved voices (`VoiceStore.describe`); one deleted meanwhile is left out."""
        out = []
        for name in store.names():
            try:
                out.append(store.describe(name))
            except FileNotFoundError:
                continue
        return out

    @v1.get("/voices")
    async def list_voices():
        return {"object": "list", "data": [{"id": DEFAULT, "object": "voice", "created": int(started)},
                                           *saved_voices()]}

    @v1.post("/voices", status_code=201)
    async def create_voice(request: Request):
        ctype = request.headers.get("content-type", "")
        if is_json_type(ctype):  # Boson's shape: {ref_audio, ref_text, description}
            return await create_audio_voice(request)
        if media_type(ctype)[0] != "multipart/form-data":
            raise ApiError(400, "upload a voice as multipart/form-data with the fields name, file (reference audio) "
                           "and transcript (optional), or as JSON {ref_audio, ref_text} (Boson's shape)",
                           code="invalid_content_type")
        stream = limited(request.stream(), MAX_UPLOAD_BYTES, "the upload")
        try:
            form = await MultiPartParser(request.headers, stream, max_files=1, max_fields=8).parse()
        except MultiPartException as e:
            raise ApiError(400, f"malformed multipart body: {e.message}", code="invalid_multipart") from None
        try:
            name, file, transcript = form.get("name"), form.get("file"), form.get("transcript")
            if not isinstance(name, str) or not name:
                raise ApiError(400, "the field name is missing (the new voice's name)", "name", "missing_field")
            try:
                check_name(name)
            except VoiceError as e:
                raise ApiError(400, str(e), "name", "invalid_value") from None
            if not isinstance(file, UploadFile):
                raise ApiError(400, "the field file is missing or not a file: attach the reference audio",
                               "file", "missing_field")
            if transcript is not None and not isinstance(transcript, str):
                raise ApiError(400, "transcript must be text", "transcript", "invalid_value")
            transcript = (transcript.strip() or None) if transcript is not None else None
            if (taken := store.find(name)) is not None:
                raise ApiError(409, store.exists_message(name, taken), "name", "voice_exists")
            data = await file.read()
        finally:
            await form.close()
        wav, sr = await asyncio.to_thread(read_upload_audio, data)
        what = "transcript" if transcript else "file"
        async with voice_lock:
            try:
                voice = await asyncio.to_thread(tts.make_voice, (wav, sr), transcript)
            except ContractError as e:  # a special token in the transcript, a prompt beyond the context
                raise contract_error(e, {"ref_text": "transcript"}) from None
            except ValueError as e:
                raise ApiError(400, str(e), "transcript" if "transcript" in str(e) else "file",
                               "invalid_value") from None
        room = scheduler.slot_positions - len(voice.prefix)
        if room < min_rows(tts.facts.num_codebooks) + 3:  # + <|text|>, one token, <|audio|>
            raise ApiError(400, f"the voice's prompt is {len(voice.prefix)} positions ({len(voice.rows)} reference "
                           f"rows{' and its transcript' if transcript else ''}), but a batch slot here holds "
                           f"{scheduler.slot_positions}: use a shorter reference clip or transcript", what,
                           "context_length_exceeded")
        try:
            return JSONResponse(await asyncio.to_thread(store.add, name, voice), 201)
        except VoiceExists as e:
            raise ApiError(409, str(e), "name", "voice_exists") from None

    @v1.delete("/voices/{name}")
    async def delete_voice(name: str):
        if name.lower() == DEFAULT:
            raise ApiError(400, f"the voice {name!r} is built in (zero-shot speech, no reference) and cannot be "
                           f"deleted", "name", "reserved_voice")
        try:
            loaded = await asyncio.to_thread(store.delete, name)
            if loaded is not None:
                tts.forget_voice(loaded)  # its prefill state leaves memory once no request uses it
        except UnknownVoice as e:
            raise ApiError(404, str(e), "name", "voice_not_found") from None
        except VoiceError as e:
            raise ApiError(400, str(e), "name", "invalid_value") from None
        return {"id": name, "object": "voice", "deleted": True}

    # -- models, tags, health, page ------------------------------------------------------------------------------
    def model_entry(mid: str) -> dict:
        return {"id": mid, "object": "model", "created": int(started), "owned_by": "higgs-onnx",
                **({"parent": model_id} if mid != model_id else {})}

    @v1.get("/models")
    async def list_models():
        return {"object": "list", "data": [model_entry(m) for m in models]}

    @v1.get("/models/{mid}")
    async def get_model(mid: str):
        if mid not in models:
            raise ApiError(404, f"model {mid!r} is not served here; use one of {', '.join(models)}", "model",
                           "model_not_found")
        return model_entry(mid)

    @v1.get("/tags")
    async def list_tags():
        """The model's inline control tags, for the page's hints (`<|category:name|>`)."""
        tags = sorted(tts.tokens.control_tags)
        return {"object": "list", "data": [{"id": t, "category": t[2:-2].split(":")[0], "name": t[2:-2].split(":")[1]}
                                           for t in tags]}

    app.include_router(v1)

    limits = {"context_positions": tts.facts.max_positions, "slot_positions": scheduler.slot_positions,
              "default_max_rows": DEFAULT_MAX_ROWS, "min_rows": min_rows(tts.facts.num_codebooks),
              "max_input_chars": MAX_INPUT_CHARS, "one_request_chars": ONE_REQUEST_CHARS, "max_pieces": MAX_PIECES,
              "max_json_bytes": MAX_JSON_BYTES,
              "max_upload_bytes": MAX_UPLOAD_BYTES, "max_connections": timeouts.max_connections,
              "timeouts_s": {k: v for k, v in timeouts.as_dict().items() if k.endswith("_s")}}

    @app.get("/health")
    async def health():
        """Liveness, the request limits (context and slot positions, default max_rows, sizes, timeouts), the
        scheduler's counters and how often each client guard fired."""
        return {"status": "ok", "model": model_id, "models": models, "sample_rate": sample_rate,
                "limits": limits, "scheduler": scheduler.stats(), "guards": dict(COUNTERS),
                "voice_cache": tts.voices.stats(),
                "uptime_s": round(time.time() - started, 1)}

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_CSP,
                                                            "Cache-Control": "no-cache"})

    for path, endpoint in (("/health", health), ("/", page)):  # HEAD: the GET's headers, no body (uvicorn drops it)
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app

