"""An int8 KV cache for the decoder's GroupQueryAttention graph (the cpu "gqa" decoder).

ONNX Runtime's CPU GroupQueryAttention keeps a quantized cache itself: with `kv_cache_bit_width=8` and
`k_quant_type` / `v_quant_type` set, its `past_key` / `present_key` (and value) are int8 and it stores
`round(x / scale)`, reading back `q * scale`, with the scales given as its `k_scale` / `v_scale` inputs
(`PER_TENSOR`: shape [1]; `PER_CHANNEL`: [1, kv_heads, 1, head_dim]). ModelBuilder has no released option for it,
so `quantize_cache` rewrites a built graph: the attributes, two scale initializers per layer, and int8 cache inputs
and outputs. Nothing else in the graph changes; the weights file is shared as it is.

The scales come from `calibrate`: the largest |K| and |V| per layer (per channel) that the fp32-cache graph of the
same weights wrote over a few real prompts (a zero-shot line and a clone of the bundled reference, with rows it
generated), with `MARGIN` of headroom. K is taken after Qwen3's per-head RMS norm and the rotary embedding (GQA
applies both before writing the cache), so its channels differ in scale with the norm's weights: per channel for K
and V is the default (`PER_CHANNEL`), measured against per tensor in docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

KV_CACHES = ("fp32", "int8")
MODES = ("PER_CHANNEL", "PER_TENSOR")
MODE = "PER_CHANNEL"  # K and V: measured better than PER_TENSOR on the tiny exports (docs/performance.md)
MARGIN = 1.25  # headroom over the largest calibrated value: a value past it saturates at +-127
GQA = "GroupQueryAttention"
K_SCALE, V_SCALE = 12, 13  # GroupQueryAttention's input slots for the scales (ORT 1.32 schema)


def cache_names(graph) -> tuple[list[str], list[str]]:
    """The graph's past_key_values.* inputs and present.* outputs."""
    past = [i.name for i in graph.input if i.name.startswith("past_key_values.")]
    present = [o.name for o in graph.output if o.name.startswith("present.")]
    return past, present


def cache_dtype(path: Path) -> str:
    """"int8" or "fp32": what the decoder graph at `path` keeps in its cache (read from its first past input)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    past, _ = cache_names(model.graph)
    if not past:
        return "fp32"
    elem = next(i for i in model.graph.input if i.name == past[0]).type.tensor_type.elem_type
    return "int8" if elem == onnx.TensorProto.INT8 else "fp32"


def scales(absmax: np.ndarray, mode: str) -> np.ndarray:
    """Scales from the calibrated |x| maxima (kv_heads, head_dim): [1] or [1, kv_heads, 1, head_dim] float32."""
    if mode not in MODES:
        raise ValueError(f"quantization mode must be one of {MODES}, got {mode!r}")
    top = absmax.max() if mode == "PER_TENSOR" else absmax
    s = np.maximum(np.asarray(top, np.float64) * MARGIN / 127.0, 1e-8)
    shape = [1] if mode == "PER_TENSOR" else [1, absmax.shape[0], 1, absmax.shape[1]]
    return s.astype(np.float32).reshape(shape)


def quantize_cache(src: Path, dst: Path, absmax: dict[str, np.ndarray], mode: str = "PER_CHANNEL") -> int:
    """Write the graph of `src` to `dst` with an int8 cache, every GQA node's scales from `absmax` (keyed by past
    input name); the external weights stay where `src` points (same folder). Returns the nodes rewritten."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(src), load_external_data=False)
    g = model.graph
    past, present = cache_names(g)
    nodes = [n for n in g.node if n.op_type == GQA]
    if not nodes or len(nodes) * 2 != len(past):
        raise ValueError(f"{src}: {len(nodes)} {GQA} nodes for {len(past)} cache inputs; not a gqa decoder")
    for n in nodes:
        k_in, v_in = n.input[3], n.input[4]
        if k_in not in absmax or v_in not in absmax:
            raise ValueError(f"{n.name}: no calibration for {k_in} / {v_in}")
        if any(a.name in ("k_quant_type", "kv_cache_bit_width") for a in n.attribute):
            raise ValueError(f"{n.name}: the cache is quantized already")
        names = []
        for kind, name in (("k", k_in), ("v", v_in)):
            init = numpy_helper.from_array(scales(absmax[name], mode), f"{name}.{kind}_scale")
            g.initializer.append(init)
            names.append(init.name)
        inputs = list(n.input) + [""] * max(0, K_SCALE - len(n.input))
        inputs[K_SCALE:V_SCALE + 1] = names
        del n.input[:]
        n.input.extend(inputs)
        n.attribute.extend([helper.make_attribute("k_quant_type", mode), helper.make_attribute("v_quant_type", mode),
                            helper.make_attribute("kv_cache_bit_width", 8)])
    for v in list(g.input) + list(g.output):
        if v.name in past or v.name in present:
            v.type.tensor_type.elem_type = onnx.TensorProto.INT8
    onnx.save(model, str(dst))
    return len(nodes)


def calibrate(export: Path, threads: int = 0, rows: int = 96) -> dict[str, np.ndarray]:
    """|K| and |V| maxima per layer and channel (kv_heads, head_dim), keyed by past input name, from the
    fp32-cache decoder of the export at `export`: a zero-shot line and a clone of the bundled reference, each
    prefilled and then `rows` rows generated (seeded), the whole cache read back at the end."""
    from ..generation.options import GenerationOptions
    from ..runtime.model import HiggsTTS

    rec = Path(__file__).resolve().parent.parent / "assets" / "recordings" / "ref_en_24k.flac"
    from ..manifest import load_manifest

    if cache_dtype(load_manifest(export, verify=False).part_file("llm_decoder")) != "fp32":  # before the model loads
        raise ValueError(f"{export}: calibration needs the fp32-cache decoder")
    tts = HiggsTTS(export, threads=threads, verify=False)
    texts = ["The quick brown fox jumps over the lazy dog, and then it runs home before the rain starts.",
             "Calibration reads what the cache holds: numbers, like 3.5 kilos at 7:45, and a question?"]
    voice = tts.make_voice(rec, rec.with_suffix(".txt").read_text().strip())
    top: dict[str, np.ndarray] = {}
    with tts.scheduler(1, None) as sched:
        for i, (text, v) in enumerate([(texts[0], None), (texts[1], voice)]):
            req = tts.request(text, voice=v, options=GenerationOptions(seed=11 + i, max_rows=rows))
            h = sched.submit(req, keep=True)
            h.wait()
            for name, a in tts.backend.snapshot(req.cache).items():
                m = np.abs(a[0]).max(axis=1)  # (kv_heads, head_dim) over the positions
                top[name] = m if name not in top else np.maximum(top[name], m)
            h.release()
    del tts, voice, sched
    from ..memory import release_memory

    release_memory()  # the build loads the gate's models next: this one must be gone
    return top


# The int8-cache graph is compared with the fp32-cache graph of the same weights, teacher-forced on the fp32 graph's
# greedy rows (`compare`). The loss it may add is tied to a loss the build already accepts: the int4 decoder's own
# rounding (its parity cosine against a reference on the same dequantized weights, int8 activations included).
# Hidden-state and logit cosine may lose at most BUDGET x that; a build without int4 weights has no such figure and
# is held to ABSOLUTE. Top-1 agreement of the codes must stay >= TOP1. Measured (docs/building.md, "The int8 KV
# cache"), 1 - cosine of hidden states / logits: tiny int4 4.1e-5 / 8.6e-5 against an int4 rounding of 2.4e-5 (limit
# 1.2e-4); 4b int4 4.7e-3 / 4.5e-3 against 4.4e-3 (limit 2.2e-2). Scales made 20x too coarse lose 2.9e-4 / 5.8e-4
# (tiny) and 7.9e-2 / 7.6e-2 (4b), 20x too fine (saturating) 0.38 and 0.57: the budget passes the right scales on
# both geometries and fails every broken one. Greedy agreement and the worst row are reported, not gated: greedy
# rows of a random-weight model part ways at the first near-tie, whatever the cache.
BUDGET = 5.0
POLICY = 2  # bump when the calibration or the gates change: a build that refused int8 under another policy tries again
ABSOLUTE = 0.9995
TOP1 = 0.75
GATES = {"hidden_cosine": ABSOLUTE, "logit_cosine": ABSOLUTE, "top1_agreement": TOP1}  # without an int4 figure


def gates(int4_cosine: float | None) -> dict[str, float]:
    """The thresholds for a build whose int4 decoder has parity cosine `int4_cosine` against its dequantized
    reference (None: not an int4 build)."""
    if int4_cosine is None:
        return dict(GATES)
    floor = 1.0 - BUDGET * max(1.0 - int4_cosine, 0.0)
    return {"hidden_cosine": floor, "logit_cosine": floor, "top1_agreement": TOP1}


def failed_gates(figures: dict, limits: dict[str, float] | None = None) -> list[str]:
    return [f"{k} {figures[k]:.5f} < {v:.5f}" for k, v in (limits or GATES).items() if not figures[k] >= v]


def summary(figures: dict) -> str:
    return (f"hidden cosine {figures['hidden_cosine']:.6f} (worst row {figures['min_row_hidden_cosine']:.6f}), "
            f"logit cosine {figures['logit_cosine']:.6f}, top-1 {figures['top1_agreement']:.1%} of codes")


def gate_rows(facts) -> int:
    """Rows per gate text: fewer on a large model (each is a decoder step of both graphs)."""
    return 120 if facts.hidden <= 1024 else 48


GATE_TEXTS = ("Hello there, this is a test of the quantized cache, spoken clearly.",
              "A second line with other words: 3.5 kilos at 7:45, and then a question?")


class _Recording:
    """A backend that keeps every hidden state its heads are given (teacher-forced runs: one per row). It drives the
    parts apart (`fused` false: the heads see every row's hidden state), on the step graph's session too."""

    fused = False

    def __init__(self, backend):
        self.backend, self.hidden = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def audio_logits(self, hidden: np.ndarray) -> np.ndarray:
        self.hidden.append(np.array(hidden[0], np.float64))
        return self.backend.audio_logits(hidden)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def _pass(tts, texts, rows: int, teachers: list | None) -> list[dict]:
    """One model's runs per text: its greedy rows, and the hidden states and logits of `teachers[i]` (None: its
    own greedy rows) teacher-forced through it."""
    from ..generation.engine import generate
    from ..generation.options import GREEDY_OPTIONS
    from ..generation.pipeline import stop_rules
    from ..generation.prompt import build_prompt

    f = tts.facts
    rules, options = stop_rules(f), dataclasses.replace(GREEDY_OPTIONS, max_rows=rows)
    out = []
    for i, text in enumerate(texts):
        prompt = build_prompt(tts.tokenizer, tts.tokens, text)
        free = generate(tts.backend, prompt, rules, options, f.placeholder).rows
        teacher = free if teachers is None else teachers[i]
        rec = _Recording(tts.backend)
        res = generate(rec, prompt, rules, dataclasses.replace(options, max_rows=len(teacher)), f.placeholder,
                       keep_logits=True, teacher_rows=teacher)
        out.append({"free": free, "hidden": np.stack(rec.hidden), "logits": np.stack(res.logits)})
    return out


def compare(fp32_tts, int8_tts, texts=GATE_TEXTS, rows: int = 120) -> dict:
    """The int8-cache graph against the fp32-cache graph of the same weights, per text: greedy rows of the fp32
    graph are teacher-forced through both (hidden-state and logit cosine, the worst row's, and top-1 agreement of
    every code), then each graph decodes greedily on its own (rows equal, and the first row that differs).

    Either model may be given as a function that loads it: it is then loaded for its own pass only, so the two are
    never in memory together (the build: two 4b models would double its peak)."""
    from ..memory import release_memory

    runs = []
    for i, model in enumerate((fp32_tts, int8_tts)):
        tts = model() if callable(model) else model
        runs.append(_pass(tts, texts, rows, None if i == 0 else [r["free"] for r in runs[0]]))
        del tts
        release_memory()
    out = []
    for text, r32, r8 in zip(texts, runs[0], runs[1], strict=True):
        (h32, l32), (h8, l8) = (r32["hidden"], r32["logits"]), (r8["hidden"], r8["logits"])
        n = min(len(h32), len(h8))
        per_row = [_cosine(h32[i], h8[i]) for i in range(n)]
        top = (l32[:n].argmax(-1) == l8[:n].argmax(-1))
        a, b = r32["free"], r8["free"]
        m = min(len(a), len(b))
        same = (a[:m] == b[:m]).all(axis=1)
        out.append({"text": text, "rows": n, "hidden_cosine": _cosine(h32[:n], h8[:n]),
                    "min_row_hidden_cosine": float(min(per_row)), "logit_cosine": _cosine(l32[:n], l8[:n]),
                    "top1_agreement": float(top.mean()),
                    "greedy_rows": [len(a), len(b)], "greedy_equal": float(same.mean()) if m else 1.0,
                    "greedy_first_difference": None if same.all() else int(np.argmin(same))})
    return {"texts": out, "hidden_cosine": min(t["hidden_cosine"] for t in out),
            "min_row_hidden_cosine": min(t["min_row_hidden_cosine"] for t in out),
            "logit_cosine": min(t["logit_cosine"] for t in out),
            "top1_agreement": min(t["top1_agreement"] for t in out)}


def dequantize_cache(src: Path, dst: Path) -> int:
    """The reverse of `quantize_cache`: the graph of `src` with an fp32 cache again (the attributes and scale inputs
    gone, the same weights), written to `dst` beside the same weights file. Returns the nodes rewritten."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    g = model.graph
    past, present = cache_names(g)
    scale_names = set()
    nodes = [n for n in g.node if n.op_type == GQA]
    for n in nodes:
        keep = [a for a in n.attribute if a.name not in ("k_quant_type", "v_quant_type", "kv_cache_bit_width")]
        del n.attribute[:]
        n.attribute.extend(keep)
        inputs = list(n.input)
        scale_names.update(x for x in inputs[K_SCALE:V_SCALE + 1] if x)
        inputs[K_SCALE:V_SCALE + 1] = [""] * len(inputs[K_SCALE:V_SCALE + 1])
        while inputs and not inputs[-1]:
            inputs.pop()
        del n.input[:]
        n.input.extend(inputs)
    inits = [i for i in g.initializer if i.name not in scale_names]
    del g.initializer[:]
    g.initializer.extend(inits)
    for v in list(g.input) + list(g.output):
        if v.name in past or v.name in present:
            v.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    onnx.save(model, str(dst))
    return len(nodes)


def fp32_twin(export: Path, dst: Path) -> Path:
    """A copy of the int8-cache export at `export` whose decoder keeps an fp32 cache on the same weights, in `dst`
    (files linked, the decoder graph and the manifest written): what `eval.py` and `bench.py` compare it with."""
    return _twin(export, dst, dequantize_cache, "float32", {"dtype": "fp32", "twin_of": str(export)})


def int8_twin(export: Path, dst: Path, absmax: dict[str, np.ndarray], mode: str = MODE) -> Path:
    """A copy of the fp32-cache export at `export` with an int8 cache of scales from `absmax`, in `dst` (files
    linked, the decoder graph and the manifest written; no gates): the build's candidate, and `benchmarks/
    kv_cache.py`'s variants."""
    info = {"dtype": "int8", "mode": mode, "bits": 8, "margin": MARGIN}
    return _twin(export, dst, lambda src, out: quantize_cache(src, out, absmax, mode), "int8", info)


def _twin(export: Path, dst: Path, rewrite, dtype: str, kv: dict) -> Path:
    import json
    import shutil

    from ..manifest import MANIFEST, link_or_copy, sha256_file, write_manifest
    from . import llm_route, llm_step

    data = json.loads((export / MANIFEST).read_text())
    entry = data["parts"]["llm_decoder"]
    graph = entry["file"]
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in export.iterdir():
        if f.is_file() and f.name not in (graph, MANIFEST):
            link_or_copy(f, dst / f.name)
    rewrite(export / graph, dst / graph)
    entry["files"][graph] = {"size": (dst / graph).stat().st_size, "sha256": sha256_file(dst / graph)}
    for io in ("inputs", "outputs"):
        for e in entry[io]:
            if e["name"].startswith(("past_key_values.", "present.")):
                e["dtype"] = dtype
    data["decoder"]["kv_cache"] = kv
    # the step graph and the int8 route hold the decoder's graph: compose them again from the new one
    for derived in (llm_step, llm_route):
        if derived.NAME not in data["parts"]:
            continue
        step = data["parts"][derived.NAME]
        path = derived.compose(dst, {p: data["parts"][p]["file"] for p in derived.USES})
        step["files"] = {path.name: {"size": path.stat().st_size, "sha256": sha256_file(path)}}
        for io in ("inputs", "outputs"):
            for e in step[io]:
                if e["name"].startswith(("past_key_values.", "present.")):
                    e["dtype"] = dtype
    write_manifest(dst, data)
    return dst


def calibrate_apart(export: Path, threads: int = 0) -> dict[str, np.ndarray]:
    """`calibrate` in a child process: the build's peak memory then holds one model at a time (the memory a 4b
    model leaves behind in this process is not reused by the gate's models: 8.2 GB peak in one process, measured)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="higgs-calib-") as tmp:
        out = Path(tmp) / "absmax.npz"
        r = subprocess.run([sys.executable, "-m", __name__, str(export), str(out), str(threads)],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"calibrating the int8 KV cache failed:\n{r.stderr[-2000:]}")
        with np.load(out) as z:
            return {k: z[k] for k in z.files}


if __name__ == "__main__":  # python -m higgs_onnx.parts.kv_cache EXPORT OUT.npz THREADS (calibrate_apart's child)
    import sys

    np.savez(sys.argv[2], **calibrate(Path(sys.argv[1]), int(sys.argv[3])))
