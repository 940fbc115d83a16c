"""`python -m higgs_onnx.judge CODES.npy --text "..." --model-path DIR [--audio] [--json]`: judge a saved take.

Prints the verdict with its figures; exit 0 for a good take, 1 for a degenerate one, 2 for bad input. Apart from
the guard (`higgs_onnx.guard`, NumPy only) so that no arrow runs from guard/ up to the runtime: the guard stays
below the engine that imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .guard import judge


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m higgs_onnx.judge",
                                 description="Check a saved take (inference.py --save-codes) and print its verdict: "
                                             "exit 0 for a good take, 1 for a degenerate one, 2 for bad input.")
    ap.add_argument("codes", type=Path, help="the delayed rows .npy that --save-codes wrote")
    ap.add_argument("--text", required=True, help="the text the take speaks")
    ap.add_argument("--model-path", type=Path, required=True, help="the export that made it (its model facts; "
                    "with --audio, its codec)")
    ap.add_argument("--stop", default=None, choices=("eoc", "max_rows", "loop", "overlong"), help="how it stopped "
                    "(default: eoc when its last row holds EOC in the first codebook, else max_rows)")
    ap.add_argument("--audio", action="store_true", help="also decode it and check for dead air")
    ap.add_argument("--json", action="store_true", help="print the verdict as JSON")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    try:
        from .checkpoint import ModelFacts
        from .exports import load_export
        from .generation.delay import read_code_rows

        manifest = load_export(args.model_path, verify=False)
        f = ModelFacts.from_dict(manifest.model)
        rows = read_code_rows(args.codes, f.num_codebooks, f.codebook_vocab, "CODES")
        if not args.text.strip():
            raise ValueError("--text is empty: give the text the take speaks")
        # an EOC take winds down with EOC in the first codebook of its last rows
        stop = args.stop or ("eoc" if rows[-1, 0] == f.eoc else "max_rows")
        wav = None
        if args.audio:
            from .runtime.model import HiggsTTS

            wav = HiggsTTS(args.model_path, verify=False).decode_rows(rows)
        v = judge(rows, args.text, f.frame_rate, f.num_codebooks, stop, wav, f.hop)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(v.as_dict()))
    else:
        figs = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in v.figures.items())
        print(f"{v.name}: {v.reason} ({figs})")
    return 0 if v.good else 1


if __name__ == "__main__":
    sys.exit(main())
