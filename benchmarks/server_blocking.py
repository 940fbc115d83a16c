"""Does any work block the server? Three measurements on a real server (docs/server.md, "Nothing blocks the loop"):

1. `--normalize`: while one request of 50,000 digits (the input bound) is read by the text steps, `/health` and a
   short WebSocket session at another door must answer within 1 s (the worst latency of each is reported);
2. word timing: a plain request's time to first byte while 8 long SSE streams run, with `caption_level: "word"`
   against without (the aligner runs in its own lower-priority process: the ratio should be <= 1.2), and
   /health's worst answer while they run (the loop's worst stall);
3. SIGTERM: 10 servers in a row, each stopped with streams in flight: seconds from the signal to the exit, against
   the documented grace (about 11 s).

    python benchmarks/server_blocking.py --model-path onnx/cpu_int4 [--json out.json] [--only normalize,words,sigterm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRACE_S = 11.0  # docs/server.md: the step's 5 s, uvicorn's 5 s, and the rest
LONG = " ".join(["A long input sentence that goes on and on for a while."] * 40)


def server(model: str, tmp: Path, *args: str):
    from higgs_onnx.serve.process import ServerProcess

    return ServerProcess(model, tmp / "voices", tmp / "server.log", *args)


def post(url: str, body: dict, stream: bool = False, timeout: float = 600.0) -> tuple[float, int]:
    """(seconds to the first byte, status) of a speech request; the body read to its end."""
    import httpx2 as httpx

    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/audio/speech", json={"model": "higgs-tts-3", **body},
                      timeout=timeout) as r:
        first = None
        for _ in r.iter_bytes():
            if first is None:
                first = time.perf_counter() - t0
        return (first if first is not None else time.perf_counter() - t0), r.status_code


async def ws_first_audio(url: str, text: str) -> tuple[float, float]:
    """(seconds to the session's first answer, seconds to its first audio) of a short WebSocket session."""
    import websockets

    t0 = time.perf_counter()
    async with websockets.connect(url.replace("http", "ws") + "/v1/audio/speech/stream", max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "max_rows": 40}))
        await ws.recv()  # session.configured
        answered = time.perf_counter() - t0
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        while True:
            m = await ws.recv()
            if isinstance(m, bytes):
                return answered, time.perf_counter() - t0


HEAVY = {"digits": "7" * 50_000, "grouped": ("1,111 " * 9_000)[:50_000],
         "zh": ("2026年12月4日，共123456元。" * 3_000)[:50_000]}


def normalize(model: str, tmp: Path) -> dict:
    """Three requests of 50,000 characters (the input bound: digits, grouped numbers, Chinese dates and money) read
    with `normalize`, all at once (dry runs: the text steps, the pieces and every piece's contract check, which is
    the work a request does before the scheduler decodes it), against /health and a short WebSocket session, polled
    while they run."""
    import httpx2 as httpx

    s = server(model, tmp, "--normalize")
    try:
        left, out = [len(HEAVY)], {}

        def heavy(name: str, text: str):
            t0 = time.perf_counter()
            r = httpx.post(s.url + "/v1/audio/speech", json={"model": "higgs-tts-3", "input": text,
                                                            "dry_run": True}, timeout=600)
            out[name] = {"s": round(time.perf_counter() - t0, 2), "status": r.status_code,
                         "says": r.json()["error"]["message"][:120] if r.status_code != 200 else None}
            left[0] -= 1

        idle = [asyncio.run(ws_first_audio(s.url, "Hello there.")) for _ in range(3)]
        for name, text in HEAVY.items():
            threading.Thread(target=heavy, args=(name, text), daemon=True).start()
        time.sleep(0.05)
        health, ws = [], []
        while left[0]:
            t0 = time.perf_counter()
            httpx.get(s.url + "/health", timeout=60)
            health.append(time.perf_counter() - t0)
            if len(ws) < 3:
                ws.append(asyncio.run(ws_first_audio(s.url, "Hello there.")))
            time.sleep(0.02)
        return {"heavy": out, "health_max_s": max(health, default=0.0), "health_n": len(health),
                "ws_answer_max_s": max(a for a, _ in ws), "ws_first_audio_max_s": max(f for _, f in ws),
                "ws_first_audio_idle_s": statistics.median(f for _, f in idle), "ws_n": len(ws)}
    finally:
        s.stop()


def words(model: str, tmp: Path) -> dict:
    """A plain request's time to first byte under 8 long SSE streams, without and with word timing, and the slowest
    /health answer while they run (polled every 20 ms: the event loop's worst stall)."""
    import httpx2 as httpx

    s = server(model, tmp, "--max-batch", "9")
    try:
        out = {}
        post(s.url, {"input": "Warm up.", "max_rows": 40, "response_format": "pcm"})
        for level in ("piece", "word"):
            ts = [threading.Thread(target=post, args=(s.url, {"input": LONG, "stream_format": "sse",
                                                             "caption_level": level, "response_format": "pcm",
                                                             "max_rows": None}), daemon=True) for _ in range(8)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            time.sleep(3.0)  # the streams are past their first pieces: decoding and (with words) aligning
            firsts = [post(s.url, {"input": "A plain request.", "response_format": "pcm", "max_rows": 60})[0]
                      for _ in range(3)]
            health = []
            while any(t.is_alive() for t in ts):
                t1 = time.perf_counter()
                httpx.get(s.url + "/health", timeout=60)
                health.append(time.perf_counter() - t1)
                time.sleep(0.02)
            out[level] = {"plain_first_byte_s": statistics.median(firsts), "streams_s": time.perf_counter() - t0,
                          "health_max_s": round(max(health, default=0.0), 3), "health_n": len(health)}
        out["ratio"] = out["word"]["plain_first_byte_s"] / out["piece"]["plain_first_byte_s"]
        return out
    finally:
        s.stop()


def sigterm(model: str, tmp: Path, n: int = 10) -> dict:
    """`n` servers, each sent SIGTERM with 3 streams in flight: seconds from the signal to the exit."""
    stops = []
    for i in range(n):
        (tmp / str(i)).mkdir()
        s = server(model, tmp / str(i))
        ts = [threading.Thread(target=_quiet, args=(post, s.url, {"input": LONG, "stream_format": "sse",
                                                                  "max_rows": None}), daemon=True)
              for _ in range(3)]
        for t in ts:
            t.start()
        time.sleep(2.0)
        t0 = time.perf_counter()
        os.kill(s.proc.pid, signal.SIGTERM)
        try:
            s.proc.wait(60)
        finally:
            stops.append(time.perf_counter() - t0)
            s.stop()
    return {"stops_s": [round(x, 2) for x in stops], "max_s": max(stops), "grace_s": GRACE_S,
            "within": sum(x <= GRACE_S for x in stops)}


def _quiet(f, *a):
    try:
        f(*a)
    except Exception:  # noqa: BLE001 - a stream cut by the shutdown is what is measured
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--only", default="normalize,words,sigterm")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from higgs_onnx.runtime.route import cpu_summary

    out = {"cpu": cpu_summary(), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            (Path(tmp) / name).mkdir()
            out[name] = {"normalize": normalize, "words": words, "sigterm": sigterm}[name](args.model_path,
                                                                                          Path(tmp) / name)
            print(name, json.dumps(out[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
