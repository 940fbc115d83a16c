"""A Wyoming server (Home Assistant's voice protocol) on the one scheduler:
`python -m higgs_onnx.wyoming --model-path onnx/cpu_int4 [--uri tcp://127.0.0.1:10200] [--voices DIR]`, or
`python -m higgs_onnx.serve ... --wyoming tcp://0.0.0.0:10200` beside the HTTP API, sharing its scheduler (so
Wyoming requests batch with every other request).

Events (package `wyoming`, pinned):
- `describe` -> `info`: one TTS program, its voices ("default", zero-shot, and every saved voice in the folder),
  `supports_synthesize_streaming` true. A saved voice is listed under the languages it was saved with, else (and
  "default" always) under the server's `languages`.
- A request's voice is its name; a voice naming only a language (`{"language": "de"}`) is the first saved voice
  (by name) saved with that language, else the default voice.
- Synthesis (`synthesize`, and the streaming `synthesize-start` / `-chunk` / `-stop` of Wyoming 1.7+, which Home
  Assistant uses for an LLM's answer) is a codec of the stream engine: `serve/streams/wyoming.py` says what is sent.
- Malformed or oversized frames close the connection (`read_event`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
from pathlib import Path

from .. import __version__
from .streams.engine import Engine
from .streams.wire import within
from .streams.wyoming import Frame, Wyoming, WyomingTransport
from .textstream import SpeechSession
from .voices import DEFAULT, VoiceError

log = logging.getLogger("higgs_onnx.wyoming")
MAX_HEADER = 65536  # one JSON header line
MAX_DATA = 1 << 20  # a TTS client sends text: 1 MiB of event data or payload is far more than any sends
FRAME_S = 30.0  # the rest of an event, once its header came: a client that stalls inside one is closed
SEND_S = 30.0  # a write that waits this long (the client reads nothing): the connection is closed, its job cancelled
DEFAULT_LANGUAGES = ("en", "zh")


async def read_event(reader: asyncio.StreamReader):
    """The next event (None at the end of the stream), with every length bounded; Frame for a malformed one."""
    from wyoming.event import Event

    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as e:
        if e.partial.strip():
            raise Frame("the stream ended inside an event header") from None
        return None
    except asyncio.LimitOverrunError:
        raise Frame(f"an event header is longer than {MAX_HEADER} bytes") from None
    try:
        head = json.loads(line)
    except ValueError as e:
        raise Frame(f"an event header is not JSON ({e})") from None
    if not isinstance(head, dict) or not isinstance(head.get("type"), str):
        raise Frame('an event header is a JSON object with a "type"')
    data = head.get("data") or {}
    lengths = [head.get("data_length") or 0, head.get("payload_length") or 0]
    if not isinstance(data, dict) or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_DATA
                                         for n in lengths):
        raise Frame(f"bad event lengths or data (data and payload are at most {MAX_DATA} bytes)")
    try:
        if lengths[0]:
            extra = json.loads(await within(reader.readexactly(lengths[0]), FRAME_S))
            if not isinstance(extra, dict):
                raise Frame("event data is not a JSON object")
            data = {**data, **extra}
        payload = await within(reader.readexactly(lengths[1]), FRAME_S) if lengths[1] else None
    except asyncio.IncompleteReadError:
        raise Frame("the stream ended inside an event") from None
    except TimeoutError:
        raise Frame(f"the rest of an event did not come within {FRAME_S:g} s") from None
    except ValueError as e:
        raise Frame(f"event data is not JSON ({e})") from None
    return Event(type=head["type"], data=data, payload=payload)


class WyomingService:
    """What every connection shares: the model, the scheduler, the voices."""

    def __init__(self, tts, scheduler, store, languages=DEFAULT_LANGUAGES, default_voice: str = "default",
                 send_s: float = SEND_S, job=None):
        """`job`: the server's own job (`job.run.SpeechJob`: its lead, from --instructions, and its text steps,
        docs/text.md) under every text; None: texts are read as written."""
        self.tts, self.scheduler, self.store = tts, scheduler, store
        self.lead, self.read = (job.lead, job.reader()) if job is not None else ("", None)
        self.languages, self.default_voice, self.send_s = list(languages), default_voice, send_s
        self.rate = tts.facts.sample_rate

    def info(self):
        from wyoming.info import Attribution, Info, TtsProgram, TtsVoice

        by = Attribution(name="Boson AI (Higgs Audio v3); higgs-onnx", url="https://huggingface.co/bosonai/higgs-tts-3-4b")
        voices = [TtsVoice(name=n, attribution=by, installed=True, version=None, languages=list(langs),
                           description="zero-shot (no reference)" if n == "default" else f"saved voice {n}")
                  for n, langs in [("default", self.languages), *self.saved_languages()]]
        program = TtsProgram(name="higgs-onnx", attribution=by, installed=True, version=__version__,
                             description=f"Higgs Audio v3 TTS on ONNX Runtime ({Path(self.tts.manifest.folder).name})",
                             voices=voices, supports_synthesize_streaming=True)
        return Info(tts=[program])

    def saved_languages(self) -> list[tuple[str, tuple[str, ...]]]:
        """(name, languages) of every saved voice: its own languages, else the server's (one deleted meanwhile is
        left out). Only each file's small meta is read (`VoiceStore.languages`)."""
        out = []
        for name in self.store.names():
            try:
                out.append((name, self.store.languages(name) or tuple(self.languages)))
            except (FileNotFoundError, VoiceError):
                continue
        return out

    def voice_name(self, voice) -> str | None:
        """The voice a request's `SynthesizeVoice` names (None: the default): its name; for a language alone, the
        first saved voice saved with that language (the same code, else the same language in another region),
        else the default."""
        if voice is None or voice.name is not None:
            return None if voice is None else voice.name
        if not isinstance(voice.language, str) or not voice.language.strip():
            return None
        want = voice.language.strip().replace("_", "-").lower()
        own = []
        for name in self.store.names():
            try:
                own.append((name, [x.lower() for x in self.store.languages(name)]))
            except (FileNotFoundError, VoiceError):
                continue
        for same in (lambda x: x == want, lambda x: x.split("-")[0] == want.split("-")[0]):
            for name, langs in own:
                if any(same(x) for x in langs):
                    return name
        return None

    def voice(self, name: str | None):
        """The voice for a request's name (None: the default); VoiceError for an unknown or unusable one."""

        name = name or self.default_voice
        return None if name.lower() == DEFAULT else self.store.get(name)

    def session(self, voice) -> SpeechSession:
        return SpeechSession(self.scheduler, voice, prefix=self.lead)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, through the stream engine (streams/wyoming.py is its codec), to its end."""
        transport = WyomingTransport(reader, writer, read_event, self.send_s)
        engine = Engine(transport, functools.partial(Wyoming, service=self), None, None, self.send_s, self.rate,
                        f"wyoming {transport.peer}")
        await engine.run()


async def serve_wyoming(uri: str, service: WyomingService) -> None:
    """Listen on `uri` (tcp://HOST:PORT or unix://PATH) until cancelled."""
    server = await start(uri, service)
    async with server:
        await server.serve_forever()


async def start(uri: str, service: WyomingService) -> asyncio.AbstractServer:
    kind, where, port = parse_uri(uri)
    if kind == "tcp":
        return await asyncio.start_server(service.handle, where or "127.0.0.1", port, limit=MAX_HEADER)
    return await asyncio.start_unix_server(service.handle, where, limit=MAX_HEADER)


MDNS_TYPE = "_wyoming._tcp.local."
MAX_NAME = 63  # an mDNS instance name is one DNS label


def zeroconf_name(name: str | None, what: str = "--zeroconf") -> str:
    """The instance name Home Assistant shows (`NAME._wyoming._tcp.local.`): given, or `higgs-onnx-<host name>`."""
    if not name:
        name = f"higgs-onnx-{socket.gethostname().split('.')[0]}"[:MAX_NAME]
    if len(name.encode()) > MAX_NAME or "." in name or not name.isprintable():
        raise ValueError(f"{what} {name!r}: a name of at most {MAX_NAME} bytes, printable, without dots")
    return name


def check_zeroconf(uri: str, name: str | None, what: str = "--zeroconf") -> str:
    """The announced name, once the URI can be announced (tcp, an IPv4 address or a name: mDNS here is IPv4)."""
    kind, host, _ = parse_uri(uri)
    if kind != "tcp":
        raise ValueError(f"{what}: a unix socket ({uri}) cannot be announced on the network; listen on tcp://")
    if ":" in host:
        raise ValueError(f"{what}: {uri} is IPv6; the announcement is IPv4 (listen on an IPv4 address or 0.0.0.0)")
    return zeroconf_name(name, what)


class Announcement:
    """The Wyoming door announced over mDNS (python-zeroconf), as wyoming-piper does: `NAME._wyoming._tcp.local.`
    at the address and port it listens on. A server bound to one address is announced on that interface only (one
    on 127.0.0.1 is found on this machine alone); one on 0.0.0.0 on every interface, at the address this machine
    would reach the mDNS group from. `close()` withdraws it."""

    def __init__(self, zc, info):
        self.zc, self.info = zc, info

    @classmethod
    async def start(cls, server: asyncio.AbstractServer, name: str) -> Announcement:
        from zeroconf import InterfaceChoice, IPVersion
        from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

        host, port = server.sockets[0].getsockname()[:2]
        if host in ("0.0.0.0", "::", ""):
            interfaces, address = InterfaceChoice.All, own_address()
        else:
            interfaces, address = [host], host
        zc = AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
        info = AsyncServiceInfo(MDNS_TYPE, f"{name}.{MDNS_TYPE}", addresses=[socket.inet_aton(address)], port=port,
                                properties={"app": "higgs-onnx"})
        await zc.async_register_service(info)
        log.info("announced %s at %s:%d over mDNS", info.name, address, port)
        return cls(zc, info)

    async def close(self) -> None:
        try:
            await self.zc.async_unregister_service(self.info)
        finally:
            await self.zc.async_close()


def own_address() -> str:
    """The IPv4 address this machine sends to the mDNS group from (no packet is sent); loopback when none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("224.0.0.251", 5353))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def parse_uri(uri: str, what: str = "--uri") -> tuple[str, str, int | None]:
    """("tcp", host, port) or ("unix", path, None); ValueError naming `what` for anything else."""
    kind, _, where = uri.partition("://")
    if kind == "tcp":
        host, _, port = where.rpartition(":")
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"{what} {uri!r}: the port must be a number from 0 to 65535 (tcp://HOST:PORT)")
        return kind, host, int(port)
    if kind == "unix" and where:
        return kind, where, None
    raise ValueError(f"{what} {uri!r}: use tcp://HOST:PORT or unix://PATH")


def check_uri(uri: str, what: str = "--uri") -> str:
    parse_uri(uri, what)
    return uri
