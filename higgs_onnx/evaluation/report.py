"""The report: figures per section + the gate checks, written as JSON and as Markdown (plots in `plots.py`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from .gates import NEAR_TIE_REL, Check, judge_divergence


@dataclass
class Report:
    meta: dict
    sections: dict[str, dict] = field(default_factory=dict)  # figures, or {"skipped": why} / {"error": what}
    checks: list[Check] = field(default_factory=list)
    arrays: dict[str, dict[str, np.ndarray]] = field(default_factory=dict, repr=False)  # for plots, not the JSON

    def add(self, name: str, figures: dict) -> None:
        """Store a section's figures; keys starting with "_" (waveforms ...) go to `arrays`."""
        self.sections[name] = {k: v for k, v in figures.items() if not k.startswith("_")}
        self.arrays[name] = {k[1:]: v for k, v in figures.items() if k.startswith("_")}

    @property
    def failures(self) -> list[str]:
        return [c.detail for c in self.checks if not c.ok]

    @property
    def passed(self) -> bool:
        return not self.failures


def _plain(x):
    """JSON-safe: non-finite floats become "inf" / "-inf" / "nan" (strict JSON has no Infinity)."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else str(float(x))
    if isinstance(x, np.integer):
        return int(x)
    return x


def to_json(report: Report) -> str:
    return json.dumps(_plain({"meta": report.meta, "passed": report.passed, "failures": report.failures,
                              "checks": [asdict(c) for c in report.checks], "sections": report.sections}), indent=2)


# ---------------------------------------------------------------------------------------------------------------
# Markdown: one renderer per section (figures, report meta) -> lines


def _parts(s: dict, meta: dict) -> list[str]:
    from ..parity import summary

    lines = ["| part | precision | figure | ok |", "|---|---|---|---|"]
    for part, fig in s.items():
        figure = f"error: {fig['error']}" if "error" in fig else summary(fig)
        lines.append(f"| {part} | {fig['precision']} | {_cell(figure)} | {'yes' if fig.get('ok', True) else 'NO'} |")
    return lines


def _decoder_steps(s: dict, meta: dict) -> list[str]:
    steps = s["per_step"]
    lines = [f"Hidden states of the first prompt's prefill (step 0 = its last position) and {len(steps) - 1} "
             f"single-row decode steps vs one full reference forward: cosine min "
             f"{min(x['cosine'] for x in steps):.6f}, max abs {s['max_abs']:.3g}.", "",
             "| step | position | cosine | max abs |", "|---|---|---|---|"]
    return lines + [f"| {x['step']} | {x['position']} | {x['cosine']:.6f} | {x['max_abs']:.3g} |" for x in steps]


def _encoder(s: dict, meta: dict) -> list[str]:
    lines = [f"- `{name}` ({r['samples']} samples, {r['frames']} frames): {r['agreement'] * 100:.2f}% of codes equal"
             for name, r in s["recordings"].items()]
    if s.get("int8"):  # the build tried the int8 GEMM: which form it kept and each form's gate against fp32
        lines += ["", f"Encoder precision: {s['precision']}; int8 forms gated at build against the fp32 graph: "
                      f"{s['int8_summary']}.", "", "| form | recording | codes equal to fp32's (first codebook) | "
                      "with -60 dBFS noise (first) | gate |", "|---|---|---|---|---|"]
        for form, f in s["int8"]["forms"].items():
            lines += [f"| {form} | `{name}` | {r['mean']:.1%} ({r['first']:.1%}) | {r['dither_mean']:.1%} "
                      f"({r['dither_first']:.1%}) | {'passes' if f['ok'] else 'fails'} |"
                      for name, r in f["recordings"].items()]
    return lines


def _greedy(s: dict, meta: dict) -> list[str]:
    rel = meta["gates"]["greedy_near_tie"]
    lines = [f"Near-tie rule: a divergence whose reference top-1/top-2 margin is <= "
             f"{NEAR_TIE_REL if rel is None else rel:g} x "
             f"max|logit| (that row and codebook) is numerics; a wider one is a bug"
             + (" (reported, not gated at this precision)." if rel is None else "."), "",
             "| prompt | first divergence | margin | tolerance | verdict | rows ONNX / PyTorch | duration ratio |",
             "|---|---|---|---|---|---|---|"]
    for p in s["prompts"]:
        tolerance, verdict = judge_divergence(p, rel)
        where = ("none" if p["first_divergence"] is None else f"row {p['first_divergence']}"
                 + ("" if p["codebook"] is None else f", codebook {p['codebook']}"))
        lines.append(f"| {_cell(p['prompt'][:40])} | {where} | {_g(p.get('margin'))} | {_g(tolerance)} | {verdict} | "
                     f"{p['onnx_rows']} / {p['torch_rows']} | {p['duration_ratio']:.2f} |")
    return lines


def _teacher_forced(s: dict, meta: dict) -> list[str]:
    lines = ["| prompt | rows | top-1 | logit cos | logit max abs / scale | KL (T = 0.8) |",
             "|---|---|---|---|---|---|"]
    for p in s["prompts"]:
        lines.append(f"| {_cell(p['prompt'][:40])} | {p['rows']} | {p['top1']:.4f} | {p['logit_cosine']:.6f} | "
                     f"{p['logit_max_abs']:.3g} / {p['logit_scale']:.3g} | {p['kl']:.2e} |")
    return lines


def _speed(s: dict, meta: dict) -> list[str]:
    return [f"Greedy runs: ONNX {s['onnx']['rows_per_s']:.1f} rows/s (RTF {s['onnx']['rtf']:.2f}), PyTorch "
            f"{s['torch']['rows_per_s']:.1f} rows/s (RTF {s['torch']['rtf']:.2f})."]


def _audio(s: dict, meta: dict) -> list[str]:
    return [f"`{s['prompt'][:40]}`: ONNX {s['onnx_seconds']:.2f} s, PyTorch {s['torch_seconds']:.2f} s, log-spectral "
            f"distance {s['log_spectral_distance_db']:.3g} dB (each backend's codes through its own codec)."]


def _sampled(s: dict, meta: dict) -> list[str]:
    return [f"{len(s['runs'])} runs: clean EOC stops {s['eoc_rate'] * 100:.0f}% (PyTorch "
            f"{s['torch_eoc_rate'] * 100:.0f}%), mean duration ratio {s['mean_duration_ratio']:.2f}."]


def _text_lm(s: dict, meta: dict) -> list[str]:
    first = "never" if s["first_difference"] is None else f"token {s['first_difference']}"
    return [f"Next-token agreement {s['next_token_agreement'] * 100:.1f}% over {s['prompt_tokens']} prompt tokens; "
            f"greedy continuation of {s['continuation_tokens']} tokens first differs at {first}."]


def _teacher_codes(s: dict, meta: dict) -> list[str]:
    return [f"`{s['file']}`: {s['within_tolerance'] * 100:.1f}% of codes within {s['tolerance']} of the export's top "
            f"logit over {s['rows']} rows; rows outside: {s['rows_outside'][:10] or 'none'}."]


def _intelligibility(s: dict, meta: dict) -> list[str]:
    return [f"WER with faster-whisper `{s['asr_model']}`: ONNX {s['onnx_wer'] * 100:.1f}%, PyTorch "
            f"{s['torch_wer'] * 100:.1f}%."]


def _quality(s: dict, meta: dict) -> list[str]:
    lines = ["DNSMOS (1-5, from the audio alone: real speech scores ~3-3.5, noise and the tiny synthetic model ~1.1, "
             f"silence ~1.8): ONNX ovrl {s['onnx_ovrl']:.2f}, PyTorch {s['torch_ovrl']:.2f}.", "",
             "| prompt | ONNX sig / bak / ovrl | PyTorch sig / bak / ovrl |", "|---|---|---|"]
    for r in s["rows"]:
        a, b = r["onnx"], r["torch"]
        lines.append(f"| {_cell(r['prompt'][:40])} | {a['sig']:.2f} / {a['bak']:.2f} / {a['ovrl']:.2f} | "
                     f"{b['sig']:.2f} / {b['bak']:.2f} / {b['ovrl']:.2f} |")
    return lines


def _g(x) -> str:
    return "" if x is None else f"{x:.3g}"


def _cell(text: str) -> str:
    """Text for a Markdown table cell: a `|` (as in `<|emotion:...|>` tags) would end the cell."""
    return text.replace("|", "\\|")


def _kv_cache(s: dict, m: dict) -> list[str]:
    lines = [f"The int8 KV cache ({s.get('mode')}) against the same export with an fp32 cache (same weights), "
             "teacher-forced on the fp32 cache's greedy rows; then each decodes greedily on its own.", "",
             "| text | rows | hidden cosine | worst row | logit cosine | top-1 | greedy rows equal | first diff. |",
             "|---|---|---|---|---|---|---|---|"]
    for t in s["texts"]:
        first = "-" if t["greedy_first_difference"] is None else t["greedy_first_difference"]
        lines.append(f"| {_cell(t['text'][:40])} | {t['rows']} | {t['hidden_cosine']:.6f} | "
                     f"{t['min_row_hidden_cosine']:.6f} | {t['logit_cosine']:.6f} | {t['top1_agreement']:.1%} | "
                     f"{t['greedy_equal']:.1%} | {first} |")
    return lines


def _route(s: dict, m: dict) -> list[str]:
    lines = [f"Both decoder routes on the same prompts against the {s['reference']} reference: prefill hidden states "
             f"and the audio head's logits on them (1 - cosine; top-1 codes agreeing with the reference's). The "
             f"export's crossover: {s['crossover_words']}.", "",
             "| prompt | positions | hidden int4 | hidden int8 | logits int4 | logits int8 | top-1 int4 | top-1 int8 |",
             "|---|---|---|---|---|---|---|---|"]
    for p in s["gate"]["prompts"]:
        a, b = p["int4"], p["int8"]
        lines.append(f"| {p['prompt']} | {p['positions']} | {a['hidden_distance']:.2e} | {b['hidden_distance']:.2e} "
                     f"| {a['logit_distance']:.2e} | {b['logit_distance']:.2e} | {a['top1']:.1%} | {b['top1']:.1%} |")
    ms = s["clone_prefill_ms"]
    first = "-" if s["greedy_first_difference"] is None else s["greedy_first_difference"]
    lines += ["", f"A cloned voice's prefill ({s['clone_positions']} positions): {ms['int4']:.1f} ms on int4, "
              f"{ms['int8']:.1f} ms on the int8 route ({ms['int4'] / max(ms['int8'], 1e-9):.2f} x). Greedy rows with "
              f"the prompt prefilled on each route: {s['greedy_equal']:.1%} equal (first difference: {first})."]
    return lines


def _load(s: dict, m: dict) -> list[str]:
    lines = ["| part | ran on | inputs | outputs | ok |", "|---|---|---|---|---|"]
    for part, fig in s.items():
        if fig["ok"]:
            lines.append(f"| {part} | {fig['ran_on']} | {len(fig['inputs'])} | {len(fig['outputs'])} | yes |")
        else:
            lines.append(f"| {part} | - | {_cell(fig['error'][:160])} | | NO |")
    return lines


def _determinism(s: dict, m: dict) -> list[str]:
    lines = [f"Each prompt twice at seed {s['seed']}.", "", "| prompt | rows | stop | codes | waveform |",
             "|---|---|---|---|---|"]
    return lines + [f"| {_cell(p['prompt'][:40])} | {p['rows']} | {p['stop']} | "
                    f"{'identical' if p['codes_equal'] else 'DIFFER'} | "
                    f"{'identical' if p['waveform_equal'] else 'differs'} |" for p in s["prompts"]]


def _streaming(s: dict, m: dict) -> list[str]:
    lines = [f"`{s['prompt'][:40]}` at seed {s['seed']}, streamed against its one-shot take.", "",
             "| codec | chunks | codes | SNR vs one-shot | max abs / peak | first audio |", "|---|---|---|---|---|---|"]
    for kind, c in s["codecs"].items():
        rel = "-" if c["max_abs_rel"] is None else f"{c['max_abs_rel']:.2e}"
        lines.append(f"| {kind} | {c['chunks']} | {'identical' if c['codes_equal'] else 'DIFFER'} | "
                     f"{c['snr_db']:.1f} dB | {rel} | {c['first_audio_s'] * 1e3:.0f} ms |")
    return lines


def _batching(s: dict, m: dict) -> list[str]:
    lines = [f"{len(s['requests'])} requests on {s['slots']} slots (widest batch {s['widest']}), the int8 route off, "
             "against each alone.", "", "| prompt | seed | rows alone / batched | first difference |",
             "|---|---|---|---|"]
    return lines + [f"| {_cell(r['prompt'][:40])} | {r['seed']} | {r['rows'][0]} / {r['rows'][1]} | "
                    f"{'none' if r['first_difference'] is None else r['first_difference']} |" for r in s["requests"]]


def _step_graph(s: dict, m: dict) -> list[str]:
    lines = [f"`{s['prompt'][:40]}` on `{s['this']}` and on `{s['other']}` (a second load), the int8 route off.", "",
             "| run | rows | codes equal | first difference |", "|---|---|---|---|"]
    return lines + [f"| {r['run']} | {r['rows'][0]} / {r['rows'][1]} | {r['equal']:.1%} | "
                    f"{'none' if r['first_difference'] is None else r['first_difference']} |" for r in s["runs"]]


def _int8_route(s: dict, m: dict) -> list[str]:
    lines = ["The two routes' prefill hidden states: their angle, and the bound the build's measurements give (each "
             "route's angle to fp32 summed).", "", "| prompt | positions | angle (rad) | bound |", "|---|---|---|---|"]
    lines += [f"| {p['prompt']} | {p['positions']} | {p['angle']:.3e} | {_g(p['bound']) or '-'} |"
              for p in s["prompts"]]
    first = "-" if s["greedy_first_difference"] is None else s["greedy_first_difference"]
    return lines + ["", f"Greedy rows with the prompt prefilled on each route: {s['greedy_equal']:.1%} equal (rows "
                    f"{s['greedy_rows'][0]} / {s['greedy_rows'][1]}, first difference: {first})."]


def _takes(s: dict, m: dict) -> list[str]:
    verdicts = ", ".join(f"{k} {v}" for k, v in s["verdicts"].items()) or "none judged"
    first = "-" if s["first_audio_s"] is None else f"{s['first_audio_s'] * 1e3:.0f} ms"
    rtf = "-" if s["rtf"] is None else f"{s['rtf']:.3f}"
    return [f"{s['takes']} takes judged by the guard: {verdicts}. Decoder loop {s['rows_per_s']:.1f} rows/s, mean "
            f"RTF {rtf}, first audio of a stream {first} (figures, not gated)."]


RENDER: dict[str, tuple[str, Callable[[dict, dict], list[str]]]] = {
    "parts": ("Parts", _parts), "decoder_steps": ("Decoder steps", _decoder_steps),
    "encoder": ("Encoder on recordings", _encoder), "greedy": ("Greedy free-running", _greedy),
    "teacher_forced": ("Teacher-forced", _teacher_forced), "speed": ("Speed", _speed),
    "audio": ("Audio", _audio), "sampled": ("Sampled runs", _sampled),
    "text_lm": ("Text LM (tied text head)", _text_lm),
    "teacher_codes": ("Teacher codes", _teacher_codes), "intelligibility": ("Intelligibility", _intelligibility),
    "quality": ("Quality (DNSMOS)", _quality),
    "kv_cache": ("int8 KV cache", _kv_cache), "route": ("Decoder routes: int4 and the int8 GEMM", _route),
    "load": ("Parts load", _load), "determinism": ("Determinism", _determinism),
    "streaming": ("Streaming vs one-shot", _streaming), "batching": ("Batched vs alone", _batching),
    "step_graph": ("Step graph vs the parts apart", _step_graph), "int8_route": ("int8 route vs int4", _int8_route),
    "takes": ("Takes: the guard and speed", _takes),
}


def _section(name: str, figures: dict, meta: dict, plot: str | None) -> list[str]:
    title, render = RENDER.get(name, (name, lambda s, m: [f"`{json.dumps(_plain(s))[:500]}`"]))
    lines = ["", f"## {title}", ""]
    if "skipped" in figures:
        return lines + [f"Skipped: {figures['skipped']}."]
    if isinstance(figures.get("error"), str):
        return lines + [f"**Broke**: {figures['error']}"]
    lines += render(figures, meta)
    return lines + (["", f"![{title}]({plot})"] if plot else [])


ROUTE_DECODER = {"llm_step": "the step graph (`llm_step`: embedding, decoder and heads in one call)",
                 "llm_decoder": "the parts apart (`llm_decoder`, `audio_embed`, `audio_heads`)"}
ROUTE_CACHE = {"state": "the KV cache is OpenVINO state", "host": "the KV cache goes through the host (NumPy arrays)"}


def _decoder_route(route: dict | None) -> str:
    """One sentence: how the decoder ran (eval's `--kv-cache` / `--parts-apart` and the export pick it)."""
    if not route:
        return ""
    cache = ROUTE_CACHE.get(route["kv_cache"], f"the KV cache is bound in `{route['kv_cache']}` buffers")
    return f"Route: {ROUTE_DECODER.get(route['decoder'], route['decoder'])}; {cache}."


def to_markdown(report: Report, plots: dict[str, str] | None = None) -> str:
    """`plots`: section name -> link to its PNG (relative to where the Markdown is read)."""
    m, plots = report.meta, plots or {}
    failed = len(report.failures)
    title, ref = (("Runtime report", "Reference: none (`--runtime-only`: the export against itself, here).")
                  if m.get("runtime_only") else ("Parity report", f"Reference: `{m['checkpoint']}` (PyTorch)."))
    lines = [f"# {title}: `{m['model_path']}` ({m['precision']})", "",
             f"{ref} Result: **{'PASS' if report.passed else 'FAIL'}** "
             f"({len(report.checks) - failed} of {len(report.checks)} checks passed).", "",
             f"Provider: `{m.get('provider', m.get('device', '-'))}`; the parts ran on "
             f"{', '.join(sorted(set(m.get('ran_on', {}).values()))) or '-'}. {_decoder_route(m.get('route'))}", "",
             "| section | check | ok |", "|---|---|---|"]
    lines += [f"| {c.section} | {_cell(c.detail)} | {'yes' if c.ok else 'NO'} |" for c in report.checks]
    for name, figures in report.sections.items():
        lines += _section(name, figures, m, plots.get(name))
    if report.failures:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in report.failures]
    if m.get("seconds"):
        lines += ["", "Seconds per section: " + ", ".join(f"{k} {v:.1f}" for k, v in m["seconds"].items()) + "."]
    return "\n".join(lines) + "\n"
