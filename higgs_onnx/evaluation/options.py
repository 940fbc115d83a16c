"""What an evaluation runs (`EvalOptions`) and where its reports go (`Outputs`): the one place for eval's defaults."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .gates import GATE_NAMES

DEFAULT_PROMPTS = ("Hello there, how are you today?",
                   "<|emotion:elation|>The quick brown fox jumps over the lazy dog.",
                   "Speech synthesis turns written words into sound, one frame at a time.")
# Two real recordings shipped with the package: odd lengths, and one at 22.05 kHz stereo, so the encoder section
# also covers resampling and down-mixing (sample-identical FLAC copies of tests/data/*.wav).
RECORDINGS_DIR = Path(__file__).resolve().parent.parent / "assets" / "recordings"
RECORDINGS = tuple(sorted(RECORDINGS_DIR.glob("*.flac")))


@dataclass(frozen=True)
class EvalOptions:
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    runs: int = 2  # sampled runs per prompt (seeds 0..runs-1)
    max_rows: int = 600  # row limit of every generation run (24 s of audio)
    decode_steps: int = 8  # single-row decode steps after the prefill in the decoder-steps section
    text_tokens: int = 16  # greedy text continuation of the text-LM section
    recordings: tuple[Path, ...] = RECORDINGS  # audio files for the encoder section
    teacher_codes: Path | None = None  # (L, N) delayed rows .npy from another implementation
    tolerance: float = 1.0  # logit tolerance for `teacher_codes`
    gates: tuple[tuple[str, float | None], ...] = ()  # overrides of GATES[precision], e.g. (("eoc_rate", 0.9),)
    window: int = 16  # greedy rows kept on each side of the first divergence (for the rows plot)

    def __post_init__(self) -> None:
        if not self.prompts or not all(p.strip() for p in self.prompts):
            raise ValueError("eval needs at least one non-empty prompt")
        for name in ("max_rows", "decode_steps", "text_tokens", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.runs < 0:
            raise ValueError(f"--runs must be >= 0, got {self.runs}")
        if not self.recordings:
            raise ValueError("the encoder section needs at least one recording")
        for path in (*self.recordings, *([self.teacher_codes] if self.teacher_codes else [])):
            if not Path(path).is_file():
                raise FileNotFoundError(f"{path} does not exist or is not a file")
        if not (self.tolerance == self.tolerance and 0 < self.tolerance < float("inf")):  # NaN fails the first test
            raise ValueError(f"--tolerance must be a finite number > 0, got {self.tolerance}")
        for key, _ in self.gates:
            if key not in GATE_NAMES:
                raise ValueError(f"unknown gate {key!r}; gates: {', '.join(GATE_NAMES)}")


def parse_thresholds(items: list[str]) -> tuple[tuple[str, float | None], ...]:
    """["teacher_top1=0.9", "greedy_near_tie=none"] -> gate overrides (`none` switches a gate off)."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in GATE_NAMES:
            raise ValueError(f"--threshold expects GATE=VALUE with GATE in {', '.join(GATE_NAMES)}, got {item!r}")
        try:
            out.append((key, None if value.lower() == "none" else float(value)))
        except ValueError:
            raise ValueError(f"--threshold {key}: {value!r} is not a number (or 'none')") from None
    return tuple(out)


def read_prompts(path: Path) -> tuple[str, ...]:
    """One prompt per non-empty line of a UTF-8 text file."""
    from ..longform.files import read_text_file

    if Path(path).is_dir():
        raise IsADirectoryError(f"--prompts {path} is a folder, not a text file")
    try:
        text = read_text_file(path)  # encodings, BOMs, binary files: the long-form reader's one-line answers
    except ValueError as e:
        raise ValueError(f"--prompts: {str(e).removeprefix('--text-file ')}") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"--prompts {path} does not exist") from None
    prompts = tuple(ln.strip() for ln in text.splitlines() if ln.strip())
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


@dataclass(frozen=True)
class Outputs:
    """Report files; `plots` is a folder of PNGs that the Markdown report embeds."""

    json: Path | None = None
    markdown: Path | None = None
    plots: Path | None = None

    @classmethod
    def resolve(cls, json: Path | None, markdown: Path | None, plots: Path | None, draw: bool = True) -> Outputs:
        """Plots default to `<markdown stem>_plots/` beside the Markdown file; `draw=False` switches them off."""
        if draw and plots is None and markdown is not None:
            plots = markdown.with_name(f"{markdown.stem}_plots")
        return cls(json, markdown, plots if draw else None)

    def check(self) -> None:
        """Refuse before the (long) evaluation: each report file's folder must exist and be writable (probed by
        writing, not `os.access`), a report file must not be a folder, and the plots folder, where it exists
        already, must be a writable folder (else its parent must be one: `write_plots` makes it)."""
        from ..outputs import check_output_dir, check_output_file, probe_writable

        for flag, path, example in (("--json", self.json, "report.json"), ("--markdown", self.markdown, "report.md")):
            if path is not None:
                check_output_file(path, flag, example=example)
        if self.plots is not None:
            plots = Path(self.plots)
            if plots.exists():
                check_output_dir(plots, "--plots", create=False)
            elif plots.parent.exists() and not plots.parent.is_dir():
                raise NotADirectoryError(f"--plots {plots}: {plots.parent} is a file, not a folder")
            elif not plots.parent.is_dir():
                raise FileNotFoundError(f"--plots {plots}: folder {plots.parent} does not exist")
            else:
                probe_writable(plots.parent, f"--plots {plots}")
            require_matplotlib()


def require_matplotlib() -> None:
    """The plots need matplotlib (checked before the evaluation; `plots` draws with it): MissingExtra names the
    extra that has it."""
    from ..extras import require

    require("eval", "the plots (or pass --no-plots)", ("matplotlib",))
