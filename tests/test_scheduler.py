"""The server's scheduler without HTTP: concurrent jobs share decoder calls, each gets its own codes and audio,
a full queue refuses, a cancelled job frees its slot, requests are built for the pool's slot, and an exclusive
(deterministic) job runs alone and equals the request made alone, to the bit. Waits are bounded polls of the
scheduler's counters, never wall-clock assertions."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from higgs_onnx.generation.contract import ContractError
from higgs_onnx.generation.options import POOL_POSITIONS, GenerationOptions
from higgs_onnx.serve.scheduler import JobScheduler, QueueFull

pytestmark = pytest.mark.slow
TEXTS = [f"Request number {i} asks for its own words, {'and a few more ' * i}then stops." for i in range(6)]


async def until(check, what: str, polls: int = 1200):
    """Poll `check()` (0.05 s apart) until truthy; fail after `polls` polls instead of hanging."""
    for _ in range(polls):
        if value := check():
            return value
        await asyncio.sleep(0.05)
    pytest.fail(f"{what}: not reached")


async def collect(job):
    chunks = [c async for c in job]
    return chunks[-1].rows, np.concatenate([c.samples for c in chunks])


def test_concurrent_jobs_are_batched_and_independent(tts):
    options = [GenerationOptions(seed=i, max_rows=300) for i in range(len(TEXTS))]
    alone = [tts.generate(t, options=o) for t, o in zip(TEXTS, options, strict=True)]
    sched = JobScheduler(tts, max_batch=4, max_queue=8)
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
    sched = JobScheduler(tts, max_batch=1, max_queue=1)
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
            b.cancel()  # b first: it leaves the queue before a's slot could be given to it
            a.cancel()
            for job in (a, b):
                async for _ in job:
                    pass
            return await until(lambda: (s := sched.stats())["in_flight"] == 0 and s, "nothing in flight")

        stats = asyncio.run(main())
    finally:
        sched.stop()
    assert stats["in_flight"] == 0 and stats["active"] == 0
    assert stats["cancelled"] == 2 and stats["finished"] == 0 and stats["started"] == 1  # b never got a slot


def test_requests_are_built_for_the_pool_slot(tts, monkeypatch):
    """The pool is made with `slot_positions` and every request is checked against it: a request that fits the
    model's 4096 positions but not a 3072-position slot is refused at submit, not cut."""
    made = []
    pool = tts.backend.pool
    monkeypatch.setattr(tts.backend, "pool", lambda slots, max_len: made.append((slots, max_len)) or
                        pool(slots, max_len))
    sched = JobScheduler(tts, max_batch=2, max_queue=1)
    assert sched.slot_positions == min(tts.facts.max_positions, POOL_POSITIONS) == 3072
    sched.start()
    try:
        async def main():
            with pytest.raises(ContractError, match="batch slot here holds 3072") as e:
                sched.submit(TEXTS[0], options=GenerationOptions(max_rows=3500))
            assert e.value.code == "context_length_exceeded" and e.value.param == "max_rows"
            tts.request(TEXTS[0], options=GenerationOptions(max_rows=3500))  # fine with a cache of its own
            job = sched.submit(TEXTS[0], options=GenerationOptions(seed=1, max_rows=50))
            return [c async for c in job]

        chunks = asyncio.run(main())
    finally:
        sched.stop()
    assert made == [(2, 3072)] and chunks[-1].is_last
    assert sched.stats()["submitted"] == 1  # the refused one never entered


def test_exclusive_job_runs_alone_and_equals_the_lone_request(tts4):
    """int4 (MatMulNBits kernels can round differently for several rows than for one): a deterministic job made
    while others run waits for the batch to drain, runs alone, and its rows equal `tts.generate`'s and its samples
    `tts.stream`'s exactly; the jobs behind it run after it, batched again."""
    text, opts = TEXTS[2], GenerationOptions(seed=7)
    want = tts4.generate(text, options=opts)
    want_samples = np.concatenate([c.samples for c in tts4.stream(text, options=opts)])
    sched = JobScheduler(tts4, max_batch=4, max_queue=8)
    sched.start()
    try:
        async def main():
            long = {"max_rows": 600, "ignore_eoc": True}  # still running when the exclusive job comes
            before = [sched.submit(t, options=GenerationOptions(seed=i, **long)) for i, t in enumerate(TEXTS[:3])]
            await until(lambda: sched.stats()["active"] >= 2, "a batch running")
            det = sched.submit(text, options=opts, exclusive=True)
            after = [sched.submit(t, options=GenerationOptions(seed=10 + i, max_rows=400))
                     for i, t in enumerate(TEXTS[3:])]
            results = await asyncio.gather(*(collect(j) for j in [*before, det, *after]))
            return before, det, after, results

        before, det, after, results = asyncio.run(main())
        stats = sched.stats()
    finally:
        sched.stop()
    rows, samples = results[len(before)]
    assert det.widest == 1 and stats["exclusive"] == 1 and stats["exclusive_widest_batch"] == 1, stats
    np.testing.assert_array_equal(rows, want.rows)
    np.testing.assert_array_equal(samples, want_samples)  # the same incremental codec: bit for bit
    assert samples.shape == want.waveform.shape  # the one-shot decode: same length, equal to float noise
    assert np.abs(samples - want.waveform).max() <= 2e-4 * np.abs(want.waveform).max()
    assert max(j.widest for j in before) >= 2 and max(j.widest for j in after) >= 2  # the others still batched
    assert stats["in_flight"] == 0 and stats["finished"] == len(TEXTS) + 1


def test_a_cancelled_exclusive_job_does_not_hold_the_queue(tts4):
    sched = JobScheduler(tts4, max_batch=2, max_queue=4)
    sched.start()
    try:
        async def main():
            running = sched.submit(TEXTS[5], options=GenerationOptions(max_rows=2000, ignore_eoc=True))
            await until(lambda: sched.stats()["active"] == 1, "the first job running")
            det = sched.submit(TEXTS[0], options=GenerationOptions(max_rows=50), exclusive=True)
            behind = sched.submit(TEXTS[1], options=GenerationOptions(max_rows=50))
            assert sched.stats()["waiting"] == 2  # the exclusive job waits for the drain, the next one behind it
            det.cancel()
            chunks = [c async for c in behind]  # admitted beside the running job once the exclusive one is gone
            running.cancel()
            async for _ in det:
                pass
            async for _ in running:
                pass
            return chunks, await until(lambda: (s := sched.stats())["in_flight"] == 0 and s, "nothing in flight")

        chunks, stats = asyncio.run(main())
    finally:
        sched.stop()
    assert chunks[-1].is_last and stats["exclusive"] == 0 and stats["cancelled"] == 2 and stats["finished"] == 1


def test_one_redraw_driver_for_whole_takes_and_server_jobs(builds):
    """The core scheduler's `_retake` draws a degenerate take again for every door: a server job (audio streamed)
    gets each redrawn take's chunks, then a `Redrawn` event with that take's record; the chunks after the last one
    are the kept take, equal to the bit to a fresh request made with the kept take's seed and temperature (what the
    server's own loop of new jobs sent before); `tts.generate(retries=)` (audio="speech") records the same takes."""
    import dataclasses

    from higgs_onnx.generation.scheduler import Redrawn
    from higgs_onnx.guard import GuardOptions, RetryPolicy
    from higgs_onnx.runtime.model import HiggsTTS

    strict = HiggsTTS(builds["fp32"], verify=False, guard=GuardOptions(overlong_factor=1.01, slack_s=0.0))
    text, opts = TEXTS[1], GenerationOptions(seed=3, temperature=0.8)
    sched = JobScheduler(strict, max_batch=2, max_queue=2)
    sched.start()
    try:
        async def main():
            job = sched.submit(text, options=opts, retry=RetryPolicy(retries=2))
            items = [c async for c in job]
            last = job.takes[-1]
            fresh = sched.submit(text, options=dataclasses.replace(opts, seed=last["seed"],
                                                                   temperature=last["temperature"]))
            return job, items, [c async for c in fresh]

        job, items, fresh = asyncio.run(main())
        stats = sched.stats()
    finally:
        sched.stop()
    marks = [i for i, item in enumerate(items) if isinstance(item, Redrawn)]
    assert len(marks) == 2 and [items[i].take for i in marks] == job.takes[:2]
    assert [t["verdict"] for t in job.takes] == ["overlong"] * 3
    assert [t["seed"] for t in job.takes] == [3, 3 + RetryPolicy.seed_step, 3 + 2 * RetryPolicy.seed_step]
    kept = items[marks[-1] + 1:]
    np.testing.assert_array_equal(np.concatenate([c.samples for c in kept]),
                                  np.concatenate([c.samples for c in fresh]))
    np.testing.assert_array_equal(kept[-1].rows, fresh[-1].rows)
    assert stats["submitted"] == 2 and stats["finished"] == 2 and stats["in_flight"] == 0  # one job, its redraws in it
    whole = strict.generate(text, options=opts, retries=2)
    assert whole.takes == job.takes and whole.verdict.name == "overlong"
