"""Pin what every door says for a fixed set of requests, to compare two trees (before and after a refactor):
`python scripts/pin_doors.py TREE MODEL_PATH` starts `python -m higgs_onnx.serve` from TREE (its own higgs_onnx)
with Wyoming beside it, and prints a JSON object of sha256 prefixes: HTTP (greedy, seeded, takes, retries,
loudness, speed, deterministic, a long input in pieces, a dialogue), one WebSocket session and one Wyoming
synthesis. Run it on both trees against the same export; equal objects mean nothing audible changed
(docs/testing.md). The command line is pinned the same way by running `inference.py` from each tree and hashing
its files."""

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
            return out
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python scripts/pin_doors.py TREE MODEL_PATH")
    print(json.dumps(main(sys.argv[1], sys.argv[2]), indent=1))
