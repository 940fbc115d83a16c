"""The int8 KV cache's scale choices on one export: per channel / per tensor, with and without the margin, and two
deliberately broken scales (20 x too coarse, 20 x too fine), each gated like the build does it.

    python benchmarks/kv_cache.py --model-path onnx/cpu_int4_kvfp32 [--rows 120] [--json out.json]

`--model-path` is an export with an fp32 cache (`optimize.py ... --kv-cache fp32`; an int8 one is turned back into
its fp32 twin first). The scales are calibrated once on it (`parts/kv_cache.calibrate`); every variant is an int8
twin of it (`int8_twin`) compared with it (`compare`): 1 - cosine of hidden states and logits, top-1 agreement,
and the greedy rows' first difference. The build's limits (`gates`, from the decoder's int4 rounding) are printed
beside them. Prints the CPU; the figures do not depend on it (up to rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = (("per channel, margin 1.25 (the default)", "PER_CHANNEL", 1.0, 1.25),
            ("per channel, margin 1.0", "PER_CHANNEL", 1.0, 1.0),
            ("per tensor, margin 1.25", "PER_TENSOR", 1.0, 1.25),
            ("broken: 20 x too coarse", "PER_CHANNEL", 20.0, 1.25),
            ("broken: 20 x too fine (saturating)", "PER_CHANNEL", 0.05, 1.25))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=120, help="rows per gate text (the build: 120 on tiny, 48 on 4b)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not (args.model_path / "manifest.json").is_file():
        raise SystemExit(f"error: {args.model_path} is not an export (no manifest.json)")
    from higgs_onnx.manifest import load_manifest
    from higgs_onnx.parts import kv_cache as kv
    from higgs_onnx.runtime.model import HiggsTTS

    with tempfile.TemporaryDirectory(prefix="higgs-kv-") as tmp:
        src = args.model_path
        if load_manifest(src, verify=False).kv_cache == "int8":
            src = kv.fp32_twin(src, Path(tmp) / "fp32")
        int4 = load_manifest(src, verify=False).parts["llm_decoder"].get("parity", {}).get("cosine_vs_dequantized")
        limits = kv.gates(int4)
        t0 = time.perf_counter()
        top = kv.calibrate(src)
        print(f"calibrated in {time.perf_counter() - t0:.1f} s; limits {limits} (int4 rounding: "
              f"{'-' if int4 is None else f'{1 - int4:.2e}'})", flush=True)
        fp32 = HiggsTTS(src, verify=False)
        out, margin = {"model_path": str(args.model_path), "int4_cosine": int4, "limits": limits}, kv.MARGIN
        print(f"  {'scales':<38} {'1-cos hidden':>13} {'1-cos logits':>13} {'top-1':>7} {'greedy first diff':>18}"
              f"  gates")
        try:
            for name, mode, factor, m in VARIANTS:
                kv.MARGIN = m
                folder = kv.int8_twin(src, Path(tmp) / "int8", {k: v * factor for k, v in top.items()}, mode)
                r = kv.compare(fp32, HiggsTTS(folder, verify=False), rows=args.rows)
                failed = kv.failed_gates(r, limits)
                first = [t["greedy_first_difference"] for t in r["texts"]]
                out[name] = {**{k: v for k, v in r.items() if k != "texts"}, "greedy_first": first,
                             "failed": failed}
                print(f"  {name:<38} {1 - r['hidden_cosine']:>13.2e} {1 - r['logit_cosine']:>13.2e} "
                      f"{r['top1_agreement']:>7.1%} {str(first):>18}  {'FAIL' if failed else 'pass'}", flush=True)
        finally:
            kv.MARGIN = margin
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
