"""A text of any length -> one recording in one voice, chunk by chunk, resumable.

The text is split into pieces of whole sentences near `target_chars` (`split.split_text`, ~20 s of speech each:
the model was trained on utterances up to ~80 s and sampling drifts on long draws). Each piece is one request:

    <|tts|> [<|ref_text|> voice text] <|ref_audio|> [voice rows]        # the voice (cached prefill state)
    <|text|> previous piece <|audio|> [its rows]                          # history: the last `history` pieces
    <|text|> this piece <|audio|>                                         # generation starts here

The voice is the given reference or cached voice; zero-shot, it is the first piece's own text and codes, so every
later piece is cloned from the voice the first one chose. The previous pieces follow as finished turns, so the
model continues the recording (pace, loudness, prosody) rather than starting a new one.

Fitting the context (the request contract, `generation.contract`): a piece's row budget is
`min(chars * rows_per_char + 100, max_rows or DEFAULT_MAX_ROWS)`, capped by the room its voice and text leave in
the model's context. History is dropped, oldest first, while the contract says the prompt plus that budget does not
fit (`ContractError` code `context_length_exceeded`). A piece that cannot fit even without history (its budget would
be below the rows its text needs) is refused when the job is planned, before any work: every piece is checked up
front against the given voice; zero-shot, piece 1 is checked up front and the others, whose voice is piece 1's own
audio, as soon as piece 1 exists (before piece 2 starts). A piece that reaches its row limit without EOC is
generated again once with another seed, then reported (`write`/`run`; `stream` keeps it: its audio is already out).

Every finished piece's codes go to a work folder beside the output (`<out>.work/piece-NNNN.npz`, with `plan.json`):
a job that is interrupted (Ctrl-C, SIGKILL, a full disk) and run again with `resume=True` skips the finished pieces
and, with the same seed, gives the same file as an uninterrupted run. A damaged piece file (cut off by a crash,
emptied by a full disk) is made again; a damaged `plan.json` is written again, and only pieces stamped with this
job's plan are kept. One job at a time per output: the work folder's `lock` (an flock, released by the kernel when
the process dies, even by SIGKILL) makes a second job on the same output refuse with one line.

Pieces are joined with a short pause (longer at paragraph ends) and short fades, so no join clicks. `write` grows
`<out>.partial` piece by piece and renames it at the end; `stream` hands out each piece's audio while the piece is
generated (the fade-in on its first samples, the last `fade_ms` held back for the fade-out, then the pause). Both
decode with the same incremental codec calls, so the streamed samples equal the file's (before PCM16 quantization)
for the same seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..generation.contract import ContractError, check_max_rows, min_rows, needed_rows
from ..generation.options import DEFAULT_MAX_ROWS, GenerationOptions
from ..guard import RetryPolicy
from ..outputs import OutputError, atomic, probe_writable, write_atomic
from .files import LOCK, JobLockedError, check_outputs, read_text_file, work_folder
from .joins import Edges, fade_edges
from .split import Piece, split_text

log = logging.getLogger(__name__)

PLAN = "plan.json"
PLAN_VERSION = 2  # 2: lanes, and the rows as generated in every piece (KV continuation)
PREFILL_CHUNK = 256  # fixed (not timed) prefill chunks: the same text and seed give the same decoder calls
RETRY_SEED = RetryPolicy.seed_step  # added to a piece's seed for its one retry (guard.RetryPolicy, cooled too)
STOP_REASONS = ("eoc", "max_rows", "loop", "overlong")  # the engine's and the guard's (higgs_onnx/guard)
# what np.load / reading an archive member raises on a file that is not an intact .npz (empty, cut off, garbage)
NPZ_ERRORS = (OSError, ValueError, EOFError, KeyError, TypeError, zipfile.BadZipFile, zlib.error)
# what soundfile raises when the output cannot be written (libsndfile errors are RuntimeErrors; a short write on a
# full disk trips soundfile's own `assert written == frames`)
WRITE_ERRORS = (OSError, RuntimeError, AssertionError)


def piece_rows(text: str, max_rows: int | None, rows_per_char: float) -> int:
    """The row budget of one piece of `text` (long-form's, and each segment's of a text stream): `chars *
    rows_per_char + 100`, capped by `max_rows` (None: DEFAULT_MAX_ROWS)."""
    cap = max_rows if max_rows is not None else DEFAULT_MAX_ROWS
    return min(cap, int(len(text) * rows_per_char) + 100)


@dataclass(frozen=True)
class LongFormOptions:
    target_chars: int = 300  # ~20 s of English speech per piece
    max_chars: int = 600
    history: int = 1  # earlier pieces kept in the prompt as turns (within the context budget)
    pause_s: float = 0.3  # silence between pieces inside a paragraph
    paragraph_pause_s: float = 0.7  # silence after a paragraph
    turn_pause_s: float = 0.4  # a dialogue's silence between two speakers' turns
    fade_ms: float = 8.0  # fade-out / fade-in at each join (no clicks)
    rows_per_char: float = 4.0  # row budget of a piece: chars * this + 100, capped by max_rows and the context

    def __post_init__(self) -> None:
        if not 1 <= self.target_chars <= self.max_chars:
            raise ValueError(f"need 1 <= target_chars <= max_chars, got {self.target_chars}, {self.max_chars}")
        if self.history < 0 or min(self.pause_s, self.paragraph_pause_s, self.turn_pause_s, self.fade_ms) < 0:
            raise ValueError("history, pauses and fade must be >= 0")
        if self.rows_per_char <= 0:
            raise ValueError(f"rows_per_char must be > 0, got {self.rows_per_char}")


@dataclass(frozen=True)
class PieceResult:
    index: int  # 0-based
    total: int
    text: str
    waveform: np.ndarray  # this piece's audio, fades applied, followed by its pause
    rows: int
    stop_reason: str
    retried: bool
    resumed: bool  # read back from the work folder
    seconds_so_far: float  # audio made up to and including this piece
    elapsed_s: float
    eta_s: float | None
    seconds: float = 0.0  # this piece's audio, pause included
    start_sample: int = 0  # where its first sample sits in the recording (the pauses before it included)
    speech_samples: int = 0  # its samples before its pause (the cue of a caption: start .. start + these)
    speaker: str | None = None  # a dialogue's speaker


def _reason(e: BaseException) -> str:
    """An error's own words, without errno numbers or paths (the message names the paths itself)."""
    if isinstance(e, OSError):
        return e.strerror or type(e).__name__
    if isinstance(e, AssertionError):
        return "a short write: the disk may be full"
    text = str(e).splitlines()[-1] if str(e) else type(e).__name__
    return text.split(": ", 1)[-1] if text.startswith("Error ") else text


@dataclass
class _Lane:
    next: int  # the next piece to make (its position in `pieces`)
    end: int  # len(pieces)
    pieces: list[int]  # the lane's pieces, in order
    busy: _Making | None = None  # the piece being made
    kept: object = None  # the handle whose cache the next piece continues
    prev: object = None  # and its request


class _Making:
    """A piece being made: its handle, and its audio so far (fades applied, the last `fade` samples held back)."""

    def __init__(self, index: int, handle, attempt: int, prev, edges: Edges):
        self.index, self.handle, self.attempt, self.prev, self.edges = index, handle, attempt, prev, edges
        self.audio: list[np.ndarray] = []

    def push(self, samples: np.ndarray) -> None:
        out = self.edges.push(samples)
        if out.size:
            self.audio.append(out)

    def finish(self) -> list[np.ndarray]:
        return [*self.audio, self.edges.finish()]


def split_lanes(pieces: list[Piece], lanes: int) -> list[tuple[int, int]]:
    """Pieces [a, b) of each lane: contiguous runs of whole paragraphs of about equal length (at most one lane per
    paragraph)."""
    ends = [i + 1 for i, p in enumerate(pieces) if p.paragraph_end]
    if not ends or ends[-1] != len(pieces):
        ends.append(len(pieces))
    lanes = max(1, min(lanes, len(ends)))
    chars = np.cumsum([len(p.text) for p in pieces])
    total, cuts, prev = chars[-1], [], 0
    for k in range(1, lanes):
        options = [e for e in ends[:-1] if e > prev and len(ends) - ends.index(e) - 1 >= lanes - k]
        if not options:
            break
        cut = min(options, key=lambda e: abs(chars[e - 1] - total * k / lanes))
        cuts.append(cut)
        prev = cut
    bounds = [0, *cuts, len(pieces)]
    return [(bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1)]


class LongForm:
    """One long-form job: `tts` (a `HiggsTTS`), the text, the output path (its work folder sits beside it).

    Constructing it checks everything knowable before any work (the output and work folder, every piece's fit in
    the model's context) and takes the output's lock; `write`, `stream` and `close` release it (so does a `with`
    block, or the process ending). `stream_options` chooses the incremental codec's chunks, for the file and the
    stream alike (default: `StreamOptions()`, the first audio after 8 frames)."""

    def __init__(self, tts, text: str, out: str | os.PathLike, voice=None, options: GenerationOptions | None = None,
                 lf: LongFormOptions | None = None, resume: bool = False, stream_options=None,
                 lanes: int | None = None):
        from ..generation.codec_stream import StreamOptions
        from ..generation.prompt import check_text

        if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1):
            raise ValueError(f"lanes must be a whole number >= 1, got {lanes!r}")
        if getattr(voice, "width", 1) > 1:
            raise ValueError("a blend of voices is not supported for long-form (each piece continues the KV cache "
                             "of the pieces before it, and a blend cannot continue one); use one voice")
        self.tts, self.voice, self.out = tts, voice, Path(out)
        self.slot = tts.slot_positions  # positions of one lane's batching slot
        self.options, self.lf = options or GenerationOptions(), lf or LongFormOptions()
        self.codec_options = stream_options or StreamOptions()
        self._lock = None
        self.work = work_folder(self.out)
        self.gains: dict[int, float] | None = None
        self.pieces = self._split(text)
        if not self.pieces:
            raise ValueError("the text is empty")
        for i, p in enumerate(self.pieces, 1):
            check_text(p.text, f"{self._name(i - 1)} ({p.text[:40]!r})")
        # voice groups (long-form: one; a dialogue: one per speaker), each piece's group, and the lanes (lists of
        # piece indices in order: long-form's runs of whole paragraphs, a dialogue's turns of one speaker)
        self.voices, self.group, self.lanes = self._layout(voice, lanes, resume)
        self.lane_of = {i: k for k, lane in enumerate(self.lanes) for i in lane}
        self.pos = {i: q for lane in self.lanes for q, i in enumerate(lane)}
        # a zero-shot group's voice is its first piece's own text and codes
        self.anchor = [min(i for i, g in enumerate(self.group) if g == k) for k in range(len(self.voices))]
        self.stats: dict = {}  # the figures of the last run (scheduler stats, positions prefilled vs generated)
        self.plan = {"version": PLAN_VERSION, "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
                     "model_id": tts.model_id, "voice": None if voice is None else voice_digest(voice),
                     "options": dataclasses.asdict(self.options), "longform": dataclasses.asdict(self.lf),
                     "pieces": [dataclasses.asdict(p) for p in self.pieces],
                     "lanes": [[lane[0], lane[-1] + 1] for lane in self.lanes], **self._plan_extra()}
        self.plan_id = hashlib.sha256(json.dumps(self.plan, sort_keys=True).encode()).hexdigest()
        # False unless an intact plan.json of this job was found: then pieces from before the stamp existed count too
        self._plan_intact = True
        check_outputs(self.out)
        check_max_rows(self.options.max_rows, tts.facts.num_codebooks, tts.limits(self.slot))
        self._check_fit(range(len(self.pieces)), {})  # zero-shot groups: their first pieces now, the rest later
        self._prepare(resume)

    # -- what the job is: overridden by a dialogue -----------------------------------------------------------------
    def _split(self, text: str) -> list[Piece]:
        return split_text(text, self.lf.target_chars, self.lf.max_chars)

    def _name(self, i: int) -> str:
        return f"piece {i + 1} of the text"

    def _where(self, i: int) -> str:
        return f"piece {i + 1} of {len(self.pieces)}"

    def _layout(self, voice, lanes: int | None, resume: bool) -> tuple[list, list[int], list[list[int]]]:
        if lanes is None:  # a job being resumed keeps its lanes; a new one asks the machine
            lanes = self._planned_lanes() if resume else None
        if lanes is None:
            lanes = self._auto_lanes()
        return [voice], [0] * len(self.pieces), [list(range(a, b)) for a, b in split_lanes(self.pieces, lanes)]

    def _plan_extra(self) -> dict:
        return {}

    # -- planning: does every piece fit? ------------------------------------------------------------------------
    def _prompt_len(self, text: str, voice_rows: int, voice_text: str | None,
                    history: list[tuple[str, int]] = ()) -> int:
        """Positions of a piece's prompt (what `build_prompt` makes), without building the request."""
        from ..generation.prompt import build_prefix, build_suffix

        tok, ids = self.tts.tokenizer, self.tts.tokens
        turns = sum(len(build_suffix(tok, ids, t)) + rows for t, rows in history)
        return len(build_prefix(tok, ids, voice_rows, voice_text)) + turns + len(build_suffix(tok, ids, text))

    def _budget(self, i: int, voice_rows: int, voice_text: str | None) -> int:
        """Piece `i`'s row budget with this voice (no history), or a ContractError when it cannot fit at all."""
        f, text = self.tts.facts, self.pieces[i].text
        limits = self.tts.limits(self.slot)
        cap = self.options.max_rows if self.options.max_rows is not None else DEFAULT_MAX_ROWS  # for the message
        want = self._want(i)
        prompt = self._prompt_len(text, voice_rows, voice_text)
        room = limits.positions - prompt
        need = max(needed_rows(text, f.frame_rate, f.num_codebooks), min_rows(f.num_codebooks))
        where = f"{self._where(i)} ({len(text)} characters: {text[:40]!r}...)"
        if want < need:
            raise ContractError(f"{where} needs at least {need} rows, but max_rows is {cap}: raise --max-rows or "
                                f"make the pieces shorter (LongFormOptions.target_chars/max_chars)", "max_rows")
        if room < need:
            voice = f"the voice ({voice_rows} reference rows and its transcript) and " if voice_rows else ""
            raise ContractError(f"{where} does not fit even without history: {voice}its text take {prompt} "
                                f"positions, {limits.describe()}, and it needs at least {need} rows: use a shorter "
                                f"reference clip or transcript, or shorter pieces", "input",
                                "context_length_exceeded", 413)
        return min(want, room)

    def _check_fit(self, pieces, done: dict) -> None:
        """Every piece of `pieces` whose voice is known fits with it: a given voice, or a zero-shot group's first
        piece (no voice) and, once that piece exists, the group's other pieces (its own audio is their voice)."""
        for i in pieces:
            voice = self._voice_for(self.group[i], done)
            if voice is not None:
                self._budget(i, len(voice.rows), voice.ref_text)
            elif i == self.anchor[self.group[i]]:
                self._budget(i, 0, None)

    # -- the work folder ------------------------------------------------------------------------------------------
    def _prepare(self, resume: bool) -> None:
        try:
            self.work.mkdir(exist_ok=True)
        except OSError as e:
            raise PermissionError(f"--out {self.out}: cannot create its work folder {self.work} "
                                  f"({_reason(e)})") from None
        probe_writable(self.work, f"--out {self.out}: work folder")
        self._acquire()
        try:
            self._check_plan(resume)
        except BaseException:
            self.close()
            raise

    def _acquire(self) -> None:
        """Take the output's lock (refuse at once if another job holds it); a no-op while this job holds it."""
        from filelock import FileLock, Timeout

        if self._lock is not None:
            return
        self.work.mkdir(exist_ok=True)
        lock = FileLock(str(self.work / LOCK), thread_local=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise JobLockedError(f"another long-form job is writing {self.out} right now (it holds "
                                 f"{self.work / LOCK}); wait for it to finish, or choose another --out") from None
        except OSError as e:
            raise PermissionError(f"--out {self.out}: cannot lock its work folder {self.work} "
                                  f"({_reason(e)})") from None
        self._lock = lock

    def close(self) -> None:
        """Release the output's lock (the work folder stays for a later resume unless the job finished)."""
        if self._lock is not None:
            self._lock.release(force=True)
            self._lock = None

    def __enter__(self) -> LongForm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_plan(self, resume: bool) -> None:
        plan = self.work / PLAN
        if plan.is_file():
            if not resume:
                raise FileExistsError(f"{self.work} holds an unfinished job: add --resume to continue it, or delete "
                                      f"the folder to start again")
            try:
                old = json.loads(plan.read_text(encoding="utf-8"))
            except (ValueError, OSError):  # damaged (a full disk, a crash): its pieces prove whose they are
                log.warning("%s was damaged: writing it again; only pieces stamped with this job are kept", plan)
                self._plan_intact = False
                self._write_plan(plan)
                return
            if old != self.plan:
                was = old.get("lanes") if isinstance(old, dict) else None
                if isinstance(was, list) and len(was) != len(self.lanes) and \
                        {k: v for k, v in old.items() if k != "lanes"} == \
                        {k: v for k, v in self.plan.items() if k != "lanes"}:
                    raise ValueError(f"{self.work} was planned with {len(was)} lanes: resume with --lanes "
                                     f"{len(was)} (or without --lanes), or delete it to start again")
                raise ValueError(f"{self.work} belongs to another text, voice or settings; delete it to start "
                                 f"again with these")
        else:  # a new job (or one whose plan.json was deleted): only pieces stamped with this plan count
            self._plan_intact = False
            self._write_plan(plan)

    def _write_plan(self, plan: Path) -> None:
        try:
            write_atomic(plan, json.dumps(self.plan, indent=1).encode())
        except OSError as e:
            raise OutputError(f"cannot write {plan} ({_reason(e)}); free space in {self.work.parent} and run "
                              f"again") from None

    # -- pieces ---------------------------------------------------------------------------------------------------
    def _piece_path(self, i: int) -> Path:
        return self.work / f"piece-{i + 1:04d}.npz"

    def _load(self, i: int) -> dict | None:
        """Piece `i` from the work folder, or None when it is not there or not usable (then it is made again)."""
        path = self._piece_path(i)
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                piece = {"codes": z["codes"], "rows": int(z["rows"]), "stop": str(z["stop"]),
                         "retried": bool(z["retried"]), "plan": str(z["plan"]) if "plan" in z.files else None,
                         "piece": str(z["piece"]) if "piece" in z.files else None, "gen": z["gen"]}
            codes, gen, f = piece["codes"], piece["gen"], self.tts.facts
            n = f.num_codebooks
            ok = (codes.ndim == 2 and codes.shape[1] == n and codes.dtype.kind in "iu" and len(codes) > 0
                  and piece["stop"] in STOP_REASONS and len(codes) == piece["rows"] - n + 1
                  and codes.min() >= 0 and codes.max() < f.codebook_vocab
                  and gen.shape == (piece["rows"], n) and gen.dtype.kind in "iu"
                  and gen.min() >= 0 and gen.max() < f.codebook_vocab
                  and piece["piece"] in (None, self._piece_stamp(i)))  # its own rows, codes and text
            ours = piece["plan"] == self.plan_id or (piece["plan"] is None and self._plan_intact)
        except NPZ_ERRORS + (AttributeError,):  # cut off by a kill or a full disk, emptied, not an .npz at all
            ok, ours = False, True
        if not ok or not ours:
            log.warning("%s is %s: making piece %d again", path, "damaged" if not ok else "from another job", i + 1)
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
            return None
        piece["codes"], piece["gen"] = piece["codes"].astype(np.int64), piece["gen"].astype(np.int64)
        return piece

    def _piece_stamp(self, i: int) -> str:
        """Which piece a file holds: its index and its text's hash (a file copied over another piece is refused)."""
        return f"{i}:{hashlib.sha256(self.pieces[i].text.encode()).hexdigest()[:16]}"

    def _save(self, i: int, piece: dict) -> None:
        try:
            with atomic(self._piece_path(i), ".npz") as tmp:
                np.savez(tmp, codes=piece["codes"], rows=piece["rows"], stop=piece["stop"], retried=piece["retried"],
                         gen=piece["gen"], plan=self.plan_id, piece=self._piece_stamp(i))
        except OSError as e:
            raise OutputError(f"cannot save piece {i + 1} in {self.work} ({_reason(e)}); the pieces before it are "
                              f"kept there: free space and run again with --resume") from None

    # -- lanes -----------------------------------------------------------------------------------------------------
    def _planned_lanes(self) -> int | None:
        """The lane count of the unfinished job in the work folder (resumed with the lanes it was planned with)."""
        try:
            old = json.loads((self.work / PLAN).read_text(encoding="utf-8"))
            return len(old["lanes"]) if isinstance(old.get("lanes"), list) and old["lanes"] else None
        except (OSError, ValueError, TypeError, AttributeError):
            return None

    def _auto_lanes(self) -> int:
        """Lanes from this machine's measured batch gain: 1 where batching does not pay."""
        from ..generation.scheduler import choose_batch, measure_batch_gain

        paragraphs = sum(p.paragraph_end for p in self.pieces) or 1
        if paragraphs < 2:
            return 1
        sizes = tuple(b for b in (1, 2, 4) if b <= paragraphs)
        self.gains = measure_batch_gain(self.tts.backend, sizes)
        return choose_batch(self.gains)

    def _voice_for(self, g: int, done: dict[int, dict]):
        """Group `g`'s voice, for every lane's first piece and every restart: the given one, or (zero-shot) the
        group's first piece's own text and codes (None until that piece exists)."""
        a = self.anchor[g]
        if self.voices[g] is not None or a not in done:
            return self.voices[g]
        return self.tts.voice_from_codes(done[a]["codes"], self.pieces[a].text)

    def _suffix_len(self, i: int) -> int:
        from ..generation.prompt import build_suffix

        cache = self.__dict__.setdefault("_suffixes", {})
        if i not in cache:
            cache[i] = len(build_suffix(self.tts.tokenizer, self.tts.tokens, self.pieces[i].text))
        return cache[i]

    def _want(self, i: int) -> int:
        return piece_rows(self.pieces[i].text, self.options.max_rows, self.lf.rows_per_char)

    def _context(self, i: int, done: dict[int, dict]) -> tuple[bool, list[int], bool]:
        """Piece `i`'s context: (with the voice, the earlier pieces in its prompt, continues the piece before).

        A pure function of the texts and the row counts of the pieces before it in its lane, so a resumed job
        builds exactly the prompt the uninterrupted one had. A lane's first piece hears the voice only (zero-shot
        piece 1: nothing). Every later piece continues the one before (KV continuation: its prompt is the previous
        prompt, its rows, and the new text) while the lane's prompt plus the piece's whole row budget fits the
        slot; when it would not, the lane starts again from the voice and the last `history` pieces (fewer while
        they do not fit). `history=0`: every piece hears the voice only."""
        lane, g = self.lanes[self.lane_of[i]], self.group[i]
        start, anchor = lane[0], self.anchor[g]
        zero_shot = self.voices[g] is None
        with_voice, history = not (zero_shot and start == anchor), []
        for q in range(1, self.pos[i] + 1):
            j = lane[q]
            if self.lf.history == 0:
                with_voice, history, cont = True, [], False
                continue
            grown = history + [lane[q - 1]]
            if self._fits(j, with_voice, grown, done):
                history, cont = grown, True
                continue
            with_voice, cont = True, False  # start again from the voice and the last pieces
            keep = [lane[r] for r in range(max(0, q - self.lf.history), q) if not (zero_shot and lane[r] == anchor)]
            while keep and not self._fits(j, True, keep, done):
                keep = keep[1:]
            history = keep
        if i == start:
            return with_voice, [], False
        return with_voice, history, cont

    def _fits(self, j: int, with_voice: bool, history: list[int], done: dict) -> bool:
        return self._prompt_positions(j, with_voice, history, done) + self._want(j) <= self.slot

    def _prompt_positions(self, j: int, with_voice: bool, history: list[int], done: dict) -> int:
        """The prompt length of piece `j` with (or without) the voice and the earlier pieces `history`."""
        from ..generation.prompt import build_prefix

        g = self.group[j]
        voice, a = self.voices[g], self.anchor[g]
        rows, text = (0, None) if not with_voice else (len(voice.rows), voice.ref_text) \
            if voice is not None else (len(done[a]["gen"]), self.pieces[a].text)
        prefixes = self.__dict__.setdefault("_prefixes", {})
        if (rows, text) not in prefixes:
            prefixes[rows, text] = len(build_prefix(self.tts.tokenizer, self.tts.tokens, rows, text))
        return prefixes[rows, text] + sum(self._suffix_len(k) + done[k]["rows"] for k in history) + \
            self._suffix_len(j)

    def _request(self, i: int, done: dict[int, dict], attempt: int, prev=None):
        """Piece `i`'s request in its lane's context (`_context`), and whether it continues `prev` (the request of
        the piece before, when its cache is still in the scheduler: then only the new text is prefilled)."""
        with_voice, history, cont = self._context(i, done)
        voice = self._voice_for(self.group[i], done) if with_voice else None
        budget = self._budget(i, 0, None) if voice is None else self._budget(i, len(voice.rows), voice.ref_text)
        if cont:
            budget = self._want(i)  # `_context` made sure the lane's prompt and all of it fit
        options = dataclasses.replace(self.options, seed=self.options.seed + i, max_rows=budget)
        if attempt:  # the guard's retry policy: the seed moved by RETRY_SEED, the temperature cooled (greedy: kept)
            options = RetryPolicy().next_options(options, attempt) or dataclasses.replace(
                options, seed=options.seed + attempt * RETRY_SEED)
        turns = [(self.pieces[k].text, done[k]["gen"]) for k in history]
        continues = prev if cont and prev is not None else None
        req = self.tts.request(self.pieces[i].text, voice=voice, options=options, history=turns, slot=self.slot,
                               continues=continues)
        if cont and continues is None:  # resumed: the cache it would continue is gone
            req.breaks = self._replay_breaks(i, done, req)
        return req, continues is not None

    def _replay_breaks(self, i: int, done: dict[int, dict], req) -> tuple[int, ...]:
        """Piece `i` would have continued its lane's cache, which a resumed job no longer has: where its
        from-scratch prefill must end a call for it to make the calls that built that cache (each earlier piece's
        new positions in `PREFILL_CHUNK`s from where that piece started, each row it fed a call of its own). The
        same calls round the same way (int4 rounds a long prefill differently from rows fed one by one), so a
        resumed job writes the bytes of an uninterrupted one."""
        lane = self.lanes[self.lane_of[i]]
        q = self.pos[i]
        while self._context(lane[q], done)[2]:
            q -= 1  # back to the piece of the lane that started from the voice
        first = lane[q]
        with_voice, history, _ = self._context(first, done)
        end = self._prompt_positions(first, with_voice, history, done)
        breaks = []
        for r in range(q, self.pos[i]):
            k = lane[r]
            fed = max(done[k]["rows"] - 1, 0)  # the last row is sampled, never fed
            breaks += range(end, end + fed + 1)  # the prompt's end, then each fed row
            end += done[k]["rows"] + self._suffix_len(lane[r + 1])
        if end != len(req.prompt):  # the lane's prompt is not the concatenation of its pieces: no replay
            raise AssertionError(f"piece {i + 1}: its lane's prompt is {len(req.prompt)} positions, its pieces add "
                                 f"up to {end}")
        return tuple(b - req.cached for b in breaks if b > req.cached)

    def _steps(self, streaming: bool):
        """Every piece in order: ("audio", samples) as it is made (streaming only) and ("piece", PieceResult).

        The lanes run together through one scheduler (one slot each, one decoder call per step for all of them),
        driven from here with fixed prefill chunks, so the same text, seed and lane count give the same decoder
        calls. A piece's audio is made by the scheduler's codec worker while the lanes go on; pieces come out in
        text order (a piece of a later lane waits, made, until the pieces before it are out)."""
        from ..generation.scheduler import PrefillPolicy

        t0, n, sr = time.perf_counter(), len(self.pieces), self.tts.facts.sample_rate
        done: dict[int, dict] = {}
        resumed: set[int] = set()
        for i in range(n):
            piece = self._load(i)
            if piece is not None:
                done[i] = piece
                resumed.add(i)
        sched = self.tts.scheduler(len(self.lanes), self.slot, PrefillPolicy(chunk=PREFILL_CHUNK))
        lanes = [_Lane(next((q for q, i in enumerate(lane) if i not in done), len(lane)), len(lane), lane)
                 for lane in self.lanes]
        ready: dict[int, np.ndarray] = {}  # finished pieces' audio not handed out yet
        sent: dict[int, list] = {}  # audio of the piece on air handed out so far (streaming)
        made: dict[int, _Making] = {}
        out_next, seconds, made_chars, at = 0, 0.0, 0, 0
        unchecked = {g for g, v in enumerate(self.voices) if v is None}  # zero-shot groups whose voice is unknown
        for g in sorted(unchecked):
            if self.anchor[g] in done:
                self._check_fit([i for i in range(n) if self.group[i] == g], done)
                unchecked.discard(g)
        try:
            while out_next < n:
                i = out_next
                if i in resumed and i not in ready:
                    ready[i] = self._audio(i, done[i]["codes"])
                if i in ready:  # its turn: the rest of its audio, then the piece
                    wav = ready.pop(i)
                    head = sent.pop(i, [])
                    if streaming and wav.size:
                        yield "audio", wav
                    full = np.concatenate([*head, wav]) if head else wav
                    seconds += full.size / sr
                    start, at = at, at + full.size
                    left = sum(len(self.pieces[k].text) for k in range(n) if k not in done)
                    elapsed = time.perf_counter() - t0
                    eta = elapsed / made_chars * left if made_chars else None
                    p = done[i]
                    yield "piece", PieceResult(i, n, self.pieces[i].text, full, p["rows"], p["stop"], p["retried"],
                                               i in resumed, seconds, elapsed, eta, full.size / sr, start,
                                               full.size - self._pause(i).size, self._speaker(i))
                    out_next += 1
                    continue
                if streaming and i in made and made[i].audio:  # on air: what is final goes out now
                    chunk = np.concatenate(made[i].audio)
                    made[i].audio.clear()
                    sent.setdefault(i, []).append(chunk)
                    yield "audio", chunk
                for lane in lanes:  # every idle lane starts its next piece (zero-shot: once its voice is known)
                    if lane.busy is None and lane.next < lane.end:
                        i = lane.pieces[lane.next]
                        g = self.group[i]
                        if self.voices[g] is not None or i == self.anchor[g] or self.anchor[g] in done:
                            self._submit(sched, lane, i, done, 0, streaming, made)
                progressed = sched.step()
                for lane in lanes:
                    m = lane.busy
                    if m is None:
                        continue
                    events, ended = m.handle.drain()
                    for chunk in events:
                        m.push(chunk.samples)
                    if not ended:
                        continue
                    if m.handle.error is not None:
                        raise m.handle.error
                    last = m.handle.result
                    piece = {"codes": last.codes, "rows": len(last.rows), "stop": last.stats.stop_reason,
                             "retried": m.attempt == 1, "gen": last.rows}
                    if piece["stop"] != "eoc" and m.attempt == 0 and not streaming:
                        self._retry(sched, lane, done, made)
                        continue
                    self._save(m.index, piece)
                    done[m.index] = piece
                    made_chars += len(self.pieces[m.index].text)
                    ready[m.index] = np.concatenate([*made.pop(m.index).finish(), self._pause(m.index)])
                    lane.busy, lane.next = None, self.pos[m.index] + 1
                    if lane.next < lane.end and self.lf.history > 0:
                        lane.kept, lane.prev = m.handle, m.handle.request  # the next piece continues its cache
                    else:
                        m.handle.release()
                    g = self.group[m.index]
                    if g in unchecked and m.index == self.anchor[g]:  # zero-shot: the group's voice is known now
                        self._check_fit([k for k in range(n) if self.group[k] == g], done)
                        unchecked.discard(g)
                if not progressed:
                    sched.wait_for_codec()
        finally:
            st = sched.stats()
            sched.close()
            self.stats = {"lanes": len(self.lanes), "mean_batch": st["mean_batch"],
                          "decoder_steps": st["decoder_steps"], "rows_generated": st["rows"],
                          "positions_prefilled": st["prefill_positions"], "prefill_calls": st["prefill_calls"],
                          "pieces_made": len(done) - len(resumed), "pieces_resumed": len(resumed),
                          "batch_gain": self.gains}

    def _submit(self, sched, lane: _Lane, i: int, done: dict, attempt: int, streaming: bool, made: dict) -> None:
        req, continued = self._request(i, done, attempt, lane.prev)
        after, prev = (lane.kept, lane.prev) if continued else (None, None)
        if lane.kept is not None and not continued:
            lane.kept.release()  # the lane starts again from the voice: its old cache goes
        lane.kept = lane.prev = None
        # kept when done: for the next piece to continue, or (writing a file) for a retry to cut back
        keep = self.lf.history > 0 and (self.pos[i] + 1 < lane.end or not streaming)
        handle = sched.submit(req, "stream", self.codec_options, keep=keep, after=after)
        made[i] = lane.busy = _Making(i, handle, attempt, prev, Edges(self._fade_samples()))

    def _retry(self, sched, lane: _Lane, done: dict, made: dict) -> None:
        """The piece reached its row limit without EOC: make it once more with another seed, in the same context
        (a continued cache is cut back to where the piece started)."""
        m = lane.busy
        req = m.handle.request
        if m.prev is not None and req.cache is not None:
            req.cache.truncate(req.cached)
            lane.kept, lane.prev = m.handle, m.prev
        else:
            m.handle.release()
        self._submit(sched, lane, m.index, done, 1, False, made)

    def run(self) -> Iterator[PieceResult]:
        """Generate (or read back) every piece in order, yielding each with its audio as soon as it is final."""
        for kind, item in self._steps(streaming=False):
            if kind == "piece":
                yield item

    def stream(self, on_piece: Callable[[PieceResult], None] | None = None) -> Iterator[np.ndarray]:
        """The recording as float32 sample chunks at the codec rate, each handed out as soon as it is final: a
        piece's audio comes while the piece is generated (pieces read back from the work folder come whole).
        `on_piece` gets each finished piece (progress). The chunks concatenate to the samples `write` puts in the
        file for the same seed; a piece that reaches its row limit is kept, not retried. At the end the work folder
        is removed; stopping early (closing the iterator) keeps it and releases the lock."""
        self._acquire()
        finished = False
        try:
            for kind, item in self._steps(streaming=True):
                if kind == "audio":
                    if item.size:
                        yield item
                elif on_piece:
                    on_piece(item)
            finished = True
        finally:
            if finished:
                shutil.rmtree(self.work, ignore_errors=True)
            self.close()

    def _speaker(self, i: int) -> str | None:
        return None

    def _fade_samples(self) -> int:
        return int(self.lf.fade_ms * self.tts.facts.sample_rate / 1000)

    def _pause(self, i: int) -> np.ndarray:
        last = i == len(self.pieces) - 1
        return np.zeros(0 if last else int(self._pause_s(i) * self.tts.facts.sample_rate), np.float32)

    def _pause_s(self, i: int) -> float:
        """The silence after piece `i` (not the last)."""
        return self.lf.paragraph_pause_s if self.pieces[i].paragraph_end else self.lf.pause_s

    def _audio(self, i: int, codes: np.ndarray) -> np.ndarray:
        """A piece's waveform with fades at both ends, followed by its pause."""
        # the incremental codec, in the chunks `stream` uses (so both give the same samples); its activations stay
        # bounded whatever the piece's length (one call for a 28 s piece holds ~2 GB of them on the real codec)
        stream = self.tts.codec_stream(self.codec_options)
        wav = np.concatenate([*stream.push(codes), stream.flush()]) if len(codes) else np.zeros(0, np.float32)
        wav = fade_edges(np.array(wav, np.float32), self._fade_samples())
        return np.concatenate([wav, self._pause(i)])

    def write(self, on_piece: Callable[[PieceResult], None] | None = None) -> Path:
        """Run the job into `<out>.partial` piece by piece (memory stays flat with the text's length), rename it to
        `out` at the end and remove the work folder. An interrupted run leaves the partial file and the work folder:
        run again with `resume=True`. Writing the output failing (a full disk, the folder gone) is an `OutputError`
        naming `out` and where the audio and the pieces are."""
        from ..audio import GrowingAudioFile

        self._acquire()
        try:
            partial = self.out.with_name(self.out.name + ".partial")
            try:
                sink = GrowingAudioFile(self.out, self.tts.facts.sample_rate)
            except WRITE_ERRORS as e:
                raise OutputError(f"cannot write {self.out} ({_reason(e)}); nothing was generated yet") from None
            seconds = 0.0
            try:
                for piece in self.run():
                    try:
                        sink.write(piece.waveform)
                    except WRITE_ERRORS as e:
                        raise OutputError(
                            f"cannot write {self.out} ({_reason(e)}) after {seconds:.1f} s of audio; the audio so "
                            f"far is in {partial} and the finished pieces in {self.work}: free space (or fix the "
                            f"folder) and run again with --resume") from None
                    seconds = piece.seconds_so_far
                    if on_piece:
                        on_piece(piece)
            except BaseException:
                _quietly(sink.abandon)
                raise
            try:
                path = sink.commit()
            except WRITE_ERRORS as e:
                _quietly(sink.abandon)
                where = f"the whole recording is in {partial}" if partial.is_file() else "the audio file is lost"
                raise OutputError(f"cannot write {self.out} ({_reason(e)}); {where}, and its pieces are kept in "
                                  f"{self.work}: rename it yourself, or run again with --resume") from None
            shutil.rmtree(self.work, ignore_errors=True)
            return path
        finally:
            self.close()


def _quietly(fn) -> None:
    """Clean-up that must not hide the error being raised."""
    try:
        fn()
    except Exception:  # noqa: BLE001 - the original error is the one to report
        log.debug("clean-up failed", exc_info=True)


def voice_digest(voice) -> str:
    h = hashlib.sha256(np.ascontiguousarray(voice.rows).tobytes())
    h.update(str(voice.ref_text).encode())
    return h.hexdigest()




def generate_long(tts, text: str, out: str | os.PathLike, voice=None, options: GenerationOptions | None = None,
                  lf: LongFormOptions | None = None, resume: bool = False,
                  on_piece: Callable[[PieceResult], None] | None = None, lanes: int | None = None) -> Path:
    """Synthesize `text` into one recording at `out` (see the module docstring); returns the path. `lanes`: None
    chooses from the machine's measured batch gain."""
    return LongForm(tts, text, out, voice, options, lf, resume, lanes=lanes).write(on_piece)


__all__ = ["JobLockedError", "LongForm", "LongFormOptions", "Piece", "PieceResult", "check_outputs", "generate_long",
           "read_text_file"]
