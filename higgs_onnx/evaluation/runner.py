"""The evaluation run: each section of `SECTIONS` measures, `apply_gates` judges, the writers write.

A section that raises is reported as broken and the others still run; a section that needs a part which failed its
parity check is skipped with that part's name (generation through a broken part only repeats its error). Gate
failures never skip anything. The reports are written whatever failed.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..generation.options import GenerationOptions
from ..outputs import write_atomic
from . import generation, sections
from .context import EvalContext, run_sections
from .gates import apply_gates
from .options import EvalOptions, Outputs
from .report import Report, to_json, to_markdown

log = logging.getLogger(__name__)


class Evaluator(EvalContext):
    """An `EvalContext` that runs the sections of `SECTIONS`, skipping those the options leave out or that would
    run through a part that failed its parity check."""

    def skip_reason(self, name: str, report: Report) -> str | None:
        section = SECTIONS[name]
        unasked = section.unasked(self.options)
        if unasked:
            return f"not asked ({unasked})"
        needless = section.needless(self)
        if needless:
            return f"nothing to compare ({needless})"
        parts = report.sections.get("parts", {})
        broken = [p for p in section.needs if isinstance(parts.get(p), dict) and not parts[p].get("ok", True)]
        if broken:
            return (f"part {', '.join(broken)} failed its parity check; running through it would only repeat "
                    f"that error")
        return None

    def run(self, progress: Callable[[str], None] | None = None) -> Report:
        say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
        report = Report(meta=self.meta())
        run_sections(self, SECTIONS, lambda name, _: self.skip_reason(name, report), report, say)
        report.checks = apply_gates(report.sections, self.gates)
        report.meta["ran_on"] = self.ran_on()
        return report


def _not_asked_sampled(o: EvalOptions) -> str | None:
    return None if o.runs else "--runs 0"


def _fp32_cache(ev) -> str | None:
    return None if ev.tts.manifest.kv_cache == "int8" else "the KV cache is fp32"


def _no_route(ev) -> str | None:
    return None if "llm_route" in ev.tts.manifest.parts else "the export has no int8 route"


def _not_asked_teacher_codes(o: EvalOptions) -> str | None:
    return None if o.teacher_codes else "no --teacher-codes file"


@dataclass(frozen=True)
class Section:
    run: Callable[[EvalContext], dict]  # -> figures (keys starting with "_" hold arrays kept out of the JSON)
    needs: tuple[str, ...] = ()  # exported parts it runs through
    unasked: Callable[[EvalOptions], str | None] = lambda options: None  # why the options leave it out
    needless: Callable[[EvalContext], str | None] = lambda ev: None  # why the export has nothing for it to do


GENERATION = ("llm_decoder", "text_embed", "audio_embed", "audio_heads")
SECTIONS: dict[str, Section] = {
    "parts": Section(sections.parts),
    "decoder_steps": Section(sections.decoder_steps, ("llm_decoder",)),
    "encoder": Section(sections.encoder, ("audio_encoder",)),
    "greedy": Section(generation.greedy, GENERATION),
    "teacher_forced": Section(generation.teacher_forced, GENERATION),
    "speed": Section(generation.speed, GENERATION),
    "audio": Section(generation.audio, (*GENERATION, "audio_tokenizer")),
    "sampled": Section(generation.sampled, GENERATION, _not_asked_sampled),
    "text_lm": Section(sections.text_lm, ("llm_decoder", "text_embed")),
    "teacher_codes": Section(sections.teacher_codes, GENERATION, _not_asked_teacher_codes),
    "intelligibility": Section(sections.intelligibility, (*GENERATION, "audio_tokenizer")),
    "quality": Section(sections.quality, (*GENERATION, "audio_tokenizer")),
    "kv_cache": Section(sections.kv_cache, GENERATION, needless=_fp32_cache),
    "route": Section(sections.route, GENERATION, needless=_no_route),
}


def load_models(model_path: Path, checkpoint: str | None, verify: bool = True, provider: str | None = None,
                options: EvalOptions | None = None, kv_cache: str = "bound", step_graph: bool = True,
                route: str | None = None):
    """(HiggsTTS, ReferenceModel): the export on the route `provider` / `kv_cache` / `step_graph` pick (HiggsTTS's
    arguments of those names) and its reference (default: the checkpoint its manifest names). The prompts of
    `options` are checked against the request contract first, before the reference loads."""
    from ..checkpoint import resolve
    from ..foreign import comparable
    from ..reference.model import ReferenceModel, parity_dtype
    from ..runtime.model import HiggsTTS

    tts = HiggsTTS(model_path, provider=provider, verify=verify, kv_cache=kv_cache, step_graph=step_graph,
                   route=route)
    check_prompts(tts, options or EvalOptions())
    source = checkpoint or manifest_checkpoint(tts.manifest)
    ref = ReferenceModel(resolve(source), dtype=parity_dtype(tts.facts))
    if comparable(ref.facts, tts.manifest) != comparable(tts.facts, tts.manifest):
        raise ValueError(f"checkpoint {source} does not match the export (different dims or ids)")
    return tts, ref


def checkpoint_candidates(path: str, folder: Path, cwd: Path | None = None) -> list[Path]:
    """Where the checkpoint of a manifest's `source.path` may be: the path itself when absolute (new manifests);
    an older, relative one is relative to the folder optimize.py ran in, which is unknown: the current folder, the
    export folder, and the export folder's parents (`--output onnx` puts exports in `onnx/<name>/`, so a build run
    in the project folder has it two levels up) are tried in that order."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return [p]
    cwd = Path.cwd() if cwd is None else cwd
    folder = Path(os.path.abspath(folder))
    bases = [cwd, folder, folder.parent, folder.parent.parent]
    return list(dict.fromkeys(Path(os.path.normpath(b / p)) for b in bases))


def manifest_checkpoint(manifest) -> str:
    """The reference checkpoint an export was built from: its folder (see `checkpoint_candidates`) if it is still
    there, else its Hub repo id; a clear error naming both (and --checkpoint) when neither is available."""
    src = manifest.source
    path, repo = src.get("path"), src.get("repo_id")
    tried = checkpoint_candidates(path, manifest.folder) if isinstance(path, str) and path else []
    for cand in tried:
        if Path(path).is_absolute() and cand.is_dir():
            return str(cand)
        if (cand / "config.json").is_file():  # a relative guess must look like a checkpoint
            log.info("checkpoint %s of an older manifest (a relative path) found at %s", path, cand)
            return str(cand)
    if isinstance(repo, str) and repo:
        return repo
    where = ", ".join(map(str, tried)) or "none recorded"
    raise FileNotFoundError(f"the checkpoint {manifest.folder} was built from is not found (looked in {where}); "
                            f"pass it with --checkpoint DIR, or check the export without it: --runtime-only")


def _write(path: Path, text: str) -> None:
    """Whole file or nothing (`outputs.write_atomic`)."""
    write_atomic(path, text)


def write_reports(report: Report, outputs: Outputs) -> str:
    """JSON, then the plots, then the Markdown that embeds them (links relative to the Markdown file); returns the
    Markdown."""
    if outputs.json:
        _write(outputs.json, to_json(report))
    links = {}
    if outputs.plots:
        from .plots import write_plots

        base = outputs.markdown.parent if outputs.markdown else Path.cwd()
        links = {k: Path(os.path.relpath(v, base)).as_posix() for k, v in write_plots(report, outputs.plots).items()}
    md = to_markdown(report, links)
    if outputs.markdown:
        _write(outputs.markdown, md)
    return md


def check_prompts(tts, options: EvalOptions) -> None:
    """Every input that can be judged before the reference loads: each prompt through the contract (special tokens,
    prompt + --max-rows within the context; a ContractError naming the prompt), the recordings readable, the teacher
    codes well-formed."""
    from ..audio import read_audio
    from ..generation.contract import ContractError
    from ..generation.delay import read_code_rows

    for path in options.recordings:
        read_audio(path)
    if options.teacher_codes is not None:
        f = tts.facts
        read_code_rows(options.teacher_codes, f.num_codebooks, f.codebook_vocab, "--teacher-codes")

    for i, text in enumerate(options.prompts, 1):
        try:
            tts.request(text, options=GenerationOptions(max_rows=options.max_rows))
        except ContractError as e:
            raise ContractError(f"prompt {i} ({text[:40]!r}): {e}", e.param, e.code, e.status) from None


def evaluate(model_path: Path, checkpoint: str | None = None, options: EvalOptions | None = None,
             outputs: Outputs | None = None, verify: bool = True, provider: str | None = None,
             kv_cache: str = "bound", step_graph: bool = True, route: str | None = None) -> tuple[Report, str]:
    """Load (on the route `provider` / `kv_cache` / `step_graph` pick, see `load_models`), run every section, write
    the reports; (report, Markdown text)."""
    outputs = outputs or Outputs()
    outputs.check()
    tts, ref = load_models(model_path, checkpoint, verify, provider, options, kv_cache, step_graph, route)
    report = Evaluator(tts, ref, options).run()
    return report, write_reports(report, outputs)
