"""What a speech recogniser hears in generated audio, and its error rate against the text asked for.

Used by `best_of` (`--takes N --asr-model DIR`) to rank takes by what is actually said, and by `eval.py`'s
intelligibility section. The recogniser is faster-whisper (optional: `pip install faster-whisper`); the scoring is
jiwer's (pinned). Text mostly in scripts written without spaces (Chinese, Japanese; see `guard.script_of`) is scored
by character error rate, everything else by word error rate, after lower-casing, dropping punctuation and the
inline control tags.

Run time never downloads a model: `Transcriber.load(DIR)` takes a local faster-whisper folder (a CTranslate2
conversion: `model.bin`, `config.json`, `tokenizer.json`, ...). `eval.py` alone may let faster-whisper fetch one by
name (`$HIGGS_ASR_MODEL`), as it always did. `Transcriber.load("pocketsphinx")` (the literal name) is
pocketsphinx's English model, packaged in its wheel (`PocketsphinxTranscriber`): English only, and far weaker.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np

ASR_RATE = 16000  # Whisper hears 16 kHz
SPACELESS = ("han", "kana")  # scripts that do not separate words with spaces: scored by characters
INSTALL = "pip install faster-whisper==1.2.1"
POCKETSPHINX = "pocketsphinx"  # the name that loads pocketsphinx's packaged English recogniser
_PUNCT = re.compile(r"[^\w\s]", re.UNICODE)


class AsrUnavailable(ValueError):
    """No recogniser can be loaded: a usage error (exit 2), said before any work."""


def normalise(text: str) -> str:
    from .generation.prompt import TAG_PATTERN

    text = _PUNCT.sub(" ", TAG_PATTERN.sub(" ", text).lower())
    return " ".join(text.split())


def metric_for(text: str) -> str:
    """"cer" when most of the text's letters are in a script written without spaces, else "wer"."""
    from .guard import script_of

    scripts = [script_of(ch) for ch in text if ch.isalpha()]
    spaceless = sum(s in SPACELESS for s in scripts)
    return "cer" if scripts and spaceless * 2 >= len(scripts) else "wer"


def error_rate(text: str, heard: str) -> tuple[str, float]:
    """(metric, rate) of `heard` against `text`: 0 is every word (character) right; it can exceed 1 when far
    more is heard than was asked for. Nothing heard for a text with words is 1."""
    import jiwer

    metric = metric_for(text)
    truth, said = normalise(text), normalise(heard)
    if metric == "cer":
        truth, said = truth.replace(" ", ""), said.replace(" ", "")
    if not truth:
        return metric, 0.0 if not said else 1.0
    if not said:
        return metric, 1.0
    return metric, float(jiwer.cer(truth, said) if metric == "cer" else jiwer.wer(truth, said))


class Transcriber:
    """A loaded faster-whisper model (`name`: its folder or hub name)."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name

    @classmethod
    def load(cls, name: str | Path, *, local_only: bool = True) -> Transcriber:
        """`local_only` (run time): `name` must be a faster-whisper folder on this machine; nothing is fetched.
        `name` "pocketsphinx" (unless it is such a folder): pocketsphinx's packaged English model."""
        if str(name) == POCKETSPHINX and not (Path(name) / "model.bin").is_file():
            return PocketsphinxTranscriber.load_packaged()
        if importlib.util.find_spec("faster_whisper") is None:
            raise AsrUnavailable(f"scoring takes by ASR needs faster-whisper, which is not installed ({INSTALL})")
        if local_only:
            folder = Path(name)
            if not folder.is_dir():
                raise AsrUnavailable(f"--asr-model {folder}: no such folder (a local faster-whisper model; models "
                                     "are never downloaded at run time)")
            missing = [f for f in ("model.bin", "config.json") if not (folder / f).is_file()]
            if missing:
                raise AsrUnavailable(f"--asr-model {folder}: not a faster-whisper model folder (no "
                                     f"{', '.join(missing)})")
        from faster_whisper import WhisperModel

        try:
            model = WhisperModel(str(name), device="cpu", compute_type="int8", local_files_only=local_only)
        except Exception as e:  # noqa: BLE001 - a broken folder, an unknown name: one line, not a trace
            raise AsrUnavailable(f"could not load ASR model {str(name)!r}: {type(e).__name__}: {e}") from None
        return cls(model, str(name))

    def hear(self, wav: np.ndarray, sample_rate: int) -> str:
        from .audio import resample

        segments, _ = self.model.transcribe(resample(np.asarray(wav, np.float32), sample_rate, ASR_RATE),
                                            beam_size=1)
        return " ".join(s.text.strip() for s in segments).strip()

    def score(self, text: str, wav: np.ndarray, sample_rate: int) -> dict:
        """{"heard": ..., "wer" | "cer": rate} of one take."""
        heard = self.hear(wav, sample_rate)
        metric, rate = error_rate(text, heard)
        return {"heard": heard, metric: round(rate, 4)}


class PocketsphinxTranscriber(Transcriber):
    """pocketsphinx's English acoustic model and dictionary, packaged in its wheel (no folder, nothing fetched).

    `hear` is plain recognition with its default English language model. On this project's English recording (a
    clean 6.9 s read) that hears almost nothing right (measured word error rate 0.94-1.0: "we don't got sober but
    lee are the scene ..."), and seeded white noise is heard as nothing (also 1.0): as a ranking of takes it would
    tie them all. `score` therefore hears each take with a language model built from the asked text itself (its
    words, in its order; pocketsphinx.lm): a take that says the text is heard nearly right (0.125 on the recording),
    one that stops halfway, repeats, or says something else loses words (0.4-0.8), noise is heard as nothing (1.0).
    Only the text's words can be heard that way, so the rate is a ranking, not an absolute measure. Text with no
    English pronunciation (`align.can_align`: mostly non-Latin script) is not heard: rate 1.0 for every take, the
    reason under "not_heard", and the takes keep their ranking by rows."""

    def __init__(self, decoder):
        import threading

        super().__init__(decoder, POCKETSPHINX)
        self._lock = threading.Lock()  # one decoder: one utterance at a time

    @classmethod
    def load_packaged(cls) -> PocketsphinxTranscriber:
        if importlib.util.find_spec("pocketsphinx") is None:
            raise AsrUnavailable("--asr-model pocketsphinx needs pocketsphinx, which is not installed "
                                 "(pip install pocketsphinx==5.1.1)")
        import pocketsphinx

        try:
            return cls(pocketsphinx.Decoder(loglevel="FATAL"))
        except Exception as e:  # noqa: BLE001 - a broken install: one line, not a trace
            raise AsrUnavailable(f"could not load pocketsphinx's English model: {type(e).__name__}: {e}") from None

    @staticmethod
    def _decode(decoder, wav: np.ndarray, sample_rate: int) -> str:
        from .align import AlignUnavailable, speech_pcm16

        try:
            pcm, _ = speech_pcm16(wav, sample_rate)
        except AlignUnavailable:  # no audio (or no numbers): nothing is heard
            return ""
        decoder.start_utt()
        decoder.process_raw(pcm, full_utt=True)
        decoder.end_utt()
        hyp = decoder.hyp()
        return hyp.hypstr.strip() if hyp is not None else ""

    def hear(self, wav: np.ndarray, sample_rate: int) -> str:
        with self._lock:
            return self._decode(self.model, wav, sample_rate)

    def score(self, text: str, wav: np.ndarray, sample_rate: int) -> dict:
        """{"heard": ..., "wer" | "cer": rate} of one take, heard with the text's own language model (see above)."""
        import io

        from pocketsphinx.lm import ArpaBoLM

        from .align import can_align, dictionary_entries, make_decoder, words_of

        metric = metric_for(text)
        reason = can_align(text)
        if reason:
            return {"heard": "", metric: 1.0, "not_heard": reason}
        written: dict[str, str] = {}  # each word of the text once, lower case -> as first written (NASA, not nasa)
        for word in words_of(text):
            written.setdefault(word.lower(), word)
        lm = ArpaBoLM(text=" ".join(w.lower() for w in words_of(text)) + "\n", add_start=True)
        lm.compute()
        arpa = io.StringIO()
        lm.write(arpa)
        decoder = make_decoder(dictionary_entries(list(written), list(written.values())), arpa.getvalue())
        heard = self._decode(decoder, wav, sample_rate)
        metric, rate = error_rate(text, heard)
        return {"heard": heard, metric: round(rate, 4)}
