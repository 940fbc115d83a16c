"""Clients of the voice-agent sockets and the text-in WebSocket (a support module of the tests and of
`benchmarks/agents.py --cut-turns`, not a test module: `from agent_clients import ...`).

`cartesia`, `eleven`, `until`: raw `websockets` clients of Cartesia's and ElevenLabs' sockets. `cut_turns`: turns
cut at random points of their life over every stream door, from several client threads at once:

- protocols: Cartesia (`cancel`), ElevenLabs' two barge-ins (`close_context` while a context speaks with no flush;
  a second `close_context` after a flush and the close that ends the turn), the text-in WebSocket (the client
  closes its socket mid-turn: that door has no cancel message);
- points: before the first chunk, after the first chunk (during sends), after 2-12 chunks (across segment
  boundaries), just after a segment's words were sent (the next segment's being timed), and the socket closed
  mid-turn instead of a cancel. Drawn by their weights, or `stratified`: every door cut at every point.

After each cancel a probe (a cancel of a context that never existed) is sent on the same socket: its answer proves
the socket still reads, and every message of the cancelled context arrived before it, so the time from the cancel to
the last of them is the cancel-to-silence figure.
"""

from __future__ import annotations

import collections
import json
import random
import threading
import time
from dataclasses import dataclass

from websockets.sync.client import connect

KEY = "agent-key-7"
RATE = 24000
FIRST = ("This is the first turn and it goes on and on for a good long while so that the user has plenty of time "
         "to cut it short")
SECOND = "A second turn on the same socket."
TEXT = ("A first sentence of the turn, long enough to be cut. And a second sentence follows it, so there is a segment "
        "boundary to cancel at. And a third.")
CARTESIA = {"model_id": "sonic-3.6", "voice": {"mode": "id", "id": "default"}, "language": "en",
            "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": RATE},
            "add_timestamps": True}
PROTOCOLS = {"cartesia": 3, "elevenlabs": 2, "elevenlabs-flushed": 2, "websocket": 1}  # weights
POINTS = {"before": 3, "first": 4, "later": 4, "words": 2, "closed": 1}
PROBE_S = 15.0  # a socket whose loop is wedged answers no probe: the run fails here instead of hanging
# A segment's words come once the server's one aligner process (niced, one piece at a time for every stream) has
# timed it and the pieces queued before it: the tiny model's audio is noise, which the aligner searches every way
# (1-4 s of CPU a piece) before it gives up. Beside a busy loop and another test worker that process gets ~7 % of a
# core (CI: a "words" turn waited 15 s and was taken for wedged), so its wait is longer than the audio's.
WORDS_S = 90.0


def ws_url(server, path: str) -> str:
    return server.url.replace("http://", "ws://") + path


def cartesia(server, path: str = "/tts/websocket", key: str = KEY):
    return connect(ws_url(server, path), additional_headers={"X-API-Key": key}, max_size=None)


def eleven(server, query: str = "", voice: str = "default", single: bool = False, key: str = KEY):
    kind = "stream-input" if single else "multi-stream-input"
    return connect(ws_url(server, f"/v1/text-to-speech/{voice}/{kind}{query}"), additional_headers={"xi-api-key": key},
                   max_size=None)


def recv(ws, timeout: float = 60):
    m = ws.recv(timeout=timeout)
    return m if isinstance(m, bytes) else json.loads(m)


def until(ws, done, timeout: float = 120) -> list:
    """Messages until `done(msg)` holds (that one included)."""
    got, end = [], time.monotonic() + timeout
    while True:
        msg = recv(ws, max(0.1, end - time.monotonic()))
        got.append(msg)
        if done(msg):
            return got


def speaking(ws, done, gap: float):
    """Messages until `done(msg)` (returned), each within `gap` s of the one before: a turn that goes on speaking may
    take long, one that goes silent for `gap` raises TimeoutError."""
    while not done(msg := recv(ws, gap)):
        pass
    return msg


def health(server) -> dict:
    import httpx2 as httpx

    return httpx.get(server.url + "/health", timeout=30).json()


def summary(cuts: list) -> dict:
    """Per protocol: turns, and the cancel to its context's last message (ms: median, p95, worst) where a cancel
    was sent (a closed socket has no such figure)."""
    import statistics

    out = {}
    for protocol in sorted({c.protocol for c in cuts}):
        mine = [c for c in cuts if c.protocol == protocol]
        ms = sorted(c.silence_s * 1000 for c in mine if c.silence_s is not None)
        out[protocol] = {"turns": len(mine), "closed": sum(c.silence_s is None for c in mine)}
        if ms:
            out[protocol] |= {"cancel_to_silence_ms_median": round(statistics.median(ms), 1),
                              "p95": round(ms[int(0.95 * (len(ms) - 1))], 1), "worst": round(ms[-1], 1)}
    return out


class Wedged(AssertionError):
    """A socket answered no probe, or a turn stopped speaking, within PROBE_S."""


@dataclass
class Cut:
    protocol: str
    point: str
    silence_s: float | None  # the cancel to the last message sent for its context (None: the socket was closed)
    after: int  # messages of the context that arrived after the cancel was sent


class Door:
    """One client thread's socket of one protocol, and how a turn on it is spoken and cut."""

    def __init__(self, server, protocol: str):
        self.server, self.protocol, self.ws = server, protocol, None

    def open(self):
        if self.ws is None and self.protocol != "websocket":
            self.ws = cartesia(self.server) if self.protocol == "cartesia" else eleven(self.server)
        return self.ws

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None

    def ours(self, m, cid: str) -> bool:
        if isinstance(m, bytes):
            return True
        return m.get("context_id", m.get("contextId")) == cid

    def audio(self, m, cid: str) -> bool:
        if self.protocol == "websocket":
            return isinstance(m, bytes)
        if self.protocol == "cartesia":
            return m["type"] == "chunk" and m["context_id"] == cid
        return bool(m.get("audio")) and m.get("contextId") == cid

    def words(self, m, cid: str) -> bool:
        if self.protocol == "websocket":
            return isinstance(m, dict) and m["type"] == "audio.words"
        if self.protocol == "cartesia":
            return m["type"] == "timestamps" and m["context_id"] == cid
        return bool(m.get("alignment")) and m.get("contextId") == cid

    def over(self, m, cid: str) -> bool:
        if self.protocol == "websocket":
            return isinstance(m, dict) and m["type"] in ("session.done", "error")
        if self.protocol == "cartesia":
            return m["type"] in ("done", "error") and m["context_id"] == cid
        return bool(m.get("isFinal") or m.get("error")) and m.get("contextId") == cid

    def start(self, cid: str, words: bool):
        from websockets.exceptions import ConnectionClosed

        try:
            return self._start(cid, words)
        except ConnectionClosed:  # closed by the server while it sat idle (its inactivity timeout): a new one
            self.ws = None
            return self._start(cid, words)

    def _start(self, cid: str, words: bool):
        ws = self.open()
        if self.protocol == "websocket":
            ws = self.ws = connect(ws_url(self.server, "/v1/audio/speech/stream"), max_size=None,
                                   additional_headers={"Authorization": f"Bearer {KEY}"})
            ws.send(json.dumps({"type": "session.config", "response_format": "pcm",
                                "caption_level": "word" if words else "none"}))
            ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            ws.send(json.dumps({"type": "input.done"}))
        elif self.protocol == "cartesia":
            ws.send(json.dumps({**CARTESIA, "context_id": cid, "transcript": TEXT, "continue": False,
                                "add_timestamps": words}))
        elif self.protocol == "elevenlabs":
            ws.send(json.dumps({"text": TEXT + " ", "context_id": cid}))  # whole sentences: spoken without a flush
        else:
            ws.send(json.dumps({"text": TEXT, "context_id": cid, "flush": True}))
        return ws

    def cancel(self, cid: str) -> None:
        if self.protocol == "cartesia":
            self.ws.send(json.dumps({"context_id": cid, "cancel": True}))
        elif self.protocol == "elevenlabs":
            self.ws.send(json.dumps({"context_id": cid, "close_context": True}))
        else:  # the close that ends a flushed turn, then a second close: the barge-in
            self.ws.send(json.dumps({"context_id": cid, "close_context": True}))
            self.ws.send(json.dumps({"context_id": cid, "close_context": True}))

    def probe(self, i: int):
        if self.protocol == "cartesia":
            self.ws.send(json.dumps({"context_id": f"probe{i}", "cancel": True}))
            return lambda m: m["type"] == "error" and m["context_id"] == f"probe{i}"
        self.ws.send(json.dumps({"context_id": f"probe{i}", "close_context": True}))
        return lambda m: m.get("error") == "unknown_context" and m.get("contextId") == f"probe{i}"

    def turn(self, i: int, point: str, rng: random.Random) -> Cut:
        from websockets.exceptions import ConnectionClosed

        cid = f"t{i}"
        ws = self.start(cid, words=point == "words" or rng.random() < 0.3)
        reads = {"before": 0, "first": 1, "later": rng.randint(2, 12), "words": 0, "closed": rng.randint(0, 6)}[point]
        heard = collections.deque(maxlen=4)  # the last text messages (what a server that closed the socket said)

        def seen(m) -> None:
            if not isinstance(m, bytes):
                heard.append(str(m)[:300])

        try:
            over = False
            if point == "words":  # just after a segment's words: the next segment's are being timed
                over = self.over(speaking(ws, lambda m: seen(m) or self.words(m, cid) or self.over(m, cid), WORDS_S),
                                 cid)
            for _ in range(reads):
                if over:
                    break
                over = self.over(speaking(ws, lambda m: seen(m) or self.audio(m, cid) or self.over(m, cid), PROBE_S),
                                 cid)
        except TimeoutError:
            raise Wedged(f"a {self.protocol} turn ({point}, {cid}) stopped speaking; /health: "
                         f"{health(self.server)}") from None
        except ConnectionClosed as e:  # the server closed the socket mid-turn: say what it said last
            raise AssertionError(f"a {self.protocol} turn ({point}, {cid}) was closed by the server ({e}); its last "
                                 f"messages: {list(heard)}; /health: {health(self.server)}") from None
        if point == "closed" or self.protocol == "websocket":
            time.sleep(rng.random() * 0.01)
            self.close()  # the client leaves mid-turn (the WebSocket's only way to cut a turn)
            return Cut(self.protocol, point, None, 0)
        time.sleep(rng.random() * 0.01)
        t0 = time.perf_counter()
        self.cancel(cid)
        probe, last, after = self.probe(i), t0, 0
        try:
            while True:
                m = recv(ws, PROBE_S)
                if probe(m):
                    break
                if self.ours(m, cid):
                    last, after = time.perf_counter(), after + 1
        except TimeoutError:
            raise Wedged(f"a {self.protocol} socket answered no probe {PROBE_S:g} s after a cancel ({point}, {cid}); "
                         f"/health: {health(self.server)}") from None
        except ConnectionClosed as e:
            raise AssertionError(f"a {self.protocol} socket was closed by the server after a cancel ({point}, {cid}; "
                                 f"{e}); /health: {health(self.server)}") from None
        return Cut(self.protocol, point, last - t0, after)


def stratified(turns: int, seed: int) -> list[tuple[str, str]]:
    """`turns` (protocol, point) pairs in a shuffled order: every door cut at every point `turns // 20` times (20:
    the doors times the points), the rest drawn by the weights."""
    rng = random.Random(seed)
    pairs = [(p, q) for p in PROTOCOLS for q in POINTS]
    plan = pairs * (turns // len(pairs)) + [
        (rng.choices(list(PROTOCOLS), weights=list(PROTOCOLS.values()))[0],
         rng.choices(list(POINTS), weights=list(POINTS.values()))[0]) for _ in range(turns % len(pairs))]
    rng.shuffle(plan)
    return plan


def cut_turns(server, turns: int, seed: int, workers: int = 4, plan: list[tuple[str, str]] | None = None) -> list[Cut]:
    """`turns` turns cut at random points (module docstring) by `workers` client threads at once; `plan`: the
    (protocol, point) of each turn (`stratified`), else each is drawn by the weights."""
    cuts: list[Cut] = []
    failures: list[BaseException] = []
    assert plan is None or len(plan) == turns, (len(plan), turns)

    def work(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        doors = {p: Door(server, p) for p in PROTOCOLS}
        try:
            for i in range(w, turns, workers):
                if plan is None:
                    protocol = rng.choices(list(PROTOCOLS), weights=list(PROTOCOLS.values()))[0]
                    point = rng.choices(list(POINTS), weights=list(POINTS.values()))[0]
                else:
                    protocol, point = plan[i]
                cuts.append(doors[protocol].turn(i, point, rng))
        except BaseException as e:  # noqa: BLE001 - told to the caller
            failures.append(e)
        finally:
            for d in doors.values():
                d.close()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return cuts
