"""Parity and quality report of an export against the PyTorch reference; exits 1 when a gate fails.

Usage:
    python eval.py --model-path onnx/cpu_int4                    # reference = the checkpoint in the manifest
    python eval.py --model-path onnx/cpu_int4 --checkpoint DIR --json report.json --markdown report.md
    python eval.py --model-path onnx/cpu_int4 --prompts prompts.txt --runs 8
    python eval.py --model-path onnx/cpu_int4 --teacher-codes rows.npy   # code rows from another implementation
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from higgs_onnx.cli import add_log_level, run_main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", type=Path, required=True)
    ap.add_argument("--checkpoint", help="reference checkpoint folder or repo id (default: the manifest's source)")
    ap.add_argument("--prompts", type=Path, help="text file, one prompt per line (default: 3 built-in prompts)")
    ap.add_argument("--runs", type=int, default=2, help="sampled runs per prompt (default %(default)s)")
    ap.add_argument("--max-frames", type=int, default=600, help="row limit per run (default %(default)s)")
    ap.add_argument("--teacher-codes", type=Path, help="delayed code rows (L, 8) .npy to teacher-force")
    ap.add_argument("--tolerance", type=float, default=1.0, help="logit tolerance for --teacher-codes")
    ap.add_argument("--threshold", nargs="+", default=[], metavar="GATE=VALUE",
                    help="override gates: teacher_top1, teacher_cosine, greedy_identical, eoc_rate")
    ap.add_argument("--json", type=Path, help="write the report as JSON")
    ap.add_argument("--markdown", type=Path, help="write the report as Markdown")
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the model files")
    add_log_level(ap)
    return ap


def run(args: argparse.Namespace) -> int:
    from higgs_onnx.checkpoint import resolve
    from higgs_onnx.evaluate import DEFAULT_PROMPTS, GATES, Evaluator, to_json, to_markdown
    from higgs_onnx.reference.model import ReferenceModel, parity_dtype
    from higgs_onnx.runtime.model import HiggsTTS

    gates = {}
    for item in args.threshold:
        key, sep, value = item.partition("=")
        if not sep or key not in GATES["fp32"]:
            raise ValueError(f"--threshold expects GATE=VALUE with GATE in {', '.join(GATES['fp32'])}, got {item!r}")
        gates[key] = float(value)
    if args.runs < 0:
        raise ValueError("--runs must be >= 0")
    prompts = DEFAULT_PROMPTS
    if args.prompts:
        prompts = [ln.strip() for ln in args.prompts.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if not prompts:
            raise ValueError(f"{args.prompts} has no prompts")
    tts = HiggsTTS(args.model_path, verify=not args.no_verify)
    source = args.checkpoint or tts.manifest.data["source"]["path"]
    if not args.checkpoint and not Path(source).is_dir():
        source = tts.manifest.data["source"]["repo_id"] or source
    ref = ReferenceModel(resolve(source), dtype=parity_dtype(tts.facts))
    if ref.facts != tts.facts:
        raise ValueError(f"checkpoint {source} does not match the export (different dims or ids)")
    report = Evaluator(tts, ref, prompts, runs=args.runs, max_frames=args.max_frames, gates=gates).run(
        args.teacher_codes, args.tolerance)
    md = to_markdown(report)
    print("\n" + md)
    if args.json:
        args.json.write_text(to_json(report))
    if args.markdown:
        args.markdown.write_text(md)
    if report.failures:
        print(f"FAILED: {len(report.failures)} gate(s); first: {report.failures[0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
