"""Long-form benchmark: a long text through `higgs_onnx.longform` vs short lines; piece statistics and drift.

Usage:
    python benchmarks/longform.py --preset tiny --words 1500     # every piece should stop on EOC; drift table
    python benchmarks/longform.py --preset 4b --words 150 300    # RTF vs short lines; peak RSS per text length
    python benchmarks/longform.py --model-path onnx/cpu_int4 --words 1500 --lanes 1 2 4   # lanes: chapter speed-up

With `--lanes`, each lane count runs the same text (same seed) in its own child; the table adds the chapter
speed-up over one lane, the machine's batch gain G(B) measured in that child (target: speed-up >= 0.85 x G(B)),
the mean batch, and the prompt positions prefilled vs the rows generated (KV continuation prefills only each
piece's own text).

Each text length runs in a fresh child process (its own peak RSS). Reported per run: pieces, how many stopped on
EOC (and how many needed the retry), piece durations (min / median / max), rows per text token of the first and
the last quarter of the pieces (drift: a model that drifts talks longer or shorter per token late in a long draw),
RTF, and RTF of short single lines in the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("CI", "1")

SENTENCES = [
    "The morning train left the station a little after seven, carrying a handful of sleepy commuters.",
    "Dr. Alvarez checked her notes twice; the figures, 3.5 and 7.25, still did not add up.",
    "Outside, the rain had eased into a fine mist that blurred the lights of the harbour.",
    "\"We should have left earlier,\" said Tom, although nobody was listening to him anymore.",
    "By noon the market was crowded with traders, tourists and a surprising number of dogs.",
    "She remembered the old house, the creaking stairs, and the smell of bread on Sundays.",
    "Nothing in the report explained why the bridge had been closed for three whole weeks.",
    "Later that evening, the committee met again and argued until well past midnight.",
]


def make_text(words: int, sentences: int = 4) -> str:
    """About `words` words in paragraphs of `sentences` sentences."""
    out, n, i = [], 0, 0
    while n < words:
        para = " ".join(SENTENCES[(i + k) % len(SENTENCES)] for k in range(sentences))
        out.append(para)
        n += len(para.split())
        i += 3
    return "\n\n".join(out)


REFERENCE = ROOT / "higgs_onnx" / "assets" / "recordings" / "ref_en_24k.flac"


def run_one(model: Path, words: int, threads: int, history: int = 1, lanes: int = 1, clone: bool = False,
            sentences: int = 4, short_lines: bool = True) -> dict:
    from bench import peak_rss_mb

    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.generation.scheduler import measure_batch_gain
    from higgs_onnx.longform.render import LongForm, LongFormOptions
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(model, threads=threads, verify=False)
    tts.generate("Warm up.", max_rows=10)
    short_rtf = []
    for s in SENTENCES[:3] if short_lines else ():  # short lines of the same kind of text, same process
        sp = tts.generate(s, seed=1)
        short_rtf.append(sp.stats.rtf)
    text = make_text(words, sentences)
    voice = tts.make_voice(REFERENCE, REFERENCE.with_suffix(".txt").read_text().strip()) if clone else None
    with tempfile.TemporaryDirectory() as d:
        job = LongForm(tts, text, Path(d) / "long.wav", voice=voice, options=GenerationOptions(seed=0),
                       lf=LongFormOptions(history=history), lanes=lanes)
        t0 = time.perf_counter()
        pieces = [dataclasses.replace(p, waveform=None) for p in job.run()]  # keep figures, not audio
        wall = time.perf_counter() - t0
        job.close()
    gain = measure_batch_gain(tts.backend, (1, lanes)).get(lanes, 1.0) if lanes > 1 else 1.0
    secs = [p.seconds for p in pieces]
    tokens = [len(tts.tokenizer.encode(p.text, add_special_tokens=False).ids) for p in pieces]
    per_token = [p.rows / t for p, t in zip(pieces, tokens, strict=True)]
    q = max(1, len(pieces) // 4)
    audio = sum(secs)
    return {"words": len(text.split()), "chars": len(text), "pieces": len(pieces),
            "eoc": sum(p.stop_reason == "eoc" for p in pieces), "retried": sum(p.retried for p in pieces),
            "piece_s": {"min": min(secs), "median": statistics.median(secs), "max": max(secs)},
            "rows_per_token_first": statistics.mean(per_token[:q]),
            "rows_per_token_last": statistics.mean(per_token[-q:]),
            "audio_s": audio, "wall_s": wall, "rtf": wall / audio,
            "short_line_rtf": statistics.mean(short_rtf) if short_rtf else float("nan"),
            "peak_rss_mb": peak_rss_mb(), "lanes": len(job.lanes), "paragraphs": sum(p.paragraph_end for p in
                                                                                      job.pieces),
            "mean_batch": job.stats["mean_batch"], "positions_prefilled": job.stats["positions_prefilled"],
            "rows_generated": job.stats["rows_generated"], "batch_gain": gain}


def cpu_flags() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split())
    except (OSError, IndexError):
        return "unknown"
    names = ["avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16"]
    return " ".join(n for n in names if n in flags) or "no AVX2"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["tiny", "4b"], default="tiny")
    ap.add_argument("--words", type=int, nargs="+", default=[1500])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--history", type=int, default=1, help="earlier pieces kept in each prompt (default 1)")
    ap.add_argument("--work", type=Path, default=ROOT / "onnx" / "bench")
    ap.add_argument("--model-path", type=Path, help="an existing export (instead of building --preset)")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1], help="lane counts to run (default 1)")
    ap.add_argument("--paragraph-sentences", type=int, default=4, help="sentences per paragraph (default 4)")
    ap.add_argument("--short-lines-once", action="store_true", help="time the short lines in the 1-lane run only")
    ap.add_argument("--clone", action="store_true", help="clone the bundled reference recording (every lane starts at "
                    "once; zero-shot, the other lanes wait for piece 1's voice)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._one:
        print(json.dumps(run_one(Path(args._one[0]), int(args._one[1]), args.threads, args.history,
                                 args.lanes[0], args.clone, args.paragraph_sentences,
                                 not args.short_lines_once or args.lanes[0] == 1)))
        return 0
    if args.model_path is not None:
        export = args.model_path
    else:
        from bench import ensure_export

        _, export = ensure_export(args.preset, "int4", args.work / args.preset)
    runs = []
    for w in args.words:
        for lanes in args.lanes:
            r = subprocess.run([sys.executable, __file__, "--_one", str(export), str(w), "--threads",
                                str(args.threads), "--history", str(args.history), "--lanes", str(lanes),
                                "--paragraph-sentences", str(args.paragraph_sentences),
                                *(["--clone"] if args.clone else []),
                                *(["--short-lines-once"] if args.short_lines_once else [])],
                               capture_output=True, text=True, cwd=ROOT)
            if r.returncode:
                raise SystemExit(f"run of {w} words, {lanes} lanes failed:\n{r.stderr[-3000:]}")
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"\nlong-form: {export}, history {args.history}, {os.cpu_count()} CPUs ({cpu_flags()})")
    print(f"  {'words':>6} {'pieces':>6} {'EOC':>5} {'retry':>5} {'piece s min/med/max':>21} "
          f"{'rows/token 1st/last':>20} {'audio s':>8} {'RTF':>6} {'short RTF':>9} {'peak RSS MB':>11}")
    for r in runs:
        p = r["piece_s"]
        print(f"  {r['words']:>6} {r['pieces']:>6} {r['eoc']:>5} {r['retried']:>5} "
              f"{p['min']:>7.1f}/{p['median']:>5.1f}/{p['max']:>5.1f}   "
              f"{r['rows_per_token_first']:>9.2f}/{r['rows_per_token_last']:<9.2f} {r['audio_s']:>8.1f} "
              f"{r['rtf']:>6.2f} {r['short_line_rtf']:>9.2f} {r['peak_rss_mb']:>11.0f}")
    print(f"\n  {'words':>6} {'lanes':>5} {'wall s':>8} {'speed-up':>8} {'G(B)':>6} {'0.85 G':>6} "
          f"{'mean batch':>10} {'RTF / short':>11} {'prefilled / generated':>22}")
    for r in runs:
        one = next((x for x in runs if x["words"] == r["words"] and x["lanes"] == 1), None)
        speed = one["wall_s"] / r["wall_s"] if one else float("nan")
        r["speed_up"] = speed
        short = r["short_line_rtf"] if r["short_line_rtf"] == r["short_line_rtf"] else (one or r)["short_line_rtf"]
        print(f"  {r['words']:>6} {r['lanes']:>5} {r['wall_s']:>8.1f} {speed:>8.2f} {r['batch_gain']:>6.2f} "
              f"{0.85 * r['batch_gain']:>6.2f} {r['mean_batch']:>10.2f} {r['rtf'] / short:>11.2f} "
              f"{r['positions_prefilled']:>10} / {r['rows_generated']:<10}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
