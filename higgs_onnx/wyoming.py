"""`python -m higgs_onnx.wyoming`: a Wyoming server (Home Assistant's voice protocol) on its own scheduler; the
protocol itself is `higgs_onnx.serve.wyoming_server` (which `python -m higgs_onnx.serve --wyoming URI` also runs, on
the HTTP server's scheduler). docs/integrations.md."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from .cli import add_log_level, run_main
from .extras import require, require_text
from .hub import cli_model_path, model_path_arg
from .job.options import SpeechOptions, add_text_flags, text_values
from .job.run import SpeechJob
from .runtime.model import HiggsTTS
from .serve.scheduler import JobScheduler, add_idle_unload, idle_note
from .serve.voices import VoiceError, VoiceStore, check_languages
from .serve.wyoming_server import DEFAULT_LANGUAGES, Announcement, WyomingService, check_uri, check_zeroconf, start

SSML_REFUSED = "does not apply to Wyoming: its text arrives in pieces, and Home Assistant sends plain text"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m higgs_onnx.wyoming", description="A Wyoming TTS server for Home "
                                 "Assistant (docs/integrations.md)")
    ap.add_argument("--model-path", type=model_path_arg, required=True, help="an onnx/<device>_<precision> folder, "
                    "or a Hub reference hf://ORG/REPO/FOLDER[@REVISION] (docs/hub.md)")
    ap.add_argument("--uri", default="tcp://127.0.0.1:10200", help="where to listen (default %(default)s; "
                    "tcp://0.0.0.0:10200 for Home Assistant on another machine)")
    ap.add_argument("--zeroconf", nargs="?", const="", metavar="NAME", help="announce the server over mDNS for "
                    "Home Assistant's discovery, as NAME (default: higgs-onnx-HOSTNAME); docs/integrations.md")
    ap.add_argument("--voices", type=Path, help="folder of saved voices (default: MODEL_PATH/voices; for a Hub "
                    "reference, a community-layout export or a folder you cannot write, a folder in higgs-onnx's "
                    "cache: docs/hub.md)")
    ap.add_argument("--default-voice", default="default", metavar="NAME", help="the voice when a request names none")
    ap.add_argument("--languages", default=",".join(DEFAULT_LANGUAGES), help="languages the voices are listed with "
                    "(Home Assistant offers a voice for these; default %(default)s)")
    ap.add_argument("--max-batch", type=int, default=4, help="requests generated together (default %(default)s)")
    add_idle_unload(ap)
    add_text_flags(ap, "every text", SSML_REFUSED)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = one per core)")
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the model files")
    add_log_level(ap)
    return ap


def run(args: argparse.Namespace) -> int:
    require("server", "the Wyoming server", ("wyoming", "zeroconf") if args.zeroconf is not None else ("wyoming",))
    check_uri(args.uri)
    if args.ssml:
        raise ValueError(f"--ssml {SSML_REFUSED}")
    name = None if args.zeroconf is None else check_zeroconf(args.uri, args.zeroconf)
    base = SpeechOptions.build(text_values(args), "cli")  # the text steps (docs/text.md), before the model loads
    require_text(vars(args))
    languages = list(check_languages(args.languages, "--languages"))  # the one check of a language code
    if not languages:
        raise ValueError("--languages needs at least one language code, e.g. en")

    cli_model_path(args, voices=True)  # hf://...: fetched once; its voices folder in our cache, not the download
    tts = HiggsTTS(args.model_path, threads=args.threads, verify=not args.no_verify)
    store = VoiceStore(args.voices or Path(args.model_path) / "voices", tts.model_id)
    scheduler = JobScheduler(tts, max_batch=args.max_batch, idle_unload=args.idle_unload)
    service = WyomingService(tts, scheduler, store, languages, args.default_voice,
                             job=SpeechJob(base, tts.tokens.control_tags, "wyoming"))
    try:
        service.voice(None)
    except VoiceError as e:
        raise ValueError(f"--default-voice: {e}") from None

    async def main() -> None:
        service.scheduler.start()
        try:
            server = await start(args.uri, service)
            mdns = None if name is None else await Announcement.start(server, name)
            where = ", ".join(str(s.getsockname()) for s in server.sockets)
            print(f"higgs-onnx Wyoming server on {args.uri} ({where}); voices: "
                  f"{', '.join(['default', *store.names()])}"
                  f"{'' if mdns is None else f'; announced as {mdns.info.name}'}"
                  f"{idle_note(args.idle_unload)}", flush=True)
            try:
                async with server:
                    await server.serve_forever()
            finally:
                if mdns is not None:
                    await mdns.close()
        finally:
            service.scheduler.stop()

    try:
        asyncio.run(main())
    except OSError as e:
        raise ValueError(f"cannot listen on {args.uri}: {e.strerror or e}") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
