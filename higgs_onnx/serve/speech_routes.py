"""`POST /v1/audio/speech`: OpenAI's speech request (and Boson's and sglang-omni's shapes)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from ..generation.contract import ContractError
from ..job.options import Shape
from ..job.run import Gone
from .formats import FORMATS
from .http import (
    ApiError,
    JobResponse,
    SpeechRequest,
    media_type,
    read_form,
    read_json,
    validation_message,
)
from .pieces import plan_pieces
from .service import SpeechService
from .shapes import ShapeError, normalise

log = logging.getLogger(__name__)


def router(svc: SpeechService) -> APIRouter:
    router = APIRouter()

    @router.post("/audio/speech")
    async def speech(request: Request):
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
        # off the event loop: the text steps (normalize, markdown, the lexicon) read up to the input bound
        job, ready = await asyncio.to_thread(svc.check_speech, r)
        options, sse = job.options.generation, r.stream_format == "sse"
        if r.stream and r.stream_format == "audio" and r.response_format != "pcm":
            raise ApiError(400, f"stream: true sends raw PCM: it needs response_format 'pcm', got "
                           f"{r.response_format!r} (every format streams here without it)", "stream", "invalid_value")
        svc.optioned(job.check, Shape(words=sse))  # what is known before a voice is made
        job_opts, voice = job.options, await svc.job_voice(inline, r)
        if r.model_extra:
            log.info("ignored fields: %s", ", ".join(sorted(r.model_extra)))
        try:  # an input beyond one request: read in pieces (serve/pieces.py); None: one request, as ever
            pieces = await asyncio.to_thread(plan_pieces, svc.tts, svc.scheduler.slot_positions, ready.reading.text,
                                             ready.tag, voice, options)
        except ContractError as e:
            raise svc.contract_error(e, {"ref_text": "voice"}) from None
        except ValueError as e:
            raise ApiError(400, str(e), "input", "invalid_value") from None
        svc.optioned(job.check, Shape(pieces=len(pieces or ()), voices=getattr(voice, "width", 1), words=sse))
        if job_opts.dry_run:
            return await svc.dry_run(r.input, ready.text, ready.tag, voice, options, pieces, ready.reading)
        read_pieces = (lambda: svc.read_pieces(pieces, voice, options, ready.tag)) if pieces else None
        try:
            made = await svc.runner(request).run(job_opts, ready, voice, read_pieces)
        except Gone:
            return Response(status_code=499)
        first, chunks, takes, level = made.first, made.rest, made.takes, made.level
        if first is None:  # ended without a chunk and without an error: never a 200 with no audio
            log.error("request %s ended without audio", made.job.id)
            raise ApiError(500, "the generation ended without audio; no audio to send", None, "no_audio")
        job, tag = made.job, ready.tag
        body = svc.stream_body(job, first, chunks, r.response_format, sse, len(r.input), tag, takes, level,
                           sglang=sse and r.stream)
        fmt = FORMATS[r.response_format]
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": str(job.id)}
        if r.response_format == "pcm":  # what sglang-omni's raw PCM stream says of itself
            headers.update({"X-Sample-Rate": str(svc.sample_rate), "X-Channels": "1", "X-Bit-Depth": "16"})
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

    return router
