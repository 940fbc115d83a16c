"""Parity and quality report of an export against the PyTorch reference; exits 1 when a part or gate fails.

Usage:
    python eval.py --model-path onnx/cpu_int4                    # reference = the checkpoint in the manifest
    python eval.py --model-path onnx/cpu_int4 --checkpoint DIR --json report.json --markdown report.md
                                                                 # + PNGs in report_plots/, embedded in report.md
    python eval.py --model-path onnx/cpu_int4 --prompts prompts.txt --runs 8 --plots figs/
    python eval.py --model-path onnx/cpu_int4 --teacher-codes rows.npy   # code rows from another implementation
    python eval.py --model-path onnx/cpu_fp32 --threshold greedy_near_tie=none eoc_rate=0.9
    python eval.py --model-path onnx/openvino_int4 --provider openvino --kv-cache host   # another runtime route
    python eval.py --model-path hf://ORG/REPO/cpu_int4 --runtime-only   # no PyTorch, no checkpoint: does it run here?

Both reports are written whatever failed; the exit code says pass (0) or fail (1). The report targets are checked
before anything is loaded. eval.py runs from any folder: the manifest records the checkpoint's absolute path (older
manifests' relative ones are looked up from here, from the export folder and from its parents).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from higgs_onnx.cli import add_log_level, run_main
from higgs_onnx.evaluation.options import EvalOptions
from higgs_onnx.hub import cli_model_path, model_path_arg
from higgs_onnx.providers import PROVIDERS
from higgs_onnx.runtime.backend import KV_LAYOUTS


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", type=model_path_arg, required=True, help="an export folder, or a Hub reference "
                    "hf://ORG/REPO/FOLDER[@REVISION] (docs/hub.md)")
    ap.add_argument("--checkpoint", help="reference checkpoint folder or repo id (default: the manifest's source)")
    ap.add_argument("--prompts", type=Path, help="text file, one prompt per line (default: 3 built-in prompts)")
    ap.add_argument("--runs", type=int, default=EvalOptions.runs, help="sampled runs per prompt (default %(default)s)")
    ap.add_argument("--max-rows", "--max-frames", dest="max_rows", type=int, default=EvalOptions.max_rows,
                    help="row limit per run (default %(default)s)")
    ap.add_argument("--recordings", type=Path, nargs="+", metavar="FILE",
                    help="audio files for the encoder section (default: the two shipped with the package)")
    ap.add_argument("--teacher-codes", type=Path, help="delayed code rows (L, 8) .npy to teacher-force")
    ap.add_argument("--tolerance", type=float, default=EvalOptions.tolerance,
                    help="logit tolerance for --teacher-codes (default %(default)s)")
    ap.add_argument("--threshold", nargs="+", default=[], metavar="GATE=VALUE",
                    help="override gates (VALUE 'none' switches one off): teacher_top1, teacher_cosine, "
                         "greedy_near_tie, eoc_rate; with --runtime-only: stream_snr_db, batch_identical, "
                         "batch_first_difference, step_graph_equal, route_slack, clean_takes")
    ap.add_argument("--json", type=Path, help="write the report as JSON")
    ap.add_argument("--markdown", type=Path, help="write the report as Markdown")
    ap.add_argument("--plots", type=Path, metavar="DIR",
                    help="write PNG plots here (default with --markdown: <markdown stem>_plots/ beside it)")
    ap.add_argument("--no-plots", action="store_true", help="draw no plots")
    ap.add_argument("--provider", choices=PROVIDERS, help="execution provider (default: the one the folder was "
                    "built for; see README, Devices)")
    ap.add_argument("--kv-cache", choices=KV_LAYOUTS, default="bound",
                    help="where the decoder keeps its KV cache: bound (default: the export's own layout; OpenVINO "
                         "state on --provider openvino) or host (NumPy arrays fed back every step)")
    ap.add_argument("--parts-apart", action="store_true",
                    help="drive the decoder, audio embedding and heads as three sessions even where the export has "
                         "the one-call step graph")
    ap.add_argument("--route", choices=("auto", "off", "on"), help="the int8 prefill route where the export has one: "
                    "auto (its measured crossover), off (the int4 graph for every call) or on (every call of two or "
                    "more rows); default: $HIGGS_ROUTE, else auto (docs/building.md, the int8 prefill route)")
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the model files")
    ap.add_argument("--runtime-only", action="store_true",
                    help="check the export against itself, without PyTorch or the checkpoint: parts load, "
                         "determinism, stream vs one-shot, batched vs alone, step graph vs parts, int8 route vs "
                         "int4, the guard (docs/evaluation.md, Without PyTorch)")
    add_log_level(ap)
    return ap


# flags only the sections with the PyTorch reference read: refused with --runtime-only
REFERENCE_FLAGS = (("checkpoint", "--checkpoint"), ("recordings", "--recordings"), ("plots", "--plots"))


def check_runtime_only(args: argparse.Namespace) -> None:
    """--runtime-only runs no reference: a flag for the reference's sections is refused in one line; otherwise
    the reference's packages must be installed, and their absence points at --runtime-only."""
    from higgs_onnx.extras import MissingExtra, require

    if args.runtime_only:
        given = [flag for name, flag in REFERENCE_FLAGS if getattr(args, name)]
        if given:
            raise ValueError(f"--runtime-only checks the export without the PyTorch reference: drop {given[0]} (or "
                             f"drop --runtime-only for the full report)")
        return
    try:
        require("eval", "the eval report (its PyTorch reference)", ("torch", "transformers", "safetensors"))
    except MissingExtra as e:
        e.args = (f"{e}; or check the export without it: eval.py --runtime-only",)
        raise


def run(args: argparse.Namespace) -> int:
    from higgs_onnx.evaluation import Outputs, evaluate, parse_thresholds, read_prompts

    check_runtime_only(args)
    outputs = Outputs.resolve(args.json, args.markdown, args.plots, draw=not (args.no_plots or args.runtime_only))
    outputs.check()  # every report target, before the (long) evaluation
    cli_model_path(args)  # hf://...: fetched once
    options = EvalOptions(prompts=read_prompts(args.prompts) if args.prompts else EvalOptions.prompts,
                          runs=args.runs, max_rows=args.max_rows,
                          recordings=tuple(args.recordings) if args.recordings else EvalOptions.recordings,
                          teacher_codes=args.teacher_codes, tolerance=args.tolerance,
                          gates=parse_thresholds(args.threshold))
    kw = {"verify": not args.no_verify, "provider": args.provider, "kv_cache": args.kv_cache,
          "step_graph": not args.parts_apart, "route": args.route}
    if args.runtime_only:
        from higgs_onnx.evaluation.runtime_only import evaluate_runtime

        report, md = evaluate_runtime(args.model_path, options, outputs, **kw)
    else:
        report, md = evaluate(args.model_path, args.checkpoint, options, outputs, **kw)
    print("\n" + md)
    if report.failures:
        print(f"FAILED: {len(report.failures)} check(s); first: {report.failures[0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
