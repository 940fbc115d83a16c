"""Running a speech job: the one place that prepares what the model reads, checks the rules between its fields
and the shape of the job, and runs what a job does around generation: takes, redraws, loudness and word timing.

    job = SpeechJob(SpeechOptions.build(values, "http"), tts.tokens.control_tags, "http")
    ready = job.prepare(text)              # the lead (instructions' tags, then the speed tag) and the reading
    job.check(Shape(pieces=n, voices=2))   # the rules that need the job's shape (job.options.RULES)

Two drivers run it. The sync one (`speak`, `best_of`; the command line, corpus rows and the Python API) runs on a
model's own scheduler; the async one (`Runner`; HTTP, SSE, the WebSocket, Wyoming and dialogues) runs over the
server's scheduler, which batches the job's takes with every other request. Both judge, choose and record takes by
one policy (`guard`: `take_seeds`, `judge`, `take_scores`, `best_take`, `RetryPolicy`); a degenerate take is drawn
again by one driver, the scheduler's (`generation.scheduler.Scheduler._retake`); and both finish a whole take the
same way (`job.finish`): one loudness gain (`level`, `leveled`), then each piece's words timed in one
lower-priority aligner process with one failure rule (`with_words`, `time_words`).

`job` stands one floor above `runtime`: `runtime` imports nothing from here.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from ..generation.scheduler import Redrawn
from ..guard import GuardOptions, RetryPolicy, best_take, judge, misheard, take_record, take_scores, take_seeds
from ..tags import CONTROL_TAG
from ..text.directions import DirectionError
from ..text.pipeline import Reading
from ..text.ssml import SsmlError
from .finish import level, leveled, with_words
from .options import TEXT, OptionError, Shape, SpeechOptions, check_takes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """What the model reads for one text: `lead` (the instructions' tags, then the speed tag: every request of
    the job starts with it, a stream session takes it as its prefix) and `reading` (the text steps' result)."""

    lead: str
    reading: Reading

    @property
    def text(self) -> str:
        return self.lead + self.reading.text

    @property
    def tag(self) -> str | None:
        return self.lead or None


class SpeechJob:
    """A job's options at one door, with the model's control tags: the lead made once, texts read, rules checked.
    OptionError (one line, the field it is about) for instructions the model cannot map or a text the steps leave
    empty."""

    def __init__(self, options: SpeechOptions, tags, door: str):
        self.options, self.tags, self.door = options, tags, door
        try:
            self.lead = options.lead(tags)
        except DirectionError as e:
            raise OptionError(str(e), "instructions") from None

    @classmethod
    def build(cls, values: dict, door: str, tags, base: SpeechOptions | None = None) -> SpeechJob:
        return cls(SpeechOptions.build(values, door, base), tags, door)

    def prepare(self, text: str, what: str = "input") -> Prepared:
        """The lead and the reading of `text`; OptionError (param `input`) when the steps leave nothing to speak."""
        try:
            reading = self.options.read(text, self.tags)
        except SsmlError as e:  # the text is the document: its field is the input's
            raise OptionError(str(e), "input") from None
        # only the model's own tags count as no speech: any other `<|...|>` (an SSML alias of `<|audio|>`) stays, for
        # the request contract to refuse by name as a special token
        spoken = CONTROL_TAG.sub(lambda m: "" if m.group() in self.tags else m.group(), reading.text)
        if reading.steps and not spoken.strip():
            raise OptionError(f"{what} has nothing to speak after {', '.join(s for s, _ in reading.steps)}",
                              "input")
        return Prepared(self.lead, reading)

    def reader(self) -> Callable[[str], str] | None:
        """The text steps as text -> text for a stream's segments (None: it has none); the lead is its prefix."""
        return self.options.reader(self.tags)

    def check(self, shape: Shape) -> None:
        """The rules between fields with the job's shape known (pieces, a blend, a live stream, a place for words)."""
        self.options.check_rules(self.door, shape)


def read_text(tts, text: str, **fields) -> str:
    """What the model should read of `text`, through the text steps the keywords ask for (`normalize`, `markdown`,
    `emoji`, `stage_directions`, `lexicon` (a dict or `text.lexicon.Lexicon`), `instructions`; docs/text.md), with
    the bounds of every door; pass the result to `HiggsTTS.generate`, `stream` or `best_of`. With no keywords the
    text is returned as it is."""
    unknown = sorted(set(fields) - set(TEXT))
    if unknown:
        raise TypeError(f"read_text() got an unexpected keyword argument {unknown[0]!r}; it takes "
                        f"{', '.join(TEXT)}")
    # the fields' own names in its messages (the python door's are refused by generate: the text is prepared here)
    job = SpeechJob.build(fields, "http", tts.tokens.control_tags)
    return job.lead + job.options.read(text, job.tags).text


# -- the sync driver ---------------------------------------------------------------------------------------------
def best_of(tts, text: str, takes: int, ref_audio=None, ref_text: str | None = None, voice=None, options=None, *,
            save_takes=None, asr=None, **keywords):
    """`takes` draws of one request as rows of one batch, each judged by the guard; the best is returned, with every
    take's record (seed, temperature, rows, verdict, score, kept) in `Speech.takes`. Take i draws with seed
    `seed + i * guard.TAKE_SEED_STEP`. The prompt is prefilled once (`HiggsTTS.draw_takes`): every take starts
    from its saved state, so the takes cost what batching the rows costs; only the takes the choice needs are
    decoded (the best by its rows, checked for dead air; all with `save_takes`). Best: a good take before a
    degenerate one, then the one whose length is nearest the good takes' median (an outlier length is the likelier
    failure); ties go to the lower take. `save_takes`: a folder for `take-<i>.wav` of every take and `takes.json`.
    `asr` (an `asr.Transcriber`): every good take is also decoded and heard, and the best is the good take with the
    lowest word (character) error rate, then as above; each record gets what was heard and its `wer` or `cer`.
    Sampling only (greedy takes would all be the same)."""
    from ..generation.options import GenerationOptions

    options = GenerationOptions.make(options, **keywords)
    shape = Shape(voices=getattr(voice, "width", 1))
    SpeechOptions(options, takes=check_takes(takes)).check_rules("python", shape)  # every door's bound and rules
    folder = None if save_takes is None else takes_folder(save_takes)
    if voice is not None and ref_audio is not None:
        raise ValueError("give either voice or ref_audio, not both")
    if voice is None and ref_audio is not None:
        voice = tts.make_voice(ref_audio, ref_text)  # once: every take hears it
    done = tts.draw_takes(text, take_seeds(options.seed, takes), voice, options)
    f = tts.facts
    g = tts.guard or GuardOptions()
    verdicts = [judge(r.generated, text, f.frame_rate, f.num_codebooks, r.stop_reason, options=g) for r in done]
    speeches: dict = {}

    def decoded(i: int):  # a take's audio, and its verdict with the dead-air check on it
        if i not in speeches:
            s = speeches[i] = tts.speech_of(done[i])
            if verdicts[i].good:
                verdicts[i] = judge(done[i].generated, text, f.frame_rate, f.num_codebooks, done[i].stop_reason,
                                    s.waveform, f.hop, g)
        return speeches[i]

    heard: dict[int, dict] = {}
    if asr is not None:  # every good take decoded (dead air checked) and heard; the best says the text best
        for i in range(takes):
            if verdicts[i].good:
                decoded(i)  # may find dead air
            if verdicts[i].good:
                heard[i] = asr.score(text, speeches[i].waveform, f.sample_rate)
                verdicts[i] = misheard(heard[i], g, {**verdicts[i].figures, **heard[i]}) or verdicts[i]
        scores = take_scores([r.n for r in done], [v.good for v in verdicts])
        best = max(range(takes), key=lambda i: (verdicts[i].good, -heard_rate(heard.get(i)), scores[i], -i))
        decoded(best)
    while asr is None:  # the best by its rows; its audio checked; a take with dead air gives way to the next
        scores = take_scores([r.n for r in done], [v.good for v in verdicts])
        best = best_take(scores)
        was_good = verdicts[best].good
        decoded(best)
        if verdicts[best].good or not was_good:
            break
    if folder is not None:
        for i in range(takes):
            decoded(i)
        scores = take_scores([r.n for r in done], [v.good for v in verdicts])
    records = [{**take_record(r.options, r.n, r.stop_reason, v), "take": i + 1, "score": round(scores[i], 4),
                **heard.get(i, {}), "kept": i == best} for i, (r, v) in enumerate(zip(done, verdicts, strict=True))]
    if folder is not None:  # saved takes are scored by ear too: DNSMOS, in takes.json (quality.take_quality)
        from ..quality import take_quality

        for i, record in enumerate(records):
            record.update(take_quality(speeches[i].waveform, speeches[i].sample_rate))
        save_all_takes(folder, [speeches[i] for i in range(takes)], records)
    kept = speeches[best]
    kept.verdict, kept.takes = verdicts[best], records
    return kept


def speak(tts, job: SpeechOptions, text: str, voice=None, *, on_row=None, save_takes=None, asr=None):
    """One whole take of `text` (already prepared) by the job's policy: the best of `takes`, or one take redrawn
    up to `retries` times; then brought to the job's loudness. Returns (`Speech`, the `loudness.Loudness` record or
    None)."""
    if job.takes > 1:
        speech = best_of(tts, text, job.takes, voice=voice, options=job.generation, save_takes=save_takes, asr=asr)
    else:
        speech = tts.generate(text, voice=voice, options=job.generation, on_row=on_row,
                              retries=RetryPolicy(retries=job.retries) if job.retries else None)
    speech.waveform, lv = level(speech.waveform, speech.sample_rate, job.loudness)
    return speech, lv


def heard_rate(record: dict | None) -> float:
    """A heard take's error rate (`asr.Transcriber.score`); a take not heard ranks after every heard one."""
    if record is None:
        return float("inf")
    return record.get("wer", record.get("cer"))


def takes_folder(path):
    """The `save_takes` folder (a `Path`): created, and writable, before any work."""
    from pathlib import Path

    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"save_takes {folder} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"cannot write into save_takes {folder} ({e.strerror or type(e).__name__})") from None
    return folder


def save_all_takes(folder, speeches: list, records: list[dict]) -> None:
    import json

    from ..audio import write_audio
    from ..outputs import write_atomic

    for i, s in enumerate(speeches, 1):
        write_audio(folder / f"take-{i}.wav", s.waveform, s.sample_rate)
    write_atomic(folder / "takes.json", json.dumps(records, indent=2))


# -- the async driver --------------------------------------------------------------------------------------------
class Gone(Exception):
    """The client left while a whole take was being made: its jobs are cancelled."""


@dataclass
class Outcome:
    """What the async driver made: the job whose audio is sent, its first item and the rest (chunks and piece cues),
    the takes' records (None: one take) and the loudness record (None: not asked)."""

    job: object
    first: object
    rest: AsyncIterator
    takes: list | None = None
    level: object = None


class Runner:
    """The async driver over the server's scheduler. `start(text, voice, options, exclusive)` submits one job (its
    refusals raised as the door's errors); `collect(job)` gathers a job's chunks, or raises `Gone` when the client
    left; `opening(job, chunks)` awaits a streamed job's first chunk (`Gone` likewise)."""

    def __init__(self, tts, start, collect, opening, sample_rate: int):
        self.tts, self.start, self.collect, self.opening = tts, start, collect, opening
        self.sample_rate = sample_rate

    async def run(self, job: SpeechOptions, ready: Prepared, voice, read_pieces=None) -> Outcome:
        """A job by its policy: best of takes, redraws, or one take (whole when it is measured for loudness,
        streamed otherwise; `read_pieces()`: the job of an input read in pieces); then the finish: its loudness (one
        gain for the whole take), and each piece's words timed when `caption_level` is "word"."""
        made = await self.take(job, ready.text, voice, read_pieces)
        if job.caption_level == "word" and made.first is not None:
            made.first, made.rest = await with_words(made.first, made.rest, ready.reading.text, self.sample_rate,
                                                     job.caption_language)
        return made

    async def take(self, job: SpeechOptions, text: str, voice, read_pieces=None) -> Outcome:
        options, takes = job.generation, None
        if job.takes > 1:
            handle, done, takes = await self.best_take(text, voice, options, job.takes, job.deterministic)
        elif job.retries:  # the scheduler's one redraw driver; the kept take's chunks follow its last `Redrawn`
            handle = self.start(text, voice, options, job.deterministic, RetryPolicy(retries=job.retries))
            done, takes = kept_take(await self.collect(handle)), handle.takes
            for i, t in enumerate(takes):
                tally("redraw", t["verdict"], redraw=i < len(takes) - 1)
        else:
            handle = read_pieces() if read_pieces else self.start(text, voice, options, job.deterministic)
            if job.loudness is None:
                chunks = aiter(handle)
                return Outcome(handle, await self.opening(handle, chunks), chunks)
            done = await self.collect(handle)
        done, lv = leveled(done, self.sample_rate, job.loudness)
        return Outcome(handle, done[0] if done else None, replay(done[1:]), takes, lv)

    async def best_take(self, text: str, voice, options, n: int, exclusive: bool):
        """(job, chunks, takes): `n` draws submitted together (they batch with every other request), each judged;
        the best (`guard.best_take`) is kept."""
        opts = [dataclasses.replace(options, seed=seed) for seed in take_seeds(options.seed, n)]
        jobs = []
        try:
            for o in opts:
                jobs.append(self.start(text, voice, o, exclusive))
            made = [await self.collect(j) for j in jobs]
        except BaseException:
            for j in jobs:
                j.cancel()
            raise
        verdicts = [self.judged(text, d) if d else None for d in made]
        for v in verdicts:
            tally("best_of", v.name if v is not None else "no_audio")
        scores = take_scores([len(d[-1].rows) if d else 0 for d in made], [v is not None and v.good for v in verdicts])
        best = best_take(scores, [bool(d) for d in made])
        takes = [{**(take_record(o, len(d[-1].rows), d[-1].stats.stop_reason, v) if d else
                     {"seed": o.seed, "verdict": "no_audio"}), "take": i + 1, "score": round(scores[i], 4),
                  "kept": i == best} for i, (o, d, v) in enumerate(zip(opts, made, verdicts, strict=True))]
        return jobs[best], made[best], takes

    def judged(self, text: str, done: list):
        """The guard's verdict of a whole take."""
        f, last = self.tts.facts, done[-1]
        return judge(last.rows, text, f.frame_rate, f.num_codebooks, last.stats.stop_reason,
                     np.concatenate([c.samples for c in done]), f.hop, self.tts.guard or GuardOptions())


async def replay(items: list) -> AsyncIterator:
    """A list as an async iterator (the chunks of a take already made)."""
    for item in items:
        yield item


def kept_take(done: list) -> list:
    """A redrawn job's items from its kept take on: those after its last `Redrawn` event."""
    marks = [i for i, item in enumerate(done) if isinstance(item, Redrawn)]
    return done[marks[-1] + 1:] if marks else done


_takes: dict[tuple[str, str], int] = {}  # (policy, verdict) -> takes judged by the server's driver
_redraws = 0
_tally = threading.Lock()


def tally(policy: str, verdict: str, redraw: bool = False) -> None:
    global _redraws
    with _tally:
        _takes[policy, verdict] = _takes.get((policy, verdict), 0) + 1
        _redraws += redraw


def take_tally() -> tuple[dict[tuple[str, str], int], int]:
    """The takes the async driver judged, by policy (`best_of`, `redraw`) and verdict (`good` or the guard's
    failure), and the redraws it made (the metrics' takes, redraws and guard verdicts)."""
    with _tally:
        return dict(_takes), _redraws
