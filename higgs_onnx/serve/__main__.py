"""Start the speech server: one model, loaded once, behind an OpenAI-compatible HTTP API and a web page.

    python -m higgs_onnx.serve --model-path onnx/cpu_int4 [--host 127.0.0.1] [--port 8000] [--max-batch 4]
                               [--max-queue 16] [--prefill-chunk N] [--voices DIR] [--api-key KEY] [--threads N]

Prints one line, `higgs-onnx speech server: http://HOST:PORT/ ...`, once it accepts requests (with --port 0 the
line has the port the system chose). Ctrl-C stops it (in-flight streams get a few seconds to finish).

Every request feeds one scheduler (`generation.scheduler`): up to --max-batch requests advance together, one
decoder call per step; a new prompt is prefilled in chunks between the running requests' steps (sized by time, about
one decode step each, unless --prefill-chunk fixes the number of positions), and audio is decoded on a codec thread
of its own, so a long prompt or the codec never stops the streams in flight.

Slow or stuck clients are bounded (serve/limits.py has the table): request headers within --header-timeout,
request bodies within --body-timeout with pauses of at most --body-idle-timeout, a response the client stops
reading is cut after --send-timeout, idle kept-alive connections close after --keep-alive-timeout, and at most
--max-connections connections and requests are open at once (503 beyond).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from pathlib import Path

from ..cli import add_log_level, run_main
from ..extras import require, require_text
from ..hub import cli_model_path, model_path_arg
from ..job.options import SpeechOptions, add_text_flags, text_values
from ..runtime.session import PROVIDERS
from ..runtime.voice_cache import DEFAULT_VOICE_CACHE_BYTES
from .launch import is_loopback, load, timeouts_of
from .limits import MAX_HEADER_BYTES, Timeouts, guarded_protocol
from .scheduler import add_idle_unload, idle_note

log = logging.getLogger("higgs_onnx.serve")
SSML_REFUSED = ('is per request, not a server default (a WebSocket or Wyoming session\'s text arrives in pieces): send '
                '"ssml": true with POST /v1/audio/speech')


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m higgs_onnx.serve", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", type=model_path_arg, required=True, help="an onnx/<device>_<precision> folder, "
                    "or a Hub reference hf://ORG/REPO/FOLDER[@REVISION] (docs/hub.md)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine "
                    "only; 0.0.0.0 exposes it to the network, use --api-key then)")
    ap.add_argument("--port", type=int, default=8000, help="TCP port (default %(default)s; 0 = any free port)")
    ap.add_argument("--max-batch", type=int, default=4, help="requests generated together (default %(default)s)")
    ap.add_argument("--max-queue", type=int, default=16, help="requests that may wait for a batch slot; more get "
                    "HTTP 429 (default %(default)s)")
    ap.add_argument("--prefill-chunk", type=int, metavar="N", help="prompt positions prefilled per decoder step "
                    "while other requests decode (default: sized by time, about one decode step's worth)")
    ap.add_argument("--voices", type=Path, help="folder of saved voices (default: MODEL_PATH/voices; for a Hub "
                    "reference, a community-layout export or a folder you cannot write, a folder in higgs-onnx's "
                    "cache, docs/hub.md; a voice belongs to the export that made "
                    "it); created if missing")
    ap.add_argument("--default-voice", default="default", metavar="NAME", help="the voice for requests that name "
                    "none or one of OpenAI's (alloy, echo, nova, ...: what stock clients such as Open "
                    "WebUI send): a saved voice's name, or 'default' (zero-shot, the default)")
    ap.add_argument("--wyoming", metavar="URI", help="also answer Home Assistant's Wyoming protocol on URI "
                    "(tcp://HOST:PORT), on the same scheduler: its requests batch with the HTTP ones")
    ap.add_argument("--zeroconf", nargs="?", const="", metavar="NAME", help="announce the --wyoming door over mDNS "
                    "for Home Assistant's discovery, as NAME (default: higgs-onnx-HOSTNAME)")
    ap.add_argument("--ws-idle-timeout", type=float, default=30.0, metavar="S", help="a text-in WebSocket session "
                    "with nothing to speak and no message for this long is closed (default %(default)s)")
    ap.add_argument("--api-key", default=os.environ.get("HIGGS_API_KEY"), help="require 'Authorization: Bearer "
                    "KEY' on /v1 (default: $HIGGS_API_KEY, which keeps the key out of the process list)")
    ap.add_argument("--metrics-public", action="store_true", help="serve GET /metrics (Prometheus) without the "
                    "API key, for a scraper that cannot send one (default: behind --api-key like /v1)")
    add_text_flags(ap, "every request's text (a request's own fields are laid over these)", SSML_REFUSED)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = one per core)")
    ap.add_argument("--provider", choices=sorted(PROVIDERS), help="execution provider (default: the one the "
                    "folder was built for)")
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the model files")
    t = Timeouts()
    ap.add_argument("--header-timeout", type=float, metavar="S", help="seconds for a request's line and headers to "
                    f"arrive; then 408 and the connection is closed (default {t.header_s})")
    ap.add_argument("--body-timeout", type=float, default=t.body_s, metavar="S", help="seconds for a whole request "
                    "body (default %(default)s)")
    ap.add_argument("--body-idle-timeout", type=float, default=t.body_idle_s, metavar="S", help="longest pause "
                    "inside a request body; then 408 (default %(default)s)")
    ap.add_argument("--send-timeout", type=float, default=t.send_s, metavar="S", help="a response the client stops "
                    "reading for this long is cut and its job cancelled (default %(default)s)")
    ap.add_argument("--keep-alive-timeout", type=float, metavar="S", help="idle kept-alive connections are closed "
                    f"after this (default {t.keep_alive_s})")
    ap.add_argument("--max-connections", type=int, metavar="N", help="open connections and running requests at "
                    f"most; more get 503 (default {t.max_connections})")
    ap.add_argument("--voice-cache-mb", type=int, default=DEFAULT_VOICE_CACHE_BYTES >> 20, metavar="MB",
                    help="memory for voices made from references, least recently used out (a real-model voice is "
                    "~80 MB; default %(default)s)")
    add_idle_unload(ap)
    ap.add_argument("--guard", action="append", default=[], metavar="KEY=VALUE", help="a threshold of the guard "
                    "(docs/guard.md), e.g. --guard loop_rows=48 --guard overlong_factor=3; repeatable")
    ray = ap.add_argument_group("Ray Serve: replicas of this server behind one address (docs/server.md, Scaling)")
    ray.add_argument("--ray", action="store_true", help="serve on Ray Serve: --replicas copies of the model, each "
                     "with its own scheduler, behind Ray's HTTP proxy on --host/--port")
    ray.add_argument("--address", help="a running Ray cluster to deploy on ('auto', HEAD:6379 or "
                     "ray://HEAD:10001; default: start a local one)")
    ray.add_argument("--replicas", type=int, default=1, metavar="N", help="replicas (with --max-replicas: the "
                     "fewest; default %(default)s); each takes --threads cores (0: 1 under --ray)")
    ray.add_argument("--max-replicas", type=int, metavar="M", help="autoscale between --replicas and M on ongoing "
                     "requests per replica (target: --max-batch)")
    add_log_level(ap)
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Every argument that can be checked before the (slow) model load; ValueError says which and why."""
    from ..runtime.prepared import enabled
    from ..runtime.route import check_mode
    from ..runtime.session import check_threads

    check_mode(None)  # $HIGGS_ROUTE: here, not in a replica after Ray has started
    enabled()  # $HIGGS_PREPARED alike

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.voice_cache_mb < 0:
        raise ValueError(f"--voice-cache-mb must be >= 0, got {args.voice_cache_mb}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.wyoming is not None:
        from .wyoming_server import check_uri, check_zeroconf

        check_uri(args.wyoming, "--wyoming")
        if args.zeroconf is not None:
            args.zeroconf = check_zeroconf(args.wyoming, args.zeroconf)
    elif args.zeroconf is not None:
        raise ValueError("--zeroconf announces the Wyoming door: give --wyoming tcp://HOST:PORT too")
    if not args.ws_idle_timeout > 0:
        raise ValueError(f"--ws-idle-timeout must be > 0 seconds, got {args.ws_idle_timeout}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1 position, got {args.prefill_chunk} (leave it out to size "
                         f"chunks by time)")
    check_ray_args(args)
    if getattr(args, "ssml", None):
        raise ValueError(f"--ssml {SSML_REFUSED}")
    timeouts_of(args)
    check_threads(args.threads)
    args.base = SpeechOptions.build(text_values(args), "cli")  # the text steps' defaults: the bounds of every door
    from ..guard import GuardOptions

    args.guard_options = GuardOptions.parse(args.guard) if args.guard else None
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty; give a key, or leave the flag out for an open server")
    cli_model_path(args, voices=True)  # hf://...: fetched once here (Ray replicas get the local folder)
    if not args.model_path.is_dir():
        raise FileNotFoundError(f"--model-path {args.model_path} is not a folder (expected an onnx/<device>_"
                                f"<precision> export)")
    if args.voices is not None and args.voices.exists() and not args.voices.is_dir():
        raise NotADirectoryError(f"--voices {args.voices} is a file, not a folder")


def check_ray_args(args: argparse.Namespace) -> None:
    """The flags of --ray, and the plain server's flags that do not apply under it (refused by name)."""
    if not args.ray:
        for flag, value, default in (("--address", args.address, None), ("--replicas", args.replicas, 1),
                                     ("--max-replicas", args.max_replicas, None)):
            if value != default:
                raise ValueError(f"{flag} needs --ray (the plain server is one process)")
        return
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise ValueError(f"--max-replicas ({args.max_replicas}) must be >= --replicas ({args.replicas})")
    if args.wyoming is not None:
        raise ValueError("--wyoming is not served with --ray (every replica would listen on its port): run "
                         "python -m higgs_onnx.serve --wyoming beside it, or the Wyoming server alone")
    for flag in ("header_timeout", "keep_alive_timeout", "max_connections"):
        if getattr(args, flag) is not None:  # before timeouts_of fills in the defaults
            raise ValueError(f"--{flag.replace('_', '-')} does not apply with --ray: Ray Serve's proxy reads the "
                             f"connections (its http_options; docs/server.md, Scaling)")
    if args.address is not None:
        from ..ray_local import check_address

        check_address(args.address)


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (a taken port is one clear error, not a late crash); uvicorn
    listens on it once the model is loaded, so until then a connection is refused (not ready) instead of waiting."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} cannot be resolved ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    sock.set_inheritable(True)
    return sock


def serve(args: argparse.Namespace) -> int:
    require("ray" if args.ray else "server", "serve --ray" if args.ray else "the server")  # the extra, one line
    check_args(args)  # before the heavy imports: a bad flag is answered at once
    require_text(vars(args))  # the text steps' defaults need the text extra
    sock = listen(args.host, args.port)
    if not is_loopback(args.host) and args.api_key is None:
        print(f"warning: listening on {args.host} without --api-key: anyone who reaches this port can use it",
              file=sys.stderr)
    if args.ray:  # Ray's proxy listens: the port is checked (and, for --port 0, chosen) here, then let go
        from .ray_serve import serve_on_ray

        args.port = sock.getsockname()[1]
        sock.close()
        return serve_on_ray(args)
    import uvicorn

    app, tts, voices = load(args)
    scheduler = app.state.scheduler
    timeouts = timeouts_of(args)
    port = sock.getsockname()[1]
    shown = f"[{args.host}]" if ":" in args.host else args.host
    banner = (f"higgs-onnx speech server: http://{shown}:{port}/ (model {Path(tts.manifest.folder).name}, "
              f"batch {args.max_batch}, queue {args.max_queue}, prefill chunk "
              f"{args.prefill_chunk or 'by time'}, voices in {voices}"
              f"{idle_note(args.idle_unload)}"
              f"{', API key required' if args.api_key else ''})")

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                print(banner, flush=True)

        async def shutdown(self, sockets=None) -> None:
            """SIGTERM / Ctrl-C: every job in flight ends at once, each answered as documented (a JSON 503 where no
            audio went out yet; an error event on SSE, the WebSocket and Wyoming; one log line each), before
            uvicorn closes the connections."""
            await asyncio.to_thread(scheduler.stop)
            await asyncio.sleep(0.3)  # the handlers send their answers
            await super().shutdown(sockets)

    level = args.log_level.lower()
    config = uvicorn.Config(app, log_level=level, access_log=level in ("debug", "info"), lifespan="on",
                            timeout_graceful_shutdown=5, server_header=False, http=guarded_protocol(timeouts),
                            timeout_keep_alive=timeouts.keep_alive_s, limit_concurrency=timeouts.max_connections,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    Server(config).run(sockets=[sock])
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(serve, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
