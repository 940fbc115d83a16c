"""Chunked prefill through the server's scheduler: a new clone prompt is prefilled in chunks between the running
streams' decoder steps, so they keep advancing; every job's rows still equal the same request made alone.

Structural, never wall-clock: the core scheduler's engine is wrapped to log each prefill call (request, positions)
and each decoder step (the requests it advanced), and the assertions read that log and the scheduler's counters.
Also here: a job cancelled in the middle of its prefill, and a shutdown with jobs running and waiting, both give
every slot back and leave no thread behind; and `/health` of the real server reports the new figures.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from servers import LONG, served

from higgs_onnx.generation.options import GenerationOptions
from higgs_onnx.serve.scheduler import JobScheduler, ShuttingDown

pytestmark = pytest.mark.slow

REC = Path(__file__).resolve().parents[1] / "higgs_onnx" / "assets" / "recordings"
RUNNING = [f"Stream number {i} keeps talking while a new voice joins, {'on and on ' * i}." for i in range(3)]
CLONE_TEXT = " ".join(["word"] * 40) + "."  # after the voice's 230-position prefix: a prompt of ~300 positions
CHUNK = 16


@pytest.fixture(scope="module")
def voice(tts):
    return tts.make_voice(str(REC / "ref_en_24k.flac"), (REC / "ref_en_24k.txt").read_text().strip())


async def until(check, what: str, polls: int = 1200):
    """Poll `check()` (0.01 s apart) until truthy; fail after `polls` polls instead of hanging."""
    for _ in range(polls):
        if value := check():
            return value
        await asyncio.sleep(0.01)
    pytest.fail(f"{what}: not reached")


def record(sched: JobScheduler) -> list[tuple]:
    """Log the core engine's calls, in order: ("prefill", request, positions) and ("step", [requests advanced])."""
    log: list[tuple] = []
    engine = sched.core.engine
    prefill, step = engine.prefill, engine.step

    def logged_prefill(req, limit=None):
        n = prefill(req, limit)
        log.append(("prefill", req, n))
        return n

    def logged_step(requests, keep=frozenset()):
        log.append(("step", [r for r in requests if r.decoding]))
        return step(requests, keep)

    engine.prefill, engine.step = logged_prefill, logged_step
    return log


async def collect(job) -> np.ndarray:
    chunks = [c async for c in job]
    assert chunks and chunks[-1].is_last
    return chunks[-1].rows


def running_options(i: int) -> GenerationOptions:
    return GenerationOptions(seed=10 + i, max_rows=260, ignore_eoc=True)  # still running when the clone comes


def test_a_clone_prompt_is_prefilled_in_chunks_while_the_streams_go_on(tts, voice):
    clone_opts = GenerationOptions(seed=5, max_rows=120)
    probe = tts.request(CLONE_TEXT, voice=voice, options=clone_opts, slot=3072)
    assert 280 <= len(probe.prompt) <= 340 and probe.cached == len(voice.prefix), (len(probe.prompt), probe.cached)
    to_prefill = len(probe.prompt) - probe.cached  # the voice's prefix is restored from its saved KV state
    alone = [tts.generate(t, options=running_options(i)).rows for i, t in enumerate(RUNNING)]
    alone.append(tts.generate(CLONE_TEXT, voice=voice, options=clone_opts).rows)

    sched = JobScheduler(tts, max_batch=4, max_queue=4, prefill_chunk=CHUNK)
    log = record(sched)
    sched.start()
    try:
        async def main():
            running = [sched.submit(t, options=running_options(i)) for i, t in enumerate(RUNNING)]
            tasks = [asyncio.ensure_future(collect(j)) for j in running]
            await until(lambda: (s := sched.stats())["active"] == 3 and s["prefilling"] == 0 and
                        s["decoder_steps"] >= 3, "the three streams decoding")
            before = sched.stats()
            clone = sched.submit(CLONE_TEXT, voice=voice, options=clone_opts)
            tasks.append(asyncio.ensure_future(collect(clone)))
            return [j.request for j in running], clone, before, await asyncio.gather(*tasks)

        running, clone, before, rows = asyncio.run(main())
        after = sched.stats()
    finally:
        sched.stop()
    mine = [i for i, e in enumerate(log) if e[0] == "prefill" and e[1] is clone.request]
    sizes = [log[i][2] for i in mine]
    # the clone's prompt (after its cached prefix) went in chunks of at most CHUNK positions
    assert sum(sizes) == to_prefill and max(sizes) <= CHUNK and len(sizes) == math.ceil(to_prefill / CHUNK) >= 4, sizes
    assert after["prefill_calls"] - before["prefill_calls"] == len(sizes), (before, after)
    assert after["prefill_positions"] - before["prefill_positions"] == to_prefill
    # between its first and its last chunk the three streams were stepped after every chunk: they kept advancing
    steps = [e[1] for e in log[mine[0]:mine[-1]] if e[0] == "step"]
    assert len(steps) == len(sizes) - 1, steps
    assert all(set(map(id, running)) <= set(map(id, s)) and clone.request not in s for s in steps)
    assert after["longest_stall_s"] > 0 and after["mean_batch"] > 2.5
    for want, got in zip(alone, rows, strict=True):  # fp32: batched and chunked, the same rows as alone
        np.testing.assert_array_equal(got, want)
    assert (after["active"], after["kept"], after["in_flight"], after["finished"]) == (0, 0, 0, 4), after
    assert after["slots_in_use"] == 0


def test_a_job_cancelled_mid_prefill_gives_its_slot_back(tts, voice):
    """The client leaves while its prompt is being prefilled (one position per chunk: many chunks): the job ends
    cancelled at the next step, the others finish, every slot is back, and a new job still runs."""
    sched = JobScheduler(tts, max_batch=2, max_queue=2, prefill_chunk=1)
    log = record(sched)
    sched.start()
    try:
        async def main():
            busy = sched.submit(RUNNING[0], options=running_options(0))
            task = asyncio.ensure_future(collect(busy))
            await until(lambda: sched.stats()["decoder_steps"] >= 3, "a stream decoding")
            victim = sched.submit(CLONE_TEXT, voice=voice, options=GenerationOptions(seed=1, max_rows=60))
            await until(lambda: sum(e[0] == "prefill" and e[1] is victim.request for e in log) >= 3,
                        "the victim prefilling")
            victim.cancel()
            got = [c async for c in victim]  # ends without a chunk, without an error
            assert got == [] and victim.outcome == "cancelled"
            assert victim.request.embeds is None and victim.request.cache is None  # its slot went back
            await task
            again = sched.submit(RUNNING[1], options=GenerationOptions(seed=2, max_rows=40))
            await collect(again)
            return victim

        victim = asyncio.run(main())
        stats = sched.stats()
    finally:
        sched.stop()
    chunks = sum(e[0] == "prefill" and e[1] is victim.request for e in log)
    assert chunks < len(victim.request.prompt) - victim.request.cached  # it did not prefill to the end
    assert (stats["active"], stats["kept"], stats["in_flight"], stats["slots_in_use"]) == (0, 0, 0, 0), stats
    assert (stats["cancelled"], stats["finished"], stats["failed"]) == (1, 2, 0), stats


def test_shutdown_with_jobs_in_flight_frees_everything(tts):
    """stop() while jobs run and wait: each ends with "shutting down", the pool is empty, no thread is left."""
    sched = JobScheduler(tts, max_batch=2, max_queue=4)
    sched.start()

    async def main():
        long = GenerationOptions(max_rows=2000, ignore_eoc=True)
        jobs = [sched.submit(t, options=long) for t in [*RUNNING, LONG[:200]]]
        # both slots taken (on a busy machine the second job may still be prefilling after the first's steps)
        await until(lambda: sched.stats()["decoder_steps"] >= 3 and sched.core.codec_worker._thread
                    and sched.stats()["waiting"] <= 2, "a batch running, its audio made")
        assert sched.stats()["waiting"] == 2
        threads.extend([sched.core._thread, sched.core.codec_worker._thread])
        sched.stop()  # what the app's lifespan does, from the event loop
        errors = []
        for job in jobs:
            try:
                async for _ in job:
                    pass
            except ShuttingDown as e:
                errors.append(str(e))
        with pytest.raises(ShuttingDown):  # nothing is queued on a stopped scheduler (it would never run)
            sched.submit(RUNNING[0])
        return errors

    threads: list[threading.Thread] = []  # the loop's and the codec worker's
    errors = asyncio.run(main())
    stats = sched.stats()
    assert len(errors) == 4 and all("shutting down" in e for e in errors), errors
    assert (stats["active"], stats["waiting"], stats["kept"], stats["in_flight"], stats["failed"]) == \
        (0, 0, 0, 0, 4), stats
    assert sched.core.pool.in_use == 0 and stats["slots_in_use"] == 0
    assert len(threads) == 2 and not any(t.is_alive() for t in threads), threads


def test_health_reports_the_scheduling_figures(builds, tmp_path):
    """The real server (uvicorn) with --prefill-chunk 16, the official openai client: three streams, then a clone
    request; /health shows its prefill in chunks and the codec's time."""
    with served(builds["fp32"], tmp_path, "--prefill-chunk", str(CHUNK)) as server:
        stats = server.stats()
        new = ("prefill_calls", "prefill_positions", "longest_stall_s", "codec_busy_s", "rows", "kept")
        assert all(k in stats for k in new) and stats["prefill_chunk"] == CHUNK, stats
        assert "prefill chunk 16" in server.banner
        with (REC / "ref_en_24k.flac").open("rb") as f:
            r = server.http.post("/v1/voices", data={"name": "clone", "transcript": (REC / "ref_en_24k.txt")
                                                     .read_text().strip()}, files={"file": ("ref.flac", f)})
        assert r.status_code == 201, r.text
        client = server.client()
        stop = threading.Event()

        def stream(i: int) -> int:
            with client.audio.speech.with_streaming_response.create(
                    model="higgs-tts-3", voice="default", input=LONG, response_format="pcm",
                    extra_body={"seed": i, "max_rows": 1500}) as resp:
                n = 0
                for piece in resp.iter_bytes():
                    n += len(piece)
                    if stop.is_set():
                        break  # leaving cancels the job
                return n

        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream, i) for i in range(3)]
            before = server.wait(lambda s: s["active"] == 3 and s["prefilling"] == 0, "three streams decoding")
            audio = client.audio.speech.create(model="higgs-tts-3", voice="clone", input=CLONE_TEXT,
                                               response_format="pcm", extra_body={"seed": 3, "max_rows": 60})
            during = server.stats()
            stop.set()
            assert all(f.result() > 0 for f in streams)
        assert len(audio.content) > 0
        calls = during["prefill_calls"] - before["prefill_calls"]
        positions = during["prefill_positions"] - before["prefill_positions"]
        assert positions > 3 * CHUNK and calls == math.ceil(positions / CHUNK), (before, during)
        assert during["longest_stall_s"] > 0 and during["codec_busy_s"] > 0
        end = server.settle()
        assert (end["active"], end["kept"], end["waiting"], end["slots_in_use"]) == (0, 0, 0, 0), end
        assert end["cancelled"] >= 3, end


def test_a_client_leaving_mid_prefill_frees_its_slot(builds, tmp_path):
    """Over HTTP: a request whose long prompt is prefilled one position per step (`--prefill-chunk 1`) beside a
    running stream; its client closes the connection while /health shows it prefilling. The app cancels the job,
    its slot comes back at the next step (only the stream's is in use), and it did not prefill to its end."""
    with served(builds["fp32"], tmp_path, "--prefill-chunk", "1", "--max-batch", "2") as server:
        stop = threading.Event()

        def stream() -> int:
            body = {"model": "tts-1", "input": LONG, "response_format": "pcm", "max_rows": 2400}
            with server.http.stream("POST", "/v1/audio/speech", json=body) as r:
                for _ in r.iter_bytes():
                    if stop.is_set():
                        break
                return r.status_code

        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(stream)
            server.wait(lambda s: s["active"] == 1 and s["prefilling"] == 0 and s["decoder_steps"] > 0,
                        "a stream decoding")
            before = server.stats()
            body = json.dumps({"model": "tts-1", "input": LONG, "response_format": "pcm"}).encode()
            host, port = server.url.removeprefix("http://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                server.wait(lambda st: st["prefilling"] == 1 and st["prefill_calls"] > before["prefill_calls"] + 5,
                            "the second request prefilling")
            left = server.wait(lambda st: st["cancelled"] == before["cancelled"] + 1, "the job cancelled")
            assert (left["active"], left["slots_in_use"], left["prefilling"]) == (1, 1, 0), left
            positions = left["prefill_positions"] - before["prefill_positions"]
            assert 5 < positions < 500, positions  # LONG's prompt is ~600 positions: it stopped part way
            stop.set()
            assert running.result() == 200
        end = server.settle()
        assert (end["active"], end["slots_in_use"], end["kept"], end["waiting"]) == (0, 0, 0, 0), end
