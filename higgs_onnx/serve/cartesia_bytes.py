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
from .streams.cartesia import MODEL_PREFIX
from .streams.engine import Refused
from .streams.pcm import Output, PcmStream

DOOR = "cartesia_bytes"
FIELDS = ("transcript", "model_id", "voice", "output_format", "language", "generation_config")
CONTAINERS = ("raw", "wav", "mp3")
MP3_BIT_RATE = 64000  # serve.formats' MP3 (64 kbit/s CBR)
# our fields' names in this door's errors: the options table's (`AGENT_FIELDS`), and the input is the transcript
NAMES = {"input": "transcript", **AGENT_FIELDS[DOOR]}


def bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def obj(body: dict, name: str, what: str) -> dict:
    """The body's object `name` ({} when left out or null); ApiError naming it when it is not an object."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(f"{name} must be an object {what}, got {value!r:.40}", name)
    return value


def only(value: dict, name: str, allowed: tuple[str, ...], why: str) -> None:
    """Refuse the first key of `value` outside `allowed`, by its dotted name."""
    extra = sorted(set(value) - set(allowed))
    if extra:
        raise bad(f"{name}.{extra[0]} is not served here: {why}", f"{name}.{extra[0]}", "unsupported_parameter")


def check_body(body: dict, svc: SpeechService) -> tuple[str, str, dict, dict]:
    """(transcript, voice name, the job's fields by our names, the output format) of a body; ApiError naming the
    first field it refuses."""
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
    model = body.get("model_id")
    if model is not None and (not isinstance(model, str) or model not in svc.models
                              and not model.startswith(MODEL_PREFIX)):
        raise ApiError(400, f"model_id {model!r:.60} is not served here; use one of {', '.join(svc.models)} (or a "
                       f"Cartesia model name: all are this model)", "model_id", "model_not_found")
    voice = obj(body, "voice", '{"mode": "id", "id": NAME}')
    if voice.get("mode", "id") != "id":
        raise bad(f"voice.mode {voice.get('mode')!r:.40} is not served here: a voice is a saved voice named by id "
                  f'({{"mode": "id", "id": NAME}})', "voice.mode", "unsupported_parameter")
    only(voice, "voice", ("mode", "id"), 'a voice is a saved voice named by id ({"mode": "id", "id": NAME})')
    name = voice.get("id", "default")
    if not isinstance(name, str) or not name.strip():
        raise bad(f"voice.id must be a voice's name, got {name!r:.40}", "voice.id")
    gen = obj(body, "generation_config", "{speed}")
    only(gen, "generation_config", ("speed",), "this model has no such control (its emotions are inline tags in "
         "the transcript, docs/text.md)")
    values = {"voice": name, "speed": gen.get("speed"), "caption_language": body.get("language")}
    return transcript, name, values, check_format(obj(body, "output_format", "{container, encoding, sample_rate}"),
                                                  svc.sample_rate)


def check_format(fmt: dict, native: int) -> dict:
    """The output: {"fmt": a key of FORMATS, "enc": a raw PCM encoder or None (the format's own)}."""
    container = fmt.get("container", "raw")
    if container not in CONTAINERS:
        raise bad(f"output_format.container {container!r:.40} is not served here; use one of "
                  f"{', '.join(CONTAINERS)}", "output_format.container", "unsupported_format")
    keys = ("container", "sample_rate", "bit_rate") if container == "mp3" else ("container", "encoding",
                                                                                 "sample_rate")
    only(fmt, "output_format", keys, f"a {container} output takes {', '.join(keys)}")
    rate, encoding = fmt.get("sample_rate", native), fmt.get("encoding", "pcm_s16le")
    try:
        out = Output.check(encoding if container != "mp3" else "pcm_s16le", rate, native,
                           ("output_format.encoding", "output_format.sample_rate"))
    except Refused as e:
        raise bad(e.message, e.param, e.code) from None
    if container == "raw":
        return {"fmt": "pcm", "enc": PcmStream(out, native), "output": out}
    if out.rate != native:
        raise bad(f"output_format.sample_rate {rate}: {container} is made at the model's rate, {native} (raw PCM is "
                  f"resampled to any of the rates)", "output_format.sample_rate", "unsupported_format")
    if container == "wav" and encoding != "pcm_s16le":
        raise bad(f"output_format.encoding {encoding!r:.40}: wav here is 16-bit (pcm_s16le); raw PCM can be "
                  f"pcm_f32le", "output_format.encoding", "unsupported_format")
    if container == "mp3" and fmt.get("bit_rate", MP3_BIT_RATE) != MP3_BIT_RATE:
        raise bad(f"output_format.bit_rate {fmt.get('bit_rate')!r:.40}: MP3 here is {MP3_BIT_RATE} bit/s",
                  "output_format.bit_rate", "unsupported_format")
    return {"fmt": container, "enc": None, "output": out}


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
