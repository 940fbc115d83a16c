"""The one scheduler (`generation/scheduler.py`) on its own: chunked prefill interleaved with the running batch, fixed
chunks and a request's breaks deciding every prefill call, codec work off the decoder loop, cancel, KV continuation
rules, a caller-driven scheduler that cannot start a request says so, the thread mode stops cleanly, and a decode
row cannot ride along a prefill chunk on the GQA graph (why the two are separate calls). Rows are compared bit for
bit on the tiny fp32 export."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from higgs_onnx.generation.codec_stream import StreamOptions
from higgs_onnx.generation.scheduler import Cancelled, PrefillPolicy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "higgs_onnx" / "assets" / "recordings" / "ref_en_24k.flac"
TEXTS = [f"Request number {i} asks for its own words, {'and a few more ' * i}then stops." for i in range(4)]


@pytest.fixture(scope="module")
def voice(tts):
    return tts.make_voice(REF, REF.with_suffix(".txt").read_text().strip())


def test_a_long_prompt_is_prefilled_in_chunks_while_the_batch_goes_on(tts, voice):
    sched = tts.scheduler(4, 1024, PrefillPolicy(chunk=16))
    running = [sched.submit(tts.request(t, seed=i, max_rows=300, slot=1024)) for i, t in enumerate(TEXTS[:3])]
    for _ in range(3):
        sched.step()
    clone = tts.request(TEXTS[3], ref_audio=REF, ref_text=REF.with_suffix(".txt").read_text().strip(), seed=7,
                        max_rows=300, slot=1024)
    clone.prefix = clone.cached = None  # prefill the whole clone prompt, reference included (~300 positions)
    clone.cached = 0
    assert len(clone.prompt) > 250
    seen = []  # (rows of the running requests, clone positions prefilled) after every step
    h = sched.submit(clone)
    while not h.finished.is_set():
        sched.step()
        seen.append((sum(r.request.n for r in running), clone.prefilled, clone.embeds is None))
    during = [rows for rows, done, whole in seen if not whole and done > 0]
    assert len(during) >= len(clone.prompt) // 16 - 1  # one chunk per step ...
    assert during == sorted(during) and during[-1] - during[0] >= 3 * (len(during) - 1)  # ... and 3 rows each
    sched.run_until_idle()
    stats = sched.stats()
    assert stats["prefill_calls"] >= len(clone.prompt) // 16 and stats["active"] == 0
    alone = [tts.generate(t, seed=i, max_rows=300).rows for i, t in enumerate(TEXTS[:3])]
    for r, want in zip(running, alone, strict=True):
        np.testing.assert_array_equal(r.wait().generated, want)
    sched.close()


def test_fixed_chunks_and_breaks_decide_every_prefill_call(tts):
    """A fixed chunk applies alone too (a batch job's calls do not depend on what else runs), and a request's
    `breaks` end a call wherever they fall (how a resumed long-form piece replays the calls that built its cache);
    the rows are those of one whole-prompt prefill here (fp32)."""
    req = tts.request(TEXTS[2], seed=3, max_rows=40, slot=512)
    calls = []
    real = tts.backend.prefill
    tts.backend.prefill = lambda cache, embeds: calls.append(len(embeds)) or real(cache, embeds)
    try:
        sched = tts.scheduler(2, 512, PrefillPolicy(chunk=8))
        n = len(req.prompt)
        req.breaks = (3, 4, 5, 13)
        h = sched.submit(req)
        sched.run_until_idle()
        got = h.wait().generated
        sched.close()
    finally:
        tts.backend.prefill = real
    want = [3, 1, 1, 8]
    left = n - 13
    want += [8] * (left // 8) + ([left % 8] if left % 8 else [])
    assert calls == want, (calls, n)
    np.testing.assert_array_equal(got, tts.generate(TEXTS[2], seed=3, max_rows=40).rows)


def test_the_codec_runs_off_the_decoder_loop(tts, monkeypatch):
    """A slow codec does not hold the decoder back: rows go on while a chunk is being decoded."""
    real = tts.codec_stream

    def slow(options):
        codec = real(options)
        push = codec.push

        def slow_push(frames):
            time.sleep(0.05)
            return push(frames)

        codec.push = slow_push
        return codec

    monkeypatch.setattr(tts, "codec_stream", slow)
    sched = tts.scheduler()
    # 120 rows: 26 chunks, the decoder ~100 rows ahead of the codec at its furthest (300 rows took 13 s, 5.8 s now)
    h = sched.submit(tts.request(TEXTS[2], seed=1, max_rows=120), "stream", StreamOptions(first_frames=4,
                                                                                         chunk_frames=4))
    arrivals = [(c.rows_done, h.request.n) for c in h.chunks()]
    sched.close()
    assert len(arrivals) > 3
    assert any(now > taken + 2 for taken, now in arrivals[:-1])  # the decoder ran ahead of the codec


def test_cancel_frees_the_slot_at_the_next_step(tts):
    sched = tts.scheduler(1, 512)
    a = sched.submit(tts.request(TEXTS[0], max_rows=400, slot=512, ignore_eoc=True))
    b = sched.submit(tts.request(TEXTS[1], seed=1, max_rows=60, slot=512))
    for _ in range(5):
        sched.step()
    assert a.state == "running" and b.state == "waiting"
    a.cancel()
    b.wait()
    with pytest.raises(Cancelled):
        a.wait()
    assert sched.stats()["cancelled"] == 1 and sched.stats()["finished"] == 1 and sched.pool.in_use == 0
    sched.close()


def test_continuation_rules(tts):
    sched = tts.scheduler(1, 1024)
    plain = sched.submit(tts.request(TEXTS[0], max_rows=60, slot=1024))
    with pytest.raises(ValueError, match="keep=True"):
        sched.submit(tts.request(TEXTS[1], slot=1024), after=plain)
    kept = sched.submit(tts.request(TEXTS[0], max_rows=60, slot=1024), keep=True)
    prev = kept.wait()
    with pytest.raises(ValueError, match="start with the earlier request"):
        tts.request(TEXTS[1], slot=1024, continues=prev)  # no history turn: not a continuation of it
    # the one slot is held by the kept request: a request that needs a new slot can never start
    stuck = sched.submit(tts.request(TEXTS[1], max_rows=60, slot=1024))
    with pytest.raises(RuntimeError, match="held by finished requests kept"):
        stuck.wait()
    nxt = tts.request(TEXTS[1], slot=1024, max_rows=60, history=[(TEXTS[0], prev.generated.copy())], continues=prev)
    assert nxt.cached == prev.positions
    sched.submit(nxt, after=kept).wait()  # takes over the kept slot
    stuck.cancel()
    sched.close()
    assert sched.pool.in_use == 0


def test_thread_mode_serves_many_threads_and_stops(tts):
    sched = tts.scheduler(2, 512).start()
    results = {}

    def client(i):
        results[i] = sched.submit(tts.request(TEXTS[i], seed=i, max_rows=80, slot=512), "speech").speech()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    sched.stop()
    assert sorted(results) == [0, 1, 2, 3] and all(s.waveform.size for s in results.values())
    assert sched.stats()["mean_batch"] > 1.2
    assert not [t for t in threading.enumerate() if t.name in ("higgs-engine", "higgs-codec")]


def test_a_decode_row_cannot_ride_along_a_prefill_chunk_on_the_gqa_graph(builds):
    """Measured for issue 21: one (B, S) call mixing decode rows and a prefill chunk is refused by the pinned
    GroupQueryAttention kernel, so the scheduler runs them as separate calls. If a new onnxruntime accepts it,
    this fails: measure it then (benchmarks/ride_along.py)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from ride_along import probe

    r = probe(builds["int4"])
    assert not r["supported"] and "batch_size must be 1" in r["reason"]


def test_a_mailbox_hands_items_over_in_order_and_times_out():
    from higgs_onnx.generation.scheduler import Mailbox

    box = Mailbox()
    with pytest.raises(queue.Empty):
        box.get_nowait()
    t0 = time.perf_counter()
    with pytest.raises(queue.Empty):
        box.get(timeout=0.1)
    assert 0.09 <= time.perf_counter() - t0 < 1.0
    for i in range(3):
        box.put(i)  # rings an already rung bell: no error, no block
    assert [box.get(timeout=0) for _ in range(3)] == [0, 1, 2]
    threading.Timer(0.1, box.put, ("late",)).start()
    assert box.get(timeout=5) == "late"  # a waiter wakes when the item comes, not at its timeout


def test_closing_a_scheduler_whose_lock_a_ctrl_c_left_held_still_ends(tts):
    """A KeyboardInterrupt can land between a lock's acquire and its `try`, leaving it held (the hang this
    guards against: `queue.Queue` in a handle, then closing waited forever). Closing must end, failing every
    request, however many there are."""
    sched = tts.scheduler(2, 256)
    handles = [sched.submit(tts.request(t, seed=i, max_rows=50, slot=256), "speech") for i, t in enumerate(TEXTS)]
    sched.step()
    sched._lock.acquire()  # as a Ctrl-C would leave it
    t0 = time.perf_counter()
    sched.close()
    assert time.perf_counter() - t0 < 6
    assert all(h.finished.is_set() and h.error is not None for h in handles)
    sched._lock.release()


def test_a_stop_keeps_its_grace_when_a_step_outlasts_it(tts, monkeypatch):
    """A decoder call longer than the stop's timeout (a big prompt on the 4b model): stop() returns after the
    timeout, every request ends ("shutting down"), and the loop's daemon thread finishes its call on its own."""
    import time

    sched = tts.scheduler(2, 512)
    slow, started = threading.Event(), threading.Event()
    real = sched.backend.prefill

    def prefill(cache, embeds):
        started.set()
        slow.wait(10)  # held until the test lets it go
        return real(cache, embeds)

    monkeypatch.setattr(sched.backend, "prefill", prefill)
    sched.start()
    handles = [sched.submit(tts.request(TEXTS[i], seed=i, max_rows=40, slot=512), "speech") for i in range(2)]
    assert started.wait(30)
    t0 = time.perf_counter()
    sched.stop(timeout=0.5)
    assert time.perf_counter() - t0 < 4.0  # 0.5 s join + the close (its lock waits 2 s at most)
    for h in handles:
        with pytest.raises(Exception, match="shutting down"):
            h.wait()
    slow.set()
