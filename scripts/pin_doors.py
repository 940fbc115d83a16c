"""Pin what every door says for a fixed set of requests, to compare two trees (before and after a refactor):
`python scripts/pin_doors.py TREE MODEL_PATH` starts `python -m higgs_onnx.serve` from TREE (its own higgs_onnx)
with Wyoming beside it, and prints a JSON object of sha256 prefixes: HTTP (greedy, seeded, takes, retries,
loudness, speed, deterministic, a long input in pieces, a dialogue), one WebSocket session, a Wyoming synthesis
and a streamed one, two Cartesia contexts and both ElevenLabs sockets. Run it on both trees against the same
export; equal objects mean nothing audible changed (docs/testing.md). The command line is pinned the same way by
running `inference.py` from each tree and hashing its files."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import subprocess
import sys
import tempfile

TEXT = "Hello there, this is a pinned sentence. And a second one follows it."
HTTP = [("greedy", {"temperature": 0}), ("seed", {"seed": 5}), ("takes", {"seed": 5, "takes": 3}),
        ("retries", {"seed": 2, "retries": 2}), ("loudness", {"seed": 3, "loudness": -20.0}),
        ("speed", {"seed": 3, "speed": 0.5}), ("deterministic", {"seed": 9, "deterministic": True}),
        ("long", {"seed": 1, "max_rows": None, "input": " ".join(["A long input sentence that goes on."] * 150)})]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


async def websocket(url: str) -> bytes:
    import websockets

    async with websockets.connect(url.replace("http", "ws") + "/v1/audio/speech/stream", max_size=None) as c:
        await c.send(json.dumps({"type": "session.config", "response_format": "pcm", "seed": 4}))
        await c.send(json.dumps({"type": "input.text", "text": TEXT}))
        await c.send(json.dumps({"type": "input.done"}))
        audio = b""
        while True:
            m = await c.recv()
            if isinstance(m, bytes):
                audio += m
            elif json.loads(m)["type"] == "session.done":
                return audio


async def cartesia(url: str) -> bytes:
    """One Cartesia context (two segments, the second continuing the first), then a second context flushed in two
    parts: every chunk's audio, in order."""
    import base64

    import websockets

    async with websockets.connect(url.replace("http", "ws") + "/tts/websocket", max_size=None) as c:
        await c.send(json.dumps({"context_id": "a", "transcript": TEXT, "continue": False}))
        await c.send(json.dumps({"context_id": "b", "transcript": "First part,", "continue": True}))
        await c.send(json.dumps({"context_id": "b", "transcript": " and the rest.", "continue": True,
                                 "flush": True}))
        await c.send(json.dumps({"context_id": "b", "transcript": "", "continue": False}))
        audio, done = {"a": b"", "b": b""}, set()
        while len(done) < 2:
            m = json.loads(await c.recv())
            if m["type"] == "chunk":
                audio[m["context_id"]] += base64.b64decode(m["data"])
            elif m["type"] == "done":
                done.add(m["context_id"])
        return audio["a"] + audio["b"]


async def elevenlabs(url: str, path: str) -> bytes:
    """ElevenLabs' multi-stream-input (one context, flushed, then closed) or stream-input (text, then the end)."""
    import base64

    import websockets

    multi = path == "multi-stream-input"
    ctx = {"context_id": "x"} if multi else {}
    async with websockets.connect(url.replace("http", "ws") + f"/v1/text-to-speech/default/{path}?seed=7",
                                  max_size=None) as c:
        await c.send(json.dumps({"text": " ", **ctx}))
        await c.send(json.dumps({"text": TEXT, **ctx}))
        await c.send(json.dumps({"flush": True, **ctx} if multi else {"text": ""}))
        if multi:
            await c.send(json.dumps({"close_context": True, **ctx}))
        audio = b""
        while True:
            m = json.loads(await c.recv())
            if m.get("audio"):
                audio += base64.b64decode(m["audio"])
            if m.get("isFinal"):
                return audio


async def wyoming_stream(port: int) -> bytes:
    """Wyoming's streaming synthesis: synthesize-start, the text in three chunks, synthesize-stop."""
    from wyoming.audio import AudioChunk
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

    async with AsyncTcpClient("127.0.0.1", port) as c:
        await c.write_event(SynthesizeStart().event())
        for part in (TEXT[:20], TEXT[20:45], TEXT[45:]):
            await c.write_event(SynthesizeChunk(text=part).event())
        await c.write_event(SynthesizeStop().event())
        audio = b""
        while True:
            e = await c.read_event()
            if AudioChunk.is_type(e.type):
                audio += e.payload
            if SynthesizeStopped.is_type(e.type):
                return audio


async def wyoming(port: int) -> bytes:
    from wyoming.audio import AudioChunk, AudioStop
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize

    async with AsyncTcpClient("127.0.0.1", port) as c:
        await c.write_event(Synthesize(text=TEXT).event())
        audio = b""
        while True:
            e = await c.read_event()
            if AudioChunk.is_type(e.type):
                audio += e.payload
            if AudioStop.is_type(e.type):
                return audio


def main(tree: str, model: str) -> dict:
    import httpx2 as httpx

    http_port, wy_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as voices:
        proc = subprocess.Popen([sys.executable, "-m", "higgs_onnx.serve", "--model-path", model, "--port",
                                 str(http_port), "--voices", voices, "--wyoming", f"tcp://127.0.0.1:{wy_port}"],
                                cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            for line in proc.stdout:
                if "speech server" in line:
                    break
            url, out = f"http://127.0.0.1:{http_port}", {}
            for name, extra in HTTP:
                body = {"model": "higgs-tts-3", "input": TEXT, "response_format": "pcm", "max_rows": 200, **extra}
                body = {k: v for k, v in body.items() if v is not None}
                r = httpx.post(url + "/v1/audio/speech", json=body, timeout=600)
                out[f"http {name}"] = f"{r.status_code} {digest(r.content)}"
            turns = [{"speaker": "a", "text": "Hello there, how are you today?"},
                     {"speaker": "b", "text": "Fine, thank you. And you?"}, {"speaker": "a", "text": "Well."}]
            r = httpx.post(url + "/v1/audio/dialogue", json={"model": "higgs-tts-3", "turns": turns, "seed": 6,
                                                             "voices": {"a": "default", "b": "default"},
                                                             "response_format": "pcm"}, timeout=600)
            out["http dialogue"] = f"{r.status_code} {digest(r.content)}"
            out["websocket"] = digest(asyncio.run(websocket(url)))
            out["wyoming"] = digest(asyncio.run(wyoming(wy_port)))
            out["wyoming stream"] = digest(asyncio.run(wyoming_stream(wy_port)))
            out["cartesia"] = digest(asyncio.run(cartesia(url)))
            for path in ("multi-stream-input", "stream-input"):
                out[f"elevenlabs {path}"] = digest(asyncio.run(elevenlabs(url, path)))
            return out
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python scripts/pin_doors.py TREE MODEL_PATH")
    print(json.dumps(main(sys.argv[1], sys.argv[2]), indent=1))
