"""Exports for different devices and decoder graphs side by side, in one run: parity, decoder step, speed, memory.

    python benchmarks/devices.py --preset tiny                     # cpu (GQA), cpu portable, openvino at int4
    python benchmarks/devices.py --preset 4b --steps 30 --rows 48  # the real geometry (builds what is missing)
    python benchmarks/devices.py --targets cpu openvino --precision fp32
    python benchmarks/devices.py --model-paths onnx/cpu_int4 onnx/openvino_int4 --also-host   # existing exports

Each target is `device[:attention]`; its export is built (or reused) under `--work/<preset>/onnx/`. Every figure
comes from a fresh child process per export (its peak RSS is its own), and the exports take turns `--rounds` times
(the best median of each is kept), so the ratios to the first target hold within this run on this machine.
Parity: each part's gate from the build (the same checks eval.py's Parts section runs) and the decoder's figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench import TEXT, child, decoder_figures, ensure_export, peak_rss_mb  # noqa: E402
from higgs_onnx import providers  # noqa: E402
from higgs_onnx.manifest import load_manifest  # noqa: E402
from higgs_onnx.parity import summary  # noqa: E402


def measure(folder: Path, threads: int, context: int, steps: int, rows: int, kv_cache: str = "bound") -> dict:
    """One export in this process: load, decoder prefill/step, one fixed-length generation, peak RSS. `kv_cache`
    "host": the cache fed through NumPy every step (on OpenVINO: the plain path, not the stateful model)."""
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.runtime.model import HiggsTTS

    t0 = time.perf_counter()
    tts = HiggsTTS(folder, threads=threads, verify=False, kv_cache=kv_cache)
    tts.generate("Warm up.", max_rows=8)
    load_s = time.perf_counter() - t0
    figs = decoder_figures(tts, context, steps)
    t0 = time.perf_counter()
    speech = tts.generate(TEXT, options=GenerationOptions(temperature=0, max_rows=rows, ignore_eoc=True))
    wall = time.perf_counter() - t0
    return {**figs, "load_s": load_s, "rows": len(speech.rows), "rows_per_s": len(speech.rows) / wall,
            "ran_on": sorted(set(tts.ran_on().values())), "kv_memory": tts.kv_memory, "peak_rss_mb": peak_rss_mb()}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["tiny", "4b"], default="tiny")
    ap.add_argument("--targets", nargs="+", default=["cpu", "cpu:portable", "openvino"], metavar="DEVICE[:ATTENTION]")
    ap.add_argument("--precision", choices=["int4", "fp16", "fp32"], default="int4")
    ap.add_argument("--steps", type=int, default=30, help="decode steps for the step median")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rows", type=int, default=48, help="rows of the timed generation")
    ap.add_argument("--rounds", type=int, default=2, help="turns each export takes (best median kept)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--work", type=Path, default=ROOT / "onnx" / "bench")
    ap.add_argument("--model-paths", type=Path, nargs="+", metavar="DIR",
                    help="existing export folders to compare (instead of --targets; nothing is built)")
    ap.add_argument("--also-host", action="store_true", help="measure each OpenVINO export a second time with its "
                    "KV cache fed through NumPy (the path before the stateful model)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--_measure", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--_kv-cache", dest="_kv_cache", default="bound", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args._measure:
        print(json.dumps(measure(args._measure, args.threads, args.context, args.steps, args.rows, args._kv_cache)))
        return 0
    exports, how = {}, {}
    if args.model_paths:
        for folder in args.model_paths:
            m = load_manifest(folder, verify=False)  # a clear error before any run
            exports[folder.name] = folder
            if args.also_host and providers.get(m.device).ort_name is None:  # run by the OpenVINO runtime
                exports[f"{folder.name}:host"], how[f"{folder.name}:host"] = folder, "host"
    for target in [] if args.model_paths else args.targets:
        device, _, attention = target.partition(":")
        providers.get(device).check(args.precision, attention or None)  # a clear error before any build
        _, exports[target] = ensure_export(args.preset, args.precision, args.work / args.preset, device,
                                           attention or None)
        if args.also_host and providers.get(device).ort_name is None:
            exports[f"{target}:host"], how[f"{target}:host"] = exports[target], "host"
    runs: dict[str, list[dict]] = {t: [] for t in exports}
    for r in range(args.rounds):
        for target, folder in exports.items():
            fig, _ = child("--_measure", str(folder), "--threads", str(args.threads), "--context", str(args.context),
                           "--steps", str(args.steps), "--rows", str(args.rows), "--_kv-cache",
                           how.get(target, "bound"), script=__file__)
            runs[target].append(fig)
            print(f"  round {r + 1}: {target:<22} step {fig['decoder_step_ms']:.1f} ms", flush=True)
    out = {"preset": None if args.model_paths else args.preset, "precision": args.precision, "threads": args.threads,
           "exports": {}}
    for target, figs in runs.items():
        m = load_manifest(exports[target], verify=False)
        best = min(figs, key=lambda f: f["decoder_step_ms"])
        parts_ok = all(e["parity"].get("ok", True) for e in m.parts.values())
        out["exports"][target] = {**best, "folder": exports[target].name, "decoder": m.decoder,
                                  "decoder_parity": summary(m.parts["llm_decoder"]["parity"]),
                                  "parts_ok": parts_ok,
                                  "step_ms_rounds": [f["decoder_step_ms"] for f in figs],
                                  "rss_mb_median": statistics.median(f["peak_rss_mb"] for f in figs)}
    base = next(iter(out["exports"].values()))
    what = "given exports" if args.model_paths else f"preset {args.preset}, {args.precision}"
    print(f"\ndevices: {what}, context {args.context}, {args.rows} rows; ratios to {next(iter(out['exports']))}")
    print(f"{'target':<22}{'runs on':<22}{'cache':<7}{'parity':<8}{'step ms':>9}{'x':>6}{'prefill ms':>11}{'rows/s':>8}"
          f"{'RSS MB':>8}  decoder parity")
    for target, e in out["exports"].items():
        print(f"{target:<22}{', '.join(e['ran_on']):<22}{e['kv_memory']:<7}{'PASS' if e['parts_ok'] else 'FAIL':<8}"
              f"{e['decoder_step_ms']:>9.2f}{e['decoder_step_ms'] / base['decoder_step_ms']:>6.2f}"
              f"{e['prefill_zero_shot_ms']:>11.1f}{e['rows_per_s']:>8.1f}{e['peak_rss_mb']:>8.0f}  "
              f"{e['decoder_parity']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0 if all(e["parts_ok"] for e in out["exports"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
