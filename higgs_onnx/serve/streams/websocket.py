"""The engine's transport over a WebSocket (Starlette's): JSON text frames in, JSON or binary frames out."""

from __future__ import annotations

import json

from .engine import Engine, Transport
from .wire import json_object, within


class WebSocketTransport(Transport):
    """`shape`: what a message must be (said in the error); `keyed`: a string field every message carries."""

    def __init__(self, ws, shape: str = "a message is a JSON object", keyed: str | None = None):
        self.ws, self.shape, self.keyed = ws, shape, keyed

    async def receive(self, limit: int):
        try:
            msg = await self.ws.receive()
        except RuntimeError:  # Starlette: the disconnect was read already
            return None
        if msg["type"] == "websocket.disconnect":
            return None
        return json_object(msg, limit, self.shape, self.keyed)

    async def send(self, obj) -> None:
        from starlette.websockets import WebSocketDisconnect

        try:
            if isinstance(obj, bytes):
                await self.ws.send_bytes(obj)
            else:
                await self.ws.send_text(json.dumps(obj))
        except (WebSocketDisconnect, RuntimeError, OSError):  # the client left, or the socket closed
            raise ConnectionError("the socket is closed") from None

    async def close(self, code: int | None) -> None:
        if code is None:
            return
        try:
            await within(self.ws.close(code), 1.0)
        except Exception:  # noqa: BLE001 - closed already, or the client reads nothing
            pass


async def serve(ws, codec, svc, idle_s: float, label: str | None = None, **transport) -> Engine:
    """Run one accepted WebSocket through the engine with `codec`, to its end."""
    engine = Engine(WebSocketTransport(ws, **transport), codec, svc, idle_s, svc.timeouts.send_s, svc.sample_rate,
                    label)
    await engine.run()
    return engine
