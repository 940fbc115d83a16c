"""The guard: is a draw a good take, or one of the model's degenerate ones? Every verdict has a name, which becomes the
request's stop reason.

    watch = RowWatch(GuardOptions(), expected, num_codebooks, frame_rate)   # online: told every row as it is made
    watch.see(rows, n)            # -> "loop" | "overlong" | None (the request stops at once on a verdict)
    verdict = judge(rows, text, frame_rate, num_codebooks, stop_reason, wav, hop)   # a finished take
    python -m higgs_onnx.judge CODES.npy --text "..." --model-path onnx/cpu_int4 [--audio]   # exit 0 / 1 / 2
                                                                        # (the command: higgs_onnx/judge.py)

Verdicts (thresholds in `GuardOptions`, defaults justified beside each field):
- `loop`: the same row, or the same cycle of up to `loop_period` rows, over `loop_rows` rows in a row: a tone loop.
  Checked on every row, so a loop stops `loop_rows` rows after it starts instead of running to `max_rows`.
- `overlong`: far more rows than the text needs, at the script's speaking rate (`expected_rows`): rambling past the
  text. Checked on every row too.
- `short`: a clean stop (EOC) far before the text could have been said.
- `silence`: dead air longer than `silence_s` inside the speech (frames of RMS < `silence_rms` between the first
  and the last sounding frame); needs the audio.
- the engine's own `eoc` (a clean stop: a good take unless one of the above) and `max_rows` (the row limit hit
  without EOC: not a good take either).

`trim_tail` cuts trailing near-silence of a good take down to `keep_tail_s`. Everything here is NumPy on the
rows the engine already holds; `RowWatch.see` is one comparison of the newest row against the last `loop_period`.
"""

from __future__ import annotations

import unicodedata
from dataclasses import asdict, dataclass, field

import numpy as np

from ..tags import CONTROL_TAG

GOOD = ("eoc",)  # stop reasons of a good take (before the length and audio verdicts)
VERDICTS = ("loop", "overlong", "short", "silence", "max_rows", "misheard")  # a degenerate take, by name


@dataclass(frozen=True)
class GuardOptions:
    """Thresholds of the guard. Rows are delayed code rows, `frame_rate` of them a second (25 on this model)."""

    # 32 identical frames is where users of the public ONNX export break (1.3 s of one frame: no speech holds a
    # frame that long); a cycle of 2-8 rows repeating that long is the same tone with a wobble
    loop_rows: int = 32
    loop_period: int = 8
    # speaking rates, characters a second, per script, at the slow end of read speech (the guard's "expected" is the
    # longest plausible reading, so that a slow reader is never called overlong): English audiobooks run 130-160
    # words a minute at ~5.5 characters a word with its space (12-15/s: 12); read Mandarin 3.5-5 syllables
    # (characters) a second (3.5); Japanese kana 6-8 morae a second (6); Korean 5-7 syllable blocks (5)
    rates: tuple[tuple[str, float], ...] = (("latin", 12.0), ("han", 3.5), ("kana", 6.0), ("hangul", 5.0))
    # rows beyond `overlong_factor` x the text's expected rows plus `slack_s` of audio: users cap at ~20 rows a word
    # (2 x the ~10 of English at 150 words a minute); 2.5 x leaves room for slow, expressive reading, and the slack
    # for the pauses around a short line (measured: the synthetic checkpoints' takes run 6 rows per prompt token,
    # chat template included, so a 10-character Chinese line takes ~180 rows where speech needs ~50)
    overlong_factor: float = 2.5
    slack_s: float = 4.0
    # a clean stop before `short_factor` x the expected rows, for texts of at least `short_min_s` of expected speech
    short_factor: float = 0.3
    short_min_s: float = 2.0
    # dead air: RMS below 0.008 (users' threshold, about -42 dBFS) for longer than `silence_s` inside the speech
    silence_rms: float = 0.008
    silence_s: float = 1.5
    keep_tail_s: float = 0.25  # of trailing near-silence, kept by `trim_tail`
    # a take heard (`asr`, pocketsphinx with the text's own language model) with a word error rate above this says
    # something else: measured on real speech (docs/evaluation.md, "The ASR judge"): 60 clean Piper sentences 0.0
    # (at 16/22/24 kHz), the same at 20 dB SNR at most 0.125, this project's human recording 0.125; two words
    # dropped, two repeated or the last 40 % cut: at least 0.154 on sentences of 5-13 words
    max_heard_wer: float = 0.15

    def __post_init__(self) -> None:
        for name in ("loop_rows", "loop_period"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"guard {name} must be a whole number >= 1, got {v!r}")
        for name in ("overlong_factor", "slack_s", "short_factor", "short_min_s", "silence_rms", "silence_s",
                     "keep_tail_s", "max_heard_wer"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"guard {name} must be a number >= 0, got {v!r}")
        if not self.overlong_factor > 1:
            raise ValueError(f"guard overlong_factor must be > 1, got {self.overlong_factor}")

    @property
    def rate(self) -> dict[str, float]:
        return dict(self.rates)

    @classmethod
    def parse(cls, items: list[str] | tuple[str, ...]) -> GuardOptions:
        """`["overlong_factor=3", "loop_rows=48"]` (a command line's `--guard KEY=VALUE`s) -> the options; an unknown
        key or a bad value is a ValueError naming it."""
        import dataclasses

        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "rates"}
        values = {}
        for item in items:
            key, sep, raw = item.partition("=")
            if not sep or key not in fields:
                raise ValueError(f"--guard {item!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}")
            kind = int if fields[key].type in ("int", int) else float
            try:
                values[key] = kind(raw)
            except ValueError:
                raise ValueError(f"--guard {key}: {raw!r} is not {'a whole number' if kind is int else 'a number'}"
                                 ) from None
        return cls(**values)


def script_of(ch: str) -> str | None:
    """The script a character is spoken at the rate of (None: not spoken: spaces, punctuation, symbols)."""
    cat = unicodedata.category(ch)
    if not cat.startswith(("L", "N")):
        return None
    o = ord(ch)
    if 0x3040 <= o <= 0x30FF or 0x31F0 <= o <= 0x31FF or 0xFF66 <= o <= 0xFF9D:
        return "kana"
    if 0xAC00 <= o <= 0xD7AF or 0x1100 <= o <= 0x11FF or 0x3130 <= o <= 0x318F:
        return "hangul"
    if 0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0xF900 <= o <= 0xFAFF or 0x20000 <= o <= 0x2FFFF:
        return "han"
    return "latin"  # every alphabet (Latin, Cyrillic, Greek, ...) and digits: read at about the same rate


def expected_seconds(text: str, options: GuardOptions = GuardOptions()) -> float:
    """Seconds `text` takes at the typical rate of each of its scripts (control tags and spaces take none; a
    space between words is counted in the Latin rate)."""
    rate, counts = options.rate, {}
    for ch in CONTROL_TAG.sub(" ", text):
        s = script_of(ch)
        if s is not None:
            counts[s] = counts.get(s, 0) + 1
    latin = counts.pop("latin", 0)
    words = len([w for w in CONTROL_TAG.sub(" ", text).split() if any(script_of(c) == "latin" for c in w)])
    seconds = (latin + max(words - 1, 0)) / rate["latin"] if latin else 0.0
    return seconds + sum(n / rate[s] for s, n in counts.items())


def expected_rows(text: str, frame_rate: float, num_codebooks: int, options: GuardOptions = GuardOptions()) -> int:
    """Rows `text` takes at the typical rate: its seconds of frames plus the delay ramp."""
    return int(round(expected_seconds(text, options) * frame_rate)) + num_codebooks - 1


def overlong_rows(expected: int, frame_rate: float, options: GuardOptions) -> int:
    """The row count past which a take is `overlong`."""
    return int(options.overlong_factor * expected + options.slack_s * frame_rate)


class RowWatch:
    """One request's online guard: `see(rows, n)` after each row (rows[:n] made so far) returns the verdict that
    stops it now ("loop", "overlong") or None. `counts[p]` is how many rows in a row have equalled the row p back."""

    def __init__(self, options: GuardOptions, expected: int | None, num_codebooks: int, frame_rate: float):
        self._settings = (options, expected, num_codebooks, frame_rate)
        self.options, self.num_codebooks = options, num_codebooks
        self.limit = None if expected is None else overlong_rows(expected, frame_rate, options)
        self.counts = np.zeros(options.loop_period, np.int64)
        self.verdict: str | None = None
        self.at: int | None = None  # the row count when it fired

    def fresh(self) -> RowWatch:
        """A new watch with the same settings (for a new draw of the same text)."""
        return RowWatch(*self._settings)

    def see(self, rows: np.ndarray, n: int) -> str | None:
        if self.verdict is not None:
            return self.verdict
        p = self.options.loop_period
        if n > self.num_codebooks:  # past the delay ramp (the first rows hold BOC fill)
            back = rows[max(n - 1 - p, 0):n - 1][::-1]  # the rows 1, 2, ... p back
            same = np.zeros(p, bool)
            same[:len(back)] = (back == rows[n - 1]).all(axis=1)
            self.counts = np.where(same, self.counts + 1, 0)
            if self.counts.max() >= self.options.loop_rows:
                self.verdict, self.at = "loop", n
        if self.verdict is None and self.limit is not None and n > self.limit:
            self.verdict, self.at = "overlong", n
        return self.verdict


@dataclass
class Verdict:
    """A take's verdict: `name` ("good" or a degenerate kind), `reason` one line for people, and the figures."""

    name: str
    reason: str
    figures: dict = field(default_factory=dict)

    @property
    def good(self) -> bool:
        return self.name == "good"

    def as_dict(self) -> dict:
        return asdict(self)


def frame_rms(wav: np.ndarray, hop: int) -> np.ndarray:
    """RMS of each codec frame (`hop` samples) of a waveform."""
    n = len(wav) // hop
    if n == 0:
        return np.zeros(0, np.float32)
    x = np.asarray(wav[:n * hop], np.float64).reshape(n, hop)
    return np.sqrt((x * x).mean(axis=1)).astype(np.float32)


def longest_inner_silence(rms: np.ndarray, threshold: float) -> int:
    """Frames of the longest run below `threshold` between the first and the last frame above it."""
    loud = np.flatnonzero(rms >= threshold)
    if len(loud) < 2:
        return 0
    gaps = np.diff(loud) - 1
    return int(gaps.max()) if len(gaps) else 0


def judge(rows: np.ndarray, text: str, frame_rate: float, num_codebooks: int, stop_reason: str,
          wav: np.ndarray | None = None, hop: int | None = None, options: GuardOptions = GuardOptions()) -> Verdict:
    """The verdict of a finished take: its delayed `rows`, the text it speaks, how it stopped, and (optional) its
    audio `wav` in frames of `hop` samples."""
    n = len(rows)
    want = expected_rows(text, frame_rate, num_codebooks, options)
    fig = {"rows": n, "expected_rows": want, "overlong_above": overlong_rows(want, frame_rate, options),
           "stop_reason": stop_reason, "seconds": max(n - num_codebooks + 1, 0) / frame_rate}
    watch = RowWatch(options, want, num_codebooks, frame_rate)
    # as the engine asked: after every row but the one that ended the take (a clean stop's last row, the row limit)
    seen = n if stop_reason in ("loop", "overlong") else n - 1
    for i in range(1, seen + 1):
        if watch.see(rows, i):
            break
    if watch.at is not None:
        fig["at_row"] = watch.at
    if "loop" in (stop_reason, watch.verdict):
        where = f" (from row {watch.at - options.loop_rows})" if watch.verdict == "loop" else ""
        return Verdict("loop", f"the same rows repeat for {options.loop_rows}+ rows{where}", fig)
    if "overlong" in (stop_reason, watch.verdict):
        return Verdict("overlong", f"{n} rows for a text of about {want} (more than {fig['overlong_above']})", fig)
    if stop_reason == "max_rows":
        return Verdict("max_rows", f"no end of speech after {n} rows (the row limit)", fig)
    if stop_reason not in GOOD:  # cancelled, teacher-forced ...: not a take to judge
        return Verdict(stop_reason, f"stopped by {stop_reason}", fig)
    if want / frame_rate >= options.short_min_s and n < options.short_factor * want:
        return Verdict("short", f"ended after {n} rows; the text needs about {want}", fig)
    if wav is not None and hop:
        fig["longest_silence_s"] = gap_s = dead_air_s(wav, hop, frame_rate, options)
        if gap_s > options.silence_s:
            return silence(gap_s, fig, options)
    return Verdict("good", "a clean stop at a plausible length", fig)


def dead_air_s(wav: np.ndarray, hop: int, frames_per_s: float, options: GuardOptions) -> float:
    """Seconds of the longest dead air inside the speech of `wav` (RMS in frames of `hop` samples)."""
    return longest_inner_silence(frame_rms(wav, hop), options.silence_rms) / frames_per_s


def silence(gap_s: float, fig: dict, options: GuardOptions) -> Verdict:
    """The "silence" verdict: `gap_s` of dead air, above `silence_s`."""
    return Verdict("silence", f"{gap_s:.1f} s of dead air inside the speech (RMS < {options.silence_rms})", fig)


def listen(text: str, wav: np.ndarray, sample_rate: int, asr, options: GuardOptions = GuardOptions()) -> Verdict:
    """The part of the guard that listens, for any audio of `text` (a take, or real speech): dead air inside the
    speech (RMS in 40 ms frames), then what `asr` (`asr.Transcriber`) hears: "misheard" above `max_heard_wer`. A
    text the recogniser cannot hear (`not_heard`: no English pronunciation) is judged on dead air alone."""
    hop = max(1, round(sample_rate * 0.04))
    gap_s = dead_air_s(wav, hop, sample_rate / hop, options)
    fig: dict = {"seconds": len(wav) / sample_rate, "longest_silence_s": round(gap_s, 3)}
    if gap_s > options.silence_s:
        return silence(gap_s, fig, options)
    heard = asr.score(text, wav, sample_rate)
    return misheard(heard, options, {**fig, **heard}) or Verdict("good", "no dead air; heard as the text",
                                                                 {**fig, **heard})


def misheard(heard: dict, options: GuardOptions = GuardOptions(), figures: dict | None = None) -> Verdict | None:
    """"misheard" when a heard take's error rate (`asr.Transcriber.score`) is above `max_heard_wer`; else None."""
    rate = heard.get("wer", heard.get("cer", 0.0))
    if "not_heard" in heard or rate <= options.max_heard_wer:
        return None
    return Verdict("misheard", f"heard {heard['heard']!r}: error rate {rate:.2f} (above {options.max_heard_wer})",
                   figures if figures is not None else dict(heard))


TAKE_SEED_STEP = 7_919  # seed of take i of a best-of: seed + i * this (not a retry's step: the two never meet)


def take_seeds(seed: int, takes: int) -> list[int]:
    """The seeds of a best-of's takes, the same at every door."""
    return [seed + i * TAKE_SEED_STEP for i in range(takes)]


def take_scores(rows: list[int], good: list[bool]) -> list[float]:
    """A take's score: 1 for a good take, 0 for a degenerate one, less half its relative distance from the good
    takes' median length (an outlier length is the likelier failure)."""
    middle = float(np.median([n for n, ok in zip(rows, good, strict=True) if ok])) if any(good) else 0.0
    return [float(ok) - abs(n - middle) / max(middle, 1.0) / 2 for n, ok in zip(rows, good, strict=True)]


def best_take(scores: list[float], made: list[bool] | None = None) -> int:
    """The take a best-of keeps: the highest score among those made (a take that made no audio comes last), ties
    to the lower take. One rule for every door (`job.run.best_of`, the server's `takes`: `job.run.Runner`)."""
    return max(range(len(scores)), key=lambda i: (scores[i] if made is None or made[i] else -9.0, -i))


MAX_RETRIES = 10  # redraws of one take: the bound of every door's `retries` (job.options)


def check_retries(value, label: str = "retries") -> int:
    """A retry count, whole and within 0..MAX_RETRIES; ValueError naming `label` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{label} must be a whole number, got {value!r}")
    if not 0 <= value <= MAX_RETRIES:
        raise ValueError(f"{label} must be from 0 to {MAX_RETRIES}, got {value!r}")
    return value


@dataclass(frozen=True)
class RetryPolicy:
    """What a degenerate take gets: up to `retries` new draws, each with the seed moved by `seed_step` and the
    temperature cooled by `cool` (users of the public export cool by 0.1-0.2), not below `min_temperature`. A greedy
    request (temperature 0) is not retried: its draw would be the same."""

    retries: int = 2
    seed_step: int = 1_000_003
    cool: float = 0.15
    min_temperature: float = 0.3

    def __post_init__(self) -> None:
        check_retries(self.retries)  # the bound every door shares (job.options reads it here)
        if isinstance(self.seed_step, bool) or not isinstance(self.seed_step, int) or self.seed_step < 1:
            raise ValueError(f"seed_step must be a whole number >= 1, got {self.seed_step!r}")
        for name in ("cool", "min_temperature"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")

    def after(self, verdict: Verdict, options, tries: int):
        """The options of the next draw after the `tries`-th take was judged `verdict`, or None: a good take, one cut
        by the caller's own row limit (before the guard would call it overlong: a new draw would be cut the same
        way), or no retry left."""
        if verdict.good or verdict.name == "max_rows":
            return None
        return self.next_options(options, tries)

    def next_options(self, options, tries: int):
        """The options of try `tries + 1` (tries made so far: `tries`), or None when no retry is left."""
        import dataclasses

        if tries > self.retries or options.temperature == 0:
            return None
        cooled = max(self.min_temperature, options.temperature - self.cool)
        return dataclasses.replace(options, seed=options.seed + self.seed_step, temperature=min(cooled,
                                                                                              options.temperature))


def take_record(options, rows: int, stop_reason: str, verdict: Verdict) -> dict:
    """One take as reports list it: the seed and temperature of its `options`, its rows, stop reason and verdict."""
    return {"seed": options.seed, "temperature": options.temperature, "rows": int(rows),
            "stop_reason": stop_reason, "verdict": verdict.name, "reason": verdict.reason}


def trim_tail(wav: np.ndarray, hop: int, frame_rate: float, options: GuardOptions = GuardOptions()) -> np.ndarray:
    """`wav` with trailing frames of RMS < `silence_rms` cut to `keep_tail_s` (whole frames)."""
    rms = frame_rms(wav, hop)
    loud = np.flatnonzero(rms >= options.silence_rms)
    if not len(loud):
        return wav
    keep = int(round(options.keep_tail_s * frame_rate))
    end = min(len(wav), (loud[-1] + 1 + keep) * hop)
    return wav[:max(end, hop)]
