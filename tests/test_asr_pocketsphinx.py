"""`--asr-model pocketsphinx`: pocketsphinx's packaged English recogniser (`asr.PocketsphinxTranscriber`) on the real
English recording, against seeded white noise, the German recording and the recording cut after its first sentence.

Measured on this machine (one core, numbers of the 6.9 s recording, tests/data/ref_en_24k.wav):
- `hear` (plain recognition, pocketsphinx's default English language model): "we don't got sober but lee are the
  scene thirty thirty three weirdly so so", word error rate 1.0 (0.94-1.0 across its settings), ~2.5 s. Noise is
  heard as nothing: also 1.0. Plain recognition cannot rank takes here, so its test checks only that it hears
  words in speech and none in noise.
- `score` (recognition with a language model of the asked text): "the quick brown fox over the lazy dog speech
  synthesis turns words into sound", 0.125 (two words missed), ~0.2 s. The first sentence alone: 0.5625; the German
  recording: 0.8125; noise: 1.0. The thresholds sit between those: at most 0.3 for the full take (over twice the
  measured 0.125, still under the half-take's 0.56), at least 0.9 for noise, and the order full < half < noise.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pocketsphinx  # noqa: F401 - pinned (requirements.txt): a missing one is a failure, never a silent skip
import pytest

from higgs_onnx.asr import AsrUnavailable, PocketsphinxTranscriber, Transcriber, error_rate
from higgs_onnx.audio import read_audio

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def asr():
    return Transcriber.load(Path("pocketsphinx"))  # as inference.py's --asr-model (type=Path) hands it over


@pytest.fixture(scope="module")
def en():
    data, sr = read_audio(DATA / "ref_en_24k.wav")
    return data[:, 0], sr, (DATA / "ref_en_24k.txt").read_text(encoding="utf-8").strip()


def _noise(sr, seconds=3.0):
    return np.random.default_rng(0).normal(0, 0.1, int(seconds * sr)).astype(np.float32)


def test_the_literal_name_loads_the_packaged_model(asr, tmp_path, monkeypatch):
    assert isinstance(asr, PocketsphinxTranscriber) and asr.name == "pocketsphinx"
    assert isinstance(Transcriber.load("pocketsphinx"), PocketsphinxTranscriber)
    monkeypatch.chdir(tmp_path)  # a faster-whisper folder named pocketsphinx is still that folder
    (tmp_path / "pocketsphinx").mkdir()
    (tmp_path / "pocketsphinx" / "model.bin").write_bytes(b"")
    with pytest.raises(AsrUnavailable, match="faster-whisper"):  # not installed here; a broken folder where it is
        Transcriber.load(Path("pocketsphinx"))


def test_plain_recognition_hears_words_in_speech_and_none_in_noise(asr, en, capsys):
    x, sr, text = en
    t = time.perf_counter()
    heard = asr.hear(x, sr)
    took = time.perf_counter() - t
    noise = asr.hear(_noise(sr), sr)
    with capsys.disabled():
        print(f"\n  hear: {heard!r} {error_rate(text, heard)} in {took:.2f} s; noise: {noise!r}")
    assert len(heard.split()) >= 8 and len(noise.split()) <= 2
    assert asr.hear(np.zeros(0, np.float32), sr) == ""


def test_scoring_a_take_ranks_speech_over_a_half_take_over_noise(asr, en, capsys):
    x, sr, text = en
    t = time.perf_counter()
    full = asr.score(text, x, sr)
    took = time.perf_counter() - t
    half = asr.score(text, x[: int(3.1 * sr)], sr)  # the first sentence only
    noise = asr.score(text, _noise(sr), sr)
    de, de_sr = read_audio(DATA / "ref_de_22k_stereo.wav")
    german = asr.score(text, de, de_sr)  # speech, but not this text
    with capsys.disabled():
        print(f"\n  score: {full} in {took:.2f} s; half {half['wer']}, German {german['wer']}, noise {noise['wer']}")
    assert set(full) == {"heard", "wer"} and full["wer"] <= 0.3
    assert noise["wer"] >= 0.9 and german["wer"] >= 0.6
    assert full["wer"] < half["wer"] < noise["wer"]


def test_text_it_cannot_hear_scores_every_take_alike(asr, en):
    x, sr, _ = en
    got = asr.score("你好世界", x, sr)
    assert got["cer"] == 1.0 and got["heard"] == "" and "English only" in got["not_heard"]
