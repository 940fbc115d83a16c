"""Corpus synthesis on Ray: JSONL rows in, a folder of audio files and a manifest out, on one machine or a cluster.

    python -m higgs_onnx.corpus --model-path onnx/cpu_int4 --input lines.jsonl --out corpus/ [--workers N]
                                [--batch B] [--address auto|ray://head:10001] [--voices DIR] [--format wav|flac]

Each input line is `{"id": ..., "text": ...}` plus optional `voice` (a voice file, or a name in `--voices`), `seed`,
`temperature`, `top_k`, `top_p`, `max_rows`. Every worker is one long-lived Ray actor holding one loaded `HiggsTTS`
and a slot pool: it decodes up to `--batch` rows per decoder call (continuous batching), so on a CPU, whose decode
step is bound by reading the weights, batching inside a worker beats more workers. Without `--address` a local Ray
instance is started (workers x threads <= cores); with one, the same code joins a cluster, and every node needs the
export folder at the same path (or on a shared filesystem).

Output: `<out>/<id>.wav` (written atomically, following the umask) and `<out>/manifest.jsonl`, one line per row,
in input order: id, file, duration_s, rows, stop_reason, seconds, worker, error (a failed row: id, line, error). A
rerun skips rows whose file and successful manifest line exist, so a killed job finishes only what is missing.

Bad rows are recorded with their one-line error and the job goes on: a row the request contract refuses (each
request is built for the pool's slot of 3,072 positions, so a text too long for it, `max_rows` below the codebook
count or special tokens in the text are refused, never cut to fit), an unknown voice, an empty text, bad options,
a generation that ended without audio, a file that could not be written. A line that is not a JSON object, or whose
id is not a valid file name, has no usable id: it is recorded as `{"id": null, "line": N, "error": ...}` and
tracked by its line number, so it never collides with a real row (whatever that row's id) and every rerun reports
it again. Refused before Ray starts (one line, exit 2): duplicate ids, an input that is not UTF-8 (a BOM is fine;
the message gives the `iconv` command), a `--out` that is a file or cannot be written, a `ray://` address without
Ray Client. Exit code 0 when every row succeeded, 1 when any failed, 2 for a usage error, 130 / 143 when stopped by
Ctrl-C / SIGTERM (handled alike: Ray is shut down first, the rows made so far are kept, a rerun makes the rest).

Ray: a local instance keeps its session files (logs, sockets, spilled objects) in a private folder
`$TMPDIR/higgs-ray-XXXXXXXX` (`/tmp/higgs-ray-...` when `$TMPDIR` is longer than 32 characters: unix socket paths
are limited to 107 bytes), not under /tmp/ray, and removes it when the job ends, after stopping any process of the
instance that `ray.shutdown()` left (e.g. one started while a signal interrupted `ray.init`). With `--log-level
DEBUG` the folder is kept and its path printed. Only a SIGKILL of the driver leaves it behind (Ray's kernel
fate-sharing still ends the processes). `ray://` addresses need Ray Client, which requirements.txt pins
(`ray[data,client]`, it adds grpcio); an install without it gets one line saying so.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .cli import add_log_level, run_main
from .memory import peak_rss

MANIFEST = "manifest.jsonl"
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a plain file name: cannot leave the folder
OPTION_FIELDS = ("seed", "temperature", "top_k", "top_p", "max_rows")
FORMATS = ("wav", "flac")
log = logging.getLogger(__name__)
RAY_TEMP_PREFIX = "higgs-ray-"
# Ray puts its unix sockets at <temp>/session_<date>_<time>_<us>_<pid>/sockets/plasma_store (~65 bytes after
# <temp>), and a socket path has at most 107 bytes: a longer $TMPDIR falls back to /tmp.
MAX_RAY_TEMP_BASE = 32


def line_key(line: int) -> str:
    """The key of a line without a usable id: has a space, so no row id (ID_PATTERN) can equal it."""
    return f"line {line}"


def entry_key(entry: dict) -> str | None:
    """The key of a manifest entry: its id, or its line for a line recorded without one (None: unusable)."""
    if entry.get("id") is not None:
        return str(entry["id"])
    line = entry.get("line")
    return line_key(line) if isinstance(line, int) and not isinstance(line, bool) else None


@dataclass(frozen=True)
class Row:
    id: str | None  # None: a line without a usable id (malformed JSON, a bad id), known by its line number
    line: int
    text: str | None = None
    voice: str | None = None
    options: dict | None = None
    error: str | None = None  # set for a row that cannot run (recorded, not generated)

    @property
    def key(self) -> str:
        return self.id if self.id is not None else line_key(self.line)


def read_input(path: Path) -> str:
    """The input file's text: UTF-8 (a BOM is dropped); another encoding, a binary or empty file is one line."""
    from .longform.render import read_text_file

    if path.is_dir():
        raise IsADirectoryError(f"--input {path} is a folder, not a JSONL file")
    if not path.is_file():
        raise FileNotFoundError(f"--input {path} does not exist")
    try:
        return read_text_file(path)
    except ValueError as e:
        raise ValueError(f"--input {e}") from None


def row_id(value) -> str | None:
    """A row's id as its file name (a string, or a whole number >= 0), or None when it cannot be one."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        value = str(value)
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value if ID_PATTERN.match(value) else None


def read_rows(path: Path) -> list[Row]:
    """Every non-blank line as a Row; a malformed one becomes a Row with its error. Duplicate ids are refused."""
    from .generation.options import GenerationOptions

    rows, seen = [], {}
    # lines end at "\n" only: str.splitlines would also split inside a JSON string at U+2028, U+0085, ...
    for n, line in enumerate(read_input(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError(f"not a JSON object but {type(obj).__name__}")
        except ValueError as e:
            rows.append(Row(id=None, line=n, error=f"malformed JSON on line {n}: {e}"))
            continue
        rid = row_id(obj.get("id"))
        if rid is None:
            rows.append(Row(id=None, line=n, error=f"line {n}: id {obj.get('id')!r} must be 1-128 letters, "
                                                   f"digits, '.', '_' or '-' (it names the output file)"))
            continue
        if rid in seen:
            raise ValueError(f"duplicate id {rid!r} on lines {seen[rid]} and {n}: ids name the output files")
        seen[rid] = n
        text, voice = obj.get("text"), obj.get("voice")
        options = {k: obj[k] for k in OPTION_FIELDS if k in obj}
        unknown = set(obj) - {"id", "text", "voice", *OPTION_FIELDS}
        error = None
        if text is not None and not isinstance(text, str):
            error = f"text must be a string, got {type(text).__name__} {text!r:.40}"
        elif not isinstance(text, str) or not text.strip():
            error = "empty or missing text"
        elif unknown:
            error = f"unknown field(s) {', '.join(sorted(unknown))}"
        elif voice is not None and (not isinstance(voice, str) or not voice.strip()):
            error = f"voice {voice!r} must be a voice file or a name in --voices"
        else:
            try:
                GenerationOptions.make(None, **options)
            except (ValueError, TypeError) as e:
                error = str(e)
        rows.append(Row(id=rid, line=n, text=text, voice=voice, options=options, error=error))
    return rows


def read_manifest(out: Path) -> dict[str, dict]:
    """The last entry per row key of an earlier run (a line cut by a kill, or not an entry, is skipped)."""
    done = {}
    path = out / MANIFEST
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").split("\n"):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            key = entry_key(entry) if isinstance(entry, dict) else None
            if key is not None:
                done[key] = entry
    return done


def os_reason(e: OSError) -> str:
    """An OSError as words: its strerror ("No space left on device"), or its own message, never the errno text."""
    return e.strerror if e.strerror else str(e) or type(e).__name__


class RowWriteError(OSError):
    """A row's file could not be written (the message is the one line for its manifest entry)."""


class Worker:
    """A Ray actor: one loaded model, one slot pool; `run(rows)` generates a list of rows with continuous batching."""

    def __init__(self, model_path: str, out: str, batch: int, threads: int, voices: str | None, fmt: str):
        import socket

        from .runtime.model import HiggsTTS

        self.tts = HiggsTTS(model_path, threads=threads, verify=False)
        self.out, self.batch, self.voices, self.fmt = Path(out), batch, voices, fmt
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._voice_cache: dict[str, object] = {}

    def _voice(self, ref):
        from .runtime.model import Voice

        if ref is None:
            return None
        if ref not in self._voice_cache:
            path = Path(ref)
            if not path.suffix and self.voices and ID_PATTERN.match(str(ref)):
                path = Path(self.voices) / f"{ref}.npz"
            if not path.is_file():
                raise ValueError(f"unknown voice {ref!r} (a voice file, or a name in --voices)")
            self._voice_cache[ref] = Voice.load(path, self.tts.model_id)
        return self._voice_cache[ref]

    def failure(self, row: dict, e: BaseException) -> dict:
        """A failed row's manifest entry: one line saying what went wrong."""
        if isinstance(e, (ValueError, RowWriteError)):  # the request contract, an unknown voice: already one line
            message = str(e)
        elif isinstance(e, OSError):
            message = f"{type(e).__name__}: {os_reason(e)}{f' ({e.filename})' if e.filename else ''}"
        else:
            message = f"{type(e).__name__}: {e}"
        return {"id": row["id"], "error": message, "worker": self.name}

    def finish(self, row: dict, req, t0: float) -> dict:
        """A generated row -> its file and manifest entry; a generation without one audio frame is a failure."""
        from .audio import write_audio
        from .generation.contract import NoAudioError

        tts = self.tts
        if req.n < tts.facts.num_codebooks:  # frames = rows - N + 1
            raise NoAudioError(f"the generation ended after {req.n} rows ({req.stop_reason}) without one audio "
                               f"frame")
        wav = tts.decode_rows(req.generated)
        if not wav.size:
            raise NoAudioError(f"the generation ended after {req.n} rows ({req.stop_reason}) without audio")
        path = self.out / f"{row['id']}.{self.fmt}"
        try:
            write_audio(path, wav, tts.facts.sample_rate)
        except OSError as e:
            # write_audio's own messages name the path; an OS error is its words ("No space left on device")
            raise RowWriteError(f"cannot write {path}: {e.strerror}" if e.strerror else str(e)) from None
        return {"id": row["id"], "file": path.name, "duration_s": wav.size / tts.facts.sample_rate, "rows": req.n,
                "stop_reason": req.stop_reason, "seconds": time.perf_counter() - t0, "worker": self.name,
                "worker_peak_rss_mb": peak_rss() / 2**20, "error": None}

    def run(self, rows: list[dict]) -> list[dict]:
        from .generation.engine import Engine
        from .generation.options import POOL_POSITIONS, GenerationOptions

        tts, results, waiting = self.tts, [], list(rows)
        engine = Engine(tts.backend, tts.backend.pool(self.batch, min(tts.facts.max_positions, POOL_POSITIONS)))
        active = []  # (row, request, started)

        while waiting or active:
            while waiting and len(active) < self.batch:
                row = waiting.pop(0)
                t0, req = time.perf_counter(), None
                try:  # built for this pool's slot: a request that does not fit is refused (the contract), not cut
                    req = tts.request(row["text"], voice=self._voice(row["voice"]),
                                      options=GenerationOptions.make(None, **row["options"]),
                                      slot=engine.pool.capacity)
                    engine.start(req)
                except Exception as e:  # noqa: BLE001 - the row is recorded as failed, the others go on
                    if req is not None:
                        req.release()
                    results.append(self.failure(row, e))
                    continue
                active.append((row, req, t0))
            if not active:
                break
            try:
                engine.step([r for _, r, _ in active])
            except Exception as e:  # noqa: BLE001 - a failed decoder step fails its batch; the rest goes on
                for row, req, _ in active:
                    req.release()
                    results.append(self.failure(row, e))
                active.clear()
                continue
            for item in [a for a in active if a[1].done]:
                active.remove(item)
                row, req, t0 = item
                try:
                    results.append(self.finish(row, req, t0))
                except Exception as e:  # noqa: BLE001
                    results.append(self.failure(row, e))
        return results


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m higgs_onnx.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, required=True, help="an onnx/<device>_<precision> export")
    ap.add_argument("--input", type=Path, required=True, help="JSONL (UTF-8), one {\"id\", \"text\", ...} per line")
    ap.add_argument("--out", type=Path, required=True, help="output folder (created; reruns resume it)")
    ap.add_argument("--workers", type=int, default=1, help="Ray actors, each with the model loaded (default 1)")
    ap.add_argument("--batch", type=int, default=4, help="rows per decoder call inside a worker (default 4)")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads per worker (default: cores / "
                    "workers on a local instance)")
    ap.add_argument("--address", help="join a running Ray cluster ('auto', HEAD:6379, or ray://head:10001 with "
                    "ray[client]); default: start a local instance")
    ap.add_argument("--voices", type=Path, help="folder of named voices (<name>.npz from --save-voice)")
    ap.add_argument("--format", choices=FORMATS, default="wav")
    add_log_level(ap)
    return ap


def check_address(address: str | None) -> None:
    """A `ray://` address needs Ray Client (grpcio): pinned here, but a hand-made install may lack it."""
    import importlib.metadata
    import importlib.util

    if address is None:
        return
    if not address.strip():
        raise ValueError("--address is empty: give 'auto', HEAD:6379 or ray://HEAD:10001, or leave it out to start "
                         "a local instance")
    if address.startswith("ray://") and importlib.util.find_spec("grpc") is None:
        try:
            version = importlib.metadata.version("ray")
        except importlib.metadata.PackageNotFoundError:
            version = "2.60.0"
        raise ValueError(f"--address {address} needs Ray Client, which is not installed: pip install "
                         f"\"ray[client]=={version}\" (or join the cluster with --address auto / HEAD:6379 from a "
                         f"node of it)")


def check_out(out: Path) -> None:
    from .outputs import check_output_dir

    check_output_dir(out, "--out")
    manifest = out / MANIFEST
    if manifest.exists() and not manifest.is_file():
        raise ValueError(f"--out {out}: {manifest} is not a file; remove it or choose another folder")


def run(args: argparse.Namespace) -> int:
    from .manifest import load_manifest

    if args.workers < 1 or args.batch < 1 or args.threads < 0:
        raise ValueError("--workers and --batch must be >= 1, --threads >= 0")
    check_address(args.address)
    load_manifest(args.model_path, verify=False)  # a missing or broken export: one line, before Ray starts
    rows = read_rows(args.input)
    if not rows:
        raise ValueError(f"{args.input} has no rows")
    check_out(args.out)  # a file, an unwritable place: one line, before Ray starts
    done = read_manifest(args.out)
    ok = {k for k, e in done.items() if e.get("error") is None and e.get("file") and
          (args.out / str(e["file"])).is_file()}
    todo = [r for r in rows if r.key not in ok]
    bad = [r for r in todo if r.error is not None]
    todo = [r for r in todo if r.error is None]
    print(f"{len(rows)} rows: {len(ok)} done before, {len(todo)} to make, {len(bad)} bad", file=sys.stderr)

    lines = {r.key: r.line for r in rows}
    with (args.out / MANIFEST).open("a", encoding="utf-8") as journal:
        def record(entry: dict) -> None:
            if entry.get("error") is not None and "line" not in entry:  # a failed row says where it is
                entry = {"id": entry["id"], "line": lines.get(entry_key(entry)), **entry}
            journal.write(json.dumps(entry) + "\n")
            journal.flush()
            done[entry_key(entry)] = entry

        for r in bad:
            record({"id": r.id, "line": r.line, "error": r.error})
        if todo:
            stop = StopSignal()
            try:
                generate_all(args, todo, record, stop)
            except (KeyboardInterrupt, SystemExit) as e:
                if isinstance(e, SystemExit):  # Ray's own SIGTERM handler, while ray.init runs
                    if e.code != signal.SIGTERM:
                        raise
                    stop.signum = signal.SIGTERM
                name = "SIGTERM" if stop.signum == signal.SIGTERM else "Ctrl-C"
                print(f"stopped by {name}; Ray is shut down. The rows made so far are in {args.out / MANIFEST}: "
                      f"rerun the same command to make the rest", file=sys.stderr)
                return 128 + (stop.signum or signal.SIGINT)
    compact(args.out, rows, done)
    failed = [r.key for r in rows if done.get(r.key, {}).get("error") is not None or r.key not in done]
    hours = sum(done[r.key].get("duration_s", 0.0) for r in rows
                if r.key in done and done[r.key].get("error") is None) / 3600
    print(f"{args.out}: {len(rows) - len(failed)} of {len(rows)} rows made ({hours * 60:.1f} min of audio); "
          f"{len(failed)} failed{': ' + ', '.join(failed[:5]) if failed else ''}"
          f"{' ...' if len(failed) > 5 else ''} (see {MANIFEST})")
    return 1 if failed else 0


class StopSignal:
    """SIGTERM handled like Ctrl-C (a KeyboardInterrupt), so `ray.shutdown()` runs and stops the local instance.

    `install` before and again after `ray.init`, which sets SIGTERM handlers of its own (a SIGTERM while it runs is
    Ray's SystemExit(15), which the same `finally` handles). `shield` while shutting down: a second signal is noted,
    not raised, so the shutdown is not cut short. `signum` says which signal stopped the job."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @staticmethod
    def _main_thread() -> bool:  # signals reach the main thread only; run() in a thread leaves them alone
        return threading.current_thread() is threading.main_thread()

    def _raise(self, signum, frame):
        self.signum = signum
        raise KeyboardInterrupt

    def _note(self, signum, frame):
        self.signum = self.signum or signum

    def install(self) -> None:
        if self._main_thread():
            self._previous.setdefault(signal.SIGTERM, signal.getsignal(signal.SIGTERM))
            signal.signal(signal.SIGTERM, self._raise)

    def shield(self) -> None:
        if self._main_thread():
            for sig in self.SIGNALS:
                self._previous.setdefault(sig, signal.getsignal(sig))
                if signal.getsignal(sig) is not signal.SIG_IGN:  # an ignored Ctrl-C (nohup, `&`) stays ignored
                    signal.signal(sig, self._note)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


def ray_temp_dir() -> str:
    """A private, short folder for a local Ray instance's session files (see the module docstring)."""
    base = tempfile.gettempdir()
    if len(base) > MAX_RAY_TEMP_BASE:
        base = "/tmp"
    return tempfile.mkdtemp(prefix=RAY_TEMP_PREFIX, dir=base)


def processes_using(folder: str) -> list[int]:
    """Pids of processes (other than this one) that name `folder` in their command line, run in it or have a file
    open in it (Linux /proc; elsewhere none)."""
    if not os.path.isdir("/proc"):
        return []
    folder = os.path.realpath(folder)
    inside, pids = folder.rstrip("/") + "/", []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if folder.encode() in f.read():
                    pids.append(int(name))
                    continue
            links = [os.readlink(f"/proc/{name}/cwd")]
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:  # gone, or not ours
            continue
        for fd in fds:
            try:
                links.append(os.readlink(f"/proc/{name}/fd/{fd}"))
            except OSError:  # this file was closed meanwhile: the process is still scanned
                continue
        if any(link == folder or link.startswith(inside) for link in links):
            pids.append(int(name))
    return pids


def stop_leftovers(folder: str, grace_s: float = 3.0, rounds: int = 4) -> list[int]:
    """Stop what is left of a local instance after `ray.shutdown()`: processes it did not know yet (a signal during
    `ray.init`) or orphaned agents, found through its private `folder`. SIGTERM, then SIGKILL after `grace_s`;
    scanned again until nothing is left (a dying raylet may just have started a worker). Returns the pids found."""
    found: list[int] = []
    for _ in range(rounds):
        pids = [p for p in processes_using(folder) if _alive(p)]
        if not pids:
            break
        log.info("stopping %d Ray process(es) left after ray.shutdown: %s", len(pids), pids)
        found += pids
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [p for p in pids if _alive(p)]
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 1.0  # SIGKILL is not instant: let them go before looking again
        while pids and time.monotonic() < deadline:
            time.sleep(0.02)
            pids = [p for p in pids if _alive(p)]
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:  # gone meanwhile
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"  # a zombie is gone for our purposes
    except OSError:
        return False


def generate_all(args, todo: list[Row], record, stop: StopSignal | None = None) -> None:
    import shutil

    import ray
    from tqdm import tqdm

    stop = stop or StopSignal()
    stop.install()
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // args.workers)
    temp = None if args.address else ray_temp_dir()
    keep_temp = getattr(args, "log_level", "WARNING") == "DEBUG"
    try:
        if args.address:
            ray.init(address=args.address, log_to_driver=False)
        else:  # "local": a new instance even when RAY_ADDRESS is set
            ray.init(address="local", num_cpus=max(cores, args.workers * threads), include_dashboard=False,
                     log_to_driver=False, _temp_dir=temp)
        stop.install()
        actor = ray.remote(num_cpus=threads if not args.address else 1)(Worker)
        workers = [actor.remote(str(args.model_path.resolve()), str(args.out.resolve()), args.batch, threads,
                                str(args.voices.resolve()) if args.voices else None, args.format)
                   for _ in range(args.workers)]
        units = [todo[i:i + args.batch] for i in range(0, len(todo), args.batch)]
        payload = [[{"id": r.id, "text": r.text, "voice": r.voice, "options": r.options} for r in u] for u in units]
        t0, made, audio = time.perf_counter(), 0, 0.0
        bar = tqdm(total=len(todo), unit="row", file=sys.stderr, disable=not sys.stderr.isatty())
        pending = {}
        for w in workers:  # one unit per worker at a time: the next goes to whichever finishes first
            if payload:
                pending[w.run.remote(payload.pop(0))] = w
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            w = pending.pop(ready[0])
            for entry in ray.get(ready[0]):
                record(entry)
                made += 1
                audio += entry.get("duration_s", 0.0)
            if payload:
                pending[w.run.remote(payload.pop(0))] = w
            rate = made / (time.perf_counter() - t0)
            eta = (len(todo) - made) / rate if rate else 0.0
            bar.update(made - bar.n)
            bar.set_postfix_str(f"{audio / 3600:.3f} h audio, {rate:.2f} rows/s, ETA {eta:.0f} s")
            if not bar.disable:
                continue
            print(f"{made}/{len(todo)} rows, {audio / 3600:.3f} h of audio, {rate:.2f} rows/s, ETA {eta:.0f} s",
                  file=sys.stderr)
        bar.close()
    finally:
        stop.shield()
        try:
            ray.shutdown()
            if temp is not None:
                stop_leftovers(temp)
                if keep_temp:
                    print(f"Ray's session files are kept in {temp}", file=sys.stderr)
                else:
                    shutil.rmtree(temp, ignore_errors=True)
        finally:
            stop.restore()


def compact(out: Path, rows: list[Row], done: dict[str, dict]) -> None:
    """Rewrite the manifest atomically: one line per row, in input order."""
    tmp = out / (MANIFEST + ".partial")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rows:
            if r.key in done:
                f.write(json.dumps(done[r.key]) + "\n")
    os.replace(tmp, out / MANIFEST)


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
