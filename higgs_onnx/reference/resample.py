"""Band-limited (windowed-sinc, polyphase) resampling with ``torchaudio.functional.resample`` semantics.

Why this exists: transformers' ``HiggsAudioV2TokenizerModel`` resamples its 24 kHz input to 16 kHz for the
semantic (HuBERT) branch with ``torchaudio.functional.resample(x, 24000, 16000)``, but torchaudio has no
build for the torch we pin. The codec was trained on torchaudio's output, so this module re-implements the
same algorithm (written from the math, not copied) and :mod:`higgs_onnx.reference.torchaudio_shim` exposes it
as ``torchaudio.functional.resample``.

Algorithm (after reducing ``orig``/``new`` by their gcd): one polyphase FIR bank of ``new`` filters, each
``2 * width + orig`` taps, applied with a strided ``conv1d`` (stride ``orig``). Filter ``j``, tap ``i`` is a
low-pass sinc with cutoff ``base = min(orig, new) * rolloff`` evaluated at
``t = (-j / new + i' / orig) * base`` (``i' = i - width``), clamped to ``±lowpass_filter_width`` zero
crossings, multiplied by a Hann window ``cos²(t·π / (2·lpw))`` (or a Kaiser window) and by ``base / orig``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_KAISER_DEFAULT_BETA = 14.769656459379492
_METHODS = ("sinc_interp_hann", "sinc_interp_kaiser")


def sinc_kernel(
    orig: int,
    new: int,
    lowpass_filter_width: int,
    rolloff: float,
    resampling_method: str,
    beta: float | None,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    """Return the ``[new, 1, 2*width + orig]`` polyphase kernel bank and the one-sided ``width``."""
    base_freq = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    # The kernel is computed in the waveform dtype with the same operation order as torchaudio (which
    # builds it in the waveform dtype). Computing it in float64 and casting is *more* exact, but it differs
    # from torchaudio's float32 kernel by ~1 ulp per tap; what we want is torchaudio's numbers, because those
    # are what the codec saw in training, so we reproduce its rounding rather than improve on it.
    idx = torch.arange(-width, width + orig, dtype=dtype, device=device)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=dtype, device=device)[:, None, None] / new + idx
    t = (t * base_freq).clamp(-lowpass_filter_width, lowpass_filter_width)
    if resampling_method == "sinc_interp_hann":
        window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    else:
        # beta as a default-dtype (float32) scalar, as torchaudio does, so float64 inputs round it alike.
        b = torch.tensor(float(_KAISER_DEFAULT_BETA if beta is None else beta), device=device)
        window = torch.i0(b * torch.sqrt(1 - (t / lowpass_filter_width) ** 2)) / torch.i0(b)
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones((), dtype=dtype, device=device), torch.sin(t) / t)
    kernel = kernel * (window * (base_freq / orig))
    return kernel, width


def resample(
    waveform: torch.Tensor,
    orig_freq: int,
    new_freq: int,
    lowpass_filter_width: int = 6,
    rolloff: float = 0.99,
    resampling_method: str = "sinc_interp_hann",
    beta: float | None = None,
) -> torch.Tensor:
    """Resample ``waveform`` (``[..., time]``, floating point) from ``orig_freq`` Hz to ``new_freq`` Hz.

    Drop-in for ``torchaudio.functional.resample``: output is ``[..., ceil(new_freq * time / orig_freq)]``
    in the input's dtype; ``orig_freq == new_freq`` returns ``waveform`` itself.
    """
    if orig_freq <= 0 or new_freq <= 0:
        raise ValueError(f"orig_freq and new_freq must be positive, got {orig_freq}, {new_freq}")
    if lowpass_filter_width <= 0:
        raise ValueError(f"lowpass_filter_width must be positive, got {lowpass_filter_width}")
    if resampling_method not in _METHODS:
        raise ValueError(f"resampling_method must be one of {_METHODS}, got {resampling_method!r}")
    if not torch.is_floating_point(waveform):
        raise TypeError(f"waveform must be floating point, got {waveform.dtype}")
    if orig_freq == new_freq:
        return waveform

    g = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // g, int(new_freq) // g
    kernel, width = sinc_kernel(
        orig, new, lowpass_filter_width, rolloff, resampling_method, beta, waveform.dtype, waveform.device
    )

    shape = waveform.shape
    flat = waveform.reshape(-1, shape[-1])
    n_wavs, length = flat.shape
    padded = F.pad(flat, (width, width + orig))
    out = F.conv1d(padded[:, None], kernel, stride=orig)  # [n_wavs, new (phase), frames]
    out = out.transpose(1, 2).reshape(n_wavs, -1)  # interleave phases -> time
    # Exact integer ceil(new * length / orig). torchaudio evaluates this through a float32 tensor, which
    # can only disagree (by one sample) for inputs longer than ~2**24 samples.
    target_length = -(-new * length // orig)
    return out[:, :target_length].reshape(*shape[:-1], target_length)
