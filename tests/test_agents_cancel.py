"""Cancellation that cannot be lost (issue 52): turns cut at random points of their life over every stream
door (`agent_clients.cut_turns`: Cartesia's `cancel`, ElevenLabs' two barge-ins, the text-in WebSocket's close, and
sockets closed mid-turn), from four client threads at once, on a real server (the tiny int4 export) with a busy
loop spinning beside it to widen the race (a cancel landing in the same loop iteration as a send's result was
dropped by `asyncio.wait_for` on Python 3.11, gh-86296, and the context's speaker then ran on for ever with its slot
held). After every cancel the socket must still answer (a probe sent after it is answered), and after each batch
the scheduler's `slots_in_use`, `kept`, `active` and `in_flight` and /health's open stream sockets and streams are
back to zero. The suite cuts 400 turns (100 per batch: about a minute and a half on two cores);
`HIGGS_CUT_TURNS=2000` cuts the issue's 2,000, as `benchmarks/agents.py --cut-turns 2000 --busy` does with its
figures (docs/agents.md "Measured").
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter

import pytest
from agent_clients import KEY, POINTS, PROTOCOLS, cut_turns
from servers import served

pytestmark = pytest.mark.slow

TURNS = int(os.environ.get("HIGGS_CUT_TURNS", "400"))
BATCHES = 4


@pytest.fixture(scope="module")
def server(builds, tmp_path_factory):
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with served(builds["int4"], tmp_path_factory.mktemp("agents_cancel"), "--api-key", KEY, "--send-timeout",
                    "2", "--max-batch", "4") as s:
            yield s
            log = s.log.read_text()
            assert "cleaned up without them" not in log, log[-3000:]
    finally:
        busy.kill()
        busy.wait()


def freed(server) -> None:
    """The batch is over: no job, slot, kept context, socket or stream is left."""
    stats = server.wait(lambda s: s["in_flight"] == 0 and s["active"] == 0 and s["kept"] == 0
                        and s["slots_in_use"] == 0, "every cut turn's slot and kept context freed")
    assert stats["kept"] == 0 and stats["slots_in_use"] == 0, stats
    for _ in range(100):
        open_ = server.health()["streams"]
        if open_ == {"sockets": 0, "streams": 0}:
            return
        time.sleep(0.05)
    pytest.fail(f"stream sockets or streams left open: {open_}")


def test_two_thousand_turns_cut_at_random_points_never_wedge_or_leak(server):
    cuts = []
    for batch in range(BATCHES):
        cuts += cut_turns(server, TURNS // BATCHES, seed=52 + batch)
        freed(server)
    assert len(cuts) == TURNS
    seen = Counter((c.protocol, c.point) for c in cuts)
    for protocol in PROTOCOLS:  # every door cut at every point (the WebSocket's cut is always a close)
        for point in POINTS:
            assert seen[protocol, point] > 0 or protocol == "websocket" and point != "closed", (protocol, point)
    silences = sorted(c.silence_s for c in cuts if c.silence_s is not None)
    assert silences[-1] < 5.0, silences[-5:]  # the probe bounds it; a wedged context would never answer
