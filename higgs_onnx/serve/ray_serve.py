"""The speech server on Ray Serve: `python -m higgs_onnx.serve --ray [--address ADDR] --replicas N [--max-replicas M]`.

The same app as the plain server (every route: speech, SSE, voices, dialogue, the page, the WebSocket doors) runs in
each replica of one Ray Serve deployment (`HiggsSpeech`); each replica loads the model once and runs its own
scheduler (`serve.launch.load`). Ray Serve's HTTP proxy listens on --host/--port and routes each request to a
replica (the less busy of two, by ongoing requests); docs/server.md, "Scaling", is the user's page.

- **Admission.** A replica takes `max_batch + max_queue + LIGHT_REQUESTS` requests at once (the light ones: health,
  voice lists, sockets waiting for text); its own scheduler answers 429 with `Retry-After` when its queue is full,
  as the plain server does. Ray's router holds up to `max_queue + LIGHT_REQUESTS` requests per proxy that no replica
  has taken yet and refuses the rest with 429 and `Retry-After` (its `BackpressureConfig`; the proxy middleware
  gives it our JSON body). That queue also holds requests while the router waits for the replicas' queue lengths,
  which a replica busy on every core answers late: at `max_queue` alone (2 in a test) a health check or a scrape
  beside two requests was refused while both replicas had room.
- **Autoscaling.** `--max-replicas M` (> N) scales between N and M on ongoing requests per replica (target:
  --max-batch), up after `UPSCALE_DELAY_S` of load, down after `DOWNSCALE_DELAY_S` of quiet.
- **Shared state.** Saved voices live in one folder every replica reads and writes (`--voices`, default the
  export's `voices/`): on one machine a local folder, across machines shared storage at the same path (a voice is a
  few files written atomically, `serve.voices`); Ray's object store would lose them with the cluster. The API key
  and every flag reach the replicas as the deployment's arguments.
- **Faults.** A replica whose model fails to load never becomes RUNNING, so it takes no traffic (the command exits
  with the replica's error when none comes up); `check_health` fails when its scheduler's thread has died, and
  Ray Serve replaces it. A replica killed mid-request: the proxy middleware (`ray_proxy`) answers what it held.
- **Metrics.** Each replica's series carry `replica="<id>"`; each replica pushes its families to one small actor
  (`MetricsBoard`) every `PUSH_S`, and a scrape answered by any replica returns every live replica's: a replica
  whose actor is gone (killed, or stopped by Ray Serve) leaves the next scrape, looked up by its actor's name; one
  silent for STALE_S leaves it too. Ray's own metrics (serve_*, per replica and proxy) are on each node's Ray
  metrics port.
- **Stopping.** SIGTERM / Ctrl-C deletes the application: the replicas finish what they hold (at most DRAIN_S)
  while Ray's proxy answers every new request with our JSON 503 `no_replica` (`ray_proxy`: Ray's own answer would
  be a plain 404); then a local Ray instance is shut down whole (its proxy, and so the port, with it). Serve's own
  `serve.shutdown()` is not called: its controller call never returns by design and ends as a dead worker's error
  in Ray's logs, which a clean stop must not write.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import ray
from ray import serve

from .launch import load, voices_of
from .scheduler import idle_note

log = logging.getLogger("higgs_onnx.serve.ray")
APP = "higgs"
DEPLOYMENT = "HiggsSpeech"
NAMESPACE = "higgs-onnx"
BOARD = "higgs-metrics-board"
PROXY_CALLBACK = "higgs_onnx.serve.ray_proxy:middlewares"
LIGHT_REQUESTS = 32  # beside the jobs: health checks, voice lists, WebSocket sessions waiting for text
PUSH_S = 1.0  # a replica's metrics reach the board this often
STALE_S = 10.0  # a replica silent this long is gone from the scrape
UPSCALE_DELAY_S = 3.0
DOWNSCALE_DELAY_S = 60.0
HEALTH_PERIOD_S = 2.0
DRAIN_S = 10.0  # a stopping replica finishes its requests for at most this long; then they end as documented
REPO = str(Path(__file__).resolve().parents[2])


@ray.remote(num_cpus=0)
class MetricsBoard:
    """Every live replica's latest metric families (prometheus-client's `Metric` objects), by replica. `actor`: the
    replica's Ray actor (name, namespace), looked up at each scrape: a dead actor's name is gone from Ray's registry
    at once, so a killed replica's series leave the next scrape, not STALE_S later."""

    def __init__(self):
        self.seen: dict[str, tuple[float, list, tuple[str, str] | None]] = {}

    def put(self, name: str, families: list, actor: tuple[str, str] | None = None) -> None:
        self.seen[name] = (time.monotonic(), families, actor)

    def gather(self, name: str, families: list, actor: tuple[str, str] | None = None) -> list:
        self.put(name, families, actor)
        now = time.monotonic()
        self.seen = {k: v for k, v in self.seen.items() if now - v[0] < STALE_S and (k == name or alive(v[2]))}
        return [f for _, fams, _ in self.seen.values() for f in fams]


def alive(actor: tuple[str, str] | None) -> bool:
    """Whether a replica's named actor is still registered (None: not known, counted alive until STALE_S)."""
    if actor is None:
        return True
    try:
        ray.get_actor(actor[0], namespace=actor[1])
    except ValueError:  # no such actor: it died (a replica is never restarted under its name)
        return False
    return True


class Board:
    """A replica's side of the board: `gather(mine)` every live replica's families (its own alone when the board
    cannot be reached, logged)."""

    def __init__(self, name: str):
        self.name = name
        from ray.serve._private.constants import SERVE_NAMESPACE  # Serve's actors' namespace (ray is pinned)

        actor = ray.get_runtime_context().get_actor_name()  # the replica's actor, registered under this name
        self.me = (actor, SERVE_NAMESPACE) if actor else None
        self.actor = MetricsBoard.options(name=BOARD, namespace=NAMESPACE, get_if_exists=True,
                                          lifetime="detached").remote()

    def put(self, families: list) -> None:
        self.actor.put.remote(self.name, families, self.me)

    def gather(self, families: list) -> list:
        try:
            return ray.get(self.actor.gather.remote(self.name, families, self.me), timeout=5)
        except Exception as e:  # noqa: BLE001 - the scrape still answers, with this replica's series
            log.warning("the metrics board is unreachable (%s); this replica's metrics only", e)
            return families


@serve.ingress()
class HiggsSpeech:
    """One replica: the model, its scheduler and the app (`serve.launch.load`)."""

    def __init__(self, args: argparse.Namespace):
        self.name = serve.get_replica_context().replica_id.unique_id
        self.built, tts, _ = load(args, {"replica": self.name})  # (`app` is Ray's: the wrapper's property)
        self.scheduler = self.built.state.scheduler
        self.metrics = self.built.state.metrics
        self.metrics.board = Board(self.name)
        threading.Thread(target=self.push, name="higgs-metrics-push", daemon=True).start()
        log.info("replica %s: %s loaded (pid %d)", self.name, Path(tts.manifest.folder).name, os.getpid())

    def __serve_build_asgi_app__(self):
        return self.built

    def push(self) -> None:
        while True:
            time.sleep(PUSH_S)
            try:
                self.metrics.board.put(self.metrics.families())
            except Exception as e:  # noqa: BLE001 - the next push tries again
                log.debug("metrics push: %s", e)

    def check_health(self) -> None:
        """Ray Serve's health check: the scheduler's loop must run (a replica whose loop died is replaced)."""
        if not self.scheduler.alive:
            raise RuntimeError("the scheduler's loop has stopped")


def deployment(args: argparse.Namespace):
    """The bound application: replicas, autoscaling, admission and health of `HiggsSpeech`."""
    from ray.serve.config import BackpressureConfig

    threads = args.threads or 1
    options = {"max_ongoing_requests": args.max_batch + args.max_queue + LIGHT_REQUESTS,
               "max_queued_requests": args.max_queue + LIGHT_REQUESTS,
               "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=1),
               "ray_actor_options": {"num_cpus": threads},
               "health_check_period_s": HEALTH_PERIOD_S, "health_check_timeout_s": 30.0,
               "graceful_shutdown_wait_loop_s": 0.5, "graceful_shutdown_timeout_s": DRAIN_S}
    if args.max_replicas is not None and args.max_replicas > args.replicas:
        options["autoscaling_config"] = {"min_replicas": args.replicas, "initial_replicas": args.replicas,
                                         "max_replicas": args.max_replicas,
                                         "target_ongoing_requests": args.max_batch,
                                         "upscale_delay_s": UPSCALE_DELAY_S, "downscale_delay_s": DOWNSCALE_DELAY_S,
                                         "metrics_interval_s": 1.0, "look_back_period_s": 3.0}
    else:
        options["num_replicas"] = args.replicas
    replica_args = argparse.Namespace(**{**vars(args), "threads": threads,
                                         "model_path": args.model_path.resolve(),
                                         "voices": voices_of(args).resolve()})
    return serve.deployment(HiggsSpeech, name=DEPLOYMENT).options(**options).bind(replica_args)


def start_ray(args: argparse.Namespace, temp: str | None) -> None:
    """Join --address, or start a local instance whose processes find this package and whose proxy runs our
    middleware (`ray_proxy`; a cluster started by hand needs the same variable, docs/server.md)."""
    os.environ["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] = PROXY_CALLBACK
    path = os.environ.get("PYTHONPATH", "")
    if REPO not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, path) if p)
    if args.address is not None:  # checked (its form, a TCP answer) by serve's check_args: ray_local.check_address
        try:
            ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
        except ConnectionError as e:
            raise ValueError(f"--address {args.address}: {str(e).splitlines()[0]}") from None
        return
    cores = os.cpu_count() or 1
    need = (args.max_replicas or args.replicas) * (args.threads or 1)
    if need > cores:
        print(f"warning: {need} replica threads on {cores} cores: the replicas share cores", file=sys.stderr)
    ray.init(address="local", namespace=NAMESPACE, num_cpus=max(cores, need), include_dashboard=False,
             log_to_driver=args.log_level.upper() in ("DEBUG", "INFO"), _temp_dir=temp,
             logging_level=logging.WARNING)


def serve_on_ray(args: argparse.Namespace) -> int:
    """Deploy, print the banner once the replicas serve, and run until Ctrl-C / SIGTERM (then the app is deleted,
    and a local Ray instance stopped)."""
    import shutil

    from ..ray_local import StopSignal, ray_temp_dir, stop_leftovers

    port = args.port  # checked free (and chosen for --port 0) by serve.__main__
    temp = None if args.address else ray_temp_dir()
    stop = StopSignal()
    stop.install()
    deployed, failure = False, None
    if args.log_level.upper() not in ("DEBUG", "INFO"):
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # "Deleting app ...": Ray's, not the user's
    try:
        start_ray(args, temp)
        stop.check()
        stop.install()  # after ray.init, which sets handlers of its own
        serve.start(http_options={"host": args.host, "port": port})
        deployed = True
        try:
            serve.run(deployment(args), name=APP, route_prefix="/")
        except RuntimeError as e:  # every replica failed to start: its error, once (after Ray's cleanup lines)
            failure = f"error: no replica came up: {replica_error(e)}"
            return 1
        shown = f"[{args.host}]" if ":" in args.host else args.host
        scale = (f"{args.replicas}..{args.max_replicas} replicas (autoscaling)"
                 if args.max_replicas and args.max_replicas > args.replicas else f"{args.replicas} replica(s)")
        print(f"higgs-onnx speech server on Ray Serve: http://{shown}:{port}/ ({scale}, {args.threads or 1} "
              f"thread(s) each, model {args.model_path.name}, batch {args.max_batch}, queue {args.max_queue}, "
              f"voices in {voices_of(args)}{idle_note(args.idle_unload)}"
              f"{', API key required' if args.api_key else ''}; Ray {args.address or 'local'})", flush=True)
        while True:
            time.sleep(1.0)
    except (KeyboardInterrupt, SystemExit) as e:
        if isinstance(e, SystemExit) and e.code not in (None, 0, signal.SIGTERM):
            raise
        print(f"stopping: the replicas finish what they hold (at most {DRAIN_S:g} s; then it ends as docs/server.md "
              f"says), then Ray Serve stops", file=sys.stderr)
    finally:
        stop.shield()
        try:
            if ray.is_initialized() and deployed:  # never a Ray started just to be stopped
                try:  # the replicas drain while the proxies answer new requests with 503 no_replica (ray_proxy)
                    serve.delete(APP)
                except Exception as e:  # noqa: BLE001 - Ray already gone: nothing to stop
                    log.info("serve delete: %s", e)
            ray.shutdown()  # a local instance stops whole, its proxy (the port) with it; a cluster keeps its own
            if temp is not None:
                stop_leftovers(temp)
                shutil.rmtree(temp, ignore_errors=True)
        finally:
            stop.restore()
            if failure:
                print(failure, file=sys.stderr)
    return 0


def replica_error(e: BaseException) -> str:
    """Why the replicas failed to start: the last exception line of the deployment's status (the replica's own
    error, e.g. a model file that fails its checksum), else Ray's message."""
    text = str(e)
    try:
        for dep in serve.status().applications[APP].deployments.values():
            text = dep.message or text
    except Exception as err:  # noqa: BLE001 - Ray's own message then
        log.debug("serve.status: %s", err)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.split(":", 1)[0].endswith(("Error", "Exception")) and ":" in ln:
            return ln
    return lines[0] if lines else type(e).__name__
