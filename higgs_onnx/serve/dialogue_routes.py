"""`POST /v1/audio/dialogue`: several voices, one response (docs/dialogue.md)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from ..generation.contract import ContractError
from ..longform.dialogue import MAX_SPEAKERS
from ..longform.script import ScriptError, check_cast, speakers, turns_from_json
from .dialogue_reader import DialogueReader, check_lines, plan_lines, speaker_options
from .formats import FORMATS
from .http import (
    GONE,
    ApiError,
    DialogueRequest,
    JobResponse,
    read_json,
    validation_message,
)
from .limits import (
    MAX_INPUT_CHARS,
    MAX_PIECES,
)
from .service import SpeechService
from .textstream import SpeechSession

log = logging.getLogger(__name__)


def router(svc: SpeechService) -> APIRouter:
    router = APIRouter()

    @router.post("/audio/dialogue")
    async def dialogue(request: Request):
        body = await read_json(request)
        try:
            r = DialogueRequest.model_validate(body)
        except ValidationError as e:
            message, param = validation_message(e)
            raise ApiError(400, message, param, "invalid_value") from None
        options = svc.check_output(r)
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
                voices[name] = await svc.one_voice(spec)
            except ApiError as e:
                raise ApiError(e.status, f"voices: {name}: {e.message}", "voices", e.code) from None
        lines = plan_lines(turns)
        if len(lines) > MAX_PIECES:
            raise ApiError(400, f"turns are read in {len(lines)} pieces; the limit is {MAX_PIECES}", "turns",
                           "too_many_pieces")
        try:
            await asyncio.to_thread(check_lines, svc.tts, svc.scheduler.slot_positions, lines, voices, options)
        except ContractError as e:
            raise svc.contract_error(e) from None
        sessions = {name: SpeechSession(svc.scheduler, voices[name], speaker_options(options, k))
                    for k, name in enumerate(cast)}
        job = DialogueReader(sessions, lines, svc.sample_rate, svc.clone_voice)
        chunks = aiter(job)
        first = await svc.opening(job, chunks, request)
        if first is GONE:
            return Response(status_code=499)
        sse = r.stream_format == "sse"
        body = svc.stream_body(job, first, chunks, r.response_format, sse, chars, None)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": str(job.id),
                   "X-Pieces": str(len(lines)), "X-Speakers": str(len(cast))}
        return JobResponse(job, body, media_type="text/event-stream" if sse else FORMATS[r.response_format].media_type,
                           headers=headers)

    return router
