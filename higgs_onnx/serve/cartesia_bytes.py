"""Cartesia's bytes endpoint, `POST /tts/bytes`: one transcript in, its audio back as it is made. What LiveKit's
`livekit-plugins-cartesia` sends for `TTS.synthesize()` (its `stream()` speaks the WebSocket door,
serve/streams/cartesia.py), and Cartesia's own SDKs for their `tts.bytes` (docs/agents.md).

The JSON body, as LiveKit's plugin 1.8.9 sends it:

    {"model_id": "sonic-3", "transcript": "...", "voice": {"mode": "id", "id": NAME},
     "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000},
     "language": "en", "generation_config": {"speed": 1.2}}

with the headers `X-API-Key` (or `Authorization: Bearer`) and `Cartesia-Version` (any version: the body is read the
same). `output_format`: `raw` PCM, 16-bit or 32-bit float little-endian (`pcm_s16le`, `pcm_f32le`) at any rate of
`streams.pcm.RATES`, resampled as it comes; `wav` (16-bit) and `mp3` (64 kbit/s) as `serve.formats` makes them, at the
model's rate. `voice.id` is a saved voice's name, `default` (zero-shot) or one of OpenAI's names, as at every door;
`model_id` one of the server's model names or any of Cartesia's (`sonic...`). Every other field, and every value this
model has no place for (`voice.mode` embedding, `generation_config.emotion`, `pronunciation_dict_id` ...), is refused
by its Cartesia name, never accepted and ignored.

The job is the options table's door `cartesia_bytes` (`job.options.AGENT_FIELDS`: `voice.id`, `generation_config.speed`,
`language`), run as `POST /v1/audio/speech` runs one (`speech_routes.planned`, `produced`): a long transcript is read
in pieces, the audio streams as it is made, a client that leaves cancels it. Errors are this server's OpenAI-shaped
body with the field's Cartesia name as `param`.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..job.options import AGENT_FIELDS, OptionError, SpeechOptions
from .formats import FORMATS
from .http import ApiError, JobResponse, read_json
from .limits import MAX_INPUT_CHARS
from .service import SpeechService
from .speech_routes import planned, produced
from .streams.agent import key_of
from .streams.cartesia import check_generation, check_model, check_output, check_voice
from .streams.engine import Refused
from .streams.pcm import PcmStream

DOOR = "cartesia_bytes"
FIELDS = ("transcript", "model_id", "voice", "output_format", "language", "generation_config")
# our fields' names in this door's errors: the options table's (`AGENT_FIELDS`), and the input is the transcript
NAMES = {"input": "transcript", **AGENT_FIELDS[DOOR]}


def bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def check_body(body: dict, svc: SpeechService) -> tuple[str, str, dict, dict]:
    """(transcript, voice name, the job's fields by our names, the output format) of a body; ApiError naming the
    first field it refuses (Cartesia's fields are checked as its socket checks them: streams/cartesia.py)."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise bad(f"{unknown[0]} is not a field of Cartesia's bytes endpoint here; the fields are "
                  f"{', '.join(FIELDS)}", unknown[0], "unknown_parameter")
    transcript = body.get("transcript")
    if not isinstance(transcript, str) or not transcript.strip():
        raise bad(f"transcript must be the text to speak, got {transcript!r:.40}", "transcript")
    if len(transcript) > MAX_INPUT_CHARS:
        raise bad(f"transcript is {len(transcript)} characters long; the limit is {MAX_INPUT_CHARS}", "transcript",
                  "string_above_max_length")
    try:
        check_model(body.get("model_id"), svc)
        name = check_voice(body.get("voice"))
        values = {"voice": name, **check_generation(body.get("generation_config")),
                  "caption_language": body.get("language")}
        container, output = check_output(body.get("output_format"), svc.sample_rate)
    except Refused as e:
        raise bad(e.message, e.param, e.code) from None
    if container == "raw":
        return transcript, name, values, {"fmt": "pcm", "enc": PcmStream(output, svc.sample_rate), "output": output}
    return transcript, name, values, {"fmt": container, "enc": None, "output": output}


def renamed(e: ApiError) -> ApiError:
    """An error of the shared job path with its field under this door's name (`input` is the `transcript`)."""
    e.param = NAMES.get(e.param, e.param)
    return e


def router(svc: SpeechService) -> APIRouter:
    router = APIRouter()

    @router.post("/tts/bytes")
    async def tts_bytes(request: Request):
        if (e := svc.refusal(key_of(request, "x-api-key", "api_key"), True)) is not None:
            raise e
        body = await read_json(request)
        transcript, name, values, out = check_body(body, svc)
        try:
            def job_of():  # off the loop: the text steps may load a lexicon or a normalizer
                try:
                    options = SpeechOptions.build(values, DOOR, svc.base)
                except OptionError as e:  # its message names the field as this door does; `renamed`, its param
                    raise bad(e.message, e.param, e.code) from None
                job = svc.speech_job(options, DOOR)
                return job, svc.optioned(job.prepare, transcript)

            job, ready = await asyncio.to_thread(job_of)
            voice = await svc.resolve_voice(name)
            pieces = await planned(svc, job, ready, voice, False)
            made = await produced(svc, request, job, ready, voice, pieces)
        except ApiError as e:
            raise renamed(e) from None
        if made is None:
            return Response(status_code=499)
        body = svc.stream_body(made.job, made.first, made.rest, out["fmt"], False, len(transcript), ready.tag,
                               enc=out["enc"])
        output = out["output"]
        headers = {"Cache-Control": "no-cache", "X-Request-Id": str(made.job.id)}
        if out["fmt"] != "mp3":
            headers.update({"X-Sample-Rate": str(output.rate), "X-Channels": "1", "X-Encoding": output.encoding})
        return JobResponse(made.job, body, media_type=FORMATS[out["fmt"]].media_type, headers=headers)

    return router
