"""ElevenLabs' stream-input WebSockets on this server's scheduler (docs/agents.md): the multi-context one,
`/v1/text-to-speech/{voice_id}/multi-stream-input` (what Pipecat's `ElevenLabsTTSService(url=...)` speaks), and the
single-context `/v1/text-to-speech/{voice_id}/stream-input`. The contexts, audio and word timing are `agents.py`'s.

The query: `model_id` (the server's names, or any of ElevenLabs' `eleven_...`: all this model), `output_format`
(`pcm_8000` ... `pcm_48000`: 16-bit PCM at that rate), `auto_mode` (true: each sentence is spoken once it is whole;
false: at each clause, sooner, as a chunk schedule would), `apply_text_normalization` (auto, on, off: our
`normalize`), `language_code` (the word aligner's language), `seed`, `inactivity_timeout` (seconds, at most 180),
`enable_logging` (either: the server logs no text), `enable_ssml_parsing` and `sync_alignment` (false only).
Anything else is refused by name before any text.

Multi-context messages: `{text: " ", context_id, voice_settings?: {speed}}` opens a context (any text does);
`{text, context_id}` adds text; `{context_id, flush: true}` speaks what it holds now; `{text: ""}` keeps the socket
alive; `{context_id, close_context: true}` ends the context: after a flush (Pipecat's end of a turn) what was
flushed is spoken and `isFinal` follows; otherwise, or a second time, it is a barge-in: decoding stops within one
decoder step, its slot is freed and nothing more is sent for it. `{close_socket: true}` cancels every context and
closes the socket. Answers: `{audio, isFinal: null, alignment: null, contextId}` as audio is made; once a segment's
words are timed, `{audio: null, alignment, normalizedAlignment, contextId}` (`chars`, `charStartTimesMs`,
`charDurationsMs` from the segment's start, a closing space running to its end: `agents.char_times`;
`wordsReason` when the aligner could not time it); `{isFinal: true, contextId}`; errors `{error, message, param,
contextId}`.

Single-context (`stream-input`): the same without `context_id`; `{text: ""}` ends the input: what is held is spoken,
`isFinal` follows and the socket closes.
"""

from __future__ import annotations

import re

from fastapi import APIRouter, WebSocket

from ..job.options import OptionError, check_caption_language
from .agents import MAX_CONTEXTS, AgentError, AgentSocket, Close, Context, Output, char_times
from .cartesia import key_of

QUERY = {"model_id", "output_format", "auto_mode", "apply_text_normalization", "language_code", "seed",
         "inactivity_timeout", "enable_logging", "enable_ssml_parsing", "sync_alignment", "xi_api_key"}
FIELDS = {"text", "context_id", "voice_settings", "flush", "close_context", "close_socket", "try_trigger_generation",
          "xi_api_key"}
NORMALIZE = {"auto": "auto", "on": True, "off": False}
MAX_INACTIVITY_S = 180
MODEL_PREFIX = "eleven_"
SINGLE = "0"  # the one context of a stream-input socket
DIGITS = re.compile(r"[0-9]{1,9}")  # a number of the query (str.isdigit takes '²', which int() does not)


class ElevenLabsSocket(AgentSocket):
    name = "elevenlabs"
    text_field = "text"
    single = False

    def __init__(self, ws, svc, voice_id: str, query: dict):
        """AgentError for a query field that is not served (the route answers it, then closes)."""
        items = list(query.multi_items())
        self.voice_id, self.query = voice_id, dict(items)
        q = self.query
        unknown = sorted(set(q) - QUERY)
        if unknown:
            raise AgentError(f"{unknown[0]} is not a query parameter of ElevenLabs' stream-input here; they are "
                             f"{', '.join(sorted(QUERY))}", unknown[0], "unknown_parameter")
        if len(items) != len(q):
            twice = next(k for k, _ in items if sum(1 for j, _ in items if j == k) > 1)
            raise AgentError(f"{twice} is given twice in the query; give it once", twice, "invalid_value")
        model = q.get("model_id")
        if model is not None and model not in svc.models and not model.startswith(MODEL_PREFIX):
            raise AgentError(f"model_id {model!r:.60} is not served here; use one of {', '.join(svc.models)} (or an "
                             f"ElevenLabs model name: all are this model)", "model_id", "model_not_found")
        fmt = q.get("output_format", f"pcm_{svc.sample_rate}")
        rate = fmt.removeprefix("pcm_")
        if not fmt.startswith("pcm_") or not DIGITS.fullmatch(rate):
            raise AgentError(f"output_format {fmt!r:.40} is not served here; use pcm_RATE (16-bit PCM), RATE one "
                             f"of 8000, 16000, 22050, 24000, 44100, 48000", "output_format", "unsupported_format")
        self.output = Output.check("pcm_s16le", int(rate), svc.sample_rate)
        self.granularity = {"true": "sentence", "false": "clause"}.get(q.get("auto_mode", "true").lower())
        for name in ("auto_mode", "enable_logging", "enable_ssml_parsing", "sync_alignment"):
            if q.get(name, "false").lower() not in ("true", "false"):
                raise AgentError(f"{name} must be true or false, got {q[name]!r:.40}", name)
        for name, why in (("enable_ssml_parsing", "SSML is not read here"),
                          ("sync_alignment", "alignment comes once a segment's words are timed, after its audio")):
            if q.get(name, "false").lower() == "true":
                raise AgentError(f"{name}=true is not served here: {why}", name, "unsupported_parameter")
        self.values = {"voice": voice_id, "caption_level": "word"}
        if "apply_text_normalization" in q:
            if q["apply_text_normalization"] not in NORMALIZE:
                raise AgentError(f"apply_text_normalization must be auto, on or off, got "
                                 f"{q['apply_text_normalization']!r:.40}", "apply_text_normalization")
            self.values["normalize"] = NORMALIZE[q["apply_text_normalization"]]
        if "seed" in q:  # a number of the query: its bound is the table's (job.options)
            if not re.fullmatch(r"-?[0-9]{1,20}", q["seed"]):
                raise AgentError(f"seed must be a whole number, got {q['seed']!r:.40}", "seed")
            self.values["seed"] = int(q["seed"])
        idle = svc.ws_idle_s
        if "inactivity_timeout" in q:
            t = q["inactivity_timeout"]
            if not DIGITS.fullmatch(t) or not 1 <= int(t) <= MAX_INACTIVITY_S:
                raise AgentError(f"inactivity_timeout must be whole seconds from 1 to {MAX_INACTIVITY_S}, got "
                                 f"{t!r:.40}", "inactivity_timeout")
            idle = float(t)
        try:  # the caption_language job option's one check (job.options), under the vendor's name
            self.language = check_caption_language(q.get("language_code", "en"), "language_code")
        except OptionError as e:
            raise AgentError(str(e), "language_code") from None
        super().__init__(ws, svc, idle)

    # -- answers -----------------------------------------------------------------------------------------
    def _ctx(self, cid: str | None) -> dict:
        return {} if self.single else {"contextId": cid}

    def audio_message(self, ctx: Context, data: bytes) -> dict:
        return {"audio": self.b64(data), "isFinal": None, "normalizedAlignment": None, "alignment": None,
                **self._ctx(ctx.id)}

    def words_message(self, ctx: Context, cue) -> dict:
        timed = char_times(cue.text, cue, self.native)
        out = {"audio": None, "isFinal": None, "alignment": timed, "normalizedAlignment": timed, **self._ctx(ctx.id)}
        if cue.words_reason:
            out["wordsReason"] = cue.words_reason
        return out

    def done_message(self, ctx: Context) -> dict:
        return {"isFinal": True, **self._ctx(ctx.id)}

    def error_message(self, e: AgentError) -> dict:
        return {"error": e.code, "message": e.message, "param": e.param, **self._ctx(e.context)}

    # -- messages ----------------------------------------------------------------------------------------
    async def handle(self, msg: dict) -> None:
        unknown = sorted(set(msg) - FIELDS)
        if unknown:
            raise AgentError(f"{unknown[0]} is not a field of ElevenLabs' stream-input messages here; the fields "
                             f"are {', '.join(sorted(FIELDS))}", unknown[0], "unknown_parameter",
                             msg.get("context_id") if isinstance(msg.get("context_id"), str) else None)
        for name in ("flush", "close_context", "close_socket", "try_trigger_generation"):
            if name in msg and not isinstance(msg[name], bool):
                raise AgentError(f"{name} must be true or false, got {msg[name]!r:.40}", name)
        if "xi_api_key" in msg:
            self.check_key(msg["xi_api_key"])
        if msg.get("close_socket"):
            extra = sorted(set(msg) - {"close_socket", "xi_api_key"})
            if extra:
                raise AgentError(f"{extra[0]}: close_socket closes the socket; send it alone", extra[0],
                                 "unknown_parameter")
            raise Close(1000)
        text = msg.get("text")
        if "text" in msg and not isinstance(text, str):
            raise AgentError(f"text must be a string, got {type(text).__name__}", "text")
        if self.single:
            cid = SINGLE
            if "context_id" in msg:
                raise AgentError("context_id is for multi-stream-input; stream-input has one context", "context_id",
                                 "unknown_parameter")
        elif "context_id" not in msg:
            if text == "" and len(msg) == 1:
                return  # keep-alive
            raise AgentError("context_id is required on multi-stream-input", "context_id", "missing_parameter")
        else:
            cid = self.check_id(msg["context_id"])
        ctx = self.contexts.get(cid)
        if msg.get("close_context"):
            if self.single:
                raise AgentError("close_context is for multi-stream-input; end stream-input's text with "
                                 '{"text": ""}', "close_context", "unknown_parameter")
            return await self.close_context(cid, ctx)
        if ctx is None:
            if text == "" and not msg.get("flush"):
                return  # a keep-alive for a context not yet opened, or one that ended
            self.check_new(cid)
            if not text and msg.get("flush"):
                raise AgentError(f"context {cid!r:.60} has no text to flush", "flush", "empty_context", cid)
            ctx = await self.open(cid, msg.get("voice_settings"))
        elif msg.get("voice_settings") is not None:
            raise AgentError("voice_settings are fixed when a context opens; open a new context_id to change them",
                             "voice_settings", "context_settings_changed", cid)
        if self.single and text == "":  # stream-input's end of input
            self.flush(ctx, final=True)
            return
        if text:
            await self.feed(ctx, text, "text")
        if msg.get("flush") or msg.get("try_trigger_generation"):
            ctx.flushed = True
            self.flush(ctx, final=False)

    def check_key(self, key) -> None:
        """A key sent in a message (ElevenLabs' older clients do): it must be the server's, when it has one (the
        socket's own key was checked when it opened)."""
        import hmac

        expected = self.svc.api_key
        if not isinstance(key, str) or expected is not None and not hmac.compare_digest(key.encode(),
                                                                                        expected.encode()):
            raise AgentError("xi_api_key is not this server's API key", "xi_api_key", "invalid_api_key")

    async def close_context(self, cid: str, ctx: Context | None) -> None:
        if ctx is None:
            if cid in self.ended:
                return  # it ended already: nothing left to close
            raise AgentError(f"no context {cid!r:.60} on this socket to close", "context_id", "unknown_context", cid)
        if ctx.flushed and not ctx.ending:  # the end of a turn: what was flushed is spoken
            self.flush(ctx, final=True)
        elif ctx.busy or not ctx.queue.empty() or ctx.ending:
            await self.cancel(ctx)  # barge-in
        else:  # nothing being spoken: it ends now
            self.flush(ctx, final=True)

    async def open(self, cid: str, settings) -> Context:
        values = dict(self.values)
        if settings is not None:
            if not isinstance(settings, dict):
                raise AgentError("voice_settings must be an object", "voice_settings", "invalid_value", cid)
            for name, value in settings.items():
                if name == "speed":
                    values["speed"] = value
                elif value is not None:
                    raise AgentError(f"voice_settings.{name} is not served here: this model has no such control "
                                     f"(speed is)", f"voice_settings.{name}", "unsupported_parameter", cid)
        try:
            session, reader, _ = await self.session_of(values)
        except AgentError as e:
            raise AgentError(e.message, e.param, e.code, cid) from None
        ctx = Context(cid, session, reader, self.output, self.native, self.language, self.granularity)
        return self.add(ctx)


class StreamInputSocket(ElevenLabsSocket):
    single = True

    async def speak(self, ctx: Context) -> None:
        await super().speak(ctx)
        if not ctx.cancelled and not self.fatal.done():
            self.fatal.set_exception(Close(1000))  # the one context is over: so is the socket


def router(svc) -> APIRouter:
    router = APIRouter()

    async def serve(ws: WebSocket, voice_id: str, kind: type[ElevenLabsSocket]):
        if (e := svc.refusal(key_of(ws, "xi-api-key", "xi_api_key"), True)) is not None:
            await ws.close(1008, e.message[:120])  # before the socket opens
            return
        await ws.accept()
        try:
            sock = kind(ws, svc, voice_id, ws.query_params)
            await sock.session_of(sock.values)  # the voice and the job, checked before any text
        except AgentError as e:
            await ws.send_json({"error": e.code, "message": e.message, "param": e.param})
            await ws.close(1008)
            return
        await sock.run()

    @router.websocket("/v1/text-to-speech/{voice_id}/multi-stream-input")
    async def multi(ws: WebSocket, voice_id: str):
        await serve(ws, voice_id, ElevenLabsSocket)

    @router.websocket("/v1/text-to-speech/{voice_id}/stream-input")
    async def single(ws: WebSocket, voice_id: str):
        await serve(ws, voice_id, StreamInputSocket)

    return router


__all__ = ["MAX_CONTEXTS", "ElevenLabsSocket", "StreamInputSocket", "router"]
