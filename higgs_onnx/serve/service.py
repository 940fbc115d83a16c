"""The speech server's shared job layer (`SpeechService`), used by every route module."""

from __future__ import annotations

import asyncio
import base64
import hmac
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import Request

from ..generation.blend import Blend, normalise_weights, parse_members
from ..generation.contract import ContractError, NoAudioError
from ..generation.options import GenerationOptions
from ..job.options import SAMPLING, OptionError, SpeechOptions
from ..job.run import Gone, Prepared, Runner, SpeechJob
from ..longform.captions import Cue
from ..text.pipeline import Reading
from .formats import FORMATS, encoder
from .http import (
    ALIASES,
    JOB_FIELDS,
    OPENAI_ALIASES,
    OPENAI_VOICES,
    ApiError,
    OutputFields,
    SpeechRequest,
    StreamCut,
    VoiceRef,
    read_upload_audio,
)
from .limits import (
    MAX_INPUT_CHARS,
    Timeouts,
)
from .pieces import PieceReader
from .scheduler import QueueFull, ShuttingDown
from .textstream import SpeechSession
from .voices import DEFAULT, UnknownVoice, VoiceError, VoiceStore

log = logging.getLogger(__name__)


class SpeechService:
    """One loaded model's speech job behind every route: its state (the model, the scheduler, the voices) and what
    the routes share: resolving a voice (saved, blended, sent inline), checking a body against the job's options
    (`job.options`), starting jobs and reading them (the first chunk, takes, retries, loudness), the scheduler's and
    the contract's failures as OpenAI-style errors, and the response body (audio formats and SSE)."""

    def __init__(self, tts, scheduler, voices_dir, api_key: str | None, timeouts: Timeouts, default_voice: str,
                 ws_idle_s: float, base: SpeechOptions | None = None):
        """`base`: the server's own defaults (its text steps: `serve --markdown` ...), under every request's."""
        self.tts, self.scheduler, self.api_key, self.timeouts = tts, scheduler, api_key, timeouts
        self.base = base or SpeechOptions()
        self.default_voice, self.ws_idle_s = default_voice, ws_idle_s
        self.model_id = Path(tts.manifest.folder).name
        self.models = [self.model_id, *ALIASES, *OPENAI_ALIASES]
        self.sample_rate = tts.facts.sample_rate
        self.store = VoiceStore(voices_dir, tts.model_id)
        self.voice_lock = asyncio.Lock()  # one reference encoding at a time: it competes with generation for the cores
        self.started = time.time()
        self.replica: str | None = None  # a Ray Serve replica's id (create_app; /health says which answered)

    def refusal(self, headers, cross_site_write: bool) -> ApiError | None:
        """Why a request must be refused: a write from a page of another origin (a browser sends Origin, and
        cannot set Authorization without a CORS preflight, which this server never grants), or a missing or wrong
        API key; None when it may go on. `cross_site_write`: the request writes (not GET/HEAD; a WebSocket always
        counts, its upgrade being a GET that a page may send anywhere)."""
        origin = headers.get("origin")
        if origin and cross_site_write and urlsplit(origin).netloc != headers.get("host"):
            return ApiError(403, f"cross-origin request from {origin} refused (the server allows no CORS)",
                            code="cross_origin")
        if self.api_key is None:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return ApiError(401, "this server needs an API key: send the header Authorization: Bearer <key>",
                            code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None

    async def job_voice(self, inline, r):
        """The voice a body asks for (`inline`: `shapes.normalise`'s references): several references blended, one
        reference, or the `voice` field (a saved voice, a blend of them, the default); what is refused is refused
        before any reference is encoded."""
        if isinstance(inline, list):  # several references: a blend of them (docs/voices.md)
            return await self.inline_blend(inline, r.blend_mode)
        if inline is None:
            return await self.resolve_voice(r.voice, r.blend_mode)
        if r.blend_mode is not None:
            raise ApiError(400, "blend_mode is for a blend of voices (several references)", "blend_mode",
                           "invalid_value")
        return await self.inline_voice(inline)

    async def resolve_voice(self, voice: str | VoiceRef | list | None, mode: str | None = None):
        """The `voice` field -> a saved voice, None (zero-shot) or a `Blend` of them (`voice_blend`)."""
        if isinstance(voice, list) or isinstance(voice, str) and ("," in voice or ":" in voice):
            return await self.voice_blend(voice, mode)
        if mode is not None:
            raise ApiError(400, "blend_mode is for a blend of voices (voice \"alice:0.7,bob:0.3\")", "blend_mode",
                           "invalid_value")
        return await self.one_voice(voice)

    async def voice_blend(self, voice: str | list, mode: str | None):
        """A blend in the `voice` field (docs/voices.md): each name resolved as a voice of its own."""

        try:
            pairs = parse_members(voice, "voice")
            if len(pairs) > 1:  # the weights, before any voice is loaded
                normalise_weights([w for _, w in pairs], "voice")
        except ValueError as e:
            raise ApiError(400, str(e), "voice", "invalid_value") from None
        voices = [await self.one_voice(name) for name, _ in pairs]
        if len(voices) == 1:
            return voices[0]
        weights = None if pairs[0][1] is None else [w for _, w in pairs]
        try:
            return Blend.make(voices, weights, mode or "mixture", [n for n, _ in pairs])
        except ValueError as e:  # all weights 0, some given and some not
            raise ApiError(400, str(e).replace("the blend", "voice"), "voice", "invalid_value") from None

    async def one_voice(self, voice: str | VoiceRef | None):
        name = voice.id if isinstance(voice, VoiceRef) else voice
        if name is None or name.lower() in OPENAI_VOICES and self.store.find(name) is None:
            name = self.default_voice  # no voice named, or a stock client's "alloy": the server's default voice
        if name.lower() == DEFAULT:  # zero-shot, always, when named
            return None
        try:
            return await asyncio.to_thread(self.store.get, name)
        except UnknownVoice as e:
            raise ApiError(400, str(e), "voice", "voice_not_found") from None
        except VoiceError as e:
            raise ApiError(400, str(e), "voice", "invalid_voice") from None

    async def inline_voice(self, ref):
        """A reference sent in the speech request itself (Boson's ref_audio, sglang-omni's references): the voice,
        made once per clip and transcript (the model's voice cache keeps it)."""
        try:
            wav, sr = await asyncio.to_thread(read_upload_audio, ref.audio)
        except ApiError as e:
            raise ApiError(400, e.message.replace("uploaded audio", "reference audio"), ref.param, e.code) from None
        async with self.voice_lock:
            try:
                return await asyncio.to_thread(self.tts.make_voice, (wav, sr), ref.text)
            except ContractError as e:
                raise self.contract_error(e, {"ref_text": "ref_text"}) from None
            except ValueError as e:
                raise ApiError(400, str(e), ref.param, "invalid_value") from None

    async def inline_blend(self, refs: list, mode: str | None):
        """sglang-omni's `references` with several entries: each made a voice, blended by their `weight`."""

        voices = [await self.inline_voice(ref) for ref in refs]
        weights = None if all(ref.weight is None for ref in refs) else [ref.weight for ref in refs]
        try:
            return Blend.make(voices, weights, mode or "mixture", [f"references[{i}]" for i in range(len(refs))])
        except ValueError as e:
            raise ApiError(400, str(e).replace("the blend", "references"), "references", "invalid_value") from None

    def check_model(self, r: OutputFields) -> None:
        if r.model not in self.models:
            raise ApiError(400, f"model {r.model!r} is not served here; use one of {', '.join(self.models)}", "model",
                           "model_not_found")

    def check_output(self, r: OutputFields) -> GenerationOptions:
        """The formats and the sampling fields of a body (its model checked first); its options, or ApiError."""
        self.check_model(r)
        if r.response_format not in FORMATS:
            raise ApiError(400, f"response_format {r.response_format!r} is not supported; use one of "
                           f"{', '.join(FORMATS)}", "response_format", "unsupported_format")
        if r.stream_format not in ("audio", "sse"):
            raise ApiError(400, f"stream_format {r.stream_format!r} is not supported; use audio or sse",
                           "stream_format", "invalid_value")
        return self.job_options(r, SAMPLING, "http").generation

    def job_options(self, r, names, door: str) -> SpeechOptions:
        """The job's options from the body's fields `names` (`job.options`: bounds and rules defined once)."""
        return self.optioned(SpeechOptions.build, {k: getattr(r, k) for k in names}, door, self.base)

    def check_speech(self, r: SpeechRequest, door: str = "http") -> tuple[SpeechJob, Prepared]:
        """The job (`job.run.SpeechJob`: its options, its lead) and what the model reads of the input; ApiError for
        the first bad field (a field `door` cannot honour is refused by name)."""
        self.check_model(r)
        if not r.input.strip():
            raise ApiError(400, "input is empty: give the text to speak", "input", "invalid_value")
        if len(r.input) > MAX_INPUT_CHARS:
            raise ApiError(400, f"input is {len(r.input)} characters long; the limit is {MAX_INPUT_CHARS} (an input "
                           f"beyond one request is read in pieces, up to that)", "input", "string_above_max_length")
        job = self.check_job(r, door)
        return job, self.optioned(job.prepare, r.input)

    def check_job(self, r, door: str) -> SpeechJob:
        """The job of a body's fields (its formats and options; no input: a stream's session config)."""
        self.check_output(r)
        return self.speech_job(self.job_options(r, JOB_FIELDS, door), door)

    def speech_job(self, options: SpeechOptions, door: str) -> SpeechJob:
        """The job of `options` at `door` on this model (its lead made once); ApiError for instructions it cannot
        map."""
        return self.optioned(SpeechJob, options, self.tts.tokens.control_tags, door)

    def speech_session(self, voice, options, prefix: str = "", read=None) -> SpeechSession:
        """A session of the scheduler for a stream's segments (`textstream.SpeechSession`): the streaming doors'
        one way to speak."""
        return SpeechSession(self.scheduler, voice, options, prefix=prefix, read=read)

    @staticmethod
    def optioned(call, *args):
        """`call(*args)`, an `OptionError` as the 400 that names its field."""
        try:
            return call(*args)
        except OptionError as e:
            raise ApiError(400, e.message, e.param, e.code) from None

    async def opening(self, job, chunks: AsyncIterator, request: Request):
        """`first_chunk`, with its failures as the error response (no audio was sent yet); `Gone`: the client
        left."""
        try:
            return await self.first_chunk(job, chunks, request)
        except ConnectionAbortedError:
            raise Gone from None
        except Exception as e:  # noqa: BLE001 - failed before any audio: a proper error response
            log.error("request %s failed before its first audio: %s: %s", job.id, type(e).__name__, e)
            raise self.failure(e) from None

    async def clone_voice(self, codes, text: str):
        """A voice from a zero-shot piece's own codes (a restart of its context speaks in the voice it chose)."""
        async with self.voice_lock:
            return await asyncio.to_thread(self.tts.voice_from_codes, codes, text)

    async def first_chunk(self, job, chunks: AsyncIterator, request: Request):
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

    def failure(self, e: Exception) -> ApiError:
        if isinstance(e, ContractError):
            return self.contract_error(e)
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

    def contract_error(self, e: ContractError, params: dict[str, str] | None = None) -> ApiError:
        """The contract's own answer: its status (400 or 413), field and code; `params` renames fields."""
        param = (params or {}).get(e.param, e.param)
        return ApiError(e.status, str(e), param, e.code)

    async def dry_run(self, given: str, text: str, tag: str | None, voice, options, pieces,
                      reading: Reading | None = None) -> dict:
        """`"dry_run": true`: what the model would read and each request's prompt, checked by the contract as the
        real request is (a piece as a request of its own), as JSON; nothing is generated. `steps`: the text after
        each text step that ran (docs/text.md); `lead`: the tags every request starts with."""
        from .pieces import piece_options

        def one(read: str, opts) -> dict:
            try:
                req = self.tts.request(read, voice=voice, options=opts, slot=self.scheduler.slot_positions)
            except ContractError as e:
                raise self.contract_error(e, {"ref_text": "voice"}) from None
            except ValueError as e:
                raise ApiError(400, str(e), "input", "invalid_value") from None
            return self.tts.prompt_figures(read, req)

        lead = tag or ""
        parts = None
        if pieces is not None:
            parts = [{"index": i, "text": p.text, **await asyncio.to_thread(one, lead + p.text,
                                                                             piece_options(options, lead + p.text))}
                     for i, p in enumerate(pieces)]
            whole = {"read": text}
        else:
            whole = await asyncio.to_thread(one, text, options)
        steps = [{"step": name, "text": said} for name, said in (reading.steps if reading else ())]
        return {"object": "speech.dry_run", "input": given, "lead": tag, "steps": steps, **whole, "pieces": parts}

    def read_pieces(self, pieces: list, voice, options, tag: str | None) -> PieceReader:
        """The job of an input read in pieces: one `SpeechSession` speaking them in order (`pieces.PieceReader`).
        Zero-shot, a restart of the context speaks in the first piece's voice (made from its codes)."""

        return PieceReader(SpeechSession(self.scheduler, voice, options), pieces, self.sample_rate, tag,
                           self.clone_voice if voice is None else None)

    def start_job(self, text: str, voice, options, exclusive: bool, retry=None):
        """Submit one job (`retry`: its redraws, `guard.RetryPolicy`); the scheduler's refusals as OpenAI-style
        errors."""
        try:
            return self.scheduler.submit(text, voice=voice, options=options, exclusive=exclusive, retry=retry)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy ({e}); try again shortly", None, "rate_limit_exceeded",
                           {"Retry-After": "1"}) from None
        except ShuttingDown as e:
            raise self.failure(e) from None
        except ContractError as e:  # a stored voice's transcript is checked with the request: it is the voice's
            raise self.contract_error(e, {"ref_text": "voice"}) from None
        except ValueError as e:  # the options came built (job.options names their fields): the text's, here
            raise ApiError(400, str(e), "input", "invalid_value") from None

    def runner(self, request: Request) -> Runner:
        """The job's async driver (`job.run.Runner`) for one request: its jobs on the server's scheduler, cancelled
        when the client leaves."""
        return Runner(self.tts, self.start_job, lambda job: self.collect(job, request),
                      lambda job, chunks: self.opening(job, chunks, request), self.sample_rate)

    async def collect(self, job, request: Request) -> list:
        """Every chunk of a job; `Gone` when the client left (the job is cancelled)."""
        done = []
        try:
            async for chunk in job:
                done.append(chunk)
                if await request.is_disconnected():
                    job.cancel()
                    raise Gone
        except Gone:
            raise
        except Exception as e:  # noqa: BLE001 - a take that fails is the request's error
            log.error("request %s failed: %s: %s", job.id, type(e).__name__, e)
            raise self.failure(e) from None
        return done

    async def stream_body(self, job, first, chunks: AsyncIterator, fmt: str, sse: bool, input_chars: int,
                          tag: str | None, takes: list | None = None, level=None,
                          sglang: bool = False, enc=None) -> AsyncIterator[bytes]:
        """The response body. `sse`: OpenAI's speech.audio.delta / speech.audio.done events, or (`sglang`: `stream:
        true` with `stream_format: "sse"`) sglang-omni's audio.speech.chunk objects, the last with finish_reason
        and usage, then `data: [DONE]`. A long input's `captions.Cue`s among the chunks become
        `audio.speech.piece.start` / `audio.speech.piece` events in both (each after the audio before it); the audio
        formats leave them out. `enc`: the audio's encoder (default: `fmt`'s at the model's rate)."""
        index = itertools.count()

        def event(obj: dict) -> bytes:
            return f"data: {json.dumps(obj)}\n\n".encode()

        def chunk_event(data: bytes | None, finish: str | None = None, usage: dict | None = None) -> dict:
            audio = None if data is None else {"data": base64.b64encode(data).decode(), "format": fmt,
                                                "mime_type": FORMATS[fmt].media_type, "sample_rate": self.sample_rate}
            return {"id": f"speech-{job.id}", "object": "audio.speech.chunk", "index": next(index), "audio": audio,
                    "finish_reason": finish, **({"usage": usage} if usage is not None else {})}

        def out(data: bytes) -> bytes:
            if not sse or not data:
                return data
            if sglang:
                return event(chunk_event(data))
            return event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

        enc, stats, chunk, cues = enc or encoder(fmt, self.sample_rate), None, first, []
        try:
            while chunk is not None:
                if isinstance(chunk, Cue):
                    if sse:
                        yield event(chunk.event(f"speech-{job.id}", self.sample_rate))
                    if chunk.end is not None:
                        cues.append(chunk.as_dict(self.sample_rate))
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
            err = self.failure(e)
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

    def saved_voices(self) -> list[dict]:
        """The listing entries of the saved voices (`VoiceStore.describe`); one deleted meanwhile is left out."""
        out = []
        for name in self.store.names():
            try:
                out.append(self.store.describe(name))
            except FileNotFoundError:
                continue
        return out

    def model_entry(self, mid: str) -> dict:
        return {"id": mid, "object": "model", "created": int(self.started), "owned_by": "higgs-onnx",
                **({"parent": self.model_id} if mid != self.model_id else {})}
