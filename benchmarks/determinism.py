"""How often a seeded request batched with others gives the same codes as the same request made alone.

    python benchmarks/determinism.py onnx/cpu_int4 onnx/cpu_fp32 [--requests 24] [--batch 4] [--max-rows 200]

For each export: N seeded, sampled requests (temperature 1, each with its own seed) run (a) alone, one cache each
(`HiggsTTS.run`: a batch of one, what `inference.py` and `HiggsTTS.generate` do), (b) through a scheduler with a
slot pool of one slot (corpus `--batch 1`, a server request with `"deterministic": true`), (c) through a scheduler
of B slots, joining at staggered steps (the server and the corpus batching). It prints how many of the N have
codes identical to (a). On int4 exports the MatMulNBits kernels take another path for M > 1 rows, so batched rows
differ in the last bits and sampled draws can part ways; fp32 differs far less. Prints the CPU's flags with the
table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root

from benchmarks.bench import cpu_info, cpu_line  # noqa: E402
from higgs_onnx.generation.options import GenerationOptions  # noqa: E402
from higgs_onnx.generation.scheduler import PrefillPolicy  # noqa: E402
from higgs_onnx.runtime.model import HiggsTTS  # noqa: E402

TEXTS = ["Short one.", "A somewhat longer request that keeps talking for a while before it stops.",
         "Batch mates never change my codes.", "Every request keeps its own positions, mask and cache rows."]


def run_pool(tts, reqs, slots: int, stagger: int) -> list[np.ndarray]:
    """`reqs` through one scheduler of `slots` slots, stepped here: request i is submitted before step i * stagger
    (it starts when a slot is free); prompts prefill whole, as alone. Returns each request's rows."""
    positions = max(len(r.prompt) + r.max_rows for r in reqs)
    with tts.scheduler(slots, positions, PrefillPolicy(chunk=positions)) as sched:
        pending, handles, step = list(enumerate(reqs)), [], 0
        while pending or not sched.idle:
            while pending and pending[0][0] * stagger <= step:
                handles.append(sched.submit(pending.pop(0)[1]))
            sched.step()
            step += 1
        return [h.wait().generated.copy() for h in handles]


def measure(path: Path, n: int, batch: int, max_rows: int, ignore_eoc: bool) -> dict:
    tts = HiggsTTS(path, verify=False)
    options = GenerationOptions(temperature=1.0, max_rows=max_rows, ignore_eoc=ignore_eoc)

    def make():
        return [tts.request(TEXTS[i % len(TEXTS)], options=dataclasses.replace(options, seed=i)) for i in range(n)]

    alone = [tts.run(r, audio=None).generated.copy() for r in make()]  # each a batch of one
    one_slot = run_pool(tts, make(), 1, 0)
    batched = run_pool(tts, make(), batch, 3)
    same = lambda got: sum(a.shape == b.shape and (a == b).all() for a, b in zip(alone, got, strict=True))  # noqa: E731
    return {"export": path.name, "precision": tts.manifest.precision, "one_slot": same(one_slot),
            "batched": same(batched), "n": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("exports", nargs="+", type=Path)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-rows", type=int, default=200)
    ap.add_argument("--ignore-eoc", action="store_true", help="run every request to --max-rows (long draws)")
    args = ap.parse_args()
    print(f"CPU: {cpu_line(cpu_info())}")
    print(f"| export | precision | 1-slot pool = alone | batch {args.batch} = alone |")
    print("|---|---|---|---|")
    for path in args.exports:
        r = measure(path, args.requests, args.batch, args.max_rows, args.ignore_eoc)
        print(f"| {r['export']} | {r['precision']} | {r['one_slot']} of {r['n']} | {r['batched']} of {r['n']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
