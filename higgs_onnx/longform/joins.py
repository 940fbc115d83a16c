"""Where two pieces of a long recording meet: each piece's edges faded in and out (a short ramp), the same samples
whether the piece is faded whole (`fade_edges`) or as its samples are made (`Edges`)."""

from __future__ import annotations

import numpy as np


class Edges:
    """One piece's samples as they are made: the first `k` faded in, the last `k` held back and faded out at the
    end, the same samples `fade_edges` gives the whole waveform (k shrinks to half the piece for a very short one, so
    nothing is handed out before 2k samples exist)."""

    def __init__(self, k: int):
        self.k, self.buf, self.size, self.started = k, [], 0, False

    def push(self, samples: np.ndarray) -> np.ndarray:
        self.buf.append(np.array(samples, np.float32))
        self.size += samples.size
        if not self.k:
            return self._take(0)
        if not self.started:
            if self.size < 2 * self.k:
                return np.zeros(0, np.float32)
            self.started = True
            wav = self._take(0)
            wav[:self.k] *= _ramp(self.k)
            self.buf = [wav]
        return self._take(self.k)

    def finish(self) -> np.ndarray:
        wav = self._take(0)
        if not self.started:
            return fade_edges(wav, self.k)
        if self.k:
            wav[-self.k:] *= _ramp(self.k)[::-1]
        return wav

    def _take(self, keep: int) -> np.ndarray:
        """Everything buffered but the last `keep` samples (those stay)."""
        wav = np.concatenate(self.buf) if self.buf else np.zeros(0, np.float32)
        out, rest = wav[:wav.size - keep], wav[wav.size - keep:]
        self.buf = [rest] if rest.size else []
        return out


def _ramp(k: int) -> np.ndarray:
    return 0.5 - 0.5 * np.cos(np.linspace(0, np.pi, k, dtype=np.float32))


def fade_edges(wav: np.ndarray, fade: int) -> np.ndarray:
    """`wav` with a raised-cosine fade-in and fade-out of `fade` samples (at most half of it each)."""
    k = min(fade, wav.size // 2)
    if k:
        ramp = _ramp(k)
        wav[:k] *= ramp
        wav[-k:] *= ramp[::-1]
    return wav
