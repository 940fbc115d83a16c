"""Corpus synthesis on Ray: JSONL rows in, a folder of audio files and a manifest out, on one machine or a cluster.

    python -m higgs_onnx.corpus --model-path onnx/cpu_int4 --input lines.jsonl --out corpus/ [--workers N]
                                [--batch B] [--address auto|ray://head:10001] [--voices DIR] [--format wav|flac]

Each input line is `{"id": ..., "text": ...}` plus optional `voice` (a voice file, or a name in `--voices`), `seed`,
`temperature`, `top_k`, `top_p`, `max_rows`. Every worker is one long-lived Ray actor holding one loaded `HiggsTTS`
and a slot pool: it decodes up to `--batch` rows per decoder call (continuous batching), so on a CPU, whose decode
step is bound by reading the weights, batching inside a worker beats more workers. Without `--address` a local Ray
instance is started (workers x threads <= cores); with one, the same code joins a cluster, and every node needs the
export folder at the same path (or on a shared filesystem).

Output: `<out>/<id>.wav` (written atomically) and `<out>/manifest.jsonl`, one line per row: id, file, duration_s,
rows, stop_reason, seconds, worker, error. A rerun skips rows whose file and successful manifest line exist, so a
killed job finishes only what is missing; bad rows (malformed JSON, empty text, unknown voice, a failing row) are
recorded with their error and the job goes on; duplicate ids are refused before anything starts. Exit code 0 when
every row succeeded, 1 when any failed, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .cli import add_log_level, run_main
from .memory import peak_rss

MANIFEST = "manifest.jsonl"
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a plain file name: cannot leave the folder
OPTION_FIELDS = ("seed", "temperature", "top_k", "top_p", "max_rows")
FORMATS = ("wav", "flac")


@dataclass(frozen=True)
class Row:
    id: str
    line: int
    text: str | None = None
    voice: str | None = None
    options: dict | None = None
    error: str | None = None  # set for a row that cannot run (recorded, not generated)


def read_rows(path: Path) -> list[Row]:
    """Every non-blank line as a Row; a malformed one becomes a Row with its error. Duplicate ids are refused."""
    if not path.is_file():
        raise FileNotFoundError(f"--input {path} does not exist")
    rows, seen = [], {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            rows.append(Row(id=f"line-{n}", line=n, error=f"malformed JSON on line {n}: {e}"))
            continue
        rid = str(obj.get("id", "")).strip()
        if not ID_PATTERN.match(rid):
            rows.append(Row(id=f"line-{n}", line=n, error=f"line {n}: id {obj.get('id')!r} must be 1-128 letters, "
                                                         f"digits, '.', '_' or '-' (it names the output file)"))
            continue
        if rid in seen:
            raise ValueError(f"duplicate id {rid!r} on lines {seen[rid]} and {n}: ids name the output files")
        seen[rid] = n
        text = obj.get("text")
        unknown = set(obj) - {"id", "text", "voice", *OPTION_FIELDS}
        error = None
        if not isinstance(text, str) or not text.strip():
            error = "empty or missing text"
        elif unknown:
            error = f"unknown field(s) {', '.join(sorted(unknown))}"
        rows.append(Row(id=rid, line=n, text=text, voice=obj.get("voice"),
                        options={k: obj[k] for k in OPTION_FIELDS if k in obj}, error=error))
    return rows


def read_manifest(out: Path) -> dict[str, dict]:
    """The last entry per id of an earlier run (a line cut by a kill is skipped)."""
    done = {}
    path = out / MANIFEST
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
                done[entry["id"]] = entry
            except (ValueError, KeyError, TypeError):
                continue
    return done


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

    def run(self, rows: list[dict]) -> list[dict]:
        from .audio import write_audio
        from .generation.engine import Engine
        from .generation.options import POOL_POSITIONS, GenerationOptions

        tts, results, waiting = self.tts, [], list(rows)
        engine = Engine(tts.backend, tts.backend.pool(self.batch, min(tts.facts.max_positions, POOL_POSITIONS)))
        active = []  # (row, request, started)

        def fail(row, e):
            results.append({"id": row["id"], "error": f"{type(e).__name__}: {e}" if not isinstance(e, ValueError)
                            else str(e), "worker": self.name})

        while waiting or active:
            while waiting and len(active) < self.batch:
                row = waiting.pop(0)
                t0 = time.perf_counter()
                try:
                    req = tts.request(row["text"], voice=self._voice(row["voice"]),
                                      options=GenerationOptions.make(None, **row["options"]))
                    engine.start(req)
                except Exception as e:  # noqa: BLE001 - the row is recorded as failed, the others go on
                    fail(row, e)
                    continue
                active.append((row, req, t0))
            if not active:
                break
            engine.step([r for _, r, _ in active])
            for item in [a for a in active if a[1].done]:
                active.remove(item)
                row, req, t0 = item
                try:
                    wav = tts.decode_rows(req.generated)
                    path = write_audio(self.out / f"{row['id']}.{self.fmt}", wav, tts.facts.sample_rate)
                    results.append({"id": row["id"], "file": path.name, "duration_s": wav.size / tts.facts.sample_rate,
                                    "rows": req.n, "stop_reason": req.stop_reason,
                                    "seconds": time.perf_counter() - t0, "worker": self.name,
                                    "worker_peak_rss_mb": peak_rss() / 2**20, "error": None})
                except Exception as e:  # noqa: BLE001
                    fail(row, e)
        return results


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m higgs_onnx.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, required=True, help="an onnx/<device>_<precision> export")
    ap.add_argument("--input", type=Path, required=True, help="JSONL, one {\"id\", \"text\", ...} per line")
    ap.add_argument("--out", type=Path, required=True, help="output folder (created; reruns resume it)")
    ap.add_argument("--workers", type=int, default=1, help="Ray actors, each with the model loaded (default 1)")
    ap.add_argument("--batch", type=int, default=4, help="rows per decoder call inside a worker (default 4)")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads per worker (default: cores / "
                    "workers on a local instance)")
    ap.add_argument("--address", help="join a running Ray cluster ('auto', or ray://head:10001); default: start a "
                    "local instance")
    ap.add_argument("--voices", type=Path, help="folder of named voices (<name>.npz from --save-voice)")
    ap.add_argument("--format", choices=FORMATS, default="wav")
    add_log_level(ap)
    return ap


def run(args: argparse.Namespace) -> int:
    from .manifest import load_manifest

    if args.workers < 1 or args.batch < 1 or args.threads < 0:
        raise ValueError("--workers and --batch must be >= 1, --threads >= 0")
    load_manifest(args.model_path, verify=False)  # a missing or broken export: one line, before Ray starts
    rows = read_rows(args.input)
    if not rows:
        raise ValueError(f"{args.input} has no rows")
    args.out.mkdir(parents=True, exist_ok=True)
    done = read_manifest(args.out)
    ok = {i for i, e in done.items() if e.get("error") is None and (args.out / str(e.get("file", ""))).is_file()}
    todo = [r for r in rows if r.id not in ok]
    bad = [r for r in todo if r.error is not None]
    todo = [r for r in todo if r.error is None]
    print(f"{len(rows)} rows: {len(ok)} done before, {len(todo)} to make, {len(bad)} bad", file=sys.stderr)
    log = (args.out / MANIFEST).open("a", encoding="utf-8")

    def record(entry: dict) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()
        done[entry["id"]] = entry

    for r in bad:
        record({"id": r.id, "line": r.line, "error": r.error})
    if todo:
        generate_all(args, todo, record)
    log.close()
    compact(args.out, rows, done)
    failed = [r.id for r in rows if done.get(r.id, {}).get("error") is not None or r.id not in done]
    hours = sum(e.get("duration_s", 0.0) for e in done.values() if e.get("error") is None) / 3600
    print(f"{args.out}: {len(rows) - len(failed)} of {len(rows)} rows made ({hours * 60:.1f} min of audio); "
          f"{len(failed)} failed{': ' + ', '.join(failed[:5]) if failed else ''}"
          f"{' ...' if len(failed) > 5 else ''} (see {MANIFEST})")
    return 1 if failed else 0


def generate_all(args, todo: list[Row], record) -> None:
    import ray
    from tqdm import tqdm

    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // args.workers)
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(num_cpus=max(cores, args.workers * threads), include_dashboard=False, log_to_driver=False)
    try:
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
        ray.shutdown()


def compact(out: Path, rows: list[Row], done: dict[str, dict]) -> None:
    """Rewrite the manifest atomically: one line per row, in input order."""
    tmp = out / (MANIFEST + ".partial")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rows:
            if r.id in done:
                f.write(json.dumps(done[r.id]) + "\n")
    os.replace(tmp, out / MANIFEST)


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
