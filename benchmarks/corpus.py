"""Corpus benchmark: rows/s and audio seconds per wall second for worker x batch layouts on a local Ray instance.

Usage:
    python benchmarks/corpus.py --preset tiny --rows 40 --layouts 1x1 2x1 1x4 2x2
    python benchmarks/corpus.py --preset 4b --rows 8 --layouts 1x1 1x4 2x1 --max-rows 200

Each layout `WxB` (W workers, batch B each) runs `python -m higgs_onnx.corpus` on the same rows into a fresh folder
and reads its manifest: wall time (Ray start-up and model loads included, and reported apart), rows/s, audio
seconds per wall second, and each worker's peak RSS.
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
LINE = "Row number {i} of the corpus benchmark speaks one sentence of ordinary length for the data set."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["tiny", "4b"], default="tiny")
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x4"], help="WORKERSxBATCH")
    ap.add_argument("--max-rows", type=int, default=0, help="fix every row's length (ignore_eoc is not exposed: "
                    "0 = let the model stop)")
    ap.add_argument("--work", type=Path, default=ROOT / "onnx" / "bench")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from bench import ensure_export

    _, export = ensure_export(args.preset, "int4", args.work / args.preset)
    results = []
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "rows.jsonl"
        extra = {"max_rows": args.max_rows} if args.max_rows else {}
        src.write_text("\n".join(json.dumps({"id": f"r{i:04d}", "text": LINE.format(i=i), "seed": i, **extra})
                                 for i in range(args.rows)) + "\n")
        for layout in args.layouts:
            w, b = (int(x) for x in layout.split("x"))
            out = Path(d) / f"out-{layout}"
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "higgs_onnx.corpus", "--model-path", str(export), "--input",
                                str(src), "--out", str(out), "--workers", str(w), "--batch", str(b)],
                               capture_output=True, text=True, cwd=ROOT)
            wall = time.perf_counter() - t0
            if r.returncode:
                raise SystemExit(f"layout {layout} failed (exit {r.returncode}):\n{r.stderr[-3000:]}{r.stdout[-1000:]}")
            entries = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
            audio = sum(e["duration_s"] for e in entries)
            busy = sum(e["seconds"] for e in entries)  # row time inside the workers (overlaps within a batch)
            rss = {}
            for e in entries:
                rss[e["worker"]] = max(rss.get(e["worker"], 0.0), e["worker_peak_rss_mb"])
            results.append({"layout": layout, "workers": w, "batch": b, "rows": len(entries), "wall_s": wall,
                            "rows_per_s": len(entries) / wall, "audio_s": audio, "audio_per_wall_s": audio / wall,
                            "row_seconds_sum": busy, "worker_peak_rss_mb": sorted(rss.values())})
    print(f"\ncorpus: preset {args.preset}, int4, {args.rows} rows, {os.cpu_count()} CPUs (wall includes Ray start "
          f"and model loads)")
    print(f"  {'layout':>7} {'wall s':>8} {'rows/s':>8} {'audio s':>8} {'audio s / wall s':>17} "
          f"{'worker peak RSS MB':>20}")
    for x in results:
        rss = "/".join(f"{m:.0f}" for m in x["worker_peak_rss_mb"])
        print(f"  {x['layout']:>7} {x['wall_s']:>8.1f} {x['rows_per_s']:>8.2f} {x['audio_s']:>8.1f} "
              f"{x['audio_per_wall_s']:>17.2f} {rss:>20}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
