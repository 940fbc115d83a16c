"""Text-in streaming latency over the WebSocket (`/v1/audio/speech/stream`): a real server in a child process, a
`websockets` client that sends an LLM-like token stream (one word every `--word-ms`), and per segment: the time from
the moment its sentence became complete (the first word of the next sentence was sent, or input.done) to its first
audio byte, and the gap from one segment's last audio byte (its audio.done) to the next segment's first (the
next segment's prefill and its first chunk's rows). A segment starts once the one before has ended (it continues
that one's KV context), so on a machine slower than real time later sentences wait for the earlier ones.

    python benchmarks/textstream.py --model-path /work/b4/onnx/cpu_int4 [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXT = ("The first sentence arrives word by word, as a language model writes it. A second sentence follows it "
        "closely. And a third one ends the answer.")


async def session(url: str, word_s: float, seed: int) -> dict:
    import websockets

    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "seed": seed}))
        await ws.recv()
        complete: list[float] = []  # when each sentence became complete on the client's side
        starts, first_audio, ends = {}, {}, {}

        async def reader():
            seg = None
            async for m in ws:
                now = time.perf_counter()
                if isinstance(m, bytes):
                    first_audio.setdefault(seg, now)
                    continue
                e = json.loads(m)
                if e["type"] == "audio.start":
                    seg = e["sentence_index"]
                    starts[seg] = now
                elif e["type"] == "audio.done":
                    ends[e["sentence_index"]] = now
                elif e["type"] == "session.done":
                    return

        task = asyncio.create_task(reader())
        words = TEXT.split(" ")
        for i, w in enumerate(words):
            await ws.send(json.dumps({"type": "input.text", "text": w + " "}))
            if i and words[i - 1][-1] in ".!?":
                complete.append(time.perf_counter())  # this word made the sentence before it whole
            await asyncio.sleep(word_s)
        await ws.send(json.dumps({"type": "input.done"}))
        complete.append(time.perf_counter())
        await task
    n = len(ends)
    return {"segments": n,
            "sentence_to_first_audio_s": [round(first_audio[i] - complete[i], 3) for i in range(n)],
            "gap_between_segments_s": [round(first_audio[i + 1] - ends[i], 3) for i in range(n - 1)],
            "segment_audio_span_s": [round(ends[i] - first_audio[i], 3) for i in range(n)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", type=Path, required=True)
    ap.add_argument("--word-ms", type=float, default=50.0, help="one word every this many ms (default 50)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from higgs_onnx.serve.process import ServerProcess

    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f.startswith(("avx", "amx"))}) \
        if Path("/proc/cpuinfo").exists() else []
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(args.model_path, Path(tmp) / "voices", Path(tmp) / "server.log", timeout=600)
        try:
            url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
            rounds = [asyncio.run(session(url, args.word_ms / 1000, seed)) for seed in range(args.rounds)]
        finally:
            server.stop()
    out = {"model": str(args.model_path), "machine": platform.processor() or platform.machine(), "cpu_flags": flags,
           "word_ms": args.word_ms, "rounds": rounds}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
