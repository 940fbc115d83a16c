"""The text-in WebSocket `/v1/audio/speech/stream` (sglang-omni's message names; docs/integrations.md)."""

from __future__ import annotations

import asyncio
import functools
import logging

from fastapi import APIRouter, WebSocket
from pydantic import ValidationError

from ..generation.contract import ContractError, check_max_rows
from ..job.options import Shape
from .http import (
    WS_FIELDS,
    WS_ONLY,
    ApiError,
    SpeechRequest,
    validation_message,
)
from .service import SpeechService
from .shapes import ShapeError, normalise
from .streams.speech import ConfigError, SpeechSocket
from .streams.websocket import serve

log = logging.getLogger(__name__)


def router(svc: SpeechService) -> APIRouter:
    router = APIRouter()

    @router.websocket("/v1/audio/speech/stream")
    async def speech_stream(ws: WebSocket):
        if (e := svc.refusal(ws.headers, True)) is not None:  # closed before the session starts (code 1008)
            await ws.close(1008, e.message[:120])
            return
        await ws.accept()

        async def configure(cfg: dict):
            """(format, options, voice, (lead, text steps, words)) from a session.config; ConfigError for the first
            field that is bad or that this door cannot honour (`job.options`: refused by name, never ignored)."""

            body = {"model": svc.model_id, **{k: v for k, v in cfg.items() if k not in WS_ONLY}}
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
                job = await asyncio.to_thread(svc.check_job, r, "websocket")  # off the loop (a lexicon file)
                job_opts = job.options
                try:  # what the contract knows of max_rows before any text: here, not at every segment
                    check_max_rows(job_opts.generation.max_rows, svc.tts.facts.num_codebooks,
                                   svc.tts.limits(svc.scheduler.slot_positions))
                except ContractError as e:
                    raise ConfigError(str(e), e.param, e.code) from None
                if isinstance(inline, list):
                    raise ConfigError("references: a blend of several references is not supported on the text-in "
                                      "WebSocket (it continues one KV context across segments); send one reference",
                                      "references", "unsupported_parameter")
                voice = await svc.job_voice(inline, r)  # blend_mode: refused by the table above
                svc.optioned(job.check, Shape(voices=getattr(voice, "width", 1), continues=True))  # job.options.RULES
                words = job_opts.caption_language if job_opts.caption_level == "word" else None
                return r.response_format, job_opts.generation, voice, (job.lead, job.reader(), words)
            except ValidationError as e:
                message, param = validation_message(e)
                raise ConfigError(message, param, "invalid_value") from None
            except ShapeError as e:
                raise ConfigError(str(e), e.param, e.code) from None
            except ApiError as e:
                raise ConfigError(e.message, e.param, e.code) from None

        await serve(ws, functools.partial(SpeechSocket, configure=configure, make_session=svc.speech_session), svc,
                    svc.ws_idle_s, shape='a message is a JSON object with a "type"', keyed="type")

    return router
