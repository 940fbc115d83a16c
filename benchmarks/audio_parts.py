"""What the voice-critical parts cost and how close they stay, at each precision: the tied audio head and the fused
audio embedding of one export, rebuilt at int4 / int8 / fp16 / fp32 (the other parts come from the build cache).

Usage:
    python benchmarks/audio_parts.py --preset tiny
    python benchmarks/audio_parts.py --preset 4b --json audio_parts_4b.json

Per precision (each part built by its own module, like optimize.py, but not gated): the head's argmax agreement
with the PyTorch reference over 128 random post-norm hidden states x N codebooks (the figure optimize.py gates
on), its logit cosine, and the time of one decode step's call of each part (median of --calls, same session
options as the runtime) as ms and as % of the int4 decoder step measured in the same run (context 128). Figures
are this machine's; compare them only within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("CI", "1")
PRECISIONS = ("int4", "int8", "fp16", "fp32")


def median_ms(fn, calls: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build(part: str, prec: str, ckpt: Path, work: Path) -> Path:
    """The part built by its own module (as optimize.py does), without optimize's gate: an int8 head that misses
    the argmax gate must still be measured."""
    from higgs_onnx import parts
    from higgs_onnx.checkpoint import files_digest
    from higgs_onnx.export import ExportOptions

    out, d = work / f"{part}-{prec}", ExportOptions()
    job = parts.BuildJob(ckpt=ckpt, out=out, work=work, precision=prec, device=d.device,
                         attention=d.decoder_attention, block_size=d.block_size, accuracy_level=d.accuracy,
                         digest=files_digest(ckpt), say=lambda _: None)
    return parts.module(part).build(job)


def measure(paths: dict[str, Path], prec: str, ref, calls: int) -> dict:
    from higgs_onnx.parity import check_part
    from higgs_onnx.runtime.session import Part

    f, out = ref.facts, {}
    feeds = {"audio_heads": {"hidden_states": np.random.default_rng(0).standard_normal((1, 1, f.hidden))},
             "audio_embed": {"audio_codes": np.arange(f.num_codebooks).reshape(1, 1, -1) * 7 % f.codebook_size}}
    for name, feed in feeds.items():
        part = Part(name, paths[name])
        size = sum(p.stat().st_size for p in paths[name].parent.glob(f"{name}.onnx*"))
        out[name] = {"mb": size / 2**20, "ms": median_ms(lambda p=part, x=feed: p(**x), calls)}
    fig = check_part("audio_heads", paths["audio_heads"], ref, prec, seed=5)
    out["audio_heads"] |= {"argmax_agreement": fig["argmax_agreement"], "cosine": fig["cosine"],
                           "passes_gate": fig["ok"]}
    return out


def decoder_step_ms(folder: Path, steps: int = 30, context: int = 128) -> float:
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(folder, verify=False)
    dec, rng = tts.backend.decoder, np.random.default_rng(0)
    cache = dec.new_cache(context + steps + 2)
    dec.run(cache, rng.standard_normal((context, tts.facts.hidden)).astype(np.float32))
    row = rng.standard_normal((1, tts.facts.hidden)).astype(np.float32)
    return median_ms(lambda: dec.run(cache, row), steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["tiny", "4b"], default="tiny")
    ap.add_argument("--root", type=Path, default=ROOT / "onnx", help="export root: its cpu_int4 export (built if "
                    "missing) gives the decoder step; the variants are built in <root>/.build/audio_parts/")
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error("--calls must be >= 1")
    from higgs_onnx.checkpoint import load_facts
    from higgs_onnx.export import Exporter, ExportOptions
    from higgs_onnx.reference.model import ReferenceModel, parity_dtype

    folder = Exporter("", args.root, ExportOptions("cpu", "int4"), synthetic=args.preset).run()
    ckpt = args.root / ".build" / f"synthetic_{args.preset}"
    ref = ReferenceModel(ckpt, dtype=parity_dtype(load_facts(ckpt)))
    rows = {}
    for prec in args.precisions:
        print(f"building audio_heads + audio_embed at {prec} ...", flush=True)
        paths = {p: build(p, prec, ckpt, args.root / ".build" / "audio_parts") for p in ("audio_heads", "audio_embed")}
        rows[prec] = measure(paths, prec, ref, args.calls)
    step = decoder_step_ms(folder)
    print(f"\nint4 decoder step (context 128): {step:.1f} ms\n")
    print(f"{'precision':<10}{'head MB':>8}{'head ms':>9}{'% step':>8}{'embed ms':>9}{'% step':>8}"
          f"{'argmax':>9}{'cosine':>10}  gate")
    for prec, r in rows.items():
        h, e = r["audio_heads"], r["audio_embed"]
        print(f"{prec:<10}{h['mb']:>8.1f}{h['ms']:>9.3f}{100 * h['ms'] / step:>7.2f}%{e['ms']:>9.3f}"
              f"{100 * e['ms'] / step:>7.2f}%{100 * h['argmax_agreement']:>8.2f}%{h['cosine']:>10.6f}  "
              f"{'pass' if h['passes_gate'] else 'FAIL'}")
    if args.json:
        args.json.write_text(json.dumps({"decoder_step_ms": step, "parts": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
