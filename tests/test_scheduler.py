"""The server's scheduler without HTTP: concurrent jobs share decoder calls, each gets its own codes and audio,
a full queue refuses, a cancelled job frees its slot."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from higgs_onnx.generation.options import GenerationOptions
from higgs_onnx.runtime.model import HiggsTTS
from higgs_onnx.serve.scheduler import QueueFull, Scheduler

pytestmark = pytest.mark.slow
TEXTS = [f"Request number {i} asks for its own words, {'and a few more ' * i}then stops." for i in range(6)]


@pytest.fixture(scope="module")
def tts(builds):
    return HiggsTTS(builds["fp32"], verify=False)


async def collect(job):
    chunks = [c async for c in job]
    return chunks[-1].rows, np.concatenate([c.samples for c in chunks])


def test_concurrent_jobs_are_batched_and_independent(tts):
    options = [GenerationOptions(seed=i, max_rows=300) for i in range(len(TEXTS))]
    alone = [tts.generate(t, options=o) for t, o in zip(TEXTS, options, strict=True)]
    sched = Scheduler(tts, max_batch=4, max_queue=8)
    sched.start()
    try:
        async def main():
            jobs = [sched.submit(t, options=o) for t, o in zip(TEXTS, options, strict=True)]
            return await asyncio.gather(*(collect(j) for j in jobs))

        results = asyncio.run(main())
        stats = sched.stats()
    finally:
        sched.stop()
    assert stats["mean_batch"] > 1.5 and stats["in_flight"] == 0
    for want, (rows, audio) in zip(alone, results, strict=True):
        np.testing.assert_array_equal(rows, want.rows)
        assert audio.shape == want.waveform.shape
        assert np.abs(audio - want.waveform).max() <= 2e-4 * np.abs(want.waveform).max()


def test_full_queue_refuses_and_cancel_frees(tts):
    sched = Scheduler(tts, max_batch=1, max_queue=1)
    sched.start()
    try:
        async def main():
            long = GenerationOptions(max_rows=2000, ignore_eoc=True)
            a = sched.submit(TEXTS[0], options=long)
            b = sched.submit(TEXTS[1], options=long)
            with pytest.raises(QueueFull, match="queues 1"):
                sched.submit(TEXTS[2])
            with pytest.raises(ValueError, match="empty"):
                sched.submit("   ")
            first = await anext(aiter(a))  # a is generating; b waits
            assert first.samples.size > 0
            a.cancel()
            b.cancel()
            for job in (a, b):
                async for _ in job:
                    pass
            for _ in range(100):
                if sched.stats()["in_flight"] == 0:
                    break
                await asyncio.sleep(0.05)
            return sched.stats()

        stats = asyncio.run(main())
    finally:
        sched.stop()
    assert stats["in_flight"] == 0
