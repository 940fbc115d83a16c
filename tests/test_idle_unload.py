"""`--idle-unload SECONDS`: an idle server lets its model go and loads it again for the next request.

On a real server (tests/servers.py): the model is unloaded after the idle time (`/ready` 200 with `model_state`
"unloaded", `/health`'s scheduler, `higgs_model_loaded` 0 in `/metrics`, the process's resident memory down), the
next request loads it and gets its speech, and a voice saved before speaks the same bytes after the reload; a stream
keeping its KV context keeps the model loaded until it closes; the Wyoming server does the same. In process, the
scheduler (`generation/scheduler.py`): every ONNX Runtime session is freed (weak references die), the rows after a
reload equal the rows before, and a load that fails fails the waiting request in one line while the next one loads.
Bad values of the flag are one line and exit 2 at both commands.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import DATA, POLLS, served

ROOT = Path(__file__).resolve().parent.parent
REF = DATA / "ref_en_24k.wav"
REF_TEXT = (DATA / "ref_en_24k.txt").read_text().strip()
BODY = {"model": "tts-1", "input": "Hello there world.", "response_format": "pcm", "max_rows": 120, "seed": 3,
        "deterministic": True}
IDLE = "1"  # seconds: the tests wait about this long (plus the loop's half-second wake-up) for an unload


def vm_rss(pid: int) -> int:
    """The process's resident memory now (bytes): VmRSS of /proc/PID/status."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024


def model_state(server) -> str:
    r = server.http.get("/ready")
    assert r.status_code == 200 and r.json()["ready"] is True, r.text  # unloaded is still ready (a balancer routes)
    return r.json()["model_state"]


def until_state(server, want: str) -> None:
    for _ in range(POLLS):
        if model_state(server) == want:
            return
        time.sleep(0.05)
    pytest.fail(f"the model never became {want}: {server.stats()}")


def gauges(server) -> dict:
    r = server.http.get("/metrics")
    assert r.status_code == 200, r.text
    return {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples if not s.labels}


def speak(server, **extra) -> bytes:
    r = server.http.post("/v1/audio/speech", json={**BODY, **extra})
    assert r.status_code == 200 and len(r.content) > 1000, r.text[:300]
    return r.content


@pytest.mark.slow
def test_an_idle_server_unloads_its_model_and_the_next_request_loads_it(builds, tmp_path):
    with served(builds["fp32"], tmp_path, "--idle-unload", IDLE) as s:
        assert model_state(s) == "loaded" and gauges(s)["higgs_model_loaded"] == 1
        r = s.http.post("/v1/voices", data={"name": "narrator", "transcript": REF_TEXT},
                        files={"file": ("ref.wav", REF.read_bytes(), "application/octet-stream")})
        assert r.status_code == 201, r.text
        voiced = speak(s, voice="narrator")
        t0 = time.perf_counter()
        speak(s)
        warm_s = time.perf_counter() - t0
        loaded = vm_rss(s.proc.pid)
        until_state(s, "unloaded")
        stats = s.stats()
        assert stats["model_state"] == "unloaded" and stats["unloads"] == 1 and stats["idle_unload_s"] == 1.0
        m = gauges(s)
        assert m["higgs_model_loaded"] == 0 and m["higgs_model_unloads_total"] == 1, m
        unloaded = vm_rss(s.proc.pid)
        assert unloaded < loaded - (4 << 20), (loaded, unloaded)  # the sessions' memory went back to the system

        t0 = time.perf_counter()
        speak(s)  # loads the model first, then speaks
        cold_s = time.perf_counter() - t0
        stats = s.stats()
        assert stats["model_state"] == "loaded" and stats["reloads"] == 1 and stats["reload_s"] > 0, stats
        m = gauges(s)
        assert m["higgs_model_loaded"] == 1 and m["higgs_model_reloads_total"] == 1, m
        assert m["higgs_model_reload_seconds"] == stats["reload_s"]
        print(f"\nRSS loaded {loaded / 2**20:.0f} MB, unloaded {unloaded / 2**20:.0f} MB; reload "
              f"{stats['reload_s']:.3f} s; a request {warm_s:.3f} s warm, {cold_s:.3f} s after the unload")

        until_state(s, "unloaded")
        assert speak(s, voice="narrator") == voiced  # the saved voice survives the reload, byte for byte
        assert s.stats()["unloads"] == 2 and s.stats()["reloads"] == 2


@pytest.mark.slow
def test_a_stream_keeping_its_kv_context_keeps_the_model_loaded(builds, tmp_path):
    """The kept KV context of a text-in stream waiting for more text counts as busy: no unload under it; closing
    the stream gives it back, and the idle model is let go."""
    from websockets.sync.client import connect

    with served(builds["fp32"], tmp_path, "--idle-unload", IDLE) as s:
        with connect(s.url.replace("http://", "ws://") + "/v1/audio/speech/stream") as ws:
            ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "max_rows": 120}))
            assert json.loads(ws.recv(timeout=60))["type"] == "session.configured"
            ws.send(json.dumps({"type": "input.text", "text": "Hello there world. "}))
            ws.send(json.dumps({"type": "input.commit"}))
            while True:
                m = ws.recv(timeout=60)
                if isinstance(m, str) and json.loads(m)["type"] == "audio.done":
                    break
            s.wait(lambda st: st["kept"] == 1 and st["in_flight"] == 0, "the stream keeping its context")
            time.sleep(3 * float(IDLE))
            assert model_state(s) == "loaded" and s.stats()["unloads"] == 0
        until_state(s, "unloaded")
        assert s.stats()["kept"] == 0


@pytest.mark.slow
def test_the_wyoming_server_unloads_when_idle_and_speaks_after(builds, tmp_path):
    from wyoming.audio import AudioChunk, AudioStop
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize

    log = tmp_path / "wyoming.log"
    proc = subprocess.Popen([sys.executable, "-m", "higgs_onnx.wyoming", "--model-path", str(builds["fp32"]),
                             "--uri", "tcp://127.0.0.1:0", "--voices", str(tmp_path / "voices"), "--idle-unload",
                             IDLE, "--log-level", "INFO"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=log.open("w"))
    try:
        line = proc.stdout.readline()
        port = int(re.search(r"\('127\.0\.0\.1', (\d+)\)", line).group(1))
        assert ", unloaded after 1 s idle" in line, line

        def said(what: str) -> bool:
            for _ in range(POLLS):
                if what in log.read_text():
                    return True
                time.sleep(0.05)
            return False

        async def synthesize() -> int:
            import asyncio

            async with AsyncTcpClient("127.0.0.1", port) as c:
                await c.write_event(Synthesize(text="Hello there world.").event())
                samples = 0
                while True:
                    e = await asyncio.wait_for(c.read_event(), 120)
                    if AudioChunk.is_type(e.type):
                        samples += len(AudioChunk.from_event(e).audio) // 2
                    if AudioStop.is_type(e.type):
                        return samples

        import asyncio

        assert asyncio.run(synthesize()) > 0
        loaded = vm_rss(proc.pid)
        assert said("the model is unloaded"), log.read_text()[-2000:]
        assert vm_rss(proc.pid) < loaded
        assert asyncio.run(synthesize()) > 0
        assert said("the model is loaded again"), log.read_text()[-2000:]
    finally:
        proc.terminate()
        proc.wait(30)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.mark.parametrize("module", ["higgs_onnx.serve", "higgs_onnx.wyoming"])
def test_a_bad_idle_time_is_one_line_and_exit_2(module, tmp_path):
    for value in ("0", "-3", "abc", "nan", "inf"):
        r = subprocess.run([sys.executable, "-m", module, "--model-path", str(tmp_path), "--idle-unload", value],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "--idle-unload" in lines[0] and "a number of seconds > 0" in lines[0], lines[0]


# -- the scheduler in process ----------------------------------------------------------------------------------------
def wait_state(sched, want: str) -> None:
    for _ in range(POLLS):
        if sched.model_state == want:
            return
        time.sleep(0.05)
    pytest.fail(f"the scheduler never became {want}: {sched.stats()}")


def rows(tts, sched, text: str = "Hello there world.", **kw) -> np.ndarray:
    req = tts.request(text, seed=5, max_rows=120, slot=tts.slot_positions, **kw)
    return sched.submit(req, "stream").wait().rows


@pytest.mark.slow
def test_the_scheduler_lets_every_session_go_and_makes_them_again(builds):
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(builds["fp32"], verify=False)
    voice = tts.make_voice(REF, REF_TEXT)
    with tts.scheduler(2, tts.slot_positions, idle_unload=0.5).start() as sched:
        before, cloned = rows(tts, sched), rows(tts, sched, voice=voice)
        sessions = [weakref.ref(p.session) for p in tts.parts._sessions.values()]
        names = tts.parts.loaded()
        assert len(sessions) >= 5
        wait_state(sched, "unloaded")
        assert not tts.loaded and all(s() is None for s in sessions)  # nothing holds a session
        assert sched.pool is None and tts.voices.stats()["voices"] == 1  # the voice stays
        assert np.array_equal(rows(tts, sched), before) and np.array_equal(rows(tts, sched, voice=voice), cloned)
        assert tts.parts.loaded() == names and sched.stats()["reloads"] == 1


@pytest.mark.slow
def test_a_kept_context_holds_the_model_until_it_is_given_back(tts):
    with tts.scheduler(2, tts.slot_positions, idle_unload=0.3).start() as sched:
        h = sched.submit(tts.request("Hello there.", seed=1, max_rows=60, slot=tts.slot_positions), None, keep=True)
        h.wait()
        time.sleep(1.2)
        assert sched.model_state == "loaded" and sched.stats()["kept"] == 1
        h.release()
        wait_state(sched, "unloaded")


@pytest.mark.slow
def test_a_load_that_fails_fails_the_waiting_request_and_the_next_one_loads(builds, tmp_path):
    from higgs_onnx.runtime.model import HiggsTTS

    folder = Path(shutil.copytree(builds["fp32"], tmp_path / "export"))
    tts = HiggsTTS(folder, verify=False)
    with tts.scheduler(1, tts.slot_positions, idle_unload=0.3).start() as sched:
        first = rows(tts, sched)
        wait_state(sched, "unloaded")
        graph = folder / "text_embed.onnx"
        graph.rename(graph.with_suffix(".gone"))
        with pytest.raises(Exception) as failed:  # noqa: PT011 - ONNX Runtime's own error for the missing file
            rows(tts, sched)
        assert "text_embed" in str(failed.value) and "\n" not in str(failed.value).strip(), failed.value
        assert sched.model_state == "unloaded" and sched.stats()["failed"] == 1
        graph.with_suffix(".gone").rename(graph)
        assert np.array_equal(rows(tts, sched), first) and sched.model_state == "loaded"
