"""The speech server under load: do running streams keep their pace while a new clone request is prefilled, and how
many rows/s does the server make with 4 clients against the same export decoding 4 requests in process?

    python benchmarks/server_load.py --model-path onnx/cpu_int4 [--threads 0] [--prefill-chunk N] [--json out.json]
    python benchmarks/server_load.py --model-path onnx/cpu_int4 --compare-replicas [--duration 60] [--clients 4]

It starts the real server (`python -m higgs_onnx.serve` in a subprocess on a free port, a voices folder of its
own), then:

1. **stall**: uploads a clone voice (`POST /v1/voices`, the bundled `ref_en_24k.flac` and its transcript), starts 3
   streaming clients (`/v1/audio/speech`, `response_format=pcm`, `stream_format=sse`: one event per audio chunk of
   the server, so every chunk's arrival is timed exactly), waits until they decode, then sends a 4th request in the
   clone voice whose prompt is ~300 positions (`--clone-words`). The voice's prefix (reference rows + transcript) is
   restored from its saved KV state; the scheduler prefills the rest of the prompt in chunks between the streams'
   decoder steps. Per running stream: its median chunk interval before the 4th request came (each chunk is 1 s
   of audio = 25 rows), its largest gap overlapping the window [4th request sent, its first audio], their ratio
   (target: <= 3x), and the median interval after the window (4 in the batch). `/health` gives the 4th request's
   prefill calls and positions.
2. **upload** (`--skip-upload` to leave out): the same 3 streams while a *new* voice is uploaded. Making a voice
   (the codec encoder and the prefix prefill, `HiggsTTS.make_voice`) runs in the upload handler's thread, outside
   the scheduler, so it competes with the decoder loop for the cores: the same gap figures show what that costs.
3. **throughput**: 4 closed-loop clients, each sending its next request (`THROUGHPUT_TEXT`, `--rows` rows at
   most) as soon as its last one ended, for `--duration` s; aggregate rows/s from `/health`'s row counter over
   the window, and from the audio (seconds x 25 frames/s).
4. **in process** (`--skip-inprocess` to leave out), after the server has stopped, in a child process on the same
   export, two figures to compare the server's rows/s with:
   - *same feed*: the same 4 closed-loop clients as threads on one started scheduler (`HiggsTTS.scheduler`, the
     server's slot size, streaming audio through the codec worker, the same texts, seeds and row limits), for the
     same window: what the server costs over the engine (HTTP, SSE, the event loop);
   - *decode only*: 4 requests decoded together for `--rows` rows without stopping, no codec (what
     `bench.py --batch 4` measures): the issue-21 reference. Each new request's prompt prefill (~35 positions) and
     the codec's chunks take cores from the decoder on a 2-core machine, so the server cannot reach it there.

With `--compare-replicas` it runs one thing instead: the same closed-loop load (`--clients` clients, `--duration`
s each, the throughput phase's text and `--rows`) against one server process with 2 threads, then against the
server on Ray Serve with 2 replicas of 1 thread each (`serve --ray --replicas 2 --threads 1`, a local Ray
instance); per setup: requests and audio seconds made per second, rows/s from the audio, and the time to first
audio's p50 / p95 (docs/server.md, "Scaling").

Prints a table naming the CPU's flags (avx2, avx512f, avx512_vnni, amx); `--json` writes every figure, the chunk
arrival times included. Nothing here is asserted: the figures depend on the machine (and another process on it).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("CI", "1")

REC = ROOT / "higgs_onnx" / "assets" / "recordings"
FRAME_RATE = 25  # audio frames (rows) per second of speech
STREAM_TEXT = ("The quick brown fox jumps over the lazy dog while the speech synthesizer keeps talking about "
               "everything it sees along the river, the hills, the town and the people in it. ") * 6
# one sentence (~35 prompt positions, ~8-10 s of speech): a request's prompt is small beside its rows, as in use
THROUGHPUT_TEXT = "The quick brown fox jumps over the lazy dog while the speech synthesizer keeps talking about it."
TARGET = 3.0  # a running stream's largest gap during the prefill, in normal chunk intervals


def cpu_info() -> dict:
    """The CPU model and the flags that choose ONNX Runtime's int4 / int8 kernels (from /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {"model": "unknown CPU", "flags": {}, "cpus": os.cpu_count()}
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    have = {f: f in flags for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni")}
    have["amx"] = any(f.startswith("amx") for f in flags)
    return {"model": model, "flags": have, "amx_flags": sorted(f for f in flags if f.startswith("amx")),
            "cpus": os.cpu_count()}


def cpu_line(cpu: dict) -> str:
    flags = " ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["flags"].items())
    amx = f" ({', '.join(cpu['amx_flags'])})" if cpu.get("amx_flags") else ""
    return f"{cpu['model']}, {cpu['cpus']} CPUs: {flags}{amx}"


# -- the server ----------------------------------------------------------------------------------------------------
class Server:
    """The real server in a child process (`higgs_onnx.serve.process`), with what the phases ask of it."""

    def __init__(self, model: Path, work: Path, *args: str, timeout: float = 600.0):
        import httpx2 as httpx

        from higgs_onnx.serve.process import ServerProcess

        try:
            self.process = ServerProcess(model, work / "voices", work / "server.log", *args, timeout=timeout)
        except RuntimeError as e:
            raise SystemExit(f"error: {e}") from None
        self.url, self.banner = self.process.url, self.process.banner
        self.http = httpx.Client(base_url=self.url, timeout=600)

    def stats(self) -> dict:
        return self.http.get("/health").json()["scheduler"]

    def wait(self, done, what: str, timeout: float = 600.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done(stats := self.stats()):
                return stats
            time.sleep(0.02)
        raise SystemExit(f"error: {what}: not reached within {timeout:.0f} s; scheduler {self.stats()}")

    def upload(self, name: str, audio: bytes, transcript: str) -> float:
        t0 = time.perf_counter()
        r = self.http.post("/v1/voices", data={"name": name, "transcript": transcript},
                           files={"file": ("ref.flac", audio, "application/octet-stream")})
        if r.status_code != 201:
            raise SystemExit(f"error: uploading the voice {name} failed: {r.status_code} {r.text[:300]}")
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.process.stop()


class Stream:
    """One streaming client: POST /v1/audio/speech as SSE (pcm), every audio event's arrival time recorded."""

    def __init__(self, server: Server, text: str, voice: str = "default", seed: int = 0,
                 max_rows: int | None = None, stop: threading.Event | None = None):
        self.server, self.text, self.voice, self.seed, self.max_rows = server, text, voice, seed, max_rows
        self.stop = stop or threading.Event()
        self.sent = self.done_at = None
        self.arrivals: list[float] = []  # perf_counter of each audio chunk
        self.samples: list[int] = []
        self.stats: dict = {}
        self.error: str | None = None

    def run(self) -> Stream:
        import httpx2 as httpx

        body = {"model": "tts-1", "input": self.text, "voice": self.voice, "response_format": "pcm",
                "stream_format": "sse", "seed": self.seed, **({"max_rows": self.max_rows} if self.max_rows else {})}
        try:
            with httpx.Client(base_url=self.server.url, timeout=600) as client:
                self.sent = time.perf_counter()
                with client.stream("POST", "/v1/audio/speech", json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        self.error = f"{r.status_code} {r.text[:200]}"
                        return self
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        event = json.loads(line[6:])
                        if event["type"] == "speech.audio.delta":
                            self.arrivals.append(time.perf_counter())
                            self.samples.append(len(base64.b64decode(event["audio"])) // 2)
                        elif event["type"] == "speech.audio.done":
                            self.stats = event.get("stats", {})
                        elif event["type"] == "error":
                            self.error = event["error"]["message"]
                        if self.stop.is_set():
                            break  # leaving cancels the job on the server
        except Exception as e:  # noqa: BLE001 - reported with the figures
            self.error = f"{type(e).__name__}: {e}"
        self.done_at = time.perf_counter()
        return self

    @property
    def first_audio_s(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    def audio_s(self, rate: int = 24000) -> float:
        return sum(self.samples) / rate


def gap_figures(stream: Stream, start: float, end: float) -> dict:
    """A running stream's chunk intervals (each 25 rows): the median of those that ended before `start` (its normal
    pace), the largest that overlaps [start, end], their ratio, and the median after `end` (the pace with one more
    request in the batch). A last, partial chunk is left out."""
    a = stream.arrivals[:-1] if stream.stats else stream.arrivals  # a stream cut early has no partial last chunk
    gaps = [(a[i], a[i + 1]) for i in range(len(a) - 1)]
    before = [b - x for x, b in gaps if b <= start]
    inside = [b - x for x, b in gaps if b > start and x < end]
    after = [b - x for x, b in gaps if x >= end]
    normal = statistics.median(before) if before else None
    largest = max(inside) if inside else None
    return {"chunks": len(stream.arrivals), "median_interval_s": normal, "largest_gap_s": largest,
            "ratio": largest / normal if largest and normal else None, "intervals_in_window": len(inside),
            "median_after_s": statistics.median(after) if after else None, "error": stream.error}


def running_streams(server: Server, n: int, stop: threading.Event, pool: ThreadPoolExecutor, baseline: int):
    """Start `n` long streams; return them (futures) once the server decodes all of them and each has had
    `baseline` chunk intervals of normal pace."""
    streams = [Stream(server, STREAM_TEXT, seed=i, max_rows=2000, stop=stop) for i in range(n)]
    futures = [pool.submit(s.run) for s in streams]
    server.wait(lambda s: s["active"] >= n and s["prefilling"] == 0, f"{n} streams decoding")
    deadline = time.monotonic() + 600
    while min(len(s.arrivals) for s in streams) < baseline + 2:
        if time.monotonic() > deadline or any(f.done() for f in futures):
            raise SystemExit(f"error: the streams did not reach {baseline} chunks: "
                             f"{[(len(s.arrivals), s.error) for s in streams]}")
        time.sleep(0.02)
    return streams, futures


def finish_streams(streams, futures, stop: threading.Event, window_end: float, after: int) -> None:
    """Let every stream have `after` more chunks after the window, then cut them (the server cancels the jobs)."""
    deadline = time.monotonic() + 600
    while any(sum(t > window_end for t in s.arrivals) < after for s in streams if not s.done_at):
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    stop.set()
    for f in futures:
        f.result()


def stall_phase(server: Server, args, voice: str) -> dict:
    stop = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        streams, futures = running_streams(server, 3, stop, pool, args.baseline_chunks)
        before = server.stats()
        text = " ".join(["word"] * args.clone_words) + "."
        clone = Stream(server, text, voice=voice, seed=99, max_rows=args.clone_rows)
        pool.submit(clone.run).result()
        during = server.stats()
        if clone.error or not clone.arrivals:
            raise SystemExit(f"error: the clone request failed: {clone.error}")
        start, end = clone.sent, clone.arrivals[0]
        finish_streams(streams, futures, stop, end, args.baseline_chunks)
    figures = [gap_figures(s, start, end) for s in streams]
    return {"clone": {"prompt_positions": clone.stats.get("prompt_tokens"),
                      "prefilled_positions": during["prefill_positions"] - before["prefill_positions"],
                      "prefill_calls": during["prefill_calls"] - before["prefill_calls"],
                      "first_audio_s": clone.first_audio_s, "rows": clone.stats.get("rows"),
                      "longest_stall_s": during["longest_stall_s"], "prefill_chunk": during.get("prefill_chunk")},
            "window_s": end - start, "streams": figures, "arrivals": [arrivals(s, start) for s in streams],
            "worst_ratio": max((f["ratio"] for f in figures if f["ratio"]), default=None)}


def upload_phase(server: Server, args, audio: bytes, transcript: str) -> dict:
    stop = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        streams, futures = running_streams(server, 3, stop, pool, args.baseline_chunks)
        start = time.perf_counter()
        upload_s = server.upload("second_voice", audio, transcript)
        end = time.perf_counter()
        finish_streams(streams, futures, stop, end, args.baseline_chunks)
    figures = [gap_figures(s, start, end) for s in streams]
    return {"upload_s": upload_s, "window_s": end - start, "streams": figures,
            "arrivals": [arrivals(s, start) for s in streams],
            "worst_ratio": max((f["ratio"] for f in figures if f["ratio"]), default=None)}


def arrivals(s: Stream, zero: float) -> list[float]:
    return [round(t - zero, 4) for t in s.arrivals]


def throughput_phase(server: Server, args) -> dict:
    """`--clients` closed-loop clients: each sends its next request as soon as its last one ends, for `--duration`
    s; the rows the server made in that window (its /health row counter at both ends) / the window. Requests stop on EOC
    at different lengths, so only clients that keep sending keep the batch full (continuous batching)."""
    server.wait(lambda s: s["in_flight"] == 0, "an idle server")
    stop, done = threading.Event(), []
    # warm-up (not timed): the voice made on first use, the batch's bindings, every session's first run
    n = args.clients
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(Stream.run, [Stream(server, THROUGHPUT_TEXT, seed=190 + i, max_rows=16) for i in range(n)]))

    def client(i: int) -> None:
        k = 0
        while not stop.is_set():
            done.append(Stream(server, THROUGHPUT_TEXT, seed=200 + 10 * i + k, max_rows=args.rows, stop=stop).run())
            k += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    before = server.stats()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(args.duration)
    after = server.stats()
    wall = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join(timeout=600)
    server.wait(lambda s: s["in_flight"] == 0, "an idle server")
    rows = after["rows"] - before["rows"]
    steps = after["decoder_steps"] - before["decoder_steps"]
    audio = sum(s.audio_s() for s in done)
    return {"clients": n, "requests": len(done), "rows": rows, "decoder_steps": steps,
            "mean_batch": rows / steps if steps else None, "wall_s": wall,
            "step_ms": wall / steps * 1e3 if steps else None, "rows_per_s": rows / wall,
            "codec_busy_s": after["codec_busy_s"] - before["codec_busy_s"], "audio_s": audio,
            "prefill_positions": after["prefill_positions"] - before["prefill_positions"],
            "decode_s": after["decode_s"] - before["decode_s"], "prefill_s": after["prefill_s"] - before["prefill_s"],
            "audio_rows_per_s": audio * FRAME_RATE / wall, "first_audio_s": [s.first_audio_s for s in done],
            "errors": [s.error for s in done if s.error and not stop.is_set()]}


# -- one process with 2 threads against 2 replicas with 1 thread each (--compare-replicas) ----------------------------
SETUPS = (("one process, 2 threads", ("--threads", "2")),
          ("Ray Serve, 2 replicas x 1 thread", ("--ray", "--replicas", "2", "--threads", "1")))


def closed_loop(server: Server, clients: int, rows: int, duration: float) -> dict:
    """`clients` closed-loop SSE clients for `duration` s (after a warm-up of one short request each): what the
    setup made in the window, and each request's time to first audio."""
    with ThreadPoolExecutor(clients) as pool:  # warm-up: every replica's sessions run once (not timed)
        list(pool.map(Stream.run, [Stream(server, THROUGHPUT_TEXT, seed=190 + i, max_rows=16)
                                   for i in range(2 * clients)]))
    stop, done = threading.Event(), []

    def client(i: int) -> None:
        k = 0
        while not stop.is_set():
            done.append(Stream(server, THROUGHPUT_TEXT, seed=200 + 10 * i + k, max_rows=rows).run())
            k += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(duration)
    stop.set()
    for t in threads:
        t.join(timeout=600)
    wall = time.perf_counter() - t0  # the last requests finish: their audio counts over the whole wall
    ok = [x for x in done if not x.error]
    firsts = sorted(x.first_audio_s for x in ok if x.first_audio_s is not None)
    audio = sum(x.audio_s() for x in ok)

    def pct(q: float) -> float | None:
        return firsts[min(len(firsts) - 1, int(q * len(firsts)))] if firsts else None

    return {"requests": len(ok), "wall_s": wall, "requests_per_s": len(ok) / wall, "audio_s": audio,
            "audio_s_per_s": audio / wall, "rows_per_s": audio * FRAME_RATE / wall,
            "first_audio_p50_s": pct(0.5), "first_audio_p95_s": pct(0.95),
            "errors": [x.error for x in done if x.error]}


def compare_replicas(args, flags: list[str]) -> dict:
    out = {}
    for name, extra in SETUPS:
        with tempfile.TemporaryDirectory() as work:
            server = Server(args.model_path, Path(work), *flags, *extra)
            try:
                print(f"{name}: {args.clients} clients for {args.duration:.0f} s ...", file=sys.stderr)
                out[name] = {"banner": server.banner, **closed_loop(server, args.clients, args.rows, args.duration)}
            finally:
                server.stop()
    return out


def report_replicas(out: dict) -> None:
    print(f"\none process vs replicas: {out['model_path']}, {out['args']['clients']} closed-loop clients, "
          f"{out['args']['duration']:.0f} s each, up to {out['args']['rows']} rows per request")
    print(f"CPU: {cpu_line(out['cpu'])}")
    print(f"  {'setup':<34} {'requests/s':>10} {'audio s/s':>10} {'rows/s':>8} {'TTFA p50':>9} {'TTFA p95':>9}")
    for name, r in out["replicas"].items():
        print(f"  {name:<34} {r['requests_per_s']:>10.2f} {r['audio_s_per_s']:>10.2f} {r['rows_per_s']:>8.1f} "
              f"{fmt(r['first_audio_p50_s']):>9} {fmt(r['first_audio_p95_s']):>9}"
              f"{'  errors: ' + str(len(r['errors'])) if r['errors'] else ''}")


# -- in process: the same feed on one scheduler, and 4 requests decoded together (a child process) ---------------
def inprocess_figures(model: Path, batch: int, rows: int, threads: int, duration: float) -> dict:
    from higgs_onnx.generation.codec_stream import StreamOptions
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.generation.scheduler import PrefillPolicy
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(model, threads=threads, verify=False)

    def decode_only(n_rows: int) -> tuple[float, int, int]:
        positions = 512 + n_rows
        sched = tts.scheduler(batch, positions, PrefillPolicy(chunk=positions))
        reqs = [tts.request(f"{STREAM_TEXT[:200]} Voice {i}.", slot=positions,
                            options=GenerationOptions(seed=i, max_rows=n_rows, ignore_eoc=True))
                for i in range(batch)]
        with sched:
            handles = [sched.submit(r) for r in reqs]
            sched.run_until_idle()  # prefill and decode: the wall starts at the first decoder step
            for h in handles:
                h.wait()
            stats = sched.stats()
        return stats["decode_s"], stats["rows"], stats["decoder_steps"]

    decode_only(tts.facts.num_codebooks)  # warm-up: sessions and the batch's bindings
    wall, n, steps = decode_only(rows)
    out = {"decode_only": {"batch": batch, "rows": n, "decoder_steps": steps, "wall_s": wall, "rows_per_s": n / wall,
                           "step_ms": wall / steps * 1e3}}

    # the server's feed: closed-loop clients on one started scheduler with the server's slot size and streaming audio
    slot = tts.slot_positions
    sched = tts.scheduler(batch, slot, PrefillPolicy()).start()
    stop, audio, errors = threading.Event(), [], []

    def client(i: int, seeds) -> None:
        try:
            for seed in seeds:
                if stop.is_set():
                    return
                req = tts.request(THROUGHPUT_TEXT, slot=slot, options=GenerationOptions(seed=seed, max_rows=rows))
                for chunk in sched.submit(req, "stream", StreamOptions()).chunks():
                    audio.append(len(chunk.samples))
                    if stop.is_set():
                        break  # leaving the iterator cancels the request
        except Exception as e:  # noqa: BLE001 - the run fails below, with the reason
            errors.append(f"{type(e).__name__}: {e}")

    try:
        warm = [threading.Thread(target=client, args=(i, [190 + i])) for i in range(batch)]
        for t in warm:
            t.start()
        for t in warm:
            t.join()
        before = sched.stats()
        audio.clear()
        threads_ = [threading.Thread(target=client, args=(i, (200 + 10 * i + k for k in range(10 ** 6))),
                                     daemon=True) for i in range(batch)]
        t0 = time.perf_counter()
        for t in threads_:
            t.start()
        time.sleep(duration)
        after, wall = sched.stats(), time.perf_counter() - t0
        stop.set()
        for t in threads_:
            t.join(timeout=600)
    finally:
        sched.stop()
    if errors:
        raise SystemExit(f"error: an in-process client failed: {errors[0]}")
    n, steps = after["rows"] - before["rows"], after["decoder_steps"] - before["decoder_steps"]
    out["same_feed"] = {"rows": n, "decoder_steps": steps, "wall_s": wall, "rows_per_s": n / wall,
                        "mean_batch": n / steps if steps else None, "step_ms": wall / steps * 1e3 if steps else None,
                        "requests": after["submitted"] - before["submitted"],
                        "decode_s": after["decode_s"] - before["decode_s"],
                        "prefill_s": after["prefill_s"] - before["prefill_s"],
                        "codec_busy_s": after["codec_busy_s"] - before["codec_busy_s"]}
    return out


def inprocess(model: Path, rows: int, threads: int, duration: float) -> dict:
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--model-path", str(model), "--rows",
                        str(rows), "--threads", str(threads), "--duration", str(duration), "--_inprocess"],
                       capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"error: the in-process run failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- report ------------------------------------------------------------------------------------------------------
def fmt(x, spec: str = ".3f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def print_gaps(title: str, phase: dict) -> None:
    print(f"\n{title}")
    print(f"  {'stream':>6} {'chunks':>7} {'interval before':>16} {'largest gap in window':>22} {'ratio':>7} "
          f"{'interval after':>15}")
    for i, f in enumerate(phase["streams"]):
        print(f"  {i:>6} {f['chunks']:>7} {fmt(f['median_interval_s'], '.3f', ' s'):>16} "
              f"{fmt(f['largest_gap_s'], '.3f', ' s'):>22} {fmt(f['ratio'], '.2f', 'x'):>7} "
              f"{fmt(f['median_after_s'], '.3f', ' s'):>15}{'  ' + f['error'] if f['error'] else ''}")
    worst = phase["worst_ratio"]
    verdict = "-" if worst is None else "PASS" if worst <= TARGET else "FAIL"
    print(f"  worst ratio {fmt(worst, '.2f', 'x')} (target <= {TARGET:.0f}x): {verdict}")


def report(out: dict) -> None:
    print(f"\nserver load: {out['model_path']} ({out['banner']})")
    print(f"CPU: {cpu_line(out['cpu'])}")
    if "stall" in out:
        s, c = out["stall"], out["stall"]["clone"]
        print_gaps(f"1. stall: 3 streams, then a clone request: prompt {c['prompt_positions']} positions, "
                   f"{c['prefilled_positions']} prefilled by the scheduler in {c['prefill_calls']} calls (the "
                   f"voice's prefix comes from its saved KV state); first audio after {fmt(c['first_audio_s'])} s, "
                   f"window {s['window_s']:.3f} s, longest prefill chunk beside decoding {c['longest_stall_s']} s",
                   s)
    if "upload" in out:
        u = out["upload"]
        print_gaps(f"2. upload: 3 streams while a new voice is made ({u['upload_s']:.3f} s; make_voice runs in the "
                   f"upload handler's thread, outside the scheduler)", u)
    if "throughput" in out:
        t = out["throughput"]
        print(f"\n3. throughput: {t['clients']} concurrent clients, {t['rows']} rows in {t['wall_s']:.2f} s "
              f"({t['decoder_steps']} decoder steps, mean batch {fmt(t['mean_batch'], '.2f')}, wall per step "
              f"{fmt(t['step_ms'], '.1f')} ms; of the wall: decoder steps {t['decode_s']:.1f} s, prefill "
              f"{t['prefill_s']:.1f} s ({t['prefill_positions']} positions); codec thread busy "
              f"{t['codec_busy_s']:.2f} s)")
        print(f"  {'how':<44} {'rows/s':>8}")
        print(f"  {'server, /health rows / wall':<44} {t['rows_per_s']:>8.1f}")
        print(f"  {'server, audio seconds x 25 / wall':<44} {t['audio_rows_per_s']:>8.1f}")
        if "inprocess" in out:
            f, d = out["inprocess"]["same_feed"], out["inprocess"]["decode_only"]
            print(f"  {'in process, the same feed on one scheduler':<44} {f['rows_per_s']:>8.1f}   "
                  f"(mean batch {fmt(f['mean_batch'], '.2f')}, wall per step {fmt(f['step_ms'], '.1f')} ms, "
                  f"decoder {f['decode_s']:.1f} s, prefill {f['prefill_s']:.1f} s, codec {f['codec_busy_s']:.2f} s)")
            print(f"  {'in process, 4 rows decoded only (bench B=4)':<44} {d['rows_per_s']:>8.1f}   "
                  f"(step {d['step_ms']:.1f} ms, {d['rows']} rows)")
            print(f"  server / same feed in process: {t['rows_per_s'] / f['rows_per_s']:.2f}x (the server's cost)")
            print(f"  server / decode only: {t['rows_per_s'] / d['rows_per_s']:.2f}x (target >= 0.90x)")
        if t["errors"]:
            print(f"  errors: {t['errors']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", type=Path, required=True, help="an onnx/<device>_<precision> export")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = one per core)")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--clients", type=int, default=4, help="closed-loop clients of the throughput phase (8 with "
                    "--max-batch 8: the int8 route's batched steps; HIGGS_ROUTE=off for the int4 route alone)")
    ap.add_argument("--prefill-chunk", type=int, help="passed to the server (default: sized by time)")
    ap.add_argument("--clone-words", type=int, default=40, help="words of the clone request's text (40: a prompt of "
                    "~310 positions with the bundled reference)")
    ap.add_argument("--clone-rows", type=int, default=100, help="rows of the clone request")
    ap.add_argument("--rows", type=int, default=200, help="rows per request in the throughput phases")
    ap.add_argument("--baseline-chunks", type=int, default=3, help="chunk intervals of normal pace before and "
                    "after the window, per stream")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of the closed-loop throughput phase")
    ap.add_argument("--only-throughput", action="store_true", help="skip the stall and upload phases")
    ap.add_argument("--skip-upload", action="store_true")
    ap.add_argument("--skip-inprocess", action="store_true")
    ap.add_argument("--compare-replicas", action="store_true", help="only compare one process with 2 threads and "
                    "2 Ray Serve replicas with 1 thread each under the same load")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--_inprocess", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._inprocess:
        print(json.dumps(inprocess_figures(args.model_path, 4, args.rows, args.threads, args.duration)))
        return 0
    if not (args.model_path / "manifest.json").is_file():
        raise SystemExit(f"error: {args.model_path} is not an export (no manifest.json)")
    import numpy as np
    import soundfile as sf

    ref = (REC / "ref_en_24k.flac").read_bytes()
    transcript = (REC / "ref_en_24k.txt").read_text().strip()
    wav, sr = sf.read(REC / "ref_en_24k.flac", dtype="float32")
    other = io.BytesIO()  # another recording for the upload phase (the same one would come from the voice cache)
    sf.write(other, (0.7 * wav).astype(np.float32), sr, format="FLAC")
    flags = ["--max-batch", str(args.max_batch), "--max-queue", "8", "--threads", str(args.threads)]
    if args.prefill_chunk:
        flags += ["--prefill-chunk", str(args.prefill_chunk)]
    out: dict = {"model_path": str(args.model_path), "cpu": cpu_info(), "args": {k: (str(v) if isinstance(v, Path)
                                                                                   else v)
                                                                               for k, v in vars(args).items()}}
    if args.compare_replicas:
        out["replicas"] = compare_replicas(args, ["--max-batch", str(args.max_batch), "--max-queue", "8"])
        report_replicas(out)
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
        return 0
    with tempfile.TemporaryDirectory() as work:
        server = Server(args.model_path, Path(work), *flags)
        out["banner"] = server.banner
        try:
            if not args.only_throughput:
                out["voice_upload_s"] = server.upload("clone", ref, transcript)
                out["stall"] = stall_phase(server, args, "clone")
            if not args.skip_upload and not args.only_throughput:
                out["upload"] = upload_phase(server, args, other.getvalue(), transcript)
            out["throughput"] = throughput_phase(server, args)
            out["scheduler"] = server.stats()
        finally:
            server.stop()
            log = (Path(work) / "server.log").read_text()
            if "Traceback" in log:
                print(f"warning: the server log has a traceback:\n{log[-3000:]}", file=sys.stderr)
    if not args.skip_inprocess:
        out["inprocess"] = inprocess(args.model_path, args.rows, args.threads, args.duration)
    report(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
