"""Audio in and out (NumPy + soundfile + soxr; no torch): reference clips to mono at the codec rate, atomic writes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .outputs import atomic

MAX_REF_SECONDS = 100.0  # SGO `_MAX_REF_AUDIO_SEC`
MIN_REF_SECONDS = 1.0  # shorter clips are refused (SGO zero-pads them to this: mostly padding, no voice)
# what a reference must be to be a recording, for every job (the CLI, the API, the server, the corpus)
REF_RATES = (8000, 192000)  # Hz
MAX_REF_CHANNELS = 8
MIN_REF_PEAK = 1e-3  # -60 dBFS, after removing any DC offset: quieter is silence
MIN_REF_RMS = 1e-4  # -80 dBFS
MIN_REF_LEVELS = 16  # distinct sample values: fewer is a constant or a test signal, not a recording
WRITE_FORMATS = {".wav": ("WAV", "PCM_16"), ".flac": ("FLAC", "PCM_16"), ".ogg": ("OGG", "VORBIS")}


class AudioError(ValueError):
    """A reference clip that cannot be used; the message says why."""


def read_audio(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """(samples, channels) float32 and the sample rate of any file libsndfile reads."""
    import soundfile as sf

    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"reference audio {path} is a folder, not an audio file")
    if not path.exists():
        raise FileNotFoundError(f"reference audio {path} does not exist")
    if not path.is_file():
        raise AudioError(f"reference audio {path} is not a regular file (a device or a pipe): give an audio file")
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioError(f"cannot read reference audio {path}: {e}") from None
    return data, int(sr)


def to_mono(data: np.ndarray) -> np.ndarray:
    return data.mean(axis=1) if data.ndim == 2 else data


def resample(wav: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    if sr_in == sr_out:
        return wav.astype(np.float32, copy=False)
    import soxr

    return soxr.resample(wav.astype(np.float32, copy=False), sr_in, sr_out, quality="HQ").astype(np.float32)


def check_format(sr: int, channels: int, frames: int) -> None:
    """What a reference's header can tell (before decoding: a small file can claim hours): AudioError for a rate
    outside REF_RATES, more than MAX_REF_CHANNELS channels, or a length outside MIN_REF_SECONDS..MAX_REF_SECONDS."""
    if not REF_RATES[0] <= sr <= REF_RATES[1]:
        raise AudioError(f"the reference's sample rate is {sr} Hz; a recording is {REF_RATES[0]}-{REF_RATES[1]} Hz "
                         f"(24 kHz or more clones best)")
    if not 1 <= channels <= MAX_REF_CHANNELS:
        raise AudioError(f"the reference has {channels} channels; at most {MAX_REF_CHANNELS} are taken (mono clones "
                         f"best)")
    seconds = frames / sr
    if seconds > MAX_REF_SECONDS:
        raise AudioError(f"reference audio is {seconds:.1f} s long; the limit is {MAX_REF_SECONDS:.0f} s "
                         f"(trim it to a clean 5-20 s of speech)")
    if seconds < MIN_REF_SECONDS:
        raise AudioError(f"reference audio is {seconds:.3f} s long ({frames} samples at {sr} Hz); at least "
                         f"{MIN_REF_SECONDS:g} s is needed (a clean 5-20 s of speech clones best)")


def check_recording(data: np.ndarray, sr: int) -> np.ndarray:
    """(samples, channels) or (samples,) at `sr` -> mono float32, or AudioError when it is not a plausible
    recording: what `check_format` checks, then NaN, constant, silent, or a handful of distinct values (a test
    signal)."""
    data = np.asarray(data, dtype=np.float32)
    channels = data.shape[1] if data.ndim == 2 else 1
    wav = to_mono(data)
    if wav.size == 0:
        raise AudioError("reference audio is empty (0 samples)")
    if not np.isfinite(wav).all():
        raise AudioError("reference audio contains NaN or infinite samples")
    check_format(sr, channels, wav.size)
    levels = len(np.unique(wav[:1 << 20]))
    if levels == 1:
        if wav[0] == 0:
            raise AudioError("reference audio is silent: constant, every sample is zero")
        raise AudioError(f"reference audio is constant (every sample is {float(wav[0]):.4g}): no sound")
    ac = wav - wav.mean()
    peak, rms = float(np.abs(ac).max()), float(np.sqrt(np.mean(ac.astype(np.float64) ** 2)))
    if peak < MIN_REF_PEAK or rms < MIN_REF_RMS:
        raise AudioError(f"reference audio is silent (peak {20 * np.log10(max(peak, 1e-12)):.0f} dBFS, rms "
                         f"{20 * np.log10(max(rms, 1e-12)):.0f} dBFS); record it louder")
    if levels < MIN_REF_LEVELS:
        raise AudioError(f"reference audio holds only {levels} distinct sample values: a test signal, not a "
                         f"recording of speech")
    return wav


def prepare_reference(data: np.ndarray, sr: int, target_sr: int) -> np.ndarray:
    """Any channel count / rate -> mono float32 at `target_sr`; refuses what is not a recording (`check_recording`)."""
    return resample(check_recording(data, int(sr)), int(sr), target_sr)


def load_reference(path: str | os.PathLike, target_sr: int) -> np.ndarray:
    data, sr = read_audio(path)
    return prepare_reference(data, sr, target_sr)


def write_audio(path: str | os.PathLike, wav: np.ndarray, sr: int) -> Path:
    """Write mono audio; the format follows the extension. Atomic: a temp file renamed into place."""
    import soundfile as sf

    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"output {path} is a folder, not an audio file; name a file in it")
    fmt = WRITE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"unsupported output format {path.suffix!r}; use one of {', '.join(WRITE_FORMATS)}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"output folder {path.parent} does not exist")
    with atomic(path, path.suffix) as tmp:
        sf.write(tmp, np.clip(wav, -1.0, 1.0), sr, format=fmt[0], subtype=fmt[1])
    return path


class GrowingAudioFile:
    """Audio written as it is made, under `<name>.partial` until `commit` renames it to `<name>`: a file that is
    still growing (or was cut off) never looks complete. Each `write` flushes, so the partial file plays as far as
    it goes."""

    def __init__(self, path: str | os.PathLike, sr: int):
        import soundfile as sf

        self.path = Path(path)
        fmt = WRITE_FORMATS.get(self.path.suffix.lower())
        if fmt is None:
            raise ValueError(f"unsupported output format {self.path.suffix!r}; use one of {', '.join(WRITE_FORMATS)}")
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.file = sf.SoundFile(self.partial, "w", samplerate=sr, channels=1, format=fmt[0], subtype=fmt[1])
        self.samples = 0

    def write(self, samples: np.ndarray) -> None:
        self.file.write(np.clip(samples, -1.0, 1.0))
        self.file.flush()
        self.samples += samples.size

    def commit(self) -> Path:
        self.file.close()
        os.replace(self.partial, self.path)
        return self.path

    def abandon(self) -> Path:
        """Close what was written so far; it stays under the partial name."""
        self.file.close()
        return self.partial


def pcm16(samples: np.ndarray) -> bytes:
    """Float samples -> raw 16-bit little-endian PCM (what `aplay -f S16_LE` and `ffplay -f s16le` read)."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
