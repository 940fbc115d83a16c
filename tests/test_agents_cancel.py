"""Cancellation that cannot be lost (issue 52): many agent turns cancelled at random points of their life, over
Cartesia's `cancel` and ElevenLabs' `close_context` (a barge-in) and by sockets closed mid-turn, on a real server
(the tiny int4 export) with a busy loop spinning beside it to widen the race (a cancel landing in the same loop
iteration as a send's result was dropped by `asyncio.wait_for` on Python 3.11, gh-86296, and the context's speaker
then ran on for ever with its slot held). After every cancel the socket must still answer (a probe message sent
after it is answered), and after each batch the scheduler's `slots_in_use`, `kept`, `active` and `in_flight` and
/health's open agent sockets and contexts are back to zero.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
from test_agents import CARTESIA, FIRST, KEY, cartesia, eleven, until

pytestmark = pytest.mark.slow

TURNS = 80  # per protocol
TEXT = FIRST + ". " + "And a second sentence follows it, so there is a segment boundary to cancel at. And a third."
PROBE_S = 15.0  # a socket whose loop is wedged answers no probe: the test fails here instead of hanging


@pytest.fixture(scope="module")
def server(builds, tmp_path_factory):
    from test_server import Server

    s = Server(builds["int4"], tmp_path_factory.mktemp("agents_cancel"), "--api-key", KEY, "--send-timeout", "2")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield s
    busy.kill()
    busy.wait()
    s.stop()
    log = s.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "cleaned up without them" not in log, log[-3000:]


def freed(server) -> None:
    """The batch is over: no job, slot, kept context, socket or context is left."""
    stats = server.wait(lambda s: s["in_flight"] == 0 and s["active"] == 0 and s["kept"] == 0
                        and s["slots_in_use"] == 0, "every cancelled turn's slot and kept context freed")
    assert stats["kept"] == 0 and stats["slots_in_use"] == 0, stats
    for _ in range(100):
        open_ = server.health()["streams"]
        if open_ == {"sockets": 0, "streams": 0}:
            return
        time.sleep(0.05)
    pytest.fail(f"stream sockets or streams left open: {open_}")


def chunks(server, ws, audio, over, n: int) -> None:
    """Read until `n` audio messages (`audio(msg)`) have come, or the turn is over (`over(msg)`: it was shorter)."""
    for _ in range(n):
        try:
            last = until(ws, lambda m: audio(m) or over(m), timeout=PROBE_S)[-1]
        except TimeoutError:
            pytest.fail(f"a turn stopped speaking; /health: {server.health()['scheduler']}")
        if over(last):
            return


def test_cartesia_cancels_at_random_points_never_wedge_or_leak(server):
    rng = random.Random(52)
    points = {"before": 0, "first": 0, "later": 0, "closed": 0}
    ws = cartesia(server)
    try:
        for i in range(TURNS):
            cid = f"t{i}"
            ws.send(json.dumps({**CARTESIA, "context_id": cid, "transcript": TEXT, "continue": False,
                                "add_timestamps": rng.random() < 0.5}))
            point = rng.choices(list(points), weights=(3, 4, 4, 1))[0]
            points[point] += 1
            if point != "before":
                chunks(server, ws, lambda m, c=cid: m["type"] == "chunk" and m["context_id"] == c,
                       lambda m, c=cid: m["type"] in ("done", "error") and m["context_id"] == c,
                       1 if point == "first" else rng.randint(2, 12))
            if point == "closed":  # the client leaves mid-turn; the next turn opens a new socket
                ws.close()
                ws = cartesia(server)
                continue
            time.sleep(rng.random() * 0.01)
            ws.send(json.dumps({"context_id": cid, "cancel": True}))
            ws.send(json.dumps({"context_id": f"probe{i}", "cancel": True}))  # answered once the cancel is done
            got = until(ws, lambda m, i=i: m["type"] == "error" and m["context_id"] == f"probe{i}", timeout=PROBE_S)
            assert got[-1]["code"] == "unknown_context", got[-1]
    finally:
        ws.close()
    assert all(points.values()), points
    freed(server)


def test_elevenlabs_barge_ins_at_random_points_never_wedge_or_leak(server):
    rng = random.Random(86296)
    points = {"before": 0, "first": 0, "later": 0, "closed": 0, "close_socket": 0}
    ws = eleven(server)
    try:
        for i in range(TURNS):
            cid = f"t{i}"
            ws.send(json.dumps({"text": TEXT + " ", "context_id": cid}))  # whole sentences: spoken without a flush
            point = rng.choices(list(points), weights=(3, 4, 4, 1, 1))[0]
            points[point] += 1
            if point != "before":
                chunks(server, ws, lambda m, c=cid: m.get("audio") and m.get("contextId") == c,
                       lambda m, c=cid: (m.get("isFinal") or m.get("error")) and m.get("contextId") == c,
                       1 if point == "first" else rng.randint(2, 12))
            if point in ("closed", "close_socket"):
                if point == "close_socket":
                    ws.send(json.dumps({"close_socket": True}))
                ws.close()
                ws = eleven(server)
                continue
            time.sleep(rng.random() * 0.01)
            ws.send(json.dumps({"context_id": cid, "close_context": True}))
            ws.send(json.dumps({"context_id": f"probe{i}", "close_context": True}))
            got = until(ws, lambda m, i=i: m.get("error") and m.get("contextId") == f"probe{i}", timeout=PROBE_S)
            assert got[-1]["error"] == "unknown_context", got[-1]
    finally:
        ws.close()
    assert all(points.values()), points
    freed(server)

