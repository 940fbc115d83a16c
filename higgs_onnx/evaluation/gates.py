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


def gates_for(precision: str, overrides: tuple[tuple[str, float | None], ...] = ()) -> dict[str, float | None]:
    if precision not in GATES:
        raise ValueError(f"no eval gates for precision {precision!r}; known: {', '.join(GATES)}")
    return {**GATES[precision], **dict(overrides)}


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


GATED: dict[str, Callable[[dict, dict], list[Check]]] = {
    "parts": _parts, "decoder_steps": _decoder_steps, "teacher_forced": _teacher_forced, "greedy": _greedy,
    "sampled": _sampled, "kv_cache": _kv_cache, "route": _route}


def apply_gates(sections: dict[str, dict], gates: dict[str, float | None]) -> list[Check]:
    """Every check of every section that ran; a section that broke is a failed check of its own."""
    checks = []
    for name, fig in sections.items():
        if isinstance(fig.get("error"), str):  # the runner's mark of a section that raised
            checks.append(Check(name, "ran", False, f"{name} broke: {fig['error']}"))
        elif "skipped" not in fig and name in GATED:
            checks += GATED[name](fig, gates)
    return checks
