"""The Wyoming server (Home Assistant's voice protocol), driven by the `wyoming` package's own client over a real
TCP socket on loopback: describe / info with the saved voices, synthesize, the streaming events Home Assistant sends
for an LLM's answer (the stream engine, serve/streams/wyoming.py: a block per sentence), bad requests and job fields
Wyoming has no place for answered with an error event (the connection stays), malformed or oversized frames closing
the connection, a client that vanishes mid-audio, and `serve --wyoming` (servers.served) sharing the HTTP server's
scheduler."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from servers import served
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
TEXT = "Hello there, from the Wyoming server. A second sentence follows."
MDNS_NAME = f"higgs-test-{os.getpid()}"


def discover(name: str, timeout: float = 10.0):
    """The announced service as Home Assistant finds it: browsing `_wyoming._tcp.local.` over mDNS
    (python-zeroconf) on loopback, then its records (from the browse's answers). A direct QU query for the name is
    not used: on one host several mDNS sockets share port 5353, and a unicast answer may reach another of them."""
    import threading

    from zeroconf import IPVersion, ServiceBrowser, Zeroconf

    full, seen = f"{name}._wyoming._tcp.local.", threading.Event()

    class Listener:
        def add_service(self, zc, kind, found):
            if found == full:
                seen.set()

        update_service = add_service

        def remove_service(self, zc, kind, found):
            pass

    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        ServiceBrowser(zc, "_wyoming._tcp.local.", Listener())
        if not seen.wait(timeout):
            return None
        return zc.get_service_info("_wyoming._tcp.local.", full, timeout=3000)
    finally:
        zc.close()


@pytest.fixture(scope="module")
def wyoming(builds, tmp_path_factory):
    from higgs_onnx.runtime.model import HiggsTTS

    voices = tmp_path_factory.mktemp("wyoming") / "voices"
    voices.mkdir()
    tts = HiggsTTS(builds["fp32"], verify=False)
    tts.make_voice(DATA / "ref_en_24k.wav", (DATA / "ref_en_24k.txt").read_text().strip()).save(voices / "narrator.npz")
    proc = subprocess.Popen([sys.executable, "-m", "higgs_onnx.wyoming", "--model-path", str(builds["fp32"]),
                             "--uri", "tcp://127.0.0.1:0", "--voices", str(voices), "--zeroconf", MDNS_NAME],
                            cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "CI": "1"})
    line = proc.stdout.readline()
    m = re.search(r"\('127\.0\.0\.1', (\d+)\)", line)
    assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
    yield int(m.group(1))
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err[-3000:]


async def read_until(client, stop, limit: int = 100000) -> list:
    got = []
    for _ in range(limit):
        e = await asyncio.wait_for(client.read_event(), 120)
        assert e is not None, f"closed after {[x.type for x in got]}"
        got.append(e)
        if stop(e):
            return got
    raise AssertionError("no end")


def audio_of(events) -> np.ndarray:
    return np.frombuffer(b"".join(e.payload for e in events if AudioChunk.is_type(e.type)), "<i2")


def test_describe_and_synthesize(wyoming):
    async def run():
        async with AsyncTcpClient("127.0.0.1", wyoming) as c:
            await c.write_event(Describe().event())
            info = Info.from_event(await c.read_event())
            program = info.tts[0]
            assert [v.name for v in program.voices] == ["default", "narrator"]
            assert program.supports_synthesize_streaming and "en" in program.voices[0].languages
            out = {}
            for voice in (None, "narrator"):
                v = SynthesizeVoice(name=voice) if voice else None
                await c.write_event(Synthesize(text=TEXT, voice=v).event())
                got = await read_until(c, lambda e: AudioStop.is_type(e.type))
                start = AudioStart.from_event(got[0])
                assert (start.rate, start.width, start.channels) == (24000, 2, 1)
                out[voice] = audio_of(got)
            return out

    out = asyncio.run(run())
    assert len(out[None]) > 24000 and len(out["narrator"]) > 24000 and not np.array_equal(
        out[None][:1000], out["narrator"][:1000])


def test_home_assistants_streaming_flow(wyoming):
    """Home Assistant's streaming writer: synthesize-start, a chunk per LLM delta, synthesize (the whole text, for
    servers without streaming: ignored), synthesize-stop; audio comes per sentence, then synthesize-stopped."""
    async def run():
        async with AsyncTcpClient("127.0.0.1", wyoming) as c:
            await c.write_event(SynthesizeStart(voice=SynthesizeVoice(name="narrator")).event())
            first_audio_before_stop = False
            for w in TEXT.split(" "):
                await c.write_event(SynthesizeChunk(text=w + " ").event())
            try:  # the first sentence's audio starts before the text is over
                e = await asyncio.wait_for(c.read_event(), 60)
                first_audio_before_stop = AudioStart.is_type(e.type)
            except TimeoutError:
                pass
            await c.write_event(Synthesize(text=TEXT).event())
            await c.write_event(SynthesizeStop().event())
            got = await read_until(c, lambda e: SynthesizeStopped.is_type(e.type))
            return first_audio_before_stop, got

    early, got = asyncio.run(run())
    types = [e.type for e in got if not AudioChunk.is_type(e.type)]
    assert early and types == ["audio-stop", "audio-start", "audio-stop", "synthesize-stopped"]
    assert len(audio_of(got)) > 0


def test_each_stream_speaks_a_block_per_sentence_and_a_bad_sentence_is_an_error_in_its_place(wyoming):
    """The stream engine under Wyoming's streaming synthesis: two streams in turn on one connection, their text in
    pieces that cut words; each sentence is its own audio-start / audio-chunk / audio-stop block, then
    synthesize-stopped ends the stream. A sentence that cannot be spoken (a special token) is an error event where
    its block would be, and its stream goes on to the next sentence."""
    async def stream(c, pieces: list[str]) -> list:
        await c.write_event(SynthesizeStart().event())
        for piece in pieces:
            await c.write_event(SynthesizeChunk(text=piece).event())
        await c.write_event(SynthesizeStop().event())
        return await read_until(c, lambda e: SynthesizeStopped.is_type(e.type))

    async def run():
        async with AsyncTcpClient("127.0.0.1", wyoming) as c:
            return (await stream(c, ["One sen", "tence here. And a sec", "ond one", "! The last", " one."]),
                    await stream(c, ["Bad <|im_", "start|> token. ", "A good one."]))

    first, second = asyncio.run(run())
    blocks = []
    for e in first:
        if AudioStart.is_type(e.type):
            blocks.append([])
        elif AudioChunk.is_type(e.type):
            blocks[-1].append(len(e.payload or b""))
    kinds = [e.type for e in first if not AudioChunk.is_type(e.type)]
    assert kinds == ["audio-start", "audio-stop"] * 3 + ["synthesize-stopped"], kinds
    assert len(blocks) == 3 and all(sum(b) > 0 for b in blocks), blocks
    kinds = [e.type for e in second if not AudioChunk.is_type(e.type)]
    assert kinds == ["error", "audio-start", "audio-stop", "synthesize-stopped"], kinds
    assert Error.from_event(second[0]).code == "special_token" and len(audio_of(second)) > 0


def test_a_field_wyoming_has_no_place_for_is_refused_by_name_and_nothing_is_spoken(wyoming):
    """A synthesis event whose data carries a job field Wyoming's events have no place for (ssml, speed) is answered
    with one error event naming it, in the options table's words (job.options.refuse), before anything is spoken; a
    refused synthesize-start opens no stream. The connection stays: the next plain synthesize speaks."""
    async def run():
        async with AsyncTcpClient("127.0.0.1", wyoming) as c:
            answers = []
            for event in (Event("synthesize", {"text": "Not spoken.", "ssml": True}),
                          Event("synthesize", {"text": "Not spoken.", "speed": 1.2}),
                          Event("synthesize-start", {"ssml": True}), SynthesizeChunk(text="No stream. ").event()):
                await c.write_event(event)
                answers.append(await asyncio.wait_for(c.read_event(), 60))
            await c.write_event(Synthesize(text="Now it speaks.").event())
            return answers, await read_until(c, lambda e: AudioStop.is_type(e.type))

    answers, got = asyncio.run(run())
    assert all(Error.is_type(e.type) for e in answers), answers
    errors = [Error.from_event(e) for e in answers]
    assert [(x.code, x.text) for x in errors[:3]] == [
        ("unsupported_parameter", "ssml is not supported by Wyoming: Wyoming has no such field"),
        ("unsupported_parameter", "speed is not supported by Wyoming: Wyoming has no such field"),
        ("unsupported_parameter", "ssml is not supported by Wyoming: Wyoming has no such field")]
    assert errors[3].code == "bad_order"  # the refused synthesize-start opened nothing
    assert [e.type for e in got if not AudioChunk.is_type(e.type)] == ["audio-start", "audio-stop"]
    assert len(audio_of(got)) > 0


def test_bad_requests_get_an_error_event_and_the_connection_stays(wyoming):
    async def run():
        async with AsyncTcpClient("127.0.0.1", wyoming) as c:
            codes = []
            for ev in (Synthesize(text="Hi.", voice=SynthesizeVoice(name="nobody")),
                       Synthesize(text="Bad <|im_start|> token."), Synthesize(text="   "),
                       SynthesizeChunk(text="no start"), SynthesizeStop()):
                await c.write_event(ev.event())
                e = await asyncio.wait_for(c.read_event(), 60)
                assert Error.is_type(e.type), e
                codes.append(Error.from_event(e).code)
            await c.write_event(Describe().event())  # still answering
            assert Info.is_type((await c.read_event()).type)
            return codes

    assert asyncio.run(run()) == ["voice_not_found", "special_token", "empty_text", "bad_order", "bad_order"]


def raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # nothing more comes (a frame cut short ends here)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_malformed_and_oversized_frames_close_with_an_error(wyoming):
    for frame, want in ((b"{not json\n", b"not JSON"), (b'["a"]\n', b'"type"'),
                        (b'{"type": "synthesize", "payload_length": 9999999999}\n', b"at most"),
                        (b'{"type": "synthesize", "data_length": 5}\n{"a"', b"ended inside"),
                        (b"x" * 70000 + b"\n", b"longer than")):
        out = raw(wyoming, frame)  # recv returns b"" at the close: the server closed it
        assert b'"error"' in out and want in out, (frame[:40], out)


def test_a_client_that_vanishes_mid_audio_leaves_the_server_serving(wyoming):
    async def vanish():
        reader, writer = await asyncio.open_connection("127.0.0.1", wyoming)
        from wyoming.event import async_write_event

        await async_write_event(Synthesize(text=TEXT * 3).event(), writer)
        await reader.readline()  # the first event has begun
        writer.transport.abort()

    async def describe():
        async with AsyncTcpClient("127.0.0.1", wyoming) as c:
            await c.write_event(Synthesize(text="Still here.").event())
            return audio_of(await read_until(c, lambda e: AudioStop.is_type(e.type)))

    asyncio.run(vanish())
    assert len(asyncio.run(describe())) > 0


def test_announced_over_mdns_and_found_by_a_client(wyoming):
    """`--zeroconf NAME`: an mDNS query finds NAME._wyoming._tcp.local. at the port the server listens on, and a
    Wyoming client that connects there is answered."""
    info = discover(MDNS_NAME)
    assert info is not None, "not announced"
    assert info.port == wyoming and info.parsed_addresses() == ["127.0.0.1"]
    assert info.properties[b"app"] == b"higgs-onnx"
    assert discover("nobody-by-this-name", 1.5) is None

    async def describe():
        async with AsyncTcpClient(info.parsed_addresses()[0], info.port) as c:
            await c.write_event(Describe().event())
            return Info.from_event(await asyncio.wait_for(c.read_event(), 60))

    assert asyncio.run(describe()).tts[0].name == "higgs-onnx"


def test_bad_flags_are_one_line(builds):
    for args, want in ((["--uri", "tcp://127.0.0.1:99999"], "port must be"), (["--uri", "http://x"], "use tcp://"),
                       (["--default-voice", "nobody"], "--default-voice: unknown voice"),
                       (["--uri", "unix:///tmp/w.sock", "--zeroconf"], "a unix socket"),
                       (["--zeroconf", "a.b"], "without dots"), (["--zeroconf", "x" * 64], "at most 63 bytes")):
        r = subprocess.run([sys.executable, "-m", "higgs_onnx.wyoming", "--model-path", str(builds["fp32"]), *args],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_serve_answers_wyoming_on_its_own_scheduler(builds, tmp_path):
    """`serve --wyoming`: the HTTP server's scheduler speaks Wyoming's requests (a refused one submits nothing), and
    its Wyoming door is announced over mDNS while it runs."""
    name = f"higgs-serve-{os.getpid()}"
    with served(builds["fp32"], tmp_path, "--zeroconf", name, wyoming=True) as server:
        port = server.wyoming_port
        info = discover(name)  # the HTTP server's Wyoming door is announced too
        assert info is not None and info.port == port
        before = server.stats()["submitted"]

        async def run():
            async with AsyncTcpClient("127.0.0.1", port) as c:
                await c.write_event(Event("synthesize", {"text": "Not this one.", "ssml": True}))
                refused = await asyncio.wait_for(c.read_event(), 60)
                await c.write_event(Synthesize(text="One scheduler for both.").event())
                return refused, audio_of(await read_until(c, lambda e: AudioStop.is_type(e.type)))

        refused, audio = asyncio.run(run())
        assert Error.is_type(refused.type) and Error.from_event(refused).code == "unsupported_parameter"
        assert len(audio) > 0
        assert server.stats()["submitted"] == before + 1  # the HTTP server's scheduler made it, and only it
    assert discover(name, 2.0) is None  # withdrawn when the server stops
    r = subprocess.run([sys.executable, "-m", "higgs_onnx.serve", "--model-path", str(builds["fp32"]), "--zeroconf"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--zeroconf announces the Wyoming door" in r.stderr, r.stderr
