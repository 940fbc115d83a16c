"""A text of any length -> one recording in one voice, chunk by chunk, resumable.

The text is split into pieces of whole sentences near `target_chars` (`split.split_text`, ~20 s of speech each:
the model was trained on utterances up to ~80 s and sampling drifts on long draws). Each piece is one request:

    <|tts|> [<|ref_text|> voice text] <|ref_audio|> [voice rows]        # the voice (cached prefill state)
    <|text|> previous piece <|audio|> [its rows]                          # history: the last `history` pieces
    <|text|> this piece <|audio|>                                         # generation starts here

The voice is the given reference or cached voice; zero-shot, it is the first piece's own text and codes, so every
later piece is cloned from the voice the first one chose. The previous pieces follow as finished turns, so the
model continues the recording (pace, loudness, prosody) rather than starting a new one; they are dropped, oldest
first, when the prompt plus the piece's row budget would not fit the model's context. A piece that reaches its
row limit without EOC is generated again once with another seed, then reported.

Every finished piece's codes go to a work folder beside the output (`<out>.work/piece-NNNN.npz`, with
`plan.json`): a job that is interrupted (Ctrl-C, SIGKILL) and run again with `resume=True` skips the finished
pieces and, with the same seed, gives the same file as an uninterrupted run. Pieces are joined with a short pause
(longer at paragraph ends) and short fades, so no join clicks; the output is written atomically at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..generation.delay import apply_delay
from ..generation.options import GenerationOptions
from .split import Piece, split_text

PLAN = "plan.json"
PLAN_VERSION = 1
RETRY_SEED = 1_000_003  # added to a piece's seed for its one retry
CODEC_WINDOW = 250  # frames (10 s) per codec call when a piece is decoded


@dataclass(frozen=True)
class LongFormOptions:
    target_chars: int = 300  # ~20 s of English speech per piece
    max_chars: int = 600
    history: int = 1  # earlier pieces kept in the prompt as turns (within the context budget)
    pause_s: float = 0.3  # silence between pieces inside a paragraph
    paragraph_pause_s: float = 0.7  # silence after a paragraph
    fade_ms: float = 8.0  # fade-out / fade-in at each join (no clicks)
    rows_per_char: float = 4.0  # row budget of a piece: chars * this + 100, capped by max_rows and the context

    def __post_init__(self) -> None:
        if not 1 <= self.target_chars <= self.max_chars:
            raise ValueError(f"need 1 <= target_chars <= max_chars, got {self.target_chars}, {self.max_chars}")
        if self.history < 0 or min(self.pause_s, self.paragraph_pause_s, self.fade_ms) < 0:
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


def read_text_file(path: str | os.PathLike) -> str:
    """A text file for long-form, refused with one clear line when it is empty, binary or not UTF-8."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"--text-file {path} is a folder")
    if not path.is_file():
        raise FileNotFoundError(f"--text-file {path} does not exist")
    data = path.read_bytes()
    if b"\x00" in data:
        raise ValueError(f"{path} is a binary file, not text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); convert it, "
                         f"e.g. iconv -f latin1 -t utf-8") from None
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text


class LongForm:
    """One long-form job: `tts` (a `HiggsTTS`), the text, the output path (its work folder sits beside it)."""

    def __init__(self, tts, text: str, out: str | os.PathLike, voice=None, options: GenerationOptions | None = None,
                 lf: LongFormOptions | None = None, resume: bool = False):
        from ..generation.prompt import check_text

        self.tts, self.voice, self.out = tts, voice, Path(out)
        self.options, self.lf = options or GenerationOptions(), lf or LongFormOptions()
        self.pieces = split_text(text, self.lf.target_chars, self.lf.max_chars)
        if not self.pieces:
            raise ValueError("the text is empty")
        for i, p in enumerate(self.pieces, 1):
            check_text(p.text, f"piece {i} of the text ({p.text[:40]!r})")
        self.work = self.out.with_name(self.out.name + ".work")
        self.plan = {"version": PLAN_VERSION, "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
                     "model_id": tts.model_id, "voice": None if voice is None else _voice_id(voice),
                     "options": dataclasses.asdict(self.options), "longform": dataclasses.asdict(self.lf),
                     "pieces": [dataclasses.asdict(p) for p in self.pieces]}
        self._prepare(resume)

    def _prepare(self, resume: bool) -> None:
        plan = self.work / PLAN
        if plan.is_file():
            if not resume:
                raise FileExistsError(f"{self.work} holds an unfinished job: add --resume to continue it, or delete "
                                      f"the folder to start again")
            try:
                old = json.loads(plan.read_text())
            except ValueError:
                raise ValueError(f"{plan} is damaged; delete {self.work} to start again") from None
            if old != self.plan:
                raise ValueError(f"{self.work} belongs to another text, voice or settings; delete it to start "
                                 f"again with these")
        else:
            self.work.mkdir(parents=True, exist_ok=True)
            _atomic_write(plan, json.dumps(self.plan, indent=1).encode())

    # -- pieces ---------------------------------------------------------------------------------------------------
    def _piece_path(self, i: int) -> Path:
        return self.work / f"piece-{i + 1:04d}.npz"

    def _load(self, i: int) -> dict | None:
        path = self._piece_path(i)
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                return {"codes": z["codes"], "rows": int(z["rows"]), "stop": str(z["stop"]),
                        "retried": bool(z["retried"])}
        except (OSError, ValueError, KeyError):  # a piece cut off by a kill: make it again
            path.unlink(missing_ok=True)
            return None

    def _save(self, i: int, piece: dict) -> None:
        tmp = self._piece_path(i).with_suffix(".partial.npz")
        np.savez(tmp, codes=piece["codes"], rows=piece["rows"], stop=piece["stop"], retried=piece["retried"])
        os.replace(tmp, self._piece_path(i))

    def _voice_for(self, done: dict[int, dict]):
        """The voice of every piece: the given one, or (zero-shot) the first piece's own text and codes."""
        if self.voice is not None or 0 not in done:
            return self.voice
        return self.tts.voice_from_codes(done[0]["codes"], self.pieces[0].text)

    def _history(self, i: int, done: dict[int, dict], voice_is_first: bool) -> list[tuple[str, np.ndarray]]:
        f, out = self.tts.facts, []
        for j in range(max(0, i - self.lf.history), i):
            if voice_is_first and j == 0:
                continue  # the first piece already is the voice
            out.append((self.pieces[j].text, apply_delay(done[j]["codes"], f.boc, f.eoc)))
        return out

    def _generate(self, i: int, done: dict[int, dict]) -> dict:
        f, piece = self.tts.facts, self.pieces[i]
        voice = self._voice_for(done)
        history = self._history(i, done, self.voice is None and i > 0)
        budget = min(self.options.max_rows, int(len(piece.text) * self.lf.rows_per_char) + 100)
        seed = self.options.seed + i
        result = None
        for attempt in range(2):
            while True:  # drop history, oldest first, until prompt + budget fit the context
                options = dataclasses.replace(self.options, seed=seed + attempt * RETRY_SEED, max_rows=budget)
                try:
                    req = self.tts.request(piece.text, voice=voice, options=options, history=history)
                except ValueError:
                    if not history:
                        raise
                    history = history[1:]
                    continue
                if len(req.prompt) + budget <= f.max_positions or not history:
                    break
                history = history[1:]
            speech = self.tts.synthesizer.speak(req)
            result = {"codes": speech.codes, "rows": len(speech.rows), "stop": speech.stop_reason,
                      "retried": attempt == 1}
            if speech.stop_reason == "eoc":
                break
        return result

    def run(self) -> Iterator[PieceResult]:
        """Generate (or read back) every piece in order, yielding each with its audio as soon as it is final."""
        t0, done, made_chars, gen_s, seconds = time.perf_counter(), {}, 0, 0.0, 0.0
        n = len(self.pieces)
        for i in range(n):
            piece = self._load(i)
            resumed = piece is not None
            if piece is None:
                t = time.perf_counter()
                piece = self._generate(i, done)
                self._save(i, piece)
                made_chars += len(self.pieces[i].text)
                gen_s += time.perf_counter() - t
            done[i] = piece
            wav = self._audio(i, piece["codes"])
            seconds += wav.size / self.tts.facts.sample_rate
            elapsed = time.perf_counter() - t0
            left = sum(len(p.text) for p in self.pieces[i + 1:])
            eta = gen_s / made_chars * left if made_chars else None  # from this run's generation speed
            result = PieceResult(i, n, self.pieces[i].text, wav, piece["rows"], piece["stop"], piece["retried"],
                                 resumed, seconds, elapsed, eta, wav.size / self.tts.facts.sample_rate)
            yield result

    def _audio(self, i: int, codes: np.ndarray) -> np.ndarray:
        """A piece's waveform with fades at both ends, followed by its pause."""
        from ..runtime.stream import StreamOptions

        f, lf = self.tts.facts, self.lf
        # the incremental codec in 10 s windows: its activations stay bounded whatever the piece's length (one call
        # for a 28 s piece holds ~2 GB of them on the real codec)
        stream = self.tts.codec_stream(StreamOptions(first_frames=CODEC_WINDOW, chunk_frames=CODEC_WINDOW))
        wav = np.concatenate([*stream.push(codes), stream.flush()]) if len(codes) else np.zeros(0, np.float32)
        wav = np.array(wav, np.float32)
        k = min(int(lf.fade_ms * f.sample_rate / 1000), wav.size // 2)
        if k:
            ramp = (0.5 - 0.5 * np.cos(np.linspace(0, np.pi, k, dtype=np.float32)))
            wav[:k] *= ramp
            wav[-k:] *= ramp[::-1]
        last = i == len(self.pieces) - 1
        pause = 0.0 if last else (lf.paragraph_pause_s if self.pieces[i].paragraph_end else lf.pause_s)
        return np.concatenate([wav, np.zeros(int(pause * f.sample_rate), np.float32)])

    def write(self, on_piece: Callable[[PieceResult], None] | None = None) -> Path:
        """Run the job into `<out>.partial` piece by piece (memory stays flat with the text's length), rename it to
        `out` at the end and remove the work folder. An interrupted run leaves the partial file and the work folder:
        run again with `resume=True`."""
        from ..audio import GrowingAudioFile

        sink = GrowingAudioFile(self.out, self.tts.facts.sample_rate)
        try:
            for piece in self.run():
                sink.write(piece.waveform)
                if on_piece:
                    on_piece(piece)
        except BaseException:
            sink.abandon()
            raise
        path = sink.commit()
        shutil.rmtree(self.work, ignore_errors=True)
        return path


def _voice_id(voice) -> str:
    h = hashlib.sha256(np.ascontiguousarray(voice.rows).tobytes())
    h.update(str(voice.ref_text).encode())
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def generate_long(tts, text: str, out: str | os.PathLike, voice=None, options: GenerationOptions | None = None,
                  lf: LongFormOptions | None = None, resume: bool = False,
                  on_piece: Callable[[PieceResult], None] | None = None) -> Path:
    """Synthesize `text` into one recording at `out` (see the module docstring); returns the path."""
    return LongForm(tts, text, out, voice, options, lf, resume).write(on_piece)


__all__ = ["LongForm", "LongFormOptions", "Piece", "PieceResult", "generate_long", "read_text_file"]
