"""What the voice-agent codecs share (Cartesia's `/tts/websocket`, ElevenLabs' stream-input sockets): several
contexts on one socket (one per agent turn, each a `Stream` of the engine with its own voice and text steps), raw PCM
out (`pcm.Output`), a context's job built from the options table under the vendor's field names, and the vendor's
API key. The engine does the rest (engine.py)."""

from __future__ import annotations

import asyncio
import base64

from ..limits import MAX_JSON_BYTES
from .engine import Codec, Refused, Stream
from .pcm import PcmStream
from .wire import TextTooLong

MAX_CONTEXTS = 8  # open at once on one socket (ElevenLabs allows 5): each may keep a KV context between segments


class AgentCodec(Codec):
    max_streams = MAX_CONTEXTS
    frame_limit = MAX_JSON_BYTES

    @staticmethod
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")

    def encoder(self, stream: Stream) -> PcmStream:
        return PcmStream(stream.state["output"], self.engine.native)

    async def feed(self, stream: Stream, text, param: str) -> None:
        """Text for a context; past the bound on text waiting to be spoken the context is cancelled (nothing of it
        queued) and refused."""
        if not isinstance(text, str):
            raise Refused(f"{param} must be a string, got {type(text).__name__}", param, "invalid_value", stream.id)
        if stream.ending:
            raise Refused(f"context {stream.id!r:.60} has ended its input; a new turn needs a new context", param,
                          "context_closed", stream.id)
        try:
            self.engine.feed(stream, text)
        except TextTooLong as e:  # this context cannot go on as sent
            await self.engine.cancel(stream, how="was refused (text_too_long)")
            raise Refused(str(e), param, "text_too_long", stream.id) from None

    async def failed(self, stream: Stream, seg, e: Refused) -> None:
        if e.kind != "stopping":  # a failed segment ends its context (the message names it)
            raise e


async def session_of(svc, door: str, values: dict, stream: str | None = None) -> tuple:
    """(session, text steps) of a context (`stream`) whose job fields are `values` (our names, mapped from the
    protocol's: `job.options.AGENT_FIELDS`) at `door`; Refused naming the protocol's field for a bad one."""
    from ...job.options import OPTIONS, OptionError, Shape, SpeechOptions
    from ...job.run import SpeechJob
    from ..http import ApiError

    def named(param):
        return OPTIONS[param].label(door) if param in OPTIONS else param

    def job_of():  # off the loop: the text steps may load a lexicon or a normalizer
        options = SpeechOptions.build(values, door, svc.base)
        return options, SpeechJob(options, svc.tts.tokens.control_tags, door)

    try:
        options, job = await asyncio.to_thread(job_of)
        voice = await svc.resolve_voice(values.get("voice"))
        job.check(Shape(voices=getattr(voice, "width", 1), continues=True))
    except OptionError as e:
        raise Refused(e.message, named(e.param), e.code, stream) from None
    except ApiError as e:
        raise Refused(e.message, named(e.param), e.code or "invalid_value", stream) from None
    return svc.speech_session(voice, options.generation, job.lead), job.reader()


def char_times(text: str, cue, sample_rate: int) -> dict:
    """ElevenLabs' `alignment` of one segment from its word cues: every character of `text` (then a closing space)
    with a start and a duration in ms from the segment's start. A word's letters share its aligned span; the
    characters between two words share the gap; the closing space runs to the segment's end, so a client that
    advances its clock by each alignment's last character stays on the audio's clock. No words (the aligner could
    not time them): one space over the whole segment."""
    from ...align import word_spans

    ms = 1000.0 / sample_rate
    end = (cue.end - cue.start) * ms
    words = list(cue.words or ())
    spans = word_spans(text)
    if not words or len(spans) != len(words):
        return {"chars": [" "], "charStartTimesMs": [0], "charDurationsMs": [max(1, round(end))]}
    times, durs = [0.0] * len(text), [0.0] * len(text)
    prev_end, prev_pos = 0.0, 0
    for (a, b), w in zip(spans, words, strict=True):
        ws, we = (w.start - cue.start) * ms, (w.end - cue.start) * ms
        _spread(times, durs, prev_pos, a, prev_end, ws)  # the gap before the word
        _spread(times, durs, a, b, ws, we)
        prev_end, prev_pos = we, b
    _spread(times, durs, prev_pos, len(text), prev_end, prev_end)
    starts = [round(t) for t in times] + [round(prev_end)]
    lengths = [max(0, round(t + d) - round(t)) for t, d in zip(times, durs, strict=True)]
    lengths.append(max(0, round(end) - round(prev_end)))
    return {"chars": [*text, " "], "charStartTimesMs": starts, "charDurationsMs": lengths}


def _spread(times: list, durs: list, a: int, b: int, t0: float, t1: float) -> None:
    n = b - a
    if n <= 0:
        return
    step = max(0.0, t1 - t0) / n
    for i in range(n):
        times[a + i], durs[a + i] = t0 + i * step, step



def check_key(svc, key, param: str) -> None:
    """A key sent in a message (ElevenLabs' older clients do): it must be the server's, when it has one (the
    socket's own key was checked when it opened)."""
    import hmac

    expected = svc.api_key
    if not isinstance(key, str) or expected is not None and not hmac.compare_digest(key.encode(), expected.encode()):
        raise Refused(f"{param} is not this server's API key", param, "invalid_api_key")


async def accepted(ws, svc, header: str, query: str) -> bool:
    """Accept the socket when its key (the vendor's `header`, or `query` parameter) is the server's; else close it
    before it opens (1008)."""
    if (e := svc.refusal(key_of(ws, header, query), True)) is not None:
        await ws.close(1008, e.message[:120])
        return False
    await ws.accept()
    return True


def key_of(ws, header: str, query: str) -> dict:
    """The request's headers with the vendor's key (its own header, or the query parameter a browser client sends)
    as the `Authorization: Bearer` the service checks."""
    headers = {k.lower(): v for k, v in ws.headers.items()}
    key = ws.headers.get(header) or ws.query_params.get(query)
    if key and "authorization" not in headers:
        headers["authorization"] = f"Bearer {key}"
    return headers
