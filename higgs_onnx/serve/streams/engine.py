"""The one stream engine under every text-in door (docs/agents.md "One engine"): the OpenAI-style WebSocket,
Wyoming's streaming synthesis, Cartesia's and ElevenLabs' sockets. A door is a codec (`Codec`): it parses its
messages into open / feed / flush / cancel calls on the engine and words the engine's events in its protocol. The
engine owns everything else, one way for every door:

- **Streams** (a door's contexts; the WebSocket and Wyoming have one at a time): a voice (`SpeechSession`), its text
  steps, a segmenter (`textin.TextSegmenter`) and the queue of segments cut from the text as it arrives (at most
  `wire.MAX_PENDING` characters waiting), at most `max_streams` open on one connection.
- **Speaking**: each stream's speaker task speaks its segments in order: the text steps run off the event loop, the
  segment is submitted (continuing the KV context of the one before), its audio is encoded by the codec's encoder and
  sent as it is made.
- **The kept KV context, one rule**: a segment that ends keeps its KV context (and so its batch slot) for the next
  segment of its stream while that stream waits for text, until a job of any door waits for a slot: then it is given
  back within `wire.STARVED_POLL_S` and the next segment starts again from the voice (`wire.next_segment`). A stream
  that ends, is cancelled or loses its connection gives it back at once.
- **Word timing, one chain**: with words asked for, a finished segment's samples are timed in the aligner pool
  (`job.finish.time_words`: one failure rule, an aligner failure is a cue with no words and a `words_reason`) after
  the segment before's, never holding back the next segment's audio; a flush's answer and the stream's end wait for
  the words before them.
- **Barge-in**: `cancel` marks a stream cancelled (nothing more is sent for it), cancels its tasks and waits for
  them at most `wire.ENDING_S` (`wire.end_tasks`, re-cancelling; a cancel cannot be lost: no await in the stream path
  is `asyncio.wait_for`), then gives back its kept KV context whatever the tasks did.
- **Stalls, leaving and idle time**: every send waits at most the server's --send-timeout (`wire.send_within`); a
  client that stops reading, leaves or whose connection fails ends the connection, and every stream is cancelled as
  above before `run` returns. A connection idle for `idle_s` with nothing being spoken (no segment, and no words
  still being timed) is told so and closed.
- **Failures**: a segment's failure (`wire.segment_failure`) is worded by the codec, which says whether its stream
  goes on (the WebSocket, Wyoming) or ends (the agent sockets); the server stopping ends the connection; a failure of
  the server's own is logged once with its traceback and the client told in one line.

`OPEN` counts connections in their loop and streams open over the process (`/health`'s `streams`): a leak shows.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field

from ...job.finish import joined, time_words
from ...textin import TextSegmenter
from ..scheduler import ShuttingDown
from .wire import BadFrame, SegmentQueue, Stalled, buffered, end_tasks, next_segment, segment_failure, send_within

log = logging.getLogger(__name__)
MAX_ID = 256  # characters of a stream (context) id
ENDED_KEPT = 1024  # ended stream ids remembered per connection (a late message for one is told it ended)
OPEN = {"sockets": 0, "streams": 0}  # connections in their loop and streams open, over the process (/health)


class Refused(Exception):
    """What a door refuses: one line, the field it is about, a code, the stream it concerns, and `kind` (a segment's
    failure: client, busy, stopping, server; None for a message refused before any work)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value",
                 stream: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.stream, self.kind = message, param, code, stream, kind


class Close(Exception):
    """End the connection (`code`: the WebSocket close code), after the error message the door sent."""

    def __init__(self, code: int = 1008):
        super().__init__(code)
        self.code = code


class Flush:
    """A marker in a stream's queue: what came before it is spoken (`n`: the flush's number)."""

    def __init__(self, n: int):
        self.n = n


@dataclass
class Segment:
    """One segment being spoken: its text as sent and as the model reads it (after the text steps), where it starts
    on its stream's clock (samples at the model's rate), what was sent of it."""

    index: int
    text: str
    read: str = ""
    start: int = 0
    bytes: int = 0
    failed: bool = False
    stop: str | None = None  # the decoder's stop reason
    continued: bool = False  # it continued the KV context of the segment before
    held: list = field(default_factory=list)  # its samples, while its words are to be timed


class Stream:
    """One stream of text in one voice (an agent's context, a WebSocket session, a Wyoming synthesis)."""

    def __init__(self, sid: str, session, reader=None, words: str | None = None, granularity: str = "sentence",
                 delay_s: float | None = None, settings: dict | None = None):
        self.id, self.session, self.reader, self.words = sid, session, reader, words
        self.settings = settings or {}  # what the door fixes per stream (it checks later messages against them)
        self.segmenter = TextSegmenter(granularity)
        self.queue = SegmentQueue()
        self.delay_s = delay_s  # speak held text after this long without more (None: wait for a flush)
        self.timer: asyncio.TimerHandle | None = None
        self.offset = 0  # samples (the model's rate) spoken so far: where the next segment starts
        self.index = 0  # segments taken so far
        self.task: asyncio.Task | None = None
        self.words_tail: asyncio.Task | None = None  # the last segment's word timing (each waits for the one before)
        self.encoder = None  # the door's encoder for this stream (`Codec.encoder`)
        self.flushes = 0
        self.flushed = False  # a flush came (ElevenLabs: a close after one ends the turn instead of cutting it)
        self.ending = False  # its input is over: no more text
        self.cancelled = False
        self.busy = False  # a segment is being spoken
        self.state: dict = {}  # the door's own per-stream values

    def speaking(self) -> bool:
        """A segment is being spoken, one waits, or its words are still being timed (owed to the client)."""
        return self.busy or not self.queue.empty() or (self.words_tail is not None and not self.words_tail.done())


class Codec:
    """A door's protocol: it reads messages (`handle`) and words the engine's events. Subclasses set `name` (the
    door, as the options table and the logs name it) and override what their protocol says."""

    name = "stream"
    text_field = "text"  # the field that carries a stream's text (a segment's own failure names it)
    max_streams = 1
    frame_limit = 65536  # characters of one JSON message
    idle_code = 1000  # the close code after an idle timeout
    one_stream = False  # the connection ends when its stream does (the OpenAI-style WebSocket, stream-input)
    failure_codes = {"client": "invalid_value", "busy": "rate_limit_exceeded", "server": "server_error",
                     "stopping": "shutting_down"}  # a segment's failure by kind, when it has no code of its own

    def __init__(self, engine: Engine):
        self.engine = engine

    async def opened(self) -> None:
        """Before the message loop (the WebSocket reads its session.config here)."""

    async def handle(self, msg) -> None:
        raise NotImplementedError

    def encoder(self, stream: Stream):
        """An object with push(samples) -> bytes and finish() -> bytes for a segment of `stream`."""
        raise NotImplementedError

    async def started(self, stream: Stream, seg: Segment) -> None:
        """A segment starts (before its audio)."""

    async def audio(self, stream: Stream, seg: Segment, data: bytes) -> None:
        raise NotImplementedError

    async def ended(self, stream: Stream, seg: Segment) -> None:
        """A segment's audio is all sent (or it failed: `seg.failed`)."""

    async def failed(self, stream: Stream, seg: Segment, e: Refused) -> None:
        """A segment could not be spoken (`e.kind`); raise to end the stream, return to go on."""
        raise e

    async def words(self, stream: Stream, seg: Segment, cue) -> None:
        """A segment's words, timed (`cue.words`; `cue.words_reason` when there are none)."""

    async def flushed(self, stream: Stream, n: int) -> None:
        """Everything before flush `n` is spoken (its words sent)."""

    async def done(self, stream: Stream) -> None:
        """The stream's input was all spoken."""

    @classmethod
    def error(cls, e: Refused):
        """The message that tells the client of `e`."""
        raise NotImplementedError

    @classmethod
    def lost(cls, message: str):
        """The last message on a socket whose replica was lost (serve/ray_proxy.py)."""
        return cls.error(Refused(message, None, "replica_lost", kind="server"))

    def idle(self, seconds: float) -> Refused:
        return Refused(f"idle for {seconds:g} s with nothing to speak", None, "idle_timeout")

    def failure(self, e: Exception) -> Refused:
        """A failure of the server's own, as the one line the client gets."""
        return Refused(f"the socket failed ({type(e).__name__}); the server log has the details", None,
                       "server_error")


class Transport:
    """How a connection's messages come and go (a WebSocket's JSON frames, Wyoming's events)."""

    async def receive(self, limit: int):
        """The next message (None: the client left); BadFrame for one that is not a message."""
        raise NotImplementedError

    async def send(self, obj) -> None:
        """Send one message; ConnectionError when the connection is closed."""
        raise NotImplementedError

    async def close(self, code: int | None) -> None:
        """Close the connection (`code` None: the client is gone or stalled)."""


class Engine:
    """One connection: its streams, and the loop that reads the client's messages into its codec."""

    def __init__(self, transport: Transport, codec_type, svc, idle_s: float | None, send_s: float,
                 native: int, label: str | None = None):
        self.transport, self.svc, self.idle_s, self.send_s, self.native = transport, svc, idle_s, send_s, native
        self.codec = codec_type(self)
        self.label = label or self.codec.name
        self.streams: dict[str, Stream] = {}
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> how it ended
        self.send_lock = asyncio.Lock()
        self.fatal: asyncio.Future = asyncio.get_running_loop().create_future()  # the connection cannot go on

    # -- sending -------------------------------------------------------------------------------------------------
    async def send(self, obj, stream: Stream | None = None) -> None:
        """One message (nothing for None or for a cancelled stream); Stalled when the client reads nothing for the
        send timeout, ConnectionError when it left."""
        if obj is None:
            return
        async with self.send_lock:
            if stream is not None and stream.cancelled:
                return
            await send_within(self.transport.send(obj), self.send_s)

    async def refuse(self, e: Refused, stream: Stream | None = None) -> None:
        await self.send(self.codec.error(e), stream)

    def lost(self, e: BaseException) -> None:
        """The connection cannot go on (the client left or stalled, the server is stopping, its one stream ended):
        its loop ends on `e`."""
        if not self.fatal.done():
            self.fatal.set_exception(e)
            self.fatal.exception()  # read here: the loop may have ended already, and nobody else would

    # -- the loop ------------------------------------------------------------------------------------------------
    async def receive(self, timeout: float | None = None, limit: int | None = None):
        """The next message (None: the client left); TimeoutError after `timeout` (default: idle_s); Refused for a
        frame that is not a message; the connection's end (`lost`) as its exception."""
        receiving = asyncio.ensure_future(self.transport.receive(limit or self.codec.frame_limit))
        try:
            done, _ = await asyncio.wait({receiving, self.fatal}, timeout=self.idle_s if timeout is None else timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not receiving.done():
                receiving.cancel()
        if receiving in done:
            try:
                return receiving.result()
            except BadFrame as e:
                raise Refused(e.message, None, e.code) from None
        if self.fatal in done:
            raise self.fatal.exception() or ConnectionError("the connection ended")
        raise TimeoutError

    async def run(self) -> None:
        """Read messages until the client leaves, stalls or closes; however it ends, every stream is cancelled (its
        job stopped, its slot and kept KV context freed) before this returns. One log line."""
        code: int | None = 1000
        OPEN["sockets"] += 1
        try:
            await self.codec.opened()
            while True:
                try:
                    msg = await self.receive()
                except TimeoutError:
                    if any(s.speaking() for s in self.streams.values()):
                        continue  # speaking: the client waits for audio, it is not idle
                    await self.refuse(self.codec.idle(self.idle_s))
                    raise Close(self.codec.idle_code) from None
                except Refused as e:
                    await self.refuse(e)
                    continue
                if msg is None:
                    raise ConnectionError("the client left")
                try:
                    await self.codec.handle(msg)
                except Refused as e:
                    await self.refuse(e)
        except Close as e:
            code = e.code
        except ShuttingDown:
            code = 1012  # service restart: the client may reconnect
        except Stalled as e:
            code = None
            log.warning("%s: %s; its streams cancelled, their slots freed", self.label, e)
        except ConnectionError as e:
            code = None
            log.info("%s: the client left (%s)", self.label, type(e).__name__)
        except Exception as e:  # noqa: BLE001 - a failure of the server's own: logged once, the connection closes
            code = 1011
            log.error("%s failed", self.label, exc_info=e)
            try:
                await self.refuse(self.codec.failure(e))
            except Exception:  # noqa: BLE001 - the client may be gone too
                code = None
        finally:
            try:
                await self.cancel(*self.streams.values(), how="ended with its connection")
            finally:
                OPEN["sockets"] -= 1
        await self.transport.close(code)

    # -- streams -------------------------------------------------------------------------------------------------
    def check_id(self, sid, param: str = "context_id") -> str:
        if not isinstance(sid, str) or not sid:
            raise Refused(f"{param} must be a non-empty string, got {sid!r:.40}", param, "invalid_value")
        if len(sid) > MAX_ID:
            raise Refused(f"{param} is {len(sid)} characters long; the limit is {MAX_ID}", param,
                          "string_above_max_length")
        if not sid.isprintable():
            raise Refused(f"{param} must be printable characters", param, "invalid_value")
        return sid

    def check_new(self, sid: str, param: str = "context_id") -> None:
        """Refused when a stream `sid` may not be opened now: it ended already, or too many are open."""
        if sid in self.ended:
            raise Refused(f"context {sid!r:.60} {self.ended[sid]}; a new turn needs a new {param}", param,
                          "context_closed", sid)
        if len(self.streams) >= self.codec.max_streams:
            raise Refused(f"{len(self.streams)} contexts are open on this socket; at most {self.codec.max_streams} "
                          f"may be: finish or cancel one first", param, "too_many_contexts", sid)

    def open(self, stream: Stream) -> Stream:
        """Start speaking `stream` (its speaker task waits for segments)."""
        self.streams[stream.id] = stream
        OPEN["streams"] += 1
        stream.task = asyncio.create_task(self.speak(stream))
        return stream

    def _end(self, stream: Stream, how: str) -> None:
        if self.streams.get(stream.id) is stream:
            del self.streams[stream.id]
            OPEN["streams"] -= 1
        self.ended[stream.id] = how
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    def feed(self, stream: Stream, text: str) -> None:
        """Text for `stream`: its complete segments are queued; the rest waits (for more, a flush, or `delay_s`).
        TextTooLong past the bound on text waiting to be spoken (nothing of `text` queued)."""
        stream.queue.put(stream.segmenter.feed(text), buffered(stream.segmenter))
        self._arm(stream)

    def _arm(self, stream: Stream) -> None:
        """Speak what the segmenter holds once `delay_s` passes with no more text (Cartesia's max_buffer_delay_ms)."""
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if stream.delay_s is not None and buffered(stream.segmenter) and not stream.ending:
            stream.timer = asyncio.get_running_loop().call_later(stream.delay_s, self._flush_held, stream)

    def _flush_held(self, stream: Stream) -> None:
        stream.timer = None
        if not stream.cancelled and not stream.ending:
            stream.queue.put(stream.segmenter.flush())

    def flush(self, stream: Stream, final: bool = False, marked: bool = False, drop_held: bool = False) -> None:
        """Speak what `stream` holds now (`drop_held`: drop it instead); `final`: its input is over (its end follows
        what is queued); `marked`: the codec's `flushed` follows what is queued."""
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if stream.ending:
            return
        held = stream.segmenter.flush()
        if not drop_held:
            stream.queue.put(held)
        if marked:
            stream.flushes += 1
            stream.queue.mark(Flush(stream.flushes))
        if final:
            stream.ending = True
            stream.queue.end()

    async def finish(self, stream: Stream) -> None:
        """Wait until `stream` has spoken all its input (after a final flush)."""
        if stream.task is not None:
            await asyncio.shield(stream.task)

    async def cancel(self, *streams: Stream, how: str = "was cancelled") -> None:
        """Barge-in: nothing more is sent for `streams`; their tasks are cancelled (a job's slot leaves the batch at
        the next decoder step) and waited for at most wire.ENDING_S (`end_tasks`); then, whatever the tasks did,
        their kept KV contexts are given back and the streams end."""
        streams = list(streams)
        for s in streams:
            s.cancelled = True
            if s.timer is not None:
                s.timer.cancel()
        try:
            await end_tasks([t for s in streams for t in (s.task, s.words_tail)], self.label)
        finally:
            for s in streams:
                s.session.close()
                self._end(s, how)

    # -- speaking ------------------------------------------------------------------------------------------------
    async def speak(self, stream: Stream) -> None:
        """The stream's segments in order, then its end; a failure the codec raises ends the stream (its message
        sent); the connection's own failures end the connection."""
        try:
            while (item := await next_segment(stream.queue, stream.session, f"{self.label} {stream.id}")) is not None:
                if isinstance(item, Flush):
                    await self._words_sent(stream)
                    await self.codec.flushed(stream, item.n)
                    continue
                await self.segment(stream, item)
            await self._words_sent(stream)
            await self.codec.done(stream)
            how = "is done"
        except asyncio.CancelledError:
            raise
        except Refused as e:
            await self.refuse(e, stream)
            how = "ended on an error"
        except (Stalled, ConnectionError, ShuttingDown) as e:
            self.lost(e)
            how = "ended with the socket"
        except Exception as e:  # noqa: BLE001 - a failure of the server's own: logged, the stream ends
            log.error("%s stream %s failed", self.label, stream.id, exc_info=e)
            await self.refuse(Refused(f"speech generation failed ({type(e).__name__}); the server log has the "
                                      "details", None, "server_error", stream.id, "server"), stream)
            how = "ended on an error"
        stream.session.close()
        if not stream.cancelled:
            self._end(stream, how)
            if self.codec.one_stream:
                self.lost(Close(1000))  # its one stream is over: so is the connection

    async def _words_sent(self, stream: Stream) -> None:
        if stream.words_tail is not None:
            await stream.words_tail

    async def segment(self, stream: Stream, text: str) -> None:
        """One segment: its audio sent as it is made, its words timed once it is whole (in the background)."""
        stream.busy = True
        try:
            await self._segment(stream, text)
        finally:
            stream.busy = False

    async def _segment(self, stream: Stream, text: str) -> None:
        seg = Segment(stream.index, text, start=stream.offset)
        stream.index += 1
        codec = self.codec
        await codec.started(stream, seg)
        try:  # the text steps, off the event loop (a segment may be up to the stream's text bound)
            seg.read = await asyncio.to_thread(stream.reader, text) if stream.reader is not None else text
            enc = codec.encoder(stream)
            async for chunk in stream.session.speak(seg.read):
                if data := enc.push(chunk.samples):
                    seg.bytes += len(data)
                    await codec.audio(stream, seg, data)
                stream.offset += chunk.samples.size
                if stream.words is not None:
                    seg.held.append(chunk.samples)
                if chunk.is_last and chunk.stats is not None:
                    seg.stop = chunk.stats.stop_reason
            if data := enc.finish():
                seg.bytes += len(data)
                await codec.audio(stream, seg, data)
        except (asyncio.CancelledError, Stalled, ConnectionError):
            raise
        except Exception as e:  # noqa: BLE001 - wire.segment_failure says which failures are whose
            kind, message, code = segment_failure(e, f"{self.label} {stream.id}")
            seg.failed = True
            await codec.failed(stream, seg, Refused(message, codec.text_field if kind == "client" else None,
                                                    code or codec.failure_codes[kind], stream.id, kind))
            if kind == "stopping":
                raise ShuttingDown(message) from None
        seg.continued = stream.session.last_continued
        await codec.ended(stream, seg)
        if stream.words is not None and not seg.failed:
            from ...longform.captions import Cue

            cue = Cue(seg.start, stream.offset, seg.read, index=seg.index)
            samples, seg.held = joined(seg.held), []
            stream.words_tail = asyncio.create_task(self._time_words(stream, seg, cue, samples, stream.words_tail))

    async def _time_words(self, stream: Stream, seg: Segment, cue, samples, before: asyncio.Task | None) -> None:
        """Send `cue`'s words once timed (after the segment before's)."""
        if before is not None:
            await before
        cue = await time_words(cue, samples, self.native, stream.words)
        try:
            await self.codec.words(stream, seg, cue)
        except (Stalled, ConnectionError) as e:  # the connection's loop ends on it; nothing raised here, where
            self.lost(e)  # nobody may wait for this task any more
