"""Per-codebook sampling (spec §5.2): temperature -> top-k -> top-p -> softmax -> multinomial, pure NumPy.

`SamplingOptions` holds the only copy of the defaults (SGO 0.1.9 speech defaults, "measured on SeedTTS EN").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GREEDY_TEMPERATURE = 1e-5  # at or below this temperature sampling is argmax (SGO)


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.8
    top_k: int = 30  # <= 0 or >= vocab: off
    top_p: float = 0.8  # 1.0: off

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE


GREEDY = SamplingOptions(temperature=0.0, top_k=0, top_p=1.0)


def filter_logits(logits: np.ndarray, opts: SamplingOptions) -> np.ndarray:
    """(N, V) logits -> (N, V) temperature-scaled logits with filtered entries set to -inf."""
    return truncate(logits.astype(np.float32) / np.float32(opts.temperature), opts)


def truncate(x: np.ndarray, opts: SamplingOptions) -> np.ndarray:
    """(N, V) temperature-scaled log-weights -> the same with what top-k and top-p filter out set to -inf."""
    v = x.shape[-1]
    if 0 < opts.top_k < v:
        kth = np.partition(x, v - opts.top_k, axis=-1)[:, v - opts.top_k, None]
        x = np.where(x < kth, -np.inf, x)  # ties with the k-th value are kept
    if opts.top_p < 1.0:
        order = np.argsort(-x, axis=-1, kind="stable")
        sorted_x = np.take_along_axis(x, order, axis=-1)
        cum = np.cumsum(softmax(sorted_x), axis=-1)
        remove = cum > opts.top_p
        remove[:, 1:] = remove[:, :-1].copy()  # shift right: keep the token that crosses p
        remove[:, 0] = False  # top-1 always kept
        drop = np.zeros_like(remove)
        np.put_along_axis(drop, order, remove, axis=-1)
        x = np.where(drop, -np.inf, x)
    return x


def softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def sample_codes(logits: np.ndarray, rng: np.random.Generator, opts: SamplingOptions) -> np.ndarray:
    """(N, V) logits -> (N,) int64 codes, one independent draw per codebook."""
    if opts.greedy:
        return logits.argmax(axis=-1).astype(np.int64)
    return draw(softmax(filter_logits(logits, opts)).astype(np.float64), rng)


def draw(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(N, V) float64 probabilities -> (N,) int64 codes: one uniform draw per codebook through the inverse CDF."""
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random((probs.shape[0], 1)) * cdf[:, -1:]
    idx = (cdf <= u).sum(axis=-1)  # inverse CDF; zero-probability entries can never be drawn
    return np.minimum(idx, probs.shape[-1] - 1).astype(np.int64)
