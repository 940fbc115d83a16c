"""`GET /metrics` (Prometheus) and `GET /ready` on a real server (serve/metrics.py): the text parses with
prometheus-client's own parser, and the counters equal what the test sent (requests by door and status, a full
queue's 429, the jobs and the histograms of their figures)."""

from __future__ import annotations

import json
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import served

pytestmark = pytest.mark.slow
KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "higgs-tts-3", "input": "Hello there.", "max_rows": 40, "response_format": "pcm"}


@pytest.fixture(scope="module")
def server(builds, tmp_path_factory):
    with served(builds["fp32"], tmp_path_factory.mktemp("metrics"), "--api-key", KEY, "--max-batch", "1",
                "--max-queue", "0") as s:
        yield s


def scrape(server) -> dict:
    """{(name, labels as a sorted tuple): value} of one scrape, parsed by prometheus-client."""
    r = server.http.get("/metrics", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    out = {}
    for family in text_string_to_metric_families(r.text):
        assert family.documentation, family.name  # every family says what it is
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_count_what_was_sent_and_need_the_key(server):
    from websockets.sync.client import connect

    assert server.http.get("/metrics").status_code == 401  # behind --api-key (no --metrics-public)
    assert server.http.get("/ready").json() == {"ready": True, "model_state": "loaded"}  # no --idle-unload
    for path in ("/ready", "/health"):  # probes that send HEAD (load balancers, Kubernetes): the GET's status
        head = server.http.head(path)
        assert head.status_code == 200 and head.content == b"", (path, head.status_code)
    before = scrape(server)
    for _ in range(3):
        assert server.http.post("/v1/audio/speech", json=BODY, headers=AUTH).status_code == 200
    assert server.http.post("/v1/audio/speech", json={**BODY, "input": " "}, headers=AUTH).status_code == 400
    # one slot and no queue: a long request holds it, a second one is refused (429)
    long = {**BODY, "input": " ".join(["word"] * 200) + ".", "max_rows": 2000}
    first = threading.Thread(target=lambda: server.http.post("/v1/audio/speech", json=long, headers=AUTH))
    first.start()
    server.wait(lambda s: s["in_flight"] == 1, "the long request running")
    assert server.http.post("/v1/audio/speech", json=BODY, headers=AUTH).status_code == 429
    first.join(120)
    url = server.url.replace("http://", "ws://")
    with connect(url + "/v1/audio/speech/stream", additional_headers=AUTH) as ws:
        ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}))
        assert json.loads(ws.recv(timeout=60))["type"] == "session.configured"
    with pytest.raises(Exception):  # noqa: B017 - the upgrade refused: websockets' InvalidStatus
        connect(url + "/tts/websocket", additional_headers={"X-API-Key": "wrong"})
    server.settle()
    after = scrape(server)

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("higgs_requests_total", door="http", status="200") == 4  # the three, and the long one
    assert grew("higgs_requests_total", door="http", status="400") == 1
    assert grew("higgs_requests_total", door="http", status="429") == 1
    assert grew("higgs_requests_total", door="websocket", status="accepted") == 1
    assert grew("higgs_requests_total", door="cartesia", status="refused") == 1
    assert grew("higgs_jobs_total", outcome="rejected") == 1
    assert grew("higgs_jobs_total", outcome="finished") == 4
    assert grew("higgs_time_to_first_audio_seconds_count") == 4 == grew("higgs_real_time_factor_count")
    assert grew("higgs_rows_total") > 0 and grew("higgs_decoder_steps_total") > 0
    assert after[("higgs_in_flight", ())] == 0 and after[("higgs_slots_in_use", ())] == 0
    assert after[("higgs_max_batch", ())] == 1 and after[("higgs_aligner_pending", ())] == 0


@pytest.fixture(scope="module")
def roomy(builds, tmp_path_factory):
    with served(builds["fp32"], tmp_path_factory.mktemp("metrics2"), "--api-key", KEY) as s:
        yield s


def test_takes_verdicts_and_voice_cache_hits(roomy):
    """A best-of-2 request counts two judged takes; a request with retries counts its takes and redraws; the same
    inline reference twice is one voice-cache miss, then a hit."""
    import base64
    from pathlib import Path

    server = roomy
    clip = base64.b64encode((Path(__file__).parent / "data" / "ref_en_24k.wav").read_bytes()).decode()
    before = scrape(server)
    assert server.http.post("/v1/audio/speech", json={**BODY, "takes": 2}, headers=AUTH).status_code == 200
    assert server.http.post("/v1/audio/speech", json={**BODY, "retries": 2}, headers=AUTH).status_code == 200
    for _ in range(2):
        r = server.http.post("/v1/audio/speech", json={**BODY, "ref_audio": clip, "ref_text": "A reference."},
                             headers=AUTH)
        assert r.status_code == 200, r.text
    after = scrape(server)

    def grew(name: str, **labels) -> float:
        def total(m):
            return sum(v for (n, lab), v in m.items() if n == name and all(dict(lab).get(k) == x
                                                                           for k, x in labels.items()))
        return total(after) - total(before)

    assert grew("higgs_takes_total", policy="best_of") == 2
    redrawn = grew("higgs_redraws_total")
    assert grew("higgs_takes_total", policy="redraw") == 1 + redrawn and 0 <= redrawn <= 2
    assert grew("higgs_voice_cache_lookups_total", result="miss") == 1
    assert grew("higgs_voice_cache_lookups_total", result="hit") == 1
    assert after[("higgs_voice_cache_bytes", ())] > 0
    verdicts = {dict(lab)["verdict"] for (n, lab) in after if n == "higgs_takes_total"}
    assert verdicts and all(v == "good" or v.replace("_", "").isalpha() for v in verdicts)


def test_metrics_public_needs_no_key(builds, tmp_path):
    with served(builds["fp32"], tmp_path, "--api-key", KEY, "--metrics-public") as s:
        r = s.http.get("/metrics")
        assert r.status_code == 200 and "higgs_in_flight" in r.text
        assert s.http.get("/v1/models").status_code == 401  # the API itself still needs the key


def test_ready_only_between_start_and_stop(tts):
    """`/ready` reads `JobScheduler.ready`: not before the scheduler starts (the model is still loading: the server
    does not even listen then), not once it stops (draining after SIGTERM)."""
    from higgs_onnx.serve.scheduler import JobScheduler

    sched = JobScheduler(tts, max_batch=1)
    assert not sched.ready
    sched.start()
    try:
        assert sched.ready
    finally:
        sched.stop()
    assert not sched.ready


def test_head_ready_is_503_while_draining(tts, tmp_path):
    """A stopped scheduler (the drain after SIGTERM): GET and HEAD /ready both answer 503 with Retry-After."""
    import asyncio

    import httpx2 as httpx

    from higgs_onnx.serve.app import create_app
    from higgs_onnx.serve.scheduler import JobScheduler

    sched = JobScheduler(tts, max_batch=1)
    app = create_app(tts, sched, tmp_path / "voices")
    sched.start()
    sched.stop()

    async def probe() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            return [await c.request(m, "/ready") for m in ("GET", "HEAD")]

    get, head = asyncio.run(probe())
    assert get.status_code == head.status_code == 503 and head.headers["retry-after"] == "1"
    assert get.json()["error"]["code"] == "not_ready" and head.content == b""
