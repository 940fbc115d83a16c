"""What a voice blend costs: one request in one voice vs the same request blended from 2 (and 3) voices.

Usage:
    python benchmarks/blend.py --model-path onnx/cpu_int4 --rows 48              # 1, 2 and 3 voices
    python benchmarks/blend.py --model-path /work/b4/onnx/cpu_int4 --rows 48 --json blend.json

A blend of N voices runs as N rows of one batch (docs/voices.md): N prompts prefilled, then every step one heads
call and one decoder call for the N rows. So its decode step should cost what a batch of N costs, which is what the
machine's batch gain G(N) says (measured here in the same process, `measure_batch_gain`): a step of N rows takes
N / G(N) times one row's. Each configuration runs the same text and seed for `--rows` rows (`ignore_eoc`, no guard,
rows only: the codec is not timed), after a warm-up, `--repeat` times interleaved (the fastest run counts). The
voices are the bundled references (tests/data), made once before timing (their codec encoding and prefix prefill
are not part of a request); a third voice is zero-shot.
Prints a table with the CPU's flags; `--json` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("CI", "1")

DATA = ROOT / "tests" / "data"
TEXT = "The quick brown fox jumps over the lazy dog while the speech synthesizer keeps talking."


def one_run(tts, voice, rows: int, seed: int = 1) -> dict:
    """One request to its `rows` rows (a batch of one, or the blend's own pool): wall, prefill and decode time."""
    from higgs_onnx.generation.options import GenerationOptions

    options = GenerationOptions(seed=seed, max_rows=rows, ignore_eoc=True, guard=False)
    t0 = time.perf_counter()
    req = tts.request(TEXT, voice=voice, options=options)
    done = tts.run(req, None)
    wall = time.perf_counter() - t0
    assert done.n == rows, (done.n, rows)
    return {"voices": done.width, "rows": done.n, "prompt_positions": [len(m.prompt) for m in done.members],
            "wall_s": round(wall, 3), "prefill_s": round(done.prefill_s, 3), "decode_s": round(done.decode_s, 3),
            "step_ms": round(1000 * done.decode_s / done.n, 1), "rows_per_s": round(done.n / done.decode_s, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=48, help="rows per request (default %(default)s)")
    ap.add_argument("--max-voices", type=int, default=3, choices=[2, 3], help="widest blend measured")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each configuration, interleaved; the fastest "
                    "counts (default %(default)s: a 2-core machine shared with other work is noisy)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from longform import cpu_flags

    from higgs_onnx.generation.blend import Blend
    from higgs_onnx.generation.scheduler import measure_batch_gain
    from higgs_onnx.runtime.model import HiggsTTS

    t0 = time.perf_counter()
    tts = HiggsTTS(args.model_path, threads=args.threads, verify=False)
    tts.preload()
    en = tts.make_voice(DATA / "ref_en_24k.wav", (DATA / "ref_en_24k.txt").read_text().strip())
    de = tts.make_voice(DATA / "ref_de_22k_stereo.wav", (DATA / "ref_de_22k_stereo.txt").read_text().strip())
    setup = time.perf_counter() - t0
    one_run(tts, en, 8)  # warm-up: first calls of every session
    configs = [("one voice (en)", en), ("blend en 0.5 + de 0.5", Blend.make([en, de])),
               ("blend en + de + zero-shot, 1/3 each", Blend.make([en, de, None]))][:args.max_voices]
    every: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for _ in range(args.repeat):  # interleaved, so a slow spell of the machine does not fall on one configuration
        for name, voice in configs:
            r = one_run(tts, voice, args.rows)
            every[name].append({**r, "name": name})
            print(f"{name}: {r}", file=sys.stderr, flush=True)
    runs = [min(every[name], key=lambda r: r["decode_s"]) for name, _ in configs]
    gains = measure_batch_gain(tts.backend, tuple(range(1, args.max_voices + 1)))
    base = runs[0]
    print(f"\n{args.model_path}, {os.cpu_count()} CPUs ({cpu_flags()}), {args.rows} rows each; setup (load + 2 "
          f"voices) {setup:.1f} s\n")
    print("| request | prompt positions | prefill | decode | ms / step | rows/s | decode cost vs one voice | "
          "N / G(N) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        n = r["voices"]
        print(f"| {r['name']} | {' + '.join(map(str, r['prompt_positions']))} | {r['prefill_s']:.2f} s | "
              f"{r['decode_s']:.2f} s | {r['step_ms']:.1f} | {r['rows_per_s']:.2f} | "
              f"{r['decode_s'] / base['decode_s']:.2f} x | {n / gains[n]:.2f} |")
    print("\nbatch gain: " + ", ".join(f"G({b}) = {g:.2f}" for b, g in sorted(gains.items())))
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model_path), "rows": args.rows, "cpus": os.cpu_count(),
                                         "cpu_flags": cpu_flags(), "runs": runs, "every_run": every,
                                         "batch_gain": {str(b): g for b, g in gains.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
