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
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

from ..job.run import aligned, joined
from ..longform.captions import Cue
from ..textin import GRANULARITIES, TextSegmenter
from .formats import encoder
from .limits import MAX_JSON_BYTES
from .scheduler import ShuttingDown
from .segments import (
    BadFrame,
    SegmentQueue,
    Stalled,
    buffered,
    end_tasks,
    json_object,
    next_segment,
    segment_failure,
    send_within,
    within,
)

log = logging.getLogger(__name__)
CONFIG_S = 10.0
MAX_MESSAGE_CHARS = 65536  # one input.text; an LLM sends tokens
_ids = itertools.count(1)


class Close(Exception):
    """End the session after an error message."""


class ConfigError(ValueError):
    """A session.config that cannot be used: its message, field and code (the app's `configure` raises it)."""

    def __init__(self, message: str, param: str | None, code: str | None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class WsSession:
    def __init__(self, ws, configure, make_session, sample_rate: int, idle_s: float, send_s: float = 30.0):
        """`configure(cfg)` (async): (format, options, voice, text prefix) for a session.config, or ConfigError;
        `make_session(voice, options, prefix)` the `SpeechSession`. A send that waits `send_s` (the client stopped
        reading) ends the session: its job is cancelled and its slot and kept context are freed."""
        self.ws, self.configure, self.make_session = ws, configure, make_session
        self.sample_rate, self.idle_s, self.send_s = sample_rate, idle_s, send_s
        self.id = f"ws-{next(_ids)}"
        self.send_lock = asyncio.Lock()
        self.busy = False  # a segment is queued or being spoken
        self.segments = SegmentQueue()  # what is cut and not yet spoken (at most segments.MAX_PENDING characters)
        self.words: str | None = None  # word times asked for: the aligner's language
        self.offset = 0  # samples sent so far: where the next segment starts on the session's clock
        self.words_task: asyncio.Task | None = None  # the last segment's word timing

    async def send(self, obj: dict | bytes) -> None:
        async with self.send_lock:
            sending = self.ws.send_bytes(obj) if isinstance(obj, bytes) else self.ws.send_text(json.dumps(obj))
            await send_within(sending, self.send_s)

    async def error(self, message: str, error_type: str = "invalid_request_error", param: str | None = None,
                    code: str | None = None) -> None:
        await self.send({"type": "error", "message": message, "error_type": error_type, "param": param,
                         "code": code})

    async def receive(self, timeout: float, limit: int = MAX_MESSAGE_CHARS) -> dict | None:
        """The next JSON message (None: the client left); errors for frames that are not one."""
        while True:
            msg = await within(self.ws.receive(), timeout)
            if msg["type"] == "websocket.disconnect":
                return None
            try:
                data = json_object(msg, limit, 'a message is a JSON object with a "type"', keyed="type")
            except BadFrame as e:
                await self.error(e.message, code=e.code)
                continue
            return data

    async def run(self) -> None:
        """The session, start to end; however it ends (done, an error, the client gone or stalled, the server
        stopping), its job is cancelled and its slot and kept context freed before this returns. One log line."""
        from fastapi import WebSocketDisconnect

        session = speaker = reader = None
        code = 1000
        try:
            session, segmenter = await self.start()
            speaker = asyncio.create_task(self.speak(session))
            reader = asyncio.create_task(self.read(segmenter, speaker))
            await asyncio.wait({reader, speaker}, return_when=asyncio.FIRST_COMPLETED)
            if speaker.done() and not reader.done():  # it ended on an error of its own: stop reading
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
                speaker.result()
            else:
                reader.result()
                await speaker
        except Close:
            code = 1008
        except ShuttingDown:  # logged once, by segments.segment_failure
            code = 1012  # service restart: the client may reconnect
        except Stalled as e:
            code = None
            log.warning("%s: %s; session ended, its slot freed", self.id, e)
        except (WebSocketDisconnect, ConnectionError, RuntimeError) as e:  # the client left mid-send
            code = None
            log.info("%s: the client left (%s)", self.id, type(e).__name__)
        finally:
            try:  # a finished task's failure is the session's end, told above: retrieved here
                await end_tasks((reader, speaker, self.words_task), self.id)
            finally:
                if session is not None:
                    session.close()
        if code is not None:
            await self._close(code)

    async def _close(self, code: int) -> None:
        try:
            await within(self.ws.close(code), 1.0)
        except Exception:  # noqa: BLE001 - closed already, or the client reads nothing
            pass

    async def start(self):
        try:
            msg = await self.receive(CONFIG_S, MAX_JSON_BYTES)  # it may carry a reference clip, as HTTP's body
        except TimeoutError:
            await self.error(f"no session.config within {CONFIG_S:g} s", code="config_timeout")
            raise Close from None
        if msg is None:
            raise ConnectionError("left before configuring")
        if msg["type"] != "session.config":
            await self.error(f"the first message must be session.config, got {msg['type']!r}", code="not_configured")
            raise Close
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
            self.fmt, options, voice, prefix = await self.configure(cfg)
            self.words = prefix[2]  # caption_level "word": the aligner's language (None: no word times)
        except ConfigError as e:
            await self.error(e.message, param=e.param, code=e.code)
            raise Close from None
        session = self.make_session(voice, options, prefix)
        session.continuation = continuation
        await self.send({"type": "session.configured", "session_id": self.id, "response_format": self.fmt,
                         "stream_audio": True, "split_granularity": granularity, "sample_rate": self.sample_rate,
                         "continuation": continuation})
        return session, TextSegmenter(granularity)

    async def read(self, segmenter: TextSegmenter, speaker: asyncio.Task) -> None:
        while True:
            try:
                msg = await self.receive(self.idle_s)
            except TimeoutError:
                if self.busy or not self.segments.empty():
                    continue  # speaking: the client waits for audio, it is not idle
                await self.error(f"idle for {self.idle_s:g} s with nothing to speak", code="idle_timeout")
                raise Close from None
            if msg is None:
                raise ConnectionError("the client left")
            kind = msg["type"]
            try:
                if kind == "input.text":
                    if not isinstance(msg.get("text"), str):
                        await self.error("input.text needs a string text", param="text", code="invalid_value")
                        continue
                    self.segments.put(segmenter.feed(msg["text"]), buffered(segmenter))
                elif kind == "input.commit":
                    self.segments.put(segmenter.flush())
                    await self.send({"type": "input.committed", "session_id": self.id})
                elif kind == "input.done":
                    self.segments.put(segmenter.flush())
                    self.segments.end()
                    return
                elif kind == "session.config":
                    await self.error("the session is configured already", code="already_configured")
                else:
                    await self.error(f"unknown message type {kind!r}; use input.text, input.commit or input.done",
                                     code="unknown_type")
            except ValueError as e:  # too much text waiting to be spoken
                await self.error(str(e), param="text", code="text_too_long")
                raise Close from None
            if speaker.done():  # it ended on an error of its own
                return

    async def speak(self, session) -> None:
        from fastapi import WebSocketDisconnect

        index, words = 0, None
        while (text := await next_segment(self.segments, session, self.id)) is not None:
            self.busy = True
            seg, start, held = f"{self.id}-{index}", self.offset, []
            await self.send({"type": "audio.start", "id": seg, "sentence_index": index, "sentence_text": text,
                             "format": self.fmt, "sample_rate": self.sample_rate})
            enc, total, failed, stop = encoder(self.fmt, self.sample_rate), 0, False, None
            try:
                async for chunk in session.speak(text):
                    if data := enc.push(chunk.samples):
                        await self.send(data)
                        total += len(data)
                    self.offset += chunk.samples.size
                    if self.words is not None:
                        held.append(chunk.samples)
                    if chunk.is_last and chunk.stats is not None:
                        stop = chunk.stats.stop_reason
                if data := enc.finish():
                    await self.send(data)
                    total += len(data)
            except WebSocketDisconnect:
                raise
            except Exception as e:  # noqa: BLE001 - this segment fails (segments.segment_failure says how)
                kind, message, code = segment_failure(e, f"{self.id} segment {index}")
                if kind == "stopping":  # the server is stopping: the session ends (close code 1012)
                    await self.error(message, "server_error", code="shutting_down")
                    raise
                failed = True
                if kind == "client":  # special tokens, a segment that cannot fit: the session goes on
                    await self.error(message, param="input", code=code or "invalid_value")
                else:
                    await self.error(message, "server_error", code="rate_limit_exceeded" if kind == "busy" else
                                     "server_error")
            await self.send({"type": "audio.done", "id": seg, "sentence_index": index, "total_bytes": total,
                             "error": failed, "stop_reason": stop, "continued": session.last_continued})
            if self.words is not None and not failed:
                cue = Cue(start, self.offset, session.read_text or text, index=index)
                words = self.words_task = asyncio.create_task(self.timed(seg, cue, joined(held), words))
            index += 1
            self.busy = False
        if words is not None:
            await words
        await self.send({"type": "session.done", "session_id": self.id, "total_sentences": index})

    async def timed(self, seg: str, cue: Cue, samples, before: asyncio.Task | None) -> None:
        """`audio.words` for a finished segment, once the aligner has timed it (after the segment before's): on
        the session's clock, as the SSE events' words; `words_reason` says why there are none."""
        if before is not None:
            await before
        cue = await aligned(cue, samples, self.sample_rate, self.words)
        shown = {k: v for k, v in cue.as_dict(self.sample_rate).items() if k != "index"}  # SSE's piece shape
        await self.send({"type": "audio.words", "id": seg, "sentence_index": cue.index, **shown})
