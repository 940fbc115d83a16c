"""Raw PCM out of the agent sockets (Cartesia, ElevenLabs): little-endian 16-bit or 32-bit float, mono, at a rate
the client names, resampled from the model's rate as the audio comes (soxr's streaming resampler, so chunk edges
leave no seams)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .engine import Refused

RATES = (8000, 16000, 22050, 24000, 44100, 48000)
ENCODINGS = {"pcm_s16le": "16-bit", "pcm_f32le": "32-bit float"}


@dataclass(frozen=True)
class Output:
    """The socket's audio: raw little-endian PCM (`encoding`, a key of ENCODINGS) at `rate` Hz, mono."""

    encoding: str
    rate: int

    @staticmethod
    def check(encoding, rate, native: int, params: tuple[str, str] = ("output_format", "output_format"),
              stream: str | None = None) -> Output:
        """The output, or Refused naming `params` (the encoding's field, the rate's)."""
        if not isinstance(encoding, str) or encoding not in ENCODINGS:
            raise Refused(f"{params[0]}: encoding {encoding!r:.40} is not served here; use one of "
                          f"{', '.join(ENCODINGS)}", params[0], "unsupported_format", stream)
        if isinstance(rate, bool) or not isinstance(rate, int) or rate not in RATES:
            raise Refused(f"{params[1]}: sample_rate {rate!r:.40} is not served here; use one of "
                          f"{', '.join(map(str, RATES))} (the model speaks at {native})", params[1],
                          "unsupported_format", stream)
        return Output(encoding, rate)


class PcmStream:
    """One segment's audio as bytes: resampled from the model's rate, then encoded. A new one for each segment, so
    each segment's audio is as long as it is at the model's rate and its words' times hold on the client's clock."""

    def __init__(self, output: Output, native: int):
        self.output = output
        self.resampler = None
        if output.rate != native:
            import soxr

            self.resampler = soxr.ResampleStream(native, output.rate, 1, dtype="float32", quality="HQ")

    def _encode(self, samples: np.ndarray) -> bytes:
        if self.output.encoding == "pcm_f32le":
            return np.clip(samples, -1.0, 1.0).astype("<f4").tobytes()
        return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()

    def push(self, samples: np.ndarray) -> bytes:
        samples = samples.astype(np.float32, copy=False)
        if self.resampler is not None:
            samples = self.resampler.resample_chunk(samples, last=False)
        return self._encode(samples) if samples.size else b""

    def finish(self) -> bytes:
        """What the resampler still holds."""
        if self.resampler is None:
            return b""
        tail = self.resampler.resample_chunk(np.zeros(0, np.float32), last=True)
        return self._encode(tail) if tail.size else b""
