"""Generate speech with the PyTorch reference (the ground truth; slow, needs torch).

Usage:
    python -m higgs_onnx.reference --checkpoint models/tiny --text "Hello there." --out ref.wav
    python -m higgs_onnx.reference --checkpoint DIR --ref-audio me.wav --ref-text "What I said." \
        --text "New words." --out clone.wav
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli import add_log_level, run_main
from ..generation.options import DEFAULT_MAX_ROWS, GenerationOptions
from ..generation.sampling import SamplingOptions


def build_parser() -> argparse.ArgumentParser:
    d = SamplingOptions()
    ap = argparse.ArgumentParser(prog="python -m higgs_onnx.reference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoint folder or Hub repo id")
    ap.add_argument("--text", required=True)
    ap.add_argument("--out", type=Path, required=True, help="output audio file (.wav/.flac/.ogg)")
    ap.add_argument("--ref-audio", type=Path)
    ap.add_argument("--ref-text")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--temperature", type=float, default=d.temperature)
    ap.add_argument("--top-k", type=int, default=d.top_k)
    ap.add_argument("--top-p", type=float, default=d.top_p)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-rows", type=int, default=DEFAULT_MAX_ROWS, help="most delayed rows to generate")
    add_log_level(ap)
    return ap


def run(args: argparse.Namespace) -> int:
    from ..audio import write_audio
    from ..checkpoint import resolve
    from .model import ReferenceModel

    if args.ref_text is not None and args.ref_audio is None:
        raise ValueError("--ref-text needs --ref-audio")
    options = GenerationOptions(args.temperature, args.top_k, args.top_p, args.seed, args.max_rows)
    model = ReferenceModel(resolve(args.checkpoint), dtype=args.dtype)
    speech = model.generate(args.text, ref_audio=args.ref_audio, ref_text=args.ref_text, options=options)
    write_audio(args.out, speech.waveform, speech.sample_rate)
    s = speech.stats
    print(f"{args.out}: {s.audio_s:.2f} s of audio, {s.frames} frames, stop: {s.stop_reason}, {s.wall_s:.2f} s wall")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
