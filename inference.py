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
import os
import sys
import time
from pathlib import Path

from higgs_onnx.cli import add_log_level, run_main
from higgs_onnx.generation.blend import MODES
from higgs_onnx.generation.options import DEFAULT_MAX_ROWS, GenerationOptions
from higgs_onnx.generation.prompt import check_text
from higgs_onnx.job.options import SpeechOptions
from higgs_onnx.runtime.session import PROVIDERS, check_threads
from higgs_onnx.runtime.stream import CODEC_MODES, StreamOptions

log = logging.getLogger("inference")


def build_parser() -> argparse.ArgumentParser:
    d, so = GenerationOptions(), StreamOptions()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", type=Path, required=True, help="an onnx/<device>_<precision> folder")
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
                    "(needs `pip install faster-whisper`; nothing is downloaded)")
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
    if args.takes > 1:
        raise ValueError(f"{what} is not supported with --takes (each take would need a batch row per voice); use "
                         f"--retries")
    return files


CAPTION_CHARS = 150  # the pieces (cues) of a job with --captions: ~10 s, whole sentences


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
    from higgs_onnx.longform.render import read_text_file
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
    if args.retries is None:
        args.retries = 0 if args.takes != 1 else RETRIES
    args.job = SpeechOptions.build({"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                                    "seed": args.seed, "max_rows": args.max_rows, "speed": args.speed,
                                    "takes": args.takes, "retries": args.retries, "loudness": args.loudness,
                                    "blend_mode": args.blend_mode}, "cli")
    options = args.job.generation
    stream = StreamOptions(first_frames=args.first_frames, chunk_frames=args.chunk_frames, codec=args.stream_codec)
    if args.out is not None and str(args.out) == "-":
        if args.codes is not None or args.selftest:
            raise ValueError("--out - (raw PCM on stdout) is for generated speech; name a file for --codes")
        args.stream = True  # stdout only ever gets audio as it is made
    check_threads(args.threads)
    if args.ref_text is not None and args.ref_audio is None:
        raise ValueError("--ref-text needs --ref-audio (the recording it transcribes)")
    if args.voice is not None and args.ref_audio is not None:
        raise ValueError("use either --voice or --ref-audio, not both")
    if args.save_voice is not None and args.ref_audio is None:
        raise ValueError("--save-voice needs --ref-audio (the voice to save)")
    args.voice_files = voice_files(args)
    check_dialogue_args(args)
    if args.text_file is not None and (args.out_dir is None) == (args.out is None):
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
    if args.takes > 1 and args.stream:
        raise ValueError("--takes is for --text without --stream (a stream's audio is out before the takes are "
                         "judged)")
    if args.speed is not None and (args.codes is not None or args.selftest or args.script is not None or
                                   args.text_file is not None and args.out is not None):
        raise ValueError("--speed is for --text, or --text-file with --out-dir (a tag before each line); in a long "
                         "text or a script, write the tag (<|prosody:speed_slow|>) where it should apply")
    if args.save_takes is not None and args.takes < 2:
        raise ValueError("--save-takes needs --takes N (N >= 2)")
    if args.save_takes is not None and args.save_takes.exists() and not args.save_takes.is_dir():
        raise ValueError(f"--save-takes {args.save_takes} is a file, not a folder")
    if args.loudness is not None and args.stream:
        raise ValueError("--loudness needs the whole take before it is written: not with --stream or --out -")
    if args.asr_model is not None and args.takes < 2:
        raise ValueError("--asr-model needs --takes N (N >= 2): it ranks the takes by what is heard")
    if args.text_file is not None and args.out_dir is not None and args.save_codes is not None:
        raise ValueError("--save-codes is for single utterances")
    if (args.text_file is not None or args.script is not None) and args.out is not None and args.save_codes is not None:
        raise ValueError("--save-codes is for single utterances (long-form keeps each piece's codes in OUT.work/)")
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
            from higgs_onnx.longform.render import check_not_locked

            check_not_locked(args.out)
    if (args.text_file is not None or args.script is not None) and args.out is not None and str(args.out) != "-":
        from higgs_onnx.longform.render import check_outputs

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


def speed_prefix(tts, args) -> str:
    """`--speed` as the model's prosody tag to put before the text ("" at about 1, or where the model has none)."""
    from higgs_onnx.job.options import speed_tag

    speed = args.job.speed
    tag = speed_tag(speed, tts.tokens.control_tags)
    if tag is None and not 0.9 <= speed <= 1.1:
        log.warning("--speed %g: this model has no prosody speed tag for it; the text is spoken at its own pace", speed)
    return tag or ""


def speak(tts, text: str, out: Path, args, voice) -> object:
    """One utterance to `out` (a file, or '-' for PCM on stdout); returns its `GenerationStats`."""
    from tqdm import tqdm

    bar = tqdm(total=args.options.max_rows or DEFAULT_MAX_ROWS, unit="row", desc=out.name or "stdout", leave=False,
               disable=not sys.stderr.isatty())
    progress = lambda n: bar.update(n - bar.n)  # noqa: E731
    try:
        if args.stream:
            stats = speak_streaming(tts, text, out, args, voice, progress)
        else:
            stats = speak_once(tts, text, out, args, voice, progress)
    finally:
        bar.close()
    if stats.stop_reason == "max_rows":
        limit = "--max-rows" if args.max_rows is not None else "the default row limit"
        log.warning("%s: no end of speech within %d rows; the audio is cut at %s", out, stats.rows, limit)
    elif stats.stop_reason != "eoc":  # the guard stopped it: a loop, or rambling far past the text
        log.warning("%s: stopped by the guard (%s) after %d rows", out, stats.stop_reason, stats.rows)
    first = f"first audio after {stats.first_audio_s:.2f} s ({stats.chunks} chunks)" if args.stream else \
        f"first row after {stats.first_row_s:.2f} s"
    ran = sorted(set(tts.ran_on().values()))
    print(f"{out}: {stats.audio_s:.2f} s audio in {stats.wall_s:.2f} s (RTF {stats.rtf:.2f}); {first}; "
          f"{stats.rows} rows; stop: {stats.stop_reason}; ran on {', '.join(ran)}",
          file=sys.stderr if args.stream else sys.stdout)
    return stats


def speak_once(tts, text: str, out: Path, args, voice, progress):

    from higgs_onnx.audio import write_audio
    from higgs_onnx.outputs import write_or_keep

    if getattr(args, "takes", 1) > 1:
        speech = tts.best_of(text, args.takes, voice=voice, options=args.options, save_takes=args.save_takes,
                             asr=getattr(args, "asr", None))
    else:
        speech = tts.generate(text, voice=voice, options=args.options, on_row=progress,
                              retries=getattr(args, "retries", 0))
    wav = level(speech.waveform, speech.sample_rate, args, out)
    write_or_keep(lambda: write_audio(out, wav, speech.sample_rate), wav, speech.sample_rate, out)
    if args.save_codes:
        save_codes(args.save_codes, speech.rows, speech.codes)
    report_takes(out, speech)
    return speech.stats


def level(wav, sample_rate: int, args, out: Path):
    """`wav` at `--loudness` (unchanged without it), with one line on what was done."""
    if getattr(args, "loudness", None) is None:
        return wav
    from higgs_onnx.loudness import normalise

    wav, lv = normalise(wav, sample_rate, args.loudness)
    if lv.measured is None:
        print(f"{out}: too short or silent to measure its loudness; left as it is", file=sys.stderr)
    else:
        short = f" (the peak ceiling held it {lv.target - lv.reached:.1f} LU below)" if lv.reached < lv.target - 0.05 \
            else ""
        print(f"{out}: loudness {lv.measured:.1f} -> {lv.reached:.1f} LUFS (gain {lv.gain_db:+.1f} dB){short}",
              file=sys.stderr)
    return wav


def level_file(path: Path, args) -> None:
    """A written recording brought to `--loudness` in place (atomically: a temp file renamed over it)."""
    import soundfile as sf

    from higgs_onnx.audio import write_audio

    wav, sr = sf.read(path, dtype="float32")
    write_audio(path, level(wav, sr, args, path), sr)


def report_takes(out: Path, speech) -> None:
    """One line per take the guard judged, when there was more than one or the last is not good (stderr)."""
    takes = speech.takes or []
    if len(takes) < 2 and (speech.verdict is None or speech.verdict.good):
        return
    for i, t in enumerate(takes, 1):
        heard = "".join(f", {m.upper()} {t[m] * 100:.0f}% (heard {t['heard']!r})" for m in ("wer", "cer") if m in t)
        score = f", score {t['score']:.3f}{heard}{', kept' if t['kept'] else ''}" if "score" in t else ""
        print(f"{out}: take {i} (seed {t['seed']}, temperature {t['temperature']:.2f}): {t['verdict']}: "
              f"{t['reason']}{score}", file=sys.stderr)
    if speech.verdict is not None and not speech.verdict.good and speech.verdict.name != "max_rows":
        print(f"{out}: kept the last take although the guard calls it {speech.verdict.name} (no retries left; "
              f"--retries N draws more)", file=sys.stderr)


def save_codes(path: Path, rows, codes) -> None:
    import numpy as np

    from higgs_onnx.outputs import OutputError

    try:
        np.save(path, rows)
        np.save(path.with_suffix(".raw.npy"), codes)
    except OSError as e:
        raise OutputError(f"cannot write --save-codes {path} ({e.strerror or type(e).__name__}); the audio was "
                          f"written") from None


def speak_streaming(tts, text: str, out: Path, args, voice, progress):
    """Audio written as each chunk is final: PCM to stdout, or a file growing under a partial name."""
    from higgs_onnx.audio import GrowingAudioFile, pcm16

    to_stdout = str(out) == "-"
    sink = None if to_stdout else GrowingAudioFile(out, tts.facts.sample_rate)
    chunks = tts.stream(text, voice=voice, options=args.options, stream_options=args.stream_options,
                        on_row=progress)
    try:
        for chunk in chunks:
            if to_stdout:
                sys.stdout.buffer.write(pcm16(chunk.samples))
                sys.stdout.buffer.flush()
            else:
                sink.write(chunk.samples)
            last = chunk
    except BrokenPipeError:  # the player went away: stop generating, say so once
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise RuntimeError("stdout was closed by the reader; generation stopped") from None
    except BaseException:
        if sink is not None:
            print(f"{sink.abandon()} holds the audio made before the stop", file=sys.stderr)
        raise
    finally:
        chunks.close()
    if sink is not None:
        sink.commit()
    if args.save_codes:
        save_codes(args.save_codes, last.rows, last.codes)
    return last.stats


def run(args: argparse.Namespace) -> int:
    args.options, args.stream_options = check_args(args)
    if args.asr_model is not None:  # before the model loads: a missing recogniser is known now
        from higgs_onnx.asr import Transcriber

        args.asr = Transcriber.load(args.asr_model)
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(args.model_path, provider=args.provider, threads=args.threads, verify=not args.no_verify)
    if args.selftest:
        return selftest(tts)
    if args.codes is not None:
        return decode_codes(tts, args.codes, args.out, args)
    if args.text is not None:  # the text's tokens too, before a reference is encoded
        from higgs_onnx.generation.prompt import encode_user_text

        encode_user_text(tts.tokenizer, tts.tokens, args.text, "--text")
    if args.ref_text is not None:
        from higgs_onnx.generation.prompt import encode_user_text

        encode_user_text(tts.tokenizer, tts.tokens, args.ref_text, "--ref-text")
    voice = None
    t0 = time.perf_counter()
    if args.voice_files is not None:
        from higgs_onnx.generation.blend import Blend
        from higgs_onnx.runtime.model import Voice

        voices = [Voice.load(path, tts.model_id) for path, _ in args.voice_files]
        voice = voices[0]
        if len(voices) > 1:
            voice = Blend.make(voices, None if args.voice_files[0][1] is None else [w for _, w in args.voice_files],
                               args.blend_mode or "mixture", [path.stem for path, _ in args.voice_files])
            say = print if not args.stream else lambda *a: print(*a, file=sys.stderr)
            say(f"voice: a blend of {voice.describe()} ({voice.mode}; one batch row per voice)")
    elif args.ref_audio is not None:  # encoded and prefilled once, reused for every line
        voice = tts.make_voice(args.ref_audio, args.ref_text)
        say = print if not args.stream else lambda *a: print(*a, file=sys.stderr)
        say(f"voice: reference encoded and prefilled in {time.perf_counter() - t0:.2f} s (reused for every line)")
        if args.save_voice:
            say(f"voice saved to {voice.save(args.save_voice)}")
    if args.text is not None:
        speak(tts, speed_prefix(tts, args) + args.text, args.out, args, voice)
        return 0
    if args.script is not None:
        return speak_dialogue(tts, args)
    from higgs_onnx.longform.render import read_text_file

    text = read_text_file(args.text_file)  # empty, binary and non-UTF-8 files are refused here
    if args.out is not None:
        return speak_long(tts, text, args, voice)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{args.text_file} has no non-empty lines")
    return speak_lines(tts, lines, args, voice)


def speak_lines(tts, lines: list[str], args, voice) -> int:
    """One file per line, the lines generated together through one scheduler (`--lanes` at a time, one decoder
    call for all of them). Every line is checked against the request contract before any work."""
    from higgs_onnx.audio import GrowingAudioFile, write_audio
    from higgs_onnx.generation.contract import ContractError
    from higgs_onnx.generation.scheduler import choose_batch, measure_batch_gain
    from higgs_onnx.outputs import write_or_keep

    slot, prefix = tts.slot_positions, speed_prefix(tts, args)
    requests = []
    for i, line in enumerate(lines, 1):
        try:
            requests.append(tts.request(prefix + line, voice=voice, options=args.options, slot=slot))
        except ContractError as e:
            raise ContractError(f"line {i} of {args.text_file}: {e}", e.param, e.code, e.status) from None
        except ValueError as e:
            raise ValueError(f"line {i} of {args.text_file}: {e}") from None
    lanes = args.lanes
    if lanes is None:
        lanes = choose_batch(measure_batch_gain(tts.backend, tuple(b for b in (1, 2, 4) if b <= len(lines))))
    lanes = min(lanes, len(lines))
    width = getattr(voice, "width", 1)  # a voice blend takes a batch row per voice
    args.out_dir.mkdir(parents=True, exist_ok=True)
    say = sys.stderr if args.stream else sys.stdout
    t0, audio, made = time.perf_counter(), 0.0, 0
    with tts.scheduler(lanes * width, slot) as sched:
        mode = "stream" if args.stream else "speech"
        handles = [sched.submit(r, mode, args.stream_options) for r in requests]
        sinks = {h.id: None for h in handles}
        pending = dict(zip((h.id for h in handles), enumerate(handles, 1), strict=True))
        try:
            while pending:
                progressed = sched.step()
                for hid, (i, h) in list(pending.items()):
                    out = args.out_dir / f"{i:04d}.wav"
                    events, ended = h.drain()
                    for chunk in events:  # --stream: each file grows under a partial name as its line is made
                        if sinks[hid] is None:
                            sinks[hid] = GrowingAudioFile(out, tts.facts.sample_rate)
                        sinks[hid].write(chunk.samples)
                    if not ended:
                        continue
                    if h.error is not None:
                        raise h.error
                    del pending[hid]
                    if args.stream:
                        sinks.pop(hid).commit()
                        stats = h.result.stats
                    else:
                        speech = h.result
                        wav = level(speech.waveform, speech.sample_rate, args, out)
                        write_or_keep(lambda w=wav, s=speech, o=out: write_audio(o, w, s.sample_rate), wav,
                                      speech.sample_rate, out)
                        stats = speech.stats
                    made += 1
                    audio += stats.audio_s
                    if stats.stop_reason != "eoc":
                        log.warning("%s: no end of speech within %d rows; the audio is cut at the limit", out,
                                    stats.rows)
                    print(f"{out}: {stats.audio_s:.2f} s audio; {stats.rows} rows; stop: {stats.stop_reason} "
                          f"({made}/{len(lines)})", file=say, flush=True)  # progress, also through a pipe
                if not progressed:
                    sched.wait_for_codec()
        except BaseException:
            for sink in sinks.values():
                if sink is not None:
                    sink.abandon()
            raise
        st = sched.stats()
    wall = time.perf_counter() - t0
    print(f"{made} files in {args.out_dir}: {audio:.1f} s audio in {wall:.1f} s (RTF {wall / max(audio, 1e-9):.2f}); "
          f"{lanes} lanes, mean batch {st['mean_batch']:.2f}", file=say)
    return 0


def long_options(args):
    """LongFormOptions from the flags: --history, and with --captions pieces cut near --caption-chars."""
    from higgs_onnx.longform.render import LongFormOptions

    if args.captions is None:
        return LongFormOptions(history=args.history)
    return LongFormOptions(history=args.history, target_chars=args.caption_chars or CAPTION_CHARS)


def speak_long(tts, text: str, args, voice) -> int:
    """The whole text as one recording: pieces in one voice, each saved to OUT.work/ as it finishes."""
    from higgs_onnx.longform.render import LongForm

    def job(out: Path):
        return LongForm(tts, text, out, voice, args.options, long_options(args), resume=args.resume,
                        stream_options=args.stream_options, lanes=args.lanes)

    return run_job(job, args, str(args.text_file))


def speak_dialogue(tts, args) -> int:
    """A dialogue script as one recording: each speaker a lane continuing its own context, turns in script order."""
    from higgs_onnx.longform.dialogue import Dialogue
    from higgs_onnx.runtime.model import Voice

    loaded: dict[Path, object] = {}
    voices = {}
    for name, path in args.cast.items():
        if path is not None and path not in loaded:
            loaded[path] = Voice.load(path, tts.model_id)
        voices[name] = None if path is None else loaded[path]

    def job(out: Path):
        return Dialogue(tts, args.turns, out, voices, args.options, long_options(args), resume=args.resume,
                        stream_options=args.stream_options, where=str(args.script))

    return run_job(job, args, str(args.script))


def run_job(make, args, label: str) -> int:
    """Drive a long-form or dialogue job (`make(out)` builds it): progress per piece, the file (or raw PCM on
    stdout), loudness, captions, and a summary."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # stdout: nothing to resume, the work goes here (removed however)
        return _run_job(make, args, label, Path(tmp))


def _run_job(make, args, label: str, tmp: Path) -> int:
    from higgs_onnx.audio import pcm16
    from higgs_onnx.generation.contract import ContractError
    from higgs_onnx.longform import captions
    from higgs_onnx.outputs import OutputError

    to_stdout = str(args.out) == "-"
    job = make(tmp / "stdout.wav" if to_stdout else args.out)
    n = len(job.pieces)
    lanes = len(job.lanes)
    chosen = "" if args.lanes is not None or job.gains is None else \
        f", chosen from the measured batch gain {', '.join(f'G({b})={g:.2f}' for b, g in sorted(job.gains.items()))}"
    cast = getattr(job, "cast", None)
    who = f" for {len(cast)} speakers ({', '.join(cast)})" if cast else ""
    print(f"{label}: {n} pieces of {sum(len(p.text) for p in job.pieces) / n:.0f} characters on average"
          f" in {lanes} lane{'s' if lanes > 1 else ''}{who}{chosen}{' (resuming)' if args.resume else ''}",
          file=sys.stderr)
    seconds, t0, cues = 0.0, time.perf_counter(), []

    def progress(p) -> None:
        nonlocal seconds
        seconds = p.seconds_so_far
        cues.append(captions.cue_of(p))
        eta = f", ETA {p.eta_s:.0f} s" if p.eta_s is not None else ""
        note = " (from the work folder)" if p.resumed else f", stop: {p.stop_reason}" + (
            " after a retry" if p.retried else "")
        who = f" ({p.speaker})" if p.speaker else ""
        print(f"piece {p.index + 1}/{n}{who}: {p.seconds_so_far:.1f} s of audio so far{eta}{note}", file=sys.stderr)
        if p.stop_reason != "eoc" and not p.resumed:
            log.warning("piece %d did not end on its own within its row budget (kept, cut at the limit)", p.index + 1)

    if to_stdout:  # audio goes out while each piece is generated
        chunks = job.stream(progress)
        try:
            for samples in chunks:
                sys.stdout.buffer.write(pcm16(samples))
                sys.stdout.buffer.flush()
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            raise RuntimeError("stdout was closed by the reader; generation stopped") from None
        finally:
            chunks.close()
    else:
        try:
            job.write(progress)  # grows OUT.partial piece by piece, renames it at the end, removes OUT.work/
            if args.loudness is not None:  # the whole recording at one level (one gain: pieces keep their balance)
                level_file(args.out, args)
        except (OutputError, ContractError):
            raise  # their message says what to do (and resuming cannot make a piece fit)
        except BaseException:
            print(f"the finished pieces are kept in {job.work}: run again with --resume to continue",
                  file=sys.stderr)
            raise
    if args.captions is not None:
        try:
            captions.write(args.captions, cues, job.tts.facts.sample_rate)
        except OSError as e:
            raise OutputError(f"the audio is written, but the captions cannot be: {args.captions} "
                              f"({e.strerror or type(e).__name__})") from None
        print(f"{args.captions}: {len(cues)} cues", file=sys.stderr)
    wall = time.perf_counter() - t0
    st = job.stats
    print(f"{args.out}: {seconds:.1f} s audio from {n} pieces in {wall:.1f} s (RTF {wall / max(seconds, 1e-9):.2f}); "
          f"{st.get('lanes', lanes)} lanes, mean batch {st.get('mean_batch', 0):.2f}; prompt positions prefilled "
          f"{st.get('positions_prefilled', 0)} vs rows generated {st.get('rows_generated', 0)}",
          file=sys.stderr if args.stream else sys.stdout)
    return 0


def decode_codes(tts, path: Path, out: Path, args=None) -> int:
    import numpy as np

    from higgs_onnx.audio import write_audio
    from higgs_onnx.generation.delay import read_code_rows

    rows = read_code_rows(path, tts.facts.num_codebooks, tts.facts.codebook_vocab)
    n = tts.facts.num_codebooks
    delayed = len(rows) > 0 and rows[0, 1:].tolist() == [tts.facts.boc] * (n - 1)  # delayed rows start with BOC
    wav = tts.decode_rows(rows.astype(np.int64), delayed=delayed)
    write_audio(out, level(wav, tts.facts.sample_rate, args, out), tts.facts.sample_rate)
    print(f"{out}: {wav.size / tts.facts.sample_rate:.2f} s decoded from {'delayed' if delayed else 'raw'} rows")
    return 0


def selftest(tts) -> int:
    import numpy as np

    f = tts.facts
    t = np.arange(int(1.5 * f.sample_rate)) / f.sample_rate
    wav = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    codes = tts.encode_audio(wav)
    audio = tts.decode_rows(codes, delayed=False)
    ok = codes.shape[1] == f.num_codebooks and audio.size == codes.shape[0] * f.hop and np.isfinite(audio).all()
    print(f"selftest {'OK' if ok else 'FAILED'}: {wav.size} samples -> codes {codes.shape} -> {audio.size} samples")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
