"""Export Higgs Audio v3 TTS to a self-contained ONNX folder `onnx/<device>_<precision>/` with a manifest.

Usage:
    python optimize.py --device cpu --precision int4                  # downloads bosonai/higgs-tts-3-4b
    python optimize.py --model-dir path/to/checkpoint --device cuda --precision fp16
    python optimize.py --synthetic tiny --device cpu --precision int4  # embedded default, no download
    python optimize.py ... --components llm_decoder audio_heads       # rebuild a subset
    python optimize.py ... --part-precision audio_heads=fp16          # keep a part at higher precision
    python optimize.py --synthetic tiny --device openvino --precision int4   # OpenVINO runtime, IR decoder
    python optimize.py --synthetic tiny --device cpu --attention portable    # decoder without contrib attention
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from higgs_onnx.cli import add_log_level, run_main
from higgs_onnx.extras import installed_or_exit, require

with installed_or_exit("export", "building an export"):  # torch, Olive ...: one line naming the extra if missing
    from higgs_onnx.checkpoint import DEFAULT_REPO
    from higgs_onnx.export import ENCODERS, PART_CACHE_ENV, Exporter, ExportOptions, part_cache_root
    from higgs_onnx.manifest import PART_NAMES, ROUTE_FORMS
    from higgs_onnx.providers import ATTENTIONS, PROVIDERS


def build_parser() -> argparse.ArgumentParser:
    d = ExportOptions()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help=f"checkpoint folder or Hub repo id (default {DEFAULT_REPO})")
    src.add_argument("--synthetic", choices=["tiny", "4b"], help="build a synthetic checkpoint instead")
    ap.add_argument("--revision", help="Hub revision (branch, tag or commit)")
    ap.add_argument("--device", choices=PROVIDERS, default=d.device, help="target (default %(default)s; "
                    "README, Devices: which are verified here)")
    ap.add_argument("--precision", choices=["int4", "fp16", "fp32"], default=d.precision)
    ap.add_argument("--attention", choices=ATTENTIONS, help="decoder graph: gqa (ModelBuilder, contrib "
                    "GroupQueryAttention) or portable (standard ONNX ops); default: the device's (gqa; portable on "
                    "openvino). A non-default graph goes to onnx/<device>_<precision>_<attention>/")
    ap.add_argument("--kv-cache", choices=["int8", "fp32"], help="the decoder's KV cache: int8 (calibrated scales, "
                    "gated against fp32 on the same weights) or fp32; default: int8 for a cpu int4 build if its gates "
                    "hold, else fp32. A non-default cache goes to onnx/<device>_<precision>_kv<cache>/")
    ap.add_argument("--prefill-route", choices=["int8", "none"], help="int8: beside the int4 decoder, its twin on "
                    "ONNX Runtime's int8 GEMM for calls of many rows (prefill, batched steps), gated against fp32 and "
                    "timed for the crossover (+1 byte per weight on disk and in memory); none: the int4 graph for "
                    "every call. Default: int8 for a cpu int4 gqa build if its gate holds (docs/building.md)")
    ap.add_argument("--route-crossover", nargs=2, metavar=("POSITIONS", "ROWS"), help="record this crossover for the "
                    "int8 route instead of measuring it here: one-row calls from POSITIONS, batched steps from ROWS "
                    "('none': never); for a build meant for another machine")
    ap.add_argument("--route-form", choices=list(ROUTE_FORMS), default=None, help="the int8 route's weights: "
                    "s7 (7-bit, the default: exact on every x86 CPU, AVX2 included) or s8 (8-bit, used only where the "
                    "CPU has VNNI or AMX); docs/building.md")
    ap.add_argument("--encoder", choices=list(ENCODERS), help="the codec encoder (a new voice's reference -> "
                    "codes): int8 (ONNX Runtime's int8 GEMM, gated against fp32 on the bundled recordings) or fp32; "
                    "default: int8 for a cpu build if a form's gate holds (docs/building.md)")
    ap.add_argument("--part-precision", nargs="+", default=[], metavar="PART=PREC",
                    help="per-part precision overrides, e.g. audio_heads=fp16 audio_embed=fp32")
    ap.add_argument("--components", nargs="+", default=[], choices=PART_NAMES, metavar="PART",
                    help=f"parts to rebuild even when up to date ({', '.join(PART_NAMES)})")
    ap.add_argument("--block-size", type=int, default=d.block_size, help="int4 block size (default: the cpu int4 "
                    "decoder's chosen by its gate against fp32, docs/building.md \"The int4 layout\"; 32 elsewhere)")
    ap.add_argument("--accuracy-level", type=int, choices=range(5), help="MatMulNBits accuracy level "
                    "(default 4 on cpu, 0 elsewhere)")
    ap.add_argument("--output", type=Path, default=Path("onnx"), help="output root (default %(default)s)")
    ap.add_argument("--part-cache", type=Path, metavar="DIR",
                    help="keep finished part builds in DIR, shared by every output root that names it (default: "
                         "$HIGGS_PART_CACHE, else OUTPUT/.build/parts)")
    ap.add_argument("--force", action="store_true", help="rebuild every step")
    ap.add_argument("--push-to-hub", metavar="ORG/REPO", help="after the build (or when it is up to date), upload "
                    "the export as the folder <device>_<precision> of this Hub repo (made if missing) with a model "
                    "card README.md; needs HF_TOKEN with write access (docs/hub.md)")
    ap.add_argument("--hub-revision", metavar="BRANCH", help="--push-to-hub: the branch to commit to (made from main "
                    "if missing; default main)")
    ap.add_argument("--private", action="store_true", help="--push-to-hub: make the repo private when it is created")
    add_log_level(ap)
    return ap


def parse_crossover(values: list[str] | None) -> tuple | None:
    """`--route-crossover 64 none` -> (64, None); the bounds are ExportOptions'."""
    if values is None:
        return None
    out = []
    for v in values:
        if v.lower() == "none":
            out.append(None)
        elif v.isascii() and v.isdigit():  # not '²', which isdigit() takes and int() refuses
            out.append(int(v))
        else:
            raise ValueError(f"--route-crossover takes two sizes >= 1 (or none), got {v!r}")
    return tuple(out)


def parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        part, sep, prec = item.partition("=")
        if not sep:
            raise ValueError(f"--part-precision expects PART=PRECISION, got {item!r}")
        out[part.strip()] = prec.strip()
    return out


def check_push_args(args: argparse.Namespace) -> None:
    if args.push_to_hub is None:
        for flag, value in (("--hub-revision", args.hub_revision), ("--private", args.private or None)):
            if value is not None:
                raise ValueError(f"{flag} is for --push-to-hub ORG/REPO")
        return
    from higgs_onnx.hub import HubError, parse

    if args.push_to_hub.count("/") != 1:
        raise ValueError(f"--push-to-hub takes ORG/REPO, got {args.push_to_hub!r}")
    try:
        parse(f"hf://{args.push_to_hub}")
    except HubError:
        raise ValueError(f"--push-to-hub {args.push_to_hub[:120]!r} is not a repo id: ORG/REPO, each letters, digits, "
                         "'-', '_', '.' (at most 96; no '--' or '..', no '.git' at the end)") from None
    rev = args.hub_revision
    if rev is not None:
        try:
            parse(f"hf://{args.push_to_hub}@{rev}")
            ok = "/" not in rev
        except HubError:
            ok = False
        if not ok:
            raise ValueError(f"--hub-revision {rev[:120]!r} is not a branch name an hf:// reference can name: letters, "
                             "digits, '-', '_', '.' (no '/', no '..', not starting with '.')")


def run(args: argparse.Namespace) -> int:
    from higgs_onnx import providers

    if providers.get(args.device).ort_name is None:  # the OpenVINO runtime builds its IR
        require("openvino", f"--device {args.device}")
    check_push_args(args)  # before the build: a malformed repo id is known now
    opts = ExportOptions(device=args.device, precision=args.precision, attention=args.attention,
                         part_precision=parse_overrides(args.part_precision), block_size=args.block_size,
                         accuracy_level=args.accuracy_level, components=tuple(args.components), force=args.force,
                         kv_cache=args.kv_cache, prefill_route=args.prefill_route,
                         route_crossover=parse_crossover(args.route_crossover), route_form=args.route_form,
                         encoder=args.encoder)
    cache_from = None  # who named the part cache, when not the output's own .build/parts
    if args.part_cache is not None:
        cache_from = "--part-cache"
    elif os.environ.get(PART_CACHE_ENV, "").strip():
        cache_from = f"${PART_CACHE_ENV}"
    if cache_from:  # before any work: a file there, or a folder it cannot write
        from higgs_onnx.outputs import check_output_dir

        check_output_dir(part_cache_root(args.output / ".build", args.part_cache), cache_from)
    exporter = Exporter(args.model_dir or DEFAULT_REPO, args.output, opts, revision=args.revision,
                        token=os.environ.get("HF_TOKEN"), synthetic=args.synthetic, part_cache=args.part_cache)
    folder = exporter.run()
    if args.push_to_hub:
        from higgs_onnx.hub import push

        push(folder, args.push_to_hub, revision=args.hub_revision, private=args.private)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
