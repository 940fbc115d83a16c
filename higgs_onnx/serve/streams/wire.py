"""The stream engine's primitives (engine.py, under every text-in door): text arriving in pieces, cut into segments,
spoken one after the other by one `SpeechSession`, and the lifecycle around it.

- `SegmentQueue`: the segments waiting to be spoken, with the one bound on them: at most MAX_PENDING characters
  received and not yet spoken (a client sending far faster than speech is refused with `TextTooLong`).
- `send_within`: every send a door makes waits at most its send timeout (the server's --send-timeout); past it the
  client is taken to have stopped reading (`Stalled`) and the door ends the session, which cancels its job and
  frees its slot and kept context. `within` bounds an await with `asyncio.timeout`, never `asyncio.wait_for`: on
  Python 3.11 wait_for drops a cancel that lands in the same loop iteration as its inner result (CPython gh-86296),
  and a lost cancel leaves a context's speaker running with its slot held; `asyncio.timeout` awaits in the task
  itself and raises TimeoutError only when no other cancel is pending.
- `segment_failure`: why one segment could not be spoken, as one line and a kind (`client`: the segment's own
  fault, the session goes on; `busy`: the server was full; `stopping`: the server is shutting down, the session
  ends; `server`: a failure of the server itself, logged once with its traceback). Each door words the kind in its
  own protocol's codes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable

from ...generation.contract import ContractError, NoAudioError
from ..scheduler import QueueFull, ShuttingDown

log = logging.getLogger(__name__)
STARVED_POLL_S = 0.1  # how often a session waiting for text looks for jobs its kept KV context keeps out
MAX_PENDING = 100_000  # characters received and not yet spoken: more is a client that sends far faster than speech
ENDING_S = 5.0  # how long a cancelled task of a session may take to end before its session is cleaned up without it
RECANCEL_S = 0.5  # a cancelled task still running after this is cancelled again (a lost cancel does not stick)


class Stalled(ConnectionError):
    """The client stopped reading: a send waited past the send timeout."""


class TextTooLong(ValueError):
    """More than MAX_PENDING characters are waiting to be spoken."""


async def within(waiting: Awaitable, seconds: float):
    """What `waiting` returns, or TimeoutError after `seconds`; a cancel of the awaiting task is never lost."""
    async with asyncio.timeout(seconds):
        return await waiting


async def send_within(sending: Awaitable, seconds: float) -> None:
    """`sending`, or Stalled once it has waited `seconds` (the client reads nothing)."""
    try:
        await within(sending, seconds)
    except TimeoutError:
        raise Stalled(f"the client read nothing for {seconds:g} s") from None


async def end_tasks(tasks, where: str, bound: float = ENDING_S) -> None:
    """Cancel `tasks` (None entries skipped) and wait at most `bound` s for them to end, cancelling again every
    RECANCEL_S any that still runs; past the bound one line is logged and the caller goes on to its cleanup. Never
    raises the tasks' own failures (they are retrieved here)."""
    tasks = [t for t in tasks if t is not None]
    loop = asyncio.get_running_loop()
    deadline, rounds = loop.time() + bound, 0
    while pending := [t for t in tasks if not t.done()]:
        left = deadline - loop.time()
        if left <= 0:
            log.error("%s: %d task(s) still running %g s after their cancel; cleaned up without them", where,
                      len(pending), bound)
            break
        if rounds == 1:
            log.warning("%s: a cancelled task still runs after %g s; cancelled again", where, RECANCEL_S)
        rounds += 1
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()


class SegmentQueue:
    """Segments in the order they were cut, then None (the input is over)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending = 0  # characters queued and not yet taken

    def put(self, segments: list[str], buffered: int = 0) -> None:
        """Queue `segments`; `buffered`: characters the segmenter still holds. TextTooLong past MAX_PENDING, and then
        nothing of `segments` is queued."""
        waiting = self.pending + sum(map(len, segments)) + buffered
        if waiting > MAX_PENDING:
            raise TextTooLong(f"{waiting} characters are waiting to be spoken; at most {MAX_PENDING} may wait: "
                              f"send text about as fast as it is spoken")
        for s in segments:
            self.queue.put_nowait(s)
            self.pending += len(s)

    def mark(self, marker) -> None:
        """Queue a marker (not text: it counts no characters), taken in order with the segments."""
        self.queue.put_nowait(marker)

    def end(self) -> None:
        self.queue.put_nowait(None)

    def empty(self) -> bool:
        return self.queue.empty()

    async def next(self):
        """The next segment (or marker), None at the end."""
        text = await self.queue.get()
        if isinstance(text, str):
            self.pending -= len(text)
        return text


class BadFrame(ValueError):
    """A WebSocket frame that is not a JSON object: its one-line message and code."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.message, self.code = message, code


def json_object(msg: dict, limit: int, shape: str = "a message is a JSON object", keyed: str | None = None) -> dict:
    """A received WebSocket text frame (`msg`, ASGI's) as the JSON object it must be, or BadFrame: a binary frame,
    more than `limit` characters, not JSON, not an object (`shape` says what it must be), or without a string
    `keyed` field."""
    text = msg.get("text")
    if text is None:
        raise BadFrame("send JSON text frames; binary frames are not accepted", "invalid_frame")
    if len(text) > limit:
        raise BadFrame(f"a message is at most {limit} characters; send text as it arrives", "message_too_long")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise BadFrame(f"the message is not valid JSON ({e})", "invalid_json") from None
    if not isinstance(data, dict) or keyed is not None and not isinstance(data.get(keyed), str):
        raise BadFrame(shape, "invalid_message")
    return data


def buffered(segmenter) -> int:
    """Characters a `textin.TextSegmenter` holds that are not yet a segment."""
    return len(segmenter.buf) + len(segmenter.lead)


def segment_failure(e: Exception, where: str) -> tuple[str, str, str | None]:
    """(kind, message, code) for a segment that failed with `e` (`where`: the session, for the log). Raises what is
    not the segment's failure (the client gone or stalled)."""
    if isinstance(e, (Stalled, ConnectionError)):
        raise e
    if isinstance(e, ContractError):  # special tokens, a segment that cannot fit
        return "client", str(e), e.code
    if isinstance(e, (ValueError, NoAudioError)):
        return "client", str(e), None
    if isinstance(e, QueueFull):
        return "busy", f"{e}; try again shortly", None
    if isinstance(e, ShuttingDown):
        log.info("%s: ended, the server is shutting down", where)
        return "stopping", f"{e}; try again shortly", None
    log.error("%s: a segment failed", where, exc_info=e)
    return "server", f"speech generation failed ({type(e).__name__}); the server log has the details", None


async def next_segment(segments: SegmentQueue, session, name: str) -> str | None:
    """The next segment of `segments` to speak (None: the input is done). While none is queued, `session` (a
    `textstream.SpeechSession`) keeps the last segment's KV context for it, unless the scheduler has a job waiting
    for the slot that context holds: then it is given back (the next segment starts again from the voice), so
    sessions idle between segments never starve other requests."""
    waiting = asyncio.ensure_future(segments.next())
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=STARVED_POLL_S)
            if done:
                return waiting.result()
            if session.prev is not None and session.scheduler.starved:
                log.info("%s: its kept context is given back (a job waits for the slot)", name)
                await asyncio.to_thread(session.release)  # it waits for the decoder's step to end
    finally:
        waiting.cancel()
