"""What `inference.py` runs once its job is built and checked (`job.command.Command`): one utterance (whole or
streamed, best of takes, retries, loudness), one file per line batched through one scheduler, a long text or a
dialogue script as one recording (progress per piece, captions, resume), decoding given codes, and the codec
self-test. A take's policy is the job's (`job.run.speak`), its finish (loudness, word timing) `job.finish`'s."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from .audio import GrowingAudioFile, pcm16, write_audio
from .generation.contract import ContractError
from .generation.delay import read_code_rows
from .generation.options import DEFAULT_MAX_ROWS
from .generation.scheduler import choose_batch, measure_batch_gain
from .job import finish, run
from .job.command import Command
from .job.options import speed_tag
from .job.run import SpeechJob
from .longform import captions
from .longform.dialogue import Dialogue
from .longform.render import LongForm
from .outputs import OutputError, write_or_keep
from .runtime.model import HiggsTTS, Voice

log = logging.getLogger("inference")


def speak_all(cmd: Command, model_path: Path, asr=None) -> int:
    """Load the model, make the voice, and speak the text, the lines, the long text or the script, or decode the
    codes. `asr`: the `asr.Transcriber` that hears the takes (--asr-model)."""
    tts = HiggsTTS(model_path, provider=cmd.provider, threads=cmd.threads, verify=cmd.verify)
    if cmd.task == "selftest":
        return selftest(tts)
    if cmd.task == "codes":
        return decode_codes(tts, cmd)
    from .generation.prompt import encode_user_text

    if cmd.task == "text":  # the text's tokens too, before a reference is encoded
        encode_user_text(tts.tokenizer, tts.tokens, cmd.texts[0], "--text")
    if cmd.ref_text is not None:
        encode_user_text(tts.tokenizer, tts.tokens, cmd.ref_text, "--ref-text")
    voice = make_voice(tts, cmd)
    job = SpeechJob(cmd.speech, tts.tokens.control_tags, "cli")  # the lead, made once (its rules: Command.build)
    speed = cmd.speech.speed
    if speed_tag(speed, tts.tokens.control_tags) is None and not 0.9 <= speed <= 1.1:
        log.warning("--speed %g: this model has no prosody speed tag for it; the text is spoken at its own pace", speed)
    if cmd.dry_run:
        return dry_run(tts, cmd, job, voice)
    if cmd.task == "script":
        return speak_dialogue(tts, cmd)
    texts = [job.prepare(text, "the text").text for text in cmd.texts]  # the lead once, before the first piece
    if cmd.task == "text":
        speak(tts, texts[0], cmd, voice, asr)
        return 0
    if cmd.task == "long":
        return run_job(lambda out: LongForm(tts, texts[0], out, voice, cmd.speech.generation, cmd.long_options,
                                            resume=cmd.resume, stream_options=cmd.stream, lanes=cmd.lanes), cmd)
    return speak_lines(tts, texts, cmd, voice)


def make_voice(tts, cmd: Command):
    """The voice: a saved one or a blend of saved ones (--voice), or a reference encoded and prefilled once (reused
    for every line, saved with --save-voice); None: the model's own."""
    say = (lambda *a: print(*a, file=sys.stderr)) if cmd.live else print
    t0 = time.perf_counter()
    if cmd.voice_files is not None:
        from .generation.blend import Blend

        voices = [Voice.load(path, tts.model_id) for path, _ in cmd.voice_files]
        if len(voices) == 1:
            return voices[0]
        blend = Blend.make(voices, None if cmd.voice_files[0][1] is None else [w for _, w in cmd.voice_files],
                           cmd.speech.blend_mode or "mixture", [path.stem for path, _ in cmd.voice_files])
        say(f"voice: a blend of {blend.describe()} ({blend.mode}; one batch row per voice)")
        return blend
    if cmd.ref_audio is None:
        return None
    voice = tts.make_voice(cmd.ref_audio, cmd.ref_text)
    say(f"voice: reference encoded and prefilled in {time.perf_counter() - t0:.2f} s (reused for every line)")
    if cmd.save_voice:
        say(f"voice saved to {voice.save(cmd.save_voice, cmd.voice_languages)}")
    return voice


def dry_run(tts, cmd: Command, job: SpeechJob, voice) -> int:
    """`--dry-run`: for the text (or each line of the text file), what the model would read and the prompt it would
    get, one JSON object per line on stdout. Each request is built and checked by the contract as for real (a line
    in a batching slot, as `--out-dir` runs it); nothing is generated, and no part of the model is loaded."""
    slot = None if cmd.task == "text" else tts.slot_positions
    for i, text in enumerate(cmd.texts, 1):
        ready = job.prepare(text, "the text")
        req = tts.request(ready.text, voice=voice, options=cmd.speech.generation, slot=slot)
        steps = [{"step": name, "text": after} for name, after in ready.reading.steps]
        print(json.dumps({"line": i, "text": text, "lead": ready.tag, "steps": steps,
                          **tts.prompt_figures(ready.text, req)}, ensure_ascii=False))
    n, loaded = len(cmd.texts), ", ".join(sorted(tts.ran_on())) or "none"
    print(f"dry run: {n} request{'s' if n > 1 else ''} checked, nothing generated; model parts loaded: {loaded}",
          file=sys.stderr)
    return 0


def speak(tts, text: str, cmd: Command, voice, asr=None) -> object:
    """One utterance to --out (a file, or '-' for PCM on stdout); returns its `GenerationStats`."""
    from tqdm import tqdm

    out = cmd.out
    ready(tts, cmd)
    bar = tqdm(total=cmd.speech.generation.max_rows or DEFAULT_MAX_ROWS, unit="row", desc=out.name or "stdout",
               leave=False, disable=not sys.stderr.isatty())
    progress = lambda n: bar.update(n - bar.n)  # noqa: E731
    try:
        if cmd.live:
            stats = speak_streaming(tts, text, cmd, voice, progress)
        else:  # one whole take by the job's policy (best of takes, redraws), then its loudness
            speech, lv = run.speak(tts, cmd.speech, text, voice, on_row=progress, save_takes=cmd.save_takes,
                                   asr=asr)
            say_level(out, lv)
            write_or_keep(lambda: write_audio(out, speech.waveform, speech.sample_rate), speech.waveform,
                          speech.sample_rate, out)
            save_codes(cmd.save_codes, speech.rows, speech.codes)
            report_takes(out, speech)
            stats = speech.stats
    finally:
        bar.close()
    if stats.stop_reason == "max_rows":
        log.warning("%s: no end of speech within %d rows; the audio is cut at %s", out, stats.rows, cmd.row_limit)
    elif stats.stop_reason != "eoc":  # the guard stopped it: a loop, or rambling far past the text
        log.warning("%s: stopped by the guard (%s) after %d rows", out, stats.stop_reason, stats.rows)
    print(f"{out}: {summary(stats, tts.load_s, cmd.live)}; ran on {', '.join(sorted(set(tts.ran_on().values())))}",
          file=sys.stderr if cmd.live else sys.stdout)
    return stats


def ready(tts, cmd: Command) -> None:
    """The sessions an utterance runs through, made before it starts (load, not generation): the decoder's, the
    text embedding, the heads and the codec decoder it uses. The int8 route's stays lazy (made by the first call
    that takes it, and then counted apart from that call's time: `GenerationStats.load_s`)."""
    stream = cmd.live and cmd.stream.codec != "window" and tts.has_stateful_codec
    tts.preload(("text_embed", "audio_heads", "audio_tokenizer_stream" if stream else "audio_tokenizer"))


def summary(stats, load_s: float, live: bool) -> str:
    """The one-line summary's figures: audio, generation time (the wall time less the sessions made meanwhile) and
    its RTF, split into prefill, decode and codec; the load apart (the folder opened and every session made)."""
    first = f"first audio after {stats.first_audio_s - stats.load_s:.2f} s ({stats.chunks} chunks)" if live else \
        f"first row after {stats.first_row_s:.2f} s"
    return (f"{stats.audio_s:.2f} s audio in {stats.wall_s - stats.load_s:.2f} s (RTF {stats.rtf:.2f}: prefill "
            f"{stats.prefill_s:.2f} s, decode {stats.decode_s:.2f} s, codec {stats.codec_s:.2f} s); load "
            f"{load_s:.2f} s apart; {first}; {stats.rows} rows; stop: {stats.stop_reason}")


def say_level(out, lv) -> None:
    """One line on what a loudness target did (`job.finish.level`'s record; None: none was asked)."""
    if lv is None:
        return
    if lv.measured is None:
        print(f"{out}: too short or silent to measure its loudness; left as it is", file=sys.stderr)
    else:
        short = f" (the peak ceiling held it {lv.target - lv.reached:.1f} LU below)" if lv.reached < lv.target - 0.05 \
            else ""
        print(f"{out}: loudness {lv.measured:.1f} -> {lv.reached:.1f} LUFS (gain {lv.gain_db:+.1f} dB){short}",
              file=sys.stderr)


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


def save_codes(path: Path | None, rows, codes) -> None:
    """--save-codes: the delayed rows to FILE.npy and the raw codes to FILE.raw.npy."""
    import numpy as np

    if path is None:
        return
    try:
        np.save(path, rows)
        np.save(path.with_suffix(".raw.npy"), codes)
    except OSError as e:
        raise OutputError(f"cannot write --save-codes {path} ({e.strerror or type(e).__name__}); the audio was "
                          f"written") from None


def to_stdout(samples, close) -> None:
    """Raw PCM on stdout as each array of samples comes; a reader that went away stops generation, said once.
    `close()` ends the generation however the writing ends."""
    try:
        for chunk in samples:
            sys.stdout.buffer.write(pcm16(chunk))
            sys.stdout.buffer.flush()
    except BrokenPipeError:  # the player went away: stop generating, say so once
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise RuntimeError("stdout was closed by the reader; generation stopped") from None
    finally:
        close()


def speak_streaming(tts, text: str, cmd: Command, voice, progress):
    """Audio written as each chunk is final: PCM to stdout, or a file growing under a partial name."""
    sink = None if cmd.to_stdout else GrowingAudioFile(cmd.out, tts.facts.sample_rate)
    chunks = tts.stream(text, voice=voice, options=cmd.speech.generation, stream_options=cmd.stream, on_row=progress)
    last = []

    def audio():
        for chunk in chunks:
            last[:] = [chunk]
            yield chunk.samples

    if sink is None:
        to_stdout(audio(), chunks.close)
    else:
        try:
            for samples in audio():
                sink.write(samples)
        except BaseException:
            print(f"{sink.abandon()} holds the audio made before the stop", file=sys.stderr)
            raise
        finally:
            chunks.close()
        sink.commit()
    save_codes(cmd.save_codes, last[0].rows, last[0].codes)
    return last[0].stats


def speak_lines(tts, lines: list[str], cmd: Command, voice) -> int:
    """One file per line, the lines generated together through one scheduler (`--lanes` at a time, one decoder
    call for all of them). Every line is checked against the request contract before any work."""
    slot, options = tts.slot_positions, cmd.speech.generation
    requests = []
    for i, line in enumerate(lines, 1):
        try:
            requests.append(tts.request(line, voice=voice, options=options, slot=slot))
        except ContractError as e:
            raise ContractError(f"line {i} of {cmd.source}: {e}", e.param, e.code, e.status) from None
        except ValueError as e:
            raise ValueError(f"line {i} of {cmd.source}: {e}") from None
    lanes = cmd.lanes or choose_batch(measure_batch_gain(tts.backend, tuple(b for b in (1, 2, 4) if b <= len(lines))))
    lanes = min(lanes, len(lines))
    cmd.out_dir.mkdir(parents=True, exist_ok=True)
    say = sys.stderr if cmd.live else sys.stdout
    t0, audio, made, loaded = time.perf_counter(), 0.0, 0, tts.load_s
    with tts.scheduler(lanes * getattr(voice, "width", 1), slot) as sched:  # a voice blend: a batch row per voice
        handles = [sched.submit(r, "stream" if cmd.live else "speech", cmd.stream) for r in requests]
        sinks = {h.id: None for h in handles}
        pending = dict(zip((h.id for h in handles), enumerate(handles, 1), strict=True))
        try:
            while pending:
                progressed = sched.step()
                for hid, (i, h) in list(pending.items()):
                    out = cmd.out_dir / f"{i:04d}.wav"
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
                    if cmd.live:
                        sinks.pop(hid).commit()
                        stats = h.result.stats
                    else:
                        speech = h.result
                        wav, lv = finish.level(speech.waveform, speech.sample_rate, cmd.speech.loudness)
                        say_level(out, lv)
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
    wall = time.perf_counter() - t0 - (tts.load_s - loaded)  # generation: the sessions made meanwhile are load
    print(f"{made} files in {cmd.out_dir}: {audio:.1f} s audio in {wall:.1f} s (RTF {wall / max(audio, 1e-9):.2f}; "
          f"load {tts.load_s:.2f} s apart); {lanes} lanes, mean batch {st['mean_batch']:.2f}", file=say)
    return 0


def speak_dialogue(tts, cmd: Command) -> int:
    """A dialogue script as one recording: each speaker a lane continuing its own context, turns in script order."""
    loaded = {path: Voice.load(path, tts.model_id) for path in set(cmd.cast.values()) if path is not None}
    voices = {name: None if path is None else loaded[path] for name, path in cmd.cast.items()}
    return run_job(lambda out: Dialogue(tts, list(cmd.turns), out, voices, cmd.speech.generation, cmd.long_options,
                                        resume=cmd.resume, stream_options=cmd.stream, where=cmd.source), cmd)


def run_job(make, cmd: Command) -> int:
    """Drive a long-form or dialogue job (`make(out)` builds it): progress per piece, the file (or raw PCM on
    stdout), then its finish (loudness, captions with their words), and a summary."""
    with tempfile.TemporaryDirectory() as tmp:  # stdout: nothing to resume, the work goes here (removed however)
        job = make(Path(tmp) / "stdout.wav" if cmd.to_stdout else cmd.out)
        n, lanes, cast = len(job.pieces), len(job.lanes), getattr(job, "cast", None)
        gains = "" if cmd.lanes is not None or job.gains is None else ", chosen from the measured batch gain " + \
            ", ".join(f"G({b})={g:.2f}" for b, g in sorted(job.gains.items()))
        who = f" for {len(cast)} speakers ({', '.join(cast)})" if cast else ""
        print(f"{cmd.source}: {n} pieces of {sum(len(p.text) for p in job.pieces) / n:.0f} characters on average"
              f" in {lanes} lane{'s' if lanes > 1 else ''}{who}{gains}{' (resuming)' if cmd.resume else ''}",
              file=sys.stderr)
        t0, cues, seconds, loaded = time.perf_counter(), [], [0.0], job.tts.load_s

        def progress(p) -> None:
            seconds[0] = p.seconds_so_far
            cues.append(captions.cue_of(p))
            eta = f", ETA {p.eta_s:.0f} s" if p.eta_s is not None else ""
            note = " (from the work folder)" if p.resumed else f", stop: {p.stop_reason}" + (
                " after a retry" if p.retried else "")
            who = f" ({p.speaker})" if p.speaker else ""
            print(f"piece {p.index + 1}/{n}{who}: {p.seconds_so_far:.1f} s of audio so far{eta}{note}",
                  file=sys.stderr)
            if p.stop_reason != "eoc" and not p.resumed:
                log.warning("piece %d did not end on its own within its row budget (kept, cut at the limit)",
                            p.index + 1)

        if cmd.to_stdout:  # audio goes out while each piece is generated
            chunks = job.stream(progress)
            to_stdout(chunks, chunks.close)
        else:
            try:
                job.write(progress)  # grows OUT.partial piece by piece, renames it at the end, removes OUT.work/
                say_level(cmd.out, finish.level_file(cmd.out, cmd.speech.loudness))  # one gain: pieces keep balance
            except (OutputError, ContractError):
                raise  # their message says what to do (and resuming cannot make a piece fit)
            except BaseException:
                print(f"the finished pieces are kept in {job.work}: run again with --resume to continue",
                      file=sys.stderr)
                raise
        if cmd.captions is not None:
            write_captions(cmd, cues, job.tts.facts.sample_rate)
        wall, st = time.perf_counter() - t0 - (job.tts.load_s - loaded), job.stats  # the sessions made: load
        print(f"{cmd.out}: {seconds[0]:.1f} s audio from {n} pieces in {wall:.1f} s (RTF "
              f"{wall / max(seconds[0], 1e-9):.2f}; load {job.tts.load_s:.2f} s apart); {st.get('lanes', lanes)} "
              f"lanes, mean batch "
              f"{st.get('mean_batch', 0):.2f}; prompt positions prefilled {st.get('positions_prefilled', 0)} vs rows "
              f"generated {st.get('rows_generated', 0)}", file=sys.stderr if cmd.live else sys.stdout)
    return 0


def write_captions(cmd: Command, cues: list, sample_rate: int) -> None:
    """--captions: a cue per piece, or per word (`job.finish.file_words`, timed on the written audio)."""
    if cmd.speech.caption_level == "word":
        pieces = len(cues)
        cues, kept, why = finish.file_words(cmd.out, cues, cmd.speech.caption_language)
        if kept:
            print(f"--caption-level word: {kept} of {pieces} pieces keep a piece-level cue ({why})", file=sys.stderr)
    try:
        captions.write(cmd.captions, cues, sample_rate)
    except OSError as e:
        raise OutputError(f"the audio is written, but the captions cannot be: {cmd.captions} "
                          f"({e.strerror or type(e).__name__})") from None
    print(f"{cmd.captions}: {len(cues)} cues", file=sys.stderr)


def decode_codes(tts, cmd: Command) -> int:
    """--codes: given code rows (delayed or raw) decoded to --out, at --loudness if asked."""
    import numpy as np

    f = tts.facts
    rows = read_code_rows(cmd.codes, f.num_codebooks, f.codebook_vocab)
    delayed = len(rows) > 0 and rows[0, 1:].tolist() == [f.boc] * (f.num_codebooks - 1)  # delayed rows start with BOC
    wav = tts.decode_rows(rows.astype(np.int64), delayed=delayed)
    leveled, lv = finish.level(wav, f.sample_rate, cmd.speech.loudness)
    say_level(cmd.out, lv)
    write_audio(cmd.out, leveled, f.sample_rate)
    print(f"{cmd.out}: {wav.size / f.sample_rate:.2f} s decoded from {'delayed' if delayed else 'raw'} rows")
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
