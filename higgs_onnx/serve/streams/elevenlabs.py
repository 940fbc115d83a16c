"""ElevenLabs' stream-input WebSockets (docs/agents.md), a codec of the stream engine (engine.py): the multi-context
`/v1/text-to-speech/{voice_id}/multi-stream-input` (Pipecat's `ElevenLabsTTSService(url=...)`) and the single-context
`/v1/text-to-speech/{voice_id}/stream-input`. The query (`Query`) is checked before any text.

Multi-context messages: `{text: " ", context_id, voice_settings?: {speed}}` opens a context (any text does);
`{text, context_id}` adds text; `{context_id, flush: true}` speaks what it holds; `{text: ""}` keeps the socket
alive; `{context_id, close_context: true}` ends the context, dropping held text never flushed (what an LLM was
writing when the user spoke): after a flush (Pipecat's end of a turn) what was flushed is spoken, then `isFinal`;
without one while it speaks, or a second time, it is a barge-in (decoding stops within one step, its slot is freed,
nothing more is sent for it); with nothing spoken or queued it just ends. `{close_socket: true}` cancels every
context and closes. Answers: `{audio, isFinal: null, alignment: null, contextId}`; once a segment's words are timed
`{audio: null, alignment, normalizedAlignment, contextId}` (`agent.char_times`; `wordsReason` when they could not
be); `{isFinal: true, contextId}`; errors `{error, message, param, contextId}`. `stream-input`: the same without
`context_id`; `{text: ""}` ends the input (what is held is spoken, `isFinal`, the socket closes; first, it is
refused: nothing to speak).
"""

from __future__ import annotations

import functools
import re

from fastapi import APIRouter, WebSocket

from ...job.options import OptionError, check_caption_language
from .agent import AgentCodec, accepted, char_times, check_key, session_of
from .engine import Close, Refused, Stream
from .pcm import RATES, Output
from .websocket import serve

QUERY = {"model_id", "output_format", "auto_mode", "apply_text_normalization", "language_code", "seed",
         "inactivity_timeout", "enable_logging", "enable_ssml_parsing", "sync_alignment", "xi_api_key"}
FIELDS = {"text", "context_id", "voice_settings", "flush", "close_context", "close_socket", "try_trigger_generation",
          "xi_api_key"}
BOOLS = {"auto_mode": None, "enable_logging": None, "enable_ssml_parsing": "SSML is not read here",
         "sync_alignment": "alignment comes once a segment's words are timed, after its audio"}  # why true is refused
NORMALIZE = {"auto": "auto", "on": True, "off": False}
MAX_INACTIVITY_S = 180
MODEL_PREFIX = "eleven_"
SINGLE = "0"  # the one context of a stream-input socket
DIGITS = re.compile(r"[0-9]{1,9}")  # a number of the query (str.isdigit takes '²', which int() does not)


class Query:
    """The socket's query, checked before the socket reads any text: Refused for a field that is not served."""

    def __init__(self, svc, voice_id: str, query):
        items = list(query.multi_items())
        q = dict(items)
        unknown = sorted(set(q) - QUERY)
        if unknown:
            raise Refused(f"{unknown[0]} is not a query parameter of ElevenLabs' stream-input here; they are "
                          f"{', '.join(sorted(QUERY))}", unknown[0], "unknown_parameter")
        if len(items) != len(q):
            twice = next(k for k, _ in items if sum(1 for j, _ in items if j == k) > 1)
            raise Refused(f"{twice} is given twice in the query; give it once", twice, "invalid_value")
        model = q.get("model_id")
        if model is not None and model not in svc.models and not model.startswith(MODEL_PREFIX):
            raise Refused(f"model_id {model!r:.60} is not served here; use one of {', '.join(svc.models)} (or an "
                          f"ElevenLabs model name: all are this model)", "model_id", "model_not_found")
        fmt = q.get("output_format", f"pcm_{svc.sample_rate}")
        rate = fmt.removeprefix("pcm_")
        if not fmt.startswith("pcm_") or not DIGITS.fullmatch(rate):
            raise Refused(f"output_format {fmt!r:.40} is not served here; use pcm_RATE (16-bit PCM), RATE one of "
                          f"{', '.join(map(str, RATES))}", "output_format", "unsupported_format")
        self.output = Output.check("pcm_s16le", int(rate), svc.sample_rate)
        self.granularity = {"true": "sentence", "false": "clause"}.get(q.get("auto_mode", "true").lower())
        for name, why in BOOLS.items():
            if q.get(name, "false").lower() not in ("true", "false"):
                raise Refused(f"{name} must be true or false, got {q[name]!r:.40}", name)
            if why and q.get(name, "false").lower() == "true":
                raise Refused(f"{name}=true is not served here: {why}", name, "unsupported_parameter")
        self.values = {"voice": voice_id, "caption_level": "word"}
        if "apply_text_normalization" in q:
            if q["apply_text_normalization"] not in NORMALIZE:
                raise Refused(f"apply_text_normalization must be auto, on or off, got "
                              f"{q['apply_text_normalization']!r:.40}", "apply_text_normalization")
            self.values["normalize"] = NORMALIZE[q["apply_text_normalization"]]
        if "seed" in q:  # a number of the query: its bound is the table's (job.options)
            if not re.fullmatch(r"-?[0-9]{1,20}", q["seed"]):
                raise Refused(f"seed must be a whole number, got {q['seed']!r:.40}", "seed")
            self.values["seed"] = int(q["seed"])
        self.idle_s = svc.ws_idle_s
        if "inactivity_timeout" in q:
            t = q["inactivity_timeout"]
            if not DIGITS.fullmatch(t) or not 1 <= int(t) <= MAX_INACTIVITY_S:
                raise Refused(f"inactivity_timeout must be whole seconds from 1 to {MAX_INACTIVITY_S}, got "
                              f"{t!r:.40}", "inactivity_timeout")
            self.idle_s = float(t)
        try:  # the caption_language job option's one check (job.options), under the vendor's name
            self.language = check_caption_language(q.get("language_code", "en"), "language_code")
        except OptionError as e:
            raise Refused(str(e), "language_code") from None


class ElevenLabs(AgentCodec):
    name = "elevenlabs"
    text_field = "text"
    single = False

    def __init__(self, engine, query: Query):
        super().__init__(engine)
        self.query = query

    @classmethod
    def _ctx(cls, cid: str | None) -> dict:
        return {} if cls.single else {"contextId": cid}

    async def audio(self, stream: Stream, seg, data: bytes) -> None:
        await self.engine.send({"audio": self.b64(data), "isFinal": None, "normalizedAlignment": None,
                                "alignment": None, **self._ctx(stream.id)}, stream)

    async def words(self, stream: Stream, seg, cue) -> None:
        timed = char_times(cue.text, cue, self.engine.native)
        out = {"audio": None, "isFinal": None, "alignment": timed, "normalizedAlignment": timed, **self._ctx(stream.id)}
        if cue.words_reason:
            out["wordsReason"] = cue.words_reason
        await self.engine.send(out, stream)

    async def done(self, stream: Stream) -> None:
        await self.engine.send({"isFinal": True, **self._ctx(stream.id)}, stream)

    @classmethod
    def error(cls, e: Refused) -> dict:
        return {"error": e.code, "message": e.message, "param": e.param, **cls._ctx(e.stream)}

    async def handle(self, msg: dict) -> None:
        engine = self.engine
        unknown = sorted(set(msg) - FIELDS)
        if unknown:
            raise Refused(f"{unknown[0]} is not a field of ElevenLabs' stream-input messages here; the fields are "
                          f"{', '.join(sorted(FIELDS))}", unknown[0], "unknown_parameter",
                          msg.get("context_id") if isinstance(msg.get("context_id"), str) else None)
        for name in ("flush", "close_context", "close_socket", "try_trigger_generation"):
            if name in msg and not isinstance(msg[name], bool):
                raise Refused(f"{name} must be true or false, got {msg[name]!r:.40}", name)
        if "xi_api_key" in msg:
            check_key(self.engine.svc, msg["xi_api_key"], "xi_api_key")
        if msg.get("close_socket"):
            extra = sorted(set(msg) - {"close_socket", "xi_api_key"})
            if extra:
                raise Refused(f"{extra[0]}: close_socket closes the socket; send it alone", extra[0],
                              "unknown_parameter")
            raise Close(1000)
        text = msg.get("text")
        if "text" in msg and not isinstance(text, str):
            raise Refused(f"text must be a string, got {type(text).__name__}", "text")
        if self.single:
            cid = SINGLE
            if "context_id" in msg:
                raise Refused("context_id is for multi-stream-input; stream-input has one context", "context_id",
                              "unknown_parameter")
        elif "context_id" not in msg:
            if text == "" and len(msg) == 1:
                return  # keep-alive
            raise Refused("context_id is required on multi-stream-input", "context_id", "missing_parameter")
        else:
            cid = engine.check_id(msg["context_id"])
        stream = engine.streams.get(cid)
        if msg.get("close_context"):
            if self.single:
                raise Refused('close_context is for multi-stream-input; end stream-input\'s text with {"text": ""}',
                              "close_context", "unknown_parameter")
            return await self.close_context(cid, stream)
        if stream is None:
            if self.single and text == "" and cid not in engine.ended:
                await engine.refuse(Refused('the first message opens the stream with text ({"text": " "}); '
                                            '{"text": ""} ends it, and there is nothing to speak', "text",
                                            "empty_context"))
                raise Close(1008)
            if text == "" and not msg.get("flush"):
                return  # a keep-alive for a context not yet opened, or one that ended
            engine.check_new(cid)
            if not text and msg.get("flush"):
                raise Refused(f"context {cid!r:.60} has no text to flush", "flush", "empty_context", cid)
            stream = await self.open(cid, msg.get("voice_settings"))
        elif msg.get("voice_settings") is not None:
            raise Refused("voice_settings are fixed when a context opens; open a new context_id to change them",
                          "voice_settings", "context_settings_changed", cid)
        if self.single and text == "":  # stream-input's end of input
            engine.flush(stream, final=True)
            return
        if text:
            await self.feed(stream, text, "text")
        if msg.get("flush") or msg.get("try_trigger_generation"):
            stream.flushed = True
            engine.flush(stream)

    async def close_context(self, cid: str, stream: Stream | None) -> None:
        """The end of a turn after a flush (what was flushed is spoken), else a barge-in; held text that was never
        flushed is dropped either way."""
        engine = self.engine
        if stream is None:
            if cid in engine.ended:
                return  # it ended already: nothing left to close
            raise Refused(f"no context {cid!r:.60} on this socket to close", "context_id", "unknown_context", cid)
        if stream.flushed and not stream.ending:  # the end of a turn: what was flushed is spoken
            engine.flush(stream, final=True, drop_held=True)
        elif stream.speaking() or stream.ending:
            await engine.cancel(stream)  # barge-in
        else:  # nothing spoken or queued: it ends now
            engine.flush(stream, final=True, drop_held=True)

    async def open(self, cid: str, settings) -> Stream:
        values = dict(self.query.values)
        if settings is not None:
            if not isinstance(settings, dict):
                raise Refused("voice_settings must be an object", "voice_settings", "invalid_value", cid)
            for name, value in settings.items():
                if name == "speed":
                    values["speed"] = value
                elif value is not None:
                    raise Refused(f"voice_settings.{name} is not served here: this model has no such control "
                                  f"(speed is)", f"voice_settings.{name}", "unsupported_parameter", cid)
        session, reader = await session_of(self.engine.svc, self.name, values, cid)
        stream = Stream(cid, session, reader, self.query.language, self.query.granularity)
        stream.state["output"] = self.query.output
        return self.engine.open(stream)


class StreamInput(ElevenLabs):
    single = True
    one_stream = True  # the one context is over: so is the socket


def router(svc) -> APIRouter:
    router = APIRouter()

    async def door(ws: WebSocket, voice_id: str, codec: type[ElevenLabs]):
        if not await accepted(ws, svc, "xi-api-key", "xi_api_key"):
            return
        try:
            query = Query(svc, voice_id, ws.query_params)
            await session_of(svc, codec.name, query.values)  # the voice and the job, checked before any text
        except Refused as e:
            await ws.send_json({"error": e.code, "message": e.message, "param": e.param})
            await ws.close(1008)
            return
        await serve(ws, functools.partial(codec, query=query), svc, query.idle_s, "elevenlabs socket")

    @router.websocket("/v1/text-to-speech/{voice_id}/multi-stream-input")
    async def multi(ws: WebSocket, voice_id: str):
        await door(ws, voice_id, ElevenLabs)

    @router.websocket("/v1/text-to-speech/{voice_id}/stream-input")
    async def single(ws: WebSocket, voice_id: str):
        await door(ws, voice_id, StreamInput)

    return router
