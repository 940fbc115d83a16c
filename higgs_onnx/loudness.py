"""Loudness normalisation (EBU R128 / ITU-R BS.1770 integrated loudness, measured by pyloudnorm).

`--loudness LUFS` (the CLI, long-form, corpus) and `"loudness"` (the server) bring every output to the same
integrated loudness, so audiobook chapters, podcast segments and corpus files sit at one level. A gain is applied
to the whole take; when that gain would push a sample past the peak ceiling (-1 dBFS, EBU R128's true-peak limit,
approximated by the sample peak) the gain is lowered to meet the ceiling and the result is quieter than asked for:
`Loudness.reached` says by how much. Audio too short to measure (under BS.1770's 400 ms gating block) or silent is
left as it is. Normalising needs the whole take, so it does not combine with streamed output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RANGE = (-70.0, -5.0)  # LUFS a user may ask for: broadcast -23, podcasts -16, audiobooks (ACX) -18 to -23
PEAK_CEILING = 10 ** (-1.0 / 20)  # -1 dBFS
BLOCK_S = 0.4  # BS.1770's gating block: shorter audio has no integrated loudness


@dataclass(frozen=True)
class Loudness:
    target: float
    measured: float | None  # LUFS before (None: too short or silent to measure)
    gain_db: float
    reached: float | None  # LUFS after

    def as_dict(self) -> dict:
        return {k: (None if v is None else round(v, 2)) for k, v in self.__dict__.items()}


def check_target(lufs: float | None, what: str = "--loudness") -> float | None:
    if lufs is None:
        return None
    if isinstance(lufs, bool) or not isinstance(lufs, (int, float)) or not RANGE[0] <= lufs <= RANGE[1]:
        raise ValueError(f"{what} must be a loudness in LUFS from {RANGE[0]:g} to {RANGE[1]:g} (e.g. -16 for a "
                         f"podcast, -23 for broadcast), got {lufs!r}")
    return float(lufs)


def measure(wav: np.ndarray, sample_rate: int) -> float | None:
    """Integrated loudness in LUFS; None when the audio is shorter than one gating block or silent."""
    import pyloudnorm

    x = np.asarray(wav, np.float64)
    if len(x) < int(BLOCK_S * sample_rate) + 1:
        return None
    value = pyloudnorm.Meter(sample_rate).integrated_loudness(x)
    return None if not np.isfinite(value) else float(value)


def normalise(wav: np.ndarray, sample_rate: int, target: float) -> tuple[np.ndarray, Loudness]:
    """`wav` (float, -1..1) brought to `target` LUFS under the peak ceiling."""
    measured = measure(wav, sample_rate)
    if measured is None:
        return wav, Loudness(target, None, 0.0, None)
    gain = 10 ** ((target - measured) / 20)
    peak = float(np.max(np.abs(wav))) if len(wav) else 0.0
    if peak * gain > PEAK_CEILING:
        gain = PEAK_CEILING / peak
    out = (np.asarray(wav, np.float32) * np.float32(gain)).astype(np.float32)
    gain_db = 20 * np.log10(gain)
    return out, Loudness(target, measured, float(gain_db), measured + float(gain_db))
