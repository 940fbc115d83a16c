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


def read_code_rows(path, num_codebooks: int, codebook_vocab: int, what: str = "--codes") -> np.ndarray:
    """(L, N) int64 code rows from an .npy file (what `inference.py --save-codes` writes), or one clear ValueError."""
    import zipfile
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what} {path} is a folder, not an .npy file")
    if path.exists() and not path.is_file():  # /dev/zero, a pipe: np.load would read for ever
        raise ValueError(f"{what} {path} is not a regular file (a device or a pipe); give the .npy file")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        rows = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile):
        raise ValueError(f"{what} {path} is not a NumPy .npy array of code rows (inference.py --save-codes writes "
                         f"one)") from None
    if not isinstance(rows, np.ndarray) or rows.ndim != 2 or rows.shape[1] != num_codebooks \
            or not np.issubdtype(rows.dtype, np.integer):
        kind = f"{rows.dtype} {rows.shape}" if isinstance(rows, np.ndarray) else "an .npz archive"
        raise ValueError(f"{what} {path}: expected integer code rows of shape (L, {num_codebooks}), got {kind}")
    if len(rows) == 0:
        raise ValueError(f"{what} {path} has no rows")
    if rows.min() < 0 or rows.max() >= codebook_vocab:
        raise ValueError(f"{what} {path}: codes must lie in [0, {codebook_vocab})")
    return rows.astype(np.int64)
