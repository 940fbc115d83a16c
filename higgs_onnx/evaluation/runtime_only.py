"""eval.py --runtime-only: the export against itself, with no PyTorch and no checkpoint ("does it run right here?").

Every check compares ONNX with ONNX on this machine: each part loads on the provider with the I/O of its manifest;
the same seed twice gives the same codes; a stream gives the one-shot's codes and, through either codec, its audio;
requests batched on a scheduler give their codes alone; the one-call step graph gives the parts' codes; the int8
route stays as close to int4 as the build's own measurements allow; the guard judges every take. The sections that
need the reference are in the report, skipped by name. Figures only here; `gates.py` judges them.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import numpy as np

from ..generation.options import GenerationOptions
from ..generation.pipeline import stop_rules
from ..generation.sampling import GREEDY
from ..parity import snr_db
from .context import EvalContext, run_sections
from .gates import apply_gates, gates_for
from .options import EvalOptions
from .report import Report

SEED = 0  # the seed of every sampled take (request i of the batching section: SEED + i)
NEEDS_REFERENCE = "needs the PyTorch reference (--runtime-only)"
BATCH_SLOTS = 2  # fewer slots than requests: one joins when another leaves


class RuntimeContext(EvalContext):
    """An `EvalContext` without the reference: the export, the options and gates, and every take it made (for the
    guard's summary and the speed figures)."""

    def __init__(self, tts, options: EvalOptions | None = None):
        self.tts, self.ref, self.options = tts, None, options or EvalOptions()
        self.precision = tts.manifest.precision
        self.gates = gates_for(self.precision, self.options.gates, runtime_only=True)
        self.rules = stop_rules(tts.facts)
        self.takes: list = []  # every Speech (or the last chunk of a stream) the sections made, in order
        self._once: dict[str, object] = {}

    def options_for(self, seed: int | None = SEED, greedy: bool = False) -> GenerationOptions:
        return GenerationOptions.make(sampling=GREEDY if greedy else None, seed=seed, max_rows=self.options.max_rows)

    def take(self, text: str):
        """The one-shot take of `text` at `SEED`, made once (determinism's first run; streaming compares with it)."""
        if text not in self._once:
            self._once[text] = self.keep(self.tts.generate(text, options=self.options_for()))
        return self._once[text]

    def keep(self, speech):
        self.takes.append(speech)
        return speech

    def meta(self) -> dict:
        o, m = self.options, self.tts.manifest.data
        return {"model_path": str(self.tts.manifest.folder), "precision": self.precision, "device": m["device"],
                "provider": self.tts.provider, "checkpoint": None, "runtime_only": True, "gates": self.gates,
                "prompts": list(o.prompts), "max_rows": o.max_rows, "seed": SEED, "route": self.route(),
                "seconds": {}}


def route_off(tts):
    """The decoder with every call on int4 for the block (a context manager; nothing to force without a route)."""
    from contextlib import nullcontext

    from ..runtime.route import NEVER, forced

    dec = tts.backend.decoder
    return forced(dec, NEVER) if getattr(dec, "route", None) is not None else nullcontext()


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first row where two takes' rows differ (the shorter one's length when one only stops earlier)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero((a[:n] != b[:n]).any(axis=1))
    return int(diff[0]) if diff.size else (None if len(a) == len(b) else n)


def load(ev: RuntimeContext) -> dict:
    """Each part of the manifest opened on the provider (`ModelParts.part`: its inputs and outputs checked against
    the manifest and the model facts): {part: ok, ran_on, inputs, outputs} or {ok: False, error}."""
    rows = {}
    for name in ev.tts.manifest.parts:
        try:
            part = ev.tts.part(name)
            rows[name] = {"ok": True, "ran_on": ev.tts.ran_on().get(name, "-"), "inputs": list(part.input_types),
                          "outputs": list(part.output_names)}
        except Exception as e:  # one part that does not load is a failed row; the others still load
            rows[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return rows


def determinism(ev: RuntimeContext) -> dict:
    """Every prompt generated twice at the same seed: identical codes (and waveform) expected."""
    out = []
    for text in ev.options.prompts:
        a = ev.take(text)
        b = ev.keep(ev.tts.generate(text, options=ev.options_for()))
        out.append({"prompt": text, "rows": len(a.rows), "stop": a.stop_reason,
                    "codes_equal": bool(np.array_equal(a.rows, b.rows)),
                    "waveform_equal": bool(np.array_equal(a.waveform, b.waveform))})
    return {"seed": SEED, "prompts": out}


def streaming(ev: RuntimeContext) -> dict:
    """The first prompt streamed (`tts.stream`, default chunks) through each codec the export has, against its
    one-shot take at the same seed: codes, and the audio's SNR against the one-shot decode of the same codes."""
    from ..generation.codec_stream import StreamOptions

    text = ev.options.prompts[0]
    want = ev.take(text)
    peak = max(float(np.abs(want.waveform).max()), 1e-9) if want.waveform.size else 1.0
    codecs = {}
    for kind in ("stateful", "window") if ev.tts.has_stateful_codec else ("window",):
        chunks = list(ev.tts.stream(text, options=ev.options_for(), stream_options=StreamOptions(codec=kind)))
        last = chunks[-1]
        ev.keep(last)
        got = np.concatenate([c.samples for c in chunks])
        same = got.shape == want.waveform.shape
        codecs[kind] = {"codes_equal": bool(np.array_equal(last.rows, want.rows)), "chunks": len(chunks),
                        "snr_db": snr_db(want.waveform, got) if same else float("-inf"),
                        "max_abs_rel": float(np.abs(got - want.waveform).max() / peak) if same and got.size else None,
                        "first_audio_s": last.stats.first_audio_s, "samples": [int(got.size), int(want.waveform.size)]}
    return {"prompt": text, "seed": SEED, "codecs": codecs}


def batching(ev: RuntimeContext) -> dict:
    """Every prompt (request i at seed SEED + i) on one scheduler of `BATCH_SLOTS` slots, prompts prefilled whole as
    alone, against each request generated alone; the int8 route off for both (its rows round apart from int4's)."""
    from ..generation.scheduler import PrefillPolicy

    tts, texts = ev.tts, list(ev.options.prompts)
    if len(texts) < 2:
        texts.append(texts[0])  # two requests at least, to share a decoder call
    positions = tts.slot_positions
    opts = [ev.options_for(SEED + i) for i in range(len(texts))]
    with route_off(tts):
        alone = [ev.keep(tts.generate(t, options=o)) for t, o in zip(texts, opts, strict=True)]
        with tts.scheduler(BATCH_SLOTS, positions, PrefillPolicy(chunk=positions)) as sched:
            handles = [sched.submit(tts.request(t, options=o, slot=positions), "speech")
                       for t, o in zip(texts, opts, strict=True)]
            sched.run_until_idle()
            batched = [ev.keep(h.wait()) for h in handles]
    rows = [{"prompt": t, "seed": o.seed, "rows": [len(a.rows), len(b.rows)],
             "first_difference": first_difference(a.rows, b.rows)}
            for t, o, a, b in zip(texts, opts, alone, batched, strict=True)]
    firsts = [r["first_difference"] for r in rows if r["first_difference"] is not None]
    return {"slots": BATCH_SLOTS, "widest": max(h.widest for h in handles), "requests": rows,
            "identical": sum(r["first_difference"] is None for r in rows) / len(rows),
            "first_difference": min(firsts) if firsts else None}


def step_graph(ev: RuntimeContext) -> dict:
    """The one-call step graph against the decoder, embedding and heads apart (a second load of the same folder,
    the other way), the int8 route off on both: the first prompt greedy and at `SEED`."""
    from ..runtime.model import HiggsTTS

    tts = ev.tts
    other = HiggsTTS(tts.manifest.folder, provider=tts.provider, verify=False, kv_cache=tts.kv_cache,
                     step_graph=not tts.step_graph, route="off")
    text, runs = ev.options.prompts[0], []
    with route_off(tts):
        for label, greedy in (("greedy", True), (f"seed {SEED}", False)):
            a, b = (ev.keep(m.generate(text, options=ev.options_for(greedy=greedy))) for m in (tts, other))
            n = min(len(a.rows), len(b.rows))
            equal = float((a.rows[:n] == b.rows[:n]).mean()) * n / max(len(a.rows), len(b.rows), 1)
            runs.append({"run": label, "rows": [len(a.rows), len(b.rows)], "equal": equal,
                         "first_difference": first_difference(a.rows, b.rows)})
    names = {True: "llm_step", False: "llm_decoder"}
    return {"prompt": text, "this": names[tts.step_graph], "other": names[other.step_graph], "runs": runs}


def int8_route(ev: RuntimeContext) -> dict:
    """Both decoder routes on the build's gate prompts (`parts/llm_route.gate_prompts`): the angle between their
    prefill hidden states, bounded by the sum of each route's angle to the fp32 reference that the build measured on
    the same prompts (the manifest's route gate); then the first prompt's greedy rows with its prefill on either
    route (the steps on int4 both times), as in the full report's route section."""
    from ..generation.engine import generate
    from ..parity import cosine
    from ..parts import llm_route
    from ..runtime.model import HiggsTTS
    from ..runtime.route import NEVER, RoutePolicy, forced

    tts = ev.tts
    if getattr(tts.backend.decoder, "route", None) is None:  # not loaded under this CPU's policy: load it
        tts = HiggsTTS(ev.tts.manifest.folder, provider=ev.tts.provider, verify=False, route="on")
    dec = tts.backend.decoder
    built = {p["prompt"]: p for p in ev.tts.manifest.decoder.get("route", {}).get("gate", {}).get("prompts", [])}
    prompts = []
    for name, embeds in llm_route.gate_prompts(tts):
        a, b = (llm_route.prefill_hidden(dec, embeds, route) for route in (False, True))
        row = {"prompt": name, "positions": len(embeds), "angle": angle(cosine(a, b)), "bound": None}
        if name in built:  # angle(int4, int8) <= angle(int4, fp32) + angle(int8, fp32)
            row["bound"] = sum(angle(1.0 - built[name][k]["hidden_distance"]) for k in ("int4", "int8"))
        prompts.append(row)
    options = ev.options_for(greedy=True)
    rows = {}
    for label, policy in (("int4", NEVER), ("int8", RoutePolicy(prefill=2))):
        with forced(dec, policy):
            rows[label] = generate(tts.backend, ev.prompt(ev.options.prompts[0]), ev.rules, options,
                                   tts.facts.placeholder).rows
    a, b = rows["int4"], rows["int8"]
    n = min(len(a), len(b))
    return {"prompts": prompts, "greedy_rows": [len(a), len(b)],
            "greedy_equal": float((a[:n] == b[:n]).all(axis=1).mean()) if n else 1.0,
            "greedy_first_difference": first_difference(a, b)}


def angle(cos: float) -> float:
    return float(np.arccos(np.clip(cos, -1.0, 1.0)))


def takes(ev: RuntimeContext) -> dict:
    """The guard's verdict on every take the other sections made, and the speed figures (not gated): rows/s over
    the decoder loop, the real-time factor, the streams' first-audio time."""
    verdicts = [t.verdict.name for t in ev.takes if getattr(t, "verdict", None) is not None]
    stats = [t.stats for t in ev.takes if t.stats is not None]
    rows, busy = sum(s.rows for s in stats), sum(s.prefill_s + s.decode_s for s in stats)
    first = [s.first_audio_s for s in stats if s.chunks > 1]
    return {"takes": len(verdicts), "good": verdicts.count("good"),
            "clean": verdicts.count("good") / len(verdicts) if verdicts else 1.0,
            "verdicts": {v: verdicts.count(v) for v in sorted(set(verdicts))},
            "rows_per_s": rows / max(busy, 1e-9), "rtf": float(np.mean([s.rtf for s in stats])) if stats else None,
            "first_audio_s": min(first) if first else None}


def _has(part: str, what: str) -> Callable:
    return lambda ev: None if part in ev.tts.manifest.parts else f"the export has no {what}"


def _teacher_codes(ev: RuntimeContext) -> dict:
    from .sections import teacher_codes

    return teacher_codes(ev)


@dataclasses.dataclass(frozen=True)
class RuntimeSection:
    run: Callable[[RuntimeContext], dict]
    needs: tuple[str, ...] = ()  # parts it runs through: skipped when one failed to load
    needless: Callable[[RuntimeContext], str | None] = lambda ev: None


GENERATION = ("text_embed", "audio_embed", "audio_heads", "audio_tokenizer")  # + the decoder (see `_needs`)
RUNTIME_SECTIONS: dict[str, RuntimeSection] = {
    "load": RuntimeSection(load),
    "determinism": RuntimeSection(determinism, GENERATION),
    "streaming": RuntimeSection(streaming, GENERATION),
    "batching": RuntimeSection(batching, GENERATION),
    "step_graph": RuntimeSection(step_graph, (*GENERATION, "llm_step", "llm_decoder"), _has("llm_step", "step graph")),
    "int8_route": RuntimeSection(int8_route, (*GENERATION, "llm_route", "audio_encoder"),
                                 _has("llm_route", "int8 route")),
    "takes": RuntimeSection(takes),
}


class RuntimeEvaluator(RuntimeContext):
    """Runs `RUNTIME_SECTIONS` (a section through a part that did not load is skipped, naming it), then lists the
    full report's sections: `teacher_codes` runs when asked (it needs no reference), the others are skipped."""

    def skip_reason(self, name: str, section: RuntimeSection, report: Report) -> str | None:
        needless = section.needless(self)
        if needless:
            return f"nothing to compare ({needless})"
        loaded = report.sections.get("load", {})
        decoder = "llm_step" if self.tts.step_graph and "llm_step" in self.tts.manifest.parts else "llm_decoder"
        broken = [p for p in (*section.needs, decoder) if isinstance(loaded.get(p), dict) and not loaded[p]["ok"]]
        if broken:
            return f"part {', '.join(dict.fromkeys(broken))} did not load"
        return None

    def run(self, progress: Callable[[str], None] | None = None) -> Report:
        from .runner import SECTIONS

        say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
        report = Report(meta=self.meta())
        sections = dict(RUNTIME_SECTIONS)
        if self.options.teacher_codes:
            sections["teacher_codes"] = RuntimeSection(_teacher_codes, GENERATION)
        run_sections(self, sections, lambda name, section: self.skip_reason(name, section, report), report, say)
        for name in SECTIONS:  # the full report's: each needs the reference, but for teacher codes not asked
            if name not in report.sections:
                unasked = SECTIONS[name].unasked(self.options) if name == "teacher_codes" else None
                report.add(name, {"skipped": f"not asked ({unasked})" if unasked else NEEDS_REFERENCE})
        report.checks = apply_gates(report.sections, self.gates)
        report.meta["ran_on"] = self.ran_on()
        return report


def evaluate_runtime(model_path, options: EvalOptions | None = None, outputs=None, verify: bool = True,
                     provider: str | None = None, kv_cache: str = "bound", step_graph: bool = True,
                     route: str | None = None) -> tuple[Report, str]:
    """Load the export on the route the arguments pick (`HiggsTTS`'s of those names), check the prompts against
    the request contract, run the runtime-only sections, write the reports; (report, Markdown text)."""
    from ..runtime.model import HiggsTTS
    from .options import Outputs
    from .runner import check_prompts, write_reports

    outputs = outputs or Outputs()
    outputs.check()
    options = options or EvalOptions()
    tts = HiggsTTS(model_path, provider=provider, verify=verify, kv_cache=kv_cache, step_graph=step_graph,
                   route=route)
    check_prompts(tts, options)
    report = RuntimeEvaluator(tts, options).run()
    return report, write_reports(report, outputs)
