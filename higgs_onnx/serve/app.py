"""The FastAPI app: OpenAI's `POST /v1/audio/speech` (plus voices, models, tags, health and a web page).

Every speech response streams: the handler submits a job to the `Scheduler`, waits for its first chunk (so that
a failure before any audio still gets a proper JSON error, and a client that leaves while queued cancels it),
then returns a `StreamingResponse` that encodes each chunk as it comes (`formats`). Leaving the response early,
for whatever reason, cancels the job, which frees its batch slot.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, one clear line, never a traceback:
4xx for what the client sent, 401 for the API key, 408 for a body that stops arriving, 413 for one too large (or a
prompt that does not fit), 429 when the queue is full, 500 (server log has the details) for a failure of the server
itself, 503 for a request that had no audio yet when the server shut down. Every request is checked against the
request contract (`generation.contract`) before it is queued: a `ContractError` is answered with its own status,
param and code; a generation that ends without audio is an error, never a 200 with an empty body.

The OpenAPI schema is at `/openapi.json`; there is no `/docs` page (FastAPI's Swagger page loads its script from a
CDN, which a server on an offline machine cannot reach, and the page's CSP would refuse it).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..job.finish import close_aligner
from ..job.options import SpeechOptions
from . import cartesia_bytes, dialogue_routes, info_routes, speech_routes, stream_routes, voice_routes
from .http import STATIC, ApiError, HostGuard, LoggedCut, client_of, error_response, validation_message
from .limits import BodyDeadline, BodyTimeout, ClientGone, Timeouts
from .metrics import CONTENT_TYPE, Metrics, RequestCounter
from .service import SpeechService
from .streams import cartesia, elevenlabs
from .voices import DEFAULT

log = logging.getLogger(__name__)


def create_app(tts, scheduler, voices_dir: str | Path, api_key: str | None = None, *,
               allowed_hosts: list[str] | None = None, timeouts: Timeouts | None = None,
               default_voice: str = DEFAULT, ws_idle_s: float = 30.0, wyoming: str | None = None,
               base: SpeechOptions | None = None, metrics_public: bool = False,
               metrics_labels: dict | None = None, zeroconf: str | None = None) -> FastAPI:
    """The app for one loaded model: the routes of every module, on one `SpeechService`. Its lifespan starts and
    stops `scheduler`. `api_key` (if set) is required as `Authorization: Bearer <key>` on every /v1 route;
    `allowed_hosts` (if set) refuses other Host headers (DNS rebinding: the server's own loopback names); `timeouts`
    bound the request bodies (`limits`); `default_voice` (a saved voice's name) speaks for requests that name no
    voice or one of OpenAI's (`OPENAI_VOICES`); "default" named is zero-shot speech. `base`: the server's defaults
    of the job's options (its text steps), under every request's own (Wyoming's too). `metrics_public`: `/metrics`
    without the API key (for a scraper that cannot send one); `metrics_labels`: added to every series (a Ray Serve
    replica's name); `zeroconf`: the name the Wyoming door is announced as over mDNS. The app's `state`
    has its `metrics` (`metrics.Metrics`) and `scheduler`."""
    timeouts = timeouts or Timeouts()
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, LoggedCut) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(LoggedCut())
    svc = SpeechService(tts, scheduler, voices_dir, api_key, timeouts, default_voice, ws_idle_s, base)
    svc.replica = (metrics_labels or {}).get("replica")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        beside = mdns = None
        try:
            if wyoming is not None:  # Home Assistant's protocol on the same scheduler (higgs_onnx.wyoming)
                from .wyoming_server import Announcement, WyomingService, start

                beside = await start(wyoming, WyomingService(tts, scheduler, svc.store, default_voice=default_voice,
                                                               send_s=timeouts.send_s,
                                                               job=svc.speech_job(svc.base, "wyoming")))
                log.info("Wyoming server on %s", wyoming)
                if zeroconf is not None:
                    mdns = await Announcement.start(beside, zeroconf)
            yield
        finally:
            if mdns is not None:
                await mdns.close()
            if beside is not None:
                beside.close()
            scheduler.stop()
            close_aligner()  # the word aligner's process (job.finish), if a stream started it

    # no /docs page: Swagger UI loads from a CDN (offline machines, the page CSP); the schema stays at /openapi.json
    app = FastAPI(title="higgs-onnx speech server", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(BodyTimeout)
    async def _body_timeout(request: Request, e: BodyTimeout):
        log.warning("%s %s: %s; connection closed", client_of(request), request.url.path, e)
        return error_response(408, f"{e}; send the whole body at once", None, "body_timeout",
                              {"Connection": "close"})

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, e: Exception):  # one line, not a traceback: nobody reads the answer
        reason = str(e) if isinstance(e, ClientGone) else "the client left before the end of its request body"
        log.warning("%s %s: %s", client_of(request), request.url.path, reason)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        message, param = validation_message(e)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(e.status_code, message, code={404: "not_found"}.get(e.status_code),
                              headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):  # uvicorn logs the traceback; the client gets one line
        return error_response(500, "internal server error; the server log has the details", code="server_error")

    metrics = Metrics(scheduler, tts.voices, metrics_labels)  # GET /metrics (serve/metrics.py)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(BodyDeadline, timeouts=timeouts)
    if allowed_hosts:
        app.add_middleware(HostGuard, names=allowed_hosts)

    async def guard(request: Request) -> None:
        """The API key, and no cross-site writes (`SpeechService.refusal`)."""
        if (e := svc.refusal(request.headers, request.method not in ("GET", "HEAD"))) is not None:
            raise e

    info, root = info_routes.routers(svc)
    for router in (speech_routes.router(svc), dialogue_routes.router(svc), voice_routes.router(svc), info):
        app.include_router(router, prefix="/v1", dependencies=[Depends(guard)])
    for sockets in (stream_routes, cartesia, elevenlabs):  # their own checks, before the WebSocket is accepted
        app.include_router(sockets.router(svc))
    app.include_router(cartesia_bytes.router(svc))  # Cartesia's POST /tts/bytes: its own key header (X-API-Key)
    app.include_router(root)

    async def metrics_guard(request: Request) -> None:
        if not metrics_public:
            await guard(request)

    @app.get("/metrics", dependencies=[Depends(metrics_guard)], include_in_schema=False)
    async def prometheus():
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @app.api_route("/ready", methods=["GET", "HEAD"], include_in_schema=False)
    async def ready():
        """Readiness: 200 once the model is loaded and the scheduler runs; 503 while it drains (SIGTERM). HEAD
        answers alike, without the body (load balancers and Kubernetes probes send HEAD). An idle server whose model
        is unloaded (--idle-unload) is ready: 200 with `model_state` "unloaded" (its next request loads it)."""
        if scheduler.ready:
            return {"ready": True, "model_state": scheduler.model_state}
        return error_response(503, "the server is not ready (starting or draining)", None, "not_ready",
                              {"Retry-After": "1"})
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.state.metrics, app.state.scheduler = metrics, scheduler
    return app
