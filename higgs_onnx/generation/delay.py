"""The codebook delay pattern (spec §5.1): codebook c is shifted down by c rows, padded with BOC above, EOC below."""

from __future__ import annotations

import numpy as np


def apply_delay(raw: np.ndarray, boc: int, eoc: int) -> np.ndarray:
    """(T, N) raw codes -> (T + N - 1, N) delayed rows."""
    t, n = raw.shape
    out = np.full((t + n - 1, n), eoc, dtype=np.int64)
    for c in range(n):
        out[:c, c] = boc
        out[c:c + t, c] = raw[:, c]
    return out


def reverse_delay(delayed: np.ndarray) -> np.ndarray:
    """(L, N) delayed rows -> (L - N + 1, N) raw codes (empty when L < N)."""
    length, n = delayed.shape
    t = max(length - n + 1, 0)
    out = np.empty((t, n), dtype=np.int64)
    for c in range(n):
        out[:, c] = delayed[c:c + t, c]
    return out


def codes_for_codec(raw: np.ndarray, codebook_size: int) -> np.ndarray:
    """(T, N) raw codes -> (1, N, T) codec input; BOC/EOC leftovers (>= codebook_size) become 0 (spec §5.1)."""
    codes = np.where(raw >= codebook_size, 0, raw)
    return np.ascontiguousarray(codes.T[None].astype(np.int64))
