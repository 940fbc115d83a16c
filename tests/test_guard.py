"""The guard (`higgs_onnx/guard.py`) on crafted code sequences: every verdict fires where it should, and the takes
that must pass (speech-like variation, long but plausible takes, CJK text) pass. No export needed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from higgs_onnx.guard import (
    GuardOptions,
    RetryPolicy,
    RowWatch,
    expected_rows,
    expected_seconds,
    judge,
    script_of,
    trim_tail,
)

N, FPS, HOP, SR = 8, 25.0, 960, 24000  # the real model's codebooks, frame rate and hop (a test geometry only)
TEXT = "The quick brown fox jumps over the lazy dog while the speech goes on."


def speech_rows(n: int, seed: int = 0) -> np.ndarray:
    """Rows that vary as speech codes do: every row new."""
    return np.random.default_rng(seed).integers(0, 1024, (n, N))


def test_scripts_and_speaking_rates():
    assert [script_of(c) for c in "aЖ7 ,你カ한"] == ["latin", "latin", "latin", None, None, "han", "kana", "hangul"]
    en = expected_seconds("Hello there, how are you today?")  # 24 letters + 5 spaces at 12/s
    assert en == pytest.approx(29 / 12)
    assert expected_seconds("你好，今天天气很好。") == pytest.approx(8 / 3.5)  # punctuation takes no time
    assert expected_seconds("<|emotion:elation|>Hi!") == expected_seconds("Hi!")  # tags are not spoken
    assert expected_rows("Hello there, how are you today?", FPS, N) == round(29 / 12 * FPS) + N - 1


def test_identical_rows_are_a_loop_exactly_loop_rows_after_they_start():
    g = GuardOptions()
    rows = np.concatenate([speech_rows(100), np.tile(speech_rows(1, 1), (60, 1))])
    w = RowWatch(g, 1000, N, FPS)
    fired = next(n for n in range(1, len(rows) + 1) if w.see(rows, n))
    assert w.verdict == "loop" and fired == 100 + 1 + g.loop_rows  # the first repeat is row 101's successor


@pytest.mark.parametrize("period", [2, 3, 8])
def test_a_short_cycle_is_a_loop(period):
    cycle = speech_rows(period, 2)
    rows = np.concatenate([speech_rows(50), np.tile(cycle, (80 // period + 2, 1))])
    w = RowWatch(GuardOptions(), 1000, N, FPS)
    assert any(w.see(rows, n) for n in range(1, len(rows) + 1)) and w.verdict == "loop"


def test_speech_like_rows_and_longer_cycles_pass():
    w = RowWatch(GuardOptions(), 10_000, N, FPS)
    rows = speech_rows(3000, 3)
    assert not any(w.see(rows, n) for n in range(1, len(rows) + 1))
    # a cycle longer than loop_period (9 rows) is not called a loop; codes repeating in one codebook only neither
    w = RowWatch(GuardOptions(), 10_000, N, FPS)
    rows = np.concatenate([speech_rows(20), np.tile(speech_rows(9, 4), (20, 1))])
    assert not any(w.see(rows, n) for n in range(1, len(rows) + 1))
    rows = speech_rows(500, 5)
    rows[:, 0] = 7
    w = RowWatch(GuardOptions(), 10_000, N, FPS)
    assert not any(w.see(rows, n) for n in range(1, len(rows) + 1))


def test_the_delay_ramp_is_not_a_loop():
    """The first N rows hold BOC fill in the late codebooks: a short loop_rows must not count them."""
    g = dataclasses.replace(GuardOptions(), loop_rows=3)
    rows = speech_rows(40)
    rows[:N, 1:] = 1024  # BOC
    rows[:N, 0] = 5
    w = RowWatch(g, 1000, N, FPS)
    assert not any(w.see(rows, n) for n in range(1, len(rows) + 1))


def test_overlong_fires_online_and_a_long_plausible_take_passes():
    g = GuardOptions()
    want = expected_rows(TEXT, FPS, N)
    limit = int(g.overlong_factor * want + g.slack_s * FPS)
    rows = speech_rows(limit + 5)
    w = RowWatch(g, want, N, FPS)
    fired = next(n for n in range(1, len(rows) + 1) if w.see(rows, n))
    assert w.verdict == "overlong" and fired == limit + 1
    slow = speech_rows(2 * want)  # read at half the typical rate: long, but plausible
    assert judge(slow, TEXT, FPS, N, "eoc").name == "good"


def test_judge_names_each_verdict():
    want = expected_rows(TEXT, FPS, N)
    assert judge(speech_rows(want), TEXT, FPS, N, "eoc").good
    assert judge(speech_rows(want), TEXT, FPS, N, "max_rows").name == "max_rows"
    assert judge(speech_rows(want // 5), TEXT, FPS, N, "eoc").name == "short"
    assert judge(speech_rows(10), "Hi.", FPS, N, "eoc").good  # a very short text is never "short"
    loop = np.concatenate([speech_rows(40), np.tile(speech_rows(1, 9), (40, 1))])
    v = judge(loop, TEXT, FPS, N, "loop")
    assert v.name == "loop" and v.figures["at_row"] == 40 + 1 + 32 and "from row 41" in v.reason
    assert judge(speech_rows(3 * want + 200), TEXT, FPS, N, "overlong").name == "overlong"
    assert judge(speech_rows(want), TEXT, FPS, N, "cancelled").name == "cancelled"


def test_cjk_takes_at_their_speaking_rate_pass():
    for text in ("你好，今天天气很好，我们去公园散步吧。", "こんにちは、今日はいい天気ですね。",
                 "안녕하세요, 오늘 날씨가 좋네요."):
        want = expected_rows(text, FPS, N)
        assert judge(speech_rows(int(1.8 * want)), text, FPS, N, "eoc").good, text
        assert judge(speech_rows(want // 4), text, FPS, N, "eoc").name == "short", text


def _tone(seconds: float, amp: float = 0.2) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (amp * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def test_dead_air_inside_the_speech_is_silence_and_a_pause_is_not():
    want = expected_rows(TEXT, FPS, N)
    rows = speech_rows(want)
    gap = np.concatenate([_tone(2), np.zeros(int(2.0 * SR), np.float32), _tone(2)])
    v = judge(rows, TEXT, FPS, N, "eoc", gap, HOP)
    assert v.name == "silence" and v.figures["longest_silence_s"] == pytest.approx(2.0, abs=0.05)
    pause = np.concatenate([_tone(2), np.full(int(1.0 * SR), 1e-3, np.float32), _tone(2)])
    assert judge(rows, TEXT, FPS, N, "eoc", pause, HOP).good
    tail = np.concatenate([_tone(2), np.zeros(3 * SR, np.float32)])  # trailing silence is not inside the speech
    assert judge(rows, TEXT, FPS, N, "eoc", tail, HOP).good


def test_trailing_near_silence_is_trimmed_to_the_kept_tail():
    wav = np.concatenate([_tone(1.0), np.full(2 * SR, 1e-4, np.float32)])
    out = trim_tail(wav, HOP, FPS)
    assert len(out) == SR + int(0.25 * FPS) * HOP  # 1 s of tone and 0.25 s of its tail
    assert len(trim_tail(_tone(1.0), HOP, FPS)) == SR  # nothing to trim
    quiet = np.zeros(SR, np.float32)
    assert len(trim_tail(quiet, HOP, FPS)) == SR  # all silence: left alone (the guard calls it out elsewhere)


def test_retry_policy_cools_and_moves_the_seed_and_stops():
    from higgs_onnx.generation.options import GenerationOptions

    p = RetryPolicy(retries=2)
    o = GenerationOptions(temperature=0.8, seed=5)
    o1 = p.next_options(o, 1)
    assert (o1.seed, o1.temperature) == (5 + p.seed_step, pytest.approx(0.65))
    o2 = p.next_options(o1, 2)
    assert o2.temperature == pytest.approx(0.5) and p.next_options(o2, 3) is None
    assert p.next_options(GenerationOptions(temperature=0.0), 1) is None  # greedy: the same draw again
    assert RetryPolicy(cool=1.0).next_options(o, 1).temperature == pytest.approx(0.3)  # the floor


@pytest.mark.parametrize("bad, match", [
    ({"loop_rows": 0}, "loop_rows must be a whole number >= 1"), ({"loop_period": 2.5}, "loop_period"),
    ({"silence_rms": -1.0}, "silence_rms must be a number >= 0"), ({"overlong_factor": 1.0}, "must be > 1"),
])
def test_bad_guard_options(bad, match):
    with pytest.raises(ValueError, match=match):
        GuardOptions(**bad)


@pytest.mark.parametrize("bad, match", [({"retries": -1}, "retries must be"), ({"retries": True}, "retries must"),
                                        ({"seed_step": 0}, "seed_step"), ({"cool": "x"}, "cool")])
def test_bad_retry_policies(bad, match):
    with pytest.raises(ValueError, match=match):
        RetryPolicy(**bad)
