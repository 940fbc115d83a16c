"""The server's HTTP edges with raw sockets: slow or stuck clients (headers that never end, bodies shorter than their
Content-Length, an absurd chunk size, a trickle), sizes (headers, declared and sent bodies), connection limits, a
client that leaves mid-body, HEAD. Each case must end in a bounded time with one clear answer (or a close) and one
log line, never a hang or a traceback.

The server here runs with short timeouts (`--header-timeout 1.5` ...) so the cases end quickly; sockets carry a
generous timeout of their own only so that a regression fails instead of hanging. What fired is read from the
`guards` counters of /health, not from the clock.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx2 as httpx
import pytest
from servers import DATA, QUICK, TEXT, Server, assert_error, served

from higgs_onnx.serve.limits import MAX_HEADER_BYTES, Timeouts, guarded_protocol

pytestmark = pytest.mark.slow

TIMEOUTS = {"--header-timeout": "1.5", "--body-idle-timeout": "1.5", "--body-timeout": "4",
            "--keep-alive-timeout": "1", "--max-connections": "8"}
BOUND = 30.0  # a socket read that takes this long means the server hangs: fail


@pytest.fixture(scope="module")
def edge(builds, tmp_path_factory):
    with served(builds["fp32"], tmp_path_factory.mktemp("edges"), *[x for kv in TIMEOUTS.items() for x in kv]) as s:
        yield s


def connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=BOUND)
    return s


def read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            data = s.recv(65536)
        except TimeoutError:
            pytest.fail(f"the server neither answered nor closed within {BOUND} s (got {out[:200]!r})")
        except ConnectionResetError:
            return out
        if not data:
            return out
        out += data


def read_response(s: socket.socket) -> bytes:
    """One whole response with a Content-Length, from a connection that stays open."""
    raw = b""
    while b"\r\n\r\n" not in raw or len(raw.partition(b"\r\n\r\n")[2]) < int(parse(raw)[1]["content-length"]):
        data = s.recv(65536)
        assert data, raw
        raw += data
    return raw


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response -> (status, headers in lower case, body with chunked encoding undone)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        out = b""
        while body:
            size, _, rest = body.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, body = out + rest[:n], rest[n + 2:]
        body = out
    return status, headers, body


def error_of(raw: bytes, status: int, code: str | None = None) -> dict:
    got, headers, body = parse(raw)
    assert got == status, raw[:500]
    err = json.loads(body)["error"]
    assert code is None or err["code"] == code, err
    assert "\n" not in err["message"] and err["message"], err
    return err


def guard(server: Server, name: str) -> int:
    return server.health()["guards"].get(name, 0)


def wait_guard(server: Server, name: str, above: int) -> int:
    for _ in range(600):
        if (n := guard(server, name)) > above:
            return n
        time.sleep(0.05)
    pytest.fail(f"guard {name} never fired: {server.health()['guards']}")


def post_head(path: str, length: int | None = None, ctype: str = "application/json", extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n{size}{extra}\r\n").encode()


BODY = json.dumps({"model": "higgs-tts-3", "input": TEXT, "response_format": "pcm", **QUICK}).encode()


# -- headers -----------------------------------------------------------------------------------------------------
def test_headers_that_never_end_get_408(edge):
    before = guard(edge, "header_timeout")
    with connect(edge) as s:
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and nothing more
        err = error_of(read_until_closed(s), 408, "header_timeout")
    assert "1.5 s" in err["message"]
    with connect(edge) as s:  # a trickle: one byte at a time, each well inside the timeout, never a whole request
        for c in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200:
            try:
                s.sendall(bytes([c]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.1)
        error_of(read_until_closed(s), 408, "header_timeout")
    assert guard(edge, "header_timeout") == before + 2


def test_silent_and_idle_connections_are_closed(edge):
    before = guard(edge, "header_timeout")
    with connect(edge) as s:  # connects, sends nothing: closed without an answer
        assert read_until_closed(s) == b""
    assert guard(edge, "header_timeout") == before + 1
    with connect(edge) as s:  # a kept-alive connection: closed once idle (--keep-alive-timeout 1)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, headers, body = parse(read_until_closed(s))
        assert status == 200 and json.loads(body)["status"] == "ok"
    for pipelined in (False, True):  # slow headers of a second request on a kept-alive connection: 408 too
        with connect(edge) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            if not pipelined:
                first = read_response(s)
            s.sendall(b"GET /health HTTP/1.1\r\n")
            raw = read_until_closed(s)
            if pipelined:
                first, _, raw = raw.partition(b"HTTP/1.1 408")
                raw = b"HTTP/1.1 408" + raw
            assert parse(first)[0] == 200, first[:300]
            error_of(raw, 408, "header_timeout")


def test_oversized_headers_are_refused(edge):
    big = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1024)
    with connect(edge) as s:  # arriving in one piece: 431
        s.sendall(big + b"\r\n\r\n")
        error_of(read_until_closed(s), 431, "headers_too_large")
    with connect(edge) as s:  # still incomplete past the limit: uvicorn's 400 (h11 stops buffering)
        s.sendall(big)
        assert parse(read_until_closed(s))[0] == 400
    with connect(edge) as s:  # big but within the limit: fine
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Big: " +
                  b"a" * (MAX_HEADER_BYTES - 1024) + b"\r\n\r\n")
        assert parse(read_until_closed(s))[0] == 200


def test_head_health(edge):
    with connect(edge) as s:
        s.sendall(b"HEAD /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        raw = read_until_closed(s)
    status, headers, body = parse(raw)
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0, raw


# -- bodies ------------------------------------------------------------------------------------------------------
def test_body_shorter_than_its_content_length_gets_408(edge):
    before = guard(edge, "body_timeout")
    with connect(edge) as s:
        s.sendall(post_head("/v1/audio/speech", len(BODY) + 100) + BODY)  # 100 bytes never come
        raw = read_until_closed(s)
    err = error_of(raw, 408, "body_timeout")
    assert parse(raw)[1]["connection"] == "close" and "1.5 s" in err["message"]
    with connect(edge) as s:  # the same on the upload route
        s.sendall(post_head("/v1/voices", 5000, "multipart/form-data; boundary=xyz") + b"--xyz\r\n")
        error_of(read_until_closed(s), 408, "body_timeout")
    assert guard(edge, "body_timeout") == before + 2
    assert edge.settle()["in_flight"] == 0


def test_a_trickled_body_meets_the_whole_body_deadline(edge):
    """Each piece within the idle timeout, but the whole body past --body-timeout 4: 408 naming the 4 s."""
    with connect(edge) as s:
        s.sendall(post_head("/v1/audio/speech", 1000))
        raw = b""
        for _ in range(200):  # 0.5 s apart: far more than 4 s in all
            try:
                s.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                break
            s.settimeout(0.5)
            try:
                raw = s.recv(65536)
            except TimeoutError:
                continue
            break
        s.settimeout(BOUND)
        raw += read_until_closed(s)
    err = error_of(raw, 408, "body_timeout")
    assert "within 4 s" in err["message"], err


def test_absurd_chunks(edge):
    chunked = "Transfer-Encoding: chunked\r\n"
    with connect(edge) as s:  # a chunk of 2**64 - 1 bytes announced, 8 sent: 408, no hang
        s.sendall(post_head("/v1/audio/speech", extra=chunked) + b"FFFFFFFFFFFFFFFF\r\n{\"model\"")
        error_of(read_until_closed(s), 408, "body_timeout")
    malformed = guard(edge, "malformed")
    with connect(edge) as s:  # a chunk size longer than h11 parses: uvicorn's 400 (the app is told why it ends)
        s.sendall(post_head("/v1/audio/speech", extra=chunked) + b"F" * 40 + b"\r\nabc")
        assert parse(read_until_closed(s))[0] == 400
    wait_guard(edge, "malformed", malformed)
    with connect(edge) as s:  # one huge chunk that keeps coming: cut at the 1 MB JSON limit
        s.sendall(post_head("/v1/audio/speech", extra=chunked) + b"FFFFFFFFFF\r\n" + b" " * (1 << 20) + b"  ")
        error_of(read_until_closed(s), 413, "too_large")


def test_declared_sizes(edge):
    before = guard(edge, "too_large")
    with connect(edge) as s:  # a Content-Length no route takes: 413 before a byte of the body is read
        s.sendall(post_head("/v1/audio/speech", 10 ** 12) + b"{")
        raw = read_until_closed(s)
    err = error_of(raw, 413, "too_large")
    assert "1000000000000 bytes" in err["message"] and parse(raw)[1]["connection"] == "close"
    with connect(edge) as s:  # a garbage Content-Length: uvicorn's 400
        s.sendall(post_head("/v1/audio/speech", extra="Content-Length: lots\r\n") + b"{}")
        assert parse(read_until_closed(s))[0] == 400
    assert guard(edge, "too_large") == before + 1


def test_client_leaving_mid_body_logs_one_line(edge):
    before = guard(edge, "client_gone")
    with connect(edge) as s:
        s.sendall(post_head("/v1/audio/speech", len(BODY) + 1000) + BODY)
    ref = (DATA / "ref_en_24k.wav").read_bytes()
    with connect(edge) as s:  # mid-upload
        s.sendall(post_head("/v1/voices", 400_000, "multipart/form-data; boundary=xyz") +
                  b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n' + ref[:100_000])
    wait_guard(edge, "client_gone", before + 1)
    log = edge.log.read_text()
    lines = [x for x in log.splitlines() if "left before the end of its request body" in x]
    assert len(lines) == 2 and "/v1/audio/speech" in lines[0] and "/v1/voices" in lines[1], log[-2000:]
    assert "Traceback" not in log
    assert edge.settle()["in_flight"] == 0
    assert [v["id"] for v in edge.http.get("/v1/voices").json()["data"]] == ["default"]


def test_connection_limit_gets_503(edge):
    """--max-connections 8: with 8 connections open, the next request gets 503; once they close, 200 again."""
    edge.http.close()  # the fixture's own pooled connection would count
    edge.http = httpx.Client(base_url=edge.url, timeout=120)
    idle = [connect(edge) for _ in range(8)]
    try:
        with connect(edge) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            status, _, body = parse(read_until_closed(s))
        assert status == 503, body
    finally:
        for s in idle:
            s.close()
    for _ in range(200):  # the server sees the closes a moment later
        with connect(edge) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            if parse(read_until_closed(s))[0] == 200:
                break
        time.sleep(0.05)
    else:
        pytest.fail("still 503 after the connections closed")


def test_an_integer_beyond_pythons_digit_limit_is_a_400(edge):
    body = b'{"model": "tts-1", "input": "Hi there.", "seed": ' + b"9" * 5000 + b"}"
    r = edge.http.post("/v1/audio/speech", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")


def test_still_serving_after_the_edges(edge):
    r = edge.http.post("/v1/audio/speech", content=BODY, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.content
    assert_error(edge.http.post("/v1/audio/speech", content=BODY, headers={"content-type": "text/plain"}), 415)


# -- a client that stops reading its response ---------------------------------------------------------------------
def test_a_response_nobody_reads_is_cut():
    """The guarded protocol in a real uvicorn (in this process, small socket buffers): an app streams megabytes to a
    client that never reads; once the send buffer has stayed full for --send-timeout, the connection is aborted and
    the app sees the disconnect (the speech server then cancels the job)."""
    import uvicorn

    from higgs_onnx.serve.limits import COUNTERS

    seen: dict[str, object] = {}
    done = threading.Event()

    async def app(scope, receive, send):
        await receive()  # the request (no body)
        gone = asyncio.Event()

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"audio/pcm")]})
        sent = 0
        while not gone.is_set() and sent < 256 << 20:
            await send({"type": "http.response.body", "body": b"\0" * 65536, "more_body": True})
            sent += 65536
            await asyncio.sleep(0)
        seen.update(sent=sent, gone=gone.is_set())
        watcher.cancel()
        done.set()

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # inherited by the accepted socket
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    config = uvicorn.Config(app, http=guarded_protocol(Timeouts(send_s=0.5)), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    before = COUNTERS["send_timeout"]
    try:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.settimeout(BOUND)
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.05)
        client.connect(listener.getsockname())
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert done.wait(BOUND), "the stalled response was never cut"
        assert COUNTERS["send_timeout"] == before + 1
        assert seen["gone"] and seen["sent"] < 256 << 20, seen
        client.close()
    finally:
        done.set()
        server.should_exit = True
        thread.join(10)
