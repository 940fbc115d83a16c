"""`EvalContext`: what every section of the report reads: the export (`tts`), the PyTorch reference (`ref`), the
options and gates, and the greedy runs several sections share (made once per prompt).

Sections (`sections`, `generation`) take an `EvalContext`; `runner.Evaluator` is one that also runs the sections.
This module imports no section, so the sections and the runner never import each other in a circle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..generation.engine import GenerationResult, generate
from ..generation.options import GenerationOptions
from ..generation.pipeline import stop_rules
from ..generation.prompt import build_prompt
from ..generation.sampling import GREEDY, SamplingOptions
from .gates import gates_for
from .options import EvalOptions


class EvalContext:
    """The export, the reference and the options every section reads, plus the greedy runs several sections share."""

    def __init__(self, tts, ref, options: EvalOptions | None = None):
        from ..reference.model import ReferenceBackend

        self.tts, self.ref, self.options = tts, ref, options or EvalOptions()
        self.precision = tts.manifest.precision
        self.gates = gates_for(self.precision, self.options.gates)
        self.ref_backend = ReferenceBackend(ref)
        self.rules = stop_rules(tts.facts)
        self._greedy: dict[str, dict[str, GenerationResult]] = {}

    def prompt(self, text: str) -> list[int]:
        return build_prompt(self.tts.tokenizer, self.tts.tokens, text)

    def generate(self, backend: str, text: str, sampling: SamplingOptions, seed: int, keep_logits: bool = False,
                 teacher: np.ndarray | None = None) -> GenerationResult:
        """One run of the shared loop on "onnx" or "torch"; `teacher` (L, N) rows are fed instead of the picks."""
        be = self.tts.backend if backend == "onnx" else self.ref_backend
        options = GenerationOptions.make(sampling=sampling, seed=seed, max_rows=self.options.max_rows)
        return generate(be, self.prompt(text), self.rules, options, self.tts.facts.placeholder,
                        keep_logits=keep_logits, teacher_rows=teacher)

    def run_both(self, text: str, sampling: SamplingOptions, seed: int, keep_logits: bool = False) -> dict:
        return {b: self.generate(b, text, sampling, seed, keep_logits) for b in ("onnx", "torch")}

    def greedy_runs(self, text: str) -> dict[str, GenerationResult]:
        """Greedy runs of both backends with their logits, made once per prompt (greedy, teacher-forced, speed, audio
        read them)."""
        if text not in self._greedy:
            self._greedy[text] = self.run_both(text, GREEDY, 0, keep_logits=True)
        return self._greedy[text]

    def meta(self) -> dict:
        o, m = self.options, self.tts.manifest.data
        hub = self.tts.source  # an export fetched from the Hub: where, at which commit
        return {"model_path": str(self.tts.manifest.folder), **({"source": str(hub)} if hub else {}),
                "precision": self.precision, "device": m["device"],
                "provider": self.tts.provider,
                "checkpoint": str(self.ref.folder), "gates": self.gates, "prompts": list(o.prompts), "runs": o.runs,
                "max_rows": o.max_rows, "recordings": [Path(p).name for p in o.recordings], "route": self.route(),
                "seconds": {}}

    def route(self) -> dict:
        """How the export's decoder runs here: the part that holds its weights (`llm_step`, the one-call step graph,
        or `llm_decoder` with the embedding and heads apart) and where its KV cache lives (`backend.kv_memory`:
        "cpu"/"cuda"/"dml" bound buffers, "state" inside OpenVINO's compiled model, "host" arrays fed back)."""
        be = self.tts.backend
        return {"decoder": be.decoder_part, "kv_cache": be.kv_memory, "int8_route": be.route_part is not None,
                "asked": {"kv_cache": self.tts.kv_cache, "step_graph": self.tts.step_graph, "route": self.tts.route}}

    def ran_on(self) -> dict[str, str]:
        """part -> the provider/device its session ran on (each checked at load: no silent fallback)."""
        return self.tts.ran_on()


def run_sections(ctx, sections: dict, skip: Callable[[str, object], str | None], report,
                 say: Callable[[str], None]) -> None:
    """Each of `sections` ({name: section with `run(ctx)`}) in order into `report`: skipped with `skip(name,
    section)`'s reason, else run; a section that raises is reported broken and the others still run; its seconds
    are kept in the report's meta."""
    log = logging.getLogger(__name__)
    for name, section in sections.items():
        reason = skip(name, section)
        if reason:
            say(f"skipping {name}: {reason}")
            report.add(name, {"skipped": reason})
            continue
        say(f"evaluating {name} ...")
        t0 = time.perf_counter()
        try:
            figures = section.run(ctx)
        except Exception as e:  # noqa: BLE001 - a section that breaks is reported as such; the others still run
            log.debug("section %s failed", name, exc_info=True)
            figures = {"error": f"{type(e).__name__}: {e}"}
        report.add(name, figures)
        report.meta["seconds"][name] = round(time.perf_counter() - t0, 2)
