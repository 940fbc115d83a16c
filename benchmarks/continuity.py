"""Playback continuity of streamed speech: would a player that starts at the first audio have had every 100 ms of
it in time, with one stream and with 8 streams decoded together?

    python benchmarks/bench.py --continuity [--preset tiny | --model-path onnx/cpu_int4] [--streams 1 8]
        [--stream-seconds 5] [--chunk-frames 25] [--json out.json]

(`bench.py` also runs it at the end of its streaming section.) Each run submits `streams` requests at once to one
started scheduler of that many slots (the server's path: `HiggsTTS.scheduler`, its own thread, the codec worker,
the prefill sized by time, the default `StreamOptions`), each a line of exactly `--stream-seconds` of audio
(`ignore_eoc`), and records every audio chunk's arrival (the time the scheduler hands it over, from the
submission) and its samples. From those events (`continuity`):

- **on time**: the share of 100 ms windows of playback whose audio had all arrived by the time a player that
  started at the stream's first audio reaches the window (due = first arrival + the window's start in playback
  time; a player pulling 100 ms buffers, as an audio device does);
- **p95 underrun**: how late the late windows were (ms, the 95th percentile of their lateness; 0 if none);
  `max underrun` is the largest, which is also the buffer a player would have to hold back before starting to
  play without a gap;
- **stalls**: the pauses of a player that plays each sample as soon as it can and, when it runs out of audio,
  waits for the next chunk (and goes on from there, later): how many per stream and the longest; **C100** is the
  share of streams whose longest pause is at most 100 ms (sglang-omni's figure: its "maximum playback underrun"
  per request, and the share of requests at most 100 ms).

Figures of all streams together (windows pooled), the time to first audio (TTFA: submission to the first chunk;
p50 and the largest), and the audio seconds made per wall second of the whole run. The machine's load average is
recorded before and after: the figures are the machine's, shared or not. Nothing is asserted here.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WINDOW_S = 0.1  # the playback window: 100 ms, as the issue and sglang-omni's figures use
C100_S = 0.1  # sglang-omni's C100: a stream passes when its longest playback underrun is at most 100 ms
STREAMS = (1, 8)
TEXT = "The quick brown fox jumps over the lazy dog while the speech synthesizer keeps talking, stream number {}."


def _windows(events: list[tuple[float, int]], sample_rate: int, window_s: float):
    """One stream's events (arrival s, samples) -> (when each window was ready, when it was due, its length), in
    seconds. A window is ready when its last sample has arrived; the last window may be shorter."""
    events = [(t, n) for t, n in events if n > 0]
    if not events:
        raise ValueError("a stream with no audio has no playback to judge")
    times = np.maximum.accumulate(np.array([t for t, _ in events], np.float64))  # audio arrives in order
    ends = np.cumsum([n for _, n in events])  # samples there after each chunk
    win = round(window_s * sample_rate)
    starts = np.arange(math.ceil(ends[-1] / win)) * win
    stops = np.minimum(starts + win, ends[-1])  # each window's end, in samples
    ready = times[np.searchsorted(ends, stops, side="left")]  # the chunk that completes it
    return ready, times[0] + starts / sample_rate, (stops - starts) / sample_rate


def _stalls(events: list[tuple[float, int]], sample_rate: int) -> list[float]:
    """The pauses (s) of a player that plays every sample as soon as it can: it starts at the first chunk, and
    when it runs out of audio it waits for the next chunk and goes on from there, later (sglang-omni's and
    vllm-omni's "playback underrun", per chunk)."""
    events = [(t, n) for t, n in events if n > 0]
    clock, stalls = events[0][0], []
    for at, n in events:
        if at > clock:
            stalls.append(at - clock)
            clock = at
        clock += n / sample_rate
    return stalls


def continuity(streams: list[list[tuple[float, int]]], sample_rate: int, window_s: float = WINDOW_S) -> dict:
    """Playback continuity of streams of audio chunks: each stream a list of (arrival s, samples) events, in the
    order they arrived, times from the request's submission. Windows of `window_s` of playback; a window is due
    at the stream's first arrival + its start in playback time and on time when all its samples were there by
    then. Returns the pooled figures (`on_time`: share of windows; `underrun_p95_ms` / `underrun_max_ms`: over
    the late windows, 0 if none; `stalls`: pauses of a player that waits for late audio, `longest_stall_ms`;
    `c100`: the share of streams whose longest pause is at most 100 ms, sglang-omni's C100; `first_audio_s` p50 /
    max) and `streams`, the same per stream."""
    lates, stalls, firsts, audio = [], [], [], []
    for events in streams:
        ready, due, lengths = _windows(events, sample_rate, window_s)
        lates.append(ready - due)
        stalls.append(_stalls(events, sample_rate))
        firsts.append(float(due[0]))
        audio.append(float(lengths.sum()))
    per = [_summary([late], [st], [first], a)
           for late, st, first, a in zip(lates, stalls, firsts, audio, strict=True)]
    return {**_summary(lates, stalls, firsts, sum(audio)), "streams": per}


def _summary(lates: list[np.ndarray], stalls: list[list[float]], firsts: list[float], audio_s: float) -> dict:
    late = np.concatenate(lates)
    under = late[late > 0] * 1e3
    pauses = [s for ss in stalls for s in ss]
    return {"windows": int(late.size), "on_time": float(np.mean(late <= 0)), "late_windows": int(under.size),
            "underrun_p95_ms": float(np.percentile(under, 95)) if under.size else 0.0,
            "underrun_max_ms": float(under.max()) if under.size else 0.0,
            "stalls": len(pauses), "longest_stall_ms": max(pauses, default=0.0) * 1e3,
            "c100": float(np.mean([max(ss, default=0.0) <= C100_S for ss in stalls])),
            "first_audio_s": float(np.median(firsts)), "first_audio_max_s": max(firsts), "audio_s": audio_s}


def measure(tts, streams: int, seconds: float, chunk_frames: int | None = None, seed: int = 0) -> dict:
    """`streams` requests of `seconds` of audio each, submitted at once to one started scheduler of `streams`
    slots; every chunk's (arrival s from the submission, samples) recorded on the thread that hands it over."""
    from higgs_onnx.generation.codec_stream import StreamOptions
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.generation.stream import AudioChunk

    f = tts.facts
    rows = int(round(seconds * f.frame_rate)) + f.num_codebooks - 1  # the delay pattern's tail: exactly `seconds`
    positions = 512 + rows  # one slot: the prompt (well under 512 positions) and every row
    stream_options = StreamOptions() if chunk_frames is None else StreamOptions(chunk_frames=chunk_frames)
    reqs = [tts.request(TEXT.format(i), slot=positions,
                        options=GenerationOptions(seed=seed + i, max_rows=rows, ignore_eoc=True))
            for i in range(streams)]
    events: list[list[tuple[float, int]]] = [[] for _ in reqs]
    lock = threading.Lock()

    def sink(kept: list):
        def record(item) -> None:
            if isinstance(item, AudioChunk):
                with lock:
                    kept.append((time.perf_counter() - t0, item.samples.size))
        return record

    load = os.getloadavg()[0]
    with tts.scheduler(streams, positions) as sched:
        sched.start()
        t0 = time.perf_counter()
        handles = [sched.submit(r, "stream", stream_options, sink=sink(e)) for r, e in zip(reqs, events, strict=True)]
        for h in handles:
            if not h.finished.wait(timeout=3600):
                raise RuntimeError(f"a stream of {streams} did not finish within an hour")
            if h.error is not None:
                raise RuntimeError(f"a stream of {streams} failed: {h.error}")
        wall = time.perf_counter() - t0
    fig = continuity(events, f.sample_rate)
    return {"streams": streams, "seconds": seconds, "rows": rows, "chunk_frames": stream_options.chunk_frames,
            "first_frames": stream_options.first_frames, "wall_s": wall, "audio_s_per_s": fig["audio_s"] / wall,
            "load_before": load, "load_after": os.getloadavg()[0], "figures": fig, "events": events}


def run(model_path: Path, threads: int = 0, streams=STREAMS, seconds: float = 5.0,
        chunk_frames: int | None = None) -> dict:
    """Every count of `streams` on one loaded model, each after a short warm run at that count (sessions, the
    batch's bindings)."""
    from higgs_onnx.runtime.model import HiggsTTS
    from higgs_onnx.runtime.route import cpu_summary

    tts = HiggsTTS(model_path, threads=threads, verify=False)
    runs = []
    for b in streams:
        measure(tts, b, 0.5, chunk_frames)
        runs.append(measure(tts, b, seconds, chunk_frames))
    return {"export": str(model_path), "cpu": cpu_summary(), "threads": threads or os.cpu_count(),
            "precision": tts.manifest.precision, "window_ms": WINDOW_S * 1e3, "runs": runs}


def print_table(o: dict) -> None:
    print(f"\nplayback continuity: {o['export']} ({o['precision']}), {o['threads']} threads, "
          f"{o['window_ms']:.0f} ms windows")
    print(f"CPU: {o['cpu']['model']}; {', '.join(o['cpu']['flags']) or 'no AVX2'}")
    print(f"  {'streams':>7} {'audio s':>7} {'TTFA p50':>9} {'TTFA max':>9} {'on time':>8} {'p95 under':>10} "
          f"{'max under':>10} {'stalls/str':>10} {'longest':>9} {'C100':>6} {'audio s/s':>9} {'load':>10}")
    for r in o["runs"]:
        g = r["figures"]
        print(f"  {r['streams']:>7} {r['seconds']:>7.1f} {g['first_audio_s']:>8.2f}s {g['first_audio_max_s']:>8.2f}s "
              f"{100 * g['on_time']:>7.1f}% {g['underrun_p95_ms']:>7.0f} ms {g['underrun_max_ms']:>7.0f} ms "
              f"{g['stalls'] / r['streams']:>10.1f} {g['longest_stall_ms']:>6.0f} ms {100 * g['c100']:>5.0f}% "
              f"{r['audio_s_per_s']:>9.2f} "
              f"{r['load_before']:>4.1f}-{r['load_after']:<4.1f}")
    print(f"  chunks: the first {o['runs'][0]['first_frames']} frames, then {o['runs'][0]['chunk_frames']}; on time ="
          f" windows whose audio was all there when a player started at the first audio reached them; stalls: the "
          f"pauses of a player that waits for late audio; C100: streams whose longest pause <= 100 ms")
