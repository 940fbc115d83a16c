"""A speech request that would produce no audio is never a 200 with an empty body.

The request contract makes it unreachable with a real model (every request can hold one frame), so the app runs
in this process (ASGI called directly, tiny fp32 export, the real scheduler) with the codec replaced by one that
decodes nothing (the generation ends without audio: `NoAudioError`), and with a scheduler whose job ends without
any chunk at all. A request that comes once the scheduler has stopped is a 503.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from higgs_onnx.serve.app import create_app
from higgs_onnx.serve.scheduler import JobScheduler

pytestmark = pytest.mark.slow
BODY = {"model": "higgs-tts-3", "input": "Hello there world.", "response_format": "pcm", "max_rows": 60}


class NoSamples:
    """An incremental codec that decodes nothing."""

    def push(self, frames):
        return []

    def flush(self):
        return np.zeros(0, np.float32)


async def call(app, body: dict) -> tuple[int, bytes]:
    """One POST /v1/audio/speech through the ASGI app -> (status, body)."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/audio/speech", "raw_path": b"/v1/audio/speech",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    pending = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # the client stays

    sent = []

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 120)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def run(app, scheduler, body: dict) -> tuple[int, bytes]:
    scheduler.start()
    try:
        return asyncio.run(call(app, body))
    finally:
        scheduler.stop()


def test_generation_without_audio_is_an_error(tts, tmp_path, monkeypatch):
    def fresh():
        scheduler = JobScheduler(tts, max_batch=2, max_queue=2)
        return create_app(tts, scheduler, tmp_path / "voices"), scheduler

    status, body = run(*fresh(), BODY)
    assert status == 200 and body  # the same request with the real codec: audio
    monkeypatch.setattr(tts, "codec_stream", lambda options: NoSamples())
    app, scheduler = fresh()
    status, body = run(app, scheduler, BODY)
    err = json.loads(body)["error"]
    assert status == 500 and err["code"] == "no_audio" and "without one audio frame" in err["message"], body
    assert scheduler.stats()["failed"] == 1


def test_a_job_with_no_chunk_is_an_error(tts, tmp_path):
    class Empty(JobScheduler):
        def submit(self, text, **kw):
            job = super().submit(text, **kw)
            job.cancel()  # leaves before its first chunk: the job ends with nothing
            return job

    scheduler = Empty(tts, max_batch=1, max_queue=1)
    app = create_app(tts, scheduler, tmp_path / "voices")
    status, body = run(app, scheduler, BODY)
    assert status == 500 and json.loads(body)["error"]["code"] == "no_audio", body


def test_a_request_after_shutdown_is_503(tts, tmp_path):
    scheduler = JobScheduler(tts, max_batch=1, max_queue=1)
    app = create_app(tts, scheduler, tmp_path / "voices")
    scheduler.start()
    scheduler.stop()
    status, body = asyncio.run(call(app, BODY))
    err = json.loads(body)["error"]
    assert status == 503 and err["code"] == "shutting_down", body
    assert scheduler.stats()["submitted"] == 0
