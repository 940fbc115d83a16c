"""Corpus synthesis on Ray: JSONL rows in, a folder of audio files and a manifest out, on one machine or a cluster.

    python -m higgs_onnx.corpus --model-path onnx/cpu_int4 --input lines.jsonl --out corpus/ [--workers N]
                                [--batch B] [--address auto|ray://head:10001] [--voices DIR] [--format wav|flac]

Each input line is `{"id": ..., "text": ...}` plus optional `voice` (a voice file, or a name in `--voices`), `seed`,
`temperature`, `top_k`, `top_p`, `max_rows`. Every worker is one long-lived Ray actor holding one loaded `HiggsTTS`
and ONE scheduler (`generation.scheduler`) with one slot pool of `--batch` slots for its whole life. The driver
keeps 2 x batch + 2 rows in flight on each worker (a threaded actor: one call per row), so a batch is decoding and
the rest waits in the scheduler; a finished row's slot is taken by a waiting row at the next decoder step and the
driver sends the next row: no unit boundaries, and rows go to whichever worker frees a slot. The codec decode of a
finished row runs on the scheduler's codec thread and its file is written by its call's thread, off the decoder loop.
On a CPU, whose decode step is bound by reading the weights, batching inside a worker beats more workers. Without
`--address` a local Ray instance is started (workers x threads <= cores); with one, the same code joins a cluster,
and every node needs the export folder at the same path (or on a shared filesystem).

A worker whose process dies (killed, out of memory, its node gone) is replaced by a new one (at most 2 per
`--workers`), and its rows in flight go to the queue again; a row in flight on two workers that died is recorded as
failed (a rerun tries it again). A worker that cannot load the model ends the job (one line, exit 1).

Output: `<out>/<id>.wav` (written atomically, following the umask) and `<out>/manifest.jsonl`, one line per row,
in input order: id, file, duration_s, rows, stop_reason, verdict (the guard's, docs/guard.md), tries, takes (seed,
temperature, rows and verdict of each), seconds, worker, worker_peak_rss_mb, error (a failed row:
id, line, error). A rerun skips rows whose file and successful manifest line exist, so a killed job finishes only
what is missing; the hidden temp file of a row a killed worker was writing is removed before the row is made again.
`<out>/summary.json` has the run's figures: rows/s, and per worker its mean batch (decoder rows / decoder steps, over
the job and while `--batch` or more of its rows remained), slot pools made, rows made and rows/s; the summary line
prints them.

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
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .cli import add_log_level, run_main
from .extras import require
from .hub import cli_model_path, model_path_arg
from .memory import peak_rss
from .outputs import write_atomic
from .ray_local import StopSignal, check_address, ray_temp_dir, stop_leftovers

MANIFEST = "manifest.jsonl"
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a plain file name: cannot leave the folder
OPTION_FIELDS = ("seed", "temperature", "top_k", "top_p", "max_rows")
FORMATS = ("wav", "flac")
SUMMARY = "summary.json"
# rows in flight per worker: IN_FLIGHT x --batch + IN_FLIGHT_EXTRA (a batch decoding, the rest waiting in its
# scheduler, so a freed slot is taken at the next step while the driver sends the next row: a round trip)
IN_FLIGHT, IN_FLIGHT_EXTRA = 2, 2
MAX_DEATHS = 2  # a row in flight on this many workers that died is recorded as failed (a rerun tries it again)
MAX_REPLACEMENTS = 2  # new workers per --workers for ones that die
ROWS_PER_CHAR = 2  # a row's expected length: ~25 rows a second of speech at ~13 characters a second
log = logging.getLogger(__name__)


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
    text_options: dict | None = None  # the row's text steps (job.options.TEXT: normalize, markdown, ...)

    @property
    def key(self) -> str:
        return self.id if self.id is not None else line_key(self.line)


def read_input(path: Path) -> str:
    """The input file's text: UTF-8 (a BOM is dropped); another encoding, a binary or empty file is one line."""
    from .longform.files import read_text_file

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


class RowWords:
    """The export's tokenizer on the driver (no model loads): what a worker's model would read of an SSML row
    (`said`) and the request contract's check of its words (special tokens), so a document that cannot be spoken
    (`<sub alias="&lt;|audio|&gt;">`) is a row error before any work, in the words the server uses."""

    def __init__(self, manifest):
        from tokenizers import Tokenizer

        from .generation.prompt import PromptTokens

        self.tokenizer = Tokenizer.from_file(str(manifest.path(manifest.tokenizer)))
        self.ids = PromptTokens(**manifest.tokens)

    def check(self, text: str, fields: dict) -> None:
        from .generation.prompt import encode_user_text

        encode_user_text(self.tokenizer, self.ids, said(text, fields, self.ids.control_tags))


def said(text: str, fields: dict | None, tags) -> str:
    """What the model reads of a row's text: its text steps (docs/text.md), the instructions' tags first."""
    if not fields:
        return text
    from .job.run import SpeechJob

    return SpeechJob.build(fields, "corpus", tags).prepare(text, "text").text


def read_rows(path: Path, words: RowWords | None = None) -> list[Row]:
    """Every non-blank line as a Row; a malformed one becomes a Row with its error. Duplicate ids are refused.
    An SSML row's document is read here (with `words`, the export's tokenizer: through every text step and the
    contract's special-token check), not first on a worker."""
    from .job.options import OPTIONS, TEXT, OptionError, SpeechOptions

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
        unknown = set(obj) - {"id", "text", "voice", *OPTION_FIELDS, *OPTIONS}
        text_options = {k: obj[k] for k in TEXT if k in obj} or None
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
            try:  # the job options' own bounds; a job field a row cannot carry is refused by name (job.options)
                built = SpeechOptions.build({k: obj[k] for k in OPTIONS if k in obj and k != "voice"}, "corpus")
                if built.text.ssml:  # a document that cannot be read is known now, not on a worker
                    error = ssml_error(text, text_options, words)
            except OptionError as e:
                error = e.message
        rows.append(Row(id=rid, line=n, text=text, voice=voice, options=options, error=error,
                        text_options=text_options))
    return rows


def ssml_error(text: str, fields: dict, words: RowWords | None) -> str | None:
    """Why an SSML row cannot be spoken (None: it can): the document, or what it reads as (special tokens)."""
    from .generation.contract import ContractError
    from .job.options import OptionError
    from .text.ssml import SsmlError, to_text

    try:
        if words is None:
            to_text(text, ())
        else:
            words.check(text, fields)
    except (SsmlError, OptionError) as e:
        return f"text: {e}"
    except ContractError as e:  # "text contains the special token <|audio|>, ...": the worker's words
        return str(e)
    return None


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


class BatchTrace:
    """What one scheduler's decoder steps did: steps, the rows they advanced, and those counts at each of the last
    `batch` retirements, so that the end can tell the mean batch while `batch` or more rows remained."""

    def __init__(self, batch: int):
        self.batch = batch
        self.steps = self.rows = self.finished = 0
        self.tail: deque[tuple[int, int]] = deque(maxlen=batch)  # (steps, rows) when each of the last rows ended

    def saw(self, requests) -> None:
        """One decoder step over `requests` (every one of them decoding), after it ran."""
        self.steps += 1
        self.rows += len(requests)
        for req in requests:
            if req.done:
                self.finished += 1
                self.tail.append((self.steps, self.rows))

    def full(self) -> tuple[int, int] | None:
        """(steps, rows) of the steps that began with `batch` or more of this worker's rows still unfinished: up to
        the step in which the `batch`-th row from the end finished (None: fewer rows than `batch`)."""
        return self.tail[0] if self.finished >= self.batch else None


class Worker:
    """A Ray actor: one loaded model and ONE scheduler, with one slot pool, for its whole life.

    The actor is threaded (`max_concurrency`): the driver keeps several `run(rows)` calls in flight on it, each
    submits its rows to the shared scheduler (its own thread runs the decoder loop: admit into free slots, prefill,
    one batched decoder call per step, retire), so rows of different calls share the batch and a finished row's slot
    is taken by a waiting one at the next step: no unit boundaries. A row's codec decode runs on the scheduler's
    codec thread (`audio="speech"`), its file is written by the call's thread; neither holds up the decoder loop."""

    loudness: float | None = None  # LUFS every file is brought to (None: as generated)

    def __init__(self, model_path: str, out: str, batch: int, threads: int, voices: str | None, fmt: str,
                 retries: int = 2, loudness: float | None = None):
        import socket

        from .generation.scheduler import PrefillPolicy
        from .runtime.model import HiggsTTS, retry_policy

        self.tts = HiggsTTS(model_path, threads=threads, verify=False)
        self.out, self.batch, self.voices, self.fmt = Path(out), batch, voices, fmt
        self.retry = retry_policy(retries)  # the guard's retries of a degenerate take (guard.RetryPolicy)
        self.loudness = loudness
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._voice_cache: dict[str, object] = {}
        self._lock = threading.Lock()
        self.pools = 0  # slot pools made (one per actor)
        self.made = self.failed = 0
        self.first_at: float | None = None  # the first row reached this worker / the last row was done
        self.last_at: float | None = None
        backend, make_pool = self.tts.backend, self.tts.backend.pool

        def pool(*args, **kwargs):
            self.pools += 1
            return make_pool(*args, **kwargs)

        backend.pool = pool  # counted, so the figures can show the pool is made once
        # the pool's slot: every request is built for it, and one that does not fit is refused, never cut
        self.slot = self.tts.slot_positions
        # a prompt is prefilled whole (as it is alone): no latency target here, and the same calls every run
        self.sched = self.tts.scheduler(batch, self.slot, PrefillPolicy(chunk=self.slot))
        self.trace = BatchTrace(batch)
        self.sched.on_step = self.trace.saw  # the width of every decoder step
        self.sched.start()

    def _voice(self, ref):
        from .runtime.model import Voice

        if ref is None:
            return None
        with self._lock:
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

    def finish(self, row: dict, speech, t0: float) -> dict:
        """A generated row's `Speech` -> its file and manifest entry; a generation without audio is a failure."""
        from .audio import write_audio
        from .generation.contract import NoAudioError
        from .job.finish import level as finish_level

        wav, rate = speech.waveform, self.tts.facts.sample_rate
        if not wav.size:
            raise NoAudioError(f"the generation ended after {len(speech.rows)} rows ({speech.stop_reason}) without "
                               f"audio")
        path = self.out / f"{row['id']}.{self.fmt}"
        wav, level = finish_level(wav, rate, self.loudness)  # every door's one loudness call
        try:
            write_audio(path, wav, rate)
        except OSError as e:
            # write_audio's own messages name the path; an OS error is its words ("No space left on device")
            raise RowWriteError(f"cannot write {path}: {e.strerror}" if e.strerror else str(e)) from None
        verdict, takes = getattr(speech, "verdict", None), getattr(speech, "takes", None) or []
        verdict = verdict.name if verdict is not None else None
        return {"id": row["id"], "file": path.name, "duration_s": wav.size / rate, "rows": len(speech.rows),
                "stop_reason": speech.stop_reason, "verdict": verdict, "tries": len(takes) or 1,
                **({"loudness": level.as_dict()} if level is not None else {}),
                "takes": [{k: t[k] for k in ("seed", "temperature", "rows", "verdict")} for t in takes],
                "seconds": time.perf_counter() - t0, "worker": self.name,
                "worker_peak_rss_mb": peak_rss() / 2**20, "error": None}


    def said(self, row: dict) -> str:
        """What the model reads of the row's text (`said`)."""
        return said(row["text"], row.get("text_options"), self.tts.tokens.control_tags)

    def run(self, rows: list[dict]) -> list[dict]:
        """Make `rows` on this worker's scheduler (called from several threads at once); their manifest entries."""
        from .generation.options import GenerationOptions

        submitted, results = [], []
        for row in rows:
            t0 = time.perf_counter()
            with self._lock:
                self.first_at = self.first_at or t0
            try:  # built for the pool's slot: a request that does not fit is refused (the contract), not cut
                req = self.tts.request(self.said(row), voice=self._voice(row["voice"]),
                                       options=GenerationOptions.make(None, **row["options"]), slot=self.slot)
                submitted.append((row, self.sched.submit(req, audio="speech", retry=self.retry), t0))
            except Exception as e:  # noqa: BLE001 - the row is recorded as failed, the others go on
                results.append(self.failure(row, e))
        for row, handle, t0 in submitted:
            try:  # the codec decode ran on the codec thread; the file is written here, off the decoder loop
                results.append(self.finish(row, handle.speech(), t0))
            except Exception as e:  # noqa: BLE001 - a failed row (its step, its codec, its file); the rest goes on
                results.append(self.failure(row, e))
        with self._lock:
            self.last_at = time.perf_counter()
            for entry in results:
                if entry["error"] is None:
                    self.made += 1
                else:
                    self.failed += 1
        return results

    def stats(self) -> dict:
        """This worker's figures: the scheduler's (decoder steps and rows, mean batch), the mean batch while
        `batch` or more of its rows remained, slot pools made, rows made and rows/s over its busy time."""
        s, full = self.sched.stats(), self.trace.full()
        busy = (self.last_at - self.first_at) if self.first_at is not None and self.last_at is not None else 0.0
        return {"worker": self.name, "batch": self.batch, "pools": self.pools, "decoder_steps": s["decoder_steps"],
                "decoder_rows": s["rows"], "mean_batch": s["mean_batch"],
                "full_steps": full[0] if full else 0, "full_mean_batch": round(full[1] / full[0], 3) if full else None,
                "made": self.made, "failed": self.failed, "busy_s": round(busy, 3),
                "rows_per_s": round(self.made / busy, 3) if busy > 0 else None,
                "codec_busy_s": s["codec_busy_s"], "prefill_calls": s["prefill_calls"],
                "peak_rss_mb": round(peak_rss() / 2**20, 1)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m higgs_onnx.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=model_path_arg, required=True, help="an onnx/<device>_<precision> export, "
                    "or a Hub reference hf://ORG/REPO/FOLDER[@REVISION] (docs/hub.md)")
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
    ap.add_argument("--loudness", type=float, metavar="LUFS", help="bring every file to this integrated loudness "
                    "(EBU R128, e.g. -23), the peak under -1 dBFS; the manifest records each file's before/after")
    ap.add_argument("--retries", type=int, default=2, help="a take the guard finds degenerate (a loop, rambling, "
                    "dead air) is drawn again with a new seed and a cooler temperature, up to this many times "
                    "(default %(default)s; 0 = off); the manifest records every try and its verdict")
    add_log_level(ap)
    return ap


def check_out(out: Path) -> None:
    from .outputs import check_output_dir

    check_output_dir(out, "--out")
    manifest = out / MANIFEST
    if manifest.exists() and not manifest.is_file():
        raise ValueError(f"--out {out}: {manifest} is not a file; remove it or choose another folder")


def run(args: argparse.Namespace) -> int:
    from .exports import load_export
    from .runtime.prepared import enabled as check_prepared
    from .runtime.route import check_mode as check_route

    require("ray", "the corpus command", ("ray",))
    if args.workers < 1 or args.batch < 1 or args.threads < 0:
        raise ValueError("--workers and --batch must be >= 1, --threads >= 0")
    from .job.options import SpeechOptions

    SpeechOptions.build({"retries": args.retries, "loudness": args.loudness}, "cli")  # the same bounds as everywhere
    check_route(None)  # $HIGGS_ROUTE: here, not in every worker after Ray has started
    check_prepared()  # $HIGGS_PREPARED alike
    check_address(args.address)
    cli_model_path(args)  # hf://...: fetched once on the driver; the workers get the local folder
    manifest = load_export(args.model_path, verify=False)  # a missing or broken export: one line, before Ray starts
    rows = read_rows(args.input, RowWords(manifest))
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
        figures = None
        if todo:
            remove_partials(args.out, {r.id for r in todo}, args.format)
            stop = StopSignal()
            try:
                figures = generate_all(args, todo, record, stop)
                remove_partials(args.out, {r.id for r in todo}, args.format)  # a stray of a killed earlier run
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
          f"{' ...' if len(failed) > 5 else ''} (see {MANIFEST}){summary_words(figures, args.batch)}")
    write_summary(args, rows, failed, figures)
    return 1 if failed else 0


def summary_words(figures: dict | None, batch: int) -> str:
    """The figures of this run for the summary line: rows/s, and each worker's mean batch and rows/s."""
    if not figures:
        return ""
    parts = []
    for w in figures["workers"]:
        full = "" if w["full_mean_batch"] is None else f" ({w['full_mean_batch']:.2f} while >= {batch} rows remained)"
        rate = "" if w["rows_per_s"] is None else f", {w['rows_per_s']:.2f} rows/s"
        parts.append(f"{w['worker']} mean batch {w['mean_batch']:.2f}{full}{rate}")
    made, wall = figures["made"], figures["wall_s"] or 0.0
    total = f"; {made / wall:.2f} rows/s in all" if wall > 0 and made else ""
    return f"{total}; {'; '.join(parts)}" if parts else total


def write_summary(args, rows: list[Row], failed: list[str], figures: dict | None) -> None:
    """`<out>/summary.json`: this run's counts and figures (atomically; a folder in its place is only a warning)."""
    data = {"rows": len(rows), "made": len(rows) - len(failed), "failed": len(failed), "batch": args.batch,
            "workers_asked": args.workers, **(figures or {"workers": []})}
    path = args.out / SUMMARY
    try:
        write_atomic(path, json.dumps(data, indent=1) + "\n")
    except OSError as e:
        print(f"warning: cannot write {path}: {os_reason(e)}", file=sys.stderr)


def remove_partials(out: Path, ids: set[str], fmt: str) -> None:
    """Remove the temp files a killed worker may have left while writing one of these rows, about to be made again
    (`.<id>.wav.XXXXXXXX.partial.wav` from `outputs.atomic`: hidden, and never taken for a made row)."""
    ext = re.escape(fmt)
    pattern = re.compile(rf"^\.(.+)\.{ext}\.[a-z0-9_]{{8}}\.partial\.{ext}$")
    for path in out.iterdir():
        m = pattern.match(path.name)
        if m and m.group(1) in ids and path.is_file():
            try:
                path.unlink()
            except OSError:  # gone, or not ours to remove
                pass


def expected_rows(row: Row) -> int:
    """A row's expected length, to send the longest rows first (so the last rows to finish are short ones and the
    batch drains fast): its text's length in rows, at most its max_rows."""
    from .generation.options import DEFAULT_MAX_ROWS

    most = (row.options or {}).get("max_rows") or DEFAULT_MAX_ROWS
    return min(int(most), ROWS_PER_CHAR * len(row.text or ""))


class Lane:
    """One worker actor on the driver's side: the rows it has in flight (a call each)."""

    def __init__(self, actor):
        self.actor, self.inflight, self.name = actor, {}, None  # name: the worker's, once it has answered


def death_reason(e: BaseException) -> str:
    """A Ray actor's death as a short line: the error, the pid, and Ray's first words on why."""
    text = " ".join(str(e).split())
    pid = re.search(r"\bpid: (\d+)", text)
    why = [f"{label}{m.group(1).strip()}" for label, m in (
        ("", re.search(r"The actor is dead because ([^.]*)\.", text)),
        ("exit type ", re.search(r"Worker exit type: (\S+)", text)),
        ("", re.search(r"Worker exit detail: ([^.]*)", text))) if m]
    head = f"{type(e).__name__}{f' (pid {pid.group(1)})' if pid else ''}"
    return f"{head}: {', '.join(why)[:300]}" if why else head


def generate_all(args, todo: list[Row], record, stop: StopSignal | None = None) -> dict:
    """Make `todo` on `args.workers` actors; `record(entry)` each row's manifest entry as it comes back. Returns the
    run's figures: wall time, rows/s, each worker's `stats()`."""
    import shutil

    import ray
    from ray.exceptions import RayActorError, RayError
    from tqdm import tqdm

    stop = stop or StopSignal()
    stop.install()
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // args.workers)
    temp = None if args.address else ray_temp_dir()
    keep_temp = getattr(args, "log_level", "WARNING") == "DEBUG"
    figures = {"made": 0, "wall_s": None, "workers": [], "lost_workers": 0}
    try:
        if args.address:
            ray.init(address=args.address, log_to_driver=False)
        else:  # "local": a new instance even when RAY_ADDRESS is set
            ray.init(address="local", num_cpus=max(cores, args.workers * threads), include_dashboard=False,
                     log_to_driver=False, _temp_dir=temp)
        stop.check()  # a Ctrl-C that Ray's process start swallowed
        stop.install()
        depth = IN_FLIGHT * args.batch + IN_FLIGHT_EXTRA  # rows in flight per worker
        actor = ray.remote(num_cpus=threads if not args.address else 1, max_concurrency=depth + 2)(Worker)

        def new_lane() -> Lane:
            return Lane(actor.remote(str(args.model_path.resolve()), str(args.out.resolve()), args.batch, threads,
                                     str(args.voices.resolve()) if args.voices else None, args.format, args.retries,
                                     args.loudness))

        lanes = [new_lane() for _ in range(args.workers)]
        spare = MAX_REPLACEMENTS * args.workers  # new workers for ones that die
        waiting = deque({"id": r.id, "text": r.text, "voice": r.voice, "options": r.options,
                         "text_options": r.text_options}
                        for r in sorted(todo, key=expected_rows, reverse=True))  # the longest first: a short tail
        deaths: dict[str, int] = {}  # row id -> workers that died while it was in flight on them
        pending: dict = {}  # call -> its lane

        def feed() -> None:  # every lane gets rows until it has `depth` in flight: rows go where slots free
            for lane in lanes:
                while waiting and len(lane.inflight) < depth:
                    row = waiting.popleft()
                    ref = lane.actor.run.remote([row])
                    lane.inflight[ref] = row
                    pending[ref] = lane

        def lost(lane: Lane, e: BaseException) -> list[dict]:
            """`lane`'s worker died: its rows in flight go back to the queue, and a new worker takes its place while
            there are spares. Returns the entries of the rows that failed for it: in flight on their second dead
            worker."""
            nonlocal spare
            if getattr(e, "actor_init_failed", False):  # the model did not load: every new worker would fail too
                raise RuntimeError(f"a worker could not start: {str(e).strip().splitlines()[-1][:500]}") from None
            reason = death_reason(e)
            rows = list(lane.inflight.values())
            for ref in lane.inflight:
                pending.pop(ref, None)
            lane.inflight.clear()
            lanes.remove(lane)
            figures["lost_workers"] += 1
            try:
                ray.kill(lane.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            again, failed = [], []
            for row in rows:
                deaths[row["id"]] = deaths.get(row["id"], 0) + 1
                if deaths[row["id"]] >= MAX_DEATHS:
                    failed.append({"id": row["id"], "error": f"the worker making it died, {deaths[row['id']]} times "
                                   f"({reason}): rerun to try it again", "worker": lane.name})
                else:
                    again.append(row)
            waiting.extendleft(reversed(again))
            remove_partials(args.out, {row["id"] for row in rows}, args.format)  # it may have died writing one
            print(f"worker {lane.name or '(not started)'} died ({reason}); {len(again)} of its rows go to "
                  f"{'a new worker' if spare else 'the others'}", file=sys.stderr)
            if spare:
                spare -= 1
                lanes.append(new_lane())
            return failed

        t0, made, audio = time.perf_counter(), 0, 0.0
        bar = tqdm(total=len(todo), unit="row", file=sys.stderr, disable=not sys.stderr.isatty())
        feed()
        while pending:
            stop.check()
            ready, _ = ray.wait(list(pending), num_returns=1)
            ref = ready[0]
            lane = pending.pop(ref)
            row = lane.inflight.pop(ref)
            try:
                entries = ray.get(ref)
            except RayActorError as e:  # the worker's process died (killed, out of memory, its node gone)
                lane.inflight[ref] = row
                entries = lost(lane, e)
            except RayError as e:  # the call failed, not the worker: its row is recorded as failed
                entries = [{"id": row["id"], "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}",
                            "worker": lane.name}]
            for entry in entries:
                lane.name = entry.get("worker") or lane.name
                record(entry)
                made += 1
                figures["made"] += entry.get("error") is None
                audio += entry.get("duration_s", 0.0)
            feed()
            if not entries:
                continue
            rate = made / (time.perf_counter() - t0)
            eta = (len(todo) - made) / rate if rate else 0.0
            bar.update(made - bar.n)
            bar.set_postfix_str(f"{audio / 3600:.3f} h audio, {rate:.2f} rows/s, ETA {eta:.0f} s")
            if not bar.disable:
                continue
            print(f"{made}/{len(todo)} rows, {audio / 3600:.3f} h of audio, {rate:.2f} rows/s, ETA {eta:.0f} s",
                  file=sys.stderr)
        bar.close()
        figures["wall_s"] = time.perf_counter() - t0
        if waiting:
            print(f"every worker died: {len(waiting)} rows were not made; rerun the same command to make them",
                  file=sys.stderr)
        try:
            figures["workers"] = ray.get([lane.actor.stats.remote() for lane in lanes], timeout=60)
        except (RayError, TimeoutError) as e:  # a worker gone at the very end: its figures are missing
            log.warning("worker figures are missing: %s", e)
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
    return figures


def compact(out: Path, rows: list[Row], done: dict[str, dict]) -> None:
    """Rewrite the manifest atomically: one line per row, in input order."""
    write_atomic(out / MANIFEST, "".join(json.dumps(done[r.key]) + "\n" for r in rows if r.key in done))


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
