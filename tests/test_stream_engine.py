"""The stream engine (`higgs_onnx/serve/streams/engine.py`) under a door written from docs/agents.md's sketch, as
written there: a new door is one small codec. The engine runs on the real tiny model and scheduler; the transport is
an in-memory one (what a WebSocket would carry), so every message and the close code are seen."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from higgs_onnx.serve.streams.engine import OPEN, Engine, Transport

pytestmark = pytest.mark.slow
DOC = Path(__file__).resolve().parents[1] / "docs" / "agents.md"
LONG = " ".join(["This sentence goes on for a while so that a stop arrives in the middle of it."] * 4)


def sketch() -> type:
    """The codec of docs/agents.md's "One engine" section, executed as written."""
    section = DOC.read_text().split("## One engine", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.splitlines()) <= 60, "the sketch is a short file"
    space: dict = {}
    exec(compile(code, str(DOC), "exec"), space)  # noqa: S102 - our own docs' code
    return space["Plain"]


class Memory(Transport):
    """Messages in from a queue, out into a list."""

    def __init__(self):
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.sent: list = []
        self.closed: list = []

    async def receive(self, limit: int):
        return await self.incoming.get()

    async def send(self, obj) -> None:
        self.sent.append(obj)

    async def close(self, code) -> None:
        self.closed.append(code)


@pytest.fixture(scope="module")
def svc(tts, tmp_path_factory):
    from higgs_onnx.serve.limits import Timeouts
    from higgs_onnx.serve.scheduler import JobScheduler
    from higgs_onnx.serve.service import SpeechService

    scheduler = JobScheduler(tts, max_batch=2)
    scheduler.start()
    yield SpeechService(tts, scheduler, tmp_path_factory.mktemp("voices"), None, Timeouts(), "default", 5.0)
    scheduler.stop()


async def run(svc, *messages, until=None):
    """The sketch's door fed `messages` (a message after `until(sent)` holds: each `until` waits for its condition)."""
    transport = Memory()
    engine = Engine(transport, sketch(), svc, 30.0, 5.0, svc.sample_rate, "sketch")
    task = asyncio.create_task(engine.run())
    for msg in messages:
        if callable(msg):
            for _ in range(3000):
                if msg(transport.sent):
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail(f"never: {transport.sent[-3:]}")
            continue
        await transport.incoming.put(msg)
    await asyncio.wait_for(task, 120)
    return transport


def audio(sent) -> int:
    return sum(1 for m in sent if "audio" in m)


def test_the_sketch_speaks_a_stream_and_ends(svc):
    t = asyncio.run(run(svc, {"say": "Hello there. "}, {"say": "And a second sentence."}, {"end": True},
                        lambda sent: {"done": True} in sent, None))
    assert audio(t.sent) >= 2 and t.sent.index({"done": True}) == len(t.sent) - 1, t.sent[-3:]
    assert t.closed == [None]  # the client left (None: nothing more to read)
    stats = svc.scheduler.stats()
    assert stats["kept"] == 0 and stats["slots_in_use"] == 0 and stats["in_flight"] == 0, stats
    assert OPEN == {"sockets": 0, "streams": 0}


def test_the_sketch_refuses_by_its_own_words_and_a_stop_ends_a_turn_mid_audio(svc):
    t = asyncio.run(run(svc, {"shout": 1}, {"say": LONG}, {"end": True}, lambda sent: audio(sent) >= 1,
                        {"stop": True}))
    assert t.sent[0] == {"error": "invalid_message", "message": 'send {"say": TEXT}, {"end": true} or '
                                                                '{"stop": true}'}
    assert {"done": True} not in t.sent and t.closed == [1000]
    for _ in range(200):  # the cancelled job leaves the batch at its next step
        stats = svc.scheduler.stats()
        if stats["in_flight"] == 0:
            break
        time.sleep(0.01)
    assert stats["kept"] == 0 and stats["slots_in_use"] == 0 and stats["in_flight"] == 0, stats
    assert OPEN == {"sockets": 0, "streams": 0}


def test_a_stream_waiting_for_text_keeps_its_context_until_a_job_waits(svc):
    """The one kept-KV rule: a stream between segments keeps its last segment's KV context (its batch slot) while no
    job waits; with every slot taken and a job waiting, it is given back and the job served."""
    async def go():
        transport = Memory()
        engine = Engine(transport, sketch(), svc, 30.0, 5.0, svc.sample_rate, "sketch")
        task = asyncio.create_task(engine.run())
        await transport.incoming.put({"say": "One sentence. "})
        await transport.incoming.put({"say": "Two"})  # held: not a sentence yet
        for _ in range(3000):
            s = svc.scheduler.stats()
            if s["kept"] == 1 and s["in_flight"] == 0:
                break
            await asyncio.sleep(0.01)
        assert s["kept"] == 1, s  # kept while it waits for text
        other = svc.speech_session(None, None)  # a second stream fills the other slot and keeps it too
        async for _ in other.speak("Another stream."):
            pass
        assert svc.scheduler.stats()["kept"] == 2
        third = svc.scheduler.submit("A plain request waits for a slot.")  # every slot is kept: it waits
        chunks = [c async for c in third]
        assert chunks and third.outcome == "finished"
        after = svc.scheduler.stats()
        assert after["kept"] <= 1, after  # a kept context was given back to it
        other.close()
        await transport.incoming.put({"stop": True})
        await asyncio.wait_for(task, 60)

    asyncio.run(go())
    stats = svc.scheduler.stats()
    assert stats["kept"] == 0 and stats["slots_in_use"] == 0, stats


def test_a_stream_owed_its_words_is_not_idle(svc):
    """A stream whose audio is all sent but whose words are still being timed (the aligner's one process busy with
    a long piece first) is still speaking: the idle timeout (1 s) waits for them, the words and the turn's end are
    sent, and only then is the idle socket closed as idle. (It was closed as idle while its words were owed.)"""
    import numpy as np
    from starlette.datastructures import QueryParams

    from higgs_onnx.job.finish import time_words
    from higgs_onnx.longform.captions import Cue
    from higgs_onnx.serve.streams.elevenlabs import ElevenLabs, Query

    noise = (np.random.default_rng(7).standard_normal(svc.sample_rate * 40) * 0.1).astype(np.float32)

    class Timed(Memory):
        async def send(self, obj) -> None:
            self.sent.append((time.monotonic(), obj))

    async def go():
        warm = svc.speech_session(None, None)  # the session's first audio comes at once
        async for _ in warm.speak("Warm."):
            pass
        warm.close()
        await time_words(Cue(0, 0, "x"), np.zeros(0, np.float32), svc.sample_rate, "en")  # the aligner is up
        busy = asyncio.create_task(time_words(Cue(0, noise.size, "a piece the aligner takes seconds to refuse"),
                                              noise, svc.sample_rate, "en"))
        transport = Timed()
        query = Query(svc, "default", QueryParams("inactivity_timeout=1"))
        engine = Engine(transport, lambda e: ElevenLabs(e, query), svc, query.idle_s, 5.0, svc.sample_rate, "eleven")
        task = asyncio.create_task(engine.run())
        await transport.incoming.put({"text": "One sentence to time.", "context_id": "c", "flush": True})
        await transport.incoming.put({"context_id": "c", "close_context": True})  # the end of the turn
        await asyncio.wait_for(task, 120)  # the client sends nothing more: the socket ends idle
        assert (await busy).words == ()
        return transport

    t = asyncio.run(go())
    kinds = [("audio" if m.get("audio") else "words" if m.get("alignment") else "final" if m.get("isFinal")
              else m.get("error"), at) for at, m in t.sent]
    assert [k for k, _ in kinds][-3:] == ["words", "final", "idle_timeout"], kinds
    last_audio = max(at for k, at in kinds if k == "audio")
    assert kinds[-3][1] - last_audio > 1.0, kinds  # the words came later than the idle timeout after the audio
    assert t.closed == [1000] and OPEN == {"sockets": 0, "streams": 0}
