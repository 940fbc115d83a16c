"""Word-level timing: where each word of a text is said in its audio, by pocketsphinx's forced aligner.

pocketsphinx (pinned; its wheel ships an English acoustic model and the CMU pronouncing dictionary) aligns a known
word sequence to 16 kHz audio in 10 ms frames, 5 ms for speech too fast for those (`Decoder.set_align_text`, SEARCHES
below). Its model is English only, and the language of a Latin-script text cannot be told reliably from its letters,
so the caller says it (`language`): any language outside ALIGN_LANGUAGES is refused (`AlignUnavailable`) and the
captions keep their piece-level cues.

The words are the text's runs of letters and digits (`don't`, `well-known`, `U.S`, `3.5` are one word each) once the
inline control tags (`tags.CONTROL_TAG`) are dropped; punctuation is not a word. pocketsphinx 5 has no
grapheme-to-phoneme model, so a word missing from the dictionary gets a rough pronunciation here (`pronounce`):
the dictionary's entries for its parts (`well-known`; `dog's`, `couldn't've`: the word, then the clitic's sound),
number words for its digits, the letter names for a short all-capitals word (`HTTPX` reads H-T-T-P-X), else a small
English letter-to-sound table. Every word thus takes its own stretch of audio in the alignment; nothing is skipped or
interpolated. A word with no Latin letter or digit
(`Привет`, `你好`) has no English pronunciation at all: such a text is refused, with the word named.
"""

from __future__ import annotations

import functools
import itertools
import re
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ALIGN_LANGUAGES = ("en",)
ALIGN_RATE = 16000  # pocketsphinx's en-us model hears 16 kHz
FRAME_RATE = 100  # its frames a second (pocketsphinx's `frate`)
INSTALL = "pip install pocketsphinx==5.1.1"
# The beams tried in turn until the alignment holds every word. pocketsphinx's defaults lose the only path through a
# long text (measured on the English recording repeated: 34 s, 80 words had no alignment); wider ones find it. An
# alignment short of a word is never returned.
BEAM_TRIES = ({}, {"beam": 1e-64, "pbeam": 1e-64, "wbeam": 1e-40}, {"beam": 1e-80, "pbeam": 1e-80, "wbeam": 1e-60})
# pocketsphinx aligns in two passes, each tried at each beam. The first, the forced-alignment search, ends its path in
# the grammar's final state: the text's last word, or a silence after it. The second (`bestpath`, on by default) takes
# a best path through a word lattice built from the first. The two place boundaries about as well on Piper's speech,
# and the second is steadier (the first alone put a pause inside "quick"'s closing k in the int16 copy of the English
# recording, its end 130 ms early, and not in the float copy); but that lattice takes as its end every word still
# alive in the last frame, the text's last or not (fsg_search.c, find_end_node: "End node candidate w12 ... w13 ...
# <sil>"), so its path could stop a word or two early, the word before stretched to the end, and the text was refused
# as too short for the audio. That was seen where the last words are short and said fast (Piper's voice: 2 of 500
# takes of random word orders at 0.75x length, one of them 1 take in 4; "... before the first snow." at 0.55x every
# time), under heavy noise (10 of 60 sentences at 10 dB SNR) and at beams of 1e-80 and wider (the 6.9 s recording
# ended two words early). So the second pass's path is the alignment where it reaches the text's end, else the first
# pass's (docs/evaluation.md, "Word timing on real speech").
PASSES = ({}, {"bestpath": False})
# Each sound takes at least 3 frames of pocketsphinx's model (30 ms at its 100 a second), so speech faster than that
# over a stretch has no path at all (Piper's voice at 0.3x length, ~6.6 words a second: 6 of 500 random word orders).
# Where nothing else aligned, the first pass at 200 frames a second (15 ms a sound) is the last try: it timed those 6
# (median 10.8 ms, p90 26.3 ms against Piper's times), and still found no path in noise, silence, a hum or the wrong
# text.
FAST = {"frate": 200, "bestpath": False}
SEARCHES = (*({**beams, **one} for beams, one in itertools.product(BEAM_TRIES, PASSES)), FAST)
# pocketsphinx starts a word ~50 ms before its sound (measured on Piper's speech with known word times, 40 sentences:
# its starts led by a median 54 ms while its ends were within 8 ms): each start is moved this much later, by at most a
# third of the word (a short "the" keeps its length; docs/evaluation.md, "Word timing on real speech").
START_LEAD_S = 0.04
_WORD = re.compile(r"\w+(?:['’.\-]\w+)*")
_FOLD = str.maketrans({"ß": "ss", "æ": "ae", "Æ": "AE", "ø": "o", "Ø": "O", "œ": "oe", "Œ": "OE", "ł": "l",
                       "Ł": "L", "đ": "d", "Đ": "D", "þ": "th", "Þ": "TH", "ð": "dh", "Ð": "DH", "’": "'",
                       "ı": "i"})
_LETTER_NAMES = {"a": "EY", "b": "B IY", "c": "S IY", "d": "D IY", "e": "IY", "f": "EH F", "g": "JH IY",
                 "h": "EY CH", "i": "AY", "j": "JH EY", "k": "K EY", "l": "EH L", "m": "EH M", "n": "EH N",
                 "o": "OW", "p": "P IY", "q": "K Y UW", "r": "AA R", "s": "EH S", "t": "T IY", "u": "Y UW",
                 "v": "V IY", "w": "D AH B AH L Y UW", "x": "EH K S", "y": "W AY", "z": "Z IY"}
# A rough English letter-to-sound table (ARPABET, the model's phones), longest spelling first at each position.
_LTS = {"ough": "AO", "augh": "AO", "tion": "SH AH N", "sion": "ZH AH N", "tch": "CH", "sch": "S K", "igh": "AY",
        "th": "TH", "sh": "SH", "ch": "CH", "ph": "F", "wh": "W", "ck": "K", "ng": "NG", "qu": "K W", "gh": "",
        "kn": "N", "wr": "R", "ee": "IY", "ea": "IY", "oo": "UW", "ou": "AW", "ow": "OW", "oi": "OY", "oy": "OY",
        "ai": "EY", "ay": "EY", "au": "AO", "aw": "AO", "ei": "EY", "ey": "IY", "ie": "IY", "ue": "UW", "ew": "UW",
        "oa": "OW", "ar": "AA R", "er": "ER", "ir": "ER", "ur": "ER", "or": "AO R",
        "a": "AE", "b": "B", "c": "K", "d": "D", "e": "EH", "f": "F", "g": "G", "h": "HH", "i": "IH", "j": "JH",
        "k": "K", "l": "L", "m": "M", "n": "N", "o": "AA", "p": "P", "q": "K", "r": "R", "s": "S", "t": "T",
        "u": "AH", "v": "V", "w": "W", "x": "K S", "y": "IY", "z": "Z"}
# the clitics English writes after an apostrophe, as they are said after a word the dictionary has not (`couldn't've`
# was "K AW L D N T IY V IY", the letter T and "ve" spelled: too many sounds for fast speech, and the text was refused)
_CLITICS = {"s": "Z", "ve": "AH V", "d": "D", "ll": "AH L", "re": "ER", "m": "M"}
_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


class AlignUnavailable(ValueError):
    """The aligner cannot time this text (or audio): the message says why, in one line."""


@dataclass(frozen=True)
class WordTime:
    word: str  # as written in the text, without its punctuation
    start: float  # seconds from the start of the audio
    end: float


def words_of(text: str) -> list[str]:
    """The words of `text` as written: control tags dropped, punctuation not a word."""
    from .tags import CONTROL_TAG

    return _WORD.findall(CONTROL_TAG.sub(" ", text)) if isinstance(text, str) else []


def word_spans(text: str) -> list[tuple[int, int]]:
    """Where each of `words_of(text)` is in `text`: (start, end) character offsets."""
    from .tags import CONTROL_TAG

    plain = CONTROL_TAG.sub(lambda m: " " * len(m.group()), text)
    return [m.span() for m in _WORD.finditer(plain)]


@functools.cache
def _lexicon() -> dict[str, str]:
    """pocketsphinx's packaged dictionary: word -> phones (its first pronunciation)."""
    return {word: phones[0] for word, phones in _variants().items()}


@functools.cache
def _variants() -> dict[str, list[str]]:
    """pocketsphinx's packaged dictionary: word -> its pronunciations (`the`: DH AH, and `the(2)`: DH IY)."""
    path = Path(_model_dir()) / "cmudict-en-us.dict"
    variants: dict[str, list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            word, _, phones = line.strip().partition(" ")
            if phones:
                variants.setdefault(re.sub(r"\(\d+\)$", "", word), []).append(phones.strip())
    return variants


def _model_dir() -> str:
    try:
        import pocketsphinx
    except ImportError:
        raise AlignUnavailable(f"word timing needs pocketsphinx, which is not installed ({INSTALL})") from None
    return str(Path(pocketsphinx.get_model_path()) / "en-us")


def _fold(word: str) -> str:
    """Lower case, accents dropped and a few letters spelled out, so `café` is looked up as `cafe`."""
    word = unicodedata.normalize("NFKD", word.translate(_FOLD))
    return "".join(c for c in word if not unicodedata.combining(c)).lower()


def _number(digits: str) -> list[str]:
    """Number words for a run of digits: a year (1100-1999, 2010-2099) in pairs, a number below a million (no
    leading zero), else digit by digit."""
    if len(digits) > 6 or (len(digits) > 1 and digits[0] == "0"):
        return [_ONES[int(d)] for d in digits]
    n, words = int(digits), []
    if len(digits) == 4 and (1100 <= n <= 1999 or 2010 <= n <= 2099):  # a year: 1999 is nineteen ninety-nine
        high, low = divmod(n, 100)
        return _number(str(high)) + (["hundred"] if not low else ["oh", _ONES[low]] if low < 10 else _number(str(low)))
    if n >= 1000:
        words += _number(str(n // 1000)) + ["thousand"]
        n %= 1000
        if not n:
            return words
    if n >= 100:
        words += [_ONES[n // 100], "hundred"]
        n %= 100
        if not n:
            return words
    if n >= 20:
        return words + [_TENS[n // 10]] + ([_ONES[n % 10]] if n % 10 else [])
    return words + [_ONES[n]]


def _letter_to_sound(letters: str) -> str:
    """A rough pronunciation of a run of a-z by the table above (a final silent e, soft c and g, doubled letters)."""
    phones: list[str] = []
    i = 0
    if letters[-1] == "e" and len(letters) > 3 and letters[-2] not in "aeiouy":
        letters = letters[:-1]  # a silent final e
    while i < len(letters):
        if i and letters[i] == letters[i - 1] and letters[i] not in "aeiou":
            i += 1  # a doubled consonant is said once
            continue
        nxt = letters[i + 1:i + 2]
        if letters[i] in "cg" and nxt and nxt in "eiy":
            phones.append("S" if letters[i] == "c" else "JH")
            i += 1
            continue
        if letters[i] == "y" and i == 0:
            phones.append("Y")
            i += 1
            continue
        for size in (4, 3, 2, 1):
            part = letters[i:i + size]
            if len(part) == size and part in _LTS:
                phones += _LTS[part].split()
                i += size
                break
        else:
            i += 1  # not a letter the table knows: silent
    return " ".join(phones) or "AH"


def pronounce(word: str) -> str | None:
    """pocketsphinx phones for one word as written: the dictionary's, else a rough one (module docstring); None for
    a word with no Latin letter or digit."""
    lexicon, key = _lexicon(), _fold(word)
    if key in lexicon:
        return lexicon[key]
    if not re.search(r"[a-z0-9]", key):
        return None
    if word.isupper() and key.isalpha() and key.isascii() and 2 <= len(key) <= 6:
        return " ".join(_LETTER_NAMES[c] for c in key)  # an acronym, spelled
    stem, apostrophe, clitic = word.replace("’", "'").rpartition("'")
    if apostrophe and stem and clitic.lower() in _CLITICS:  # dog's, couldn't've: the word, then the clitic's sound
        said = pronounce(stem)
        if said:
            return f"{said} {_CLITICS[clitic.lower()]}"
    parts = re.findall(r"[a-z]+|[0-9]+", key)
    phones = []
    for part in parts:
        if part.isdigit():
            phones += [lexicon[w] for w in _number(part)]
        elif part in lexicon and (len(part) > 1 or len(parts) == 1):
            phones.append(lexicon[part])
        elif len(part) == 1:
            phones.append(_LETTER_NAMES[part])  # `U.S`: its letters
        else:
            phones.append(_letter_to_sound(part))
    return " ".join(phones)


def pronunciations(word: str) -> list[str]:
    """Every dictionary pronunciation of `word`, or its one rough one (`pronounce`); [] for none."""
    found = _variants().get(_fold(word))
    if found:
        return found
    rough = pronounce(word)
    return [rough] if rough else []


def dictionary_entries(names: list[str], words: list[str]) -> dict[str, str]:
    """Dictionary lines for the decoder: each name with each pronunciation of its word (`name(2)`, ... after the
    first)."""
    return {f"{name}({k + 1})" if k else name: phones for name, word in zip(names, words, strict=True)
            for k, phones in enumerate(pronunciations(word))}


def check_language(language) -> str:
    """The primary subtag of `language` (`en-US` -> `en`) if word timing covers it, else AlignUnavailable."""
    code = language.strip().lower().replace("_", "-").split("-")[0] if isinstance(language, str) else ""
    if code not in ALIGN_LANGUAGES:
        raise AlignUnavailable(f"word timing is English only (pocketsphinx's model), not language {language!r}: "
                               "captions for it keep piece-level cues")
    return code


def can_align(text: str, language: str = "en") -> str | None:
    """None if `text` can be word-timed in `language`; else the reason, one line."""
    try:
        check_language(language)
        _model_dir()
    except AlignUnavailable as e:
        return str(e)
    words = words_of(text)
    if not words:
        return "the text has no words to time (nothing but control tags, punctuation or spaces)"
    foreign = [w for w in words if not re.search(r"[a-z0-9]", _fold(w))]
    if len(foreign) * 2 > len(words):
        return (f"the text is mostly not in Latin script ({len(foreign)} of {len(words)} words): pocketsphinx's "
                "model is English only")
    if foreign:
        shown = ", ".join(repr(w) for w in foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        return f"no English pronunciation for {shown} (no Latin letter or digit): pocketsphinx's model is English only"
    return None


def speech_pcm16(samples, sample_rate) -> tuple[bytes, float]:
    """Mono 16 kHz int16 bytes of any samples (float in [-1, 1] or integer PCM; mono, (frames, channels) or
    (channels, frames)) and their duration in seconds."""
    from .audio import resample

    if not isinstance(sample_rate, (int, np.integer)) or isinstance(sample_rate, bool) or sample_rate <= 0:
        raise AlignUnavailable(f"sample rate {sample_rate!r} is not a positive whole number of hertz")
    x = np.asarray(samples)
    if x.ndim == 2 and x.shape[0] < x.shape[1] and x.shape[0] <= 8:
        x = x.T  # (channels, frames)
    if x.ndim not in (1, 2) or x.size == 0:
        raise AlignUnavailable(f"the audio is empty (shape {x.shape}): there is nothing to time the words in"
                               if x.size == 0 else f"audio of shape {x.shape} is neither mono nor (frames, channels)")
    if np.issubdtype(x.dtype, np.integer):
        x = x.astype(np.float64) / float(-np.iinfo(x.dtype).min)
    elif not np.issubdtype(x.dtype, np.floating):
        raise AlignUnavailable(f"audio samples of type {x.dtype} are not numbers")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise AlignUnavailable("the audio has samples that are not finite (NaN or infinity)")
    if x.ndim == 2:
        x = x.mean(axis=1)
    seconds = len(x) / int(sample_rate)
    x = resample(x, int(sample_rate), ALIGN_RATE)
    return (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes(), seconds


def make_decoder(entries: dict[str, str], arpa: str | None = None, **config):
    """A fresh decoder over only `entries` (word -> phones), written to a throwaway dictionary, with the ARPA
    language model `arpa` (text) or none, and `config` (pocketsphinx's options): cheap (~15 ms), and no state shared
    between calls or threads."""
    import pocketsphinx

    model = _model_dir()
    with tempfile.TemporaryDirectory(prefix="higgs-ps-") as tmp:
        words, lm = Path(tmp) / "words.dict", None
        words.write_text("".join(f"{w} {p}\n" for w, p in entries.items()), encoding="utf-8")
        if arpa is not None:
            lm = Path(tmp) / "words.arpa"
            lm.write_text(arpa, encoding="utf-8")
        return pocketsphinx.Decoder(hmm=str(Path(model) / "en-us"), dict=str(words), lm=lm and str(lm),
                                    loglevel="FATAL", **config)


def _align(entries: dict[str, str], names: list[str], pcm: bytes, **search) -> list[tuple[int, int, int]]:
    """(word index, first frame, last frame) of the words `names`, in the order the aligner found them; `search`:
    pocketsphinx's options (one of SEARCHES)."""
    decoder = make_decoder(entries, **search)
    try:
        decoder.set_align_text(" ".join(names))
        decoder.start_utt()
        decoder.process_raw(pcm, full_utt=True)
        decoder.end_utt()
    except RuntimeError as e:
        raise AlignUnavailable(f"pocketsphinx could not align the text: {e}") from None
    return [(int(re.match(r"w(\d+)", s.word)[1]), s.start_frame, s.end_frame) for s in (decoder.seg() or ())
            if re.fullmatch(r"w\d+(\(\d+\))?", s.word)]


def align_words(samples: np.ndarray, sample_rate: int, text: str, language: str = "en") -> list[WordTime]:
    """Each word of `text` (`words_of`), in order, with where it is said in `samples`: start < end, each word starting
    where the one before ended or later, all within the audio. AlignUnavailable when it cannot be timed."""
    reason = can_align(text, language)
    if reason:
        raise AlignUnavailable(reason)
    words = words_of(text)
    pcm, seconds = speech_pcm16(samples, sample_rate)
    names = [f"w{i}" for i in range(len(words))]
    entries = dictionary_entries(names, words)
    for search in SEARCHES:
        frames = _align(entries, names, pcm, **search)
        if [i for i, _, _ in frames] == list(range(len(words))):
            break
    else:
        phones = sum(len(pronounce(w).split()) for w in words)
        raise AlignUnavailable(f"pocketsphinx found no alignment of {len(words)} words ({phones} sounds) in "
                               f"{seconds:.2f} s of audio: too short for the text, or not this text")
    frame_s = 1 / search.get("frate", FRAME_RATE)
    out, last = [], 0.0
    for (_, first, final), word in zip(frames, words, strict=True):
        end = min((final + 1) * frame_s, seconds)
        start = max(first * frame_s, last)
        start = min(start + min(START_LEAD_S, (end - start) / 3), end - 1e-3)
        out.append(WordTime(word, round(start, 3), round(end, 3)))
        last = end
    return out


def word_cues(samples: np.ndarray, sample_rate: int, text: str, language: str = "en") -> list[tuple[int, int, str]]:
    """(start_sample, end_sample, word) of each word at `sample_rate`, for word-level captions."""
    return [(round(w.start * sample_rate), round(w.end * sample_rate), w.word)
            for w in align_words(samples, sample_rate, text, language)]
