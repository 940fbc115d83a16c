"""`llm_route`: the step graph's twin for many rows, its projections on ONNX Runtime's int8 GEMM.

Every projection of the int4 decoder is `MatMulNBits` (int4 weights, int8 activations per block): the right kernel
for one row, which reads the fewest bytes, and a slow one for many rows (a prefill of a cloned voice's prompt, a
batched step of several requests), where it stays near 200-270 GOPS while ONNX Runtime's u8s8 GEMM (MLAS, VNNI or
AMX) reaches the CPU's int8 peak. This graph is the step graph (`parts/llm_step.py`) with each `MatMulNBits`
replaced by

    x -> per-row scale s = max|x| / 127 -> u8 = QuantizeLinear(x, s, 128) (round(x / s) + 128, one block per row)
      -> MatMulIntegerToFloat(u8, W8, s, column scales, zero point 128) -> float

with W8 the fp32 weight at int8, one scale per output column (`quantize.quantize_columns`, written beside the int4
weights by the decoder's build: `llm_decoder_int8.onnx` + `.data`; the graph takes whatever range they hold). An
input read by several projections (gate and up) is quantized once. ONNX Runtime's CPU kernel of
`MatMulIntegerToFloat` (com.microsoft) applies the column scales as the GEMM writes its float output and the row
scales in one pass after it: five nodes per activation and one per projection, where separate Div/Round/Add/Cast
and Cast/Mul/Mul nodes took 13 % of a 281-position prefill on the 4b (docs/performance.md, the routes section).
Everything else is the step graph's, node for node: the same GroupQueryAttention (an int8 KV cache's scales too),
the same past/present names, dtypes and layout, so the runtime binds **the same KV buffers** to either session and
sends each call to the one that is faster for its row count (`runtime/route.py`). The file holds no weights of its
own: its initializers point at the decoder's, the int8 weights' and the small parts' external data.

At build time (`export.Exporter.route`) the route is gated and timed:
- `gate`: prefills of real prompts (two zero-shot lines and a clone of the bundled reference), teacher-forced
  through an fp32 PyTorch reference, the int4 route and the int8 route: hidden states over every position, and the
  audio head's logits on them (the reference's exact head for all three). The route is written only if it is no
  further from fp32 than the int4 route (1 - cosine, hidden states and logits, worst prompt).
- `crossover`: both routes timed on this machine, one-row calls of M positions (prefill) and batched steps of B
  rows; the crossover is the smallest size from which the route wins at every larger size measured, or none.
The build holds one decoder session at a time (the int4 graph's prefills and timings, then the route's alone, then
the fp32 reference on the same prompts): on the 4b the two sessions are 4.6 + 3.6 GB.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from ..manifest import ROUTE_KIND
from ..parity import GATE_TEXTS
from ..part_facts import ROUTE_PART
from ..quantize import INT8_SCALES_SUFFIX, INT8_SUFFIX
from . import FACTS
from .llm_decoder import INT8_WEIGHTS

log = logging.getLogger(__name__)

NAME = ROUTE_PART
FILE = "llm_route.onnx"
USES = FACTS[NAME].uses
ROUTES = ("int8", "none")  # optimize.py --prefill-route
KIND = ROUTE_KIND  # the manifest's decoder.route kind
POLICY = 3  # bump when the graph, the gate or the crossover rule changes: a build recomposes, gates and times its
# route again (a build that refused it tries again); 2: the quantization in QuantizeLinear, the scales in
# MatMulIntegerToFloat (docs/performance.md, the routes section); 3: the crossover from int4's better phase
# (`time_again`) over int4's whole ladders (no wall-clock budget), so a build timed beside other work is timed again
# the route may be at most this many times further from fp32 (1 - cosine) than the int4 route: 1.0 = no further
ALLOWANCE = 1.0
PREFILL_LADDER = (2, 4, 8, 16, 32, 64, 128)  # positions of a one-row call
BATCH_LADDER = (2, 4, 8, 16)  # rows of a batched step


QUANT = "route/q/"  # the names of the activation quantization's nodes (benchmarks/routes.py splits a profile by it)


def _qname(x: str) -> str:
    return QUANT + x.replace("/", "_")


def gemm_decoder(decoder, index):
    """The decoder ModelProto `decoder` (loaded without its weights) with every MatMulNBits on the int8 GEMM; its
    int8 weights are `index`'s initializers (`llm_decoder_int8.onnx`, external data kept). Returns a new model."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.ModelProto()
    model.CopyFrom(decoder)
    g = model.graph
    weights = {t.name: t for t in index.graph.initializer}
    consts = [helper.make_tensor("route/axes", TensorProto.INT64, [1], [-1]),
              helper.make_tensor("route/eps", TensorProto.FLOAT, [], [1e-12]),
              helper.make_tensor("route/c127", TensorProto.FLOAT, [], [127.0]),
              helper.make_tensor("route/zp", TensorProto.UINT8, [], [128])]
    quantized: dict[str, tuple[str, str]] = {}  # activation -> (its u8 tensor, its per-row scale)
    nodes, used = [], set()
    for node in g.node:
        if node.op_type != "MatMulNBits":
            nodes.append(node)
            continue
        base = node.input[1].removesuffix("_Q4")
        w, s = base + INT8_SUFFIX, base + INT8_SCALES_SUFFIX
        if w not in weights or s not in weights:
            raise ValueError(f"{node.name}: no int8 weights for {base} in {INT8_WEIGHTS}")
        x = node.input[0]
        if x not in quantized:
            q = _qname(x)
            nodes += [helper.make_node("Abs", [x], [q + "/abs"], name=q + "/abs"),
                      helper.make_node("ReduceMax", [q + "/abs", "route/axes"], [q + "/max0"], keepdims=1,
                                       name=q + "/max"),
                      helper.make_node("Max", [q + "/max0", "route/eps"], [q + "/max"], name=q + "/floor"),
                      helper.make_node("Div", [q + "/max", "route/c127"], [q + "/scale"], name=q + "/scale")]
            if not quantized:  # QuantizeLinear's zero points, one per row: every activation has the same rows
                nodes += [helper.make_node("Shape", [q + "/scale"], [QUANT + "rows"], name=QUANT + "rows"),
                          helper.make_node("Expand", ["route/zp", QUANT + "rows"], [QUANT + "zps"], name=QUANT + "zps")]
            nodes.append(helper.make_node("QuantizeLinear", [x, q + "/scale", QUANT + "zps"], [q + "/u8"], axis=-1,
                                          block_size=weights[w].dims[0], name=q + "/u8"))
            quantized[x] = (q + "/u8", q + "/scale")
        u8, scale = quantized[x]
        nodes.append(helper.make_node("MatMulIntegerToFloat", [u8, w, scale, s, "route/zp"], [node.output[0]],
                                      name="route/" + (node.name or base) + "/gemm", domain="com.microsoft"))
        used |= {w, s}
    if not used:
        raise ValueError("the decoder has no MatMulNBits: the int8 route is made from an int4 decoder")
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend([*consts, *(weights[n] for n in sorted(used))])
    return model


def compose(folder: Path, files: dict[str, str]) -> Path:
    """Write `folder/llm_route.onnx` from the final decoder graph and the int8 weights' index in `folder` (and the
    small parts, as the step graph); returns its path."""
    import onnx

    from . import llm_step

    decoder = onnx.load(str(folder / files["llm_decoder"]), load_external_data=False)
    index = onnx.load(str(folder / INT8_WEIGHTS), load_external_data=False)
    return llm_step.compose(folder, files, decoder=gemm_decoder(decoder, index), file=FILE, name=NAME)


# ---------------------------------------------------------------------------------------------------------------
# the gate: both routes against an fp32 reference on the same prompts


def gate_prompts(tts) -> list[tuple[str, np.ndarray]]:
    """(name, (P, D) embeddings) of real prompts: two zero-shot lines and a clone of the bundled reference."""
    from ..parity import real_prompts

    return real_prompts(tts.backend, tts, tts.tokenizer, tts.tokens, tts.facts, GATE_TEXTS)


def _forced(decoder, route: bool):
    from ..runtime.route import ALWAYS, NEVER, forced

    return forced(decoder, ALWAYS if route else NEVER)


def prefill_hidden(decoder, embeds: np.ndarray, route: bool) -> np.ndarray:
    """(P, D) hidden states of one prefill through the int4 step graph or the route (a fresh cache)."""
    with _forced(decoder, route):
        return np.array(decoder.run(decoder.new_cache(len(embeds)), embeds))


def prefills(decoder, prompts: list[tuple[str, np.ndarray]], route: bool) -> list[np.ndarray]:
    """(P, D) hidden states of each prompt's prefill on one route of `decoder` (`prefill_hidden`)."""
    return [prefill_hidden(decoder, embeds, route) for _, embeds in prompts]


def judge(reference, prompts: list[tuple[str, np.ndarray]], hidden: dict[str, list[np.ndarray]]) -> dict:
    """The gate's verdict on prefill hidden states already computed (`hidden`: {"int4": [...], "int8": [...]}, one
    array per prompt) against `reference` (a `ReferenceModel`, fp32): per prompt and worst over them, 1 - cosine of
    the hidden states and of the logits (the reference's exact head for all three), and the top-1 agreement of the
    codes with the reference's. `ok`: the route no further from fp32 than the int4 route (x `ALLOWANCE`)."""
    import torch

    from ..parity import cosine

    rows, worst = [], {}
    for i, (name, embeds) in enumerate(prompts):
        want = reference.hidden_states(embeds)
        want_logits = reference.audio_head(torch.from_numpy(want), exact=True).numpy()
        row = {"prompt": name, "positions": len(embeds)}
        for label in ("int4", "int8"):
            got = hidden[label][i]
            logits = reference.audio_head(torch.from_numpy(got), exact=True).numpy()
            row[label] = {"hidden_distance": 1.0 - cosine(want, got), "logit_distance": 1.0 - cosine(want_logits,
                                                                                                     logits),
                          "top1": float((want_logits.argmax(-1) == logits.argmax(-1)).mean())}
        rows.append(row)
    for label in ("int4", "int8"):
        worst[label] = {k: max(r[label][k] for r in rows) for k in ("hidden_distance", "logit_distance")}
        worst[label]["top1"] = min(r[label]["top1"] for r in rows)
    failed = [f"{k} {worst['int8'][k]:.3e} > int4's {worst['int4'][k]:.3e}"
              + (f" x {ALLOWANCE}" if ALLOWANCE != 1.0 else "")
              for k in ("hidden_distance", "logit_distance") if not worst["int8"][k] <= ALLOWANCE * worst["int4"][k]]
    return {"prompts": rows, "worst": worst, "allowance": ALLOWANCE, "failed": failed, "ok": not failed}


def gate(tts, reference, prompts: list[tuple[str, np.ndarray]] | None = None) -> dict:
    """`judge` on a model loaded with its route (both sessions: eval), on `prompts` (default: `gate_prompts`). The
    build runs the same steps one session at a time (`export.Exporter.route`)."""
    decoder = tts.backend.decoder
    if getattr(decoder, "route", None) is None:
        raise ValueError("the model was loaded without its int8 route")
    prompts = prompts if prompts is not None else gate_prompts(tts)
    return judge(reference, prompts, {"int4": prefills(decoder, prompts, False),
                                      "int8": prefills(decoder, prompts, True)})


def alone(folder: Path):
    """The route's session alone, as a `BoundDecoder` whose every call runs on it (the int4 step graph not loaded):
    the build gates and times each route with one decoder's weights in memory at a time."""
    from .. import providers
    from ..runtime.decoder import BoundDecoder
    from ..runtime.parts import ModelParts

    parts = ModelParts(folder, verify=False)
    p = providers.get(parts.provider)
    return BoundDecoder(parts.part(NAME), parts.facts, p.memory, p.offset_binding)


def summary(g: dict) -> str:
    w = g["worst"]
    if not w:
        return "not measured"
    return (f"1 - cosine vs fp32: hidden {w['int8']['hidden_distance']:.2e} (int4 {w['int4']['hidden_distance']:.2e}), "
            f"logits {w['int8']['logit_distance']:.2e} (int4 {w['int4']['logit_distance']:.2e}); top-1 codes "
            f"{w['int8']['top1']:.1%} (int4 {w['int4']['top1']:.1%})")


# ---------------------------------------------------------------------------------------------------------------
# the crossover: both routes timed on this machine


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def time_prefill(decoder, embeds: np.ndarray, route: bool, repeats: int = 3) -> float:
    """Best seconds of a one-row call of len(embeds) positions into a fresh cache, on either route."""
    with _forced(decoder, route):
        cache = decoder.new_cache(len(embeds))

        def once():
            cache.truncate(0)
            decoder.run(cache, embeds)

        once()  # warm-up
        return _best(once, repeats)


def time_batch(decoder, rows: int, route: bool, context: int = 16, repeats: int = 3) -> float:
    """Best seconds of one batched decode step of `rows` rows (step graph: codes in), each at `context` positions."""
    f = decoder.facts
    codes = np.random.default_rng(0).integers(0, f.codebook_size, (rows, f.num_codebooks))
    with _forced(decoder, route):
        pool = decoder.pool(rows, context + 2)
        slots = [pool.acquire(context + 2) for _ in range(rows)]
        try:
            def once():
                for s in slots:  # positions as written (their values do not change the cost), one step past them
                    pool.lengths[s.index] = context
                pool.step_batch(slots, codes)

            once()  # warm-up
            return _best(once, repeats)
        finally:
            for s in slots:
                s.free()


def time_size(decoder, kind: str, size: int, route: bool, repeats: int, rng: np.random.Generator) -> float:
    """Best seconds of one call of a ladder's `kind`: a one-row prefill of `size` positions ("prefill") or a batched
    step of `size` rows ("batch")."""
    if kind == "prefill":
        embeds = (rng.standard_normal((size, decoder.facts.hidden)) * 0.05).astype(np.float32)
        return time_prefill(decoder, embeds, route, repeats)
    return time_batch(decoder, size, route, repeats=repeats)


def crossover(times: dict[int, tuple[float, float]]) -> int | None:
    """{size: (int4 s, route s)} -> the smallest size from which the route is faster at every larger size, or None."""
    best = None
    for size in sorted(times, reverse=True):
        int4, route = times[size]
        if route >= int4:
            break
        best = size
    return best


def time_ladders(decoder, route: bool, repeats: int = 3, against: dict | None = None) -> dict[str, dict[int, float]]:
    """{kind: {size: best seconds}} of one route of `decoder`: one-row prefills along `PREFILL_LADDER`, batched
    steps along `BATCH_LADDER`. Alone (`against` None: the first route timed), every size of both ladders, whatever
    the clock says (a climb cut by a time budget on a busy machine once stopped int4's prefills at 4 positions, where
    the route never wins, and recorded "one-row calls never" for the 4b); `against` (the other route's times): the
    sizes timed there, each climb stopping once this route has won at two sizes in a row (past the crossover the
    route's lead only grows). The 4b's int4 ladders take about 16 s quiet on 2 cores."""
    rng = np.random.default_rng(0)
    out = {}
    for kind, ladder in (("prefill", PREFILL_LADDER), ("batch", BATCH_LADDER)):
        times, wins = {}, 0
        for size in ladder if against is None else sorted(against[kind]):
            times[size] = time_size(decoder, kind, size, route, repeats, rng)
            if against is not None:
                wins = wins + 1 if times[size] < against[kind][size] else 0
                if wins >= 2:
                    break
        out[kind] = times
    return out


def time_again(decoder, route: bool, times: dict[str, dict[int, float]],
               repeats: int = 3) -> dict[str, dict[int, float]]:
    """`times` ({kind: {size: s}}, one route's `time_ladders`) with each size timed once more on `decoder` and the
    better of the two kept. The build times one session at a time (int4's ladders, then the route's): a machine
    busy during one phase alone would otherwise move the crossover (a build beside other work measured int4's
    batched step of 2 rows at 165 ms, 65 ms on the same machine quiet, and gave the route every batch). The route's
    sizes get the same second pass, in its own session: the 4b's route once read 315 ms for a batched step of 16
    rows (136 ms at 8), which alone made the rule record "batched steps never"."""
    rng = np.random.default_rng(0)
    return {kind: {size: min(first, time_size(decoder, kind, size, route, repeats, rng))
                   for size, first in sizes.items()} for kind, sizes in times.items()}


def timings(int4: dict, route: dict) -> dict:
    """Both routes' `time_ladders` -> {kind: {"crossover", "ms": {size: [int4, route]}}} over the sizes both timed."""
    out = {}
    for kind in int4:  # the crossover from the figures as recorded: a reader of the manifest gets the same one
        ms = {size: (round(int4[kind][size] * 1e3, 3), round(route[kind][size] * 1e3, 3)) for size in route[kind]}
        out[kind] = {"crossover": crossover(ms), "ms": {str(k): list(v) for k, v in ms.items()}}
    return out


def measure(decoder, repeats: int = 3) -> dict:
    """Both routes of `decoder` (loaded with its route) on this machine: int4 first along the ladders, then the
    route on the same sizes (`time_ladders`). Returns the timings (ms) and the crossovers (`timings`)."""
    int4 = time_ladders(decoder, False, repeats)
    return timings(int4, time_ladders(decoder, True, repeats, against=int4))
