"""The server on Ray Serve (`python -m higgs_onnx.serve --ray`, serve/ray_serve.py): a real local Ray cluster on
this machine, replicas of the tiny export behind Ray's HTTP proxy, driven by the official `openai` client, httpx
(SSE) and a WebSocket client. Answers equal a plain server's for the same seeds; a replica killed mid-request ends
what it held as documented (serve/ray_proxy.py) and is replaced; the deployment scales 1 -> 2 under load; a replica
that cannot load its model never serves. The proxy middleware's answers are also checked on a bare ASGI app."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import served
from ws_clients import per_segment, session, ws_url

pytestmark = pytest.mark.slow
TEXT = "Hello there, this is a replica speaking."
LONG = " ".join(["Speaking on and on"] * 40) + "."
RAY = ("--ray", "--threads", "1")


def health(server) -> dict:
    r = server.http.get("/health")
    assert r.status_code == 200, r.text
    return r.json()


def replicas_seen(server, want: int = 0, within: float = 90.0, until=None) -> dict[str, int]:
    """{replica id: pid} of the replicas answering /health, once `want` distinct ones did (or `until(seen)`)."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        r = server.http.get("/health")
        if r.status_code == 200 and "replica" in r.json():
            rep = r.json()["replica"]
            seen[rep["id"]] = rep["pid"]
            if (until(seen) if until else len(seen) >= want):
                return seen
        time.sleep(0.1)
    pytest.fail(f"the replicas wanted did not answer within {within} s: {seen}")


def series_of(server) -> set[str]:
    """The replicas whose series one scrape lists (a scrape that meets the dying replica is tried again)."""
    r = server.http.get("/metrics")
    if r.status_code != 200:
        return series_of(server)
    return {s.labels["replica"] for f in text_string_to_metric_families(r.text) for s in f.samples
            if s.name == "higgs_slots_in_use"}


def scrape_total(server, name: str) -> float:
    return sum(v for (n, _), v in scrape(server).items() if n == name)


def scrape(server) -> dict:
    out = {}
    r = server.http.get("/metrics")
    assert r.status_code == 200, r.text
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sse_audio(server, **body) -> tuple[bytes, list[dict]]:
    events = []
    with server.http.stream("POST", "/v1/audio/speech", json={"model": "tts-1", "input": TEXT,
                                                              "response_format": "pcm", "stream_format": "sse",
                                                              **body}) as r:
        assert r.status_code == 200, (r.status_code, r.read())
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    return audio, events


def answers(server) -> dict:
    """What a client gets for fixed seeds: wav (openai client), a streamed mp3 (openai client), SSE, WebSocket."""
    client = server.client()
    wav = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="wav",
                                     extra_body={"seed": 3}).content
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=TEXT,
                                                            response_format="mp3", extra_body={"seed": 4}) as r:
        mp3 = b"".join(r.iter_bytes())
    sse, _ = sse_audio(server, seed=5)
    got = asyncio.run(session(server, {"response_format": "pcm", "seed": 6}, [{"type": "input.text", "text": TEXT},
                                                                           {"type": "input.done"}]))
    return {"wav": wav, "mp3": mp3, "sse": sse, "ws": per_segment(got)}


@pytest.fixture(scope="module")
def plain(builds, tmp_path_factory):
    with served(builds["fp32"], tmp_path_factory.mktemp("plain"), "--threads", "1") as s:
        yield s


@pytest.fixture(scope="module")
def pair(builds, tmp_path_factory):
    """Two replicas, one thread each, metrics open."""
    with served(builds["fp32"], tmp_path_factory.mktemp("ray2"), *RAY, "--replicas", "2", "--metrics-public",
                timeout=240) as s:
        yield s


def test_two_replicas_answer_as_one_server_does(pair, plain):
    assert "Ray Serve" in pair.banner and "2 replica(s)" in pair.banner
    ids = replicas_seen(pair, 2)
    assert len(set(ids.values())) == 2  # two processes
    limits = health(pair)["limits"]  # the proxy holds the connections: their bounds are not claimed
    assert limits["connections"] == "ray_serve_proxy" and "max_connections" not in limits, limits
    assert not {"header_s", "keep_alive_s"} & set(limits["timeouts_s"]) and limits["timeouts_s"]["send_s"] > 0
    assert "connections" not in health(plain)["limits"] and health(plain)["limits"]["max_connections"] > 0
    want = answers(plain)
    assert all(want.values())
    for _ in range(2):  # each replica answers some of them (the proxy picks one per request)
        assert answers(pair) == want
    # one scrape through the proxy has every replica's series; the counters add up to what was sent
    time.sleep(2.5)  # every replica pushes its families each second (ray_serve.PUSH_S): the scrape sees all so far
    before = scrape(pair)
    for _ in range(6):
        assert pair.http.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "max_rows": 30}).status_code \
            == 200
    assert pair.http.post("/v1/audio/speech", json={"model": "tts-1", "input": " "}).status_code == 400
    time.sleep(2.5)
    after = scrape(pair)

    def total(m: dict, name: str, **labels) -> float:
        return sum(v for (n, lab), v in m.items() if n == name and all(dict(lab).get(k) == x
                                                                       for k, x in labels.items()))

    assert {dict(lab)["replica"] for (n, lab) in after if n == "higgs_slots_in_use"} == set(ids)
    assert total(after, "higgs_requests_total", door="http", status="200") - \
        total(before, "higgs_requests_total", door="http", status="200") == 6
    assert total(after, "higgs_requests_total", door="http", status="400") - \
        total(before, "higgs_requests_total", door="http", status="400") == 1
    assert total(after, "higgs_time_to_first_audio_seconds_count") >= 6


def one_request(server, kind: str, i: int) -> str:
    """A long request of `kind` (wav, pcm stream, sse, ws); how it ended: "ok", or the documented failure seen."""
    body = {"model": "tts-1", "input": LONG, "seed": i, "max_rows": 1500}
    try:
        if kind == "wav":
            r = server.http.post("/v1/audio/speech", json={**body, "response_format": "wav"})
            if r.status_code == 200:
                return "ok"
            err = r.json()["error"]
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            return f"503 {err['code']}"
        if kind == "pcm":
            with server.http.stream("POST", "/v1/audio/speech", json={**body, "response_format": "pcm"}) as r:
                if r.status_code != 200:
                    r.read()
                    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                    return f"503 {r.json()['error']['code']}"
                for _ in r.iter_bytes():
                    pass
            return "ok"
        if kind == "sse":
            events = []
            with server.http.stream("POST", "/v1/audio/speech", json={**body, "response_format": "pcm",
                                                                      "stream_format": "sse"}) as r:
                if r.status_code != 200:
                    r.read()
                    assert r.status_code == 503, r.text
                    return f"503 {r.json()['error']['code']}"
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
            last = events[-1]
            if last["type"] == "speech.audio.done":
                return "ok"
            assert last["type"] == "error", last
            return f"sse {last['error']['code']}"
        from websockets.sync.client import connect

        url = ws_url(server)
        with connect(url, max_size=None, open_timeout=60) as ws:
            ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "seed": i}))
            ws.send(json.dumps({"type": "input.text", "text": LONG}))
            ws.send(json.dumps({"type": "input.done"}))
            while True:
                m = ws.recv(timeout=120)
                if isinstance(m, bytes):
                    continue
                m = json.loads(m)
                if m["type"] == "session.done":
                    return "ok"
                if m["type"] == "error":
                    assert m["code"] == "replica_lost", m
                    with pytest.raises(Exception) as closed:
                        ws.recv(timeout=10)
                    assert getattr(closed.value, "rcvd", None) is not None and closed.value.rcvd.code == 1011
                    return "ws replica_lost"
    except httpx.RemoteProtocolError:  # a raw audio stream cut mid-way: never taken for whole
        return "cut"


def test_a_killed_replica_ends_what_it_held_and_is_replaced(pair):
    ids = replicas_seen(pair, 2)
    kinds = ["wav", "pcm", "sse", "ws"] * 2
    results: list = []
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one_request, pair, k, i) for i, k in enumerate(kinds)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both replicas busy: kill one
            busy = {dict(lab)["replica"] for (n, lab), v in scrape(pair).items() if n == "higgs_in_flight" and v}
            if busy == set(ids):
                break
            time.sleep(0.2)
        victim = sorted(ids)[0]
        os.kill(ids[victim], signal.SIGKILL)
        killed = time.monotonic()
        while victim in series_of(pair):  # its series leave the scrape once its actor is gone (not STALE_S later)
            assert time.monotonic() - killed < 5, "a killed replica's series are still scraped"
            time.sleep(0.2)
        results = [f.result(timeout=180) for f in futures]
    print("outcomes:", results)
    lost = [r for r in results if r != "ok"]
    assert lost, f"the killed replica held none of {results}"
    assert set(lost) <= {"503 replica_lost", "sse replica_lost", "ws replica_lost", "cut"}, results
    # the survivor (and the replacement) answer the next 20
    short = {"model": "tts-1", "input": "Hi there.", "max_rows": 40, "response_format": "wav"}
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: pair.http.post("/v1/audio/speech", json=short).status_code, range(20)))
    assert codes == [200] * 20, codes
    # Ray Serve starts a new replica in the killed one's place
    fresh = replicas_seen(pair, within=120, until=lambda seen: set(seen) - set(ids))
    assert victim not in fresh and ids[victim] not in fresh.values()


def test_autoscaling_adds_a_replica_under_load(builds, tmp_path):
    with served(builds["fp32"], tmp_path, *RAY, "--replicas", "1", "--max-replicas", "2", "--max-batch", "1",
                "--max-queue", "2", "--log-level", "INFO", timeout=240) as s:
        assert "1..2 replicas (autoscaling)" in s.banner
        assert len(replicas_seen(s, 1)) == 1
        stop = threading.Event()
        codes: list[int] = []

        def load():
            while not stop.is_set():
                r = s.http.post("/v1/audio/speech", json={"model": "tts-1", "input": LONG, "max_rows": 300,
                                                          "response_format": "pcm"})
                codes.append(r.status_code)
                if r.status_code == 429:  # every replica full: the documented answer, and its wait
                    assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.headers["retry-after"]
                    time.sleep(0.2)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            seen = replicas_seen(s, 2, within=120)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert len(seen) == 2 and set(codes) <= {200, 429} and 200 in codes
        # SIGTERM while requests run: the replicas finish them (the drain), then Ray stops. First the load's last
        # requests end (a replica's scheduler counts a job until its stream is closed on its side)
        deadline = time.monotonic() + 60
        while scrape_total(s, "higgs_in_flight") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        with ThreadPoolExecutor(2) as pool:
            running = [pool.submit(sse_audio, s, seed=40 + i, max_rows=200) for i in range(2)]
            deadline = time.monotonic() + 60
            while scrape_total(s, "higgs_in_flight") < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            s.proc.send_signal(signal.SIGTERM)
            answers = drain_answers(s)  # new requests while the replicas drain, until the port closes
            for f in running:
                audio, events = f.result(timeout=120)
                assert events[-1]["type"] == "speech.audio.done" and audio  # drained: whole
        assert s.proc.wait(timeout=60) == 0
        print("answers while draining:", answers)
        assert "503 no_replica 1" in answers and set(answers) <= {"200", "503 no_replica 1"}, answers  # no 404
        log = s.log.read_text()  # a clean stop (Ray's own lines shown: INFO) writes no dead worker nor failed call
        for bad in ("unexpected system error", "graceful_shutdown", "worker died"):
            assert bad not in log, log[-3000:]


def drain_answers(server) -> list[str]:
    """What new requests get from a server sent SIGTERM, until its port closes: "200", or "<status> <code>
    <Retry-After>"."""
    seen = []
    while True:
        try:
            r = httpx.post(server.url + "/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "max_rows": 30},
                           timeout=30)
        except httpx.TransportError:
            return seen
        json_body = r.headers.get("content-type", "").startswith("application/json")
        seen.append("200" if r.status_code == 200 else f"{r.status_code} "
                    f"{r.json()['error']['code'] if json_body else r.text[:60]} {r.headers.get('retry-after')}")
        time.sleep(0.1)


def test_a_replica_that_cannot_load_never_serves(builds, tmp_path):
    """A model file that fails its checksum: every replica fails in its constructor, none takes traffic, and the
    command exits 1 with the replica's own error."""
    broken = tmp_path / "cpu_fp32"
    shutil.copytree(builds["fp32"], broken, ignore=shutil.ignore_patterns("voices"))
    victim = next(p for p in sorted(broken.glob("*.onnx")))
    victim.write_bytes(victim.read_bytes()[:-8] + b"\0" * 8)
    p = subprocess.run([sys.executable, "-m", "higgs_onnx.serve", "--model-path", str(broken), *RAY, "--port", "0"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no replica came up:") and "sha256" in last.lower(), p.stderr[-2000:]
    assert "http://" not in p.stdout


@pytest.mark.parametrize("args,message", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--address", "auto"], "--address needs --ray"),
    (["--ray", "--replicas", "0"], "--replicas must be >= 1"),
    (["--ray", "--replicas", "2", "--max-replicas", "1"], "--max-replicas (1) must be >= --replicas (2)"),
    (["--ray", "--wyoming", "tcp://127.0.0.1:10200"], "--wyoming is not served with --ray"),
    (["--ray", "--header-timeout", "5"], "--header-timeout does not apply with --ray"),
    (["--ray", "--max-connections", "5"], "--max-connections does not apply with --ray"),
    (["--ray", "--address", "127.0.0.1:1"], "--address 127.0.0.1:1: no Ray cluster answers there"),
    (["--ray", "--address", "ray://127.0.0.1:1"], "--address ray://127.0.0.1:1: no Ray cluster answers there"),
    (["--ray", "--address", "nowhere"], "give HEAD:PORT"),
    (["--ray", "--port", "TAKEN"], "pick another --port"),
])
def test_ray_flags_are_checked_before_anything_starts(builds, args, message):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = [str(taken.getsockname()[1]) if a == "TAKEN" else a for a in args]
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "higgs_onnx.serve", "--model-path", str(builds["fp32"]), *args],
                           capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 20  # at once (Ray Client alone took 31 s to give up on ray://127.0.0.1:1)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [f"error: {p.stderr.strip()[7:]}"]
    assert message in p.stderr, p.stderr


# -- the proxy middleware (serve/ray_proxy.py) on bare ASGI apps ---------------------------------------------------
def run_asgi(app, scope: dict, incoming: list[dict]) -> list[dict]:
    from higgs_onnx.serve.ray_proxy import ReplicaLoss

    sent: list[dict] = []
    pending = list(incoming)

    async def receive():
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(ReplicaLoss(app)(scope, receive, send))
    return sent


HTTP = {"type": "http", "method": "POST", "path": "/v1/audio/speech", "headers": []}


def body_of(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_the_proxy_answers_for_a_lost_replica():
    async def dies_before_answering(scope, receive, send):
        return

    sent = run_asgi(dies_before_answering, HTTP, [])
    start = sent[0]
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    assert json.loads(body_of(sent))["error"]["code"] == "replica_lost"

    async def dies_mid_sse(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})

    sent = run_asgi(dies_mid_sse, HTTP, [])
    assert not sent[-1].get("more_body") and b'"code": "replica_lost"' in sent[-1]["body"]
    assert body_of(sent).startswith(b"data: {}\n\ndata: {\"type\": \"error\"")

    async def dies_mid_audio(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"audio/pcm")]})
        await send({"type": "http.response.body", "body": b"\0\0", "more_body": True})

    sent = run_asgi(dies_mid_audio, HTTP, [])
    assert sent[-1].get("more_body") is True  # left unfinished: the server cuts the connection

    async def ray_is_full(scope, receive, send):
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"text/plain"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": b"Request dropped due to backpressure"})

    sent = run_asgi(ray_is_full, HTTP, [])
    err = json.loads(body_of(sent))["error"]
    assert sent[0]["status"] == 429 and (b"retry-after", b"1") in sent[0]["headers"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error" and "busy" in err["message"]

    async def client_left(scope, receive, send):
        await receive()

    assert run_asgi(client_left, HTTP, [{"type": "http.disconnect"}]) == []  # nothing owed to a client that left

    for path, shape in (("/v1/audio/speech/stream", "code"), ("/tts/websocket", "status_code"),
                        ("/v1/text-to-speech/v/multi-stream-input", "error")):
        async def dies_mid_session(scope, receive, send):
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.send", "bytes": b"\0\0"})

        sent = run_asgi(dies_mid_session, {"type": "websocket", "path": path, "headers": []}, [])
        message = json.loads(sent[-2]["text"])
        assert shape in message and "replica_lost" in json.dumps(message), (path, message)
        assert sent[-1] == {"type": "websocket.close", "code": 1011, "reason": "replica lost"}


def test_the_proxy_answers_no_application_as_no_replica():
    """Ray's plain-text 404 (no application: starting, or deleted by a SIGTERM's drain) is a JSON 503 no_replica
    with Retry-After, also to a WebSocket upgrade; our own app's JSON 404 stays a 404."""
    async def no_route(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"Path '/v1/audio/speech' not found. Ping http://.../-/routes"})

    sent = run_asgi(no_route, HTTP, [])
    assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
    err = json.loads(body_of(sent))["error"]
    assert err["code"] == "no_replica" and "starting or stopping" in err["message"], err
    scope = {"type": "websocket", "path": "/tts/websocket", "headers": [],
             "extensions": {"websocket.http.response": {}}}
    sent = run_asgi(no_route, scope, [])
    assert sent[0]["type"] == "websocket.http.response.start" and sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "no_replica"

    async def ours(scope, receive, send):
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {"code": "not_found"}}'})

    sent = run_asgi(ours, HTTP, [])
    assert sent[0]["status"] == 404 and json.loads(body_of(sent))["error"]["code"] == "not_found"


def test_the_proxy_answers_a_full_deployment_on_a_websocket_upgrade():
    """Ray's backpressure answer to an upgrade is an HTTP 429 on the WebSocket scope (uvicorn would make it a bare
    500): it becomes a JSON 429 with Retry-After (the denial response), or close 1013 where that is not supported."""
    async def ray_is_full(scope, receive, send):
        await send({"type": "http.response.start", "status": 429, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"Request dropped due to backpressure"})

    scope = {"type": "websocket", "path": "/v1/audio/speech/stream", "headers": []}
    sent = run_asgi(ray_is_full, {**scope, "extensions": {"websocket.http.response": {}}}, [])
    assert sent[0]["type"] == "websocket.http.response.start" and sent[0]["status"] == 429
    assert (b"retry-after", b"1") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "rate_limit_exceeded"
    assert run_asgi(ray_is_full, scope, []) == [{"type": "websocket.close", "code": 1013}]
