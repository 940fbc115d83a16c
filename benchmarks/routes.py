"""Both decoder routes in one run: what a user waits for with the int4 graph alone and with the int8 GEMM route.

    python benchmarks/bench.py --routes [--preset 4b | --model-path onnx/cpu_int4] [--threads N] [--json out.json]
    python benchmarks/routes.py --model-path onnx/cpu_int4 ...                          (the same)

The export must have the route (`optimize.py` writes it for a cpu int4 build whose gate holds). Each route is
measured in a child process of its own (a clean peak RSS), in the order off, on, auto, off again (the second int4
run shows the machine's drift):
- `off`: every call on int4 (`HiggsTTS(route="off")`: the route's session is never loaded);
- `on`: every call of two or more rows on the route (one-row steps stay on int4);
- `auto`: the export's crossover (what a user gets; measured at build, or given there).

Figures per route: a one-row prefill of 24 and 281 positions (a zero-shot prompt, a 10 s clone's prompt), the
first frame of a new cloned voice (a 10 s reference: encode, its prefix prefilled, the line prefilled, the first
row; `stats.first_row_s`) and its first audio (the first frame's rows decoded by the codec: `stats.first_audio_s`)
with the codec encoder's share (the encoder alone on the same reference), decoder rows/s of batched steps at B = 1,
2, 4, 8, 16 (a pool of 16 slots, context 32, best of `--repeats`), the single-row step (it must stay the same: int4
takes it on every route), and peak RSS.
The CPU's model and its SIMD / matrix flags head the table; nothing is asserted (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCHES = (1, 2, 4, 8, 16)
PREFILLS = (24, 281)
MODES = ("off", "on", "auto", "off")


def reference_10s(folder: Path) -> tuple[Path, str]:
    """A 10.0 s reference: the bundled English recording repeated to 10 s (a new file each run: a new voice)."""
    import soundfile as sf

    wav, sr = sf.read(ROOT / "tests" / "data" / "ref_en_24k.wav", dtype="float32")
    reps = int(np.ceil(10.0 * sr / len(wav)))
    path = folder / "ref_10s.wav"
    sf.write(path, np.tile(wav, reps)[: int(10.0 * sr)], sr)
    text = (ROOT / "tests" / "data" / "ref_en_24k.txt").read_text().strip()
    return path, " ".join([text] * reps)


def measure(model_path: Path, mode: str, threads: int, repeats: int) -> dict:
    """One route's figures in this process (`--_child`)."""
    import tempfile

    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(model_path, threads=threads, verify=False, route=mode)
    tts.preload()
    dec, f = tts.backend.decoder, tts.facts
    rng = np.random.default_rng(0)
    out = {"mode": mode, "policy": str(getattr(dec, "policy", None)), "route_loaded": tts.backend.route_part
           is not None}
    for n in PREFILLS:
        embeds = (rng.standard_normal((n, f.hidden)) * 0.05).astype(np.float32)
        cache = dec.new_cache(n)
        best = float("inf")
        for _ in range(repeats):
            cache.truncate(0)
            t0 = time.perf_counter()
            dec.run(cache, embeds)
            best = min(best, time.perf_counter() - t0)
        out[f"prefill_{n}_ms"] = best * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        ref, text = reference_10s(Path(tmp))
        tts.generate("Warm up the codec and the heads.", max_rows=8)
        wav = tts.codec.reference(ref)
        tts.encode_audio(wav[: tts.facts.sample_rate])  # the encoder's session made (its load is not a clone's)
        t0 = time.perf_counter()
        tts.encode_audio(wav)
        out["clone_encode_s"] = time.perf_counter() - t0  # the codec encoder alone on the 10 s reference
        # one frame's rows (the delay pattern's first full frame), decoded: the first audio a user hears
        s = tts.generate("A new cloned voice speaks its first frame.", ref_audio=ref, ref_text=text,
                         options=GenerationOptions(seed=1, max_rows=f.num_codebooks)).stats
        out["clone_first_frame_s"], out["clone_voice_s"] = s.first_row_s, s.voice_s
        out["clone_first_audio_s"] = s.first_audio_s  # encode + prefix and line prefilled + rows + codec chunk
    context, slots = 32, max(BATCHES)
    pool = dec.pool(slots, context + repeats + 4)
    held = [pool.acquire(context + repeats + 4) for _ in range(slots)]
    codes = rng.integers(0, f.codebook_size, (slots, f.num_codebooks))
    out["rows_per_s"] = {}
    for b in BATCHES:
        best = float("inf")
        for _ in range(repeats + 1):  # the first is a warm-up
            for s in held[:b]:
                pool.lengths[s.index] = context  # positions as written; their values do not change the cost
            t0 = time.perf_counter()
            pool.step_batch(held[:b], codes[:b])
            best = min(best, time.perf_counter() - t0)
        out["rows_per_s"][str(b)] = b / best
    out["step_ms"] = 1e3 / out["rows_per_s"]["1"]
    out["calls"] = {"int4": dec.calls[False], "route": dec.calls[True]} if hasattr(dec, "calls") else None
    from bench import peak_rss_mb

    out["peak_rss_mb"] = peak_rss_mb()
    return out


def cpu() -> dict:
    from higgs_onnx.runtime.route import cpu_summary

    return cpu_summary()


def run(model_path: Path, threads: int, repeats: int) -> dict:
    from higgs_onnx.manifest import crossover_words, load_manifest

    route = load_manifest(model_path, verify=False).decoder.get("route", {})
    if route.get("kind") != "int8-gemm":
        raise SystemExit(f"{model_path} has no int8 route ({route}); build it with optimize.py (cpu, int4)")
    runs = []
    for mode in MODES:
        print(f"  route {mode} ...", flush=True, file=sys.stderr)
        r = subprocess.run([sys.executable, __file__, "--model-path", str(model_path), "--threads", str(threads),
                            "--repeats", str(repeats), "--_child", mode], capture_output=True, text=True, cwd=ROOT)
        if r.returncode:
            raise RuntimeError(f"route {mode} failed:\n{r.stderr[-3000:]}")
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return {"export": str(model_path), "cpu": cpu(), "threads": threads or os.cpu_count(), "repeats": repeats,
            "crossover": route.get("crossover"), "crossover_words": crossover_words(route),
            "build_cpu": route.get("cpu"), "runs": runs}


def print_table(o: dict) -> None:
    print(f"\n{o['export']}: {o['cpu']['model']} ({', '.join(o['cpu']['flags'])}), {o['threads']} threads; crossover "
          f"{o['crossover_words']}")
    runs = o["runs"]
    head = ["figure", *[r["mode"] for r in runs], "int4 / route (first off vs on)"]
    rows = [("prefill 24 positions (ms)", "prefill_24_ms", "{:.1f}"),
            ("prefill 281 positions (ms)", "prefill_281_ms", "{:.1f}"),
            ("first frame, new 10 s clone (s)", "clone_first_frame_s", "{:.2f}"),
            ("first audio, new 10 s clone (s)", "clone_first_audio_s", "{:.2f}"),
            ("  of it the codec encoder (s)", "clone_encode_s", "{:.2f}"),
            ("decode step, one row (ms)", "step_ms", "{:.1f}")]
    print(" | ".join(head))
    off, on = runs[0], runs[1]
    for label, key, fmt in rows:
        print(" | ".join([label, *[fmt.format(r[key]) for r in runs], f"{off[key] / on[key]:.2f} x"]))
    for b in BATCHES:
        k = str(b)
        print(" | ".join([f"rows/s at B = {b}", *[f"{r['rows_per_s'][k]:.2f}" for r in runs],
                          f"{on['rows_per_s'][k] / off['rows_per_s'][k]:.2f} x (route / int4)"]))
    print(" | ".join(["peak RSS (MB)", *[f"{r['peak_rss_mb']:.0f}" for r in runs], ""]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, required=True, help="a cpu int4 export with the int8 route")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="best of this many (default %(default)s)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--_child", choices=("off", "on", "auto"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not (args.model_path / "manifest.json").is_file():
        ap.error(f"--model-path {args.model_path}: no manifest.json there (not an export folder)")
    if args._child:
        print(json.dumps(measure(args.model_path, args._child, args.threads, args.repeats)))
        return 0
    out = run(args.model_path, args.threads, args.repeats)
    print_table(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
