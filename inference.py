"""Generate speech with an exported Higgs Audio v3 model: ONNX Runtime only (no torch, no transformers).

Usage:
    python inference.py --model-path onnx/cpu_int4 --text "Hello there." --out hello.wav
    python inference.py --model-path onnx/cpu_int4 --ref-audio me.flac --ref-text "What I said." \\
                        --text "<|emotion:elation|>New words in my voice." --out clone.wav
    python inference.py --model-path onnx/cpu_int4 --text "Hello." --stream --out - | aplay -f S16_LE -r 24000 -c 1
    python inference.py --model-path onnx/cpu_int4 --text-file lines.txt --out-dir out/   # one wav per line, batched
    python inference.py --model-path onnx/cpu_int4 --text-file chapter.txt --out chapter.wav [--resume]  # one recording
    python inference.py --model-path onnx/cpu_int4 --script show.txt --voices-map alice=a.npz,bob=default \
                        --out show.wav --captions show.srt                           # a dialogue, with captions
    python inference.py --model-path onnx/cpu_int4 --voice a.npz:0.7,b.npz:0.3 --text "Hi." --out blend.wav  # 2 voices
    python inference.py --model-path onnx/cpu_int4 --codes rows.npy --out decoded.wav     # decode given codes
    python inference.py --model-path onnx/cpu_int4 --selftest                              # codec-only smoke test
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from higgs_onnx.cli import add_log_level, run_main
from higgs_onnx.generation.blend import MODES
from higgs_onnx.generation.codec_stream import CODEC_MODES, StreamOptions
from higgs_onnx.generation.options import DEFAULT_MAX_ROWS, GenerationOptions
from higgs_onnx.hub import local_model, model_path_arg
from higgs_onnx.job.command import Command
from higgs_onnx.job.options import add_text_flags
from higgs_onnx.runtime.session import PROVIDERS

log = logging.getLogger("inference")


def build_parser() -> argparse.ArgumentParser:
    d, so = GenerationOptions(), StreamOptions()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", type=model_path_arg, required=True, help="an onnx/<device>_<precision> folder, "
                    "or a Hub reference hf://ORG/REPO/FOLDER[@REVISION] (docs/hub.md)")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", help="text to speak; control tags like <|emotion:elation|> are allowed")
    what.add_argument("--text-file", type=Path, help="a text file: with --out, the whole text as one recording "
                      "(long-form: split into ~20 s pieces in one voice, resumable); with --out-dir, one file per line")
    what.add_argument("--script", type=Path, help="a dialogue script (`Name: line` per turn, or JSONL {speaker, "
                      "text}) spoken by the voices of --voices-map into one recording --out (docs/dialogue.md)")
    what.add_argument("--codes", type=Path, help="decode these code rows (.npy, delayed or raw) without generation")
    what.add_argument("--selftest", action="store_true", help="codec-only smoke test (encode + decode a tone)")
    ap.add_argument("--out", type=Path, help="output audio file; format from the extension (.wav, .flac, .ogg); "
                    "'-' streams raw 16-bit little-endian PCM, mono, at the codec rate (24 kHz) to stdout")
    ap.add_argument("--out-dir", type=Path, help="output folder for --text-file")
    ap.add_argument("--ref-audio", type=Path, help="reference recording of the voice to clone (any rate/channels)")
    ap.add_argument("--ref-text", help="transcript of --ref-audio (optional, improves cloning)")
    ap.add_argument("--save-voice", type=Path, help="save the encoded reference + its prefill state (.npz) to reuse")
    ap.add_argument("--voice-languages", metavar="CODES", help="with --save-voice: the languages the saved voice is "
                    "offered for, comma-separated (e.g. en,de; Home Assistant lists it under these; default: the "
                    "server's --languages)")
    ap.add_argument("--voice", help="a voice saved with --save-voice (instead of --ref-audio), or a blend of saved "
                    "voices NAME:WEIGHT,NAME:WEIGHT (e.g. a.npz:0.7,b.npz:0.3; no weights = equal), each a file or a "
                    "name in --voices (docs/voices.md)")
    ap.add_argument("--voices", type=Path, metavar="DIR", help="a folder of saved voices (<name>.npz): --voice "
                    "and --voices-map may name them (--voice alice:0.7,bob:0.3)")
    ap.add_argument("--blend-mode", metavar="|".join(MODES), help="how a blend mixes its voices' distributions: "
                    "'mixture' (default: log of the weighted sum of probabilities) or 'product' (weighted sum of "
                    "logits)")
    ap.add_argument("--voices-map", metavar="NAME=VOICE,...", help="--script: each speaker's voice, e.g. "
                    "alice=voices/alice.npz,bob=default (a saved voice's file, a name in --voices DIR, or default: "
                    "the model's own voice, chosen by the speaker's first turn)")
    ap.add_argument("--captions", type=Path, help="--text-file with --out, or --script: also write captions "
                    "(.srt or .vtt), one cue per piece timed by the samples written; pieces are then cut near "
                    "--caption-chars (docs/captions.md)")
    ap.add_argument("--caption-level", metavar="piece|word", default=None, help="with --captions: a cue per "
                    "piece (default), or per word, timed by a forced aligner on the written audio (pocketsphinx: "
                    "English only; other pieces keep piece cues and say so; docs/captions.md)")
    ap.add_argument("--caption-language", default="en", metavar="LANG", help="with --caption-level word: the text's "
                    "language (default %(default)s; the aligner times English only, other languages keep piece cues)")
    ap.add_argument("--caption-chars", type=int, default=None, help="with --captions: the length pieces (cues) aim "
                    "at, in characters (default 150, about 10 s; whole sentences, so some are longer)")
    ap.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy (default %(default)s)")
    ap.add_argument("--top-k", type=int, default=d.top_k, help="0 = off (default %(default)s)")
    ap.add_argument("--top-p", type=float, default=d.top_p, help="1 = off (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-rows", "--max-frames", dest="max_rows", type=int, default=None,
                    help="most code rows to generate: one per decoder step, 25 per second of audio, plus "
                    f"codebooks - 1 at the start (default: {DEFAULT_MAX_ROWS} or what fits after the prompt; a text "
                    "too long for that is refused; --max-frames is its old name)")
    add_text_flags(ap)
    ap.add_argument("--speed", type=float, default=None, help="--text, or --text-file with --out-dir: the model's "
                    "prosody speed tag for this speed (it has no continuous speed control; 0.25 to 4, as the server's "
                    "`speed`; about 1 = no tag)")
    ap.add_argument("--stream", action="store_true", help="write audio while it is generated: the file grows "
                    "under NAME.partial and is renamed at the end; with --out - raw PCM goes to stdout as it is made")
    ap.add_argument("--first-frames", type=int, default=so.first_frames, help="--stream: frames in the first "
                    "chunk (25 per second; default %(default)s)")
    ap.add_argument("--chunk-frames", type=int, default=so.chunk_frames, help="--stream: frames in every later "
                    "chunk (default %(default)s)")
    ap.add_argument("--stream-codec", choices=CODEC_MODES, default=so.codec, help="--stream: 'stateful' decodes "
                    "every frame once (the export's audio_tokenizer_stream part), 'window' re-decodes overlapping "
                    "windows; 'auto' (default) takes the stateful part when the export has it")
    ap.add_argument("--provider", choices=sorted(PROVIDERS), help="execution provider (default: the one the "
                    "folder was built for)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = ONNX Runtime's default: one "
                    "per core)")
    ap.add_argument("--history", type=int, default=1, help="--text-file with --out: each piece continues the KV "
                    "cache of the pieces before it in its lane until the lane's context is full; then the lane starts "
                    "again from the voice and the last HISTORY pieces (default %(default)s; 0 = every piece hears the "
                    "voice only)")
    ap.add_argument("--lanes", type=int, default=None, help="--text-file: pieces (--out: lanes of whole paragraphs) "
                    "or lines (--out-dir) generated together, one decoder call for all (default: chosen from this "
                    "machine's measured batch gain; 1 where batching does not pay)")
    ap.add_argument("--resume", action="store_true", help="--text-file with --out: continue an interrupted job from "
                    "its work folder (OUT.work/) instead of refusing to overwrite it")
    ap.add_argument("--retries", type=int, default=None, help="--text (not --stream): a take the guard finds "
                    "degenerate (a loop, rambling past the text, dead air, no end of speech) is drawn again with a new "
                    "seed and the temperature cooled by 0.15, up to this many times (default 2, or 0 with --takes; "
                    "0 = off; a greedy request is not retried: its draw would be the same). See docs/guard.md")
    ap.add_argument("--takes", type=int, default=1, help="--text (not --stream): draw N takes as rows of one batch "
                    "(the prompt prefilled once), judge each with the guard and keep the best; every take's score is "
                    "printed (default %(default)s; up to 16; needs sampling)")
    ap.add_argument("--save-takes", type=Path, help="with --takes: a folder for every take (take-<i>.wav) and "
                    "takes.json (seed, rows, verdict, score, kept)")
    ap.add_argument("--loudness", type=float, metavar="LUFS", help="bring each output to this integrated loudness "
                    "(EBU R128; e.g. -16 for podcasts, -23 for broadcast), the peak kept under -1 dBFS; needs the "
                    "whole take, so not with --stream or --out -. See docs/audio.md")
    ap.add_argument("--asr-model", type=Path, metavar="DIR", help="with --takes: also hear every good take with this "
                    "local faster-whisper model and keep the one with the lowest word (character) error rate "
                    "(needs `pip install faster-whisper`; nothing is downloaded); or `pocketsphinx`: its packaged "
                    "English model (pinned; weaker, English only, each take heard against the text's own words)")
    ap.add_argument("--dry-run", action="store_true", help="--text, or the lines of --text-file: print what the "
                    "model would read and its prompt positions (one JSON object per line), each request checked as "
                    "for real; nothing is generated or written and no part of the model is loaded")
    ap.add_argument("--save-codes", type=Path, help="save the delayed rows to FILE.npy and raw codes to FILE.raw.npy")
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the model files")
    add_log_level(ap)
    return ap


def run(args: argparse.Namespace) -> int:
    cmd = Command.build(args)  # every flag checked, the texts read, the outputs checked: before the model loads
    model = local_model(cmd.model)  # hf://...: fetched once, before the model loads
    asr = None
    if cmd.asr_model is not None:  # before the model loads: a missing recogniser is known now
        from higgs_onnx.asr import Transcriber

        asr = Transcriber.load(cmd.asr_model)
    from higgs_onnx.speak import speak_all

    return speak_all(cmd, model, asr)


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
