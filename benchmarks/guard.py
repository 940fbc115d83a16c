"""The guard on seeded draws: how often each verdict fires, how many draws a retry fixes, and its false positives.

    python benchmarks/guard.py [--draws 60] [--work onnx/bench/guard] [--json guard.json]

Synthetic checkpoints (each exported at cpu fp32, built once under `--work`):
- `tiny`, `wide` (another geometry: hidden 96, 3 layers, 6 heads): plain plants, whose draws stop on EOC by
  themselves at ~`eoc_ratio` rows per prompt token;
- `loop`: the tiny geometry with the MLP's hand on the next row weakened (`Plant.mlp_scale` 10 -> 2.0), so that
  the tied embedding copies the previous row back and draws lock onto one row, as the planting notes warn;
- `no_eoc`: the tiny geometry with EOC planted out of reach (`eoc_ratio` 1e4): draws never stop by themselves.

Every checkpoint gets `--draws` sampled takes (temperature 0.8, seeds 0..), over a few texts, through
`HiggsTTS.generate(retries=2)`; the first take's verdict and the final one are counted. A false positive is a
first take that, drawn without the guard, stops on EOC at a plausible length (within 0.5-2 x the plant's own
length, `eoc_ratio` x prompt tokens) without a loop, but was called degenerate (a take the guard stopped online is
drawn again with the same seed and the guard off to see where it would have ended). The guard's own cost per row
is timed on the rows made.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from higgs_onnx.job.run import best_of

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXTS = ("Hello there, this is a test of the guard.", "The quick brown fox jumps over the lazy dog.",
         "One more line of speech, please, with a comma or two.", "Short and sweet.",
         "你好，今天天气很好。")


def checkpoints():
    from higgs_onnx.synthetic import PRESETS, Plant

    wide = replace(PRESETS["tiny"], hidden=96, intermediate=160, layers=3, heads=6, kv_heads=3, head_dim=16)
    return {"tiny": ("tiny", Plant()), "wide": (wide, Plant()), "loop": ("tiny", Plant(mlp_scale=2.0)),
            "no_eoc": ("tiny", Plant(eoc_ratio=1e4))}


def export(name: str, preset, plant, work: Path) -> Path:
    from higgs_onnx.export import Exporter, ExportOptions
    from higgs_onnx.synthetic import build

    ckpt = work / f"ckpt_{name}"
    if not (ckpt / "config.json").is_file():
        build(preset, ckpt, seed=0, plant=plant, progress=False)
    return Exporter(str(ckpt), work / f"onnx_{name}", ExportOptions("cpu", "fp32")).run()


def draws(folder: Path, n: int, eoc_ratio: float) -> dict:
    from higgs_onnx.guard import GuardOptions, RowWatch
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(folder, verify=False)
    from higgs_onnx.generation.options import GenerationOptions

    first, final, fixed, tries, by_text = Counter(), Counter(), 0, 0, {}
    fp = plausible = 0
    rows_seen, guard_s, step_s = 0, 0.0, 0.0
    for i in range(n):
        text = TEXTS[i % len(TEXTS)]
        t0 = time.perf_counter()
        s = tts.generate(text, seed=i, temperature=0.8, retries=2)
        step_s += s.stats.decode_s
        takes = s.takes
        first[takes[0]["verdict"]] += 1
        final[takes[-1]["verdict"]] += 1
        tries += len(takes)
        if takes[0]["verdict"] != "good" and takes[-1]["verdict"] == "good":
            fixed += 1
        prompt = s.stats.prompt_tokens
        t = takes[0]
        by_text.setdefault(text[:24], Counter())[t["verdict"]] += 1
        plain = t
        if t["stop_reason"] in ("loop", "overlong"):  # stopped by the guard: where would it have ended without?
            u = tts.generate(text, seed=i, temperature=0.8, options=GenerationOptions(guard=False))
            w = RowWatch(GuardOptions(), None, tts.facts.num_codebooks, tts.facts.frame_rate)  # loops only
            looped = any(w.see(u.rows, k) for k in range(1, len(u.rows) + 1))
            # a take that loops is degenerate however it ends; one that only ran long is judged by where it ends
            plain = {"stop_reason": "loop" if looped else u.stop_reason, "rows": len(u.rows), "verdict": t["verdict"]}
        if plain["stop_reason"] == "eoc" and 0.5 * eoc_ratio * prompt <= plain["rows"] <= 2 * eoc_ratio * prompt:
            plausible += 1
            fp += plain["verdict"] != "good"
        # the guard's online cost, timed on this take's rows (one see() per row, as the engine calls it)
        w = RowWatch(GuardOptions(), 10**6, tts.facts.num_codebooks, tts.facts.frame_rate)
        t1 = time.perf_counter()
        for k in range(1, len(s.rows) + 1):
            w.see(s.rows, k)
        guard_s += time.perf_counter() - t1
        rows_seen += len(s.rows)
        del t0
    return {"draws": n, "first": dict(first), "final": dict(final), "fixed_by_retry": fixed, "takes": tries,
            "plausible_eoc_first_takes": plausible, "false_positives": fp,
            "first_by_text": {k: dict(v) for k, v in by_text.items()},
            "guard_us_per_row": guard_s / max(rows_seen, 1) * 1e6,
            "step_ms_per_row": step_s / max(rows_seen, 1) * 1e3}


def takes_cost(folder: Path, rows: int, takes: int = 4) -> dict:
    """`best_of(takes)` against one take of the same rows (ignore_eoc: every take makes exactly `rows`), wall time
    with the codec, in one process, beside the scheduler's measured batch gain G(takes) at those rows."""
    from benchmarks.bench import batch_figures, cpu_info
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(folder, verify=False)
    options = GenerationOptions(max_rows=rows, ignore_eoc=True, seed=1)
    best_of(tts, TEXTS[0], takes, options=GenerationOptions(max_rows=tts.facts.num_codebooks, ignore_eoc=True))
    one, many = [], []
    for _ in range(2):  # interleaved, best kept
        t0 = time.perf_counter()
        tts.generate(TEXTS[0], options=options)
        one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        best_of(tts, TEXTS[0], takes, options=options)
        many.append(time.perf_counter() - t0)
    gain = batch_figures(tts, [takes], rows, repeats=1)["gain"][str(takes)]
    ratio = min(many) / min(one)
    return {"rows": rows, "takes": takes, "one_take_s": min(one), "takes_s": min(many), "ratio": ratio,
            "gain": gain, "target": 1.15 * takes / gain, "cpu": cpu_info()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--takes-cost", type=Path, metavar="EXPORT", help="only: best_of(4) against one take on this "
                    "export (e.g. the 4b preset's), against 1.15 x 4 / G(4) measured in the same run")
    ap.add_argument("--rows", type=int, default=48, help="--takes-cost: rows of every take")
    ap.add_argument("--draws", type=int, default=60, help="draws per checkpoint")
    ap.add_argument("--work", type=Path, default=ROOT / "onnx" / "bench" / "guard")
    ap.add_argument("--only", nargs="+", choices=list(checkpoints()), help="some checkpoints only")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.takes_cost:
        r = takes_cost(args.takes_cost, args.rows)
        print(f"takes: {r['takes']} takes of {r['rows']} rows in {r['takes_s']:.2f} s, one take "
              f"{r['one_take_s']:.2f} s: {r['ratio']:.2f} x; G({r['takes']}) = {r['gain']:.2f}, target "
              f"1.15 x {r['takes']} / G = {r['target']:.2f} x")
        if args.json:
            args.json.write_text(json.dumps(r, indent=2))
        return 0
    out = {}
    for name, (preset, plant) in checkpoints().items():
        if args.only and name not in args.only:
            continue
        folder = export(name, preset, plant, args.work)
        out[name] = draws(folder, args.draws, plant.eoc_ratio)
        r = out[name]
        print(f"{name:<7} first takes {r['first']}; after retries {r['final']}; fixed by a retry "
              f"{r['fixed_by_retry']}; {r['takes']} takes for {r['draws']} draws; false positives "
              f"{r['false_positives']} of {r['plausible_eoc_first_takes']} plausible EOC takes; guard "
              f"{r['guard_us_per_row']:.1f} us a row ({r['guard_us_per_row'] / 1e3 / r['step_ms_per_row']:.2%} of "
              f"the step)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
