"""Scoring takes by what a recogniser hears (`higgs_onnx.asr`): error rates per script with jiwer, clear errors when
no recogniser can be loaded (before any work), and `best_of` keeping the take heard best. No Whisper weights exist
on this machine, so the one stand-in here is the recogniser in the last test (it hears each take's length); the
scoring, the ranking and the records are the real code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from higgs_onnx.asr import AsrUnavailable, Transcriber, error_rate, metric_for
from higgs_onnx.job.run import best_of

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Hello there, a line for the guard."


def test_word_error_rate_ignores_case_punctuation_and_tags():
    assert error_rate("Hello there, world!", "hello there world") == ("wer", 0.0)
    assert error_rate("one two three four", "one two tree four") == ("wer", 0.25)
    assert error_rate("<|laughter|> Hi you.", "hi you") == ("wer", 0.0)  # a control tag is not spoken
    assert error_rate("one two", "one two three four") == ("wer", 1.0)  # rambling past the text counts
    assert error_rate("one two", "") == ("wer", 1.0)
    assert error_rate("", "") == ("wer", 0.0)


def test_chinese_and_japanese_are_scored_by_characters_korean_by_words():
    assert metric_for("你好世界") == "cer" and metric_for("こんにちは、世界") == "cer"
    assert metric_for("안녕하세요 세계") == "wer" and metric_for("Hello 世界 and more words") == "wer"
    assert error_rate("你好，世界。", "你好世") == ("cer", 0.25)
    assert error_rate("你好世界", "你 好 世 界") == ("cer", 0.0)  # spaces a recogniser puts in do not count


def test_no_recogniser_is_one_clear_error(tmp_path):
    import importlib.util

    if importlib.util.find_spec("faster_whisper") is None:
        with pytest.raises(AsrUnavailable, match="needs faster-whisper, which is not installed"):
            Transcriber.load(tmp_path)
    else:
        with pytest.raises(AsrUnavailable, match="not a faster-whisper model folder"):
            Transcriber.load(tmp_path)
        with pytest.raises(AsrUnavailable, match="no such folder"):
            Transcriber.load(tmp_path / "nowhere")


@pytest.mark.slow
def test_the_command_line_refuses_asr_before_any_work(builds, tmp_path):
    for extra, want in ((["--takes", "3", "--asr-model", str(tmp_path)], "faster-whisper"),
                        (["--asr-model", str(tmp_path)], "--asr-model needs --takes N")):
        r = subprocess.run([sys.executable, "inference.py", "--model-path", builds["int4"], "--text", TEXT,
                            "--out", tmp_path / "x.wav", *extra], capture_output=True, text=True, cwd=ROOT,
                           timeout=120)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.wav").exists()


class LengthHearer:
    """Stands in for Whisper (no weights here): hears the text right only in the longest take it is given."""

    name = "length-hearer"

    def __init__(self):
        self.heard: list[int] = []

    def score(self, text, wav, sample_rate):
        self.heard.append(len(wav))
        return {"heard": str(len(wav)), "wer": 0.0 if len(wav) == self.longest else 1.0}


@pytest.mark.slow
def test_best_of_keeps_the_take_heard_best(builds):
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(builds["fp32"])
    plain = best_of(tts, TEXT, 4, seed=3)
    good = [t for t in plain.takes if t["verdict"] == "good"]
    assert len(good) >= 2 and len({t["rows"] for t in good}) >= 2  # the test needs takes of different lengths
    longest = max(good, key=lambda t: (t["rows"], -t["take"]))
    hearer = LengthHearer()
    hearer.longest = len(tts.generate(TEXT, seed=longest["seed"]).waveform)
    s = best_of(tts, TEXT, 4, seed=3, asr=hearer)
    assert len(hearer.heard) == len(good)  # every good take heard, no degenerate one
    kept = next(t for t in s.takes if t["kept"])
    assert kept["take"] == longest["take"] and kept["wer"] == 0.0 and len(s.waveform) == hearer.longest
    for t in s.takes:  # heard: the takes good before listening; misheard: those the hearer got wrong
        assert ("wer" in t and "heard" in t) == (t["verdict"] in ("good", "misheard"))
        assert (t["verdict"] == "misheard") == (t.get("wer", 0.0) > 0.15), t
    # every good take the hearer got wrong is misheard, so heard best wins over the length score
    assert sum(t["verdict"] == "misheard" for t in s.takes) == sum(t["rows"] != longest["rows"] for t in good)
