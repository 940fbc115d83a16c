"""Prometheus metrics of one server process: `GET /metrics` (prometheus-client's text format; behind `--api-key`
unless `--metrics-public`), and `GET /ready`, the readiness check (docs/server.md, "Metrics and readiness").

What it exports, all prefixed `higgs_`:
- `requests_total{door, status}`: finished HTTP requests of the speech doors (`http`: /v1/audio/speech, `dialogue`,
  `voices`) by status code, and WebSocket sessions of every socket door (`websocket`, `cartesia`, `elevenlabs`) as
  `accepted` or `refused` (the key or the origin);
- the scheduler's state at the scrape (`in_flight`, `queued`, `active`, `kept`, `slots_in_use`, `max_batch`,
  `max_queue`) and its counters (`jobs_total{outcome}` with `rejected` for a full queue's 429, `decoder_steps_total`,
  `rows_total`, `decode_seconds_total`, `prefill_seconds_total`: rows per second and step time are their rates);
- histograms of each finished job's `time_to_first_audio_seconds` and `real_time_factor` (wall / audio);
- `model_loaded` (1, or 0 while the idle model is unloaded or loading again: `--idle-unload`), `model_unloads_total`,
  `model_reloads_total` and `model_reload_seconds` (the last load after an unload);
- `aligner_pending`: pieces waiting for, or in, the word aligner's process;
- `takes_total{policy, verdict}`: takes the guard judged (`best_of`: a request's `takes`; `redraw`: its `retries`) by
  verdict (`good`, or the failure the guard found), and `redraws_total`: the takes drawn again after a bad one;
- `voice_cache_lookups_total{result}` (`hit`, `miss`) and `voice_cache_bytes`: voices made from reference audio.
Under Ray Serve each replica's series carry a `replica` label and one scrape returns every replica's (`ray_serve`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# path -> door, for the requests counter (other paths are not counted: pages, health, models)
HTTP_DOORS = {"/v1/audio/speech": "http", "/v1/audio/dialogue": "dialogue", "/v1/audio/voices": "voices",
              "/v1/voices": "voices", "/tts/bytes": "cartesia_bytes"}
SOCKET_DOORS = {"/v1/audio/speech/stream": "websocket", "/tts/websocket": "cartesia"}
FIRST_AUDIO_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
RTF_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0)


def door_of(scope: dict) -> str | None:
    path = scope.get("path", "")
    if scope["type"] == "websocket":
        if path.startswith("/v1/text-to-speech/"):
            return "elevenlabs"
        return SOCKET_DOORS.get(path)
    return HTTP_DOORS.get(path.rstrip("/")) or ("voices" if path.startswith("/v1/voices/") else None)


class Metrics:
    """One process's registry: the counters the middleware and the scheduler feed, and the scheduler read at each
    scrape."""

    def __init__(self, scheduler, voices=None, labels: dict | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.scheduler = scheduler
        self.requests = Counter("higgs_requests", "requests of the speech doors by door and status (HTTP: the "
                                "status code; WebSocket doors: accepted or refused)", ["door", "status"],
                                registry=self.registry)
        self.first_audio = Histogram("higgs_time_to_first_audio_seconds", "a finished job's time from its request to "
                                     "its first audio sample", buckets=FIRST_AUDIO_BUCKETS, registry=self.registry)
        self.rtf = Histogram("higgs_real_time_factor", "a finished job's wall time over its audio time (below 1: "
                             "faster than real time)", buckets=RTF_BUCKETS, registry=self.registry)
        self.registry.register(_SchedulerCollector(scheduler, voices))
        scheduler.on_stats = self.observe
        self.labels = labels or {}  # added to every series (a Ray Serve replica's `replica`)
        self.board = None  # ray_serve.MetricsBoard's handle: every replica's families in one scrape

    def observe(self, stats) -> None:
        """A finished job's figures (called from the scheduler's threads; prometheus-client is thread-safe)."""
        self.first_audio.observe(stats.first_audio_s)
        self.rtf.observe(stats.rtf)

    def families(self) -> list:
        """This process's metric families, each sample carrying `labels`."""
        out = list(self.registry.collect())
        if self.labels:
            for family in out:
                family.samples = [s._replace(labels={**s.labels, **self.labels}) for s in family.samples]
        return out

    def render(self) -> bytes:
        if self.board is None:
            return generate_latest(self.registry)
        return render_families(self.board.gather(self.families()))


def render_families(families: list) -> bytes:
    """Families of several processes (same names, different labels) as one exposition: each family once."""
    merged: dict[str, object] = {}
    for family in families:
        if family.name in merged:
            merged[family.name].samples.extend(family.samples)
        else:
            merged[family.name] = family

    class Many:
        def collect(self):
            return merged.values()

    return generate_latest(Many())


class _SchedulerCollector:
    def __init__(self, scheduler, voices=None):
        self.scheduler, self.voices = scheduler, voices

    def describe(self):
        return []

    def collect(self):
        from ..job.finish import aligner_pending

        s = self.scheduler.stats()
        for name, key, what in (("in_flight", "in_flight", "jobs submitted and not ended"),
                                ("queued", "waiting", "jobs waiting for a batch slot"),
                                ("active", "active", "jobs holding a batch slot"),
                                ("kept", "kept", "finished jobs keeping their KV cache for a continuation"),
                                ("slots_in_use", "slots_in_use", "batch slots of the KV pool in use"),
                                ("max_batch", "max_batch", "jobs stepped together (--max-batch)"),
                                ("max_queue", "max_queue", "jobs that may wait (--max-queue)")):
            yield GaugeMetricFamily(f"higgs_{name}", what, value=s[key])
        loaded = int(s["model_state"] == "loaded")
        yield GaugeMetricFamily("higgs_model_loaded", "1 while the model's sessions are loaded, 0 while it is "
                                "unloaded (idle: --idle-unload) or loading again", value=loaded)
        for name, key, what in (("model_unloads", "unloads", "times the idle model was unloaded (--idle-unload)"),
                                ("model_reloads", "reloads", "times a request loaded the unloaded model again")):
            yield CounterMetricFamily(f"higgs_{name}", what, value=s[key])
        if s["reload_s"] is not None:
            yield GaugeMetricFamily("higgs_model_reload_seconds", "how long the last load after an unload took",
                                    value=s["reload_s"])
        yield GaugeMetricFamily("higgs_aligner_pending", "pieces waiting for, or in, the word aligner's process",
                                value=aligner_pending())
        jobs = CounterMetricFamily("higgs_jobs", "jobs by how they ended (rejected: the queue was full, a 429)",
                                   labels=["outcome"])
        for outcome in ("submitted", "finished", "failed", "cancelled", "rejected"):
            jobs.add_metric([outcome], s[outcome])
        yield jobs
        for name, key, what in (("decoder_steps", "decoder_steps", "batched decoder steps"),
                                ("rows", "rows", "code rows generated, all jobs"),
                                ("decode_seconds", "decode_s", "seconds spent in decoder steps"),
                                ("prefill_seconds", "prefill_s", "seconds spent prefilling prompts")):
            yield CounterMetricFamily(f"higgs_{name}", what, value=s[key])
        from ..job.run import take_tally

        counts, redraws = take_tally()
        takes = CounterMetricFamily("higgs_takes", "takes the guard judged, by policy (best_of: takes; redraw: "
                                    "retries) and verdict (good, or what the guard found)",
                                    labels=["policy", "verdict"])
        for (policy, verdict), n in sorted(counts.items()):
            takes.add_metric([policy, verdict], n)
        yield takes
        yield CounterMetricFamily("higgs_redraws", "takes drawn again after a bad one (retries)", value=redraws)
        if self.voices is not None:
            v = self.voices.stats()
            lookups = CounterMetricFamily("higgs_voice_cache_lookups", "voices from reference audio looked up in "
                                          "memory: hit (made before) or miss (encoded now)", labels=["result"])
            lookups.add_metric(["hit"], v["hits"])
            lookups.add_metric(["miss"], v["misses"])
            yield lookups
            yield GaugeMetricFamily("higgs_voice_cache_bytes", "memory held by cached voices", value=v["bytes"])


class RequestCounter:
    """ASGI middleware: each request of a speech door counted by its door and status as it ends (a WebSocket door's
    session when it is accepted or refused)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        door = door_of(scope) if scope["type"] in ("http", "websocket") else None
        if door is None:
            return await self.app(scope, receive, send)
        counted = False

        async def sending(message):
            nonlocal counted
            kind = message["type"]
            if not counted and kind in ("http.response.start", "websocket.accept", "websocket.close",
                                        "websocket.http.response.start"):
                counted = True
                status = (str(message["status"]) if kind.endswith("response.start") else
                          "accepted" if kind == "websocket.accept" else "refused")
                self.metrics.requests.labels(door, status).inc()
            await send(message)

        await self.app(scope, receive, sending)
