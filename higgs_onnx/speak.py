"""What `inference.py` runs once its flags are checked (`inference.check_args`): one utterance (whole or streamed,
best of takes, retries, loudness), one file per line batched through one scheduler, a long text or a dialogue script
as one recording (progress per piece, captions, resume), decoding given codes, and the codec self-test. The CLI is
the thin door; this is its job."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from .audio import GrowingAudioFile, pcm16, write_audio
from .generation.contract import ContractError
from .generation.delay import read_code_rows
from .generation.options import DEFAULT_MAX_ROWS
from .generation.scheduler import choose_batch, measure_batch_gain
from .job import run
from .job.options import speed_tag
from .job.run import SpeechJob
from .longform import captions
from .longform.dialogue import Dialogue
from .longform.files import read_text_file
from .longform.render import LongForm, LongFormOptions
from .loudness import normalise
from .outputs import OutputError, write_or_keep
from .runtime.model import HiggsTTS, Voice

log = logging.getLogger("inference")
CAPTION_CHARS = 150  # the pieces (cues) of a job with --captions: ~10 s, whole sentences


def speak_all(args) -> int:
    """What the command line asked for, its flags checked (`inference.check_args`): load the model, make the voice,
    and speak the text, the lines, the long text or the script, or decode the codes."""

    tts = HiggsTTS(args.model_path, provider=args.provider, threads=args.threads, verify=not args.no_verify)
    if args.selftest:
        return selftest(tts)
    if args.codes is not None:
        return decode_codes(tts, args.codes, args.out, args)
    if args.text is not None:  # the text's tokens too, before a reference is encoded
        from .generation.prompt import encode_user_text

        encode_user_text(tts.tokenizer, tts.tokens, args.text, "--text")
    if args.ref_text is not None:
        from .generation.prompt import encode_user_text

        encode_user_text(tts.tokenizer, tts.tokens, args.ref_text, "--ref-text")
    voice = None
    t0 = time.perf_counter()
    if args.voice_files is not None:
        from .generation.blend import Blend
        from .runtime.model import Voice

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
            say(f"voice saved to {voice.save(args.save_voice, getattr(args, 'voice_languages', None))}")
    args.speech = SpeechJob(args.job, tts.tokens.control_tags, "cli")  # the lead, made once (its rules: check_args)
    pace_warning(tts, args)
    if args.dry_run:
        return dry_run(tts, args, voice)
    if args.text is not None:
        speak(tts, args.speech.prepare(args.text, "the text").text, args.out, args, voice)
        return 0
    if args.script is not None:
        return speak_dialogue(tts, args)

    text = read_text_file(args.text_file)  # empty, binary and non-UTF-8 files are refused here
    if args.out is not None:  # the lead once, before the first piece (--speed is refused for a long text)
        return speak_long(tts, args.speech.prepare(text, "the text").text, args, voice)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{args.text_file} has no non-empty lines")
    return speak_lines(tts, [args.speech.prepare(line, "the text").text for line in lines], args, voice)


def dry_run(tts, args, voice) -> int:
    """`--dry-run`: for the text (or each line of the text file), what the model would read and the prompt it would
    get, one JSON object per line on stdout. Each request is built and checked by the contract as for real (a line
    in a batching slot, as `--out-dir` runs it); nothing is generated, and no part of the model is loaded."""
    if args.text is not None:
        texts, slot = [args.text], None
    else:
        texts = [ln.strip() for ln in read_text_file(args.text_file).splitlines() if ln.strip()]
        slot = tts.slot_positions
        if not texts:
            raise ValueError(f"{args.text_file} has no non-empty lines")
    for i, text in enumerate(texts, 1):
        ready = args.speech.prepare(text, "the text")
        req = tts.request(ready.text, voice=voice, options=args.options, slot=slot)
        steps = [{"step": name, "text": after} for name, after in ready.reading.steps]
        print(json.dumps({"line": i, "text": text, "lead": ready.tag, "steps": steps,
                          **tts.prompt_figures(ready.text, req)}, ensure_ascii=False))
    loaded = ", ".join(sorted(tts.ran_on())) or "none"
    print(f"dry run: {len(texts)} request{'s' if len(texts) > 1 else ''} checked, nothing generated; model parts "
          f"loaded: {loaded}", file=sys.stderr)
    return 0


def pace_warning(tts, args) -> None:
    """One warning when `--speed` asks for a pace this model has no prosody tag for."""
    speed = args.job.speed
    if speed_tag(speed, tts.tokens.control_tags) is None and not 0.9 <= speed <= 1.1:
        log.warning("--speed %g: this model has no prosody speed tag for it; the text is spoken at its own pace", speed)


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
    """One whole take by the job's policy (`job.run.speak`: best of takes, redraws, loudness), written to `out`."""
    speech, lv = run.speak(tts, args.job, text, voice, on_row=progress, save_takes=args.save_takes,
                           asr=getattr(args, "asr", None))
    if lv is not None:
        say_level(out, lv)
    wav = speech.waveform
    write_or_keep(lambda: write_audio(out, wav, speech.sample_rate), wav, speech.sample_rate, out)
    if args.save_codes:
        save_codes(args.save_codes, speech.rows, speech.codes)
    report_takes(out, speech)
    return speech.stats


def level(wav, sample_rate: int, args, out: Path):
    """`wav` at `--loudness` (unchanged without it), with one line on what was done."""
    if getattr(args, "loudness", None) is None:
        return wav

    wav, lv = normalise(wav, sample_rate, args.loudness)
    say_level(out, lv)
    return wav


def say_level(out: Path, lv) -> None:
    """One line on what a loudness target did."""
    if lv.measured is None:
        print(f"{out}: too short or silent to measure its loudness; left as it is", file=sys.stderr)
    else:
        short = f" (the peak ceiling held it {lv.target - lv.reached:.1f} LU below)" if lv.reached < lv.target - 0.05 \
            else ""
        print(f"{out}: loudness {lv.measured:.1f} -> {lv.reached:.1f} LUFS (gain {lv.gain_db:+.1f} dB){short}",
              file=sys.stderr)


def level_file(path: Path, args) -> None:
    """A written recording brought to `--loudness` in place (atomically: a temp file renamed over it)."""
    import soundfile as sf

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

    try:
        np.save(path, rows)
        np.save(path.with_suffix(".raw.npy"), codes)
    except OSError as e:
        raise OutputError(f"cannot write --save-codes {path} ({e.strerror or type(e).__name__}); the audio was "
                          f"written") from None


def speak_streaming(tts, text: str, out: Path, args, voice, progress):
    """Audio written as each chunk is final: PCM to stdout, or a file growing under a partial name."""

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


def speak_lines(tts, lines: list[str], args, voice) -> int:
    """One file per line, the lines generated together through one scheduler (`--lanes` at a time, one decoder
    call for all of them). Every line is checked against the request contract before any work."""

    slot = tts.slot_positions
    requests = []
    for i, line in enumerate(lines, 1):
        try:
            requests.append(tts.request(line, voice=voice, options=args.options, slot=slot))
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

    if args.captions is None:
        return LongFormOptions(history=args.history)
    return LongFormOptions(history=args.history, target_chars=args.caption_chars or CAPTION_CHARS)


def speak_long(tts, text: str, args, voice) -> int:
    """The whole text as one recording: pieces in one voice, each saved to OUT.work/ as it finishes."""

    def job(out: Path):
        return LongForm(tts, text, out, voice, args.options, long_options(args), resume=args.resume,
                        stream_options=args.stream_options, lanes=args.lanes)

    return run_job(job, args, str(args.text_file))


def speak_dialogue(tts, args) -> int:
    """A dialogue script as one recording: each speaker a lane continuing its own context, turns in script order."""

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


def word_cues(path: Path, cues: list, language: str = "en") -> list:
    """The piece cues of the recording at `path` made a cue per word, each piece's words forced-aligned on its own
    samples (`captions.timed`); a piece the aligner cannot time (not English, or no alignment) keeps its cue, and
    the run says how many did."""
    from .audio import read_audio

    samples, rate = read_audio(path)
    samples = samples[:, 0]  # the recording is mono
    out, kept, why = [], 0, ""
    for cue in cues:
        got = captions.timed(cue, samples[cue.start:cue.end], rate, language)
        if got.words:
            out += got.words
        else:
            out.append(cue)
            kept, why = kept + 1, why or got.words_reason
    if kept:
        print(f"--caption-level word: {kept} of {len(cues)} pieces keep a piece-level cue ({why})", file=sys.stderr)
    return out


def run_job(make, args, label: str) -> int:
    """Drive a long-form or dialogue job (`make(out)` builds it): progress per piece, the file (or raw PCM on
    stdout), loudness, captions, and a summary."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # stdout: nothing to resume, the work goes here (removed however)
        return _run_job(make, args, label, Path(tmp))


def _run_job(make, args, label: str, tmp: Path) -> int:
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
        if args.caption_level == "word":
            cues = word_cues(args.out, cues, args.job.caption_language)
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
