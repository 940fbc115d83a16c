"""The speech server, for real: `python -m higgs_onnx.serve` on the tiny fp32 export, called over loopback with the
official `openai` client (and httpx2 for what it does not cover: multipart voice uploads, raw error bodies).

One server per module for the API (fp32: the load test compares bytes), and a second one with one batch slot, no
queue and an API key for the 429 and 401 tests.
"""

from __future__ import annotations

import io
import json
import os
import queue
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

pytestmark = pytest.mark.slow

httpx = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
RATE = 24000
KEY = "test-key-123"
TEXT = "Hello there world, this is the speech server."
LONG = " ".join(["word"] * 300) + "."  # the tiny model speaks ~13 rows per word: runs to the context limit (s)
QUICK = {"max_rows": 120}  # a short utterance for tests that are not about the audio


class Server:
    """A `python -m higgs_onnx.serve` subprocess; `url` once it printed its ready line."""

    def __init__(self, model: Path, tmp: Path, *args: str, timeout: float = 120.0):
        self.log, self.voices = tmp / "server.log", tmp / "voices"
        cmd = [sys.executable, "-m", "higgs_onnx.serve", "--model-path", str(model), "--port", "0",
               "--voices", str(tmp / "voices"), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True,
                                     env={**os.environ, "CI": "1"})
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"the server did not start: {self.log.read_text()[-2000:]}")
                continue
            if m := re.search(r"http://[^/\s]+", line):
                self.url, self.banner = m.group(0), line.strip()
                break
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def health(self) -> dict:
        r = self.http.get("/health")
        assert r.status_code == 200, r.text
        return r.json()

    def idle(self, within: float) -> float:
        """Seconds until nothing is in flight (fails after `within`)."""
        t0 = time.monotonic()
        while self.health()["scheduler"]["in_flight"]:
            assert time.monotonic() - t0 < within, f"still in flight after {within} s: {self.health()}"
            time.sleep(0.05)
        return time.monotonic() - t0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(builds, tmp_path_factory):
    s = Server(builds["fp32"], tmp_path_factory.mktemp("server"))
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text(), s.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def tight(builds, tmp_path_factory):
    """One batch slot, no queue, an API key."""
    s = Server(builds["fp32"], tmp_path_factory.mktemp("tight"), "--max-batch", "1", "--max-queue", "0",
               "--api-key", KEY)
    yield s
    s.stop()


def speech(server: Server, **body) -> httpx.Response:
    return server.http.post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT, **body})


def pcm_seconds(data: bytes) -> float:
    return len(data) / 2 / RATE


def first_difference(a: bytes, b: bytes) -> tuple[int, int, int]:
    x, y = np.frombuffer(a, "<i2"), np.frombuffer(b, "<i2")
    n = min(len(x), len(y))
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if len(diff) else n, len(x), len(y)


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    """An OpenAI error body with `status`, one line, no traceback."""
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and "\n" not in err["message"] and "Traceback" not in r.text, err
    if param != "any":
        assert err["param"] == param, err
    return err


# -- basics ----------------------------------------------------------------------------------------------------
def test_health_models_page(server, builds):
    h = server.health()
    assert h["status"] == "ok" and h["model"] == builds["fp32"].name and h["sample_rate"] == RATE
    assert h["scheduler"]["in_flight"] == 0 and h["scheduler"]["max_batch"] == 4
    assert server.url.startswith("http://127.0.0.1:") and builds["fp32"].name in server.banner
    ids = [m.id for m in server.client().models.list()]
    assert ids[0] == builds["fp32"].name and {"higgs-tts-3", "higgs-audio-v3-tts"} <= set(ids)
    tags = server.http.get("/v1/tags").json()["data"]
    assert {"id": "<|prosody:speed_fast|>", "category": "prosody", "name": "speed_fast"} in tags
    page = server.http.get("/")
    assert page.status_code == 200 and "<textarea" in page.text and "Content-Security-Policy" in page.headers
    assert server.http.get("/static/app.js").status_code == 200


def test_default_mp3_with_openai_client(server):
    audio = server.client().audio.speech.create(model="higgs-tts-3", voice="default", input=TEXT)
    data, sr = sf.read(io.BytesIO(audio.content))
    assert sr == RATE and 0.5 < len(data) / sr < 30 and np.abs(data).max() > 0.01


def test_pcm_streams_in_pieces(server):
    """Audio arrives while it is generated: several pieces, the first long before the last."""
    t0, times, pieces = time.perf_counter(), [], []
    with server.client().audio.speech.with_streaming_response.create(
            model="higgs-tts-3", voice="default", input=" ".join(["word"] * 40) + ".", response_format="pcm") as r:
        assert r.headers["content-type"].startswith("audio/pcm")
        for b in r.iter_bytes():
            times.append(time.perf_counter() - t0)
            pieces.append(b)
    total = times[-1]
    assert len(pieces) >= 3, [len(p) for p in pieces]
    assert times[0] < 0.5 * total, (times[0], total)
    assert pcm_seconds(b"".join(pieces)) > 5


def test_every_format_decodes(server):
    """The same seeded request in every format: wav carries the pcm bytes exactly, flac decodes to them, mp3 and
    opus to about the same duration; the streaming formats arrive in several pieces."""
    body = {"input": " ".join(["word"] * 25) + ".", "seed": 7}
    client = server.client()

    def fetch(fmt: str) -> tuple[bytes, int]:
        with client.audio.speech.with_streaming_response.create(model="higgs-tts-3", voice="default",
                                                                 response_format=fmt, input=body["input"],
                                                                 extra_body={"seed": 7}) as r:
            pieces = [b for b in r.iter_bytes() if b]
        return b"".join(pieces), len(pieces)

    pcm, _ = fetch("pcm")
    seconds = pcm_seconds(pcm)
    assert seconds > 2
    ref = np.frombuffer(pcm, "<i2").astype(np.float32) / 32767
    for fmt, tol in (("wav", 0.0), ("flac", 0.0), ("mp3", 0.12), ("opus", 0.03)):
        data, pieces = fetch(fmt)
        wav, sr = sf.read(io.BytesIO(data), dtype="float32")
        assert sr == RATE, fmt
        assert abs(len(wav) / sr - seconds) <= tol + 1e-9, (fmt, len(wav) / sr, seconds)
        if fmt == "wav":
            assert data[44:] == pcm and data[:4] == b"RIFF"
        if fmt == "flac":
            assert np.abs(wav - ref).max() < 1e-4
        if fmt in ("wav", "mp3", "opus"):
            assert pieces >= 2, (fmt, pieces)


def test_sse(server):
    events = []
    with server.http.stream("POST", "/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT, "seed": 3,
                                                              "response_format": "pcm", "stream_format": "sse"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    done = events[-1]
    assert deltas and all(e["type"] == "speech.audio.delta" for e in events[:-1])
    assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] > 0
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + done["usage"]["output_tokens"]
    import base64

    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert audio == speech(server, seed=3, response_format="pcm").content


@pytest.mark.parametrize("speed,tag", [(0.25, "speed_very_slow"), (0.6, "speed_very_slow"), (0.8, "speed_slow"),
                                       (1.0, None), (1.1, None), (1.3, "speed_fast"), (1.6, "speed_very_fast"),
                                       (4.0, "speed_very_fast")])
def test_speed_maps_to_prosody_tags(server, speed, tag):
    r = speech(server, speed=speed, stream_format="sse", response_format="pcm", **QUICK)
    done = json.loads([x for x in r.text.splitlines() if x.startswith("data: ")][-1][6:])
    assert done["speed_tag"] == (f"<|prosody:{tag}|>" if tag else None)


def test_model_ids_and_ignored_fields(server, builds):
    for model in ("higgs-tts-3", "higgs-audio-v3-tts", builds["fp32"].name):
        r = speech(server, model=model, response_format="pcm", **QUICK)
        assert r.status_code == 200 and len(r.content) > 0, (model, r.text[:200])
    # fields other clients send: ignored, not refused
    r = speech(server, response_format="pcm", stream=True, lang_code="a", volume_multiplier=1.0,
               instructions="", **QUICK)
    assert r.status_code == 200


# -- voices ----------------------------------------------------------------------------------------------------
def upload(server: Server, name: str, data: bytes, transcript: str | None = None, filename: str = "ref.wav"):
    fields = {"name": name, **({"transcript": transcript} if transcript is not None else {})}
    return server.http.post("/v1/voices", data=fields, files={"file": (filename, data, "application/octet-stream")})


def test_voice_lifecycle(server):
    ref = (DATA / "ref_en_24k.wav").read_bytes()
    r = upload(server, "narrator", ref, (DATA / "ref_en_24k.txt").read_text().strip())
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "narrator" and r.json()["reference_rows"] > 0
    assert_error(upload(server, "narrator", ref), 409, "name")
    ids = [v["id"] for v in server.http.get("/v1/voices").json()["data"]]
    assert ids == ["default", "narrator"]
    client = server.client()
    cloned = client.audio.speech.create(model="higgs-tts-3", voice="narrator", input=TEXT, response_format="pcm",
                                        extra_body={"seed": 1, **QUICK}).content
    by_id = client.audio.speech.create(model="higgs-tts-3", voice={"id": "narrator"}, input=TEXT,
                                       response_format="pcm", extra_body={"seed": 1, **QUICK}).content
    plain = speech(server, seed=1, response_format="pcm", **QUICK).content
    assert cloned == by_id and len(cloned) > 0 and cloned != plain
    # any format and channel count libsndfile reads
    stereo_flac = io.BytesIO()
    wav, sr = sf.read(DATA / "ref_en_24k.wav", dtype="float32")
    sf.write(stereo_flac, np.stack([wav, wav], 1), sr, format="FLAC")
    assert upload(server, "flac_voice", stereo_flac.getvalue(), filename="ref.flac").status_code == 201
    assert server.http.delete("/v1/voices/narrator").json() == {"id": "narrator", "object": "voice", "deleted": True}
    assert server.http.delete("/v1/voices/flac_voice").status_code == 200
    assert_error(server.http.delete("/v1/voices/narrator"), 404, "name")
    err = assert_error(speech(server, voice="narrator"), 400, "voice")
    assert "default" in err["message"]
    (server.voices / "broken.npz").write_bytes(b"not a voice")  # damaged on disk: refused, listed, deletable
    assert "damaged" in assert_error(speech(server, voice="broken"), 400, "voice")["message"]
    assert server.http.delete("/v1/voices/broken").status_code == 200


def test_voice_upload_errors(server):
    ref = (DATA / "ref_en_24k.wav").read_bytes()
    silent = io.BytesIO()
    sf.write(silent, np.zeros(RATE, np.float32), RATE, format="WAV")
    assert_error(upload(server, "bad", b"this is not audio at all" * 100), 400, "file")
    assert_error(upload(server, "bad", ref[:30]), 400, "file")  # a truncated header
    assert_error(upload(server, "bad", silent.getvalue()), 400, "file")
    assert_error(upload(server, "bad", b""), 400, "file")
    for name in ("../evil", "a/b", "x" * 65, "default", "", "dot.name"):
        assert_error(upload(server, name, ref), 400, "name")
    assert_error(upload(server, "ok", ref, transcript="\x00"), 400, "transcript")
    assert_error(server.http.post("/v1/voices", data={"name": "nofile"}), 400)
    assert_error(server.http.post("/v1/voices", json={"name": "x"}), 400)
    big = upload(server, "big", os.urandom(21 << 20))
    assert_error(big, 413)
    assert [v["id"] for v in server.http.get("/v1/voices").json()["data"]] == ["default"]
    assert server.health()["status"] == "ok"


# -- errors ----------------------------------------------------------------------------------------------------
BAD = [
    ({"model": "tts-1"}, 400, "model"),
    ({"model": None}, 400, "model"),
    ({"input": None}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": "   "}, 400, "input"),
    ({"input": "x" * 4097}, 400, "input"),
    ({"input": ["a"]}, 400, "input"),
    ({"input": "<|emotion:elation|>"}, 400, "input"),
    ({"input": "bad \x00 byte"}, 400, "input"),
    ({"response_format": "aac"}, 400, "response_format"),
    ({"response_format": "ogg"}, 400, "response_format"),
    ({"stream_format": "websocket"}, 400, "stream_format"),
    ({"speed": 0.2}, 400, "speed"),
    ({"speed": 4.5}, 400, "speed"),
    ({"speed": "fast"}, 400, "speed"),
    ({"instructions": "Speak cheerfully."}, 400, "instructions"),
    ({"voice": "alloy"}, 400, "voice"),
    ({"voice": "../../etc/passwd"}, 400, "voice"),
    ({"voice": 5}, 400, "voice"),
    ({"temperature": -1}, 400, "temperature"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"top_k": -1}, 400, "top_k"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"seed": -1}, 400, "seed"),
    ({"seed": 1.5}, 400, "seed"),
    ({"max_rows": 0}, 400, "max_rows"),
    ({"max_rows": 10**9}, 400, "max_rows"),
]


def test_bad_requests_get_one_clear_error(server):
    for fields, status, param in BAD:
        body = {"model": "higgs-tts-3", "input": TEXT, **fields}
        body = {k: v for k, v in body.items() if v is not None}
        assert_error(server.http.post("/v1/audio/speech", json=body), status, param)
    post = server.http.post
    assert_error(post("/v1/audio/speech", content=b'{"model": "higgs', headers={"content-type": "application/json"}),
                 400)
    assert_error(post("/v1/audio/speech", content=b"\xff\xfe", headers={"content-type": "application/json"}), 400)
    assert_error(post("/v1/audio/speech", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    assert_error(post("/v1/audio/speech", content=json.dumps({"model": "higgs-tts-3", "input": TEXT}),
                      headers={"content-type": "text/plain"}), 415)
    huge = json.dumps({"model": "higgs-tts-3", "input": "x" * (2 << 20)})
    assert_error(post("/v1/audio/speech", content=huge, headers={"content-type": "application/json"}), 413)
    assert_error(post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT},
                      headers={"origin": "http://evil.example"}), 403)
    assert_error(server.http.get("/v1/audio/speech"), 405)
    assert_error(server.http.get("/v1/nothing"), 404)
    assert_error(server.http.get("/health", headers={"host": "rebound.example:80"}), 400)
    with pytest.raises(openai.BadRequestError) as e:
        server.client().audio.speech.create(model="higgs-tts-3", voice="default", input=TEXT, response_format="aac")
    assert "mp3, opus, wav, flac, pcm" in e.value.message
    # still serving, nothing left in flight
    assert speech(server, response_format="pcm", **QUICK).status_code == 200
    server.idle(within=2.0)


# -- load, disconnects, 429, API key ----------------------------------------------------------------------------
def test_load_is_deterministic_per_seed(server):
    """16 requests, 4 at a time, each with its own seed: responses equal the same request made alone.

    Not always to the bit: ONNX Runtime's CPU kernels take other code paths for several rows than for one (M > 1
    GEMM vs M = 1), so a batched decoder step can differ from the lone one by ~1e-6 in a hidden state (measured:
    seed 103 of this set, from row 20). Codes stay equal unless a sampled draw falls within that noise of a
    boundary, which happens here to one request of 16, after ~3 s of identical audio."""
    client = server.client()
    text = " ".join(["word"] * 20) + "."

    def run(seed: int) -> tuple[bytes, float, float]:
        t0 = time.perf_counter()
        first = None
        with client.audio.speech.with_streaming_response.create(model="higgs-tts-3", voice="default", input=text,
                                                                 response_format="pcm",
                                                                 extra_body={"seed": seed}) as r:
            pieces = []
            for b in r.iter_bytes():
                first = first if first is not None else time.perf_counter() - t0
                pieces.append(b)
        return b"".join(pieces), first, time.perf_counter() - t0

    seeds = list(range(100, 116))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(run, seeds))
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = [run(s)[0] for s in seeds]
    alone_wall = time.perf_counter() - t0
    lat = sorted(x[2] for x in loaded)
    first = sorted(x[1] for x in loaded)
    q = statistics.quantiles(lat, n=10)
    audio = sum(pcm_seconds(x[0]) for x in loaded)
    print(f"\nload: 16 requests x {audio / 16:.2f} s audio, 4 at a time, {wall:.2f} s wall: latency p50 "
          f"{statistics.median(lat):.3f} s, p90 {q[8]:.3f} s, max {lat[-1]:.3f} s; first audio p50 "
          f"{statistics.median(first):.3f} s, max {first[-1]:.3f} s; the same 16 one by one: {alone_wall:.2f} s")
    differ = [(seed, first_difference(a, b[0])) for seed, a, b in zip(seeds, alone, loaded, strict=True) if a != b[0]]
    print(f"batched == alone for {16 - len(differ)}/16 requests; differing (seed, (first sample, alone, batched)): "
          f"{differ}")
    assert len(differ) <= 1, f"batched != alone: (seed, (first differing sample, samples alone, batched)): {differ}"
    assert all(d[1][0] >= 2 * 24000 for d in differ)  # float noise flips a late draw, never the start
    assert len(set(alone)) > 1  # the seeds matter


def test_disconnect_frees_the_slot(server):
    t0 = time.perf_counter()
    with server.http.stream("POST", "/v1/audio/speech", json={"model": "higgs-tts-3", "input": LONG,
                                                              "response_format": "pcm", "max_rows": 3000}) as r:
        assert r.status_code == 200
        pieces = r.iter_bytes()  # kept: a dropped iterator closes the response at once
        assert next(pieces)
        started = time.perf_counter() - t0
        time.sleep(0.3)
        assert server.health()["scheduler"]["in_flight"] == 1
    freed = server.idle(within=3.0)
    print(f"\ndisconnect: first bytes after {started:.2f} s, slot free {freed:.2f} s after the client left")
    assert speech(server, response_format="pcm", **QUICK).status_code == 200


def test_full_queue_gets_429(tight):
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": "higgs-tts-3", "input": LONG, "response_format": "pcm", "max_rows": 3000}

    def call(_) -> tuple[int, dict]:
        with tight.http.stream("POST", "/v1/audio/speech", json=body, headers=auth) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, {"json": r.json(), "retry": r.headers.get("retry-after")}
            pieces = r.iter_bytes()
            next(pieces)  # admitted: stay a moment, then leave (cancels it)
            time.sleep(0.3)
            return 200, {}

    refused = []
    for _ in range(5):
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(call, range(4)))
        refused = [x for s, x in results if s == 429]
        assert all(s in (200, 429) for s, _ in results), results
        if refused:
            break
    assert refused, "no request was refused with 429"
    err = refused[0]["json"]["error"]
    assert err["code"] == "rate_limit_exceeded" and refused[0]["retry"] == "1"
    tight.idle(within=5.0)
    with pytest.raises(openai.RateLimitError):  # a held slot, as the openai client sees it
        with tight.http.stream("POST", "/v1/audio/speech", json=body, headers=auth) as r:
            pieces = r.iter_bytes()  # kept: a dropped iterator closes the response (the client leaves)
            assert r.status_code == 200 and next(pieces)
            tight.client(KEY).audio.speech.create(model="higgs-tts-3", voice="default", input=TEXT)
    tight.idle(within=5.0)


def test_api_key(tight):
    assert tight.http.get("/health").status_code == 200  # open, for load balancers
    assert tight.http.get("/").status_code == 200  # the page asks for the key itself
    assert assert_error(tight.http.get("/v1/models"), 401)["code"] == "missing_api_key"
    assert_error(tight.http.get("/v1/models", headers={"authorization": "Bearer nope"}), 401)
    assert_error(tight.http.get("/v1/voices", headers={"authorization": KEY}), 401)  # no Bearer
    with pytest.raises(openai.AuthenticationError):
        tight.client("wrong").audio.speech.create(model="higgs-tts-3", voice="default", input=TEXT)
    audio = tight.client(KEY).audio.speech.create(model="higgs-tts-3", voice="default", input=TEXT,
                                                  response_format="wav", extra_body=QUICK)
    assert sf.info(io.BytesIO(audio.content)).samplerate == RATE
    assert "API key required" in tight.banner


# -- command line ----------------------------------------------------------------------------------------------
def test_bad_command_lines_exit_2(builds):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "higgs_onnx.serve", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "CI": "1"})

    model = str(builds["fp32"])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = [(["--model-path", model, "--port", "70000"], "--port"),
                 (["--model-path", model, "--max-batch", "0"], "--max-batch"),
                 (["--model-path", model, "--max-queue", "-1"], "--max-queue"),
                 (["--model-path", model, "--api-key", " "], "--api-key"),
                 (["--model-path", str(REPO / "no_such_export")], "--model-path"),
                 (["--model-path", model, "--port", str(busy.getsockname()[1])], "cannot listen")]
        for args, words in cases:
            p = run(*args)
            assert p.returncode == 2, (args, p.stderr)
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], (args, p.stderr)
