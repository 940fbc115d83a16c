"""The speech server of the tests, defined once (a support module, not a test module: `from servers import ...`).

`served(model, tmp, *flags)` starts `python -m higgs_onnx.serve` (serve/process.py) for a block and stops it after,
then checks that its log holds no traceback; every server fixture and every test that starts a server of its own
goes through it:

    @pytest.fixture(scope="module")
    def server(builds, tmp_path_factory):
        with served(builds["fp32"], tmp_path_factory.mktemp("name"), "--max-batch", "1") as s:
            yield s

`Server` is what it yields: the process, an httpx client on its URL, the official `openai` client, /health and the
scheduler's counters, polled a bounded number of times (a wait that never ends fails instead of hanging). Also here:
the OpenAI error body's check (`assert_error`), the inputs several server modules share, and `in_process(app)`: the
real app served in this process (for a stand-in patched into it).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest

from higgs_onnx.serve.process import ServerProcess

DATA = Path(__file__).resolve().parent / "data"
TEXT = "Hello there world, this is the speech server."
LONG = " ".join(["word"] * 300) + "."  # the tiny model speaks ~13 rows per word: runs to the row limit (s)
QUICK = {"max_rows": 120}  # a short utterance for tests that are not about the audio
POLLS = 1200  # bounded polls of /health (0.05 s apart): a wait that never ends fails instead of hanging


def free_port() -> int:
    """A TCP port nothing listens on now (for a server's second door, `--wyoming tcp://127.0.0.1:PORT`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server(ServerProcess):
    """A `python -m higgs_onnx.serve` subprocess for the export `model`, its voices in `tmp/voices` and its log in
    `tmp/server.log`, with the tests' helpers. `wyoming=True` opens the Wyoming door too, on `wyoming_port`;
    `process`: ServerProcess's own keywords (another `python`, `cwd`, `env`)."""

    def __init__(self, model: str | os.PathLike, tmp: Path, *args: str, timeout: float = 120.0,
                 http_timeout: float = 120.0, wyoming: bool = False, **process):
        tmp.mkdir(parents=True, exist_ok=True)
        self.voices = tmp / "voices"
        self.wyoming_port = free_port() if wyoming else None
        door = ("--wyoming", f"tcp://127.0.0.1:{self.wyoming_port}") if wyoming else ()
        try:
            super().__init__(model, self.voices, tmp / "server.log", *door, *args, timeout=timeout, **process)
        except RuntimeError as e:
            pytest.fail(str(e))
        self.http = httpx.Client(base_url=self.url, timeout=http_timeout)

    def client(self, key: str = "none"):
        """The official `openai` client on this server."""
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def health(self) -> dict:
        r = self.http.get("/health")
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self) -> dict:
        return self.health()["scheduler"]

    def wait(self, done, what: str) -> dict:
        """The scheduler stats once `done(stats)` holds (polled; fails after POLLS polls, never hangs)."""
        for _ in range(POLLS):
            stats = self.stats()
            if done(stats):
                return stats
            time.sleep(0.05)
        pytest.fail(f"{what}: not reached, scheduler {self.stats()}")

    def settle(self) -> dict:
        """The stats once nothing is in flight."""
        return self.wait(lambda s: s["in_flight"] == 0, "nothing in flight")

    def released(self) -> dict:
        """The stats once nothing is in flight and no session keeps a context (a session's end gives its kept
        context back as its handler ends, just after the client has its last event): fails if one stays kept."""
        return self.wait(lambda s: s["in_flight"] == 0 and s["kept"] == 0, "nothing in flight or kept")

    def stop(self) -> None:
        super().stop(timeout=15)


@contextmanager
def served(model: str | os.PathLike, tmp: Path, *args: str, **kw) -> Iterator[Server]:
    """A `Server` (same arguments) for the block, stopped after it (also when the block raised; a server the block
    stopped itself is left as it is); a block that ended well then finds no traceback in the server's log."""
    s = Server(model, tmp, *args, **kw)
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            s.stop()
    log = s.log.read_text()
    assert "Traceback" not in log, log[-3000:]


@contextmanager
def in_process(app) -> Iterator[str]:
    """`app` (the real ASGI app, with a stand-in patched into it) served by uvicorn on a free port in a thread of
    this process for the block; its http:// URL. For what a subprocess cannot be given: a session that speaks real
    speech in place of the model."""
    import threading

    import uvicorn

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    for _ in range(POLLS):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def assert_error(r: httpx.Response, status: int, param: str | None = "any", code: str | None = "any") -> dict:
    """An OpenAI error body with `status` (and `param`, `code` where given), one line, no traceback."""
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and "\n" not in err["message"] and "Traceback" not in r.text, err
    if param != "any":
        assert err["param"] == param, err
    if code != "any":
        assert err["code"] == code, err
    return err


def first_difference(a: bytes, b: bytes) -> tuple[int, int, int]:
    """(the first sample where two PCM bodies differ, or the shorter's length; both lengths in samples)."""
    x, y = np.frombuffer(a, "<i2"), np.frombuffer(b, "<i2")
    n = min(len(x), len(y))
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if len(diff) else n, len(x), len(y)


def sentences(n: int, per_paragraph: int = 6) -> str:
    """`n` sentences of ~50 characters, a paragraph every `per_paragraph` (90: beyond one request, read in
    pieces)."""
    out = []
    for i in range(n):
        out.append(f"Sentence number {i} is here, to be read aloud in turn.")
        if i % per_paragraph == per_paragraph - 1:
            out.append("\n\n")
    return " ".join(out).strip()
