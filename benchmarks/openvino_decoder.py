"""The decoder on the OpenVINO runtime against onnxruntime's CPU EP: decode-step time, compile time, memory, size.

Usage:
    python benchmarks/openvino_decoder.py --gqa onnx/bench/4b/onnx/cpu_int4/llm_decoder.onnx \
        --ir onnx/bench/4b/openvino_int4/llm_decoder.xml [--fp32 <portable fp32 llm_decoder.onnx>] \
        [--portable onnx/bench/4b/portable_int4/llm_decoder.onnx] [--bf16] --threads 2 --past 128 --steps 24

Rows (each in a child process of its own, one after another, so each has its own peak RSS and nothing else runs):
  ort gqa-int4        onnxruntime CPU EP on ModelBuilder's int4 graph (GroupQueryAttention + MatMulNBits), the
                      runtime's `session.Part` (decoder pool spinning, as `HiggsTTS` runs it)
  ov onnx gqa-int4    OpenVINO CPU on that same ONNX file as is (its ONNX front end decomposes MatMulNBits)
  ov ir int4          OpenVINO CPU on an IR with nncf's int4 weight compression (`parts.openvino_ir.to_ir`; built
                      from `--fp32` first when `--ir` does not exist, that build's time and peak RSS are printed)
  (optional) the same IR with bf16 inference precision (--bf16), and the portable int4 ONNX on both runtimes
Every OpenVINO row runs through `runtime.openvino.OvPart` (f32 inference precision unless said, LATENCY hint,
`--threads` inference threads). A step = one new position with the past (`--past` positions of random K/V, the
same arrays every step) and the attention mask fed from NumPy, presents returned to NumPy, as `SimpleDecoder` and
`ConcatDecoder`'s NumPy path feed it. The hidden state of the first step is compared (cosine) with the ORT row's.
A run during which other processes used more than `--noise` cores (from /proc/stat) is repeated; "noise" is the
largest such share kept. Figures are this machine's; compare rows within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("CI", "1")


def peak_rss() -> int:
    from higgs_onnx.memory import peak_rss as peak

    return peak()


def size_of(path: Path) -> int:
    side = [path.with_suffix(".bin")] if path.suffix == ".xml" else [path.with_name(path.name + ".data")]
    return sum(p.stat().st_size for p in (path, *side) if p.exists())


def geometry(path: Path) -> dict:
    """layers, kv heads, head dim and hidden size from genai_config.json beside the graph."""
    cfg = json.loads((path.parent / "genai_config.json").read_text())["model"]
    dec = cfg["decoder"]
    return {"layers": dec["num_hidden_layers"], "kv_heads": dec["num_key_value_heads"], "head_dim": dec["head_size"],
            "hidden": dec["hidden_size"]}


def child_run(cfg: dict) -> dict:
    """In a child process: open the part, time the decode steps; returns the row's figures."""
    from higgs_onnx.memory import rss

    path, geo = Path(cfg["path"]), cfg["geometry"]
    t0 = time.perf_counter()
    if cfg["runtime"] == "ort":
        from higgs_onnx.runtime.session import Part

        part = Part("llm_decoder", path, "cpu", cfg["threads"])
    else:
        from higgs_onnx.runtime.openvino import OvPart

        part = OvPart("llm_decoder", path, cfg["threads"], inference_precision=cfg.get("precision", "f32"))
    compile_s = time.perf_counter() - t0
    load_rss = rss()
    rng = np.random.default_rng(0)
    past = cfg["past"]
    feeds = {"inputs_embeds": (rng.standard_normal((1, 1, geo["hidden"])) * 0.02).astype(np.float32),
             "attention_mask": np.ones((1, past + 1), np.int64)}
    for i in range(geo["layers"]):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = rng.standard_normal(
                (1, geo["kv_heads"], past, geo["head_dim"])).astype(np.float32)
    first = part(**feeds)["hidden_states"]
    np.save(cfg["hidden_out"], first)
    if cfg.get("reference_only"):
        return {"compile_s": compile_s, "load_rss": load_rss, "peak_rss": peak_rss()}
    for _ in range(cfg["warmup"]):
        part(**feeds)
    times = []
    for _ in range(cfg["steps"]):
        t = time.perf_counter()
        out = part(**feeds)
        times.append((time.perf_counter() - t) * 1e3)
        assert out["present.0.key"].shape[2] == past + 1
    return {"compile_s": compile_s, "load_rss": load_rss, "peak_rss": peak_rss(), "times": times,
            "inference_precision": getattr(part, "inference_precision", "f32 (ORT)")}


def merge(runs: list[dict]) -> dict:
    """One row from its repeats: every step time pooled; compile time median; memory the largest."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    times = [t for r in ok for t in r["times"]]
    return {"compile_s": statistics.median(r["compile_s"] for r in ok), "load_rss": max(r["load_rss"] for r in ok),
            "peak_rss": max(r["peak_rss"] for r in ok), "mean_ms": statistics.mean(times),
            "median_ms": statistics.median(times), "min_ms": min(times), "n": len(times),
            "run_means_ms": [statistics.mean(r["times"]) for r in ok],
            "others_cores": max(r.get("others", 0.0) for r in ok),
            "inference_precision": ok[0]["inference_precision"]}


def child_build(fp32: Path, ir: Path, block_size: int) -> dict:
    from higgs_onnx.parts.openvino_ir import to_ir

    t0 = time.perf_counter()
    to_ir(fp32, ir, "int4", block_size)
    return {"seconds": time.perf_counter() - t0, "peak_rss": peak_rss()}


def busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (/proc/stat), None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def in_child(args: list[str]) -> dict:
    """Run this script with `args` in a child; the result carries `others`: the CPU seconds other processes on the
    machine used meanwhile, per wall second (a shared machine's noise)."""
    b0, c0, t0 = busy_seconds(), children_cpu(), time.perf_counter()
    res = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    wall, b1 = time.perf_counter() - t0, busy_seconds()
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1][:300]}
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if b0 is not None and b1 is not None:
        out["others"] = max(0.0, (b1 - b0) - (children_cpu() - c0)) / wall
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gqa", type=Path, help="ModelBuilder int4 llm_decoder.onnx (cpu_int4 export)")
    ap.add_argument("--ir", type=Path, help="OpenVINO int4 IR (llm_decoder.xml)")
    ap.add_argument("--fp32", type=Path, help="fp32 llm_decoder.onnx to build --ir from when it does not exist")
    ap.add_argument("--portable", type=Path, help="portable int4 llm_decoder.onnx: adds its ORT and OV rows")
    ap.add_argument("--bf16", action="store_true", help="add the IR with bf16 inference precision")
    ap.add_argument("--reference", type=Path, help="fp32 llm_decoder.onnx: every row's first hidden state is also "
                                                   "compared (cosine) with its output on onnxruntime (not timed)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1, help="run the whole sequence of rows this many times (their "
                                                         "step times are pooled): evens out a noisy machine")
    ap.add_argument("--noise", type=float, default=0.1, help="a run during which other processes used more than this "
                                                             "many cores on average is repeated (up to --retries)")
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="run only these rows (by label)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--_run", help=argparse.SUPPRESS)
    ap.add_argument("--_build", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._run:
        print(json.dumps(child_run(json.loads(args._run))))
        return
    if args._build:
        print(json.dumps(child_build(*args._build, args.block_size)))
        return
    if not (args.gqa and args.ir):
        ap.error("--gqa and --ir are required")

    report: dict = {"threads": args.threads, "past": args.past, "rows": {}}
    if not args.ir.exists():
        if not args.fp32:
            ap.error(f"{args.ir} does not exist; give --fp32 to build it")
        print(f"building {args.ir} from {args.fp32} (nncf int4_sym, group {args.block_size}) ...", flush=True)
        report["ir_build"] = in_child(["--_build", str(args.fp32), str(args.ir), "--block-size",
                                       str(args.block_size)])
        if "error" in report["ir_build"]:
            sys.exit(f"IR build failed: {report['ir_build']['error']}")
    geo = geometry(args.gqa)
    rows = [("ort gqa-int4", "ort", args.gqa, "f32"), ("ov onnx gqa-int4", "ov", args.gqa, "f32"),
            ("ov ir int4", "ov", args.ir, "f32")]
    if args.bf16:
        rows.append(("ov ir int4 bf16", "ov", args.ir, "bf16"))
    if args.portable:
        rows += [("ort portable-int4", "ort", args.portable, "f32"), ("ov onnx portable-int4", "ov", args.portable,
                                                                      "f32")]
    if args.only:
        rows = [r for r in rows if r[0] in args.only or r[0] == "ort gqa-int4"]
    hidden: dict[str, np.ndarray] = {}
    runs: dict[str, list[dict]] = {label: [] for label, *_ in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            for k, (label, runtime, path, precision) in enumerate(rows):
                print(f"  [{rep + 1}/{args.repeat}] {label} ... (load average {os.getloadavg()[0]:.2f})", flush=True)
                cfg = {"runtime": runtime, "path": str(path), "precision": precision, "threads": args.threads,
                       "past": args.past, "steps": args.steps, "warmup": args.warmup, "geometry": geo,
                       "hidden_out": str(Path(tmp) / f"{k}.npy")}
                for attempt in range(args.retries + 1):
                    res = in_child(["--_run", json.dumps(cfg)])
                    if res.get("others", 0.0) <= args.noise or "error" in res:
                        break
                    print(f"      other processes used {res['others']:.2f} cores meanwhile; "
                          + ("again in 30 s" if attempt < args.retries else "kept"), flush=True)
                    if attempt < args.retries:
                        time.sleep(30)
                if "error" not in res and label not in hidden:
                    hidden[label] = np.load(cfg["hidden_out"], allow_pickle=False)
                runs[label].append(res)
        for label, _, path, _ in rows:
            report["rows"][label] = merge(runs[label]) | {"size": size_of(path), "path": str(path)}
        if args.reference:
            print("  fp32 reference ...", flush=True)
            cfg = {"runtime": "ort", "path": str(args.reference), "threads": args.threads, "past": args.past,
                   "geometry": geo, "hidden_out": str(Path(tmp) / "ref.npy"), "reference_only": True}
            res = in_child(["--_run", json.dumps(cfg)])
            if "error" in res:
                print(f"  fp32 reference FAILED: {res['error']}")
            else:
                fp32_hidden = np.load(cfg["hidden_out"], allow_pickle=False)
                for label, h in hidden.items():
                    report["rows"][label]["cos_vs_fp32"] = cosine(fp32_hidden, h)
    ref = hidden.get("ort gqa-int4")
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    report["cpu"] = cpu
    print(f"\nCPU: {cpu}; {args.threads} threads; decode step at past {args.past}: {args.steps} steps after "
          f"{args.warmup} warm-up, x {args.repeat} runs pooled; layers {geo['layers']}, hidden {geo['hidden']}, "
          f"kv heads {geo['kv_heads']}")
    if "ir_build" in report:
        b = report["ir_build"]
        print(f"IR build (to_ir int4 from fp32 ONNX): {b['seconds']:.0f} s, peak RSS {b['peak_rss'] / 2**30:.1f} GiB")
    ort_ms = report["rows"].get("ort gqa-int4", {}).get("mean_ms")
    head = (f"{'row':<22}{'size GB':>8}{'compile s':>10}{'RSS GB':>8}{'peak GB':>8}{'step ms':>9}{'median':>8}"
            f"{'min':>7}{'x ORT':>7}{'cos ORT':>9}{'cos fp32':>9}{'noise':>6}")
    print(head)
    for label, r in report["rows"].items():
        if "error" in r:
            print(f"{label:<22} FAILED: {r['error']}")
            continue
        r["cos_vs_ort"] = cosine(ref, hidden[label]) if ref is not None else None
        ratio = f"{r['mean_ms'] / ort_ms:>7.2f}" if ort_ms else f"{'-':>7}"
        print(f"{label:<22}{r['size'] / 1e9:>8.2f}{r['compile_s']:>10.1f}{r['load_rss'] / 2**30:>8.2f}"
              f"{r['peak_rss'] / 2**30:>8.2f}{r['mean_ms']:>9.1f}{r['median_ms']:>8.1f}{r['min_ms']:>7.1f}{ratio}"
              f"{(r['cos_vs_ort'] or float('nan')):>9.5f}{r.get('cos_vs_fp32', float('nan')):>9.5f}"
              f"{r.get('others_cores', float('nan')):>6.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
