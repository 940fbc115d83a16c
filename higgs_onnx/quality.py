"""An offline speech quality score: DNSMOS (Microsoft's deep noise suppression MOS predictor, ITU-T P.835 style).

DNSMOS predicts, from audio alone (no reference), what listeners would rate on a 1-5 scale: `sig` the speech signal
itself (distortion), `bak` the background (noise), `ovrl` the whole. It was trained on noisy and processed human
speech; it says whether audio sounds like clean speech, not whether it says the text (the ASR judge does that) or
sounds like the voice. Measured here (docs/evaluation.md, "Quality scores"): Piper's clean speech scores ovrl ~3.4,
this project's human recording 3.1, silence 1.8, white noise and the tiny synthetic model's output ~1.1.

The ONNX model ships in the `speechmos` wheel (pinned); it is run through our own onnxruntime session, because the
package's own runner imports librosa (and numba) for a second model (P.808, on a mel spectrogram) we do not use.
As the reference runner does: 16 kHz audio, windows of 9.01 s every second (shorter audio repeated to fill one),
each window's raw scores mapped by the published polynomials, averaged.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from pathlib import Path

import numpy as np

RATE = 16000
WINDOW_S = 9.01
INSTALL = "pip install speechmos==0.0.1.1"
# the non-personalised DNSMOS polynomials (raw model output -> MOS), from the reference implementation
POLY = {"sig": (-0.08397278, 1.22083953, 0.0052439), "bak": (-0.13166888, 1.60915514, -0.39604546),
        "ovrl": (-0.06766283, 1.11546468, 0.04602535)}


class NoDnsmos(RuntimeError):
    """The DNSMOS model is not installed: the message says what to install."""


def model_path() -> Path:
    spec = importlib.util.find_spec("speechmos")
    if spec is None or not spec.submodule_search_locations:
        raise NoDnsmos(f"DNSMOS needs the speechmos wheel, which is not installed: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / "dnsmos_models" / "sig_bak_ovr.onnx"
    if not path.is_file():
        raise NoDnsmos(f"the speechmos wheel has no {path.name}: reinstall it ({INSTALL})")
    return path


class Dnsmos:
    """One session, shared by threads (a lock: one window at a time)."""

    def __init__(self, path: Path | None = None):
        from .runtime.session import create_session

        self.session = create_session(Path(path or model_path()), "cpu", threads=1, name="dnsmos")
        self.input = self.session.get_inputs()[0].name
        self.lock = threading.Lock()

    def score(self, samples: np.ndarray, sample_rate: int) -> dict[str, float]:
        """{"sig", "bak", "ovrl"} (1-5) of mono float audio in [-1, 1]; ValueError for empty or non-finite audio."""
        from .audio import resample

        x = np.asarray(samples, np.float32).reshape(-1)
        if x.size == 0 or not np.isfinite(x).all():
            raise ValueError("DNSMOS needs non-empty, finite audio")
        x = np.clip(resample(x, int(sample_rate), RATE) if sample_rate != RATE else x, -1.0, 1.0)
        need = int(WINDOW_S * RATE)
        while x.size < need:
            x = np.concatenate([x, x])
        hops = int(np.floor(x.size / RATE - WINDOW_S)) + 1
        raw = []
        with self.lock:
            for i in range(hops):
                window = x[i * RATE: i * RATE + need]
                if window.size == need:
                    raw.append(self.session.run(None, {self.input: window[None, :]})[0][0])
        sig, bak, ovrl = np.mean([[np.polyval(POLY[k], r[j]) for j, k in enumerate(("sig", "bak", "ovrl"))]
                                  for r in raw], axis=0)
        return {"sig": round(float(sig), 3), "bak": round(float(bak), 3), "ovrl": round(float(ovrl), 3)}


@functools.cache
def dnsmos() -> Dnsmos:
    """The shared scorer (loaded once); NoDnsmos when the wheel is missing."""
    return Dnsmos()


def take_quality(samples: np.ndarray, sample_rate: int) -> dict:
    """A take's DNSMOS record for `takes.json`: {"dnsmos": {...}}, or {"dnsmos": None, "dnsmos_off": why}."""
    try:
        return {"dnsmos": dnsmos().score(samples, sample_rate)}
    except (NoDnsmos, ValueError) as e:
        return {"dnsmos": None, "dnsmos_off": str(e)}
