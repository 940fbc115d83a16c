"""A dialogue's speakers rendering concurrently, against the same turns read by one voice in one lane.

In one process: this machine's batch gain G(2) (`measure_batch_gain`), then a two-speaker dialogue (each speaker a
lane continuing its own context, both lanes stepped by one decoder call), then the same turns as a one-voice
long-form job in one lane (`--lanes 1`, every turn a paragraph of its own, so the pieces are the same texts). Both
are zero-shot (or, with `--clone`, every voice cloned from the bundled reference) with the same seed, and every
piece is capped at `--rows` rows so the run stays short. Reported: wall, audio, RTF, mean batch, positions
prefilled against rows generated, and the speed-up per second of audio against G(2).

    python benchmarks/dialogue.py --model-path /work/b4/onnx/cpu_int4 --turns 6 --rows 120 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LINES = ["Welcome back to the show, where we talk about the things that move us.",
         "Thanks for having me. Today I want to talk about night trains.",
         "Night trains? I thought they were gone for good.",
         "They are coming back, all over Europe, and people love them.",
         "What makes them so popular again, do you think?",
         "You fall asleep in one city and wake up in another one.",
         "That does sound better than an airport at dawn.",
         "It is. And the views in the morning are hard to beat."]


def run(job) -> dict:
    t0, audio = time.perf_counter(), 0.0
    for piece in job.run():
        audio = piece.seconds_so_far
    wall = time.perf_counter() - t0
    job.close()
    st = job.stats
    return {"wall_s": round(wall, 2), "audio_s": round(audio, 2), "rtf": round(wall / audio, 3),
            "mean_batch": st["mean_batch"], "lanes": st["lanes"], "positions_prefilled": st["positions_prefilled"],
            "rows_generated": st["rows_generated"], "pieces": len(job.pieces)}


def main() -> int:
    from longform import cpu_flags

    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.generation.scheduler import measure_batch_gain
    from higgs_onnx.longform.dialogue import Dialogue
    from higgs_onnx.longform.render import LongForm
    from higgs_onnx.longform.script import Turn
    from higgs_onnx.runtime.model import HiggsTTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, required=True)
    ap.add_argument("--turns", type=int, default=6, help="turns, alternating between two speakers (<= 8)")
    ap.add_argument("--rows", type=int, default=120, help="the most rows of each piece")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clone", action="store_true", help="clone both speakers from the bundled reference")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tts = HiggsTTS(args.model_path, verify=False)
    voice = None
    if args.clone:
        data = Path(__file__).resolve().parent.parent / "tests" / "data"
        voice = tts.make_voice(data / "ref_en_24k.wav", (data / "ref_en_24k.txt").read_text().strip())
    gains = measure_batch_gain(tts.backend, (1, 2))
    turns = [Turn("Alice" if i % 2 == 0 else "Bob", LINES[i % len(LINES)], i + 1) for i in range(args.turns)]
    options = GenerationOptions(seed=args.seed, max_rows=args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        dialogue = run(Dialogue(tts, turns, Path(tmp) / "show.wav", {"Alice": voice, "Bob": voice}, options))
        text = "\n\n".join(t.text for t in turns)
        one = run(LongForm(tts, text, Path(tmp) / "one.wav", voice, options, lanes=1))
    speedup = one["rtf"] / dialogue["rtf"]
    result = {"export": str(args.model_path), "cpus": os.cpu_count(), "cpu_flags": cpu_flags(), "turns": args.turns,
              "rows_cap": args.rows, "clone": args.clone, "batch_gain": {str(k): round(v, 3) for k, v in gains.items()},
              "dialogue": dialogue, "one_voice_one_lane": one, "speedup_rtf": round(speedup, 3)}
    print(f"{args.model_path}, {os.cpu_count()} CPUs ({cpu_flags()}); {args.turns} turns, <= {args.rows} rows a piece, "
          f"{'cloned' if args.clone else 'zero-shot'}; G(2) = {gains[2]:.2f}")
    print("| run | lanes | pieces | wall | audio | RTF | mean batch | prefilled / generated |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in (("dialogue, 2 speakers", dialogue), ("the same turns, one voice, one lane", one)):
        print(f"| {name} | {r['lanes']} | {r['pieces']} | {r['wall_s']} s | {r['audio_s']} s | {r['rtf']} | "
              f"{r['mean_batch']:.2f} | {r['positions_prefilled']} / {r['rows_generated']} |")
    print(f"speed-up per second of audio: {speedup:.2f} x (G(2) = {gains[2]:.2f})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
