"""The speech server, for real: `python -m higgs_onnx.serve` on the tiny fp32 export, called over loopback with the
official `openai` client (and httpx2 for what it does not cover: multipart voice uploads, raw error bodies).

One server per module for the API (fp32: the load test compares bytes), and a second one with one batch slot, no
queue and an API key for the 429 and 401 tests. Nothing here asserts on wall-clock time: what must happen "soon"
(a freed slot, audio while generating) is read from the scheduler's counters in /health, polled a bounded number
of times. HTTP framing and the client guards (timeouts, sizes) are in test_server_edges.py, the request contract
and the upload checks here, batched determinism in test_server_determinism.py.
"""

from __future__ import annotations

import io
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from servers import DATA, LONG, QUICK, TEXT, Server, assert_error, first_difference, served

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RATE = 24000
KEY = "test-key-123"
LONG_ROWS = 2400  # LONG's prompt (~600 positions) + 2400 rows fit the server's 3072-position batch slot


@pytest.fixture(scope="module")
def server(builds, tmp_path_factory):
    with served(builds["fp32"], tmp_path_factory.mktemp("server")) as s:
        yield s


@pytest.fixture(scope="module")
def tight(builds, tmp_path_factory):
    """One batch slot, no queue, an API key."""
    with served(builds["fp32"], tmp_path_factory.mktemp("tight"), "--max-batch", "1", "--max-queue", "0",
                "--api-key", KEY) as s:
        yield s


def speech(server: Server, **body) -> httpx.Response:
    return server.http.post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT, **body})


def pcm_seconds(data: bytes) -> float:
    return len(data) / 2 / RATE


# -- basics ----------------------------------------------------------------------------------------------------
def test_health_models_page(server, builds):
    h = server.health()
    assert h["status"] == "ok" and h["model"] == builds["fp32"].name and h["sample_rate"] == RATE
    assert h["scheduler"]["in_flight"] == 0 and h["scheduler"]["max_batch"] == 4
    # the limits a request is checked against: the tiny model's 4096 positions, the pool's 3072-position slots
    limits = h["limits"]
    assert (limits["context_positions"], limits["slot_positions"], limits["default_max_rows"]) == (4096, 3072, 2048)
    assert limits["min_rows"] == 8 and h["scheduler"]["slot_positions"] == 3072
    assert set(limits["timeouts_s"]) == {"header_s", "body_idle_s", "body_s", "send_s", "keep_alive_s"}
    head = server.http.head("/health")
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
    assert server.url.startswith("http://127.0.0.1:") and builds["fp32"].name in server.banner
    ids = [m.id for m in server.client().models.list()]
    assert ids[0] == builds["fp32"].name and {"higgs-tts-3", "higgs-audio-v3-tts"} <= set(ids)
    assert {"tts-1", "tts-1-hd", "gpt-4o-mini-tts"} <= set(ids)  # OpenAI's ids: a stock client config works
    assert server.client().models.retrieve("tts-1").parent == builds["fp32"].name
    # no Swagger page (it loads from a CDN), the schema stays
    assert_error(server.http.get("/docs"), 404)
    assert "/v1/audio/speech" in server.http.get("/openapi.json").json()["paths"]
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
    """Audio arrives while it is generated: several pieces, and the first one while the job is still running (the
    scheduler says so, and it has stepped fewer rows than the whole utterance takes)."""
    steps0 = server.stats()["decoder_steps"]
    pieces, during = [], None
    with server.client().audio.speech.with_streaming_response.create(
            model="higgs-tts-3", voice="default", input=LONG, response_format="pcm",
            extra_body={"max_rows": LONG_ROWS}) as r:
        assert r.headers["content-type"].startswith("audio/pcm")
        for b in r.iter_bytes():
            if during is None:
                during = server.stats()
            pieces.append(b)
    after = server.settle()
    assert len(pieces) >= 3, [len(p) for p in pieces]
    assert during["in_flight"] == 1 and during["active"] == 1, during  # still generating at the first piece
    assert during["decoder_steps"] - steps0 < (after["decoder_steps"] - steps0) / 2, (steps0, during, after)
    assert pcm_seconds(b"".join(pieces)) > 5


def test_every_format_decodes(server):
    """The same seeded request in every format: wav carries the pcm bytes exactly, flac decodes to them, mp3 and
    opus and aac to about the same duration (aac's decode is the same audio); the streaming formats arrive in several
    pieces."""
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
    import av  # AAC (ADTS): libsndfile cannot read it; FFmpeg through PyAV can

    data, pieces = fetch("aac")
    with av.open(io.BytesIO(data), format="adts") as f:
        frames = [fr.to_ndarray() for fr in f.decode(audio=0)]
        assert f.streams.audio[0].codec_context.sample_rate == RATE
    aac = np.concatenate(frames, axis=1)[0]
    assert pieces >= 2 and abs((len(aac) - 1024) / RATE - seconds) <= 1024 / RATE  # less the encoder's priming
    assert np.corrcoef(aac[1024:1024 + len(ref)][:len(ref)], ref[:len(aac) - 1024])[0, 1] > 0.9


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
    for model in ("tts-1", "tts-1-hd", "gpt-4o-mini-tts"):  # a stock OpenAI config, unchanged
        audio = server.client().audio.speech.create(model=model, voice="default", input=TEXT, response_format="pcm",
                                                    extra_body=QUICK)
        assert len(audio.content) > 0, model
    # fields other clients send: ignored, not refused, and named in a header
    r = speech(server, response_format="pcm", stream=True, lang_code="a", volume_multiplier=1.0,
               instructions="", **QUICK)
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "lang_code,volume_multiplier"


# -- voices ----------------------------------------------------------------------------------------------------
def upload(server: Server, name: str, data: bytes, transcript: str | None = None, filename: str = "ref.wav"):
    fields = {"name": name, **({"transcript": transcript} if transcript is not None else {})}
    return server.http.post("/v1/voices", data=fields, files={"file": (filename, data, "application/octet-stream")})


def test_voice_lifecycle(server):
    ref = (DATA / "ref_en_24k.wav").read_bytes()
    cached = server.health()["voice_cache"]["voices"]
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
    assert server.health()["voice_cache"]["voices"] == cached + 1  # narrator has left it already
    assert server.http.delete("/v1/voices/flac_voice").status_code == 200
    assert server.health()["voice_cache"]["voices"] == cached  # deleted voices leave the model's cache
    assert_error(server.http.delete("/v1/voices/narrator"), 404, "name")
    err = assert_error(speech(server, voice="narrator"), 400, "voice")
    assert "default" in err["message"]
    (server.voices / "broken.npz").write_bytes(b"not a voice")  # damaged on disk: refused, listed, deletable
    assert "damaged" in assert_error(speech(server, voice="broken"), 400, "voice")["message"]
    assert server.http.delete("/v1/voices/broken").status_code == 200


def wav_bytes(samples: np.ndarray, rate: int, subtype: str = "PCM_16") -> bytes:
    out = io.BytesIO()
    sf.write(out, samples, rate, format="WAV", subtype=subtype)
    return out.getvalue()


def noise(frames: int, channels: int = 1, level: float = 0.1) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((frames, channels)) * level).astype(np.float32)


# absurd uploads: (name, file bytes, words the one-line 400 must hold)
BAD_AUDIO = [
    ("two_samples", wav_bytes(noise(2), RATE), "at least 1 s"),
    ("half_second", wav_bytes(noise(RATE // 2), RATE), "at least 1 s"),
    ("38_mhz", wav_bytes(noise(4000), 38_000_000), "38000000 Hz"),
    ("4_khz", wav_bytes(noise(8000), 4000), "4000 Hz"),
    ("1000_channels", wav_bytes(noise(100, 1000), RATE), "1000 channels"),
    ("constant", wav_bytes(np.full(RATE, 0.5, np.float32), RATE), "constant"),
    ("zeros", wav_bytes(np.zeros(RATE, np.float32), RATE), "constant"),
    ("whisper", wav_bytes(noise(RATE, level=1e-4), RATE, "FLOAT"), "silent"),
    ("square", wav_bytes(np.sign(np.sin(np.arange(2 * RATE) / 9.0)).astype(np.float32) / 2, RATE), "distinct"),
    ("truncated_data", wav_bytes(noise(2 * RATE), RATE)[:RATE], "at least 1 s"),  # 2 s cut to 0.5 s
]


def test_voice_upload_errors(server):
    ref = (DATA / "ref_en_24k.wav").read_bytes()
    assert_error(upload(server, "bad", b"this is not audio at all" * 100), 400, "file")
    assert_error(upload(server, "bad", ref[:30]), 400, "file")  # a truncated header
    assert_error(upload(server, "bad", b""), 400, "file")
    for name, data, words in BAD_AUDIO:
        err = assert_error(upload(server, name, data), 400, "file", "invalid_audio")
        assert words in err["message"], (name, err)
    assert upload(server, "noise_ok", wav_bytes(noise(2 * RATE), RATE)).status_code == 201  # 2 s of noise: taken
    assert server.http.delete("/v1/voices/noise_ok").status_code == 200
    for name in ("../evil", "a/b", "x" * 65, "default", "Default", "", "dot.name"):
        assert_error(upload(server, name, ref), 400, "name")
    assert_error(upload(server, "ok", ref, transcript="\x00"), 400, "transcript")
    assert_error(upload(server, "ok", ref, transcript="Hello <|audio|> there"), 400, "transcript", "special_token")
    assert_error(upload(server, "ok", ref, transcript=" ".join(["word"] * 2500)), 400, "transcript",
                 "context_length_exceeded")  # the voice's prompt alone is past the context: 400, not a 500
    assert_error(server.http.post("/v1/voices", data={"name": "nofile"}), 400)
    assert_error(server.http.post("/v1/voices", json={"name": "x"}), 400)
    big = upload(server, "big", os.urandom(21 << 20))
    assert_error(big, 413)
    assert [v["id"] for v in server.http.get("/v1/voices").json()["data"]] == ["default"]
    assert server.health()["status"] == "ok"


def test_voice_names_ignore_case_and_default_is_reserved(server):
    ref = (DATA / "ref_en_24k.wav").read_bytes()
    assert upload(server, "bob", ref).status_code == 201
    try:
        for other in ("Bob", "BOB", "bob"):
            err = assert_error(upload(server, other, ref), 409, "name", "voice_exists")
            assert "'bob'" in err["message"], err
        assert [v["id"] for v in server.http.get("/v1/voices").json()["data"]] == ["default", "bob"]
    finally:
        assert server.http.delete("/v1/voices/bob").status_code == 200
    for name in ("default", "DEFAULT"):
        err = assert_error(server.http.delete(f"/v1/voices/{name}"), 400, "name", "reserved_voice")
        assert "built in" in err["message"]
    # "Default" picks the built-in voice, like "default"
    assert speech(server, voice="Default", response_format="pcm", **QUICK).status_code == 200


# -- errors ----------------------------------------------------------------------------------------------------
BAD = [
    ({"model": "tts-2"}, 400, "model"),
    ({"model": 1}, 400, "model"),
    ({"model": None}, 400, "model"),
    ({"input": None}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": "   "}, 400, "input"),
    ({"input": "x" * 50001}, 400, "input"),  # past the bound of an input read in pieces (beyond 4096: pieces)
    ({"input": ["a"]}, 400, "input"),
    ({"input": "<|emotion:elation|>"}, 400, "input"),
    ({"input": "bad \x00 byte"}, 400, "input"),
    ({"response_format": "m4a"}, 400, "response_format"),
    ({"response_format": "ogg"}, 400, "response_format"),
    ({"stream_format": "websocket"}, 400, "stream_format"),
    ({"speed": 0.2}, 400, "speed"),
    ({"speed": 4.5}, 400, "speed"),
    ({"speed": "fast"}, 400, "speed"),
    ({"instructions": "Speak like a pirate."}, 400, "instructions"),  # a word the tags table cannot map
    ({"instructions": 5}, 400, "instructions"),
    ({"normalize": "fr"}, 400, "normalize"),
    ({"lexicon": {"Ann": 5}}, 400, "lexicon"),
    ({"lexicon": ["Ann"]}, 400, "lexicon"),
    ({"markdown": "yes"}, 400, "markdown"),
    ({"voice": "nosuchvoice"}, 400, "voice"),
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
    # strict types: a string or a boolean is not a number
    ({"top_k": "5"}, 400, "top_k"),
    ({"top_k": True}, 400, "top_k"),
    ({"top_k": 5.0}, 400, "top_k"),
    ({"seed": True}, 400, "seed"),
    ({"seed": "1"}, 400, "seed"),
    ({"max_rows": "100"}, 400, "max_rows"),
    ({"temperature": "0.8"}, 400, "temperature"),
    ({"temperature": True}, 400, "temperature"),
    ({"top_p": False}, 400, "top_p"),
    ({"speed": True}, 400, "speed"),
    ({"deterministic": "yes"}, 400, "deterministic"),
    ({"deterministic": 1}, 400, "deterministic"),
    ({"voice": {"id": 5}}, 400, "voice"),
    ({"response_format": 1}, 400, "response_format"),
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
    for ctype in ("text/plain", "text/plain; charset=json", "application/jsonx", "application/json; charset=latin-1",
                  "json", ""):
        assert_error(post("/v1/audio/speech", content=json.dumps({"model": "higgs-tts-3", "input": TEXT}),
                          headers={"content-type": ctype}), 415, None, "invalid_content_type")
    assert_error(post("/v1/audio/speech", content=b"[" * 100000, headers={"content-type": "application/json"}), 400,
                 None, "invalid_json")  # nested too deeply for Python's parser: a 400, not a RecursionError 500
    huge = json.dumps({"model": "higgs-tts-3", "input": "x" * (2 << 20)})
    assert_error(post("/v1/audio/speech", content=huge, headers={"content-type": "application/json"}), 413)
    assert_error(post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT},
                      headers={"origin": "http://evil.example"}), 403)
    assert_error(server.http.get("/v1/audio/speech"), 405)
    assert_error(server.http.get("/v1/nothing"), 404)
    assert_error(server.http.get("/health", headers={"host": "rebound.example:80"}), 400)
    with pytest.raises(openai.BadRequestError) as e:
        server.client().audio.speech.create(model="higgs-tts-3", voice="default", input=TEXT, response_format="m4a")
    assert "mp3, opus, wav, aac, flac, pcm" in e.value.message
    # still serving, nothing left in flight
    assert speech(server, response_format="pcm", **QUICK).status_code == 200
    server.settle()


def test_typed_values_that_are_right(server):
    """Strictness has no false alarms: an integer where a float goes, JSON null for an optional field, application/
    json with a charset or a +json type."""
    for fields in ({"temperature": 1, "top_p": 1, "speed": 1}, {"seed": None, "top_k": None}, {"deterministic": True},
                   {"voice": {"id": "default"}}):
        assert speech(server, response_format="pcm", **QUICK, **fields).status_code == 200, fields
    body = json.dumps({"model": "higgs-tts-3", "input": TEXT, "response_format": "pcm", **QUICK})
    for ctype in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
        r = server.http.post("/v1/audio/speech", content=body, headers={"content-type": ctype})
        assert r.status_code == 200 and r.content, (ctype, r.text[:200])


# -- the request contract ----------------------------------------------------------------------------------------
def create_speech(server: Server, text: str, **extra):
    return server.client().audio.speech.create(model="tts-1", voice=extra.pop("voice", "default"), input=text,
                                               response_format="pcm", extra_body=extra)


def contract_refusal(server: Server, text: str, status: int, code: str, param: str, **extra) -> str:
    """The openai client's view of a refusal: its exception class, the status, OpenAI's code and param."""
    with pytest.raises(openai.APIStatusError) as e:
        create_speech(server, text, **extra)
    err = e.value
    assert err.status_code == status and err.code == code and err.param == param, (err.status_code, err.body)
    assert isinstance(err, openai.BadRequestError) == (status == 400)
    return err.message


def test_special_tokens_are_refused_tags_are_not(server):
    for token in ("<|audio|>", "<|im_start|>", "<|endoftext|>"):
        message = contract_refusal(server, f"Hello {token} there.", 400, "special_token", "input", **QUICK)
        assert token in message
    assert len(create_speech(server, "<|emotion:elation|>Hello there.", **QUICK).content) > 0  # a control tag: fine


def test_max_rows_must_fit_and_hold_a_frame(server):
    message = contract_refusal(server, TEXT, 400, "context_length_exceeded", "max_rows", max_rows=4095)
    assert all(n in message for n in ("4095", "3072", "4096")), message  # the numbers, named
    message = contract_refusal(server, TEXT, 400, "invalid_value", "max_rows", max_rows=1)
    assert "8" in message and "frame" in message
    # the prompt plus max_rows past the slot: refused with the room there is, never cut
    message = contract_refusal(server, LONG, 400, "context_length_exceeded", "max_rows", max_rows=3000)
    assert "at most" in message
    assert len(create_speech(server, TEXT, max_rows=8).content) > 0  # 8 rows: exactly one frame


def test_long_input_after_long_transcript_voice_is_refused(server):
    """A voice whose transcript fills most of the slot (~2800 of 3072 positions): a long input no longer fits
    (413, nothing generated, never a 200 with cut audio), a short one still does."""
    ref = (DATA / "ref_en_24k.wav").read_bytes()
    r = upload(server, "wordy", ref, " ".join(["word"] * 1300) + ".")
    assert r.status_code == 201, r.text
    mid = " ".join(["word"] * 100) + "."  # its prompt fits, its speech does not
    try:
        before = server.stats()["submitted"]
        message = contract_refusal(server, LONG, 413, "context_length_exceeded", "input", voice="wordy")
        assert "transcript" in message and "3072" in message, message  # the prompt alone is past the slot
        message = contract_refusal(server, mid, 413, "context_length_exceeded", "input", voice="wordy")
        assert "long-form" in message, message  # the room after the prompt is too short for the text
        message = contract_refusal(server, mid, 400, "context_length_exceeded", "max_rows", voice="wordy",
                                   max_rows=2048)
        assert "at most" in message, message
        assert server.stats()["submitted"] == before  # refused before any work
        assert len(create_speech(server, "Hi there.", voice="wordy").content) > 0
    finally:
        server.http.delete("/v1/voices/wordy")
    # a voice that cannot leave room in a batch slot is refused when it is made, not at each request
    r = upload(server, "too_wordy", ref, " ".join(["word"] * 1500) + ".")
    err = assert_error(r, 400, "transcript", "context_length_exceeded")
    assert "3072" in err["message"]


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
    before = server.settle()
    with server.http.stream("POST", "/v1/audio/speech", json={"model": "higgs-tts-3", "input": LONG,
                                                              "response_format": "pcm", "max_rows": LONG_ROWS}) as r:
        assert r.status_code == 200
        pieces = r.iter_bytes()  # kept: a dropped iterator closes the response at once
        assert next(pieces)
        held = server.stats()
        assert held["in_flight"] == 1 and held["active"] == 1, held
    freed = server.wait(lambda s: s["cancelled"] > before["cancelled"], "the job cancelled")
    freed = server.settle()  # and its slot given back
    assert freed["cancelled"] == before["cancelled"] + 1 and freed["finished"] == before["finished"], (before, freed)
    assert freed["active"] == 0 and freed["in_flight"] == 0
    steps = freed["decoder_steps"] - before["decoder_steps"]
    print(f"\ndisconnect: the job was cancelled after {steps} decoder steps (of up to {LONG_ROWS})")
    assert steps < LONG_ROWS - 100  # it did not run to its end
    assert speech(server, response_format="pcm", **QUICK).status_code == 200


def test_full_queue_gets_429(tight):
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": "higgs-tts-3", "input": LONG, "response_format": "pcm", "max_rows": LONG_ROWS}

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
    tight.settle()
    with pytest.raises(openai.RateLimitError):  # a held slot, as the openai client sees it
        with tight.http.stream("POST", "/v1/audio/speech", json=body, headers=auth) as r:
            pieces = r.iter_bytes()  # kept: a dropped iterator closes the response (the client leaves)
            assert r.status_code == 200 and next(pieces)
            tight.client(KEY).audio.speech.create(model="higgs-tts-3", voice="default", input=TEXT)
    tight.settle()


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
                 (["--model-path", model, "--prefill-chunk", "0"], "--prefill-chunk"),
                 (["--model-path", model, "--prefill-chunk", "x"], "--prefill-chunk"),
                 (["--model-path", model, "--api-key", " "], "--api-key"),
                 (["--model-path", model, "--guard", "loop_rows=0"], "loop_rows"),
                 (["--model-path", model, "--guard", "nonsense=1"], "--guard"),
                 (["--model-path", str(REPO / "no_such_export")], "--model-path"),
                 (["--model-path", model, "--port", str(busy.getsockname()[1])], "cannot listen")]
        for args, words in cases:
            p = run(*args)
            assert p.returncode == 2, (args, p.stderr)
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], (args, p.stderr)


def test_retries_send_a_judged_take_whole(server):
    """`"retries": n`: the take is judged by the guard before it is sent (whole, not streamed); the headers and
    the SSE done event say how many takes it took and the verdict. A take cut by the request's own max_rows is not
    drawn again."""
    r = speech(server, seed=3, response_format="pcm", retries=2)
    assert r.status_code == 200 and r.headers["x-takes"] == "1" and r.headers["x-verdict"] == "good"
    assert r.content == speech(server, seed=3, response_format="pcm").content  # a good first take: the same audio
    cut = speech(server, seed=3, response_format="pcm", retries=2, max_rows=20)
    assert cut.status_code == 200 and (cut.headers["x-takes"], cut.headers["x-verdict"]) == ("1", "max_rows")
    events = []
    with server.http.stream("POST", "/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT, "seed": 3,
                                                              "retries": 1, "response_format": "pcm",
                                                              "stream_format": "sse"}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    done = events[-1]
    assert done["type"] == "speech.audio.done" and done["stop_reason"] == "eoc"
    assert [t["verdict"] for t in done["takes"]] == ["good"] and done["takes"][0]["seed"] == 3
    for bad in (11, -1):
        assert_error(speech(server, retries=bad), 400, "retries", "invalid_value")
    assert_error(speech(server, retries="2"), 400, "retries", "invalid_value")
    server.settle()


@pytest.fixture(scope="module")
def strict(builds, tmp_path_factory):
    """A guard that calls every take of the tiny checkpoint overlong (they run ~2 x their text's reading time)."""
    with served(builds["fp32"], tmp_path_factory.mktemp("strict"), "--guard", "overlong_factor=1.01", "--guard",
                "slack_s=0") as s:
        yield s


def test_the_server_draws_a_degenerate_take_again(strict):
    from higgs_onnx.guard import RetryPolicy

    r = speech(strict, seed=3, response_format="pcm", retries=2)
    assert r.status_code == 200 and r.headers["x-takes"] == "3" and r.headers["x-verdict"] == "overlong"
    with strict.http.stream("POST", "/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT, "seed": 3,
                                                              "temperature": 0.8, "retries": 1,
                                                              "response_format": "pcm", "stream_format": "sse"}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    takes = events[-1]["takes"]
    assert [(t["seed"], t["verdict"]) for t in takes] == [(3, "overlong"), (3 + RetryPolicy.seed_step, "overlong")]
    assert takes[1]["temperature"] == pytest.approx(0.65)
    plain = speech(strict, seed=3, response_format="pcm", stream_format="sse")  # no retries: it streams, and stops
    assert json.loads(plain.text.strip().splitlines()[-1][6:])["stop_reason"] == "overlong"
    strict.settle()


def test_best_of_takes_on_the_server(server):
    with server.http.stream("POST", "/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT, "seed": 3,
                                                              "takes": 3, "response_format": "pcm",
                                                              "stream_format": "sse"}) as s:
        assert s.headers["x-takes"] == "3" and s.headers["x-verdict"] == "good"
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    takes = events[-1]["takes"]
    assert [t["take"] for t in takes] == [1, 2, 3] and sum(t["kept"] for t in takes) == 1
    kept = next(t for t in takes if t["kept"])
    assert events[-1]["stats"]["rows"] == kept["rows"] and kept["score"] == max(t["score"] for t in takes)
    for body, words in (({"takes": 17}, "takes must be from 1 to 16"), ({"takes": 2, "retries": 1}, "not both"),
                        ({"takes": 2, "temperature": 0}, "needs sampling"), ({"takes": "3"}, "takes")):
        err = assert_error(speech(server, **body), 400, "takes", "invalid_value")
        assert words in err["message"], err
    server.settle()
