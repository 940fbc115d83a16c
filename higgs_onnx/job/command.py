"""The command line's job (`inference.py`) as one typed value, built once from its flags (`Command.build`) and read
by `speak.py`: every flag checked, the text file or script read, every output checked, before the model loads. A
bad combination is a ValueError (one line, exit 2); the job's fields are `job.options.SpeechOptions`' (the bounds
and rules of every door), named by their flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..generation.codec_stream import StreamOptions
from ..generation.prompt import check_text
from .options import TEXT, Shape, SpeechOptions, text_values

RETRIES = 2  # a file is written whole, so a degenerate take is drawn again by default (not with --takes)
CAPTION_CHARS = 150  # the pieces (cues) of a job with --captions: ~10 s, whole sentences


@dataclass(frozen=True)
class Command:
    """What `inference.py` was asked to do. `task`: "text" (one utterance), "lines" (--text-file --out-dir: one
    file per line), "long" (--text-file --out: one recording), "script", "codes" or "selftest"; `texts` the
    utterance, the lines, or the whole text; `speech` the job's options; `live`: audio leaves as it is made
    (--stream, or --out -: raw PCM on stdout)."""

    task: str
    speech: SpeechOptions
    stream: StreamOptions
    live: bool
    model: object  # --model-path (a folder, or a Hub reference fetched after the checks)
    provider: str | None = None
    threads: int = 0
    verify: bool = True
    texts: tuple[str, ...] = ()
    source: str | None = None  # the --text-file or --script the texts come from
    turns: tuple = ()  # --script: (speaker, text) turns
    cast: dict | None = None  # --script: speaker -> a voice file (None: the model's own voice)
    codes: Path | None = None
    out: Path | None = None  # a file, or Path("-") for raw PCM on stdout
    out_dir: Path | None = None
    voice_files: tuple[tuple[Path, float | None], ...] | None = None  # --voice: one, or a blend's members
    ref_audio: Path | None = None
    ref_text: str | None = None
    save_voice: Path | None = None
    voice_languages: tuple[str, ...] | None = None
    captions: Path | None = None
    caption_chars: int | None = None
    history: int = 1
    lanes: int | None = None
    resume: bool = False
    save_takes: Path | None = None
    save_codes: Path | None = None
    asr_model: Path | None = None
    dry_run: bool = False
    row_limit: str = "the default row limit"  # how a warning names the row limit

    @property
    def to_stdout(self) -> bool:
        return self.out is not None and str(self.out) == "-"

    @property
    def long_options(self):
        """`LongFormOptions` of --history, and with --captions pieces cut near --caption-chars."""
        from ..longform.render import LongFormOptions

        if self.captions is None:
            return LongFormOptions(history=self.history)
        return LongFormOptions(history=self.history, target_chars=self.caption_chars or CAPTION_CHARS)

    @classmethod
    def build(cls, args: argparse.Namespace) -> Command:
        """The job of `inference.py`'s parsed flags, checked (ValueError and its kin: one line each)."""
        return build(args)


def build(args: argparse.Namespace) -> Command:
    """`Command.build`: the checks in the order a user meets them (extras, bounds, combinations, outputs)."""
    from ..runtime.session import check_threads

    out, live = args.out, args.stream
    to_stdout = out is not None and str(out) == "-"
    if to_stdout:
        if args.codes is not None or args.selftest:
            raise ValueError("--out - (raw PCM on stdout) is for generated speech; name a file for --codes")
        live = True  # stdout only ever gets audio as it is made
    retries = args.retries
    if retries is None:  # redraws by default, where a take is judged whole before it is written
        retries = 0 if args.takes != 1 or live else RETRIES
    values = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
              "max_rows": args.max_rows, "speed": args.speed, "takes": args.takes, "retries": retries,
              "loudness": args.loudness, "blend_mode": args.blend_mode, "caption_level": args.caption_level,
              "caption_language": args.caption_language}
    require_extras(args, values)  # an option whose extra is missing: the one line, before its bounds are checked
    speech = SpeechOptions.build({**values, **text_values(args)}, "cli")
    stream = StreamOptions(first_frames=args.first_frames, chunk_frames=args.chunk_frames, codec=args.stream_codec)
    check_threads(args.threads)
    languages = check_voice_args(args)
    files = voice_files(args)
    words = args.captions is not None and out is not None and not to_stdout
    speech.check_rules("cli", Shape(voices=len(files or [1]), live=live, words=words))
    turns, cast = check_dialogue_args(args)
    check_combinations(args, live)
    cmd = Command(task_of(args), speech, stream, live, args.model_path, args.provider, args.threads,
                  not args.no_verify, codes=args.codes, out=out, out_dir=args.out_dir, voice_files=files,
                  ref_audio=args.ref_audio, ref_text=args.ref_text, save_voice=args.save_voice,
                  voice_languages=languages, captions=args.captions, caption_chars=args.caption_chars,
                  history=args.history, lanes=args.lanes, resume=args.resume, save_takes=args.save_takes,
                  save_codes=args.save_codes, asr_model=args.asr_model, dry_run=args.dry_run,
                  row_limit="--max-rows" if args.max_rows is not None else "the default row limit",
                  turns=turns, cast=cast, source=str(args.script) if args.script is not None else None)
    cmd = dataclasses.replace(cmd, **read_texts(args, cmd.task))
    if args.dry_run:
        check_dry_run(args, live)
    else:
        check_files(args, cmd)
    return cmd


def task_of(args: argparse.Namespace) -> str:
    if args.selftest:
        return "selftest"
    if args.codes is not None:
        return "codes"
    if args.script is not None:
        return "script"
    if args.text_file is not None:
        return "long" if args.out is not None else "lines"
    return "text"


def read_texts(args: argparse.Namespace, task: str) -> dict:
    """The texts a job speaks: --text, or the --text-file read (and refused: empty, binary, not UTF-8) before the
    model loads; its lines for --out-dir and --dry-run."""
    if args.text is not None:
        return {"texts": (args.text,)}
    if args.text_file is None:
        return {}
    from ..longform.files import read_text_file

    text = read_text_file(args.text_file)
    if task == "long" and not args.dry_run:
        return {"texts": (text,), "source": str(args.text_file)}
    lines = tuple(ln.strip() for ln in text.splitlines() if ln.strip())
    if not lines:
        raise ValueError(f"{args.text_file} has no non-empty lines")
    return {"texts": lines, "source": str(args.text_file)}


def require_extras(args: argparse.Namespace, values: dict) -> None:
    """The options whose packages come with an extra (higgs_onnx.extras), checked before the model loads: a missing
    one is one line naming the extra (exit 2)."""
    from ..extras import require, require_text

    require_text({name: getattr(args, name) for name in TEXT})
    if values["caption_level"] == "word":
        require("asr", "--caption-level word", ("pocketsphinx",))
    if args.asr_model is not None:  # the error rates need jiwer, pocketsphinx's recogniser its package
        require("asr", "--asr-model", ("jiwer", "pocketsphinx") if str(args.asr_model) == "pocketsphinx" else
                ("jiwer",))
    if values["loudness"] is not None:
        require("loudness", "--loudness", ("pyloudnorm", "scipy"))


def check_voice_args(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--ref-audio, --ref-text, --voice, --save-voice and --voice-languages together; the languages checked."""
    if args.ref_text is not None and args.ref_audio is None:
        raise ValueError("--ref-text needs --ref-audio (the recording it transcribes)")
    if args.voice is not None and args.ref_audio is not None:
        raise ValueError("use either --voice or --ref-audio, not both")
    if args.save_voice is not None and args.ref_audio is None:
        raise ValueError("--save-voice needs --ref-audio (the voice to save)")
    if args.voice_languages is None:
        return None
    if args.save_voice is None:
        raise ValueError("--voice-languages is for --save-voice (the languages the saved voice is offered for)")
    from ..runtime.voice import check_languages

    languages = check_languages(args.voice_languages, "--voice-languages")
    if not languages:
        raise ValueError("--voice-languages needs at least one language code, e.g. en,de")
    return languages


def voice_files(args: argparse.Namespace) -> tuple[tuple[Path, float | None], ...] | None:
    """`--voice` as ((file, weight or None), ...): one voice, or a blend (`a.npz:0.7,b.npz:0.3`, names looked up in
    `--voices`), checked before the model loads; what a blend cannot do is refused here."""
    from ..generation.blend import normalise_weights, parse_spec

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

    files = tuple((find(name), w) for name, w in pairs)
    normalise_weights([w for _, w in files], "--voice")  # negative, all-zero, some-but-not-all weights
    if len(files) == 1:
        if args.blend_mode is not None:
            raise ValueError("--blend-mode is for a blend of voices (--voice a.npz:0.7,b.npz:0.3)")
        return files
    if args.text_file is not None and args.out is not None:
        raise ValueError(f"--voice {spec}: a blend of voices is not supported for long-form (--text-file with --out: "
                         f"each piece continues the KV cache of the pieces before it); use one voice, or --out-dir "
                         f"for one file per line")
    return files


def voice_file(spec: str, folder: Path | None) -> Path:
    """A saved voice's file: `spec` itself, or with `--voices DIR` a bare name is DIR/NAME.npz."""
    path = Path(spec)
    if folder is not None and not path.suffix and len(path.parts) == 1:
        return folder / f"{spec}.npz"
    return path


def check_dialogue_args(args: argparse.Namespace) -> tuple[tuple, dict | None]:
    """--script, --voices-map and --captions: the flags that go together, the script read and its cast checked
    (every speaker has a voice that exists), before the model loads; (turns, cast)."""
    if args.voices_map is not None and args.script is None:
        raise ValueError("--voices-map is for --script (each speaker's voice)")
    long_out = args.out is not None and (args.text_file is not None or args.script is not None)
    if args.captions is not None:
        if not long_out:
            raise ValueError("--captions is for one recording of many pieces: --text-file with --out, or --script")
        from ..longform.captions import check_path

        check_path(args.captions)
        if str(args.out) != "-" and args.captions.resolve() == args.out.resolve():
            raise ValueError(f"--captions {args.captions} is the --out file")
    if args.caption_level is not None and args.captions is None:
        raise ValueError("--caption-level is for --captions")
    if args.caption_chars is not None:
        if args.captions is None:
            raise ValueError("--caption-chars is for --captions")
        if not 20 <= args.caption_chars <= 600:
            raise ValueError(f"--caption-chars must be from 20 to 600, got {args.caption_chars}")
    if args.script is None:
        return (), None
    if args.out is None or args.out_dir is not None:
        raise ValueError("--script needs --out FILE (the whole dialogue as one recording; - streams raw PCM)")
    if args.voices_map is None:
        raise ValueError("--script needs --voices-map NAME=VOICE,... (e.g. alice=voices/alice.npz,bob=default)")
    for flag, value in (("--voice", args.voice), ("--ref-audio", args.ref_audio), ("--lanes", args.lanes)):
        if value is not None:
            why = "the speakers are the lanes" if flag == "--lanes" else "each speaker's voice is in --voices-map"
            raise ValueError(f"{flag} is not for --script: {why}")
    from ..longform.files import read_text_file
    from ..longform.script import check_cast, parse_script, parse_voice_map

    turns = parse_script(read_text_file(args.script, "--script"), str(args.script))
    cast = {name: None if spec.lower() == "default" else cast_voice(spec, name, args.voices)
            for name, spec in parse_voice_map(args.voices_map).items()}
    check_cast(turns, cast, str(args.script))
    return tuple(turns), cast


def cast_voice(spec: str, name: str, folder: Path | None) -> Path:
    path = voice_file(spec, folder)
    if ":" in spec and not path.exists():
        raise ValueError(f"--voices-map: {name}={spec}: a blend of voices is not for a dialogue (each turn continues "
                         f"its speaker's KV cache); give one saved voice per speaker")
    if not path.is_file():
        hint = "" if folder is not None else " (a saved voice's .npz file, a name in --voices DIR, or default)"
        raise FileNotFoundError(f"--voices-map: {name}={spec}: voice file {path} does not exist{hint}")
    return path


def check_combinations(args: argparse.Namespace, live: bool) -> None:
    """The flags that only go with some tasks."""
    to_stdout = args.out is not None and str(args.out) == "-"
    if args.text_file is not None and (args.out_dir is None) == (args.out is None) and not args.dry_run:
        raise ValueError("--text-file needs one of --out FILE (the whole text as one recording) or --out-dir DIR "
                         "(one file per line)" + (", not both" if args.out is not None else ""))
    if args.resume and (args.text_file is None and args.script is None or args.out is None or to_stdout):
        raise ValueError("--resume continues a long-form or dialogue job: --text-file or --script with --out FILE")
    if args.lanes is not None and (args.lanes < 1 or args.text_file is None):
        raise ValueError("--lanes is for --text-file and must be >= 1" if args.lanes < 1
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


def check_dry_run(args: argparse.Namespace, live: bool) -> None:
    """What `--dry-run` reads (--text, or the lines of --text-file) and the flags that would make it do work."""
    if args.text is None and args.text_file is None:
        raise ValueError("--dry-run is for --text or --text-file (each line): it shows what the model would read")
    for flag, value in (("--ref-audio", args.ref_audio), ("--save-voice", args.save_voice), ("--out", args.out),
                        ("--out-dir", args.out_dir), ("--save-codes", args.save_codes),
                        ("--save-takes", args.save_takes), ("--asr-model", args.asr_model),
                        ("--captions", args.captions), ("--stream", live or None)):
        if value is not None:
            why = ("a reference would be encoded and prefilled by the model: save it once with --save-voice and "
                   "use --voice") if flag == "--ref-audio" else "a dry run writes nothing; leave it out"
            raise ValueError(f"{flag} is not for --dry-run: {why}")
    if args.text is not None:
        check_text(args.text, "--text")


def check_files(args: argparse.Namespace, cmd: Command) -> None:
    """Every output, checked before the model is loaded (nothing is created), and the texts' own rules."""
    from ..audio import WRITE_FORMATS
    from ..outputs import check_output_dir, check_output_file

    out, long = args.out, args.text_file is not None or args.script is not None
    if (args.text is not None or args.codes is not None) and out is None:
        raise ValueError("--out is required (e.g. --out hello.wav)")
    if out is not None and not cmd.to_stdout:
        if out.is_dir():
            raise IsADirectoryError(f"--out {out} is a folder, not an audio file: name a file in it (e.g. "
                                    f"{out / 'hello.wav'}), or use --text-file with --out-dir for one file per line")
        check_output_file(out, "--out", WRITE_FORMATS, "hello.wav")
        from ..longform.files import check_not_locked, check_outputs

        if long:
            check_outputs(out)  # OUT and its work folder OUT.work, before the model loads (creates nothing)
        else:
            check_not_locked(out)  # a one-shot file a running long-form job would replace
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
