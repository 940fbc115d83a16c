"""Benchmark the ONNX pipeline against this machine's memory-bandwidth floor and the PyTorch reference.

Usage:
    python benchmarks/bench.py --preset tiny                        # smoke run (seconds)
    python benchmarks/bench.py --preset 4b --frames 64 --json bench_4b.json   # real geometry (builds ~9 GB + export)
    python benchmarks/bench.py --model-path onnx/cpu_int4 --batch 1 2 4 8 --json batch.json   # batch gain G(B)
    python benchmarks/bench.py --model-path onnx/cpu_int4 --context-curve   # step vs context, int8 vs fp32 cache
    python benchmarks/bench.py --model-path onnx/cpu_int4 --step-graph      # one call per step vs the parts apart
    python benchmarks/bench.py --model-path onnx/cpu_int4 --continuity      # streamed playback at 1 and 8 streams

Everything is measured in one run: memory read bandwidth with the same thread count, the decoder step vs the floor
(weight bytes / bandwidth), prefill, per-frame host overhead, codec speed, end-to-end speed and peak RSS (in a child
process), the same rows through the PyTorch reference (bf16), and the int4 decoder export's time and RSS.
`--context-curve` measures only the decode step at 128-4,096 positions of context, for the export's KV cache and
(int8) its fp32 twin on the same weights, with the host ms per row. `--batch` measures only the batch gain G(B)
(rows/s at B / rows/s at B = 1) through the scheduler, in one process (`batch_figures`). The streaming section
ends with the playback continuity of streamed requests at 1 and 8 concurrent streams (`continuity.py`: windows on
time, p95 underrun, stalls, beside the time to first audio); `--continuity` measures only that. `--model-path`
benchmarks an existing export instead of the `--preset` synthetic one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("CI", "1")

from higgs_onnx import providers  # noqa: E402
from higgs_onnx.exports import load_export  # noqa: E402
from higgs_onnx.hub import cli_model_path, model_path_arg  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog while the speech synthesizer keeps talking."


BANDWIDTH_MB = 1024  # far beyond any cache (L3 is tens of MB) and tens of milliseconds to read


def bandwidth_gbs(threads: int, mb: int = BANDWIDTH_MB, repeats: int = 10) -> tuple[float, str]:
    """Memory read bandwidth, and a line saying how it was measured: `threads` threads (0 = one per CPU) each take
    the max of its slice of `mb` MB of float32 (NumPy's SIMD reduction, run without the GIL); best of `repeats`.

    The probe must be limited by memory, not arithmetic. On the project's 2-core machine (1 GB, 2 threads, the same
    minutes) this one reads as fast as a compiled OpenMP streaming sum, while NumPy's float64 pairwise sum (the
    former probe) and ONNX Runtime's ReduceSum (9-10 GB/s on one core, where compiled code reads 13-15) read a
    quarter or more below it (README, Performance).
    """
    n = threads or os.cpu_count() or 1
    # distinct bytes in every page: pages of equal bytes (np.ones) are merged by the host (KSM) on these VMs and
    # read from one cached page, 46-75 GB/s against ~30 from memory (the brief's microbenchmark trap)
    x = np.random.default_rng(0).random(mb * 2**20 // 4, dtype=np.float32)  # < 1: written, every page mapped
    chunks = np.array_split(x, n)
    for c in chunks:
        c[-1] = 2.0  # each chunk's known max: the check below proves every chunk was read to its end
    best = 0.0
    with ThreadPoolExecutor(n) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            peaks = list(pool.map(np.max, chunks))
            best = max(best, x.nbytes / (time.perf_counter() - t0) / 1e9)
    if peaks != [2.0] * n:  # every chunk was read to its end
        raise RuntimeError(f"bandwidth probe: the chunks' max gave {peaks}, not 2.0 each")
    return best, f"NumPy float32 max over {mb} MB in {n} threads, best of {repeats}"


def ensure_export(preset: str, precision: str, root: Path, device: str = "cpu",
                  attention: str | None = None) -> tuple[Path, Path]:
    from higgs_onnx.export import Exporter, ExportOptions
    from higgs_onnx.synthetic import build

    ckpt = root / f"synthetic_{preset}"
    if not (ckpt / "config.json").is_file():
        print(f"building the {preset} synthetic checkpoint ...", flush=True)
        build(preset, ckpt, progress=sys.stderr.isatty())
    return ckpt, Exporter(str(ckpt), root / "onnx", ExportOptions(device, precision, attention=attention)).run()


class Timed:
    """Wraps a backend and accumulates the time spent inside the decoder."""

    def __init__(self, backend):
        self.backend, self.decoder_s = backend, 0.0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def prefill(self, cache, embeds):
        t0 = time.perf_counter()
        out = self.backend.prefill(cache, embeds)
        self.decoder_s += time.perf_counter() - t0
        return out

    def decode(self, cache, embed):
        t0 = time.perf_counter()
        out = self.backend.decode(cache, embed)
        self.decoder_s += time.perf_counter() - t0
        return out

    def decode_codes(self, cache, codes):  # the step graph: embedding, decoder and heads in this one call
        t0 = time.perf_counter()
        out = self.backend.decode_codes(cache, codes)
        self.decoder_s += time.perf_counter() - t0
        return out


def step_bytes(manifest) -> int:
    """The bytes of weights one decode step reads: the ONNX decoder's as its kernels read them (`quantize.read_bytes`:
    an int4 weight's scales and, at accuracy level 4, MLAS's block sums; not the int8 route's weights, which the
    part's files also hold), or an OpenVINO IR decoder's files."""
    from higgs_onnx.quantize import read_bytes

    path = manifest.part_file("llm_decoder")
    if path.suffix == ".onnx":
        return read_bytes(path)
    return sum(f["size"] for f in manifest.parts["llm_decoder"]["files"].values())


def decoder_figures(tts, context: int, steps: int) -> dict:
    f, rng = tts.facts, np.random.default_rng(0)
    dec = tts.backend.decoder
    ms = {}
    for name, length in (("prefill_zero_shot_ms", 24), ("prefill_clone_ms", 24 + 250 + f.num_codebooks - 1)):
        embeds = rng.standard_normal((length, f.hidden)).astype(np.float32)
        t0 = time.perf_counter()
        dec.run(dec.new_cache(length + 1), embeds)
        ms[name] = (time.perf_counter() - t0) * 1e3
    cache = dec.new_cache(context + steps + 1)
    dec.run(cache, rng.standard_normal((context, f.hidden)).astype(np.float32))
    row = rng.standard_normal((1, f.hidden)).astype(np.float32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        dec.run(cache, row)
        times.append((time.perf_counter() - t0) * 1e3)
    ms["decoder_step_ms"] = statistics.median(times)
    ms["context"] = context
    return ms


MATMUL_MS = (1, 2, 4, 8, 16)  # rows (batch) of the one-matmul table


def matmul_table(k: int, n: int, threads: int, repeats: int = 20) -> list[dict]:
    """One int4 MatMulNBits of the decoder's largest shape (K x N: hidden x intermediate) alone, per block size (32,
    128) and accuracy level (4: int8 activations, VNNI kernels; 0: fp32), at M = 1..16 rows: ms per call (best round
    over distinct weight copies, so the weights come from memory) and the weight bytes read per second. A kernel
    that turns compute-bound shows as ms growing with M at M >= 2 (toolchain §13: ~1 ms per extra row on an
    AVX2-only EPYC)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from higgs_onnx.quantize import read_bytes_per_weight
    from higgs_onnx.runtime.session import session_options

    rng, out = np.random.default_rng(0), []
    for block in (b for b in (32, 128) if k % b == 0):  # a block that does not divide K: not a shape we build
        blocks = k // block
        weight_bytes = n * blocks * (block // 2 + 4)  # packed int4 + one fp32 scale per block
        # distinct copies cycled call by call, ~256 MB in all: each call reads its weights from memory, as a
        # decoder step does (one copy alone stays in the last-level cache and reads faster than memory can)
        copies = int(min(32, max(1, 256e6 // weight_bytes)))
        for level in (4, 0):
            nodes, inits = [], []
            for i in range(copies):  # one graph: one thread pool, the nodes run one after the other
                inits += [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8),
                                                  f"b{i}"),
                          numpy_helper.from_array((rng.random((n, blocks), dtype=np.float32) * 0.01 + 1e-3)
                                                  .astype(np.float32), f"s{i}")]
                nodes.append(helper.make_node("MatMulNBits", ["a", f"b{i}", f"s{i}"], [f"y{i}"],
                                              domain="com.microsoft", K=k, N=n, bits=4, block_size=block,
                                              accuracy_level=level))
            graph = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", k])],
                                      [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", n])
                                       for i in range(copies)], inits)
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                            helper.make_opsetid("com.microsoft", 1)])
            sess = ort.InferenceSession(model.SerializeToString(), session_options(threads, spin=True),
                                        providers=[providers.get("cpu").ort_name])
            row = {"block": block, "accuracy_level": level, "copies": copies, "ms": {}, "gb_s": {}}
            for m in MATMUL_MS:
                a = rng.standard_normal((m, k)).astype(np.float32)
                sess.run(None, {"a": a})
                best = float("inf")
                for _ in range(max(2, repeats // copies)):
                    t0 = time.perf_counter()
                    sess.run(None, {"a": a})
                    best = min(best, (time.perf_counter() - t0) / copies)
                row["ms"][m] = best * 1e3
                row["gb_s"][m] = k * n * read_bytes_per_weight(block, level) / best / 1e9  # as the kernel reads
            out.append(row)
            del sess
    return out


def print_matmul(table: list[dict], k: int, n: int, probe_gbs: float | None) -> None:
    print(f"one int4 MatMulNBits {k} x {n}, ms per call at M rows (weights read per second at M = 1"
          + (f"; the read probe: {probe_gbs:.1f} GB/s)" if probe_gbs else ")"))
    print(f"  {'block':>5} {'accuracy':>8}" + "".join(f"{'M=' + str(m):>9}" for m in MATMUL_MS) + f"{'GB/s M=1':>10}")
    for r in table:
        print(f"  {r['block']:>5} {r['accuracy_level']:>8}" + "".join(f"{r['ms'][m]:>9.2f}" for m in MATMUL_MS)
              + f"{r['gb_s'][1]:>10.1f}")


CURVE = (128, 512, 1024, 2048, 4096)


def context_curve(tts, contexts=CURVE, steps: int = 20) -> dict:
    """The decode step (ms, median of `steps`) with `c` positions already in the cache, for each `c`: the cache's
    length is set, not prefilled (attention reads what the mask says is there; the values do not change the time),
    so 4,096 positions cost no prefill. `kv_bytes_per_position`: the cache one position takes, all layers."""
    f, rng = tts.facts, np.random.default_rng(0)
    dec = tts.backend.decoder
    contexts = [c for c in contexts if c + 1 < f.max_positions]
    cache = dec.new_cache(max(contexts) + 2)
    row = rng.standard_normal((1, f.hidden)).astype(np.float32)
    out = {}
    for c in contexts:
        cache.length = c
        dec.run(cache, row)  # warm
        times = []
        for _ in range(steps):
            cache.length = c
            t0 = time.perf_counter()
            dec.run(cache, row)
            times.append((time.perf_counter() - t0) * 1e3)
        out[c] = statistics.median(times)
    return {"step_ms": out, "kv_bytes_per_position": tts.kv_bytes_per_position}


def curve_main(args) -> int:
    """`--context-curve`: the step against the context for the export's KV cache and, for an int8 cache, its fp32
    twin on the same weights (`parts/kv_cache.fp32_twin`), twice each (noise), plus the host ms per row."""
    from higgs_onnx.parts.kv_cache import fp32_twin
    from higgs_onnx.runtime.model import HiggsTTS

    _, export = resolve_export(args)
    dtype = load_export(export, verify=False).kv_cache
    out = {"export": str(export), "cpu": cpu_info(), "threads": args.threads, "curves": {}}
    with tempfile.TemporaryDirectory(prefix="higgs-curve-") as tmp:
        folders = {dtype: export}
        if dtype == "int8":
            folders["fp32"] = fp32_twin(export, Path(tmp) / "fp32")
        for _ in (1, 2):
            for name, folder in folders.items():
                tts = HiggsTTS(folder, threads=args.threads, verify=False)
                c = context_curve(tts, steps=args.steps)
                out["curves"].setdefault(name, []).append(c)
                del tts
        for name, folder in folders.items():
            g, _ = child("--_generation", str(folder), "--frames", str(args.frames), "--threads", str(args.threads))
            out.setdefault("host", {})[name] = {k: g[k] for k in ("host_overhead_ms_per_row", "decoder_ms_per_row")}
    print(f"context curve: {export} ({cpu_line(out['cpu'])}; {args.threads or os.cpu_count()} threads)")
    names = list(out["curves"])
    head = "".join(f"{n + ' cache, run ' + str(r):>22}" for n in names for r in (1, 2))
    print(f"  {'positions':>9}{head}")
    contexts = list(out["curves"][names[0]][0]["step_ms"])
    for c in contexts:
        cells = "".join(f"{out['curves'][n][r]['step_ms'][c]:>19.2f} ms" for n in names for r in (0, 1))
        print(f"  {c:>9}{cells}")
    for n in names:
        best = {c: min(run["step_ms"][c] for run in out["curves"][n]) for c in contexts}
        far = 2048 if 2048 in best else contexts[-1]
        ratio = best[far] / best[contexts[0]]
        h = out["host"][n]
        print(f"  {n} cache: {out['curves'][n][0]['kv_bytes_per_position'] / 1024:.1f} KiB per position; step at "
              f"{far} / at {contexts[0]} = {ratio:.2f}x; host {h['host_overhead_ms_per_row']:.2f} ms per "
              f"row beside {h['decoder_ms_per_row']:.2f} ms of decoder "
              f"({h['host_overhead_ms_per_row'] / (h['host_overhead_ms_per_row'] + h['decoder_ms_per_row']):.1%})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


def generation_figures(model_path: Path, frames: int, threads: int = 0) -> dict:
    """One generation in this process; returns timings (run in a child process for a clean peak RSS)."""
    from higgs_onnx.generation.engine import generate
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.generation.pipeline import stop_rules
    from higgs_onnx.generation.prompt import build_prompt
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(model_path, threads=threads, verify=False)
    tts.generate("Warm up.", max_rows=10)  # sessions created, buffers allocated
    timed = Timed(tts.backend)
    prompt = build_prompt(tts.tokenizer, tts.tokens, TEXT)
    t0 = time.perf_counter()
    res = generate(timed, prompt, stop_rules(tts.facts), GenerationOptions(max_rows=frames), tts.facts.placeholder)
    t_loop = time.perf_counter() - t0
    t1 = time.perf_counter()
    from higgs_onnx.generation.delay import codes_for_codec
    wav = tts.decode_audio(codes_for_codec(res.codes, tts.facts.codebook_size))
    t_codec = time.perf_counter() - t1
    rows = len(res.rows)
    zero_shot_rss = peak_rss_mb()  # before the clone below loads the codec encoder
    ref = ROOT / "tests" / "data" / "ref_en_24k.wav"  # time to first frame of a clone: new voice, then cached
    new_voice = tts.generate("A cloned line.", ref_audio=ref, max_rows=8).stats.first_row_s
    cached_voice = tts.generate("A cloned line.", ref_audio=ref, max_rows=8).stats.first_row_s
    decode_loop = t_loop - res.prefill_s
    decoder_in_loop = timed.decoder_s - res.prefill_s
    audio_s = wav.size / tts.facts.sample_rate
    return {"rows": rows, "frames": len(res.codes), "prefill_s": res.prefill_s, "loop_s": t_loop,
            "decoder_ms_per_row": decoder_in_loop / rows * 1e3,
            "host_overhead_ms_per_row": (decode_loop - decoder_in_loop) / rows * 1e3,
            "codec_decode_s": t_codec, "audio_s": audio_s, "wall_s": t_loop + t_codec,
            "rows_per_s": rows / t_loop, "rtf": (t_loop + t_codec) / max(audio_s, 1e-9),
            "time_to_first_frame_s": res.prefill_s, "rows_generated": res.rows.tolist(),
            "first_frame_new_voice_s": new_voice, "first_frame_cached_voice_s": cached_voice,
            "clone_peak_rss_mb": peak_rss_mb(),
            "peak_rss_mb": zero_shot_rss}


def load_figures(model_path: Path, threads: int = 0) -> dict:
    """The export made ready to prefill in this process, as the CLI makes it: `HiggsTTS` (the manifest, the files'
    hashes or their verdicts, the tokenizer), then the decoder's session and the parts a prompt runs through (the
    int8 route's session stays lazy: made by the first call that takes it)."""
    from higgs_onnx.runtime.model import HiggsTTS

    t0 = time.perf_counter()
    tts = HiggsTTS(model_path, threads=threads)  # verify, as the CLI does
    tts.preload(("text_embed", "audio_heads"))
    return {"ready_s": time.perf_counter() - t0, "opened_s": tts.opened_s, "sessions_s": tts.parts.load_s,
            "decoder": tts.backend.decoder_part, "route_lazy": tts.backend.route_part is not None,
            "peak_rss_mb": peak_rss_mb()}


def load_runs(export: Path, threads: int) -> dict:
    """`load_figures` in two fresh processes one after the other: the first (cold-ish: it may hash the files or
    prepare the decoder's graph, once per file identity) and the second (warm: the page cache and the user's cache
    as the first left them); each with its whole process time (interpreter and imports included)."""
    runs = {}
    for key in ("first", "second"):
        figures, wall = child("--_load", str(export), "--threads", str(threads))
        runs[key] = {**figures, "process_s": wall}
    return runs


def print_load(runs: dict) -> list[tuple]:
    return [(f"ready to prefill, {key} load", f"{r['ready_s']:.2f} s",
             f"opened {r['opened_s']:.2f} s (manifest, hashes, tokenizer), sessions {r['sessions_s']:.2f} s "
             f"({r['decoder']}{', the route lazy' if r['route_lazy'] else ''}); process {r['process_s']:.1f} s; peak "
             f"RSS {r['peak_rss_mb']:.0f} MB") for key, r in runs.items()]


LONG_TEXT = " ".join([TEXT] * 4)


def stream_figures(model_path: Path, seconds: float, threads: int, voice: bool, one_shot: bool) -> dict:
    """One line of `seconds` of audio (ignore_eoc: the length is fixed) streamed, and with `one_shot` also made in
    one piece first: time to first audio, codec time, codes and audio agreement; peak RSS of this process."""
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.parity import snr_db
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(model_path, threads=threads, verify=False)
    f = tts.facts
    kw = {"voice": tts.make_voice(ROOT / "tests" / "data" / "ref_en_24k.wav")} if voice else {}
    tts.generate("Warm up.", max_rows=10, **kw)  # sessions created
    for _ in tts.stream("Warm up.", max_rows=20, **kw):
        pass
    rows = int(round(seconds * f.frame_rate)) + f.num_codebooks - 1
    options = GenerationOptions(seed=0, max_rows=rows, ignore_eoc=True)
    out = {"seconds": seconds, "voice": voice, "rows": rows}
    if one_shot:
        sp = tts.generate(LONG_TEXT, options=options, **kw)
        s = sp.stats
        out["one_shot"] = {"first_audio_s": s.first_audio_s, "wall_s": s.wall_s, "codec_s": s.codec_s,
                           "decode_s": s.decode_s, "prefill_s": s.prefill_s}
    kept = []  # the audio is kept only to compare it (the memory runs keep nothing: the RSS is the engine's)
    for last in tts.stream(LONG_TEXT, options=options, **kw):
        if one_shot:
            kept.append(last.samples)
    s = last.stats
    out["stream"] = {"first_audio_s": s.first_audio_s, "wall_s": s.wall_s, "codec_s": s.codec_s,
                     "decode_s": s.decode_s, "chunks": s.chunks, "audio_s": s.audio_s}
    if one_shot:
        out["codes_equal"] = bool(np.array_equal(last.rows, sp.rows))
        out["snr_db"] = snr_db(sp.waveform, np.concatenate(kept))
    positions = s.prompt_tokens + rows
    out["kv_cache_mb"] = tts.kv_bytes_per_position * positions / 2**20  # its own dtype: fp32 or int8
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def codec_schemes(tts, frames: np.ndarray) -> list[dict]:
    """Streamed codec decoding of real speech codes `frames` (T, N), pushed one frame at a time as generation
    makes them, against one one-shot decode: extra codec time and SNR per scheme and setting."""
    from higgs_onnx.generation.codec_stream import CodecStream, StatefulCodecStream, StreamOptions
    from higgs_onnx.generation.delay import codes_for_codec
    from higgs_onnx.parity import snr_db

    f = tts.facts
    codes = codes_for_codec(frames, f.codebook_size)

    def best(fn, repeats=3):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = fn()
            times.append(time.perf_counter() - t0)
        return min(times), res

    tts.decode_audio(codes[..., :8])
    one_s, want = best(lambda: tts.decode_audio(codes))

    def streamed(make):
        def run():
            st, out = make(), []
            for frame in frames:
                out += st.push(frame[None])
            out.append(st.flush())
            return np.concatenate(out)
        return run

    settings = [("window", StreamOptions(left_context=24, holdback=12)),
                ("window", StreamOptions(left_context=16, holdback=10)),
                ("window", StreamOptions(left_context=8, holdback=8))]
    has_stateful = "audio_tokenizer_stream" in tts.manifest.parts
    if has_stateful:
        settings += [("stateful", StreamOptions(first_frames=8, chunk_frames=25)),
                     ("stateful", StreamOptions(first_frames=4, chunk_frames=10)),
                     ("stateful", StreamOptions(first_frames=1, chunk_frames=1))]
    rows = []
    for scheme, o in settings:
        if scheme == "window":
            make = lambda o=o: CodecStream(tts.decode_audio, f.hop, f.codebook_size, o)  # noqa: E731
        else:
            part = tts.part("audio_tokenizer_stream")
            make = lambda o=o, part=part: StatefulCodecStream(part, f.hop, f.codebook_size, o)  # noqa: E731
        secs, got = best(streamed(make))
        rows.append({"scheme": scheme, "first_frames": o.first_frames, "chunk_frames": o.chunk_frames,
                     "left_context": o.left_context if scheme == "window" else None,
                     "holdback": o.holdback if scheme == "window" else None,
                     "snr_db": snr_db(want, got), "max_abs_rel": float(np.abs(got - want).max() / np.abs(want).max()),
                     "codec_s": secs, "one_shot_s": one_s, "extra_work": secs / one_s - 1})
    return rows


CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni")  # plus every amx_* flag


def cpu_info() -> dict:
    """This machine's CPU model and the SIMD / matrix flags that decide the int4 kernels' speed (from /proc/cpuinfo):
    avx2, avx512f, avx512_vnni, avx512_bf16, avx_vnni and every amx_* flag it has."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model": "unknown CPU", "flags": []}
    lines = info.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    have = [f for f in CPU_FLAGS if f in flags] + sorted(f for f in flags if f.startswith("amx_"))
    return {"model": model, "flags": have}


def cpu_line(cpu: dict) -> str:
    return f"{cpu['model']}; {', '.join(cpu['flags']) or 'no AVX2'}"


class DecoderClock:
    """While on (a `with` block), adds up the seconds the backend spends in its decoder calls of the row loop
    (`decode`, `decode_batch`, and the step graph's `decode_codes`, `decode_batch_codes`, which hold the audio
    embedding and heads too) and how many there were: the timers are instance attributes over the backend's
    methods, removed on exit. `calls` names other methods to time instead (the heads and the embedding apart)."""

    CALLS = ("decode", "decode_batch", "decode_codes", "decode_batch_codes")
    PARTS = ("audio_logits", "embed_audio")  # the two small parts' sessions, when they run apart

    def __init__(self, backend, calls: tuple[str, ...] = CALLS):
        self.backend, self.seconds, self.calls = backend, 0.0, 0
        self.CALLS = calls

    def __enter__(self) -> DecoderClock:
        self._saved = {name: vars(self.backend).get(name) for name in self.CALLS}  # a wrapper already there
        for name in self.CALLS:
            setattr(self.backend, name, self._timed(getattr(self.backend, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name, saved in self._saved.items():
            if saved is None:
                delattr(self.backend, name)
            else:
                setattr(self.backend, name, saved)

    def _timed(self, call):
        def timed(*args):
            t0 = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed


def batch_run(tts, batch: int, rows: int, positions: int, seed: int = 0) -> dict:
    """`batch` requests of exactly `rows` rows each (ignore_eoc: none stops early, so every B runs the same rows)
    through one scheduler of `batch` slots, all submitted at once and stepped by the caller. Only decode steps are
    timed (the first step also prefills every prompt and is left out): rows/s = rows those steps made / their
    seconds; the decoder's share from `DecoderClock`."""
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.generation.scheduler import PrefillPolicy

    reqs = [tts.request(f"{TEXT} Voice number {i}.", slot=positions,
                        options=GenerationOptions(seed=seed + i, max_rows=rows, ignore_eoc=True))
            for i in range(batch)]
    with tts.scheduler(batch, positions, PrefillPolicy(chunk=positions)) as sched:
        handles = [sched.submit(r) for r in reqs]
        timed_s = timed_rows = steps = 0
        with DecoderClock(tts.backend) as clock, DecoderClock(tts.backend, DecoderClock.PARTS) as small:
            while True:
                before, prefills = sched.batch_rows, sched.prefill_calls
                saved = clock.seconds, clock.calls, small.seconds, small.calls
                t0 = time.perf_counter()
                if not sched.step():
                    break
                spent = time.perf_counter() - t0
                if sched.prefill_calls == prefills:  # a pure decode step
                    timed_s, timed_rows, steps = timed_s + spent, timed_rows + sched.batch_rows - before, steps + 1
                else:  # the prefill step's calls are not row-loop ones
                    clock.seconds, clock.calls, small.seconds, small.calls = saved
        widest = max(h.widest for h in handles)
        done = [h.wait() for h in handles]
    if widest != batch or any(r.n != rows for r in done):
        raise RuntimeError(f"B={batch}: widest batch {widest}, rows {[r.n for r in done]} (wanted {rows} each)")
    return {"rows_per_s": timed_rows / timed_s, "step_ms": timed_s / steps * 1e3,
            "decoder_ms": clock.seconds / steps * 1e3, "steps": steps, "rows": timed_rows,
            "parts_ms": small.seconds / steps * 1e3, "calls_per_step": (clock.calls + small.calls) / steps}


def batch_figures(tts, batches: list[int], rows: int, repeats: int = 3) -> dict:
    """Batch gain G(B) = rows/s at B / rows/s at B = 1, all in this process on one loaded model through the
    scheduler: each round runs every B once (interleaved, so a slow spell of a shared machine hits every B alike);
    each B keeps its best round. B = 1 is always measured (it is the denominator)."""
    f = tts.facts
    batches = sorted({1, *batches})
    positions = 512 + rows  # one slot: the prompt (well under 512 positions) and every row
    warm = f.num_codebooks  # the fewest rows a request may ask: sessions made, each B's bindings
    for b in batches:
        batch_run(tts, b, warm, positions)
    runs: dict[int, list[dict]] = {b: [] for b in batches}
    for _ in range(repeats):
        for b in batches:
            runs[b].append(batch_run(tts, b, rows, positions, seed=100 * b))
    best = {b: max(rs, key=lambda r: r["rows_per_s"]) for b, rs in runs.items()}
    one = best[1]
    audio_s = (rows - f.num_codebooks + 1) / f.frame_rate  # per request
    out = []
    for b in batches:
        r = best[b]
        loop_s = r["step_ms"] * rows / 1e3  # one request's rows at this step time
        out.append({"batch": b, "rows_per_s": r["rows_per_s"], "gain": r["rows_per_s"] / one["rows_per_s"],
                    "step_ms": r["step_ms"], "step_x_single": r["step_ms"] / one["step_ms"],
                    "decoder_ms": r["decoder_ms"], "host_ms": r["step_ms"] - r["decoder_ms"],
                    "host_share": (r["step_ms"] - r["decoder_ms"]) / r["step_ms"],
                    "rtf_per_request": loop_s / audio_s, "rows_per_request": rows,
                    "rounds_rows_per_s": [x["rows_per_s"] for x in runs[b]]})
    return {"positions": positions, "repeats": repeats, "batches": out,
            "gain": {str(x["batch"]): x["gain"] for x in out}, "peak_rss_mb": peak_rss_mb()}


def step_graph_figures(model_path: Path, batches: list[int], rows: int, repeats: int, threads: int = 0) -> dict:
    """The decode step with the step graph (one call: codes in, logits out) against the three parts driven apart
    (heads -> host -> embedding -> decoder), on the same export in one process, at each B, interleaved rounds (best
    of `repeats` kept). Per row: the whole step, the time inside runtime calls, and the host's share (the step less
    every runtime call: sampling, the state machine, NumPy and Python)."""
    from higgs_onnx.runtime.model import HiggsTTS

    models = {"parts": HiggsTTS(model_path, threads=threads, verify=False, step_graph=False),
              "step graph": HiggsTTS(model_path, threads=threads, verify=False, step_graph=True)}
    if not models["step graph"].backend.fused:
        raise SystemExit(f"{model_path} has no step graph (llm_step): rebuild it with optimize.py")
    positions = 512 + rows
    for tts in models.values():
        for b in batches:
            batch_run(tts, b, tts.facts.num_codebooks, positions)  # warm: sessions, bindings
    runs: dict = {}
    for _ in range(repeats):
        for name, tts in models.items():
            for b in batches:
                runs.setdefault((name, b), []).append(batch_run(tts, b, rows, positions, seed=7 * b))
    out = []
    for (name, b), rs in runs.items():
        r = min(rs, key=lambda x: x["step_ms"])
        runtime = r["decoder_ms"] + r["parts_ms"]
        out.append({"path": name, "batch": b, "step_ms": r["step_ms"], "row_ms": r["step_ms"] / b,
                    "runtime_ms": runtime, "decoder_ms": r["decoder_ms"], "parts_ms": r["parts_ms"],
                    "host_ms_per_row": (r["step_ms"] - runtime) / b,
                    "host_share": (r["step_ms"] - runtime) / r["step_ms"],
                    "calls_per_step": r["calls_per_step"], "rounds_step_ms": [x["step_ms"] for x in rs]})
    return {"export": str(model_path), "rows": rows, "repeats": repeats, "rows_of": out, "cpu": cpu_info()}


def step_graph_main(args) -> int:
    _, export = resolve_export(args)
    fig = step_graph_figures(export, args.batch or [1, 4], args.frames, args.repeats, args.threads)
    print(f"step graph vs parts: {export} ({cpu_line(fig['cpu'])}; {args.threads or os.cpu_count()} threads; "
          f"{fig['rows']} rows a request, best of {fig['repeats']} interleaved rounds)")
    print(f"  {'path':<11}{'B':>3}{'step ms':>9}{'calls':>7}{'in runtime':>12}{'host/row':>10}{'host %':>8}")
    for x in sorted(fig["rows_of"], key=lambda x: (x["batch"], x["path"])):
        print(f"  {x['path']:<11}{x['batch']:>3}{x['step_ms']:>9.2f}{x['calls_per_step']:>7.1f}"
              f"{x['runtime_ms']:>9.2f} ms{x['host_ms_per_row']:>7.3f} ms{100 * x['host_share']:>7.1f}%")
    if args.json:
        args.json.write_text(json.dumps(fig, indent=2))
    return 0


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it is not inherited from the parent across fork/exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(*args: str, script: str = __file__) -> tuple[dict, float]:
    """Run `script` (this one by default) in a child mode (a clean process for peak RSS); returns (its JSON, wall
    seconds)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(Path(script).resolve()), *args], capture_output=True, text=True,
                       cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"child {args[0]} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def codec_figures(tts) -> dict:
    from higgs_onnx.audio import load_reference

    f = tts.facts
    codes = np.random.default_rng(1).integers(0, f.codebook_size, (1, f.num_codebooks, int(10 * f.frame_rate)))
    tts.decode_audio(codes[..., :5])
    t0 = time.perf_counter()
    tts.decode_audio(codes)
    dec = (time.perf_counter() - t0) * 1e3 / 10
    wav = load_reference(ROOT / "tests" / "data" / "ref_en_24k.wav", f.sample_rate)
    tts.encode_audio(wav[: f.sample_rate])
    t0 = time.perf_counter()
    tts.encode_audio(wav)
    enc = (time.perf_counter() - t0) * 1e3 / (wav.size / f.sample_rate)
    return {"codec_decode_ms_per_audio_s": dec, "codec_encode_ms_per_audio_s": enc}


def torch_figures(ckpt: Path, rows: np.ndarray, text: str) -> dict:
    """The PyTorch reference (bf16) fed the same rows (same number of decode steps)."""
    import torch

    from higgs_onnx.generation.engine import generate
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.generation.pipeline import stop_rules
    from higgs_onnx.generation.prompt import build_prompt
    from higgs_onnx.reference.model import ReferenceBackend, ReferenceModel

    torch.set_num_threads(os.cpu_count() or 1)
    ref = ReferenceModel(ckpt, dtype="bf16", stream=False)  # resident: what a PyTorch user would run
    prompt = build_prompt(ref.tokenizer, ref.tokens, text)
    be = ReferenceBackend(ref)
    generate(be, prompt, stop_rules(ref.facts), GenerationOptions(max_rows=2), ref.facts.placeholder)
    t0 = time.perf_counter()
    res = generate(be, prompt, stop_rules(ref.facts), GenerationOptions(max_rows=len(rows)), ref.facts.placeholder,
                   teacher_rows=rows)
    loop = time.perf_counter() - t0
    return {"rows": len(res.rows), "loop_s": loop, "rows_per_s": len(res.rows) / loop, "peak_rss_mb": peak_rss_mb()}


def export_figures(ckpt: Path) -> dict:
    """Extract + build the int4 decoder (fp32 ModelBuilder build, streaming quantization) in this process."""
    import shutil

    from higgs_onnx.checkpoint import extract_qwen3
    from higgs_onnx.parts.llm_decoder import build_from_qwen3 as build

    work = Path(tempfile.mkdtemp(dir=ckpt.parent))
    try:
        t0 = time.perf_counter()
        build(extract_qwen3(ckpt, work / "qwen3"), work / "out", "int4", "cpu", work / "work")
        return {"int4_decoder_export_s": time.perf_counter() - t0, "int4_decoder_export_peak_rss_mb": peak_rss_mb()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


MODES = ("load", "routes", "continuity", "matmul", "context_curve", "step_graph")  # each a run of its own


def check_args(args: argparse.Namespace) -> None:
    """The numbers and the run's mode checked before any work (ValueError: the one line): a zero or negative count
    or a duration that is not a positive number failed deep in a run, after minutes (a traceback), or was used."""
    counts = {"--frames": [args.frames], "--steps": [args.steps], "--context": [args.context],
              "--repeats": [args.repeats], "--batch": args.batch or [], "--streams": args.streams,
              "--chunk-frames": [] if args.chunk_frames is None else [args.chunk_frames]}
    for flag, values in counts.items():
        if any(v < 1 for v in values):
            raise ValueError(f"{flag} must be >= 1, got {' '.join(map(str, values))}")
    for flag, value in (("--stream-seconds", args.stream_seconds), ("--long-seconds", args.long_seconds)):
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a number of seconds > 0, got {value}")
    modes = [f"--{m.replace('_', '-')}" for m in MODES if getattr(args, m)]
    if len(modes) > 1 or (args.batch and modes and modes != ["--step-graph"]):
        raise ValueError(f"{' and '.join(modes + (['--batch'] if args.batch else []))} are runs of their own: "
                         f"one at a time (--batch goes with --step-graph only)")
    if args.json is not None:
        from higgs_onnx.outputs import check_output_file

        check_output_file(args.json, "--json", example="bench.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["tiny", "4b"], default="tiny")
    ap.add_argument("--device", choices=[p.name for p in providers.PROVIDERS.values()
                                         if p.status == providers.VERIFIED], default="cpu",
                    help="the export's device (openvino: run by the OpenVINO runtime)")
    ap.add_argument("--attention", choices=providers.ATTENTIONS, help="decoder graph (default: the device's)")
    ap.add_argument("--precision", choices=["int4", "fp16", "fp32"], default="int4")
    ap.add_argument("--frames", type=int, default=64, help="rows generated for the end-to-end figures")
    ap.add_argument("--steps", type=int, default=50, help="decode steps for the decoder median")
    ap.add_argument("--context", type=int, default=128, help="context length for the decoder step")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads of the decoder and the bandwidth probe (0 = ONNX Runtime's default for the "
                    "decoder, one per CPU for the probe)")
    ap.add_argument("--work", type=Path, default=ROOT / "onnx" / "bench", help="where checkpoints/exports live")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-export", action="store_true", help="skip timing the int4 decoder export")
    ap.add_argument("--load", action="store_true", help="only the load figure: the export ready to prefill "
                    "(HiggsTTS, the decoder's session), in a first and a second fresh process")
    ap.add_argument("--_generation", type=Path, help=argparse.SUPPRESS)  # child modes
    ap.add_argument("--_load", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--_torch", nargs=2, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--_export", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--_stream", nargs=4, help=argparse.SUPPRESS)  # export seconds voice(0/1) one_shot(0/1)
    ap.add_argument("--model-path", type=model_path_arg, help="an existing export folder, or a Hub reference "
                    "hf://ORG/REPO/FOLDER[@REVISION], to benchmark (default: the --preset "
                    "synthetic export under --work, built if missing)")
    ap.add_argument("--batch", type=int, nargs="+", metavar="B", help="batched decoding only: the batch gain G(B) "
                    "for these requests per decoder call, e.g. --batch 1 2 4 8 (one process, --frames rows each)")
    ap.add_argument("--matmul", action="store_true", help="only the one-matmul table: the decoder's largest int4 "
                    "MatMulNBits at M = 1-16 rows, block 32/128, accuracy level 4/0")
    ap.add_argument("--context-curve", action="store_true", help="only the decode step against the context "
                    f"({', '.join(map(str, CURVE))} positions) for the export's KV cache and, for int8, its fp32 twin")
    ap.add_argument("--step-graph", action="store_true", help="only the decode step through the step graph against "
                    "the three parts apart, with the host ms per row (B from --batch, default 1 4)")
    ap.add_argument("--repeats", type=int, default=3, help="--batch: interleaved rounds, best kept per B")
    ap.add_argument("--routes", action="store_true", help="only both decoder routes side by side (int4 alone, the "
                    "int8 GEMM route, the measured crossover): prefill, a new clone's first frame, rows/s at B = 1-16, "
                    "peak RSS (benchmarks/routes.py)")
    ap.add_argument("--skip-stream", action="store_true", help="skip the streaming figures (TTFA, 10 s / 60 s)")
    ap.add_argument("--long-seconds", type=float, default=60.0, help="the long line of the memory check")
    ap.add_argument("--continuity", action="store_true", help="only the playback continuity of streamed requests "
                    "(benchmarks/continuity.py): windows on time, p95 underrun, stalls, first audio")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8], metavar="N",
                    help="concurrent streams of the continuity runs (default 1 8)")
    ap.add_argument("--stream-seconds", type=float, default=5.0, help="audio per stream of the continuity runs")
    ap.add_argument("--chunk-frames", type=int, help="frames per streamed chunk after the first, continuity runs "
                    "(default: StreamOptions', as the server streams)")
    from higgs_onnx.cli import one_line_errors

    one_line_errors(ap)  # a usage error is one line, not the usage block
    args = ap.parse_args(argv)
    from higgs_onnx.runtime.session import check_threads

    try:
        check_threads(args.threads)
    except ValueError as e:
        ap.error(str(e))  # a usage error: exit 2 before anything is built
    try:
        check_args(args)
    except (ValueError, OSError) as e:
        ap.error(str(e))  # a usage error: exit 2 before anything is built or timed
    if args.model_path is not None:
        try:
            cli_model_path(args)  # hf://...: fetched once here; the child processes get the local folder
        except ValueError as e:
            ap.error(str(e))
    if args.model_path is not None and not (args.model_path / "manifest.json").is_file():
        ap.error(f"--model-path {args.model_path}: no manifest.json there (not an export folder)")
    if args._generation:
        print(json.dumps(generation_figures(args._generation, args.frames, args.threads)))
        return 0
    if args._load:
        print(json.dumps(load_figures(args._load, args.threads)))
        return 0
    if args.load:
        out = {"cpu": cpu_info(), "load": load_runs(resolve_export(args)[1], args.threads)}
        print(f"CPU: {cpu_line(out['cpu'])}")
        for name, value, note in print_load(out["load"]):
            print(f"  {name:<30}{value:>20}   {note}")
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
        return 0
    if args._torch:
        print(json.dumps(torch_figures(args._torch[0], np.load(args._torch[1], allow_pickle=False), TEXT)))
        return 0
    if args._export:
        print(json.dumps(export_figures(args._export)))
        return 0
    if args.step_graph:
        return step_graph_main(args)
    if args.routes:
        import routes

        out = routes.run(resolve_export(args)[1], args.threads, min(args.repeats, 2))
        routes.print_table(out)
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
        return 0
    if args.batch:
        return batch_main(args)
    if args.continuity:
        import continuity

        out = continuity.run(resolve_export(args)[1], args.threads, args.streams, args.stream_seconds,
                             args.chunk_frames)
        continuity.print_table(out)
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
        return 0
    if args.context_curve:
        return curve_main(args)
    if args.matmul:
        f = load_export(resolve_export(args)[1], verify=False).model
        table = matmul_table(f["hidden"], f["intermediate"], args.threads)
        print(f"CPU: {cpu_line(cpu_info())}")
        print_matmul(table, f["hidden"], f["intermediate"], bandwidth_gbs(args.threads)[0])
        if args.json:
            args.json.write_text(json.dumps({"cpu": cpu_info(), "matmul": table}, indent=2))
        return 0
    if args._stream:
        m, sec, voice, once = args._stream
        print(json.dumps(stream_figures(Path(m), float(sec), args.threads, voice == "1", once == "1")))
        return 0

    from higgs_onnx.runtime.model import HiggsTTS

    ckpt, export = resolve_export(args)
    precision = load_export(export, verify=False).precision
    out = {"preset": args.preset if args.model_path is None else None, "export": export.name,
           "precision": precision, "threads": args.threads, "cpus": os.cpu_count(), "cpu": cpu_info()}
    out["bandwidth_gbs"], out["bandwidth_probe"] = bandwidth_gbs(args.threads)
    out["load"] = load_runs(export, args.threads)  # before anything else here loads the export
    data = step_bytes(load_export(export, verify=False))
    out["decoder_weight_mb"] = data / 2**20
    out["floor_ms"] = data / (out["bandwidth_gbs"] * 1e9) * 1e3
    tts = HiggsTTS(export, threads=args.threads, verify=False)
    out.update(decoder_figures(tts, args.context, args.steps))
    out["step_x_floor"] = out["decoder_step_ms"] / out["floor_ms"]
    out["decoder_weight_read_gbs"] = data / (out["decoder_step_ms"] / 1e3) / 1e9
    out["matmul_shape"] = [tts.facts.hidden, tts.facts.intermediate]
    out["matmul"] = matmul_table(tts.facts.hidden, tts.facts.intermediate, args.threads)
    out.update(codec_figures(tts))
    from higgs_onnx.audio import load_reference

    speech = tts.encode_audio(load_reference(ROOT / "tests" / "data" / "ref_en_24k.wav", tts.facts.sample_rate))
    out["codec_schemes"] = codec_schemes(tts, speech)
    del tts
    gen, _ = child("--_generation", str(export), "--frames", str(args.frames), "--threads", str(args.threads))
    rows = np.asarray(gen.pop("rows_generated"), np.int64)
    out["generation"] = gen
    if ckpt is None and not (args.skip_torch and args.skip_export):
        print(f"no checkpoint for {export} (its manifest's source folder is gone): the PyTorch and export figures "
              f"are skipped", file=sys.stderr)
    if not args.skip_torch and ckpt is not None:
        out["torch"], _ = child("--_torch", str(ckpt), str(_save(rows)))
        out["speedup_vs_torch"] = gen["rows_per_s"] / out["torch"]["rows_per_s"]
    if not args.skip_export and ckpt is not None:
        figures, _ = child("--_export", str(ckpt))
        out.update(figures)
    if not args.skip_stream:
        t = ("--threads", str(args.threads))
        out["stream"] = {"zero_shot": child("--_stream", str(export), "10", "0", "1", *t)[0],
                         "cached_voice": child("--_stream", str(export), "10", "1", "1", *t)[0],
                         "memory_10s": child("--_stream", str(export), "10", "0", "0", *t)[0],
                         "memory_long": child("--_stream", str(export), str(args.long_seconds), "0", "0", *t)[0]}
        import continuity

        out["continuity"] = continuity.run(export, args.threads, args.streams, args.stream_seconds,
                                           args.chunk_frames)
    print_table(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


def batch_main(args) -> int:
    """`--batch B ...`: the batch gain G(B) of this machine, every B in this one process (see `batch_figures`)."""
    from higgs_onnx.runtime.model import HiggsTTS

    for b in args.batch:
        if b < 1:
            raise SystemExit(f"error: --batch sizes must be >= 1, got {b}")
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats must be >= 1, got {args.repeats}")
    _, export = resolve_export(args)
    tts = HiggsTTS(export, threads=args.threads, verify=False)
    cpu = cpu_info()
    out = {"preset": None if args.model_path else args.preset, "export": str(export),
           "precision": tts.manifest.precision, "threads": args.threads, "cpus": os.cpu_count(), "cpu": cpu,
           "rows": args.frames, **batch_figures(tts, args.batch, args.frames, args.repeats)}
    print_batch_table(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


def print_batch_table(o: dict) -> None:
    pool = f"{o['threads']} intra-op threads" if o["threads"] else "ONNX Runtime's default intra-op threads"
    print(f"\nbatched decoding through the scheduler: {o['export']} ({o['precision']}), {o['rows']} rows per "
          f"request (ignore_eoc), best of {o['repeats']} interleaved rounds, {pool}")
    print(f"CPU: {cpu_line(o['cpu'])} ({o['cpus']} CPUs)")
    print(f"  {'B':>3} {'rows/s':>8} {'G(B)':>7} {'step ms':>9} {'x B=1 step':>11} {'decoder ms':>11} "
          f"{'host %':>7} {'RTF/request':>12}")
    for x in o["batches"]:
        print(f"  {x['batch']:>3} {x['rows_per_s']:>8.1f} {x['gain']:>6.2f}x {x['step_ms']:>9.1f} "
              f"{x['step_x_single']:>10.2f}x {x['decoder_ms']:>11.1f} {100 * x['host_share']:>6.1f}% "
              f"{x['rtf_per_request']:>12.2f}")
    print(f"  G(B) = rows/s at B / rows/s at B = 1; peak RSS of the run {o['peak_rss_mb']:.0f} MB")


def resolve_export(args) -> tuple[Path | None, Path]:
    """(checkpoint or None, export): `--model-path` as given (its checkpoint when the manifest's source folder is
    still there), else the `--preset` synthetic export under `--work`, built if missing."""
    if args.model_path is None:
        return ensure_export(args.preset, args.precision, args.work / args.preset, args.device, args.attention)
    source = load_export(args.model_path, verify=False).source.get("path")
    ckpt = Path(source) if isinstance(source, str) and (Path(source) / "config.json").is_file() else None
    return ckpt, args.model_path


def _save(rows: np.ndarray) -> Path:
    path = Path(tempfile.mkstemp(suffix=".npy")[1])
    np.save(path, rows)
    return path


def print_table(o: dict) -> None:
    g = o["generation"]
    step = o["decoder_step_ms"]
    lines = [
        ("memory read bandwidth", f"{o['bandwidth_gbs']:.1f} GB/s", o["bandwidth_probe"]),
        ("decoder weights", f"{o['decoder_weight_mb']:.1f} MB", "read once per decode step, as the kernel reads "
                                                                "them (int4 scales and block sums included)"),
        ("bandwidth floor per step", f"{o['floor_ms']:.2f} ms", "weights / bandwidth"),
        ("decoder step (median)", f"{step:.2f} ms", f"{o['step_x_floor']:.2f} x floor, context {o['context']}"),
        ("decoder weight read rate", f"{o['decoder_weight_read_gbs']:.1f} GB/s",
         f"weights / step, against the probe's {o['bandwidth_gbs']:.1f} GB/s: "
         + ("the kernel binds, not memory" if o['decoder_weight_read_gbs'] < 0.6 * o['bandwidth_gbs'] else
            "near the memory floor")),
        *print_load(o["load"]),
        ("prefill, zero-shot prompt", f"{o['prefill_zero_shot_ms']:.1f} ms", "24 positions"),
        ("prefill, clone-sized prompt", f"{o['prefill_clone_ms']:.1f} ms", "281 positions (10 s reference)"),
        ("host overhead per frame", f"{g['host_overhead_ms_per_row']:.3f} ms",
         f"{100 * g['host_overhead_ms_per_row'] / max(g['decoder_ms_per_row'], 1e-9):.1f} % of the decoder step"),
        ("codec decode", f"{o['codec_decode_ms_per_audio_s']:.1f} ms / audio s",
         f"{100 * g['codec_decode_s'] / max(g['wall_s'], 1e-9):.1f} % of generation time"),
        ("codec encode", f"{o['codec_encode_ms_per_audio_s']:.1f} ms / audio s", "reference audio"),
        ("end-to-end", f"{g['rows_per_s']:.1f} rows/s", f"RTF {g['rtf']:.2f}, {g['rows']} rows"),
        ("time to first frame", f"{g['time_to_first_frame_s'] * 1e3:.1f} ms", "prompt prefill"),
        ("first frame of a clone", f"{g['first_frame_new_voice_s'] * 1e3:.0f} ms",
         f"{g['first_frame_cached_voice_s'] * 1e3:.0f} ms with the voice cached (6.9 s reference)"),
        ("generation peak RSS", f"{g['peak_rss_mb']:.0f} MB", f"zero-shot; {g['clone_peak_rss_mb']:.0f} MB with a "
                                                               f"clone (codec encoder loaded)"),
    ]
    if "torch" in o:
        lines.append(("PyTorch reference (bf16)", f"{o['torch']['rows_per_s']:.2f} rows/s",
                      f"ONNX is {o['speedup_vs_torch']:.1f}x faster; RSS {o['torch']['peak_rss_mb']:.0f} MB"))
    if "int4_decoder_export_s" in o:
        lines.append(("int4 decoder export", f"{o['int4_decoder_export_s']:.1f} s",
                      f"peak RSS {o['int4_decoder_export_peak_rss_mb']:.0f} MB"))
    for c in o.get("codec_schemes", []):
        setting = (f"left {c['left_context']}, holdback {c['holdback']}" if c["scheme"] == "window" else
                   f"first {c['first_frames']}, then {c['chunk_frames']} frames")
        lines.append((f"stream codec: {c['scheme']}", f"{c['snr_db']:.1f} dB SNR",
                      f"{setting}: {100 * c['extra_work']:+.0f} % codec time vs one-shot"))
    if "stream" in o:
        for key, label in (("zero_shot", "zero-shot"), ("cached_voice", "cached voice")):
            st = o["stream"][key]
            ratio = st["stream"]["first_audio_s"] / st["one_shot"]["first_audio_s"]
            lines.append((f"first audio, 10 s, {label}", f"{st['stream']['first_audio_s']:.2f} s",
                          f"one-shot {st['one_shot']['first_audio_s']:.2f} s ({100 * ratio:.1f} %); codes equal: "
                          f"{st['codes_equal']}; SNR {st['snr_db']:.1f} dB; codec {st['stream']['codec_s']:.2f} s "
                          f"streamed vs {st['one_shot']['codec_s']:.2f} s one-shot"))
        a, b = o["stream"]["memory_10s"], o["stream"]["memory_long"]
        net = 100 * ((b["peak_rss_mb"] - b["kv_cache_mb"]) / (a["peak_rss_mb"] - a["kv_cache_mb"]) - 1)
        lines.append((f"stream peak RSS, {b['seconds']:.0f} s vs 10 s", f"{b['peak_rss_mb']:.0f} MB",
                      f"10 s: {a['peak_rss_mb']:.0f} MB ({100 * (b['peak_rss_mb'] / a['peak_rss_mb'] - 1):+.1f} %); "
                      f"KV cache {b['kv_cache_mb']:.0f} vs {a['kv_cache_mb']:.0f} MB; without it {net:+.1f} %"))
    for r in o.get("continuity", {}).get("runs", []):
        c = r["figures"]
        lines.append((f"playback, {r['streams']} stream{'s' * (r['streams'] > 1)}",
                      f"{100 * c['on_time']:.1f} % on time",
                      f"100 ms windows, {r['seconds']:.0f} s each; p95 underrun {c['underrun_p95_ms']:.0f} ms "
                      f"(max {c['underrun_max_ms']:.0f}); {c['stalls'] / r['streams']:.1f} stalls a stream, longest "
                      f"{c['longest_stall_ms']:.0f} ms, C100 {100 * c['c100']:.0f} %; first audio "
                      f"{c['first_audio_s']:.2f} s (max "
                      f"{c['first_audio_max_s']:.2f})"))
    pool = f"{o['threads']} intra-op threads" if o["threads"] else "ONNX Runtime's default intra-op threads"
    what = f"preset {o['preset']}" if o["preset"] else o["export"]
    print(f"\nbenchmark: {what}, {o['precision']}, {pool}, {o['cpus']} CPUs")
    print(f"CPU: {cpu_line(o['cpu'])}")
    for name, value, note in lines:
        print(f"  {name:<30}{value:>20}   {note}")
    if "matmul" in o:
        print()
        print_matmul(o["matmul"], o["matmul_shape"][0], o["matmul_shape"][1], o["bandwidth_gbs"])


if __name__ == "__main__":
    sys.exit(main())
