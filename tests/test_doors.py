"""Every field of the speech job at every front door, generated from the options' own table (`job.options.OPTIONS`):
a value out of its bound gets the table's own sentence at every door that honours the field, and a field a door
cannot honour is refused by name there, never accepted and ignored. Then what the doors share: the same greedy audio
through HTTP, the WebSocket and Wyoming; fields the WebSocket now honours (a reference, speed); the hostile clients
of every streaming door (a client that stops reading, one that sends text far faster than speech, a Wyoming event
without text) and SIGTERM with work in flight at every door at once.

One real server (`python -m higgs_onnx.serve --wyoming ...` on the tiny fp32 export) answers HTTP, the WebSocket and
Wyoming; the command line runs in process (its checks come before the model loads), corpus rows through the corpus'
own reader, the Python API on a loaded `HiggsTTS`."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from servers import served
from ws_clients import ws_frame, ws_handshake, ws_url
from wyoming.audio import AudioChunk, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.tts import Synthesize

import inference
from higgs_onnx.corpus import read_rows
from higgs_onnx.job.options import (
    DOORS,
    OPTIONS,
    RULES,
    OptionError,
    Shape,
    SpeechOptions,
    door_table,
    refuse,
    rules_table,
)
from higgs_onnx.job.run import best_of

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TEXT = "Hello there from every door."
ODD = "zyxwv"  # a word the server's lexicon respells "hello"
# a value past each bounded field's bound, and a value that asks for something (for the doors that refuse it)
BAD = {"temperature": -1.0, "top_k": -1, "top_p": 0.0, "seed": -1, "max_rows": 0, "speed": 9.0, "takes": 17,
       "retries": 11, "loudness": 5.0, "blend_mode": "zz", "normalize": "fr", "emoji": "smile",
       "stage_directions": "shout", "caption_level": "line", "caption_language": "english!"}
REF = {"data": base64.b64encode((DATA / "ref_en_24k.wav").read_bytes()).decode(), "text": "A reference."}
ASKS = {"speed": 1.5, "takes": 2, "retries": 1, "loudness": -16.0, "deterministic": True, "blend_mode": "product",
        "instructions": "speak calmly", "references": [REF], "dry_run": True, "normalize": True, "markdown": True,
        "ssml": True, "emoji": "name", "stage_directions": "tags", "lexicon": {"Ann": "Anne"}, "caption_level": "word",
        "caption_language": "de"}


@pytest.fixture(scope="module")
def server(builds, tmp_path_factory):
    folder = tmp_path_factory.mktemp("doors")
    (folder / "lexicon.tsv").write_text(f"{ODD}\thello\n", encoding="utf-8")  # the server's own: every door's
    with served(builds["fp32"], folder, "--lexicon", str(folder / "lexicon.tsv"), "--send-timeout", "2",
                "--ws-idle-timeout", "5", "--log-level", "INFO", wyoming=True) as s:
        yield s


# -- each door, asked for one field: None (accepted) or (message, code) ------------------------------------------
def at_http(server, name, value):
    r = server.http.post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT, "max_rows": 40,
                                                   "response_format": "pcm", name: value})
    if r.status_code == 200:
        return None
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    return err["message"], err["code"]


async def ws_config(server, config: dict) -> dict:
    import websockets

    url = ws_url(server)
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.config", **config}))
        return json.loads(await asyncio.wait_for(ws.recv(), 60))


def at_websocket(server, name, value):
    got = asyncio.run(ws_config(server, {"response_format": "pcm", name: value}))
    return None if got["type"] == "session.configured" else (got["message"], got["code"])


def at_cli(builds, tmp, capsys, name, value):
    opt = OPTIONS[name]
    flag = opt.flag or f"--{name.replace('_', '-')}"
    argv = ["--model-path", str(builds["fp32"]), "--text", "Hi.", "--out", str(tmp / "x.wav"), flag, str(value)]
    if name == "takes" and value == 2:
        argv += ["--retries", "0"]
    try:
        code = inference.main(argv)
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp / "x.wav").exists(), err
    return err.strip().removeprefix("error: "), None


def at_corpus(tmp, name, value):
    path = tmp / "rows.jsonl"
    path.write_text(json.dumps({"id": "a", "text": "Hi.", name: value}) + "\n")
    row = read_rows(path)[0]
    return None if row.error is None else (row.error, None)


def at_python(tts, name, value):
    try:
        if name == "takes":
            best_of(tts, "Hi.", value)
        elif name in ("references", "voice"):
            raise AssertionError("not a bound")
        else:
            tts.generate("Hi.", **{"max_rows": 30, name: value})
    except (ValueError, TypeError) as e:
        return str(e), None
    return None


# the agent doors' fields that carry our value as it is (a JSON number, a query number); the others are mapped from
# the protocol's own values (add_timestamps, apply_text_normalization) and tested in test_agents.py
AGENT_ASKS = {("cartesia", "speed"), ("elevenlabs", "speed"), ("elevenlabs", "seed"), ("cartesia_bytes", "speed"),
              ("cartesia_bytes", "caption_language")}


def at_agent(server, door, name, value):
    import websockets
    from websockets.sync.client import connect

    if door == "cartesia_bytes":  # a JSON body: the field where its Cartesia name puts it (generation_config.speed)
        body = {"transcript": "Hi."}
        *path, leaf = OPTIONS[name].label(door).split(".")
        at = body
        for key in path:
            at = at.setdefault(key, {})
        at[leaf] = value
        r = server.http.post("/tts/bytes", json=body)
        return None if r.status_code == 200 else (r.json()["error"]["message"], r.json()["error"]["code"])
    base = server.url.replace("http://", "ws://")
    if door == "cartesia":
        with connect(base + "/tts/websocket") as ws:
            ws.send(json.dumps({"context_id": "a", "transcript": "Hi.", "generation_config": {name: value}}))
            got = json.loads(ws.recv(timeout=60))
            return None if got["type"] != "error" else (got["error"], got["code"])
    query, settings = (f"?{name}={value}", None) if name == "seed" else ("", {name: value})
    with connect(base + f"/v1/text-to-speech/default/multi-stream-input{query}") as ws:
        try:  # a bad query is answered, and the socket closed, before any message
            ws.send(json.dumps({"text": "Hi. ", "context_id": "a", "voice_settings": settings, "flush": True}))
        except websockets.exceptions.ConnectionClosed:
            pass
        got = json.loads(ws.recv(timeout=60))
        return None if "error" not in got else (got["message"], got["error"])


def ask(door, name, value, server, builds, tts, tmp, capsys):
    if door in ("cartesia", "cartesia_bytes", "elevenlabs"):
        return at_agent(server, door, name, value)
    if door == "http":
        return at_http(server, name, value)
    if door == "websocket":
        return at_websocket(server, name, value)
    if door == "cli":
        return at_cli(builds, tmp, capsys, name, value)
    if door == "corpus":
        return at_corpus(tmp, name, value)
    if door == "python":
        return at_python(tts, name, value)
    raise AssertionError(door)


def cases(kind: str) -> list:
    """(door, field) pairs from the table: `bound` where the door honours a bounded field, `refused` where it
    refuses one (Wyoming has no such fields at all: `absent`, asserted below)."""
    out = []
    for name, opt in OPTIONS.items():
        for door in DOORS:
            state = opt.at(door)
            if door in ("cartesia", "cartesia_bytes", "elevenlabs") and (door, name) not in AGENT_ASKS:
                continue
            if kind == "bound" and state == "honoured" and name in BAD and door != "wyoming":
                if not (door == "python" and name == "blend_mode"):  # a Blend's mode: test_blend_modes_refused
                    out.append(pytest.param(door, name, id=f"{name}@{door}"))
            if kind == "refused" and state == "refused":
                out.append(pytest.param(door, name, id=f"{name}@{door}"))
    return out


def test_the_table_covers_every_field_and_door():
    """Every field has a state at every door; Wyoming carries text and a voice name only; the docs hold the
    table as the code makes it."""
    assert set(DOORS) == {"cli", "http", "websocket", "wyoming", "corpus", "python", "cartesia", "cartesia_bytes",
                          "elevenlabs"}
    for name, opt in OPTIONS.items():
        assert {opt.at(d) for d in DOORS} <= {"honoured", "always", "refused", "absent"}
        assert (opt.at("wyoming") == "honoured") == (name == "voice"), name
    for page in ("server.md", "integrations.md"):
        assert door_table() in (ROOT / "docs" / page).read_text(), f"docs/{page}: the fields x doors table is stale"
    assert len(cases("bound")) == 61 and len(cases("refused")) == 29


@pytest.mark.parametrize("door, name", cases("bound"))
def test_a_value_past_its_bound_gets_the_same_sentence_at_every_door(door, name, server, builds, tts, tmp_path,
                                                                      capsys):
    with pytest.raises(OptionError) as e:
        SpeechOptions.build({name: BAD[name]}, door)
    got = ask(door, name, BAD[name], server, builds, tts, tmp_path, capsys)
    assert got is not None, f"{door} took {name}={BAD[name]!r}"
    assert got[0] == e.value.message, (door, got)
    if got[1] is not None:
        assert got[1] == "invalid_value"


@pytest.mark.parametrize("door, name", cases("refused"))
def test_a_field_a_door_cannot_honour_is_refused_by_name(door, name, server, builds, tts, tmp_path, capsys):
    got = ask(door, name, ASKS[name], server, builds, tts, tmp_path, capsys)
    assert got is not None, f"{door} accepted {name}={ASKS[name]!r}: accepted and ignored"
    if door == "python" or (door == "cli" and OPTIONS[name].flag is None):  # Python's / argparse's own refusal
        assert name in got[0], got
        return
    with pytest.raises(OptionError) as e:
        refuse(name, door)
    assert got[0] == e.value.message and e.value.code == "unsupported_parameter", got
    if got[1] is not None:
        assert got[1] == "unsupported_parameter"


WRONG = {"a whole number": 1.5, "a finite number": "fast", "true or false": "yes", "a string": 7}


def kind_cases() -> list:
    from higgs_onnx.job.options import KINDS

    return [pytest.param(door, name, id=f"{name}@{door}") for name, kind in KINDS.items() for door in DOORS
            if OPTIONS[name].at(door) == "honoured" and door not in ("cli", "wyoming")
            and (door not in ("cartesia", "elevenlabs") or (door, name) == (door, "speed"))
            and (door, name) != ("python", "blend_mode")]  # a Blend's mode: test_blend_modes_refused


@pytest.mark.parametrize("door, name", kind_cases())
def test_a_wrong_type_gets_the_same_sentence_at_every_door(door, name, server, builds, tts, tmp_path, capsys):
    """`seed: 1.5`, `speed: "fast"`, `markdown: "yes"`, `emoji: 7`: the table's one sentence (`job.options.KINDS`)
    at HTTP, the WebSocket, a corpus row and the Python API (pydantic's own sentence at HTTP, another in corpus rows
    before). The command line's flags are typed by argparse, which names the flag."""
    from higgs_onnx.job.options import KINDS

    value = WRONG[KINDS[name]]
    with pytest.raises(OptionError) as e:
        SpeechOptions.build({name: value}, door)
    label = OPTIONS[name].label(door)  # the agent doors name their protocol's field (generation_config.speed)
    assert e.value.message == f"{label} must be {KINDS[name]}, got {value!r}" and e.value.param == name
    got = ask(door, name, value, server, builds, tts, tmp_path, capsys)
    assert got is not None and got[0] == e.value.message, (door, got)


# -- the rules between fields (job.options.RULES): each broken at every door its row lists ------------------------
BLEND = "default:0.5,alloy:0.5"  # two zero-shot voices (a stock name is the default voice): nothing to encode
LONG = " ".join(["A long input sentence that goes on."] * 150)  # over one request: read in pieces
# (rule, door) -> (the job's values as the door takes them, the shape the door sees, how to ask)
RULE_CASES = {
    ("takes or retries", "cli"): ({"takes": 2, "retries": 1}, Shape(), ["--takes", "2", "--retries", "1"]),
    ("takes or retries", "http"): ({"takes": 2, "retries": 1}, Shape(), {"takes": 2, "retries": 1}),
    ("takes need sampling", "cli"): ({"takes": 2, "temperature": 0.0}, Shape(),
                                     ["--takes", "2", "--retries", "0", "--temperature", "0"]),
    ("takes need sampling", "http"): ({"takes": 2, "temperature": 0.0}, Shape(), {"takes": 2, "temperature": 0}),
    ("takes need sampling", "python"): ({"takes": 2, "temperature": 0.0}, Shape(), {"temperature": 0.0}),
    ("one pace", "cli"): ({"speed": 1.5, "instructions": "slowly"}, Shape(),
                          ["--speed", "1.5", "--instructions", "slowly"]),
    ("one pace", "http"): ({"speed": 1.5, "instructions": "slowly"}, Shape(), {"speed": 1.5, "instructions": "slowly"}),
    ("one pace", "websocket"): ({"speed": 1.5, "instructions": "slowly"}, Shape(),
                                {"speed": 1.5, "instructions": "slowly"}),
    ("takes of a blend", "cli"): ({"takes": 2, "retries": 0}, Shape(voices=2), ["--takes", "2", "--retries", "0"]),
    ("takes of a blend", "http"): ({"takes": 2}, Shape(voices=2), {"takes": 2, "voice": BLEND}),
    ("takes of a blend", "python"): ({"takes": 2}, Shape(voices=2), {"voice": "blend"}),
    ("a whole take, live", "cli"): ({"loudness": -20.0}, Shape(live=True), ["--stream", "--loudness", "-20"]),
    ("takes of pieces", "http"): ({"takes": 2}, Shape(pieces=2), {"takes": 2, "input": LONG, "max_rows": None}),
    ("a lone run of pieces", "http"): ({"deterministic": True}, Shape(pieces=2),
                                       {"deterministic": True, "input": LONG, "max_rows": None}),
    ("a blend of pieces", "http"): ({}, Shape(pieces=2, voices=2), {"voice": BLEND, "input": LONG, "max_rows": None}),
    ("a blend of pieces", "websocket"): ({}, Shape(voices=2, continues=True), {"voice": BLEND}),
    ("words need a place", "cli"): ({"caption_level": "word"}, Shape(words=False), "words"),
    ("words need a place", "http"): ({"caption_level": "word"}, Shape(words=False), {"caption_level": "word"}),
}


def rule_cases() -> list:
    return [pytest.param(r.name, door, id=f"{r.name}@{door}") for r in RULES for door in r.doors]


def test_every_rule_has_a_case_at_every_door_it_lists_and_the_docs_hold_the_table():
    assert {(n, d) for n, d in (p.values for p in rule_cases())} == set(RULE_CASES)
    assert rules_table() in (ROOT / "docs" / "server.md").read_text(), "docs/server.md: the rules table is stale"


def pieces_free(message: str) -> str:
    import re

    return re.sub(r"read in \d+ pieces", "read in N pieces", message)


@pytest.mark.parametrize("rule, door", rule_cases())
def test_a_broken_rule_gets_the_same_sentence_at_every_door(rule, door, server, builds, tts, tmp_path, capsys):
    values, shape, asked = RULE_CASES[(rule, door)]
    row = next(r for r in RULES if r.name == rule)
    with pytest.raises(OptionError) as e:
        SpeechOptions.build(values, door).check_rules(door, shape)
    assert e.value.code == ("unsupported_parameter" if row.shaped else "invalid_value")
    want = e.value.message
    if door == "http":
        r = server.http.post("/v1/audio/speech", json={k: v for k, v in {
            "model": "higgs-tts-3", "input": TEXT, "max_rows": 40, "response_format": "pcm", **asked}.items()
            if v is not None}, timeout=300)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        got = err["message"]
        assert err["param"] == e.value.param and err["code"] == e.value.code, err
    elif door == "websocket":
        answer = asyncio.run(ws_config(server, {"response_format": "pcm", **asked}))
        assert answer["type"] == "error", answer
        got = answer["message"]
        assert answer["param"] == e.value.param and answer["code"] == e.value.code, answer
    elif door == "python":
        from higgs_onnx.generation.blend import Blend

        kw = {"voice": Blend.make([None, None], [0.5, 0.5], "mixture", ["a", "b"])} if "voice" in asked else asked
        with pytest.raises(OptionError) as raised:
            best_of(tts, "Hi.", 2, **kw)
        got = raised.value.message
    else:
        got = cli_error(builds, tmp_path, capsys, asked)
    assert pieces_free(got) == pieces_free(want), (door, got, want)


def cli_error(builds, tmp, capsys, asked) -> str:
    """The command line's one error line for `asked` (extra flags after --text, or "words": a long text with
    --captions streamed to stdout, where no file can be timed)."""
    if asked == "words":
        (tmp / "t.txt").write_text("One line. Another line.\n")
        argv = ["--text-file", str(tmp / "t.txt"), "--out", "-", "--captions", str(tmp / "c.srt"),
                "--caption-level", "word"]
    else:
        argv = ["--text", "Hi.", "--out", str(tmp / "x.wav"), *asked]
        if "--takes" in asked and "--retries" in asked and asked[asked.index("--retries") + 1] == "0" \
                and "--temperature" not in asked:  # a blend of two voice files (never read: refused first)
            for name in ("a.npz", "b.npz"):
                (tmp / name).write_bytes(b"x")
            argv += ["--voice", f"{tmp / 'a.npz'}:0.5,{tmp / 'b.npz'}:0.5"]
    code = inference.main(["--model-path", str(builds["fp32"]), *argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not (tmp / "x.wav").exists(), err
    return err.strip().removeprefix("error: ")


def test_blend_modes_refused(tts):
    from higgs_onnx.generation.blend import Blend

    with pytest.raises(ValueError, match="mixture, product"):
        Blend.make([None, None], None, "zz")


# -- the same audio through every streaming door ---------------------------------------------------------------------
async def ws_speak(server, config: dict, text: str) -> tuple[bytes, list]:
    import websockets

    url = ws_url(server)
    audio, got = b"", []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", **config}))
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        try:
            while True:
                m = await asyncio.wait_for(ws.recv(), 120)
                if isinstance(m, bytes):
                    audio += m
                    continue
                got.append(json.loads(m))
                if got[-1]["type"] == "session.done":
                    break
        except websockets.ConnectionClosed:  # a session that cannot start: its error, then the close
            pass
    return audio, got


async def wyoming_speak(port: int, text: str) -> bytes:
    async with AsyncTcpClient("127.0.0.1", port) as c:
        await c.write_event(Synthesize(text=text).event())
        audio = b""
        while True:
            e = await asyncio.wait_for(c.read_event(), 120)
            assert e is not None and not Error.is_type(e.type), e
            if AudioChunk.is_type(e.type):
                audio += e.payload
            if AudioStop.is_type(e.type):
                return audio


def test_one_text_gives_the_same_audio_at_every_streaming_door(server):
    """The default sampling and seed (Wyoming has no fields), the row budget a segment gets, a lone run: HTTP,
    the WebSocket and Wyoming give the same bytes."""
    from higgs_onnx.longform.render import piece_rows
    from higgs_onnx.serve.textstream import ROWS_PER_CHAR

    rows = piece_rows(TEXT, None, ROWS_PER_CHAR)
    http = server.http.post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT, "response_format": "pcm",
                                                      "max_rows": rows, "deterministic": True})
    assert http.status_code == 200 and len(http.content) > 0
    ws, _ = asyncio.run(ws_speak(server, {}, TEXT))
    wy = asyncio.run(wyoming_speak(server.wyoming_port, TEXT))
    assert ws == http.content and wy == http.content, (len(http.content), len(ws), len(wy))


SERVER_DEFAULTS = [("--instructions", "cheerful", "instructions", ""), ("--markdown", None, "markdown", False)]


@pytest.mark.parametrize("flag, value, field, off", SERVER_DEFAULTS, ids=[d[0] for d in SERVER_DEFAULTS])
def test_a_server_default_reaches_every_door(flag, value, field, off, builds, tmp_path):
    """The server default x door axis: a job default set on the server's command line (`--instructions`, a text
    step) is what HTTP, the WebSocket and Wyoming all read, so the three give the same bytes, and a request that
    turns it off gets other audio (Wyoming used to drop the server's instructions: its text had no lead)."""
    from higgs_onnx.longform.render import piece_rows
    from higgs_onnx.serve.textstream import ROWS_PER_CHAR

    text = "**Hello** there from every door." if field == "markdown" else TEXT
    with served(builds["fp32"], tmp_path, flag, *([value] if value else []), wyoming=True) as s:
        port = s.wyoming_port
        body = {"model": "higgs-tts-3", "input": text, "response_format": "pcm", "deterministic": True}
        dry = s.http.post("/v1/audio/speech", json={**body, "dry_run": True}).json()
        if field == "instructions":
            assert dry["lead"] and dry["lead"].startswith("<|emotion:"), dry
        else:
            assert dry["steps"] and "**" not in dry["read"], dry
        rows = piece_rows(dry["read"].removeprefix(dry["lead"] or ""), None, ROWS_PER_CHAR)
        http = s.http.post("/v1/audio/speech", json={**body, "max_rows": rows})
        off_http = s.http.post("/v1/audio/speech", json={**body, "max_rows": rows, field: off})
        assert http.status_code == off_http.status_code == 200
        ws, _ = asyncio.run(ws_speak(s, {}, text))
        wy = asyncio.run(wyoming_speak(port, text))
        assert ws == http.content and wy == http.content, (len(http.content), len(ws), len(wy))
        assert off_http.content != http.content  # the default did something, and a request may turn it off


def test_the_websocket_honours_references_and_speed(server):
    """Fields it used to accept and ignore: a reference (Boson's and sglang-omni's shapes) and speed change the
    audio; greedy, so any change is the field's."""
    greedy = {"temperature": 0.0, "max_rows": 60}
    plain, _ = asyncio.run(ws_speak(server, greedy, TEXT))
    again, _ = asyncio.run(ws_speak(server, greedy, TEXT))
    assert plain == again and len(plain) > 0
    for extra in ({"references": [REF]}, {"ref_audio": REF["data"], "ref_text": REF["text"]}, {"speed": 0.5}):
        other, got = asyncio.run(ws_speak(server, {**greedy, **extra}, TEXT))
        assert got[0]["type"] == "session.configured", got
        assert len(other) > 0 and other != plain, extra
    _, got = asyncio.run(ws_speak(server, {"references": [REF, REF]}, TEXT))
    assert got[0]["code"] == "unsupported_parameter" and got[0]["param"] == "references"
    _, got = asyncio.run(ws_speak(server, {"references": []}, TEXT))
    assert got[0]["param"] == "references" and "empty" in got[0]["message"]
    _, got = asyncio.run(ws_speak(server, {"colour": "blue"}, TEXT))
    assert got[0]["code"] == "unknown_parameter" and got[0]["param"] == "colour"
    server.released()


# -- hostile clients ---------------------------------------------------------------------------------------------
def test_a_websocket_max_rows_too_small_for_a_frame_is_refused_at_config(server):
    """max_rows 1 passes the field's bound (>= 1) but can never make a frame: refused at session.config, naming
    the field, instead of failing every segment after it was accepted."""
    got = asyncio.run(ws_config(server, {"response_format": "pcm", "max_rows": 1}))
    assert got["type"] == "error" and got["param"] == "max_rows" and "at least" in got["message"], got
    assert at_websocket(server, "max_rows", 40) is None


def test_empty_references_and_overflowing_blend_weights_are_refused(server, builds, tmp_path, capsys):
    r = server.http.post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT, "references": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "references", r.text
    r = server.http.post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT,
                                                   "voice": "default:1e308,default:1e308"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "voice", r.text
    for name in ("a.npz", "b.npz"):
        (tmp_path / name).write_bytes(b"x")  # never read: the weights are refused first
    got, _ = at_cli(builds, tmp_path, capsys, "voice", f"{tmp_path / 'a.npz'}:1e308,{tmp_path / 'b.npz'}:1e308")
    assert "add up past the largest number" in got, got


def test_a_client_that_stops_reading_frees_its_slot_at_every_streaming_door(server):
    """WebSocket and Wyoming: a client that sends a long text and never reads keeps nothing past the send timeout
    (2 s here): its job is cancelled, its slot and kept context freed, one log line; /v1/audio/speech still
    answers."""
    port = int(server.url.rsplit(":", 1)[1])
    long_text = " ".join(["word"] * 400) + "."
    ws = ws_handshake(port)
    ws.sendall(ws_frame({"type": "session.config", "response_format": "pcm"}))
    sentences = " ".join(["Word " + "word " * 40 + "word."] * 12)  # segments of ~200 characters, ~36 s each
    ws.sendall(ws_frame({"type": "input.text", "text": sentences + " And more. "}))
    wy = socket.create_connection(("127.0.0.1", server.wyoming_port))
    wy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({"text": long_text}).encode()
    wy.sendall(json.dumps({"type": "synthesize", "data_length": len(body)}).encode() + b"\n" + body)
    try:
        for _ in range(600):  # both noticed (the tiny model may finish its rows long before the sends stall)
            stalled = sorted(re.findall(r"(\w+)[^:\n]*: the client read nothing for 2 s", server.log.read_text()))
            if len(stalled) >= 2:
                break
            time.sleep(0.05)
        assert stalled == ["websocket", "wyoming"], server.log.read_text()[-2000:]  # one line each
        server.wait(lambda s: s["in_flight"] == 0 and s["kept"] == 0, "the stalled clients' work freed")
        r = server.http.post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": TEXT, "max_rows": 40,
                                                       "response_format": "pcm"})
        assert r.status_code == 200 and r.content
    finally:
        ws.close()
        wy.close()
    server.released()


def test_text_far_faster_than_speech_ends_the_session(server):
    """The documented 100,000-character rule: text received and not yet spoken past it is an error and a close."""
    chunk = "A sentence to speak. " * 3000  # 63,000 characters, under one message's limit
    _, got = asyncio.run(ws_speak_raw(server, [chunk, chunk]))
    errors = [m for m in got if m.get("type") == "error"]
    assert errors and errors[-1]["code"] == "text_too_long" and "100000" in errors[-1]["message"], got[-3:]
    server.released()


async def ws_speak_raw(server, texts: list[str]) -> tuple[bytes, list]:
    import websockets

    url = ws_url(server)
    got = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "max_rows": 40}))
        for t in texts:
            await ws.send(json.dumps({"type": "input.text", "text": t}))
        try:
            while True:
                m = await asyncio.wait_for(ws.recv(), 120)
                if not isinstance(m, bytes):
                    got.append(json.loads(m))
        except websockets.ConnectionClosed:
            pass
    return b"", got


def test_wyoming_text_far_faster_than_speech_is_refused(server):
    """The same rule at Wyoming's streaming door: past 100,000 characters waiting, an error and the end."""
    from wyoming.tts import SynthesizeChunk, SynthesizeStart

    async def run():
        async with AsyncTcpClient("127.0.0.1", server.wyoming_port) as c:
            await c.write_event(SynthesizeStart().event())
            chunk = "A sentence to speak. " * 3000
            for _ in range(2):
                await c.write_event(SynthesizeChunk(text=chunk).event())
            while (e := await asyncio.wait_for(c.read_event(), 60)) is not None:
                if Error.is_type(e.type):
                    return e.data

    err = asyncio.run(run())
    assert err["code"] == "text_too_long" and "100000" in err["text"], err
    server.released()


def test_an_sse_stream_cut_by_the_server_ends_with_an_error_event(tts, tmp_path):
    """Audio went out, then the job failed (the server stopping): the SSE body ends with an error event naming
    `shutting_down`, never a bare cut (the audio formats are cut, so truncated audio never looks whole)."""
    from types import SimpleNamespace

    from higgs_onnx.serve.http import StreamCut
    from higgs_onnx.serve.limits import Timeouts
    from higgs_onnx.serve.scheduler import ShuttingDown
    from higgs_onnx.serve.service import SpeechService

    svc = SpeechService(tts, None, tmp_path / "voices", None, Timeouts(), "default", 30.0)
    chunk = SimpleNamespace(samples=np.zeros(2400, np.float32), is_last=False, stats=None)

    async def failing():
        yield chunk
        raise ShuttingDown("the server is shutting down")

    async def body(sse: bool) -> list[bytes]:
        chunks = failing()
        first = await anext(chunks)
        return [b async for b in svc.stream_body(SimpleNamespace(id=7), first, chunks, "pcm", sse, 5, None)]

    events = [json.loads(b[6:]) for b in asyncio.run(body(True)) if b.startswith(b"data: ")]
    assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "error", events[-1]
    assert events[-1]["error"]["code"] == "shutting_down"
    with pytest.raises(StreamCut):
        asyncio.run(body(False))


def test_wyoming_events_without_text_get_an_error_event(server):
    async def run():
        async with AsyncTcpClient("127.0.0.1", server.wyoming_port) as c:
            out = []
            for event in (Event("synthesize", {}), Event("synthesize", {"text": 5}),
                          Event("synthesize-start", {}), Event("synthesize-chunk", {}),
                          Event("synthesize-chunk", {"text": ["x"]})):
                await c.write_event(event)
                if event.type != "synthesize-start":
                    e = await asyncio.wait_for(c.read_event(), 30)
                    out.append((e.type, e.data.get("code"), e.data.get("text")))
            await c.write_event(Event("synthesize-stop", {}))  # the connection still serves
            while not (e := await asyncio.wait_for(c.read_event(), 60)).type == "synthesize-stopped":
                pass
            return out

    got = asyncio.run(run())
    assert [g[:2] for g in got] == [("error", "bad_text")] * 4, got
    assert "needs a text string, got no text" in got[0][2] and "got int 5" in got[1][2]


def test_a_client_leaving_mid_audio_is_one_log_line(server):
    """A client (a small receive window, so the audio cannot all be sent ahead) reads the first bytes and leaves:
    its job is cancelled, and the log says so in one line, with no traceback."""
    before = server.log.read_text().count("left mid-audio")
    port = int(server.url.rsplit(":", 1)[1])
    body = json.dumps({"model": "higgs-tts-3", "input": " ".join(["word"] * 300) + ".", "response_format": "pcm",
                       "max_rows": 2400}).encode()
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.connect(("127.0.0.1", port))
    c.sendall(f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert c.recv(4096).startswith(b"HTTP/1.1 200")
    c.close()
    server.wait(lambda s: s["in_flight"] == 0, "the left request's job cancelled")
    for _ in range(100):
        log = server.log.read_text()
        if log.count("left mid-audio") > before:
            break
        time.sleep(0.05)
    assert log.count("left mid-audio") == before + 1 and "Traceback" not in log, log[-2000:]


# -- SIGTERM with work in flight at every door ---------------------------------------------------------------------
# one request the tiny model speaks for ~2 s alone on its slot: it reads ~2.7 rows per character and stops at the
# text's end, so the text is long enough to reach HOLD_ROWS (a short text ends in ~80 rows)
HOLD_TEXT = " ".join(["I hold the slot while the others wait"] * 25) + "."
HOLD_ROWS = 2500  # with its ~410 prompt positions, within a slot's 3072


def test_sigterm_answers_every_door_as_documented(builds, tmp_path):
    """One batch slot, held by a long speech request (a WebSocket session's kept context between segments would be
    given back as soon as a job waits: segments.next_segment). Waiting behind it, with no audio yet: a speech request,
    an SSE one, a WebSocket session's segment and a Wyoming synthesis.
    SIGTERM: both HTTP requests get the JSON 503 with Retry-After, the WebSocket an error event and close code 1012,
    Wyoming an error event, the holder's audio stream is cut (no last chunk); no traceback in the log."""
    import threading

    import httpx2 as httpx
    import websockets

    with served(builds["fp32"], tmp_path, "--max-batch", "1", wyoming=True) as s:
        port = s.wyoming_port
        body = {"model": "higgs-tts-3", "input": TEXT, "response_format": "pcm", "max_rows": 40}
        out: dict = {}

        def post(key: str, extra: dict):
            r = httpx.post(f"{s.url}/v1/audio/speech", json={**body, **extra}, timeout=60)
            out[key] = (r.status_code, r.headers.get("retry-after"), r.text)

        def hold():
            with httpx.stream("POST", f"{s.url}/v1/audio/speech", timeout=60,
                              json={**body, "input": HOLD_TEXT, "max_rows": HOLD_ROWS}) as r:
                assert r.status_code == 200, r.read()
                try:
                    for _ in r.iter_bytes():
                        out["holding"] = True  # its first audio: it runs
                    out["holder"] = "whole"
                except httpx.RemoteProtocolError:  # the chunked body ends without its last chunk: visibly incomplete
                    out["holder"] = "cut"

        async def sessions():
            url = ws_url(s)
            async with websockets.connect(url) as waiter, AsyncTcpClient("127.0.0.1", port) as wy:
                await waiter.send(json.dumps({"type": "session.config", "response_format": "pcm", "max_rows": 40}))
                await waiter.recv()
                for _ in range(1200):
                    if out.get("holding"):
                        break
                    await asyncio.sleep(0.01)
                await waiter.send(json.dumps({"type": "input.text", "text": "I wait for it. "}))
                await waiter.send(json.dumps({"type": "input.commit"}))
                await wy.write_event(Synthesize(text="I wait too.").event())
                out["ready"] = True
                got = []
                try:
                    while True:
                        m = await asyncio.wait_for(waiter.recv(), 60)
                        if not isinstance(m, bytes):
                            got.append(json.loads(m))
                except websockets.ConnectionClosed as e:
                    out["ws"] = ([m.get("code") for m in got if m["type"] == "error"], e.rcvd.code if e.rcvd else None)
                e = await asyncio.wait_for(wy.read_event(), 60)
                out["wyoming"] = (e.type, e.data.get("code")) if e is not None else None

        holder = threading.Thread(target=hold)
        side = threading.Thread(target=lambda: asyncio.run(sessions()))
        posts = [threading.Thread(target=post, args=("http", {})),
                 threading.Thread(target=post, args=("sse", {"stream_format": "sse"}))]
        holder.start()
        side.start()
        for _ in range(1200):
            if out.get("ready"):
                break
            time.sleep(0.05)
        for t in posts:
            t.start()
        s.wait(lambda st: st["waiting"] >= 4 and st["active"] == 1, "four jobs waiting behind the held slot")
        s.proc.send_signal(signal.SIGTERM)
        for t in (*posts, side, holder):
            t.join(60)
        assert s.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    assert out["holder"] == "cut", out  # its audio stream, mid-way: never ended as if whole
    for key in ("http", "sse"):
        status, retry, text = out[key]
        assert status == 503 and retry == "1" and json.loads(text)["error"]["code"] == "shutting_down", out[key]
    assert out["ws"] == (["shutting_down"], 1012), out["ws"]
    assert out["wyoming"] == ("error", "shutting_down"), out["wyoming"]


# -- the dry run: what the model would read, checked as for real, nothing generated ------------------------------
def documented_fields(page: str, after: str) -> set[str]:
    """The field names of the first `{"name", ...}` set in docs/PAGE after the text `after` (a value given to a
    name, `"object": "speech.dry_run"`, is not a name)."""
    text = (ROOT / "docs" / page).read_text()
    block = re.search(r"\{(\"[^{}]*)\}", text[text.index(after):]).group(1)
    return set(re.findall(r'"(\w+)"', re.sub(r':\s*"[^"]*"', "", block)))


def text_md_dry_run_example() -> dict:
    """The dry run's line in docs/text.md's example, as JSON."""
    text = (ROOT / "docs" / "text.md").read_text()
    section = text[text.index("## See what the model will read: the dry run"):]
    return json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])


def test_the_cli_dry_run_reads_the_text_as_the_model_would_and_loads_nothing(builds, tmp_path, capsys):
    from higgs_onnx.runtime.model import HiggsTTS

    lines = tmp_path / "lines.txt"
    lines.write_text("One line here.\n\n<|emotion:elation|> Another line.\n")
    argv = ["--model-path", str(builds["fp32"]), "--dry-run"]
    assert inference.main([*argv, "--text", TEXT, "--speed", "0.5", "--max-rows", "50"]) == 0
    out, err = capsys.readouterr()
    [one] = [json.loads(x) for x in out.splitlines()]
    # the fields the docs list are the ones it prints (inference.md's list, text.md's example)
    assert set(one) == documented_fields("inference.md", "`--dry-run` (with") == set(text_md_dry_run_example()), one
    assert one["read"].endswith(TEXT) and one["read"] != TEXT and one["max_rows"] == 50, one  # the speed tag first
    assert "nothing generated; model parts loaded: none" in err, err
    tts = HiggsTTS(builds["fp32"], verify=False)
    made = tts.generate(one["read"], max_rows=50, temperature=0.0)  # the real request: the same prompt
    assert made.stats.prompt_tokens == one["prompt_positions"]
    assert inference.main([*argv, "--text-file", str(lines)]) == 0
    got = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [g["text"] for g in got] == ["One line here.", "<|emotion:elation|> Another line."]
    for bad, words in ((["--text", "Hi.", "--out", str(tmp_path / "x.wav")], "--out is not for --dry-run"),
                       (["--text", "Hi.", "--ref-audio", str(DATA / "ref_en_24k.wav")], "--ref-audio is not for"),
                       (["--text", "Hi <|im_start|>"], "special token"), (["--selftest"], "is for --text or"),
                       (["--text", "Hi.", "--max-rows", "99999"], "max_rows is 99999")):
        assert inference.main([*argv, *bad]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, (bad, err)
    assert not (tmp_path / "x.wav").exists()


def test_the_server_dry_run_answers_json_and_generates_nothing(server):
    before = server.stats()["submitted"]
    body = {"model": "higgs-tts-3", "input": TEXT, "speed": 1.5, "dry_run": True}
    r = server.http.post("/v1/audio/speech", json=body)
    got = r.json()
    assert r.status_code == 200 and got["object"] == "speech.dry_run" and got["pieces"] is None, got
    assert set(got) == documented_fields("server.md", "| `dry_run` | extra |"), got  # the fields server.md lists
    assert got["read"].endswith(TEXT) and got["lead"] and got["read"].startswith(got["lead"])
    sse = server.http.post("/v1/audio/speech", json={**body, "dry_run": False, "stream_format": "sse",
                                                      "max_rows": 40})
    done = json.loads([x for x in sse.text.split("\n\n") if x.startswith("data: ")][-1][6:])
    assert done["usage"]["input_tokens"] == got["prompt_positions"]  # the real request had that prompt
    long = " ".join(["A sentence in a long input."] * 200)
    got = server.http.post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": long, "dry_run": True}).json()
    assert len(got["pieces"]) >= 2 and " ".join(p["text"] for p in got["pieces"]).split() == long.split()
    assert server.stats()["submitted"] == before + 1  # only the SSE request ran
    r = server.http.post("/v1/audio/speech", json={**body, "input": "Bad <|im_start|> token."})
    assert r.status_code == 400 and r.json()["error"]["code"] == "special_token", r.text


def test_the_text_steps_are_honoured_at_every_door(server, builds, tts, tmp_path, capsys):
    """Greedy speech of a text through a step equals the speech of what the step makes of it: the server's lexicon
    at HTTP, the WebSocket and Wyoming; a request's `normalize` at HTTP and the WebSocket; the CLI's and a corpus
    row's read the same; the dry runs show each step."""
    from types import SimpleNamespace

    from higgs_onnx.corpus import Worker
    from higgs_onnx.longform.render import piece_rows
    from higgs_onnx.serve.textstream import ROWS_PER_CHAR

    rows = piece_rows(TEXT, None, ROWS_PER_CHAR)

    def http(text, **fields):
        r = server.http.post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": text, "response_format": "pcm",
                                                       "max_rows": rows, "deterministic": True, **fields})
        assert r.status_code == 200 and r.content, r.text
        return r.content

    odd = TEXT.replace("Hello", ODD.title())
    plain = http(TEXT)
    assert http(odd) == plain  # the server's lexicon (serve --lexicon), with the capital kept
    assert asyncio.run(ws_speak(server, {}, odd))[0] == plain
    assert asyncio.run(wyoming_speak(server.wyoming_port, odd)) == plain
    assert http(odd, lexicon={ODD: "goodbye"}) != plain  # a request's entry over the server's
    said = "I have three cats and two dogs."
    rows = piece_rows(said, None, ROWS_PER_CHAR)
    assert http("I have 3 cats and 2 dogs.", normalize=True) == http(said)
    ws = asyncio.run(ws_speak(server, {"normalize": "en"}, "I have 3 cats and 2 dogs."))[0]
    assert ws == asyncio.run(ws_speak(server, {}, said))[0]
    got = server.http.post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": "[laughs] I have 3 cats.",
                                                     "normalize": "en", "stage_directions": "tags",
                                                     "instructions": "sadly", "dry_run": True}).json()
    assert got["read"] == "<|emotion:sadness|><|sfx:laughter|>I have three cats.", got
    assert [s["step"] for s in got["steps"]] == ["stage_directions=tags", "lexicon", "normalize=en"], got
    argv = ["--model-path", str(builds["fp32"]), "--dry-run", "--text", "[laughs] I have 3 cats."]
    assert inference.main([*argv, "--normalize", "--stage-directions", "tags", "--instructions", "sadly"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["read"] == got["read"] and [s["step"] for s in one["steps"]] == ["stage_directions=tags",
                                                                                "normalize=auto"]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"id": "a", "text": "[laughs] I have 3 cats.", "normalize": "en",
                                "stage_directions": "tags", "instructions": "sadly"}) + "\n")
    [row] = read_rows(path)
    assert row.error is None
    assert Worker.said(SimpleNamespace(tts=tts), {"text": row.text, "text_options": row.text_options}) == got["read"]
