"""The model's voice cache: bounded by bytes (least recently used out), and a deleted server voice leaves it."""

from pathlib import Path

import numpy as np
import pytest

from higgs_onnx.runtime.model import HiggsTTS, Voice
from higgs_onnx.runtime.voice_cache import VoiceCache, voice_bytes

DATA = Path(__file__).resolve().parent / "data"


def fake_voice(n: int) -> Voice:
    return Voice(rows=np.zeros((n, 8), np.int64), ref_text=None, prefix=[1, 2],
                 state={"k": np.zeros((1, 2, 2, 4), np.float32)}, model_id="m")


def test_lru_by_bytes():
    size = voice_bytes(fake_voice(10))
    cache = VoiceCache(max_bytes=3 * size)
    voices = {i: cache.put(i, fake_voice(10)) for i in range(3)}
    assert len(cache) == 3 and cache.get(0) is voices[0]  # 0 is now the most recent
    cache.put(3, fake_voice(10))
    assert cache.get(1) is None and cache.get(0) is voices[0] and cache.stats()["evictions"] == 1
    assert cache.stats()["bytes"] == 3 * size
    big = fake_voice(1000)
    assert cache.put("big", big) is big and cache.get("big") is None  # larger than the budget: used, not kept
    assert cache.forget(voices[0]) == 1 and cache.get(0) is None and cache.stats()["bytes"] == 2 * size
    again = cache.put(2, fake_voice(10))
    assert again is voices[2]  # a key kept first wins (two threads making the same voice)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="voice cache size"):
        VoiceCache(bad)


@pytest.mark.slow
def test_the_model_keeps_at_most_its_budget_and_forgets_deleted_voices(builds):
    probe = HiggsTTS(builds["int4"], verify=False)
    wav, sr = np.random.default_rng(0).uniform(-0.3, 0.3, 48000).astype(np.float32), 24000
    one = voice_bytes(probe.make_voice((wav, sr)))
    tts = HiggsTTS(builds["int4"], verify=False, voice_cache_bytes=2 * one + one // 2)  # room for two
    made = [tts.make_voice((np.roll(wav, i), sr)) for i in range(5)]
    assert tts.voices.stats()["voices"] == 2 and tts.voices.stats()["evictions"] == 3
    assert tts.make_voice((np.roll(wav, 4), sr)) is made[4]  # still cached: not made again
    assert tts.forget_voice(made[4]) and tts.voices.stats()["voices"] == 1
    assert not tts.forget_voice(made[0])  # evicted long ago


@pytest.mark.slow
def test_create_delete_cycles_keep_the_cache_empty(builds, tmp_path):
    """50 voices created and deleted through the server's store path: nothing stays in either cache."""
    from higgs_onnx.serve.voices import VoiceStore

    tts = HiggsTTS(builds["int4"], verify=False)
    store = VoiceStore(tmp_path / "voices", tts.model_id)
    wav = np.random.default_rng(1).uniform(-0.3, 0.3, 48000).astype(np.float32)
    for i in range(50):
        voice = tts.make_voice((np.roll(wav, 7 * i), 24000))
        store.add(f"v{i}", voice)
        loaded = store.delete(f"v{i}")
        assert loaded is voice and tts.forget_voice(loaded)
    assert tts.voices.stats()["voices"] == 0 and tts.voices.stats()["bytes"] == 0 and store.names() == []
