"""Corpus benchmark: how full one worker keeps its batch, and what batching gains, on a local Ray instance.

Usage:
    python benchmarks/corpus.py --model-path onnx/cpu_int4 --batch 4 --rows 24 --json corpus.json
    python benchmarks/corpus.py --model-path onnx/cpu_int4 --layouts 1x1 1x4 2x1 2x2       # workers x batch
    python benchmarks/corpus.py --preset 4b --batch 4                  # builds the synthetic 4b export first

Each layout `WxB` (default: 1x1 and 1x<--batch>) runs `python -m higgs_onnx.corpus` on the same rows of mixed
lengths (each row's `max_rows` spread over `--rows-range`; a row may also stop earlier, at its own end) into a fresh
folder, and reads its manifest and `summary.json`:
- mean batch: the worker's decoder rows / decoder steps over the whole job, and over the steps that began while
  B or more of its rows were still to make (the target is >= 0.95 x B: a finished row's slot is taken at once);
- rows/s: rows made / the worker's busy time (its first row arriving to its last row done: Ray's start and the
  model load excluded, the codec and the file writes included), and its ratio to the 1x1 layout. The target for
  one worker at batch B is >= 0.85 x G(B), where G(B) is the batch gain of the decode loop alone, measured by
  `benchmarks/bench.py --batch 1 B` (its command is printed; give its figure with --gain or its JSON with
  --bench-json to have the target checked here). G(B) leaves the codec out: where the codec's share of a row is
  large (the tiny export) the corpus's ratio falls short of it; the codec thread's busy time is in the table;
- wall time with Ray's start and the model loads, audio seconds per wall second and each worker's peak RSS.
The CPU's model and its SIMD / matrix flags (avx2, avx512f, avx512_vnni, amx_*) head the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("CI", "1")
LINE = "Row number {i} of the corpus benchmark speaks one sentence{more} for the data set."
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni")  # and every amx_* flag
FULL_TARGET, GAIN_TARGET = 0.95, 0.85


def cpu() -> tuple[str, list[str]]:
    """The CPU's model name and which of the flags that decide the int4 kernels it has (Linux /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU", []
    model = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "unknown CPU")
    flags = set(next((x.split(":", 1)[1].split() for x in lines if x.startswith("flags")), []))
    return model, [f for f in FLAGS if f in flags] + sorted(f for f in flags if f.startswith("amx"))


def rows(n: int, lo: int, hi: int) -> list[dict]:
    """`n` rows of mixed lengths: max_rows spread over [lo, hi) in a scrambled order, texts of 1-4 clauses."""
    span = max(hi - lo, 1)
    return [{"id": f"r{i:04d}", "text": LINE.format(i=i, more=", and a little more" * (i % 4)), "seed": i,
             "max_rows": lo + (i * 53) % span} for i in range(n)]


def bench_gain(path: Path, batch: int) -> float | None:
    """G(batch) from a `benchmarks/bench.py --batch 1 B --json` file: rows/s at B over rows/s at 1."""
    data = json.loads(path.read_text())
    rate = {b["batch"]: b["rows_per_s"] for b in data.get("batches", [])}
    return rate[batch] / rate[1] if 1 in rate and batch in rate else None


def run_layout(export: Path, src: Path, out: Path, workers: int, batch: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "higgs_onnx.corpus", "--model-path", str(export), "--input", str(src), "--out",
           str(out), "--workers", str(workers), "--batch", str(batch)]
    cmd += ["--threads", str(threads)] if threads else []
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"layout {workers}x{batch} failed (exit {r.returncode}):\n{r.stderr[-3000:]}"
                         f"{r.stdout[-1000:]}")
    entries = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    ws = summary["workers"]
    busy = max(w["busy_s"] for w in ws)  # the workers run side by side
    full = [w["full_mean_batch"] for w in ws if w["full_mean_batch"] is not None]
    audio = sum(e["duration_s"] for e in entries)
    return {"layout": f"{workers}x{batch}", "workers": workers, "batch": batch, "rows": len(entries),
            "generated_rows": sum(e["rows"] for e in entries), "wall_s": wall, "busy_s": busy,
            "rows_per_s": sum(w["made"] for w in ws) / busy, "wall_rows_per_s": len(entries) / wall,
            "audio_s": audio, "audio_per_wall_s": audio / wall,
            "mean_batch": [w["mean_batch"] for w in ws], "full_mean_batch": full,
            "decoder_steps": [w["decoder_steps"] for w in ws], "pools": [w["pools"] for w in ws],
            "codec_busy_s": [w["codec_busy_s"] for w in ws],
            "worker_peak_rss_mb": sorted(w["peak_rss_mb"] for w in ws)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, help="an export folder (default: build the --preset synthetic one)")
    ap.add_argument("--preset", choices=["tiny", "4b"], default="tiny")
    ap.add_argument("--batch", type=int, default=4, help="B of the 1xB layout (default 4)")
    ap.add_argument("--layouts", nargs="+", help="WORKERSxBATCH ... (default: 1x1 1x<--batch>)")
    ap.add_argument("--rows", type=int, default=24, help="rows of the corpus (default 24)")
    ap.add_argument("--rows-range", type=int, nargs=2, default=(24, 260), metavar=("LO", "HI"),
                    help="each row's max_rows, spread over [LO, HI) (default 24 260)")
    ap.add_argument("--threads", type=int, default=0, help="--threads of the corpus (default: cores / workers)")
    ap.add_argument("--gain", type=float, help="G(B) from bench.py, to check the rows/s target here")
    ap.add_argument("--bench-json", type=Path, help="bench.py --batch 1 B --json output: G(B) read from it")
    ap.add_argument("--work", type=Path, default=ROOT / "onnx" / "bench")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.rows < 1 or args.batch < 1 or args.rows_range[0] < 8 or args.rows_range[1] <= args.rows_range[0]:
        ap.error("--rows and --batch must be >= 1, --rows-range LO HI with 8 <= LO < HI")
    if args.model_path is None:
        from bench import ensure_export

        _, export = ensure_export(args.preset, "int4", args.work / args.preset)
    else:
        export = args.model_path
        if not (export / "manifest.json").is_file():
            ap.error(f"--model-path {export}: no manifest.json there (not an export folder)")
    layouts = args.layouts or ["1x1", f"1x{args.batch}"]
    model, flags = cpu()
    out = {"export": str(export.resolve()), "cpu": model, "cpu_flags": flags, "cpus": os.cpu_count(),
           "rows": args.rows, "rows_range": list(args.rows_range), "layouts": []}
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "rows.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows(args.rows, *args.rows_range)))
        for layout in layouts:
            w, b = (int(x) for x in layout.split("x"))
            print(f"  {layout} ...", end="", flush=True, file=sys.stderr)
            fig = run_layout(export, src, Path(d) / f"out-{layout}", w, b, args.threads)
            print(f" {fig['wall_s']:.1f} s", file=sys.stderr)
            out["layouts"].append(fig)
    base = next((x for x in out["layouts"] if x["layout"] == "1x1"), None)
    gain = args.gain if args.gain is not None else bench_gain(args.bench_json, args.batch) if args.bench_json else None
    out["gain"] = gain
    print(f"\ncorpus: {export}, {args.rows} rows of {args.rows_range[0]}-{args.rows_range[1] - 1} rows each, "
          f"{os.cpu_count()} CPUs: {model}; flags {', '.join(flags) or 'none of ' + ', '.join(FLAGS)}")
    print(f"  {'layout':>7} {'mean batch':>11} {'>=B left':>9} {'target':>7} {'rows/s':>8} {'x 1x1':>7} "
          f"{'codec s':>8} {'wall s':>7} {'audio s/wall s':>15} {'peak RSS MB':>12}")
    for x in out["layouts"]:
        x["vs_1x1"] = x["rows_per_s"] / base["rows_per_s"] if base else None
        mean = "/".join(f"{m:.2f}" for m in x["mean_batch"])
        full = "/".join(f"{m:.2f}" for m in x["full_mean_batch"]) or "-"
        ratio = f"{x['vs_1x1']:.2f}x" if x["vs_1x1"] is not None else "-"
        rss = "/".join(f"{m:.0f}" for m in x["worker_peak_rss_mb"])
        codec = "/".join(f"{m:.1f}" for m in x["codec_busy_s"])
        print(f"  {x['layout']:>7} {mean:>11} {full:>9} {FULL_TARGET * x['batch']:>7.2f} {x['rows_per_s']:>8.2f} "
              f"{ratio:>7} {codec:>8} {x['wall_s']:>7.1f} {x['audio_per_wall_s']:>15.2f} {rss:>12}")
    target = f"1x{args.batch}"
    mine = next((x for x in out["layouts"] if x["layout"] == target), None)
    threads = f" --threads {args.threads}" if args.threads else ""
    print(f"  mean batch: decoder rows / decoder steps, over the job and over the steps begun with >= B of the "
          f"worker's rows left (target {FULL_TARGET} x B); rows/s over the worker's busy time; codec s: its codec "
          f"thread's busy time (G(B) leaves the codec out)")
    print(f"  G({args.batch}), the decode loop's batch gain: python benchmarks/bench.py --model-path {export} "
          f"--batch 1 {args.batch}{threads} --json batch.json")
    if mine and base and mine is not base:
        if gain:
            ok = mine["vs_1x1"] >= GAIN_TARGET * gain
            print(f"  {target} vs 1x1: {mine['vs_1x1']:.2f}x; target >= {GAIN_TARGET} x G({args.batch}) = "
                  f"{GAIN_TARGET * gain:.2f}x: {'met' if ok else 'NOT met'}")
        else:
            print(f"  {target} vs 1x1: {mine['vs_1x1']:.2f}x; target >= {GAIN_TARGET} x G({args.batch}) "
                  f"(give --gain or --bench-json to check it)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
