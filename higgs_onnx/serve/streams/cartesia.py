"""Cartesia's TTS WebSocket, `GET /tts/websocket`: what Pipecat's `CartesiaTTSService(url=...)` and Cartesia's own
clients speak, on this server's scheduler (docs/agents.md). A codec of the stream
engine (engine.py: contexts, audio, word timing, barge-in).

Client -> server, JSON text frames:
- `{transcript, continue, context_id, model_id, voice: {mode: "id", id}, output_format: {container: "raw",
  encoding: "pcm_s16le" | "pcm_f32le", sample_rate}, add_timestamps, language, generation_config: {speed},
  max_buffer_delay_ms, use_normalized_timestamps: false}`. The first message of a `context_id` opens it; later ones
  must repeat its settings (Cartesia: "inputs on the same context must keep all fields except transcript, continue
  and duration the same") and their transcripts are joined verbatim. `continue` (default false) says more text
  follows; `continue: false` (with any transcript, "" included) ends the context's input: what it holds is spoken,
  then `done`. `flush: true` speaks what it holds now and answers `flush_done` once that is sent. Text held without
  a sentence end is spoken after `max_buffer_delay_ms` (default 3000, at most 5000) with no more.
- `{context_id, cancel: true}`: barge-in. Nothing more is sent for the context, its decoding stops within one
  decoder step and its slot and KV context are freed; the socket's other contexts go on.

Server -> client: `{type: "chunk", data: base64 PCM, context_id, ...}` as the audio is made; with `add_timestamps`,
`{type: "timestamps", word_timestamps: {words, start, end}, context_id}` for each segment once its words are timed
(seconds from the context's first sample; `words_reason` says why a segment has none); `{type: "done"}` once the
context is spoken; `{type: "flush_done", flush_id}`; `{type: "error", error, param, code, context_id}`.

`voice.id` is a saved voice's name, `default` (zero-shot) or one of OpenAI's names (the server's default voice);
`model_id` is one of the server's model names or any of Cartesia's (`sonic...`), all this model. The API key is
`X-API-Key` (Pipecat sends it), `api_key` in the query, or `Authorization: Bearer`.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from ...job.options import OptionError, check_caption_language
from .agent import AgentCodec, accepted, session_of
from .engine import Refused, Stream
from .pcm import Output
from .websocket import serve

SETTINGS = ("model_id", "voice", "output_format", "add_timestamps", "language", "generation_config",
            "max_buffer_delay_ms", "use_normalized_timestamps")
FIELDS = {"transcript", "continue", "context_id", "cancel", "flush", *SETTINGS}
DELAY_MS = (3000, 5000)  # max_buffer_delay_ms: Cartesia's default and its largest
MODEL_PREFIX = "sonic"  # Cartesia's model names (sonic-3.6, sonic-2 ...): all this model
CONTAINERS = ("raw", "wav", "mp3")  # what POST /tts/bytes makes; the socket streams raw PCM
MP3_BIT_RATE = 64000  # serve.formats' MP3 (64 kbit/s CBR)


class Cartesia(AgentCodec):
    name = "cartesia"
    text_field = "transcript"

    # -- answers -----------------------------------------------------------------------------------------
    @staticmethod
    def _base(kind: str, cid: str | None, done: bool = False) -> dict:
        return {"type": kind, "context_id": cid or "", "status_code": 206, "done": done}

    async def audio(self, stream: Stream, seg, data: bytes) -> None:
        await self.engine.send({**self._base("chunk", stream.id), "data": self.b64(data)}, stream)

    async def words(self, stream: Stream, seg, cue) -> None:
        sr = self.engine.native
        words = cue.words or ()
        out = {**self._base("timestamps", stream.id),
               "word_timestamps": {"words": [w.text for w in words], "start": [w.start / sr for w in words],
                                   "end": [w.end / sr for w in words]}}
        if cue.words_reason:
            out["words_reason"] = cue.words_reason
        await self.engine.send(out, stream)

    async def done(self, stream: Stream) -> None:
        await self.engine.send(self._base("done", stream.id, True), stream)

    async def flushed(self, stream: Stream, n: int) -> None:
        await self.engine.send({**self._base("flush_done", stream.id), "flush_done": True, "flush_id": n}, stream)

    @classmethod
    def error(cls, e: Refused) -> dict:
        status = {"server_error": 500, "rate_limit_exceeded": 429, "replica_lost": 503}.get(e.code, 400)
        return {**cls._base("error", e.stream, True), "status_code": status, "error": e.message, "param": e.param,
                "code": e.code}

    # -- messages ----------------------------------------------------------------------------------------
    async def handle(self, msg: dict) -> None:
        engine = self.engine
        cid = engine.check_id(msg.get("context_id"))
        if "cancel" in msg:
            extra = sorted(set(msg) - {"context_id", "cancel"})
            if extra:
                raise Refused(f"{extra[0]}: a cancel carries only context_id and cancel", extra[0],
                              "unknown_parameter", cid)
            return await self.on_cancel(cid, msg)
        unknown = sorted(set(msg) - FIELDS)
        if unknown:
            raise Refused(f"{unknown[0]} is not a field of Cartesia's TTS WebSocket here; the fields are "
                          f"{', '.join(sorted(FIELDS))}", unknown[0], "unknown_parameter", cid)
        transcript, more, flush = msg.get("transcript", ""), msg.get("continue", False), msg.get("flush", False)
        for name, value, kind in (("transcript", transcript, str), ("continue", more, bool), ("flush", flush, bool)):
            if not isinstance(value, kind):
                raise Refused(f"{name} must be {'a string' if kind is str else 'true or false'}, got "
                              f"{value!r:.40}", name, "invalid_value", cid)
        settings = {k: msg.get(k) for k in SETTINGS}
        stream = engine.streams.get(cid)
        if stream is None:
            engine.check_new(cid)
            if not transcript.strip():
                raise Refused(f"context {cid!r:.60} has no text yet: its first message needs a transcript",
                              "transcript", "empty_context", cid)
            stream = await self.open(cid, settings)
        elif stream.ending:
            raise Refused(f"context {cid!r:.60} has ended its input (continue: false); a new turn needs a new "
                          f"context_id", "context_id", "context_closed", cid)
        elif settings != stream.settings:
            name = next(k for k in SETTINGS if settings[k] != stream.settings[k])
            raise Refused(f"{name} is fixed for a context (Cartesia keeps every field but transcript and "
                          f"continue the same); open a new context_id to change it", name,
                          "context_settings_changed", cid)
        if transcript:
            await self.feed(stream, transcript, "transcript")
        if flush:
            engine.flush(stream, marked=True)
        if not more:
            engine.flush(stream, final=True)

    async def on_cancel(self, cid: str, msg: dict) -> None:
        if msg.get("cancel") is not True:
            raise Refused(f"cancel must be true, got {msg.get('cancel')!r:.40}", "cancel", "invalid_value", cid)
        stream = self.engine.streams.get(cid)
        if stream is not None:
            await self.engine.cancel(stream)
        elif cid not in self.engine.ended:  # one that ended has nothing left to stop
            raise Refused(f"no context {cid!r:.60} on this socket to cancel", "context_id", "unknown_context", cid)

    async def open(self, cid: str, s: dict) -> Stream:
        """A context for its first message's settings: checked field by field, each refused by its own name."""
        def fail(message: str, param: str, code: str = "invalid_value"):
            return Refused(message, param, code, cid)

        native = self.engine.native
        try:
            check_model(s["model_id"], self.engine.svc)
            values = {"voice": check_voice(s["voice"]), **check_generation(s["generation_config"])}
            _, output = check_output(s["output_format"], native, ("raw",))
        except Refused as e:
            raise fail(e.message, e.param, e.code) from None
        stamps = s["add_timestamps"] if s["add_timestamps"] is not None else False
        if not isinstance(stamps, bool):
            raise fail(f"add_timestamps must be true or false, got {stamps!r:.40}", "add_timestamps")
        if s["use_normalized_timestamps"] not in (None, False):
            raise fail("use_normalized_timestamps: the words are timed as the transcript writes them (false)",
                       "use_normalized_timestamps", "unsupported_parameter")
        try:  # the caption_language job option's one check (job.options), under the vendor's name
            language = check_caption_language(s["language"] if s["language"] is not None else "en", "language")
        except OptionError as e:
            raise fail(str(e), "language") from None
        delay = s["max_buffer_delay_ms"] if s["max_buffer_delay_ms"] is not None else DELAY_MS[0]
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= DELAY_MS[1]:
            raise fail(f"max_buffer_delay_ms must be a whole number from 0 to {DELAY_MS[1]}, got {delay!r:.40}",
                       "max_buffer_delay_ms")
        values["caption_level"] = "word" if stamps else "piece"
        session, reader = await session_of(self.engine.svc, self.name, values, cid)
        stream = Stream(cid, session, reader, language if stamps else None, delay_s=delay / 1000.0, settings=s)
        stream.state["output"] = output
        return self.engine.open(stream)


# -- Cartesia's fields, checked once for its socket and its bytes endpoint (serve/cartesia_bytes.py) ------------
def _obj(value, name: str, what: str) -> dict:
    """`value` as the object `name` must be ({} when left out or null); Refused naming it otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Refused(f"{name} must be an object {what}, got {value!r:.40}", name)
    return value


def _only(value: dict, name: str, allowed: tuple[str, ...], why: str) -> None:
    """Refuse the first key of `value` outside `allowed`, by its dotted name."""
    extra = sorted(set(value) - set(allowed))
    if extra:
        raise Refused(f"{name}.{extra[0]} is not served here: {why}", f"{name}.{extra[0]}", "unsupported_parameter")


def check_model(model, svc) -> None:
    if model is not None and (not isinstance(model, str) or model not in svc.models
                              and not model.startswith(MODEL_PREFIX)):
        raise Refused(f"model_id {model!r:.60} is not served here; use one of {', '.join(svc.models)} (or a "
                      f"Cartesia model name: all are this model)", "model_id", "model_not_found")


def check_voice(voice) -> str:
    """The saved voice's name `voice` ({"mode": "id", "id": NAME}) names ("default" when left out)."""
    voice = _obj(voice, "voice", '{"mode": "id", "id": NAME}')
    why = 'a voice is a saved voice named by id ({"mode": "id", "id": NAME})'
    if voice.get("mode", "id") != "id":
        raise Refused(f"voice.mode {voice.get('mode')!r:.40} is not served here: {why}", "voice.mode",
                      "unsupported_parameter")
    _only(voice, "voice", ("mode", "id"), why)
    name = voice.get("id", "default")
    if not isinstance(name, str) or not name.strip():
        raise Refused(f"voice.id must be a voice's name, got {name!r:.40}", "voice.id")
    return name


def check_generation(gen) -> dict:
    """The job's fields `generation_config` sets (speed only: this model has no other control)."""
    gen = _obj(gen, "generation_config", "{speed}")
    _only(gen, "generation_config", ("speed",), "this model has no such control (its emotions are inline tags in "
          "the transcript, docs/text.md)")
    return {"speed": gen["speed"]} if gen.get("speed") is not None else {}


def check_output(fmt, native: int, containers: tuple[str, ...] = CONTAINERS) -> tuple[str, Output]:
    """(container, raw PCM output) of an `output_format` {container, encoding, sample_rate} (mp3: bit_rate, not
    encoding); wav and mp3 are made at the model's rate."""
    fmt = _obj(fmt, "output_format", "{container, encoding, sample_rate}")
    container = fmt.get("container", "raw")
    if container not in containers:
        raise Refused(f"output_format.container {container!r:.40} is not served here; use one of "
                      f"{', '.join(containers)}", "output_format.container", "unsupported_format")
    keys = ("container", "sample_rate", "bit_rate") if container == "mp3" else ("container", "encoding",
                                                                                 "sample_rate")
    _only(fmt, "output_format", keys, f"a {container} output takes {', '.join(keys)}")
    rate, encoding = fmt.get("sample_rate", native), fmt.get("encoding", "pcm_s16le")
    out = Output.check(encoding if container != "mp3" else "pcm_s16le", rate, native,
                       ("output_format.encoding", "output_format.sample_rate"))
    if container != "raw" and out.rate != native:
        raise Refused(f"output_format.sample_rate {rate}: {container} is made at the model's rate, {native} (raw PCM "
                      f"is resampled to any of the rates)", "output_format.sample_rate", "unsupported_format")
    if container == "wav" and encoding != "pcm_s16le":
        raise Refused(f"output_format.encoding {encoding!r:.40}: wav here is 16-bit (pcm_s16le); raw PCM can be "
                      f"pcm_f32le", "output_format.encoding", "unsupported_format")
    if container == "mp3" and fmt.get("bit_rate", MP3_BIT_RATE) != MP3_BIT_RATE:
        raise Refused(f"output_format.bit_rate {fmt.get('bit_rate')!r:.40}: MP3 here is {MP3_BIT_RATE} bit/s",
                      "output_format.bit_rate", "unsupported_format")
    return container, out


def router(svc) -> APIRouter:
    router = APIRouter()

    @router.websocket("/tts/websocket")
    async def cartesia(ws: WebSocket):
        if await accepted(ws, svc, "x-api-key", "api_key"):
            await serve(ws, Cartesia, svc, svc.ws_idle_s, "cartesia socket")

    return router
