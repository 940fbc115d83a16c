"""The WebSocket text-in stream, `/v1/audio/speech/stream`, with sglang-omni's message names (its
`sglang_omni/serve/speech_ws.py`), so its clients work unchanged.

Client -> server, JSON text frames:
- `{"type": "session.config", ...}`: the speech fields of `/v1/audio/speech` (voice, response_format, temperature,
  top_k, top_p, seed, max_rows, speed), flat or under `"session"`, plus `split_granularity` ("sentence" or "clause")
  and `continuation` (default true: each segment continues the KV context of the one before). First, within
  CONFIG_S seconds.
- `{"type": "input.text", "text": "..."}` as text arrives (an LLM's tokens); `{"type": "input.commit"}` speaks what
  is buffered now; `{"type": "input.done"}` ends the input.

Server -> client: `session.configured`; per segment `audio.start` (id, sentence_index, sentence_text, format,
sample_rate), binary frames of audio as it is made, `audio.done` (id, sentence_index, total_bytes, error, stop_reason,
continued); with `caption_level: "word"`, `audio.words` (id, sentence_index, text, start_s/end_s on the session's
audio clock, words: [{text, start_s, end_s, ...}], words_reason when the aligner could not time them) once the
segment's words are timed, which never holds back the next segment's audio; `input.committed`; `session.done`
(session_id, total_sentences); errors as `{"type": "error", "message",
"error_type", "param", "code"}`. A bad message is answered with an error and the session goes on; a session that
cannot go on (bad config, no config in time, idle for `idle_s` with nothing to speak, more than MAX_PENDING
characters waiting to be spoken) gets an error and a close; the server shutting down, an error and close code 1012.
A client that stops reading (a send waits `send_s`, the server's --send-timeout) or leaves has its session ended at
once: its job cancelled, its batch slot and kept KV context freed, one log line.

A codec of the stream engine (engine.py: the segment queue, audio, word timing, stalls, idle time).
"""

from __future__ import annotations

import itertools

from ...textin import GRANULARITIES
from ..formats import encoder
from ..limits import MAX_JSON_BYTES
from .engine import Close, Codec, Refused, Stream
from .wire import TextTooLong

CONFIG_S = 10.0
MAX_MESSAGE_CHARS = 65536  # one input.text; an LLM sends tokens
_ids = itertools.count(1)


class ConfigError(ValueError):
    """A session.config that cannot be used: its message, field and code (the route's `configure` raises it)."""

    def __init__(self, message: str, param: str | None, code: str | None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class SpeechSocket(Codec):
    name = "websocket"
    text_field = "input"
    frame_limit = MAX_MESSAGE_CHARS
    idle_code = 1008
    one_stream = True

    def __init__(self, engine, configure, make_session):
        """`configure(cfg)` (async): (format, options, voice, (lead, text steps, words)) for a session.config, or
        ConfigError; `make_session(voice, options, lead)` the `SpeechSession`."""
        super().__init__(engine)
        self.configure, self.make_session = configure, make_session
        self.id = f"ws-{next(_ids)}"
        engine.label = self.id
        self.stream: Stream | None = None

    @classmethod
    def error(cls, e: Refused) -> dict:
        server = e.kind in ("busy", "server", "stopping") or e.code == "server_error"
        return {"type": "error", "message": e.message, "error_type": "server_error" if server else
                "invalid_request_error", "param": e.param, "code": e.code}

    async def fail(self, message: str, param: str | None = None, code: str | None = None) -> None:
        """Tell the client, then close (1008)."""
        await self.engine.refuse(Refused(message, param, code))
        raise Close(1008)

    async def opened(self) -> None:
        engine = self.engine
        while True:
            try:
                msg = await engine.receive(CONFIG_S, MAX_JSON_BYTES)  # it may carry a reference clip, as HTTP's body
            except TimeoutError:
                await self.fail(f"no session.config within {CONFIG_S:g} s", code="config_timeout")
            except Refused as e:
                await engine.refuse(e)
                continue
            break
        if msg is None:
            raise ConnectionError("left before configuring")
        if msg["type"] != "session.config":
            await self.fail(f"the first message must be session.config, got {msg['type']!r}", code="not_configured")
        cfg = msg.get("session") if isinstance(msg.get("session"), dict) else msg
        granularity = cfg.get("split_granularity", "sentence")
        continuation = cfg.get("continuation", True)
        try:
            if granularity not in GRANULARITIES:
                raise ConfigError(f"split_granularity must be one of {', '.join(GRANULARITIES)}, got "
                                  f"{granularity!r}", "split_granularity", "invalid_value")
            if not isinstance(continuation, bool):
                raise ConfigError("continuation must be true or false", "continuation", "invalid_value")
            if cfg.get("stream_audio", True) is not True:
                raise ConfigError("stream_audio: audio is always streamed here (binary frames as it is made)",
                                  "stream_audio", "unsupported_parameter")
            self.fmt, options, voice, (lead, reader, words) = await self.configure(cfg)
        except ConfigError as e:
            await self.fail(e.message, e.param, e.code)
        session = self.make_session(voice, options, lead)
        session.continuation = continuation
        await engine.send({"type": "session.configured", "session_id": self.id, "response_format": self.fmt,
                           "stream_audio": True, "split_granularity": granularity,
                           "sample_rate": engine.native, "continuation": continuation})
        self.stream = engine.open(Stream(self.id, session, reader, words, granularity))

    async def handle(self, msg: dict) -> None:
        engine, stream, kind = self.engine, self.stream, msg["type"]
        if kind == "session.config":
            raise Refused("the session is configured already", None, "already_configured")
        if kind not in ("input.text", "input.commit", "input.done"):
            raise Refused(f"unknown message type {kind!r}; use input.text, input.commit or input.done", None,
                          "unknown_type")
        if stream.ending:
            raise Refused(f"{kind}: input.done was sent; the session takes no more input", None, "input_done")
        try:
            if kind == "input.text":
                if not isinstance(msg.get("text"), str):
                    raise Refused("input.text needs a string text", "text", "invalid_value")
                engine.feed(stream, msg["text"])
            elif kind == "input.commit":
                engine.flush(stream)
                await engine.send({"type": "input.committed", "session_id": self.id})
            else:
                engine.flush(stream, final=True)
        except TextTooLong as e:  # too much text waiting to be spoken
            await self.fail(str(e), "text", "text_too_long")

    def encoder(self, stream: Stream):
        return encoder(self.fmt, self.engine.native)

    def _seg(self, seg) -> dict:
        return {"id": f"{self.id}-{seg.index}", "sentence_index": seg.index}

    async def started(self, stream: Stream, seg) -> None:
        await self.engine.send({"type": "audio.start", **self._seg(seg), "sentence_text": seg.text,
                                "format": self.fmt, "sample_rate": self.engine.native}, stream)

    async def audio(self, stream: Stream, seg, data: bytes) -> None:
        await self.engine.send(data, stream)

    async def failed(self, stream: Stream, seg, e: Refused) -> None:
        await self.engine.refuse(e, stream)  # the session goes on (the server stopping ends it: code 1012)

    async def ended(self, stream: Stream, seg) -> None:
        await self.engine.send({"type": "audio.done", **self._seg(seg), "total_bytes": seg.bytes,
                                "error": seg.failed, "stop_reason": seg.stop, "continued": seg.continued}, stream)

    async def words(self, stream: Stream, seg, cue) -> None:
        """`audio.words` on the session's audio clock, as the SSE events' words."""
        shown = {k: v for k, v in cue.as_dict(self.engine.native).items() if k != "index"}  # SSE's piece shape
        await self.engine.send({"type": "audio.words", **self._seg(seg), **shown}, stream)

    async def done(self, stream: Stream) -> None:
        await self.engine.send({"type": "session.done", "session_id": self.id, "total_sentences": stream.index},
                               stream)
