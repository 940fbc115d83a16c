"""Both decoder routes in one run: what a user waits for with the int4 graph alone and with the int8 GEMM route.

    python benchmarks/bench.py --routes [--preset 4b | --model-path onnx/cpu_int4] [--threads N] [--json out.json]
    python benchmarks/routes.py --model-path onnx/cpu_int4 ...                          (the same)

The export must have the route (`optimize.py` writes it for a cpu int4 build whose gate holds). Each route is
measured in a child process of its own (a clean peak RSS), in the order off, on, auto, off again (the second int4
run shows the machine's drift):
- `off`: every call on int4 (`HiggsTTS(route="off")`: the route's session is never loaded);
- `on`: every call of two or more rows on the route (one-row steps stay on int4);
- `auto`: the export's crossover (what a user gets; measured at build, or given there).

Figures per route: a one-row prefill of 24 and 281 positions (a zero-shot prompt, a 10 s clone's prompt), the
first frame of a new cloned voice (a 10 s reference: encode, its prefix prefilled, the line prefilled, the first
row; `stats.first_row_s`) and its first audio (the first frame's rows decoded by the codec: `stats.first_audio_s`)
with the codec encoder's share (the encoder alone on the same reference), decoder rows/s of batched steps at B = 1,
2, 4, 8, 16 (a pool of 16 slots, context 32, best of `--repeats`; with the host's share: the step's time outside the
decoder session's run), the single-row step (it must stay the same: int4 takes it on every route), and peak RSS.

Then where the time goes (`profile`, a child of its own, ONNX Runtime's profiler, each node's best of `--repeats`
runs): a one-row prefill of 281 positions on the route, split into its GEMMs, attention, the activations'
quantization and the other kernels, beside the same GEMMs alone (`gemm_alone`: the route's weight shapes on
`MatMulInteger`, distinct random copies, interleaved with the prefill runs) -- the prefill's distance from its GEMMs'
time at the QGEMM rate measured there; and a batched step of 8 and 16 rows on each route, split the same way.
The CPU's model and its SIMD / matrix flags head the table; nothing is asserted (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCHES = (1, 2, 4, 8, 16)
PREFILLS = (24, 281)
MODES = ("off", "on", "auto", "off")
PROFILE_PREFILL = 281  # positions of the profiled one-row prefill (a 10 s clone's prompt)
PROFILE_BATCHES = (8, 16)  # rows of the profiled batched steps
CONTEXT = 32  # positions already in the cache of a batched step's rows
SPLIT = ("GEMMs", "attention", "quantization", "other kernels")  # a profile's kernels, by `kind_of`
GEMM_OPS = ("MatMulIntegerToFloat", "MatMulInteger", "MatMulNBits", "MatMul")
COPIES = 2  # distinct random weight copies of each shape in `gemm_alone` (read from memory, as in the decoder)


def reference_10s(folder: Path) -> tuple[Path, str]:
    """A 10.0 s reference: the bundled English recording repeated to 10 s (a new file each run: a new voice)."""
    import soundfile as sf

    wav, sr = sf.read(ROOT / "tests" / "data" / "ref_en_24k.wav", dtype="float32")
    reps = int(np.ceil(10.0 * sr / len(wav)))
    path = folder / "ref_10s.wav"
    sf.write(path, np.tile(wav, reps)[: int(10.0 * sr)], sr)
    text = (ROOT / "tests" / "data" / "ref_en_24k.txt").read_text().strip()
    return path, " ".join([text] * reps)


def measure(model_path: Path, mode: str, threads: int, repeats: int) -> dict:
    """One route's figures in this process (`--_child`)."""
    import tempfile

    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(model_path, threads=threads, verify=False, route=mode)
    tts.preload()
    dec, f = tts.backend.decoder, tts.facts
    rng = np.random.default_rng(0)
    out = {"mode": mode, "policy": str(getattr(dec, "policy", None)), "route_loaded": tts.backend.route_part
           is not None}
    for n in PREFILLS:
        embeds = (rng.standard_normal((n, f.hidden)) * 0.05).astype(np.float32)
        cache = dec.new_cache(n)
        best = float("inf")
        for _ in range(repeats):
            cache.truncate(0)
            t0 = time.perf_counter()
            dec.run(cache, embeds)
            best = min(best, time.perf_counter() - t0)
        out[f"prefill_{n}_ms"] = best * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        ref, text = reference_10s(Path(tmp))
        tts.generate("Warm up the codec and the heads.", max_rows=8)
        wav = tts.codec.reference(ref)
        tts.encode_audio(wav[: tts.facts.sample_rate])  # the encoder's session made (its load is not a clone's)
        t0 = time.perf_counter()
        tts.encode_audio(wav)
        out["clone_encode_s"] = time.perf_counter() - t0  # the codec encoder alone on the 10 s reference
        # one frame's rows (the delay pattern's first full frame), decoded: the first audio a user hears
        s = tts.generate("A new cloned voice speaks its first frame.", ref_audio=ref, ref_text=text,
                         options=GenerationOptions(seed=1, max_rows=f.num_codebooks)).stats
        out["clone_first_frame_s"], out["clone_voice_s"] = s.first_row_s, s.voice_s
        out["clone_first_audio_s"] = s.first_audio_s  # encode + prefix and line prefilled + rows + codec chunk
    from bench import DecoderClock, peak_rss_mb

    slots = max(BATCHES)
    pool = dec.pool(slots, CONTEXT + repeats + 4)
    held = [pool.acquire(CONTEXT + repeats + 4) for _ in range(slots)]
    codes = rng.integers(0, f.codebook_size, (slots, f.num_codebooks))
    out["rows_per_s"], out["host_ms"] = {}, {}
    for b in BATCHES:
        best, host = float("inf"), 0.0
        session = dec.session_for(dec.policy.use(b, True))  # the one this step runs on (NEVER without a route)
        for _ in range(repeats + 1):  # the first is a warm-up
            for s in held[:b]:
                pool.lengths[s.index] = CONTEXT  # positions as written; their values do not change the cost
            with DecoderClock(session, ("run_with_iobinding",)) as run:  # the rest of the step is the host's
                t0 = time.perf_counter()
                pool.step_batch(held[:b], codes[:b])
                took = time.perf_counter() - t0
            if took < best:
                best, host = took, took - run.seconds
        out["rows_per_s"][str(b)], out["host_ms"][str(b)] = b / best, host * 1e3
    out["step_ms"] = 1e3 / out["rows_per_s"]["1"]
    out["calls"] = {"int4": dec.calls[False], "route": dec.calls[True]} if hasattr(dec, "calls") else None

    out["peak_rss_mb"] = peak_rss_mb()
    return out


def kind_of(node: str, op: str) -> str:
    """Which part of `SPLIT` a profiled kernel is (`node` its name, `op` its type)."""
    from higgs_onnx.parts.llm_route import QUANT

    if op in GEMM_OPS:
        return "GEMMs"
    if op == "GroupQueryAttention":
        return "attention"
    return "quantization" if node.startswith(QUANT) else "other kernels"


def profiled(model, threads: int, spin: bool, prefix: Path):
    """A session on the CPU with ONNX Runtime's profiler on (`model`: a path or a serialized graph), its threads and
    spinning as the runtime sets them (`session_options`)."""
    import onnxruntime as ort

    from higgs_onnx import providers
    from higgs_onnx.runtime.session import session_options

    so = session_options(threads, spin)
    so.enable_profiling, so.profile_file_prefix = True, str(prefix)
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so,
                                providers=[providers.get("cpu").ort_name])


def run_times(session) -> list[dict[str, tuple[str, float]]]:
    """Ends `session`'s profile: per run, in order, {node: (its op, its seconds)}."""
    events = json.loads(Path(session.end_profiling()).read_text())
    starts = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    out: list[dict[str, tuple[str, float]]] = [{} for _ in starts]
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            run = bisect.bisect_right(starts, e["ts"]) - 1
            out[run][e["name"].removesuffix("_kernel_time")] = (e["args"]["op_name"], e["dur"] / 1e6)
    return out


def split(runs: list[dict[str, tuple[str, float]]]) -> dict[str, float]:
    """Each node's best over `runs` (`run_times`) -> ms per part of `SPLIT`, and how many GEMMs a run holds."""
    best: dict[str, tuple[str, float]] = {}
    for run in runs:
        for name, (op, sec) in run.items():
            best[name] = (op, min(sec, best.get(name, ("", sec))[1]))
    out = dict.fromkeys(SPLIT, 0.0)
    for name, (op, sec) in best.items():
        out[kind_of(name, op)] += sec * 1e3
    out["gemms"] = sum(op in GEMM_OPS for op, _ in best.values())
    return out


def bound_call(session, model: dict, rows: int, positions: int, context: int, rng) -> tuple:
    """(IOBinding, its KV buffers) of one call as the runtime binds it: the buffers (zeros, room for `context` +
    `positions` + 1 positions) bound as past and present, each of `rows` rows with `context` positions written. One
    row: `positions` embeddings in (a prefill); several: one position of codes each (a batched step). `model`: the
    manifest's model facts."""
    import onnxruntime as ort

    from higgs_onnx.runtime.session import ORT_DTYPES

    io, buffers = session.io_binding(), []
    ins = {i.name: i for i in session.get_inputs()}
    shape = (rows, model["kv_heads"], context + positions + 1, model["head_dim"])
    for name, i in ins.items():
        if name.startswith("past_key_values"):
            buffers.append(ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, ORT_DTYPES[i.type])))
            io.bind_ortvalue_input(name, buffers[-1])
            io.bind_ortvalue_output(name.replace("past_key_values", "present"), buffers[-1])
    one = rows == 1
    io.bind_cpu_input("inputs_embeds", (rng.standard_normal((rows, positions if one else 0, model["hidden"])) * 0.05)
                      .astype(np.float32))
    io.bind_cpu_input("audio_codes", rng.integers(0, model["codebook_size"], (rows, 0 if one else 1,
                                                                               model["num_codebooks"])))
    io.bind_cpu_input("attention_mask", np.ones((rows, context + (positions if one else 1)), np.int64))
    for o in session.get_outputs():
        if not o.name.startswith("present"):
            io.bind_output(o.name)
    return io, buffers


def gemm_alone(route: Path, positions: int, rng) -> tuple[bytes, dict, dict[tuple[int, int], int]]:
    """The route's int8 GEMMs alone: one graph of `MatMulInteger` at `positions` rows over each weight shape of the
    route (`COPIES` distinct random copies, so each reads its weights from memory as in the decoder). Returns the
    serialized graph, its feeds and {(K, N): how many GEMMs of that shape the route runs}."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    g = onnx.load(str(route), load_external_data=False).graph
    dims = {t.name: tuple(t.dims) for t in g.initializer}
    shapes: dict[tuple[int, int], int] = {}
    for n in g.node:
        if n.op_type in ("MatMulIntegerToFloat", "MatMulInteger"):  # the route's GEMM, or an older build's
            shapes[dims[n.input[1]]] = shapes.get(dims[n.input[1]], 0) + 1
    nodes, inits = [], [helper.make_tensor("zp", TensorProto.UINT8, [], [128])]
    for j, (k, n) in enumerate(shapes):
        for c in range(COPIES):
            w, y = f"w{j}_{c}", f"y{j}_{c}"
            inits.append(numpy_helper.from_array(rng.integers(-127, 128, (k, n), dtype=np.int8), w))
            # the GEMM's output stays inside the graph (ORT's arena, reused each run): a one-number output
            nodes += [helper.make_node("MatMulInteger", [f"x{k}", w, "zp"], [y], name=f"gemm{j}_{c}"),
                      helper.make_node("ReduceMax", [y], [y + "/max"], keepdims=0, name=f"max{j}_{c}")]
    ks = sorted({k for k, _ in shapes})
    graph = helper.make_graph(nodes, "gemms", [helper.make_tensor_value_info(f"x{k}", TensorProto.UINT8,
                                                                             [1, positions, k]) for k in ks],
                              [helper.make_tensor_value_info(n.output[0], TensorProto.INT32, [])
                               for n in nodes if n.op_type == "ReduceMax"], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    feeds = {f"x{k}": rng.integers(0, 256, (1, positions, k), dtype=np.uint8) for k in ks}
    return model.SerializeToString(), feeds, shapes


def profile(model_path: Path, threads: int, repeats: int, positions: int = PROFILE_PREFILL,
            batches: tuple[int, ...] = PROFILE_BATCHES) -> dict:
    """Where the time goes (`--_profile`): a one-row prefill of `positions` on the route, its runs taking turns with
    its GEMMs alone (`gemm_alone`, whose pool does not spin), and batched steps of `batches` rows on the route and on
    the int4 step graph, one decoder session at a time, each spinning as the runtime's own does. Figures: the best
    wall of `repeats` runs after a warm-up, and `split` of the same runs."""
    import tempfile

    from higgs_onnx.manifest import load_manifest
    from higgs_onnx.parts import llm_route, llm_step
    from higgs_onnx.runtime.session import DECODER_SESSIONS

    facts = load_manifest(model_path, verify=False).model
    rng = np.random.default_rng(0)
    out: dict = {"prefill": {"positions": positions}, "batch": {}}

    def timed(sess, io, label: str, labels: list[str], walls: dict[str, list[float]]) -> None:
        t0 = time.perf_counter()
        sess.run_with_iobinding(io)
        walls.setdefault(label, []).append(time.perf_counter() - t0)
        labels.append(label)

    with tempfile.TemporaryDirectory() as tmp:
        model, feeds, shapes = gemm_alone(model_path / llm_route.FILE, positions, rng)
        gemms = profiled(model, threads, False, Path(tmp) / "gemms")
        for label, part in (("route", llm_route), ("int4", llm_step)):
            sess = profiled(model_path / part.FILE, threads, part.NAME in DECODER_SESSIONS, Path(tmp) / label)
            labels: list[str] = []
            walls: dict[str, list[float]] = {}
            if part is llm_route:
                io, _ = bound_call(sess, facts, 1, positions, 0, rng)
                for i in range(repeats + 1):  # turns: the machine's other load falls on both alike
                    time.sleep(0.3)  # the route's pool stops spinning
                    gemms.run(None, feeds)
                    timed(sess, io, "prefill" if i else "warm-up", labels, walls)
            for b in batches:
                io, _ = bound_call(sess, facts, b, 1, CONTEXT, rng)
                for i in range(repeats + 1):
                    timed(sess, io, str(b) if i else "warm-up", labels, walls)
            times = run_times(sess)
            del sess, io
            figures = {k: {"wall_ms": min(w) * 1e3, "split": split([t for t, lab in zip(times, labels, strict=True)
                                                                     if lab == k])}
                       for k, w in walls.items() if k != "warm-up"}
            out["batch"][label] = {str(b): figures[str(b)] for b in batches}
            out["prefill"].update(figures.get("prefill", {}))
        alone = run_times(gemms)[1:]  # the first: a warm-up
        per_shape = {shape: np.mean([min(run[f"gemm{j}_{c}"][1] for run in alone) for c in range(COPIES)])
                     for j, shape in enumerate(shapes)}  # each GEMM's best run, the copies' mean
    gemm_s = sum(count * per_shape[shape] for shape, count in shapes.items())
    ops = 2 * positions * sum(count * k * n for (k, n), count in shapes.items())
    out["prefill"].update(gemm_alone_ms=gemm_s * 1e3, tops=ops / gemm_s / 1e12,
                          over_gemms=out["prefill"]["wall_ms"] / 1e3 / gemm_s)
    return out


def cpu() -> dict:
    from higgs_onnx.runtime.route import cpu_summary

    return cpu_summary()


def child(model_path: Path, threads: int, repeats: int, mode: str) -> dict:
    """One `--_child` run of this script (a route's figures, or the profile), its JSON line read back."""
    r = subprocess.run([sys.executable, __file__, "--model-path", str(model_path), "--threads", str(threads),
                        "--repeats", str(repeats), "--_child", mode], capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"route {mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(model_path: Path, threads: int, repeats: int) -> dict:
    from higgs_onnx.manifest import crossover_words, load_manifest

    route = load_manifest(model_path, verify=False).decoder.get("route", {})
    if route.get("kind") != "int8-gemm":
        raise SystemExit(f"{model_path} has no int8 route ({route}); build it with optimize.py (cpu, int4)")
    runs = []
    for mode in MODES:
        print(f"  route {mode} ...", flush=True, file=sys.stderr)
        runs.append(child(model_path, threads, repeats, mode))
    print("  profile ...", flush=True, file=sys.stderr)
    return {"export": str(model_path), "cpu": cpu(), "threads": threads or os.cpu_count(), "repeats": repeats,
            "crossover": route.get("crossover"), "crossover_words": crossover_words(route),
            "build_cpu": route.get("cpu"), "runs": runs, "profile": child(model_path, threads, repeats + 2, "profile")}


def print_table(o: dict) -> None:
    print(f"\n{o['export']}: {o['cpu']['model']} ({', '.join(o['cpu']['flags'])}), {o['threads']} threads; crossover "
          f"{o['crossover_words']}")
    runs = o["runs"]
    head = ["figure", *[r["mode"] for r in runs], "int4 / route (first off vs on)"]
    rows = [("prefill 24 positions (ms)", "prefill_24_ms", "{:.1f}"),
            ("prefill 281 positions (ms)", "prefill_281_ms", "{:.1f}"),
            ("first frame, new 10 s clone (s)", "clone_first_frame_s", "{:.2f}"),
            ("first audio, new 10 s clone (s)", "clone_first_audio_s", "{:.2f}"),
            ("  of it the codec encoder (s)", "clone_encode_s", "{:.2f}"),
            ("decode step, one row (ms)", "step_ms", "{:.1f}")]
    print(" | ".join(head))
    off, on = runs[0], runs[1]
    for label, key, fmt in rows:
        print(" | ".join([label, *[fmt.format(r[key]) for r in runs], f"{off[key] / on[key]:.2f} x"]))
    for b in BATCHES:
        k = str(b)
        print(" | ".join([f"rows/s at B = {b}", *[f"{r['rows_per_s'][k]:.2f}" for r in runs],
                          f"{on['rows_per_s'][k] / off['rows_per_s'][k]:.2f} x (route / int4)"]))
    print(" | ".join(["peak RSS (MB)", *[f"{r['peak_rss_mb']:.0f}" for r in runs], ""]))
    print_profile(o["profile"], off, on)


def print_profile(p: dict, off: dict, on: dict) -> None:
    """Where the time goes: the profiled prefill against its GEMMs alone, and the batched steps split."""
    pre = p["prefill"]
    print(f"\nprefill of {pre['positions']} positions on the route (ONNX Runtime's profiler, each node's best run): "
          f"{pre['wall_ms']:.0f} ms = {pre['over_gemms']:.2f} x its GEMMs alone ({pre['gemm_alone_ms']:.0f} ms: "
          f"MatMulInteger on its weight shapes at {pre['tops']:.2f} TOPS)")
    print(" | ".join(["ms", "wall", *SPLIT]))
    print(" | ".join([f"prefill {pre['positions']}", f"{pre['wall_ms']:.0f}",
                      *[f"{pre['split'][k]:.0f}" for k in SPLIT]]))
    print("\nbatched step (ms): the runtime's step (its rows/s above) and its host share (outside the session's run); "
          "the profiled session's wall and kernels")
    print(" | ".join(["route", "B", "rows/s", "step", "host", "session (profiled)", *SPLIT]))
    for label, r in (("int4", off), ("route", on)):
        for b, x in p["batch"][label].items():
            step = 1e3 * int(b) / r["rows_per_s"][b]
            print(" | ".join([label, b, f"{r['rows_per_s'][b]:.1f}", f"{step:.1f}", f"{r['host_ms'][b]:.1f}",
                              f"{x['wall_ms']:.1f}", *[f"{x['split'][k]:.1f}" for k in SPLIT]]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, required=True, help="a cpu int4 export with the int8 route")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="best of this many (default %(default)s)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--_child", choices=("off", "on", "auto", "profile"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not (args.model_path / "manifest.json").is_file():
        ap.error(f"--model-path {args.model_path}: no manifest.json there (not an export folder)")
    if args._child == "profile":
        print(json.dumps(profile(args.model_path, args.threads, args.repeats)))
        return 0
    if args._child:
        print(json.dumps(measure(args.model_path, args._child, args.threads, args.repeats)))
        return 0
    out = run(args.model_path, args.threads, args.repeats)
    print_table(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
