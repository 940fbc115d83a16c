"""The autoregressive loop of spec §5.2 (SGO sampler state machine), shared by every backend.

    E = embed(prompt); h = backbone(E)              # prefill; h at <|audio|> predicts the first row
    for step in range(max_rows):
        codes = sample(audio_heads(h))               # (N,) one draw per codebook
        ramp-in  (step < N):  codebooks > step are forced to BOC
        wind-down: after EOC on codebook 0, N-2 more rows, then stop (the finishing row is kept)
        h = backbone(audio_embed(codes))
    raw = reverse_delay(rows); codes >= codebook_size -> 0; waveform = codec(raw)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .delay import reverse_delay
from .sampling import SamplingOptions, sample_codes


class Backend(Protocol):
    """What the loop needs from a model. Shapes: D hidden size, N codebooks, V codebook vocabulary (N*V rows)."""

    def embed_text(self, ids: np.ndarray) -> np.ndarray: ...  # (L,) int64 -> (L, D)
    def embed_audio(self, rows: np.ndarray) -> np.ndarray: ...  # (L, N) int64 -> (L, D)
    def prefill(self, embeds: np.ndarray, max_len: int) -> np.ndarray: ...  # (L, D) -> (D,) last hidden
    def decode(self, embed: np.ndarray) -> np.ndarray: ...  # (1, D) next input -> (D,) hidden
    def audio_logits(self, hidden: np.ndarray) -> np.ndarray: ...  # (D,) -> (N, V) float32


@dataclass(frozen=True)
class StopRules:
    num_codebooks: int
    boc: int
    eoc: int

    @property
    def wind_down(self) -> int:
        return self.num_codebooks - 2  # rows after the EOC row still generated (SGO: countdown = 8 - 2)


@dataclass
class GenerationResult:
    rows: np.ndarray  # (L, N) delayed rows as generated
    codes: np.ndarray  # (T, N) raw codes after reversing the delay (may hold BOC/EOC leftovers)
    stop_reason: str  # "eoc" or "max_rows"
    prompt_len: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    logits: list[np.ndarray] = field(default_factory=list)  # per-step (N, V), kept only when asked


def prompt_embeddings(backend: Backend, prompt: list[int], placeholder: int,
                      ref_rows: np.ndarray | None) -> np.ndarray:
    """(P, D): text positions embed their token, placeholder positions the k-th delayed reference row."""
    ids = np.asarray(prompt, dtype=np.int64)
    slots = np.flatnonzero(ids == placeholder)
    n_ref = 0 if ref_rows is None else len(ref_rows)
    if len(slots) != n_ref:
        raise ValueError(f"prompt has {len(slots)} audio placeholders but {n_ref} reference rows were given")
    text_pos = np.flatnonzero(ids != placeholder)
    text = backend.embed_text(ids[text_pos])
    embeds = np.empty((len(ids), text.shape[-1]), dtype=text.dtype)
    embeds[text_pos] = text
    if n_ref:
        embeds[slots] = backend.embed_audio(ref_rows)
    return embeds


def next_state(codes: np.ndarray, step: int, countdown: int, rules: StopRules) -> tuple[int, bool]:
    """Apply ramp-in / wind-down to this step's `codes` in place; returns (countdown, done)."""
    if step < rules.num_codebooks:  # ramp-in: codebook c starts at row c
        codes[step + 1:] = rules.boc
        return countdown, False
    if countdown >= 0:
        countdown -= 1
        return countdown, countdown <= 0
    if codes[0] == rules.eoc:
        return rules.wind_down, False
    return countdown, False


def generate(backend: Backend, prompt: list[int], rules: StopRules, sampling: SamplingOptions,
             rng: np.random.Generator, max_rows: int, placeholder: int, ref_rows: np.ndarray | None = None,
             on_row: Callable[[int], None] | None = None, keep_logits: bool = False,
             teacher_rows: np.ndarray | None = None, cached_prefix: tuple[int, dict] | None = None
             ) -> GenerationResult:
    """Run prefill and the decode loop; `teacher_rows` (L, N) forces the fed rows (teacher forcing).

    `cached_prefix` = (n, state): the first n prompt positions are already in `state` (a backend snapshot); only
    the rest of the prompt is prefilled.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    t0 = time.perf_counter()
    if cached_prefix is None:
        embeds = prompt_embeddings(backend, prompt, placeholder, ref_rows)
        hidden = backend.prefill(embeds, max_len=len(prompt) + max_rows)
    else:
        n, state = cached_prefix
        embeds = prompt_embeddings(backend, prompt[n:], placeholder, None)
        hidden = backend.prefill_cached(state, embeds, max_len=len(prompt) + max_rows)
    t1 = time.perf_counter()
    rows = np.empty((max_rows, rules.num_codebooks), dtype=np.int64)
    countdown, stop, n, logits_kept = -1, "max_rows", 0, []
    for step in range(max_rows):
        logits = backend.audio_logits(hidden)
        if keep_logits:
            logits_kept.append(logits)
        codes = sample_codes(logits, rng, sampling)
        countdown, done = next_state(codes, step, countdown, rules)
        if teacher_rows is not None:  # feed the given rows; stop where they end
            codes, done = teacher_rows[step].copy(), step + 1 == len(teacher_rows)
        rows[step], n = codes, step + 1
        if on_row:
            on_row(n)
        if done:
            stop = "eoc" if teacher_rows is None else "teacher"
            break
        if step + 1 < max_rows:
            hidden = backend.decode(backend.embed_audio(codes[None]))
    t2 = time.perf_counter()
    rows = rows[:n]
    return GenerationResult(rows=rows, codes=reverse_delay(rows), stop_reason=stop, prompt_len=len(prompt),
                            prefill_s=t1 - t0, decode_s=t2 - t1, logits=logits_kept)
