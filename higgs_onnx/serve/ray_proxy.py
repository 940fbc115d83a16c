"""Ray Serve's HTTP proxy, made to answer as our server does when a replica cannot (`serve --ray`).

Ray Serve's proxy (uvicorn in a Ray actor) forwards each request to a replica. When that replica's process dies
while it holds the request, the proxy has nothing to send: a plain-text 500, or a stream that just stops. And when
every replica is full it answers Ray's own plain-text 429. This ASGI middleware, installed in the proxy through
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=higgs_onnx.serve.ray_proxy:middlewares`, ends each such request the way
docs/server.md documents for a server that stops:

- no answer started: a JSON 503 with `Retry-After`, OpenAI's error shape, code `replica_lost`;
- an SSE stream started: an `error` event (code `replica_lost`), then the stream's end;
- another audio stream started: the connection is cut without the chunked body's end, so no client takes the
  truncated audio for whole;
- a WebSocket session open: an error message in its door's own shape (ours, Cartesia's, ElevenLabs'), then a close
  with code 1011;
- Ray's own plain-text 429 / 503 (every replica full, none running): the same JSON error body as ours, also to a
  WebSocket upgrade (an HTTP answer to the handshake, or close code 1013 where the server cannot send one);
- Ray's own plain-text 404 (no application deployed: while it starts, and while a SIGTERM drains the replicas until
  the port closes): a JSON 503 `no_replica` with `Retry-After`, never a 404 a client or a balancer reads as
  permanent. Our app answers every path itself (its 404s are JSON), so a plain 404 can only be Ray's.

It imports nothing heavy: it runs in the proxy's process, which loads no model.
"""

from __future__ import annotations

import json
import logging

from starlette.middleware import Middleware

from .limits import error_body
from .metrics import door_of

log = logging.getLogger("higgs_onnx.serve.ray")
RETRY_AFTER_S = 1
RAY_ANSWERS = (404, 429, 503)  # Ray's own plain-text answers, rewritten (`ray_answer`)
NO_APP = "no replica is running (the server is starting or stopping); try again"
LOST = ("the replica serving this request stopped before it finished (it is restarted; other replicas answer "
        "meanwhile); try again")


def middlewares() -> list[Middleware]:
    """The proxy callback Ray Serve calls once when its proxy starts."""
    return [Middleware(ReplicaLoss)]


def ray_answer(status: int, text: str) -> tuple[int, bytes]:
    """Ray's own plain-text answer as ours: (status, JSON body). 404 (no application: starting or draining) and 503
    are `no_replica` 503s, 429 stays `rate_limit_exceeded`."""
    if status == 429:
        return 429, error_body(429, f"every replica is busy; {text or 'try again'}", "rate_limit_exceeded")
    note = NO_APP if status == 404 else f"no replica is running; {text or 'try again'}"
    return 503, error_body(503, note, "no_replica")


def socket_error(door: str | None) -> dict:
    """A lost replica's last message on a WebSocket door, in that door's protocol (its codec's, serve/streams/)."""
    from .streams import codec_of

    return codec_of(door).lost(LOST)


class ReplicaLoss:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        gone = []  # the client left: nothing is owed to it

        async def receiving():
            message = await receive()
            if message["type"] in ("http.disconnect", "websocket.disconnect"):
                gone.append(message)
            return message

        if scope["type"] == "http":
            return await self.http(scope, receiving, send, gone)
        return await self.websocket(scope, receiving, send, gone)

    async def http(self, scope, receive, send, gone):
        state = {"started": False, "ended": False, "sse": False, "held": None, "body": b""}

        async def sending(message):
            kind = message["type"]
            if kind == "http.response.start":
                headers = dict(message.get("headers") or [])
                ctype = headers.get(b"content-type", b"").decode("latin-1")
                if message["status"] in RAY_ANSWERS and not ctype.startswith("application/json"):
                    state["held"] = message  # Ray's own plain-text answer: rewritten once its body is in
                    return
                state["started"] = True
                state["sse"] = ctype.startswith("text/event-stream")
            elif kind == "http.response.body" and state["held"] is not None:
                state["body"] += message.get("body", b"")
                if message.get("more_body", False):
                    return
                held, state["held"] = state["held"], None
                await self.answer(send, *ray_answer(held["status"], state["body"].decode("utf-8", "replace").strip()))
                state["started"] = state["ended"] = True
                return
            elif kind == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if not state["ended"] and not gone:
                await self.lost_http(scope, send, state)

    @staticmethod
    async def answer(send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", str(RETRY_AFTER_S).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def lost_http(self, scope, send, state) -> None:
        log.warning("%s %s: the replica was lost mid-request", scope.get("method"), scope.get("path"))
        try:
            if not state["started"]:
                await self.answer(send, 503, error_body(503, LOST, "replica_lost"))
            elif state["sse"]:
                event = {"type": "error", "error": json.loads(error_body(503, LOST, "replica_lost"))["error"]}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(),
                            "more_body": False})
            # any other started stream is left unfinished: the server cuts the connection
        except Exception as e:  # noqa: BLE001 - the client left too: nothing to tell it
            log.info("could not tell the client: %s", e)

    async def websocket(self, scope, receive, send, gone):
        state = {"accepted": False, "closed": False, "status": None}
        denial = "websocket.http.response" in (scope.get("extensions") or {})

        async def sending(message):
            kind = message["type"]
            if kind.startswith("http.response."):  # Ray's own answer to an upgrade (every replica full): ours
                if kind == "http.response.start":
                    state["status"], state["closed"] = message["status"], True
                elif not message.get("more_body", False):
                    if denial:
                        status, body = ray_answer(state["status"] or 503, "")
                        await send({"type": "websocket.http.response.start", "status": status,
                                    "headers": [(b"content-type", b"application/json"),
                                                (b"retry-after", str(RETRY_AFTER_S).encode())]})
                        await send({"type": "websocket.http.response.body", "body": body})
                    else:
                        await send({"type": "websocket.close", "code": 1013})
                return
            if kind == "websocket.accept":
                state["accepted"] = True
            elif kind in ("websocket.close", "websocket.http.response.start"):
                state["closed"] = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if state["accepted"] and not state["closed"] and not gone:
                log.warning("WebSocket %s: the replica was lost mid-session", scope.get("path"))
                try:
                    await send({"type": "websocket.send", "text": json.dumps(socket_error(door_of(scope)))})
                    await send({"type": "websocket.close", "code": 1011, "reason": "replica lost"})
                except Exception as e:  # noqa: BLE001 - the client left too
                    log.info("could not tell the client: %s", e)
