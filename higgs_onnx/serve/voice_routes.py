"""Saved voices: OpenAI-style `/v1/voices`, Boson's `/v1/audio/voices`, and Open WebUI's list."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from ..generation.contract import ContractError, min_rows
from .http import (
    OPENAI_VOICES,
    ApiError,
    is_json_type,
    limited,
    media_type,
    read_json,
    read_upload_audio,
)
from .limits import (
    MAX_UPLOAD_BYTES,
)
from .service import SpeechService
from .shapes import InlineReference as InlineRef
from .shapes import ShapeError, decode_audio_field
from .voices import DEFAULT, UnknownVoice, VoiceError, VoiceExists, check_languages, check_name

log = logging.getLogger(__name__)


def router(svc: SpeechService) -> APIRouter:
    router = APIRouter()

    @router.get("/audio/voices")
    async def audio_voices():
        saved = svc.saved_voices()
        names = [DEFAULT, *(v["id"] for v in saved)]
        data = [{"voice": v["id"], "id": v["id"], "created_at": v["created"]} for v in saved]  # Boson's list shape
        default = svc.default_voice
        return {"object": "list", "voices": [{"id": n, "name": n + (" (server default)" if n == default else "")}
                                             for n in names], "data": data,
                "default": default, "aliases": {v: default for v in OPENAI_VOICES if svc.store.find(v) is None}}

    @router.post("/audio/voices")
    async def create_audio_voice(request: Request):
        """Boson's voice creation: JSON {ref_audio (base64 or data: URI), ref_text, description?} -> a saved voice
        whose id is derived from the clip ("voice_" + its sha256's first 32 hex digits): the same clip gives the same
        id (201 when new, 200 when it exists)."""
        import hashlib

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
        if svc.store.find(vid) is not None:
            entry = svc.store.describe(vid)
            return JSONResponse({"voice": vid, "ref_text": ref_text, "description": description,
                                 "created_at": entry["created"]}, 200)
        voice = await svc.inline_voice(InlineRef(audio, ref_text.strip(), "ref_audio"))
        try:
            entry = await asyncio.to_thread(svc.store.add, vid, voice)
        except VoiceExists:  # made meanwhile by the same clip
            entry = svc.store.describe(vid)
        return JSONResponse({"voice": vid, "ref_text": ref_text, "description": description,
                             "created_at": entry["created"]}, 201)

    @router.get("/voices")
    async def list_voices():
        return {"object": "list", "data": [{"id": DEFAULT, "object": "voice", "created": int(svc.started)},
                                           *svc.saved_voices()]}

    @router.post("/voices", status_code=201)
    async def create_voice(request: Request):
        ctype = request.headers.get("content-type", "")
        if is_json_type(ctype):  # Boson's shape: {ref_audio, ref_text, description}
            return await create_audio_voice(request)
        if media_type(ctype)[0] != "multipart/form-data":
            raise ApiError(400, "upload a voice as multipart/form-data with the fields name, file (reference audio), "
                           "transcript and languages (both optional), or as JSON {ref_audio, ref_text} (Boson's shape)",
                           code="invalid_content_type")
        stream = limited(request.stream(), MAX_UPLOAD_BYTES, "the upload")
        try:
            form = await MultiPartParser(request.headers, stream, max_files=1, max_fields=8).parse()
        except MultiPartException as e:
            raise ApiError(400, f"malformed multipart body: {e.message}", code="invalid_multipart") from None
        try:
            name, file, transcript = form.get("name"), form.get("file"), form.get("transcript")
            languages = form.get("languages")
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
            if languages is not None and not isinstance(languages, str):
                raise ApiError(400, "languages must be text: language codes separated by commas, e.g. en,de",
                               "languages", "invalid_value")
            try:  # the languages the voice is offered for (Wyoming's describe); none: the server's
                languages = check_languages(languages or ())
            except VoiceError as e:
                raise ApiError(400, str(e), "languages", "invalid_value") from None
            if (taken := svc.store.find(name)) is not None:
                raise ApiError(409, svc.store.exists_message(name, taken), "name", "voice_exists")
            data = await file.read()
        finally:
            await form.close()
        wav, sr = await asyncio.to_thread(read_upload_audio, data)
        what = "transcript" if transcript else "file"
        async with svc.voice_lock:
            try:
                voice = await asyncio.to_thread(svc.tts.make_voice, (wav, sr), transcript)
            except ContractError as e:  # a special token in the transcript, a prompt beyond the context
                raise svc.contract_error(e, {"ref_text": "transcript"}) from None
            except ValueError as e:
                raise ApiError(400, str(e), "transcript" if "transcript" in str(e) else "file",
                               "invalid_value") from None
        room = svc.scheduler.slot_positions - len(voice.prefix)
        if room < min_rows(svc.tts.facts.num_codebooks) + 3:  # + <|text|>, one token, <|audio|>
            raise ApiError(400, f"the voice's prompt is {len(voice.prefix)} positions ({len(voice.rows)} reference "
                           f"rows{' and its transcript' if transcript else ''}), but a batch slot here holds "
                           f"{svc.scheduler.slot_positions}: use a shorter reference clip or transcript", what,
                           "context_length_exceeded")
        try:
            return JSONResponse(await asyncio.to_thread(svc.store.add, name, voice, languages), 201)
        except VoiceExists as e:
            raise ApiError(409, str(e), "name", "voice_exists") from None

    @router.delete("/voices/{name}")
    async def delete_voice(name: str):
        if name.lower() == DEFAULT:
            raise ApiError(400, f"the voice {name!r} is built in (zero-shot speech, no reference) and cannot be "
                           f"deleted", "name", "reserved_voice")
        try:
            loaded = await asyncio.to_thread(svc.store.delete, name)
            if loaded is not None:
                svc.tts.forget_voice(loaded)  # its prefill state leaves memory once no request uses it
        except UnknownVoice as e:
            raise ApiError(404, str(e), "name", "voice_not_found") from None
        except VoiceError as e:
            raise ApiError(400, str(e), "name", "invalid_value") from None
        return {"id": name, "object": "voice", "deleted": True}

    return router
