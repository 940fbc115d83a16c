"""The portable decoder (standard ONNX ops, `higgs_onnx.parts.portable_decoder`) against ModelBuilder's GQA decoder:
build cost, size, and decode-step time on onnxruntime's CPU EP.

Usage:
    python benchmarks/portable_decoder.py --ckpt onnx/bench/4b/synthetic_4b --out onnx/bench/4b/portable_int4
    python benchmarks/portable_decoder.py --ckpt ... --out ... --gqa onnx/bench/4b/onnx/cpu_int4/llm_decoder.onnx \
        --pasts 128 1024 --steps 24 --json portable_4b.json

The Qwen3 body is extracted once (an extraction of the same checkpoint already under the checkpoint's parent folder
is reused). The portable decoder is built (unless `--out` already holds one; `--rebuild` forces it) in a child
process, which reports its wall time and peak resident set. Then, in one process, with the runtime's session options
(`--threads` intra-op threads, no spinning), for each past length: one new position per step, measured alternately
in rounds (warm-up first) for
  - portable: growing (concat) cache fed as NumPy arrays, like `SimpleDecoder`;
  - gqa: the same NumPy feed into the GQA graph;
  - gqa-bound: the GQA graph with one shared past/present buffer bound through IOBinding, like `BoundDecoder`.
Figures are this machine's; compare them only within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("CI", "1")
FILE = "llm_decoder.onnx"


def find_body(ckpt: Path) -> Path | None:
    """An existing extraction of `ckpt` (same files digest) somewhere under the checkpoint's parent folder."""
    from higgs_onnx.checkpoint import files_digest, load_json

    stamp = files_digest(ckpt)
    for marker in sorted(ckpt.parent.glob("**/extracted_from.json")):
        try:
            if load_json(marker).get("digest") == stamp:
                return marker.parent
        except ValueError:
            continue
    return None


def build_child(body: Path, out: Path, precision: str, block_size: int, accuracy: int) -> None:
    """Run in a child process: build, then print one JSON line with the wall time and peak RSS."""
    from higgs_onnx.memory import peak_rss
    from higgs_onnx.parts.portable_decoder import build_portable_decoder

    t0 = time.perf_counter()
    build_portable_decoder(body, out, precision, block_size=block_size, accuracy_level=accuracy)
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss": peak_rss()}))


def build(body: Path, out: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--_build", str(body), "--out", str(out), "--precision", args.precision,
           "--block-size", str(args.block_size), "--accuracy", str(args.accuracy)]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + ".data")) if p.exists())


class Runner:
    """One decode step (one new position) at a fixed past length, through one session and one feeding mode."""

    def __init__(self, session, bound: bool, embeds: np.ndarray, past: dict[str, np.ndarray]):
        import onnxruntime as ort

        self.session, self.bound = session, bound
        length, hidden = next(iter(past.values())).shape[2], embeds.shape[-1]
        mask = np.ones((1, length + 1), np.int64)
        if not bound:
            self.feed = {"inputs_embeds": embeds, "attention_mask": mask, **past}
            return
        # shared buffers (capacity past + 1): the step always writes row `past`, so every step sees the same length
        self.buffers = {}
        for n, a in past.items():
            self.buffers[n] = np.zeros((*a.shape[:2], length + 1, a.shape[3]), a.dtype)
            self.buffers[n][:, :, :length] = a
        self.io = session.io_binding()
        for n, a in self.buffers.items():
            v = ort.OrtValue.ortvalue_from_numpy(a)
            self.io.bind_ortvalue_input(n, v)
            self.io.bind_ortvalue_output(n.replace("past_key_values.", "present."), v)
        self.io.bind_cpu_input("inputs_embeds", embeds)
        self.io.bind_cpu_input("attention_mask", mask)
        self.out = ort.OrtValue.ortvalue_from_shape_and_type((1, 1, hidden), np.float32, "cpu")
        self.io.bind_ortvalue_output("hidden_states", self.out)

    def hidden(self) -> np.ndarray:
        """The step's hidden state (1, 1, D)."""
        if self.bound:
            self.session.run_with_iobinding(self.io)
            return self.out.numpy().copy()
        return self.session.run(["hidden_states"], self.feed)[0]

    def step(self) -> float:
        t0 = time.perf_counter()
        if self.bound:
            self.session.run_with_iobinding(self.io)
        else:
            self.session.run(None, self.feed)
        return (time.perf_counter() - t0) * 1e3


def measure(paths: dict[str, Path], geo, pasts: list[int], steps: int, rounds: int, threads: int) -> dict:
    from higgs_onnx.memory import rss
    from higgs_onnx.parity import cosine
    from higgs_onnx.runtime.session import create_session

    sessions, load = {}, {}
    for name, path in paths.items():
        before, t0 = rss(), time.perf_counter()
        sessions[name] = create_session(path, threads=threads, spin=False)  # the CPU EP, the runtime's options
        load[name] = {"load_s": time.perf_counter() - t0, "rss_gb": (rss() - before) / 2**30}
    modes = [("portable", "portable", False)]
    if "gqa" in sessions:
        modes += [("gqa", "gqa", False), ("gqa-bound", "gqa", True)]
    rng = np.random.default_rng(0)
    results: dict = {"load": load, "steps": {}, "agreement": {}}
    per_round = max(1, steps // rounds)
    for past in pasts:
        # one random state for every mode (keys / values ~ post-norm magnitudes, embeddings ~ real ones)
        embeds = (rng.standard_normal((1, 1, geo.hidden)) * 0.02).astype(np.float32)
        cache = {f"past_key_values.{i}.{kind}": rng.standard_normal((1, geo.kv_heads, past, geo.head_dim)).astype(
            np.float32) for i in range(geo.layers) for kind in ("key", "value")}
        runners = {m: Runner(sessions[s], b, embeds, cache) for m, s, b in modes}
        hidden = {m: r.hidden() for m, r in runners.items()}
        for r in runners.values():  # warm-up
            for _ in range(3):
                r.step()
        times: dict[str, list[float]] = {m: [] for m in runners}
        for _ in range(rounds):
            for m, r in runners.items():
                times[m] += [r.step() for _ in range(per_round)]
        results["steps"][past] = {m: {"mean_ms": statistics.mean(t), "median_ms": statistics.median(t),
                                      "min_ms": min(t), "n": len(t)} for m, t in times.items()}
        # same inputs, same quantizer: the graphs should agree (cosine of the step's hidden state vs portable)
        results["agreement"][past] = {m: cosine(hidden["portable"], h) for m, h in hidden.items() if m != "portable"}
        del runners, cache
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, help="Higgs checkpoint folder (e.g. onnx/bench/4b/synthetic_4b)")
    ap.add_argument("--out", type=Path, required=True, help="folder for the portable decoder")
    ap.add_argument("--body", type=Path, help="extracted Qwen3 folder (default: reuse one, else <ckpt>/../qwen3_body)")
    ap.add_argument("--gqa", type=Path, help="ModelBuilder decoder to compare with (default: "
                                            "<ckpt>/../onnx/cpu_int4/llm_decoder.onnx when it exists)")
    ap.add_argument("--precision", default="int4", choices=("int4", "fp32", "fp16"))
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--accuracy", type=int, default=4)
    ap.add_argument("--rebuild", action="store_true", help="build even when --out holds a decoder")
    ap.add_argument("--pasts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--steps", type=int, default=24, help="measured steps per mode and past length")
    ap.add_argument("--rounds", type=int, help="the steps are split in this many alternating rounds (default: one "
                    "step per mode and round, fully interleaved: load from other processes hits every mode alike)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--_build", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._build:
        build_child(args._build, args.out, args.precision, args.block_size, args.accuracy)
        return
    if args.ckpt is None and args.body is None:
        ap.error("give --ckpt (or --body)")

    from higgs_onnx.checkpoint import extract_qwen3, load_json
    from higgs_onnx.parts.portable_decoder import Geometry

    body = args.body or find_body(args.ckpt)
    if body is None:
        print(f"extracting the Qwen3 body of {args.ckpt} ...", flush=True)
        body = extract_qwen3(args.ckpt, args.ckpt.parent / "qwen3_body")
    print(f"body: {body}", flush=True)
    geo = Geometry.from_config(load_json(body / "config.json"))
    report: dict = {"body": str(body), "precision": args.precision, "threads": args.threads}
    target = args.out / FILE
    if args.rebuild or not target.exists():
        print(f"building the portable {args.precision} decoder into {args.out} ...", flush=True)
        report["build"] = build(body, args.out, args)
    gqa = args.gqa or (args.ckpt.parent / "onnx" / "cpu_int4" / FILE if args.ckpt else None)
    paths = {"portable": target} | ({"gqa": gqa} if gqa and gqa.exists() else {})
    report["size_gb"] = {k: size_of(p) / 1e9 for k, p in paths.items()}
    args.rounds = args.rounds or args.steps
    report |= measure(paths, geo, args.pasts, args.steps, args.rounds, args.threads)

    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    report["cpu"] = cpu
    print(f"\nCPU: {cpu}, {args.threads} intra-op threads, no spinning; geometry: {geo.layers} layers, "
          f"hidden {geo.hidden}, {geo.heads}/{geo.kv_heads} heads, head dim {geo.head_dim}")
    if "build" in report:
        b = report["build"]
        print(f"portable {args.precision} build: {b['seconds']:.0f} s, peak RSS {b['peak_rss'] / 2**30:.2f} GiB")
    for k, p in paths.items():
        ld = report["load"][k]
        print(f"{k:<9} {p}: {report['size_gb'][k]:.2f} GB on disk, session load {ld['load_s']:.1f} s, "
              f"+{ld['rss_gb']:.2f} GiB RSS")
    modes = list(next(iter(report["steps"].values())))
    print(f"\n{'decode step (ms)':<18}" + "".join(f"{m:>22}" for m in modes))
    for past, row in report["steps"].items():
        print(f"{'past ' + str(past):<18}" + "".join(
            f"{row[m]['mean_ms']:>10.1f} (med {row[m]['median_ms']:>6.1f})" for m in modes))
    print(f"(mean over {row[modes[0]]['n']} steps per cell, {args.rounds} alternating rounds, after 3 warm-up steps)")
    for past, agree in report["agreement"].items():
        print(f"past {past}: hidden-state cosine vs portable: "
              + ", ".join(f"{m} {c:.6f}" for m, c in agree.items()))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
