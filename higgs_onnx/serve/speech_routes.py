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
        inline, r = await read_speech(request)
        # off the event loop: the text steps (normalize, markdown, the lexicon) read up to the input bound
        job, ready = await asyncio.to_thread(svc.check_speech, r)
        options, sse = job.options.generation, r.stream_format == "sse"
        if r.stream and r.stream_format == "audio" and r.response_format != "pcm":
            raise ApiError(400, f"stream: true sends raw PCM: it needs response_format 'pcm', got "
                           f"{r.response_format!r} (every format streams here without it)", "stream", "invalid_value")
        svc.optioned(job.check, Shape(words=sse))  # what is known before a voice is made
        voice = await svc.job_voice(inline, r)
        if r.model_extra:
            log.info("ignored fields: %s", ", ".join(sorted(r.model_extra)))
        pieces = await planned(svc, job, ready, voice, sse)
        if job.options.dry_run:
            return await svc.dry_run(r.input, ready.text, ready.tag, voice, options, pieces, ready.reading)
        made = await produced(svc, request, job, ready, voice, pieces)
        if made is None:
            return Response(status_code=499)
        body = svc.stream_body(made.job, made.first, made.rest, r.response_format, sse, len(r.input), ready.tag,
                               made.takes, made.level, sglang=sse and r.stream)
        return JobResponse(made.job, body, media_type="text/event-stream" if sse else FORMATS[r.response_format]
                           .media_type, headers=speech_headers(r, made, pieces, svc.sample_rate))

    return router


async def planned(svc: SpeechService, job, ready, voice, words: bool) -> list | None:
    """The input's pieces when it does not fit one request (serve/pieces.py; None: one request, as ever), and the
    rules between the job's fields checked with its shape (pieces, a blend's voices, a place for `words`)."""
    options = job.options.generation
    try:
        pieces = await asyncio.to_thread(plan_pieces, svc.tts, svc.scheduler.slot_positions, ready.reading.text,
                                         ready.tag, voice, options)
    except ContractError as e:
        raise svc.contract_error(e, {"ref_text": "voice"}) from None
    except ValueError as e:
        raise ApiError(400, str(e), "input", "invalid_value") from None
    svc.optioned(job.check, Shape(pieces=len(pieces or ()), voices=getattr(voice, "width", 1), words=words))
    return pieces


async def produced(svc: SpeechService, request: Request, job, ready, voice, pieces):
    """The job run by its policy (job.run.Runner: takes, redraws, loudness, word timing) up to its first audio:
    what a speech response streams; None when the client left first. Every door that answers one text with its
    audio over HTTP (POST /v1/audio/speech, Cartesia's /tts/bytes) runs its job here."""
    read_pieces = (lambda: svc.read_pieces(pieces, voice, job.options.generation, ready.tag)) if pieces else None
    try:
        made = await svc.runner(request).run(job.options, ready, voice, read_pieces)
    except Gone:
        return None
    if made.first is None:  # ended without a chunk and without an error: never a 200 with no audio
        log.error("request %s ended without audio", made.job.id)
        raise ApiError(500, "the generation ended without audio; no audio to send", None, "no_audio")
    return made


async def read_speech(request: Request):
    """(the inline references, the `SpeechRequest`) of a JSON or multipart body; ApiError for a bad one."""
    if media_type(request.headers.get("content-type", ""))[0] == "multipart/form-data":
        body = await read_form(request)
    else:
        body = await read_json(request)
    try:
        inline = normalise(body)  # Boson's and sglang-omni's fields (serve/shapes.py)
    except ShapeError as e:
        raise ApiError(400, str(e), e.param, e.code) from None
    try:
        return inline, SpeechRequest.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(400, message, param, "invalid_value") from None


def speech_headers(r: SpeechRequest, made, pieces, sample_rate: int) -> dict:
    """What a speech response says of itself in its headers."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": str(made.job.id)}
    if r.response_format == "pcm":  # what sglang-omni's raw PCM stream says of itself
        headers.update({"X-Sample-Rate": str(sample_rate), "X-Channels": "1", "X-Bit-Depth": "16"})
    if pieces:
        headers["X-Pieces"] = str(len(pieces))
    if r.model_extra:  # other servers' fields, which clients written for them send: named, never silent
        headers["X-Ignored-Fields"] = ",".join(sorted(r.model_extra))[:512]
    if made.level is not None and made.level.reached is not None:
        headers["X-Loudness"] = f"{made.level.reached:.1f}"
    if made.takes:
        kept = next((t for t in made.takes if t.get("kept")), made.takes[-1])  # best of n: kept; retries: the last
        headers.update({"X-Takes": str(len(made.takes)), "X-Verdict": kept["verdict"]})
    return headers
