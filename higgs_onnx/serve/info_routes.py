"""Models, control tags, health and the web page."""

from __future__ import annotations

import logging
import os
import time

from fastapi import APIRouter
from fastapi.responses import FileResponse

from ..generation.contract import min_rows
from ..generation.options import DEFAULT_MAX_ROWS
from .http import (
    PAGE_CSP,
    STATIC,
    ApiError,
)
from .limits import (
    COUNTERS,
    MAX_INPUT_CHARS,
    MAX_JSON_BYTES,
    MAX_PIECES,
    MAX_UPLOAD_BYTES,
)
from .pieces import ONE_REQUEST_CHARS
from .service import SpeechService
from .streams import engine

log = logging.getLogger(__name__)


PROXY_HOLDS = ("header_s", "keep_alive_s")  # under Ray Serve its proxy holds the connections: not these bounds


def behind_proxy(limits: dict) -> dict:
    """The limits a Ray Serve replica enforces: the connection bounds are the proxy's (no header timeout, its own
    keep-alive and connection count), so they are not claimed (docs/server.md, Scaling)."""
    return {**{k: v for k, v in limits.items() if k != "max_connections"}, "connections": "ray_serve_proxy",
            "timeouts_s": {k: v for k, v in limits["timeouts_s"].items() if k not in PROXY_HOLDS}}


def routers(svc: SpeechService) -> tuple[APIRouter, APIRouter]:
    """(the /v1 routes, the root ones)."""
    router, root = APIRouter(), APIRouter()
    tts, scheduler, timeouts = svc.tts, svc.scheduler, svc.timeouts
    limits = {"context_positions": tts.facts.max_positions, "slot_positions": scheduler.slot_positions,
              "default_max_rows": DEFAULT_MAX_ROWS, "min_rows": min_rows(tts.facts.num_codebooks),
              "max_input_chars": MAX_INPUT_CHARS, "one_request_chars": ONE_REQUEST_CHARS, "max_pieces": MAX_PIECES,
              "max_json_bytes": MAX_JSON_BYTES,
              "max_upload_bytes": MAX_UPLOAD_BYTES, "max_connections": timeouts.max_connections,
              "timeouts_s": {k: v for k, v in timeouts.as_dict().items() if k.endswith("_s")}}
    if svc.replica:  # set by create_app before the routes are made
        limits = behind_proxy(limits)

    @router.get("/audio/models")
    async def audio_models():
        entries = [svc.model_entry(m) for m in svc.models]
        return {"object": "list", "models": [{"id": e["id"], "name": e["id"]} for e in entries], "data": entries}

    @router.get("/models")
    async def list_models():
        return {"object": "list", "data": [svc.model_entry(m) for m in svc.models]}

    @router.get("/models/{mid}")
    async def get_model(mid: str):
        if mid not in svc.models:
            raise ApiError(404, f"model {mid!r} is not served here; use one of {', '.join(svc.models)}", "model",
                           "model_not_found")
        return svc.model_entry(mid)

    @router.get("/tags")
    async def list_tags():
        """The model's inline control tags, for the page's hints (`<|category:name|>`)."""
        tags = sorted(svc.tts.tokens.control_tags)
        return {"object": "list", "data": [{"id": t, "category": t[2:-2].split(":")[0], "name": t[2:-2].split(":")[1]}
                                           for t in tags]}

    hub = svc.tts.source  # an export fetched from the Hub: its repo, folder and commit
    source = {"repo_id": hub.repo_id, "folder": hub.folder, "revision": hub.revision, "commit": hub.commit} if hub \
        else None

    @root.get("/health")
    async def health():
        """Liveness, the request limits (context and slot positions, default max_rows, sizes, timeouts), the
        scheduler's counters and how often each client guard fired; under Ray Serve, the answering replica (its id
        and process)."""
        return {"status": "ok", "model": svc.model_id, "models": svc.models, "sample_rate": svc.sample_rate,
                **({"source": source} if source else {}), "limits": limits,
                "scheduler": svc.scheduler.stats(), "guards": dict(COUNTERS), "streams": dict(engine.OPEN),
                "voice_cache": svc.tts.voices.stats(),
                "uptime_s": round(time.time() - svc.started, 1),
                **({"replica": {"id": svc.replica, "pid": os.getpid()}} if svc.replica else {})}

    @root.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_CSP,
                                                            "Cache-Control": "no-cache"})

    for path, endpoint in (("/health", health), ("/", page)):  # HEAD: the GET's headers, no body (uvicorn drops it)
        root.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
    return router, root
