"""The voice-agent doors, measured on a real server (docs/agents.md, "Measured"), over Cartesia's `/tts/websocket`:

1. flush -> first audio: a context's text is sent held (`continue: true`, no sentence end), then flushed
   (`continue: false`); seconds from the flush to its first `chunk` (median and worst of N turns);
2. cancel -> last byte: a long turn is cancelled after its first chunk; seconds from the cancel to the last message
   sent for that context (a probe sent after the cancel is answered after the cancel is done, so every message for
   the context arrives before the probe's answer), and the decoder steps the scheduler ran for it after the cancel;
3. 50 cancelled turns: the scheduler's slots in use, kept KV contexts and running jobs afterwards (all should be 0);
4. two contexts on one socket: how their chunks interleave (the number of switches between them) and each one's
   first audio, against a context alone;
5. with `--cut-turns N`: N turns cut at random points over every stream door by four client threads (the suite's
   `tests/agent_clients.cut_turns`, in batches of 250, a busy loop beside the server with `--busy`): the cancel to
   the context's last message per protocol, and the slots, kept contexts and jobs left after each batch.

    python benchmarks/agents.py --model-path onnx/cpu_int4 [--turns 20] [--cut-turns 2000 --busy] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LONG = ("This is a long turn of the agent that goes on and on for a good while so that there is plenty of time to "
        "cut it short")
SHORT = "A short answer."
BASE = {"model_id": "sonic-3.6", "voice": {"mode": "id", "id": "default"}, "add_timestamps": False,
        "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}


def health(url: str) -> dict:
    import httpx2 as httpx

    return httpx.get(url + "/health", timeout=30).json()["scheduler"]


def messages(ws, until, timeout: float = 300.0) -> list[tuple[float, dict]]:
    """(arrival time, message) until `until(msg)` (included)."""
    out, end = [], time.monotonic() + timeout
    while True:
        msg = json.loads(ws.recv(timeout=max(0.1, end - time.monotonic())))
        out.append((time.perf_counter(), msg))
        if until(msg):
            return out


def flush_to_audio(url: str, turns: int) -> dict:
    from websockets.sync.client import connect

    waits = []
    with connect(url + "/tts/websocket", max_size=None) as ws:
        for i in range(turns):
            cid = f"f{i}"
            ws.send(json.dumps({**BASE, "context_id": cid, "transcript": "Held until the flush",
                                "continue": True, "max_buffer_delay_ms": 5000}))
            time.sleep(0.05)
            t0 = time.perf_counter()
            ws.send(json.dumps({**BASE, "context_id": cid, "transcript": "", "continue": False,
                                "max_buffer_delay_ms": 5000}))
            got = messages(ws, lambda m, cid=cid: m["type"] == "done" and m["context_id"] == cid)
            waits.append(next(t for t, m in got if m["type"] == "chunk") - t0)
    return {"turns": turns, "median_s": round(statistics.median(waits), 3), "worst_s": round(max(waits), 3)}


def cancel_to_last(url: str, turns: int) -> dict:
    from websockets.sync.client import connect

    lasts, steps = [], []
    with connect(url + "/tts/websocket", max_size=None) as ws:
        for i in range(turns):
            cid = f"c{i}"
            ws.send(json.dumps({**BASE, "context_id": cid, "transcript": LONG + ".", "continue": False}))
            messages(ws, lambda m, cid=cid: m["type"] == "chunk" and m["context_id"] == cid)
            before = health(url)["decoder_steps"]
            t0 = time.perf_counter()
            ws.send(json.dumps({"context_id": cid, "cancel": True}))
            ws.send(json.dumps({"context_id": "probe", "cancel": True}))
            got = messages(ws, lambda m: m["context_id"] == "probe")
            mine = [t for t, m in got if m["context_id"] == cid]
            lasts.append((mine[-1] - t0) if mine else 0.0)
            for _ in range(200):
                s = health(url)
                if s["active"] == 0:
                    break
                time.sleep(0.01)
            steps.append(s["decoder_steps"] - before)
    return {"turns": turns, "cancel_to_last_message_s_median": round(statistics.median(lasts), 4),
            "cancel_to_last_message_s_worst": round(max(lasts), 4),
            "decoder_steps_after_cancel_median": statistics.median(steps), "decoder_steps_after_cancel_worst":
            max(steps), "note": "steps counted from just before the cancel until the job left the batch, polled"}


def fifty_cancelled(url: str) -> dict:
    from websockets.sync.client import connect

    with connect(url + "/tts/websocket", max_size=None) as ws:
        for i in range(50):
            cid = f"t{i}"
            ws.send(json.dumps({**BASE, "context_id": cid, "transcript": LONG + ".", "continue": False}))
            messages(ws, lambda m, cid=cid: m["type"] == "chunk" and m["context_id"] == cid)
            ws.send(json.dumps({"context_id": cid, "cancel": True}))
        ws.send(json.dumps({"context_id": "probe", "cancel": True}))
        messages(ws, lambda m: m["context_id"] == "probe")
    for _ in range(200):
        s = health(url)
        if s["in_flight"] == 0:
            break
        time.sleep(0.05)
    return {k: s[k] for k in ("slots_in_use", "kept", "active", "in_flight", "cancelled")}


def interleaving(url: str) -> dict:
    from websockets.sync.client import connect

    def first_audio(*cids: str) -> tuple[dict, list[str]]:
        with connect(url + "/tts/websocket", max_size=None) as ws:
            t0 = time.perf_counter()
            for cid in cids:
                ws.send(json.dumps({**BASE, "context_id": cid, "transcript": LONG + ".", "continue": False}))
            done, order, firsts = set(), [], {}
            while done != set(cids):
                t, m = messages(ws, lambda m: True)[0]
                if m["type"] == "chunk":
                    order.append(m["context_id"])
                    firsts.setdefault(m["context_id"], round(t - t0, 3))
                elif m["type"] == "done":
                    done.add(m["context_id"])
        return firsts, order

    alone, _ = first_audio("solo")
    firsts, order = first_audio("a", "b")
    switches = sum(1 for x, y in zip(order, order[1:], strict=False) if x != y)
    return {"first_audio_alone_s": alone["solo"], "first_audio_two_s": firsts, "chunks": len(order),
            "switches_between_contexts": switches}


def cut(server, turns: int, busy: bool) -> dict:
    import subprocess

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from agent_clients import cut_turns, summary

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    cuts, after = [], []
    t0 = time.perf_counter()
    try:
        for batch in range(0, turns, 250):
            cuts += cut_turns(server, min(250, turns - batch), seed=52 + batch)
            for _ in range(400):
                s = health(server.url)
                if s["in_flight"] == 0 and s["kept"] == 0 and s["slots_in_use"] == 0:
                    break
                time.sleep(0.05)
            after.append({k: s[k] for k in ("slots_in_use", "kept", "active", "in_flight")})
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    return {"turns": len(cuts), "busy_loop_beside": busy, "seconds": round(time.perf_counter() - t0, 1),
            "per_protocol": summary(cuts), "after_each_batch": after}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--cut-turns", type=int, default=0, help="turns cut at random points over every stream door")
    ap.add_argument("--busy", action="store_true", help="a busy loop beside the server while turns are cut")
    ap.add_argument("--json")
    args = ap.parse_args()
    from higgs_onnx.serve.process import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = ServerProcess(args.model_path, tmp / "voices", tmp / "server.log")
        try:
            url = server.url.replace("http://", "ws://")
            http = server.url
            from higgs_onnx.serve.streams.agent import MAX_CONTEXTS

            report = {"model": args.model_path, "max_contexts_per_socket": MAX_CONTEXTS}
            for name, run in (("flush_to_first_audio", lambda: flush_to_audio(url, args.turns)),
                              ("cancel_to_last_byte", lambda: cancel_to_last(url, args.turns)),
                              ("after_50_cancelled_turns", lambda: fifty_cancelled(url)),
                              ("two_contexts_one_socket", lambda: interleaving(url))):
                report[name] = run()
                print(name, json.dumps(report[name]), flush=True)
            if args.cut_turns:
                report["cut_turns"] = cut(server, args.cut_turns, args.busy)
                print("cut_turns", json.dumps(report["cut_turns"]), flush=True)
            report["scheduler"] = {k: health(http)[k] for k in ("slots_in_use", "kept", "in_flight")}
        finally:
            server.stop(timeout=15)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
