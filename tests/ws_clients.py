"""WebSocket clients of the tests (a support module, not a test module: `from ws_clients import ...`).

`session`: the `websockets` client through one text-in session (`/v1/audio/speech/stream`, sglang-omni's message
names) and what came back, with `events` and `per_segment` to read it. `ws_handshake` / `ws_frame`: a raw socket
that upgrades with a tiny receive buffer and never reads, for the tests of a client that stops reading.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket

STREAM = "/v1/audio/speech/stream"


def ws_url(server, path: str = STREAM) -> str:
    return server.url.replace("http://", "ws://") + path


async def session(server, config: dict | None, messages: list, *, read_all: bool = True, pause: float = 0.0) -> list:
    """Send `config` and `messages` (dicts as JSON, bytes as binary frames, str raw), then read until session.done,
    an error that closes, or the close; returns everything received (bytes and parsed JSON)."""
    import websockets

    got = []
    async with websockets.connect(ws_url(server), max_size=None) as ws:
        if config is not None:
            await ws.send(json.dumps({"type": "session.config", **config}))
        for m in messages:
            await ws.send(m if isinstance(m, (bytes, str)) else json.dumps(m))
            if pause:
                await asyncio.sleep(pause)
        if not read_all:
            return got
        try:
            while True:
                m = await asyncio.wait_for(ws.recv(), 120)
                got.append(m if isinstance(m, bytes) else json.loads(m))
                if isinstance(got[-1], dict) and got[-1]["type"] == "session.done":
                    break
        except websockets.ConnectionClosed:
            pass
    return got


def events(got: list, kind: str) -> list[dict]:
    """The JSON messages of type `kind` in what a session received."""
    return [m for m in got if isinstance(m, dict) and m["type"] == kind]


def per_segment(got: list) -> list[bytes]:
    """The audio bytes of each segment (between its audio.start and audio.done)."""
    out = []
    for m in got:
        if isinstance(m, dict) and m["type"] == "audio.start":
            out.append(b"")
        elif isinstance(m, bytes):
            out[-1] += m
    return out


def ws_handshake(port: int, path: str = STREAM, header: str = "") -> socket.socket:
    """A raw WebSocket client with a tiny receive buffer, that will never read (`header`: one more header line)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    key = base64.b64encode(b"0123456789abcdef").decode()
    extra = f"{header}\r\n" if header else ""
    s.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n{extra}"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert b" 101 " in head.split(b"\r\n")[0], head
    return s


def ws_frame(obj: dict) -> bytes:
    """`obj` as one masked text frame, as a client sends it."""
    data = json.dumps(obj).encode()
    mask = b"\x01\x02\x03\x04"
    n = len(data)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big") if n < 65536 else \
        bytes([0x80 | 127]) + n.to_bytes(8, "big")
    return b"\x81" + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))
