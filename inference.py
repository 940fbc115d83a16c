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
from higgs_onnx.generation.prompt import check_text
from higgs_onnx.hub import cli_model_path, model_path_arg
from higgs_onnx.job.options import TEXT, Shape, SpeechOptions, add_text_flags, text_values
from higgs_onnx.runtime.session import PROVIDERS, check_threads

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


def voice_files(args: argparse.Namespace) -> list[tuple[Path, float | None]] | None:
    """`--voice` as [(file, weight or None)]: one voice, or a blend (`a.npz:0.7,b.npz:0.3`, names looked up in
    `--voices`), checked before the model loads; what a blend cannot do is refused here."""
    from higgs_onnx.generation.blend import normalise_weights, parse_spec

    if args.voices is not None and not args.voices.is_dir():
        raise NotADirectoryError(f"--voices {args.voices} is not a folder of saved voices")
    if args.voice is None:
        if args.blend_mode is not None:
            raise ValueError("--blend-mode is for a blend of voices (--voice a.npz:0.7,b.npz:0.3)")
        if args.voices is not None and args.script is None:
            raise ValueError("--voices is for --voice (or --voices-map with --script): the names it looks up")
        return None
    spec = args.voice
    pairs = [(spec, None)] if Path(spec).exists() else parse_spec(spec, "--voice")  # a file named a:b,c stays one

    def find(name: str) -> Path:
        path = voice_file(name, args.voices)
        if not path.exists():
            hint = "" if args.voices is not None or path.suffix else \
                " (a saved voice's file, or a name in --voices DIR)"
            raise FileNotFoundError(f"voice file {path} does not exist{hint}")
        return path

    files = [(find(name), w) for name, w in pairs]
    normalise_weights([w for _, w in files], "--voice")  # negative, all-zero, some-but-not-all weights
    if len(files) == 1:
        if args.blend_mode is not None:
            raise ValueError("--blend-mode is for a blend of voices (--voice a.npz:0.7,b.npz:0.3)")
        return files
    what = f"--voice {spec}: a blend of voices"
    if args.text_file is not None and args.out is not None:
        raise ValueError(f"{what} is not supported for long-form (--text-file with --out: each piece continues the "
                         f"KV cache of the pieces before it); use one voice, or --out-dir for one file per line")
    return files


def check_dialogue_args(args: argparse.Namespace) -> None:
    """--script, --voices-map and --captions: the flags that go together, the script read and its cast checked
    (every speaker has a voice that exists), before the model loads."""
    if args.voices_map is not None and args.script is None:
        raise ValueError("--voices-map is for --script (each speaker's voice)")
    long_out = args.out is not None and (args.text_file is not None or args.script is not None)
    if args.captions is not None:
        if not long_out:
            raise ValueError("--captions is for one recording of many pieces: --text-file with --out, or --script")
        from higgs_onnx.longform.captions import check_path

        check_path(args.captions)
        if str(args.out) != "-" and args.captions.resolve() == args.out.resolve():
            raise ValueError(f"--captions {args.captions} is the --out file")
    if args.caption_level is not None:
        if args.captions is None:
            raise ValueError("--caption-level is for --captions")
    if args.caption_chars is not None:
        if args.captions is None:
            raise ValueError("--caption-chars is for --captions")
        if not 20 <= args.caption_chars <= 600:
            raise ValueError(f"--caption-chars must be from 20 to 600, got {args.caption_chars}")
    if args.script is None:
        return
    if args.out is None or args.out_dir is not None:
        raise ValueError("--script needs --out FILE (the whole dialogue as one recording; - streams raw PCM)")
    if args.voices_map is None:
        raise ValueError("--script needs --voices-map NAME=VOICE,... (e.g. alice=voices/alice.npz,bob=default)")
    for flag, value in (("--voice", args.voice), ("--ref-audio", args.ref_audio), ("--lanes", args.lanes)):
        if value is not None:
            why = "the speakers are the lanes" if flag == "--lanes" else "each speaker's voice is in --voices-map"
            raise ValueError(f"{flag} is not for --script: {why}")
    from higgs_onnx.longform.files import read_text_file
    from higgs_onnx.longform.script import check_cast, parse_script, parse_voice_map

    turns = parse_script(read_text_file(args.script, "--script"), str(args.script))
    cast = {}
    for name, spec in parse_voice_map(args.voices_map).items():
        cast[name] = None if spec.lower() == "default" else _voice_path(spec, name, args.voices)
    check_cast(turns, cast, str(args.script))
    args.turns, args.cast = turns, cast


def voice_file(spec: str, folder: Path | None) -> Path:
    """A saved voice's file: `spec` itself, or with `--voices DIR` a bare name is DIR/NAME.npz."""
    path = Path(spec)
    if folder is not None and not path.suffix and len(path.parts) == 1:
        return folder / f"{spec}.npz"
    return path


def _voice_path(spec: str, name: str, folder: Path | None) -> Path:
    path = voice_file(spec, folder)
    if ":" in spec and not path.exists():
        raise ValueError(f"--voices-map: {name}={spec}: a blend of voices is not for a dialogue (each turn continues "
                         f"its speaker's KV cache); give one saved voice per speaker")
    if not path.is_file():
        hint = "" if folder is not None else " (a saved voice's .npz file, a name in --voices DIR, or default)"
        raise FileNotFoundError(f"--voices-map: {name}={spec}: voice file {path} does not exist{hint}")
    return path


RETRIES = 2  # a file is written whole, so a degenerate take is drawn again by default (not with --takes)


def check_args(args: argparse.Namespace) -> tuple[GenerationOptions, StreamOptions]:
    # the job's options (`job.options`: the bounds and rules every door shares) and the stream's; ValueError
    if args.out is not None and str(args.out) == "-":
        if args.codes is not None or args.selftest:
            raise ValueError("--out - (raw PCM on stdout) is for generated speech; name a file for --codes")
        args.stream = True  # stdout only ever gets audio as it is made
    if args.retries is None:  # redraws by default, where a take is judged whole before it is written
        args.retries = 0 if args.takes != 1 or args.stream else RETRIES
    args.job = SpeechOptions.build({"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                                    "seed": args.seed, "max_rows": args.max_rows, "speed": args.speed,
                                    "takes": args.takes, "retries": args.retries, "loudness": args.loudness,
                                    "blend_mode": args.blend_mode, "caption_level": args.caption_level,
                                    "caption_language": args.caption_language,
                                    **text_values(args)}, "cli")
    options = args.job.generation
    stream = StreamOptions(first_frames=args.first_frames, chunk_frames=args.chunk_frames, codec=args.stream_codec)
    check_threads(args.threads)
    if args.ref_text is not None and args.ref_audio is None:
        raise ValueError("--ref-text needs --ref-audio (the recording it transcribes)")
    if args.voice is not None and args.ref_audio is not None:
        raise ValueError("use either --voice or --ref-audio, not both")
    if args.save_voice is not None and args.ref_audio is None:
        raise ValueError("--save-voice needs --ref-audio (the voice to save)")
    if args.voice_languages is not None:
        if args.save_voice is None:
            raise ValueError("--voice-languages is for --save-voice (the languages the saved voice is offered for)")
        from higgs_onnx.serve.voices import check_languages

        args.voice_languages = check_languages(args.voice_languages, "--voice-languages")
        if not args.voice_languages:
            raise ValueError("--voice-languages needs at least one language code, e.g. en,de")
    args.voice_files = voice_files(args)
    words = args.captions is not None and args.out is not None and str(args.out) != "-"
    args.job.check_rules("cli", Shape(voices=len(args.voice_files or [1]), live=bool(args.stream), words=words))
    check_dialogue_args(args)
    if args.text_file is not None and (args.out_dir is None) == (args.out is None) and not args.dry_run:
        raise ValueError("--text-file needs one of --out FILE (the whole text as one recording) or --out-dir DIR "
                         "(one file per line)" + (", not both" if args.out is not None else ""))
    if args.resume and (args.text_file is None and args.script is None or args.out is None or str(args.out) == "-"):
        raise ValueError("--resume continues a long-form or dialogue job: --text-file or --script with --out FILE")
    if args.lanes is not None and (args.lanes < 1 or args.text_file is None):
        raise ValueError("--lanes is for --text-file and must be >= 1" if args.lanes is not None and args.lanes < 1
                         else "--lanes is for --text-file (with --out or --out-dir)")
    if args.history < 0:
        raise ValueError(f"--history must be >= 0, got {args.history}")
    if args.takes > 1 and args.text is None:
        raise ValueError("--takes is for --text (one utterance, its takes judged and the best kept); the pieces and "
                         "lines of a --text-file or --script each speak once (--retries redraws a degenerate one)")
    given = [f"--{n.replace('_', '-')}" for n in TEXT if getattr(args, n) is not None]
    if given and (args.codes is not None or args.selftest or args.script is not None):
        raise ValueError(f"{given[0]} is for --text or --text-file (a script's turns are read as written)")
    if args.speed is not None and (args.codes is not None or args.selftest or args.script is not None or
                                   args.text_file is not None and args.out is not None):
        raise ValueError("--speed is for --text, or --text-file with --out-dir (a tag before each line); in a long "
                         "text or a script, write the tag (<|prosody:speed_slow|>) where it should apply")
    if args.save_takes is not None and args.takes < 2:
        raise ValueError("--save-takes needs --takes N (N >= 2)")
    if args.save_takes is not None and args.save_takes.exists() and not args.save_takes.is_dir():
        raise ValueError(f"--save-takes {args.save_takes} is a file, not a folder")
    if args.asr_model is not None and args.takes < 2:
        raise ValueError("--asr-model needs --takes N (N >= 2): it ranks the takes by what is heard")
    if args.text_file is not None and args.out_dir is not None and args.save_codes is not None:
        raise ValueError("--save-codes is for single utterances")
    if (args.text_file is not None or args.script is not None) and args.out is not None and args.save_codes is not None:
        raise ValueError("--save-codes is for single utterances (long-form keeps each piece's codes in OUT.work/)")
    if args.dry_run:
        check_dry_run(args)
        return options, stream
    if (args.text is not None or args.codes is not None) and args.out is None:
        raise ValueError("--out is required (e.g. --out hello.wav)")
    from higgs_onnx.audio import WRITE_FORMATS
    from higgs_onnx.outputs import check_output_dir, check_output_file

    if args.out is not None and str(args.out) != "-":  # every output is checked before the model is loaded
        if args.out.is_dir():
            raise IsADirectoryError(f"--out {args.out} is a folder, not an audio file: name a file in it (e.g. "
                                    f"{args.out / 'hello.wav'}), or use --text-file with --out-dir for one file per "
                                    f"line")
        check_output_file(args.out, "--out", WRITE_FORMATS, "hello.wav")
        if args.text_file is None and args.script is None:  # a one-shot file a running long-form job would replace
            from higgs_onnx.longform.files import check_not_locked

            check_not_locked(args.out)
    if (args.text_file is not None or args.script is not None) and args.out is not None and str(args.out) != "-":
        from higgs_onnx.longform.files import check_outputs

        check_outputs(args.out)  # OUT and its work folder OUT.work, before the model loads (creates nothing)
    if args.out_dir is not None:
        check_output_dir(args.out_dir, "--out-dir")
    if args.save_voice is not None:
        check_output_file(args.save_voice, "--save-voice", (".npz",), "voice.npz")
    if args.save_codes is not None:
        check_output_file(args.save_codes, "--save-codes", (".npy",), "rows.npy")
    if args.text is not None:
        check_text(args.text, "--text")  # special tokens need the tokenizer: checked after the load
    if args.ref_text is not None:
        check_text(args.ref_text, "--ref-text")
    return options, stream


def check_dry_run(args: argparse.Namespace) -> None:
    """What `--dry-run` reads (--text, or the lines of --text-file) and the flags that would make it do work."""
    if args.text is None and args.text_file is None:
        raise ValueError("--dry-run is for --text or --text-file (each line): it shows what the model would read")
    for flag, value in (("--ref-audio", args.ref_audio), ("--save-voice", args.save_voice), ("--out", args.out),
                        ("--out-dir", args.out_dir), ("--save-codes", args.save_codes),
                        ("--save-takes", args.save_takes), ("--asr-model", args.asr_model),
                        ("--captions", args.captions), ("--stream", args.stream or None)):
        if value is not None:
            why = ("a reference would be encoded and prefilled by the model: save it once with --save-voice and "
                   "use --voice") if flag == "--ref-audio" else "a dry run writes nothing; leave it out"
            raise ValueError(f"{flag} is not for --dry-run: {why}")
    if args.text is not None:
        check_text(args.text, "--text")


def require_extras(args: argparse.Namespace) -> None:
    """The options whose packages come with an extra (higgs_onnx.extras), checked before the model loads: a missing
    one is one line naming the extra (exit 2)."""
    from higgs_onnx.extras import require, require_text

    require_text(vars(args))
    if args.caption_level == "word":
        require("asr", "--caption-level word", ("pocketsphinx",))
    if args.asr_model is not None:  # the error rates need jiwer, pocketsphinx's recogniser its package
        require("asr", "--asr-model", ("jiwer", "pocketsphinx") if str(args.asr_model) == "pocketsphinx" else
                ("jiwer",))
    if args.loudness is not None:
        require("loudness", "--loudness", ("pyloudnorm", "scipy"))


def run(args: argparse.Namespace) -> int:
    require_extras(args)  # an option whose extra is missing: the one line, before its bounds are checked
    args.options, args.stream_options = check_args(args)
    cli_model_path(args)  # hf://...: fetched once, before the model loads
    if args.asr_model is not None:  # before the model loads: a missing recogniser is known now
        from higgs_onnx.asr import Transcriber

        args.asr = Transcriber.load(args.asr_model)
    from higgs_onnx.speak import speak_all

    return speak_all(args)


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
