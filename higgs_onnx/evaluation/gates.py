"""The one place that judges eval's figures: `apply_gates(sections, gates)` -> a `Check` per gate.

Sections only measure; the thresholds live here (`GATES`, per export precision, overridable with `--threshold`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..parity import FP32_REL_ATOL

# A greedy divergence is judged by the reference's top-1/top-2 logit margin m at the first differing row, in the
# first differing codebook, against tolerance = NEAR_TIE_REL x max|logit| of that codebook's reference logits there:
# m <= tolerance is a near-tie (numerics: pass), a wider margin means the export computes something else (fail).
# Why 2 x FP32_REL_ATOL (2e-4): the fp32 part gate accepts each output being off by FP32_REL_ATOL x its scale; two
# logits moving in opposite directions by that much flip a pair closer than twice it, so such a flip needs no error
# the part gate would reject, and a wider one does. Measured (tiny and a 96-wide 3-layer checkpoint, fp32, 120-250
# teacher-forced rows): ONNX logits differ from the reference by <= 4.7e-6 x max|logit| per row and codebook, 40x
# below. int4's first divergences on the tiny preset: margins 5.5e-5 .. 0.1 x max|logit| (not gated at int4; a bug
# small enough to pass here fails the teacher-forced gates, which compare every row).
NEAR_TIE_REL = 2 * FP32_REL_ATOL

# Gates per export precision. teacher_top1 / teacher_cosine: teacher-forced top-1 agreement of the audio codes and
# logit cosine (worst prompt). greedy_near_tie: the relative tolerance above; None = a divergence is reported but
# not gated (fp16/int4 logits move by more than any tie: their quality is the teacher-forced gates' job).
# eoc_rate: share of sampled runs that must stop with EOC before --max-frames.
GATES: dict[str, dict[str, float | None]] = {
    "fp32": {"teacher_top1": 0.999, "teacher_cosine": 0.99999, "greedy_near_tie": NEAR_TIE_REL, "eoc_rate": 0.5},
    "fp16": {"teacher_top1": 0.95, "teacher_cosine": 0.999, "greedy_near_tie": None, "eoc_rate": 0.5},
    "int4": {"teacher_top1": 0.5, "teacher_cosine": 0.95, "greedy_near_tie": None, "eoc_rate": 0.5},
}


# The runtime-only report's gates (eval.py --runtime-only: the export against itself, no reference). Every figure is
# ONNX against ONNX on this machine. stream_snr_db: streamed audio vs the one-shot decode of the same codes, either
# codec (measured: stateful 102 dB tiny / 83.4 dB 4b, windows inf tiny / 85.3 dB 4b; a broken stream is < 31 dB).
# batch_identical / batch_first_difference: the requests whose rows batched equal their rows alone, and the row a
# request may first differ at (fp32: every row, exact; int4/fp16: the batched kernels round by the batch, a greedy
# near-tie may flip late; rows that mixed differ from the first rows, tests/test_batching.py). step_graph_equal:
# share of codes equal between the step graph and the parts apart (exact at every precision: the same kernels).
# route_slack: the int8 route's distance from int4 within this factor of the build's triangle bound (see
# `_int8_route`). clean_takes: the guard's share of good takes among all the report made.
RUNTIME_GATES: dict[str, dict[str, float | None]] = {
    p: {"stream_snr_db": 60.0, "batch_identical": 1.0 if p == "fp32" else 0.5,
        "batch_first_difference": float("inf") if p == "fp32" else 30.0, "step_graph_equal": 1.0,
        "route_slack": 1.25, "clean_takes": 0.5} for p in GATES}
GATE_NAMES = (*GATES["fp32"], *RUNTIME_GATES["fp32"])  # what --threshold may name


def gates_for(precision: str, overrides: tuple[tuple[str, float | None], ...] = (),
              runtime_only: bool = False) -> dict[str, float | None]:
    """The gates of an export's precision (`runtime_only`: those of the report without the reference), with the
    --threshold `overrides` (each of the other table's names is accepted and unused)."""
    table = RUNTIME_GATES if runtime_only else GATES
    if precision not in table:
        raise ValueError(f"no eval gates for precision {precision!r}; known: {', '.join(table)}")
    return {**table[precision], **{k: v for k, v in overrides if k in table[precision]}}


@dataclass(frozen=True)
class Check:
    section: str
    gate: str
    ok: bool
    detail: str  # one line: what was measured against what
    value: float | None = None
    limit: float | None = None


def judge_divergence(fig: dict, rel: float | None) -> tuple[float | None, str]:
    """(tolerance, verdict) of one prompt's greedy figures; `rel` None uses NEAR_TIE_REL (reported, not gated)."""
    if fig["first_divergence"] is None:
        return None, "identical"
    if fig.get("margin") is None:  # same rows, different lengths: one backend stopped where the other did not
        return None, "lengths differ"
    tolerance = (NEAR_TIE_REL if rel is None else rel) * fig["logit_scale"]
    return tolerance, "near-tie divergence" if fig["margin"] <= tolerance else "wide-margin divergence"


def _parts(figs: dict, gates: dict) -> list[Check]:
    from ..parity import summary

    out = []
    for part, fig in figs.items():
        what = f"error: {fig['error']}" if "error" in fig else summary(fig)
        ok = bool(fig.get("ok", True))
        out.append(Check("parts", f"part {part}", ok, f"part {part} ({fig['precision']}): {what}"
                         + ("" if ok else " — fails its parity check")))
    return out


def _decoder_steps(fig: dict, gates: dict) -> list[Check]:
    worst = min(s["cosine"] for s in fig["per_step"])
    limit = fig.get("limit_max_abs", fig.get("min_cosine"))
    return [Check("decoder_steps", "hidden states", bool(fig["ok"]),
                  f"decoder steps: max abs {fig['max_abs']:.3g}, worst step cosine {worst:.6f} (limit {limit:.3g})",
                  fig["max_abs"] if "limit_max_abs" in fig else fig["cosine"], limit)]


def _teacher_forced(fig: dict, gates: dict) -> list[Check]:
    out = []
    for key, gate, what in (("top1", "teacher_top1", "top-1 agreement"),
                            ("logit_cosine", "teacher_cosine", "logit cosine")):
        worst = min(p[key] for p in fig["prompts"])
        limit = gates[gate]
        if limit is not None:
            out.append(Check("teacher_forced", gate, worst >= limit,
                             f"teacher-forced {what} {worst:.6g} (worst prompt) vs >= {limit}", worst, limit))
    return out


def _greedy(fig: dict, gates: dict) -> list[Check]:
    rel = gates["greedy_near_tie"]
    out = []
    for p in fig["prompts"]:
        tolerance, verdict = judge_divergence(p, rel)
        if rel is None:
            continue
        ok = verdict in ("identical", "near-tie divergence")
        where = "" if p["first_divergence"] is None else f" at row {p['first_divergence']}"
        margin = "" if p.get("margin") is None else f": margin {p['margin']:.3g} vs tolerance {tolerance:.3g}"
        out.append(Check("greedy", "greedy_near_tie", ok, f"greedy '{p['prompt'][:40]}': {verdict}{where}{margin}"
                         + ("" if ok else " (a bug, not numerics)"), p.get("margin"), tolerance))
    return out


def _sampled(fig: dict, gates: dict) -> list[Check]:
    limit = gates["eoc_rate"]
    if limit is None:
        return []
    n = len(fig["runs"])
    return [Check("sampled", "eoc_rate", fig["eoc_rate"] >= limit,
                  f"sampled runs: {round(fig['eoc_rate'] * n)}/{n} stopped cleanly (EOC), need >= {limit:.0%}",
                  fig["eoc_rate"], limit)]


def _kv_cache(fig: dict, gates: dict) -> list[Check]:
    """The int8 cache against the fp32 cache on the same weights: the build's thresholds (`parts/kv_cache.GATES`)."""
    return [Check("kv_cache", name, fig[name] >= limit,
                  f"int8 KV cache vs fp32 cache: {name.replace('_', ' ')} {fig[name]:.5f}, need >= {limit}",
                  fig[name], limit) for name, limit in fig["thresholds"].items()]


def _route(fig: dict, gates: dict) -> list[Check]:
    """The int8 route no further from the reference than the int4 route (the build's gate, `parts/llm_route.py`)."""
    w, allow = fig["gate"]["worst"], fig["gate"]["allowance"]
    return [Check("route", name, w["int8"][name] <= allow * w["int4"][name],
                  f"int8 route vs int4 route, 1 - cosine of the {name.split('_')[0]} against the reference: "
                  f"{w['int8'][name]:.3e} vs {w['int4'][name]:.3e}", w["int8"][name], allow * w["int4"][name])
            for name in ("hidden_distance", "logit_distance")]


# -- the runtime-only report (evaluation/runtime_only.py): the export against itself ------------------------------


def _load(figs: dict, gates: dict) -> list[Check]:
    return [Check("load", f"part {part}", bool(fig["ok"]), f"part {part} loads on {fig.get('ran_on', '-')}, its I/O "
                  f"as the manifest says" if fig["ok"] else f"part {part} does not load: {fig['error']}")
            for part, fig in figs.items()]


def _determinism(fig: dict, gates: dict) -> list[Check]:
    return [Check("determinism", "same seed, same codes", p["codes_equal"],
                  f"'{p['prompt'][:40]}' seed {fig['seed']} twice: {p['rows']} rows, codes "
                  + ("identical" if p["codes_equal"] else "DIFFER")) for p in fig["prompts"]]


def _streaming(fig: dict, gates: dict) -> list[Check]:
    out, limit = [], gates["stream_snr_db"]
    for kind, c in fig["codecs"].items():
        out.append(Check("streaming", f"{kind}: codes", c["codes_equal"], f"stream ({kind} codec) vs one-shot, seed "
                         f"{fig['seed']}: codes " + ("identical" if c["codes_equal"] else "DIFFER")))
        if limit is not None:
            out.append(Check("streaming", "stream_snr_db", c["snr_db"] >= limit, f"stream ({kind} codec) vs the "
                             f"one-shot decode: SNR {c['snr_db']:.1f} dB, need >= {limit:g}", c["snr_db"], limit))
    return out


def _batching(fig: dict, gates: dict) -> list[Check]:
    n = len(fig["requests"])
    out = [Check("batching", "batched", fig["widest"] >= 2, f"{n} requests on {fig['slots']} slots: widest batch "
                 f"{fig['widest']} (need >= 2)", fig["widest"], 2)]
    share, limit = fig["identical"], gates["batch_identical"]
    if limit is not None:
        out.append(Check("batching", "batch_identical", share >= limit, f"batched vs alone: {round(share * n)}/{n} "
                         f"requests with identical rows, need >= {limit:.0%}", share, limit))
    first, limit = fig["first_difference"], gates["batch_first_difference"]
    if limit is not None:
        worst = float("inf") if first is None else first
        out.append(Check("batching", "batch_first_difference", worst >= limit, f"batched vs alone: first differing "
                         f"row {first if first is not None else 'none'}, need "
                         + ("none" if limit == float("inf") else f">= {limit:g}"), worst, limit))
    return out


def _step_graph(fig: dict, gates: dict) -> list[Check]:
    limit = gates["step_graph_equal"]
    if limit is None:
        return []
    return [Check("step_graph", "step_graph_equal", r["equal"] >= limit, f"step graph vs the parts apart, {r['run']}: "
                  f"{r['equal']:.1%} of codes equal (rows {r['rows'][0]} / {r['rows'][1]}), need >= {limit:.0%}",
                  r["equal"], limit) for r in fig["runs"]]


def _int8_route(fig: dict, gates: dict) -> list[Check]:
    """The angle between the two routes' prefill hidden states is at most the sum of each route's angle to fp32 that
    the build measured on the same prompts (a triangle inequality), times `route_slack` for another CPU's rounding."""
    slack = gates["route_slack"]
    if slack is None:
        return []
    return [Check("int8_route", "route_slack", p["angle"] <= slack * p["bound"], f"int8 vs int4 route, "
                  f"'{p['prompt']}' prefill: angle {p['angle']:.3e} rad, bound {p['bound']:.3e} x {slack:g}",
                  p["angle"], slack * p["bound"]) for p in fig["prompts"] if p.get("bound") is not None]


def _takes(fig: dict, gates: dict) -> list[Check]:
    limit = gates["clean_takes"]
    if limit is None or not fig["takes"]:
        return []
    return [Check("takes", "clean_takes", fig["clean"] >= limit, f"the guard's verdicts: {fig['good']}/{fig['takes']} "
                  f"takes good, need >= {limit:.0%}", fig["clean"], limit)]


GATED: dict[str, Callable[[dict, dict], list[Check]]] = {
    "parts": _parts, "decoder_steps": _decoder_steps, "teacher_forced": _teacher_forced, "greedy": _greedy,
    "sampled": _sampled, "kv_cache": _kv_cache, "route": _route,
    "load": _load, "determinism": _determinism, "streaming": _streaming, "batching": _batching,
    "step_graph": _step_graph, "int8_route": _int8_route, "takes": _takes}


def apply_gates(sections: dict[str, dict], gates: dict[str, float | None]) -> list[Check]:
    """Every check of every section that ran; a section that broke is a failed check of its own."""
    checks = []
    for name, fig in sections.items():
        if isinstance(fig.get("error"), str):  # the runner's mark of a section that raised
            checks.append(Check(name, "ran", False, f"{name} broke: {fig['error']}"))
        elif "skipped" not in fig and name in GATED:
            checks += GATED[name](fig, gates)
    return checks
