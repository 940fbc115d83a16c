"""Text in, audio out: the segmenter that cuts an LLM's token stream into segments (no model), and the WebSocket
session `/v1/audio/speech/stream` (sglang-omni's message names) on a real server, driven by the `websockets` client
over loopback: segments continue one KV context (only each segment's new text is prefilled), audio arrives while
text still does, and hostile clients (malformed frames, binary frames, unknown types, no config, idle, vanishing
mid-audio, a session longer than the context) each get one clear error and leave nothing held."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from servers import served
from ws_clients import events, per_segment, session, ws_url

from higgs_onnx.textin import TextSegmenter


def feed_words(seg: TextSegmenter, text: str) -> list[tuple[int, str]]:
    """(words fed so far, segment) for each segment the segmenter gives while `text` arrives word by word."""
    out = []
    for i, w in enumerate(text.split(" "), 1):
        out += [(i, s) for s in seg.feed(w + " ")]
    return out + [(-1, s) for s in seg.flush()]


def test_a_sentence_is_cut_once_the_next_word_begins():
    got = feed_words(TextSegmenter(), "Hello there. Dr. Smith is 3.5 metres tall, etc. and more! Next one? Done")
    assert got == [(3, "Hello there."), (12, "Dr. Smith is 3.5 metres tall, etc. and more!"), (14, "Next one?"),
                   (-1, "Done")]
    assert feed_words(TextSegmenter(), "Stop! he said.") == [(-1, "Stop! he said.")]  # a lowercase word goes on


def test_clauses_paragraphs_cjk_tags_and_long_text():
    assert feed_words(TextSegmenter("clause"), "One, two; three") == [(2, "One,"), (3, "two;"), (-1, "three")]
    seg = TextSegmenter()
    assert seg.feed("First paragraph with no stop\n\nSecond") == ["First paragraph with no stop"]
    assert seg.flush() == ["Second"]
    seg = TextSegmenter()
    assert seg.feed("你好。世界！再") == ["你好。", "世界！"] and seg.flush() == ["再"]
    seg = TextSegmenter()  # a tag with no words after it waits for the words it leads
    assert seg.feed("Fine. <|emotion:elation|> ") == ["Fine."]
    assert seg.feed("Great news. And") == ["<|emotion:elation|> Great news."]
    seg = TextSegmenter(max_chars=100)  # no end in sight: cut as long-form cuts a long sentence
    parts = seg.feed("word " * 60) + seg.flush()
    assert len(parts) >= 3 and all(len(p) <= 100 for p in parts) and " ".join(parts).split() == ["word"] * 60
    with pytest.raises(ValueError, match="granularity"):
        TextSegmenter("word")
    with pytest.raises(ValueError, match="string"):
        TextSegmenter().feed(5)


# -- the WebSocket session -----------------------------------------------------------------------------------------
pytest_slow = pytest.mark.slow


@pytest.fixture(scope="module")
def ws_server(builds, tmp_path_factory):
    with served(builds["fp32"], tmp_path_factory.mktemp("ws"), "--ws-idle-timeout", "1.5") as s:
        yield s


TEXT = "Hello there, this is the first sentence. And here comes a second one! A third follows it."


@pytest_slow
def test_segments_continue_one_context_and_audio_comes_while_text_arrives(ws_server):
    before = ws_server.stats()["prefill_positions"]
    words = [{"type": "input.text", "text": w + " "} for w in TEXT.split(" ")]
    got = asyncio.run(session(ws_server, {"response_format": "pcm", "seed": 1}, [*words, {"type": "input.done"}]))
    assert events(got, "session.configured")[0]["continuation"] is True
    starts, dones = events(got, "audio.start"), events(got, "audio.done")
    assert [s["sentence_text"] for s in starts] == ["Hello there, this is the first sentence.",
                                                   "And here comes a second one!", "A third follows it."]
    assert [d["continued"] for d in dones] == [False, True, True] and not any(d["error"] for d in dones)
    assert events(got, "session.done")[0]["total_sentences"] == 3
    audio = [m for m in got if isinstance(m, bytes)]
    assert sum(map(len, audio)) == sum(d["total_bytes"] for d in dones) > 0
    # the last segment's cache is given back at the end (when the session closes, just after session.done)
    stats = ws_server.released()
    prefilled = stats["prefill_positions"] - before
    alone = asyncio.run(session(ws_server, {"response_format": "pcm", "seed": 1, "continuation": False},
                                [*words, {"type": "input.done"}]))
    assert [d["continued"] for d in events(alone, "audio.done")] == [False, False, False]
    fresh = ws_server.settle()["prefill_positions"] - before - prefilled
    # a continued segment's prompt holds every earlier segment's text and rows (~100 positions each), yet only its
    # own text is prefilled: no more than segments that start afresh from the (cached) system prompt
    assert prefilled <= fresh + 6, (prefilled, fresh)
    pieces = lambda got: per_segment(got)  # noqa: E731
    ctx, fresh_audio = pieces(got), pieces(alone)
    assert ctx[0] == fresh_audio[0] and ctx[1] != fresh_audio[1]  # the same first segment; the context shapes the rest


@pytest_slow
def test_audio_of_the_first_sentence_arrives_before_the_input_ends(ws_server):
    import websockets

    async def run():
        async with websockets.connect(ws_url(ws_server)) as ws:
            await ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}))
            await ws.recv()
            await ws.send(json.dumps({"type": "input.text", "text": "The first sentence is here. Then"}))
            seen = []
            while not any(isinstance(m, bytes) for m in seen):  # audio while the input is still open
                seen.append(await asyncio.wait_for(ws.recv(), 60))
            await ws.send(json.dumps({"type": "input.done"}))
            while not (isinstance(seen[-1], str) and '"session.done"' in seen[-1]):
                seen.append(await asyncio.wait_for(ws.recv(), 60))
            return seen

    seen = asyncio.run(run())
    texts = [json.loads(m)["sentence_text"] for m in seen if isinstance(m, str) and '"audio.start"' in m]
    assert texts == ["The first sentence is here.", "Then"]


@pytest_slow
def test_hostile_clients_get_one_clear_error_each(ws_server):
    ok = {"response_format": "pcm", "max_rows": 60}
    got = asyncio.run(session(ws_server, ok, [b"\x00\x01", "{not json", json.dumps([1]), {"type": "bogus"},
                                              {"type": "input.text", "text": 5}, {"type": "session.config"},
                                              {"type": "input.text", "text": "Bad <|im_start|> token. "},
                                              {"type": "input.text", "text": "A good one. "},
                                              {"type": "input.done"}]))
    codes = [e["code"] for e in events(got, "error")]
    assert codes[:6] == ["invalid_frame", "invalid_json", "invalid_message", "unknown_type", "invalid_value",
                         "already_configured"]
    assert len(codes) == 7 and all(set(e) == {"type", "message", "error_type", "param", "code"}
                                   for e in events(got, "error"))
    assert [d["error"] for d in events(got, "audio.done")] == [True, False]  # the bad segment fails, the next speaks
    for config, code in (({"voice": "nobody"}, "voice_not_found"), ({"temperature": -1}, "invalid_value"),
                         ({"response_format": "m4a"}, "unsupported_format"),
                         ({"split_granularity": "word"}, "invalid_value"), ({"continuation": "yes"}, "invalid_value")):
        got = asyncio.run(session(ws_server, config, []))
        assert [e["code"] for e in events(got, "error")] == [code], (config, got)
    got = asyncio.run(session(ws_server, None, [{"type": "input.text", "text": "Hi."}]))
    assert [e["code"] for e in events(got, "error")] == ["not_configured"]
    got = asyncio.run(session(ws_server, ok, []))  # configured, then silent: closed after --ws-idle-timeout
    assert [e["code"] for e in events(got, "error")] == ["idle_timeout"]
    ws_server.released()


@pytest_slow
def test_a_client_that_vanishes_mid_audio_frees_everything(ws_server):
    import websockets

    async def run():
        ws = await websockets.connect(ws_url(ws_server))
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}))
        await ws.recv()
        await ws.send(json.dumps({"type": "input.text", "text": "A long sentence that keeps the model talking for a "
                                  "while, and more. Another one after it. "}))
        while not isinstance(await asyncio.wait_for(ws.recv(), 60), bytes):
            pass
        ws.transport.abort()  # gone without a close frame

    asyncio.run(run())
    stats = ws_server.released()  # the vanished session's work freed
    assert stats["cancelled"] >= 1


@pytest_slow
def test_a_session_longer_than_the_context_starts_again_from_the_voice(ws_server):
    slot = ws_server.stats()["slot_positions"]
    sentences = [f"Sentence number {i} of a session that outgrows its context." for i in range(40)]
    got = asyncio.run(session(ws_server, {"response_format": "pcm", "seed": 3},
                              [{"type": "input.text", "text": " ".join(sentences) + " "}, {"type": "input.done"}]))
    dones = events(got, "audio.done")
    assert len(dones) == 40 and not any(d["error"] for d in dones)
    continued = [d["continued"] for d in dones]
    restarts = [i for i, c in enumerate(continued) if not c]
    assert restarts[0] == 0 and len(restarts) >= 2, (continued, slot)  # the context filled up, and it went on
    assert np.all(np.diff(restarts) > 5)
    ws_server.released()


@pytest_slow
def test_an_idle_session_gives_its_kept_context_to_a_waiting_job(builds, tmp_path):
    """One slot: a session that spoke a segment keeps its KV context while it waits for text; a plain request that
    needs the slot makes the session give it back (it is served while the session stays open), and the session's
    next segment starts again from the voice."""
    import threading

    from websockets.sync.client import connect

    with served(builds["fp32"], tmp_path, "--max-batch", "1", "--max-queue", "2", "--ws-idle-timeout", "60") as s:
        with connect(ws_url(s), max_size=None) as ws:
            ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "seed": 1}))

            def segment_done() -> dict:
                while True:
                    m = ws.recv(timeout=120)
                    if isinstance(m, str) and json.loads(m)["type"] == "audio.done":
                        return json.loads(m)

            ws.send(json.dumps({"type": "input.text", "text": "The first sentence is here. "}))
            ws.send(json.dumps({"type": "input.commit"}))
            segment_done()
            s.wait(lambda st: st["kept"] == 1 and st["in_flight"] == 0, "the session keeping its context")
            got = {}
            t = threading.Thread(target=lambda: got.update(r=s.http.post("/v1/audio/speech", json={
                "model": "tts-1", "input": "Let me in.", "max_rows": 40, "response_format": "pcm"})))
            t.start()
            t.join(30)
            assert not t.is_alive() and got["r"].status_code == 200  # served while the session is still open
            ws.send(json.dumps({"type": "input.text", "text": "And a second one now. "}))
            ws.send(json.dumps({"type": "input.commit"}))
            assert segment_done()["continued"] is False  # its context was given back: from the voice again
            ws.send(json.dumps({"type": "input.done"}))
        s.released()  # everything freed
