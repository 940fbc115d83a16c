"""Wyoming's synthesis events as a codec of the stream engine (engine.py); the server around it (its service,
voices, framing, mDNS) is `serve/wyoming_server.py`.

- `synthesize` -> `audio-start`, `audio-chunk`s as the audio is made (16-bit mono PCM at the model's rate),
  `audio-stop`: one stream whose segments are all queued at once, its audio one block (an error event comes before
  `audio-start` when the first segment fails).
- `synthesize-start` (voice), `synthesize-chunk`s of text, `synthesize-stop` -> for each segment, as soon as its
  sentence is whole, `audio-start` / `audio-chunk`s / `audio-stop`; then `synthesize-stopped`. The `synthesize`
  clients send inside a stream (the whole text, for servers without streaming) is ignored.
- A field of the job that Wyoming's events have no place for (`ssml`, `speed` ...) is refused by name from the
  options table (`job.options.refuse`); a bad request is an `error` event and the connection stays.
"""

from __future__ import annotations

import asyncio
import logging

from ...audio import pcm16
from ...job.options import OPTIONS, OptionError, refuse
from ...textin import TextSegmenter
from .engine import Close, Codec, Refused, Stream, Transport
from .wire import Stalled, TextTooLong, send_within

log = logging.getLogger("higgs_onnx.wyoming")
SAMPLE_WIDTH = 2
EVENT_FIELDS = {"text", "voice"}  # what a synthesis event carries here


class Frame(ValueError):
    """A frame that breaks the protocol: the connection is closed."""


class WyomingTransport(Transport):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, read_event, send_s: float):
        self.reader, self.writer, self.read_event, self.send_s = reader, writer, read_event, send_s
        self.peer = writer.get_extra_info("peername")

    async def receive(self, limit: int):
        try:
            return await self.read_event(self.reader)
        except Frame as e:  # the protocol is broken: the client is told, the connection closed
            log.warning("%s: %s; connection closed", self.peer, e)
            from wyoming.error import Error

            try:
                await self.send(Error(text=str(e), code="bad_frame"))
            except (ConnectionError, Stalled):
                pass
            raise Close(1008) from None
        except (ConnectionError, asyncio.IncompleteReadError):
            return None

    async def send(self, obj) -> None:
        from wyoming.event import async_write_event

        await send_within(async_write_event(obj.event(), self.writer), self.send_s)

    async def close(self, code: int | None) -> None:
        if code is None:  # gone or stalled: nothing more is written
            self.writer.transport.abort()
        else:
            self.writer.close()


class Wyoming(Codec):
    name = "wyoming"
    failure_codes = {"client": "invalid_text", "busy": "busy", "server": "server_error", "stopping": "shutting_down"}

    def __init__(self, engine, service):
        super().__init__(engine)
        self.service = service
        self.stream: Stream | None = None  # a synthesize-start's stream, until its synthesize-stop
        self.count = 0

    @classmethod
    def error(cls, e: Refused):
        from wyoming.error import Error

        return Error(text=e.message, code=e.code)

    def new_stream(self, event, whole: bool) -> Stream:
        """A stream in the event's voice; Refused for an unknown voice or a job field Wyoming has no place for."""
        from ..voices import VoiceError

        for name in sorted(set(event.data or {}) - EVENT_FIELDS):
            if name in OPTIONS:
                try:
                    refuse(name, "wyoming")
                except OptionError as e:
                    raise Refused(e.message, name, e.code) from None
        svc = self.service
        try:
            voice = svc.voice(svc.voice_name(event_voice(event)))
        except VoiceError as e:
            raise Refused(str(e), "voice", "voice_not_found") from None
        self.count += 1
        stream = Stream(f"synthesis-{self.count}", svc.session(voice), svc.read)
        stream.state["whole"] = whole
        return stream

    async def handle(self, event) -> None:
        from wyoming.info import Describe
        from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

        engine, kind = self.engine, event.type
        if Describe.is_type(kind):
            await engine.send(self.service.info())
        elif SynthesizeStart.is_type(kind):
            if self.stream is not None:
                raise Refused("synthesize-start inside a stream: send synthesize-stop first", None, "bad_order")
            self.stream = engine.open(self.new_stream(event, whole=False))
        elif SynthesizeChunk.is_type(kind):
            if self.stream is None:
                raise Refused("synthesize-chunk outside a stream: send synthesize-start first", None, "bad_order")
            text = event_text(event, "synthesize-chunk")
            try:
                engine.feed(self.stream, text)
            except TextTooLong as e:
                await engine.refuse(Refused(str(e), "text", "text_too_long"))
                raise Close(1008) from None
        elif SynthesizeStop.is_type(kind):
            if self.stream is None:
                raise Refused("synthesize-stop outside a stream", None, "bad_order")
            stream, self.stream = self.stream, None
            engine.flush(stream, final=True)
            await engine.finish(stream)
        elif Synthesize.is_type(kind):
            if self.stream is not None:
                return  # the whole text, sent for servers without streaming: spoken already
            await self.whole(event)

    async def whole(self, event) -> None:
        text = event_text(event, "synthesize")
        seg = TextSegmenter()
        try:
            segments = seg.feed(text) + seg.flush()
        except ValueError as e:
            raise Refused(str(e), "text", "text_too_long") from None
        if not segments:
            raise Refused("the text is empty: nothing to speak", "text", "empty_text")
        stream = self.new_stream(event, whole=True)
        stream.queue.put(segments)
        stream.ending = True
        stream.queue.end()
        await self.engine.finish(self.engine.open(stream))

    def encoder(self, stream: Stream):
        return Pcm16()

    async def audio(self, stream: Stream, seg, data: bytes) -> None:
        from wyoming.audio import AudioChunk, AudioStart

        rate = self.engine.native
        if not stream.state.get("started"):  # the first audio of the block: its start
            stream.state["started"] = True
            await self.engine.send(AudioStart(rate=rate, width=SAMPLE_WIDTH, channels=1), stream)
        await self.engine.send(AudioChunk(rate=rate, width=SAMPLE_WIDTH, channels=1, audio=data), stream)

    async def ended(self, stream: Stream, seg) -> None:
        if not stream.state["whole"]:  # each segment of a stream is its own block
            await self._stop(stream)

    async def failed(self, stream: Stream, seg, e: Refused) -> None:
        await self.engine.refuse(e, stream)  # the next segment goes on

    async def done(self, stream: Stream) -> None:
        from wyoming.tts import SynthesizeStopped

        if stream.state["whole"]:
            await self._stop(stream)
        else:
            await self.engine.send(SynthesizeStopped(), stream)

    async def _stop(self, stream: Stream) -> None:
        from wyoming.audio import AudioStop

        if stream.state.pop("started", False):
            await self.engine.send(AudioStop(), stream)


class Pcm16:
    """The model's samples as 16-bit PCM, chunk by chunk (no resampling: Wyoming is told the model's rate)."""

    @staticmethod
    def push(samples) -> bytes:
        return pcm16(samples)

    @staticmethod
    def finish() -> bytes:
        return b""


def event_voice(event):
    from wyoming.tts import Synthesize, SynthesizeStart

    kind = SynthesizeStart if SynthesizeStart.is_type(event.type) else Synthesize
    return kind.from_event(event).voice


def event_text(event, what: str) -> str:
    """The `text` of a synthesize / synthesize-chunk event; Refused when it has none or it is not a string."""
    text = (event.data or {}).get("text")
    if not isinstance(text, str):
        got = "no text" if text is None else f"{type(text).__name__} {text!r:.40}"
        raise Refused(f"{what} needs a text string, got {got}", "text", "bad_text")
    return text
