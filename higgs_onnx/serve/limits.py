"""Bounds on what one client can hold on to: timeouts and sizes, so a slow, stuck or hostile client never pins a
connection, a task or memory for good.

- request line + headers: within 10 s of the connection, or of the first byte of the next request on a kept-alive
  one (`--header-timeout`); then 408 `header_timeout` if some of it came (a plain close if nothing did), one log line.
- size of the request line + headers: 16 KiB: while they arrive, uvicorn's 400 (`h11_max_incomplete_event_size`);
  a whole header block over it that came in one read, 431 `headers_too_large` (`BodyDeadline`); closed.
- a pause inside a request body: 10 s between two pieces (`--body-idle-timeout`); then 408 `body_timeout`, closed.
- a whole request body: 120 s (`--body-timeout`); then 408 `body_timeout`, closed.
- a declared Content-Length over 64 MiB (`DRAIN_LIMIT`): 413 `too_large` at once, closed.
- a JSON body over 1 MiB / a voice upload over 20 MiB: 413 `too_large` (the rest is read and dropped, up to 64 MiB,
  so a client still sending reads the answer instead of a reset).
- a speech `input` over 50,000 characters, or one read in more than 500 pieces: 400 `string_above_max_length` /
  `too_many_pieces`, naming the limit (`serve/pieces.py`: an input beyond one request is read piece by piece).
- a response the client stops reading: 30 s with the send buffer full (`--send-timeout`); then the connection is
  aborted, which cancels the job and frees its slot.
- an idle kept-alive connection: closed after 5 s (`--keep-alive-timeout`, uvicorn's `timeout_keep_alive`).
- open connections + running requests: 128 (`--max-connections`, uvicorn's `limit_concurrency`); more get uvicorn's
  own plain-text 503.

The header and send guards live in `guarded_protocol` (uvicorn's h11 protocol has no header timer: its keep-alive
timer only runs between requests), the body guard in `BodyDeadline` (pure ASGI, around the app). Each firing is
counted in `COUNTERS` (reported by `/health`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass

log = logging.getLogger("higgs_onnx.serve")

MAX_HEADER_BYTES = 16 << 10  # h11's own default, made explicit
MAX_JSON_BYTES = 1 << 20
MAX_UPLOAD_BYTES = 20 << 20
# a speech `input` longer than one request holds is read in pieces (serve/pieces.py): at most this many characters
# (~55 min of speech at 15 a second) and pieces (~300 characters each; short paragraphs make more), else a 400
MAX_INPUT_CHARS = 50_000
MAX_PIECES = 500
DRAIN_LIMIT = 64 << 20  # an oversized body is read (and dropped) this far, so the client gets to read the 413
COUNTERS: Counter[str] = Counter()  # header_timeout, body_timeout, send_timeout, client_gone, malformed, too_large
MALFORMED = "higgs.malformed_body"  # scope key: uvicorn refused the rest of the body (bad chunked framing) with 400


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    return {401: "authentication_error", 429: "rate_limit_error"}.get(status) or \
        ("invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> bytes:
    """An error in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, as JSON bytes (for the layers
    below the app: the protocol, the raw ASGI guards, Ray's proxy)."""
    return json.dumps({"error": {"message": message, "type": error_type(status), "param": param,
                                 "code": code}}).encode()


@dataclass(frozen=True)
class Timeouts:
    header_s: float = 10.0
    body_idle_s: float = 10.0
    body_s: float = 120.0
    send_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 128

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    def as_dict(self) -> dict:
        return asdict(self)


class BodyTimeout(Exception):
    """The client stopped sending its request body (turned into a 408 by the app)."""


class ClientGone(Exception):
    """The client closed the connection in the middle of its request body."""


def _raw_json(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response (for the protocol layer, where no request object exists)."""
    body = error_body(status, message, code)
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode()
    return head + body


def guarded_protocol(timeouts: Timeouts) -> type:
    """uvicorn's h11 protocol with two timers it lacks: the request line and headers must arrive within
    `timeouts.header_s`, and a response whose send buffer stays full for `timeouts.send_s` (the client stopped
    reading) is aborted (the app sees a disconnect: the job is cancelled, its slot freed)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None
        send_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._watch_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_headers()

        def send_400_response(self, msg: str) -> None:
            if self.cycle is not None and not self.cycle.response_complete:  # mid-body: tell the app why it ends
                self.cycle.scope[MALFORMED] = True  # type: ignore[literal-required]
            super().send_400_response(msg)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                # part of a pipelined next request is here: the header timer, not the keep-alive one, runs
                self._unset_keepalive_if_required()
                self._watch_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self.header_timer, self.send_timer):
                if timer is not None:
                    timer.cancel()
            self.header_timer = self.send_timer = None
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.send_timer is None:
                self.send_timer = self.loop.call_later(timeouts.send_s, self._send_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self.send_timer is not None:
                self.send_timer.cancel()
                self.send_timer = None

        def _watch_headers(self) -> None:
            """Armed while a request's headers are awaited (h11's IDLE) and bytes of it came (or the connection is
            new); off once the request line and headers are in."""
            waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
            if not waiting:
                if self.header_timer is not None:
                    self.header_timer.cancel()
                    self.header_timer = None
                return
            fresh = self.cycle is None or self.conn.trailing_data[0]
            if self.header_timer is None and fresh:
                self.header_timer = self.loop.call_later(timeouts.header_s, self._headers_late)

        def _who(self) -> str:
            return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

        def _headers_late(self) -> None:
            self.header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            COUNTERS["header_timeout"] += 1
            partial = bool(self.conn.trailing_data[0])
            log.warning("%s: request headers not complete after %g s; connection closed", self._who(),
                        timeouts.header_s)
            if partial:
                self.transport.write(_raw_json(408, "Request Timeout", f"the request line and headers did not "
                                               f"arrive within {timeouts.header_s:g} s", "header_timeout"))
            self.transport.close()

        def _send_stalled(self) -> None:
            self.send_timer = None
            if self.transport.is_closing():
                return
            COUNTERS["send_timeout"] += 1
            log.warning("%s: stopped reading the response for %g s; connection aborted", self._who(),
                        timeouts.send_s)
            self.transport.abort()

    return GuardedH11Protocol


async def _refuse(send, status: int, message: str, code: str) -> None:
    body = error_body(status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyDeadline:
    """Pure ASGI, around the app: while a request body is incomplete, each `receive` waits at most `body_idle_s`
    and the whole body at most `body_s` (then `BodyTimeout`); a disconnect before the body's end raises
    `ClientGone`; a declared Content-Length over DRAIN_LIMIT (413) or a header block over MAX_HEADER_BYTES (431) is
    refused at once. Once the body is complete,
    `receive` passes through untouched (a streaming response waits on it for the client to leave)."""

    def __init__(self, app, timeouts: Timeouts):
        self.app, self.timeouts = app, timeouts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + \
            sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if size > MAX_HEADER_BYTES:
            COUNTERS["too_large"] += 1
            await _refuse(send, 431, f"the request line and headers are {size} bytes; the limit is "
                                     f"{MAX_HEADER_BYTES >> 10} KiB", "headers_too_large")
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > DRAIN_LIMIT:
            COUNTERS["too_large"] += 1
            await _refuse(send, 413, f"the body ({int(declared)} bytes) is larger than any this server takes "
                                     f"({DRAIN_LIMIT >> 20} MB)", "too_large")
            return
        t, loop = self.timeouts, asyncio.get_running_loop()
        deadline = loop.time() + t.body_s
        more = True

        async def timed_receive():
            nonlocal more
            if not more:
                return await receive()
            wait = min(t.body_idle_s, deadline - loop.time())
            try:
                async with asyncio.timeout(max(wait, 0.0)):
                    message = await receive()
            except TimeoutError:
                COUNTERS["body_timeout"] += 1
                whole = deadline - loop.time() <= 0
                raise BodyTimeout(f"the request body did not arrive {'within ' if whole else 'in time: nothing for '}"
                                  f"{t.body_s if whole else t.body_idle_s:g} s") from None
            if message["type"] == "http.request":
                more = bool(message.get("more_body", False))
            elif message["type"] == "http.disconnect":
                more = False
                if scope.get(MALFORMED):
                    COUNTERS["malformed"] += 1
                    raise ClientGone("the request body's framing is malformed: uvicorn answered 400 and closed")
                COUNTERS["client_gone"] += 1
                raise ClientGone("the client left before the end of its request body")
            return message

        await self.app(scope, timed_receive, send)
