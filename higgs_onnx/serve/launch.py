"""What a server process builds from its checked arguments (`serve.__main__.check_args`): the model, its
scheduler and the app (`load`), for the plain server and for each Ray Serve replica (`ray_serve`)."""

from __future__ import annotations

import argparse
import ipaddress
import os
from pathlib import Path

from .limits import Timeouts

LOOPBACK_NAMES = ["localhost", "127.0.0.1", "[::1]"]


def timeouts_of(args: argparse.Namespace) -> Timeouts:
    t = Timeouts()
    for flag, default in (("header_timeout", t.header_s), ("keep_alive_timeout", t.keep_alive_s),
                          ("max_connections", t.max_connections)):
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    for flag in ("header_timeout", "body_timeout", "body_idle_timeout", "send_timeout", "keep_alive_timeout",
                 "max_connections"):
        value = getattr(args, flag)
        if not value > 0 or value != value or value == float("inf"):
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive number, got {value}")
    return Timeouts(header_s=args.header_timeout, body_idle_s=args.body_idle_timeout, body_s=args.body_timeout,
                    send_s=args.send_timeout, keep_alive_s=args.keep_alive_timeout,
                    max_connections=args.max_connections)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def voices_of(args: argparse.Namespace) -> Path:
    """The saved voices' folder: --voices, by default the export's `voices/` (for a Hub reference, a community-layout
    export or a folder the user cannot write, `hub.cli_model_path` set --voices to a folder in higgs-onnx's cache)."""
    return args.voices if args.voices is not None else Path(args.model_path) / "voices"


def warm_up(tts) -> None:
    """Create every session a request needs now, so the first request does not pay for loading the model."""
    from ..generation.codec_stream import StreamOptions

    tts.synthesizer  # noqa: B018 - text/audio embeddings, decoder and heads
    for part in (tts.backend.decoder_part, "text_embed", "audio_embed", "audio_heads", "audio_encoder"):
        tts.part(part)
    codec = tts.codec_stream(StreamOptions())
    if not hasattr(codec, "part"):  # window decoding: the one-shot codec part
        tts.part("audio_tokenizer")


def load(args: argparse.Namespace, metrics_labels: dict | None = None):
    """The model, its scheduler and the app, from checked arguments (`check_args`): (app, tts, voices folder).
    The plain server calls it once; each Ray Serve replica calls it (`ray_serve`)."""
    from ..runtime.model import HiggsTTS
    from .app import create_app
    from .scheduler import JobScheduler

    tts = HiggsTTS(args.model_path, provider=args.provider, threads=args.threads, verify=not args.no_verify,
                   voice_cache_bytes=args.voice_cache_mb << 20, guard=args.guard_options)
    warm_up(tts)
    voices = voices_of(args)
    try:
        voices.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the voices folder {voices} ({e.strerror}); pass --voices DIR") from None
    if not os.access(voices, os.W_OK):
        raise PermissionError(f"the voices folder {voices} is not writable; pass --voices DIR")
    if args.default_voice.lower() != "default":  # a missing or unusable default voice is known now, not per request
        from .voices import VoiceError, VoiceStore

        try:
            VoiceStore(voices, tts.model_id).get(args.default_voice)
        except VoiceError as e:
            raise ValueError(f"--default-voice: {e}") from None
    scheduler = JobScheduler(tts, max_batch=args.max_batch, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                             idle_unload=args.idle_unload)
    app = create_app(tts, scheduler, voices, args.api_key,
                     allowed_hosts=LOOPBACK_NAMES if is_loopback(args.host) else None,
                     timeouts=timeouts_of(args), default_voice=args.default_voice,
                     ws_idle_s=args.ws_idle_timeout, wyoming=args.wyoming, base=args.base,
                     metrics_public=args.metrics_public, metrics_labels=metrics_labels, zeroconf=args.zeroconf)
    return app, tts, voices
