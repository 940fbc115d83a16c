"""What the voice-agent doors share (Cartesia's `/tts/websocket`, ElevenLabs' `multi-stream-input`): several
*contexts* on one WebSocket, one per agent turn, each with its own voice, text steps and KV continuation, text
streamed in as an LLM writes it, audio streamed out as it is made, the words of each segment timed on its own
samples, and a cancel (barge-in) that stops a context within one decoder step.

A protocol (`cartesia.py`, `elevenlabs.py`) reads its messages and words its answers; this module keeps the contexts:

- `AgentSocket.open` makes a context (at most MAX_CONTEXTS open on one socket, ids of at most MAX_ID characters) with
  a `SpeechSession` of the server's scheduler; `feed` cuts its text into segments (`textin.TextSegmenter`), `flush`
  speaks what it holds now (`final`: and ends its input), `cancel` stops it.
- Each context's speaker task speaks its segments in order and sends each chunk as it comes (resampled and encoded
  for the socket's output, `Output`). When a segment's audio is whole its words are timed in the aligner pool
  (`job.run.aligned`, one niced thread for the whole server) and sent when timed: never before the next segment's
  audio, which goes on meanwhile. The context's end (`done` / `isFinal`) waits for its last words.
- A context keeps its segment's KV context for the next segment only when that one is already queued: one waiting
  for more text holds no batch slot (the next segment then starts afresh from the voice).
- A cancel marks the context cancelled (nothing more is sent for it), cancels its speaker task, which cancels the
  segment's job (its slot leaves the batch at the next decoder step) and gives back the kept KV context.
- A client that stops reading (a send waits the server's --send-timeout) or leaves ends the socket: every context is
  cancelled as above. An error in one context ends that context (an error message names it); the others go on.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import logging
from dataclasses import dataclass

import numpy as np

from ..job.run import aligned, joined
from ..longform.captions import Cue
from ..textin import TextSegmenter
from .limits import MAX_JSON_BYTES
from .scheduler import ShuttingDown
from .segments import (
    BadFrame,
    SegmentQueue,
    Stalled,
    buffered,
    end_tasks,
    json_object,
    segment_failure,
    send_within,
    within,
)

log = logging.getLogger(__name__)
MAX_CONTEXTS = 8  # open at once on one socket (ElevenLabs allows 5): each may keep a KV context between segments
MAX_ID = 256  # characters of a context id
ENDED_KEPT = 1024  # ended context ids remembered per socket (a late message for one is told it ended)
RATES = (8000, 16000, 22050, 24000, 44100, 48000)
ENCODINGS = {"pcm_s16le": "16-bit", "pcm_f32le": "32-bit float"}
OPEN = {"sockets": 0, "contexts": 0}  # agent sockets in their loop and contexts open, over the process (/health)


class AgentError(Exception):
    """A message the socket refuses: one line, the field it is about, a code, and the context it concerns."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value",
                 context: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.context = message, param, code, context


class Close(Exception):
    """End the socket (`code`: the WebSocket close code) after an error message."""

    def __init__(self, code: int = 1008):
        super().__init__(code)
        self.code = code


@dataclass(frozen=True)
class Output:
    """The socket's audio: raw little-endian PCM (`encoding`, a key of ENCODINGS) at `rate` Hz, mono."""

    encoding: str
    rate: int

    @staticmethod
    def check(encoding, rate, native: int, params: tuple[str, str] = ("output_format", "output_format"),
              context: str | None = None) -> Output:
        """The output, or AgentError naming `params` (the encoding's field, the rate's)."""
        if not isinstance(encoding, str) or encoding not in ENCODINGS:
            raise AgentError(f"{params[0]}: encoding {encoding!r:.40} is not served here; use one of "
                             f"{', '.join(ENCODINGS)}", params[0], "unsupported_format", context)
        if isinstance(rate, bool) or not isinstance(rate, int) or rate not in RATES:
            raise AgentError(f"{params[1]}: sample_rate {rate!r:.40} is not served here; use one of "
                             f"{', '.join(map(str, RATES))} (the model speaks at {native})", params[1],
                             "unsupported_format", context)
        return Output(encoding, rate)

    def stream(self, native: int) -> PcmStream:
        return PcmStream(self, native)


class PcmStream:
    """One context's audio as bytes: resampled from the model's rate as it comes (soxr's streaming resampler, so
    chunk edges leave no seams), then encoded."""

    def __init__(self, output: Output, native: int):
        self.output, self.native = output, native
        self.resampler = self._resampler()

    def _resampler(self):
        import soxr

        if self.output.rate == self.native:
            return None
        return soxr.ResampleStream(self.native, self.output.rate, 1, dtype="float32", quality="HQ")

    def _encode(self, samples: np.ndarray) -> bytes:
        if self.output.encoding == "pcm_f32le":
            return np.clip(samples, -1.0, 1.0).astype("<f4").tobytes()
        return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()

    def push(self, samples: np.ndarray) -> bytes:
        samples = samples.astype(np.float32, copy=False)
        if self.resampler is not None:
            samples = self.resampler.resample_chunk(samples, last=False)
        return self._encode(samples) if samples.size else b""

    def finish(self) -> bytes:
        """What the resampler still holds (a segment's end: the next segment starts afresh, so each segment's
        audio is as long as it is at the model's rate and its words' times hold on the client's clock)."""
        if self.resampler is None:
            return b""
        tail = self.resampler.resample_chunk(np.zeros(0, np.float32), last=True)
        self.resampler = self._resampler()
        return self._encode(tail) if tail.size else b""


class Flush:
    """A marker in a context's queue: what came before it is spoken (`n`: the flush's number)."""

    def __init__(self, n: int):
        self.n = n


class Context:
    """One agent turn: its session (voice, options, kept KV context), its text and its audio."""

    def __init__(self, cid: str, session, reader, output: Output, native: int, words: str | None,
                 granularity: str = "sentence", delay_s: float | None = None, settings: dict | None = None):
        self.id, self.session, self.reader, self.words = cid, session, reader, words
        self.settings = settings or {}  # what the protocol fixes per context (checked on every later message)
        self.segmenter = TextSegmenter(granularity)
        self.queue = SegmentQueue()
        self.stream = output.stream(native)
        self.delay_s = delay_s  # speak buffered text after this long without more (None: wait for a flush)
        self.timer: asyncio.TimerHandle | None = None
        self.offset = 0  # samples (the model's rate) sent so far: where the next segment's words start
        self.task: asyncio.Task | None = None
        self.words_tail: asyncio.Task | None = None  # the last segment's word timing (each waits for the one before)
        self.flushes = 0
        self.flushed = False  # a flush came (ElevenLabs: a close after one ends the turn instead of cutting it)
        self.ending = False  # its input is over (a final flush): no more text
        self.cancelled = False
        self.busy = False  # a segment is being spoken


class AgentSocket:
    """One socket of a voice-agent protocol: its contexts, and the loop that reads the client's messages.
    Subclasses read messages (`handle`) and word the answers (`audio_message`, `words_message`, `done_message`,
    `flushed_message`, `error_message`)."""

    name = "agent"
    text_field = "text"  # the field that carries a context's text (a segment's own failure names it)

    def __init__(self, ws, svc, idle_s: float):
        self.ws, self.svc, self.idle_s = ws, svc, idle_s
        self.send_s = svc.timeouts.send_s
        self.native = svc.sample_rate
        self.contexts: dict[str, Context] = {}
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> how it ended
        self.send_lock = asyncio.Lock()
        self.fatal: asyncio.Future = asyncio.get_running_loop().create_future()  # a context's send failed

    # -- answers (the protocol's words) ----------------------------------------------------------------------
    def audio_message(self, ctx: Context, data: bytes) -> dict:
        raise NotImplementedError

    def words_message(self, ctx: Context, cue: Cue) -> dict | None:
        raise NotImplementedError

    def done_message(self, ctx: Context) -> dict | None:
        raise NotImplementedError

    def flushed_message(self, ctx: Context, n: int) -> dict | None:
        return None

    def error_message(self, e: AgentError) -> dict:
        raise NotImplementedError

    async def handle(self, msg: dict) -> None:
        raise NotImplementedError

    # -- sending ---------------------------------------------------------------------------------------------
    async def send(self, obj: dict | None, ctx: Context | None = None) -> None:
        """One JSON message (nothing for a cancelled context); Stalled when the client reads nothing for the
        send timeout."""
        if obj is None:
            return
        from starlette.websockets import WebSocketDisconnect, WebSocketDisconnected

        async with self.send_lock:
            if ctx is not None and ctx.cancelled:
                return
            try:
                await send_within(self.ws.send_text(json.dumps(obj)), self.send_s)
            except (WebSocketDisconnect, WebSocketDisconnected):  # the client left, or the socket closed
                raise ConnectionError("the socket is closed") from None

    async def refuse(self, e: AgentError) -> None:
        await self.send(self.error_message(e))

    @staticmethod
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")

    # -- the socket's loop -----------------------------------------------------------------------------------
    async def receive(self) -> dict | None:
        """The next JSON object (None: the client left); AgentError for a frame that is not one."""
        receiving = asyncio.ensure_future(self.ws.receive())
        done, _ = await asyncio.wait({receiving, self.fatal}, timeout=self.idle_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if self.fatal in done:
            receiving.cancel()
            raise self.fatal.exception() or ConnectionError("the socket ended")
        if not done:
            receiving.cancel()
            raise TimeoutError
        msg = receiving.result()
        if msg["type"] == "websocket.disconnect":
            return None
        try:
            return json_object(msg, MAX_JSON_BYTES)
        except BadFrame as e:
            raise AgentError(e.message, None, e.code) from None

    async def run(self) -> None:
        """Read messages until the client leaves, stalls or closes; however it ends, every context is cancelled
        (its job stopped, its slot and kept KV context freed) before this returns. One log line."""
        from fastapi import WebSocketDisconnect

        code: int | None = 1000
        OPEN["sockets"] += 1
        try:
            while True:
                try:
                    msg = await self.receive()
                except TimeoutError:
                    if any(c.busy or not c.queue.empty() for c in self.contexts.values()):
                        continue  # speaking: the client waits for audio, it is not idle
                    await self.refuse(AgentError(f"idle for {self.idle_s:g} s with nothing to speak", None,
                                                 "idle_timeout"))
                    raise Close(1000) from None
                except AgentError as e:
                    await self.refuse(e)
                    continue
                if msg is None:
                    raise ConnectionError("the client left")
                try:
                    await self.handle(msg)
                except AgentError as e:
                    await self.refuse(e)
        except Close as e:
            code = e.code
        except ShuttingDown:
            code = 1012
        except Stalled as e:
            code = None
            log.warning("%s socket: %s; its contexts cancelled, their slots freed", self.name, e)
        except (WebSocketDisconnect, ConnectionError) as e:
            code = None
            log.info("%s socket: the client left (%s)", self.name, type(e).__name__)
        except Exception as e:  # noqa: BLE001 - a failure of the server's own: logged once, the socket closes
            code = 1011
            log.error("%s socket failed", self.name, exc_info=e)
            try:
                await self.refuse(AgentError(f"the socket failed ({type(e).__name__}); the server log has the details",
                                             None, "server_error"))
            except Exception:  # noqa: BLE001 - the client may be gone too
                code = None
        finally:
            try:
                await self.cancel(*self.contexts.values(), how="the socket closed")
            finally:
                OPEN["sockets"] -= 1
        if code is not None:
            try:
                await within(self.ws.close(code), 1.0)
            except Exception:  # noqa: BLE001 - closed already, or the client reads nothing
                pass

    # -- contexts --------------------------------------------------------------------------------------------
    async def session_of(self, values: dict) -> tuple:
        """(session, text steps, options) of a context whose job fields are `values` (our names, mapped from the
        protocol's: `job.options.AGENT_FIELDS`); AgentError naming the protocol's field for a bad one."""
        from ..job.options import OPTIONS, OptionError, Shape, SpeechOptions
        from ..job.run import SpeechJob
        from .http import ApiError

        svc, tags = self.svc, self.svc.tts.tokens.control_tags

        def named(param):
            return OPTIONS[param].label(self.name) if param in OPTIONS else param

        def job_of():  # off the loop: the text steps may load a lexicon or a normalizer
            options = SpeechOptions.build(values, self.name, svc.base)
            return options, SpeechJob(options, tags, self.name)

        try:
            options, job = await asyncio.to_thread(job_of)
            voice = await svc.resolve_voice(values.get("voice"))
            job.check(Shape(voices=getattr(voice, "width", 1), continues=True))
        except OptionError as e:
            raise AgentError(e.message, named(e.param), e.code) from None
        except ApiError as e:
            raise AgentError(e.message, named(e.param), e.code or "invalid_value") from None
        return svc.speech_session(voice, options.generation, job.lead), job.reader(), options

    def check_id(self, cid, param: str = "context_id") -> str:
        if not isinstance(cid, str) or not cid:
            raise AgentError(f"{param} must be a non-empty string, got {cid!r:.40}", param, "invalid_value")
        if len(cid) > MAX_ID:
            raise AgentError(f"{param} is {len(cid)} characters long; the limit is {MAX_ID}", param,
                             "string_above_max_length")
        if not cid.isprintable():
            raise AgentError(f"{param} must be printable characters", param, "invalid_value")
        return cid

    def check_new(self, cid: str, param: str = "context_id") -> None:
        """AgentError when a context `cid` may not be opened now: it ended already, or too many are open."""
        if cid in self.ended:
            raise AgentError(f"context {cid!r:.60} {self.ended[cid]}; a new turn needs a new {param}", param,
                             "context_closed", cid)
        if len(self.contexts) >= MAX_CONTEXTS:
            raise AgentError(f"{len(self.contexts)} contexts are open on this socket; at most {MAX_CONTEXTS} may be: "
                             f"finish or cancel one first", param, "too_many_contexts", cid)

    def add(self, ctx: Context) -> Context:
        self.contexts[ctx.id] = ctx
        OPEN["contexts"] += 1
        ctx.task = asyncio.create_task(self.speak(ctx))
        return ctx

    def end(self, ctx: Context, how: str) -> None:
        if self.contexts.get(ctx.id) is ctx:
            del self.contexts[ctx.id]
            OPEN["contexts"] -= 1
        self.ended[ctx.id] = how
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    async def feed(self, ctx: Context, text: str, param: str) -> None:
        """Text for `ctx`: its complete segments are queued; the rest waits (for more, a flush, or `delay_s`). Past
        the bound on text waiting to be spoken the context is cancelled (nothing of it queued) and refused."""
        if not isinstance(text, str):
            raise AgentError(f"{param} must be a string, got {type(text).__name__}", param, "invalid_value", ctx.id)
        if ctx.ending:
            raise AgentError(f"context {ctx.id!r:.60} has ended its input; a new turn needs a new context", param,
                             "context_closed", ctx.id)
        try:
            ctx.queue.put(ctx.segmenter.feed(text), buffered(ctx.segmenter))
        except ValueError as e:  # too much waiting to be spoken: this context cannot go on as sent
            await self.cancel(ctx, how="was refused (text_too_long)")
            raise AgentError(str(e), param, "text_too_long", ctx.id) from None
        self._arm(ctx)

    def _arm(self, ctx: Context) -> None:
        """Speak what the segmenter holds once `delay_s` passes with no more text (Cartesia's max_buffer_delay_ms)."""
        if ctx.timer is not None:
            ctx.timer.cancel()
            ctx.timer = None
        if ctx.delay_s is not None and buffered(ctx.segmenter) and not ctx.ending:
            ctx.timer = asyncio.get_running_loop().call_later(ctx.delay_s, self._flush_held, ctx)

    def _flush_held(self, ctx: Context) -> None:
        ctx.timer = None
        if not ctx.cancelled and not ctx.ending:
            ctx.queue.put(ctx.segmenter.flush())

    def flush(self, ctx: Context, final: bool, marked: bool = False) -> None:
        """Speak what `ctx` holds now; `final`: its input is over (its end is sent once all is spoken); `marked`:
        a flush answer follows what is queued."""
        if ctx.timer is not None:
            ctx.timer.cancel()
            ctx.timer = None
        if ctx.ending:
            return
        ctx.queue.put(ctx.segmenter.flush())
        if marked:
            ctx.flushes += 1
            ctx.queue.mark(Flush(ctx.flushes))
        if final:
            ctx.ending = True
            ctx.queue.end()

    async def cancel(self, *ctxs: Context, how: str = "was cancelled") -> None:
        """Barge-in: nothing more is sent for `ctxs`; their tasks are cancelled (a job's slot leaves the batch at the
        next decoder step) and waited for at most segments.ENDING_S (`end_tasks`); then, whatever the tasks did,
        their kept KV contexts are given back and the contexts end."""
        ctxs = list(ctxs)
        for ctx in ctxs:
            ctx.cancelled = True
            if ctx.timer is not None:
                ctx.timer.cancel()
        try:
            await end_tasks([t for ctx in ctxs for t in (ctx.task, ctx.words_tail)], f"{self.name} socket")
        finally:
            for ctx in ctxs:
                ctx.session.close()
                self.end(ctx, how)

    def lost(self, e: BaseException) -> None:
        """The socket cannot go on (the client left or stalled, the server is stopping): its loop ends on `e`."""
        if not self.fatal.done():
            self.fatal.set_exception(e)
            self.fatal.exception()  # read here: the loop may have ended already, and nobody else would

    async def speak(self, ctx: Context) -> None:
        """The context's segments in order, then its end; an error ends the context (the message names it)."""
        from fastapi import WebSocketDisconnect

        try:
            while (item := await ctx.queue.next()) is not None:
                if isinstance(item, Flush):
                    if ctx.words_tail is not None:
                        await ctx.words_tail
                    await self.send(self.flushed_message(ctx, item.n), ctx)
                    continue
                await self.segment(ctx, item)
            if ctx.words_tail is not None:
                await ctx.words_tail
            await self.send(self.done_message(ctx), ctx)
            how = "is done"
        except asyncio.CancelledError:
            raise
        except AgentError as e:
            await self.send(self.error_message(e), ctx)
            how = "ended on an error"
        except (Stalled, ConnectionError, ShuttingDown, WebSocketDisconnect) as e:
            self.lost(e)
            how = "ended with the socket"
        except Exception as e:  # noqa: BLE001 - a failure of the server's own: logged, the context ends
            log.error("%s context %s failed", self.name, ctx.id, exc_info=e)
            await self.send(self.error_message(AgentError(f"speech generation failed ({type(e).__name__}); the "
                                                          "server log has the details", None, "server_error",
                                                          ctx.id)), ctx)
            how = "ended on an error"
        ctx.session.close()
        if not ctx.cancelled:
            self.end(ctx, how)

    async def segment(self, ctx: Context, text: str) -> None:
        """One segment: its audio sent as it is made, its words timed once it is whole (in the background)."""
        ctx.busy = True
        try:
            await self._segment(ctx, text)
        finally:
            ctx.busy = False

    async def _segment(self, ctx: Context, text: str) -> None:
        from fastapi import WebSocketDisconnect

        read = await asyncio.to_thread(ctx.reader, text) if ctx.reader is not None else text
        start, held = ctx.offset, []
        try:
            async for chunk in ctx.session.speak(read):
                if data := ctx.stream.push(chunk.samples):
                    await self.send(self.audio_message(ctx, data), ctx)
                ctx.offset += chunk.samples.size
                if ctx.words is not None:
                    held.append(chunk.samples)
            if data := ctx.stream.finish():
                await self.send(self.audio_message(ctx, data), ctx)
        except (WebSocketDisconnect, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - segments.segment_failure says which failures are whose
            kind, message, code = segment_failure(e, f"{self.name} context {ctx.id}")
            if kind == "stopping":
                raise ShuttingDown(message) from None
            raise AgentError(message, self.text_field if kind == "client" else None,
                             code or {"busy": "rate_limit_exceeded", "server": "server_error"}.get(kind,
                                                                                                "invalid_value"),
                             ctx.id) from None
        if ctx.queue.empty():  # nothing to continue it yet: its KV context must not hold a batch slot while the
            ctx.session.release()  # agent waits (8 idle contexts would starve the server); the next starts afresh
        if ctx.words is not None:
            cue = Cue(start, ctx.offset, read, index=ctx.session.index - 1)
            ctx.words_tail = asyncio.create_task(self.time_words(ctx, cue, joined(held), ctx.words_tail))

    async def time_words(self, ctx: Context, cue: Cue, samples: np.ndarray, before: asyncio.Task | None) -> None:
        """Send `cue`'s words once timed (after the segment before's)."""
        from fastapi import WebSocketDisconnect

        if before is not None:
            await before
        try:
            cue = await aligned(cue, samples, self.native, ctx.words)
        except Exception as e:  # noqa: BLE001 - the aligner failed: the words say so, the audio went on
            log.error("%s context %s: word timing failed", self.name, ctx.id, exc_info=e)
            cue = Cue(cue.start, cue.end, cue.text, index=cue.index, words=(),
                      words_reason=f"word timing failed ({type(e).__name__})")
        try:
            await self.send(self.words_message(ctx, cue), ctx)
        except (Stalled, ConnectionError, WebSocketDisconnect) as e:  # the socket's loop ends on it; nothing raised
            self.lost(e)  # here, where nobody may wait for this task any more


def char_times(text: str, cue: Cue, sample_rate: int) -> dict:
    """ElevenLabs' `alignment` of one segment from its word cues: every character of `text` (then a closing space)
    with a start and a duration in ms from the segment's start. A word's letters share its aligned span; the
    characters between two words share the gap; the closing space runs to the segment's end, so a client that
    advances its clock by each alignment's last character stays on the audio's clock. No words (the aligner could
    not time them): one space over the whole segment."""
    from ..align import word_spans

    ms = 1000.0 / sample_rate
    end = (cue.end - cue.start) * ms
    words = list(cue.words or ())
    spans = word_spans(text)
    if not words or len(spans) != len(words):
        return {"chars": [" "], "charStartTimesMs": [0], "charDurationsMs": [max(1, round(end))]}
    times = [0.0] * len(text)
    durs = [0.0] * len(text)
    prev_end, prev_pos = 0.0, 0
    for (a, b), w in zip(spans, words, strict=True):
        ws, we = (w.start - cue.start) * ms, (w.end - cue.start) * ms
        _spread(times, durs, prev_pos, a, prev_end, ws)  # the gap before the word
        _spread(times, durs, a, b, ws, we)
        prev_end, prev_pos = we, b
    _spread(times, durs, prev_pos, len(text), prev_end, prev_end)
    chars = [*text, " "]
    starts = [round(t) for t in times] + [round(prev_end)]
    lengths = [max(0, round(t + d) - round(t)) for t, d in zip(times, durs, strict=True)]
    lengths.append(max(0, round(end) - round(prev_end)))
    return {"chars": chars, "charStartTimesMs": starts, "charDurationsMs": lengths}


def _spread(times: list, durs: list, a: int, b: int, t0: float, t1: float) -> None:
    n = b - a
    if n <= 0:
        return
    step = max(0.0, t1 - t0) / n
    for i in range(n):
        times[a + i], durs[a + i] = t0 + i * step, step
