"""eval.py's report: an export against the PyTorch reference, part by part and step by step.

The same generation loop runs on the ONNX backend and on the PyTorch backend, so every difference is numerics.
Layout: `options` (what to run, where to write), `sections` / `generation` (measure: each returns figures),
`gates` (the one place that judges figures), `report` (JSON, Markdown), `plots` (PNGs), `runner` (ties them up).
"""

from .gates import GATES, NEAR_TIE_REL, Check, apply_gates, judge_divergence
from .options import DEFAULT_PROMPTS, RECORDINGS, EvalOptions, Outputs, parse_thresholds, read_prompts
from .report import Report, to_json, to_markdown
from .runner import SECTIONS, Evaluator, evaluate, load_models, write_reports

__all__ = ["DEFAULT_PROMPTS", "GATES", "NEAR_TIE_REL", "RECORDINGS", "SECTIONS", "Check", "EvalOptions", "Evaluator",
           "Outputs", "Report", "apply_gates", "evaluate", "judge_divergence", "load_models", "parse_thresholds",
           "read_prompts", "to_json", "to_markdown", "write_reports"]
