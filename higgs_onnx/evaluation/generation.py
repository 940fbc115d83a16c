"""Sections that run the shared generation loop on both backends; each returns its figures, none judges.

Greedy, teacher-forced, speed and audio read the same greedy runs (`EvalContext.greedy_runs`, one per prompt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..generation.delay import codes_for_codec, reverse_delay
from ..generation.sampling import GREEDY, SamplingOptions, softmax
from ..parity import cosine, max_abs

if TYPE_CHECKING:
    from ..generation.engine import GenerationResult
    from .context import EvalContext

# Spectrogram frames: 1024-sample Hann windows (43 ms at 24 kHz), hop 256; magnitudes floored at -140 dB.
N_FFT, HOP, FLOOR = 1024, 256, 1e-7


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray, temperature: float) -> float:
    """Mean KL(p || q) over rows of the softmax at `temperature` (the sampler's distributions before filtering)."""
    p, q = softmax(p_logits / temperature), softmax(q_logits / temperature)
    return float(np.mean(np.sum(p * (np.log(p + 1e-12) - np.log(q + 1e-12)), axis=-1)))


def divergence(onnx: GenerationResult, torch: GenerationResult) -> dict:
    """Where two greedy runs first differ, and the reference's top-1/top-2 margin there (raw figures, no verdict)."""
    n = min(len(onnx.rows), len(torch.rows))
    rows = np.flatnonzero((onnx.rows[:n] != torch.rows[:n]).any(-1))
    if rows.size:
        row = int(rows[0])
        codebook = int(np.flatnonzero(onnx.rows[row] != torch.rows[row])[0])
        ref = torch.logits[row][codebook]  # (V,) the reference's logits of that codebook at that row
        top2 = np.sort(ref)[-2:]
        return {"first_divergence": row, "codebook": codebook, "margin": float(top2[1] - top2[0]),
                "logit_scale": float(np.abs(ref).max()), "onnx_code": int(onnx.rows[row, codebook]),
                "torch_code": int(torch.rows[row, codebook])}
    if len(onnx.rows) != len(torch.rows):  # equal rows, one run longer: it stopped where the other did not
        return {"first_divergence": n, "codebook": None, "margin": None, "logit_scale": None}
    return {"first_divergence": None, "codebook": None, "margin": None, "logit_scale": None}


def greedy(ev: EvalContext) -> dict:
    """Free-running greedy on both backends per prompt: first divergence, margin there, lengths, and the rows of
    both around the divergence (`window`, for the rows plot)."""
    out = []
    for text in ev.options.prompts:
        runs = ev.greedy_runs(text)
        o, t = runs["onnx"], runs["torch"]
        fig = {"prompt": text, **divergence(o, t)}
        start = max(0, (fig["first_divergence"] or 0) - ev.options.window)
        end = start + 2 * ev.options.window
        fig.update(onnx_rows=len(o.rows), torch_rows=len(t.rows), onnx_stop=o.stop_reason, torch_stop=t.stop_reason,
                   duration_ratio=len(o.codes) / max(len(t.codes), 1),
                   window={"start": start, "onnx": o.rows[start:end].tolist(), "torch": t.rows[start:end].tolist()})
        out.append(fig)
    return {"prompts": out}


def teacher_forced(ev: EvalContext) -> dict:
    """The reference's greedy rows fed to the export: per-codebook top-1 agreement, logit cosine, KL (T = 0.8)."""
    out = []
    for text in ev.options.prompts:
        t = ev.greedy_runs(text)["torch"]
        forced = ev.generate("onnx", text, GREEDY, 0, keep_logits=True, teacher=t.rows)
        lo, lt = np.stack(forced.logits), np.stack(t.logits)  # (L, N, V)
        agree = lo.argmax(-1) == lt.argmax(-1)  # (L, N)
        out.append({"prompt": text, "rows": len(t.rows), "top1": float(agree.mean()),
                    "top1_per_codebook": agree.mean(0).tolist(), "logit_cosine": cosine(lo, lt),
                    "logit_max_abs": max_abs(lo, lt), "logit_scale": float(np.abs(lt).max()),
                    "kl": kl_divergence(lt, lo, SamplingOptions().temperature)})
    return {"prompts": out}


def speed(ev: EvalContext) -> dict:
    """Rows per second and real-time factor of both backends over the greedy runs (same loop, same process)."""
    out = {}
    for name in ("onnx", "torch"):
        runs = [ev.greedy_runs(t)[name] for t in ev.options.prompts]
        seconds = sum(r.prefill_s + r.decode_s for r in runs)
        rows = sum(len(r.rows) for r in runs)
        out[name] = {"rows": rows, "seconds": seconds, "rows_per_s": rows / max(seconds, 1e-9),
                     "rtf": seconds / max(rows / ev.tts.facts.frame_rate, 1e-9)}
    return out


def log_spectrogram(wav: np.ndarray) -> np.ndarray:
    """(samples,) -> (N_FFT // 2 + 1, frames) magnitude in dB."""
    wav = np.pad(np.asarray(wav, np.float64), (0, max(0, N_FFT - len(wav))))
    frames = np.lib.stride_tricks.sliding_window_view(wav, N_FFT)[::HOP] * np.hanning(N_FFT)
    return 20 * np.log10(np.abs(np.fft.rfft(frames, axis=-1)).T + FLOOR)


def audio(ev: EvalContext) -> dict:
    """The first prompt's greedy codes of each backend decoded by its own codec (export / reference): durations and
    the log-spectral distance; the waveforms go to the spectrogram plot (`_` keys stay out of the JSON)."""
    text, f = ev.options.prompts[0], ev.tts.facts
    runs = ev.greedy_runs(text)
    wavs = {}
    for name, decode in (("onnx", ev.tts.decode_audio), ("torch", ev.ref.decode_audio)):
        raw = reverse_delay(runs[name].rows)  # (T, N)
        wavs[name] = decode(codes_for_codec(raw, f.codebook_size)) if len(raw) else np.zeros(0, np.float32)
    ev.ref.release_codec()  # see `sections.encoder`
    spec = {k: log_spectrogram(w) for k, w in wavs.items()}
    frames = min(s.shape[1] for s in spec.values())
    diff = spec["onnx"][:, :frames] - spec["torch"][:, :frames]
    return {"prompt": text, "sample_rate": f.sample_rate, "onnx_seconds": wavs["onnx"].size / f.sample_rate,
            "torch_seconds": wavs["torch"].size / f.sample_rate,
            "log_spectral_distance_db": float(np.mean(np.sqrt(np.mean(diff ** 2, axis=0)))),
            "_onnx": wavs["onnx"], "_torch": wavs["torch"]}


def sampled(ev: EvalContext) -> dict:
    """`runs` seeds per prompt at the default sampling: clean EOC stops of the export, durations vs PyTorch."""
    rows = []
    for text in ev.options.prompts:
        for seed in range(ev.options.runs):
            res = ev.run_both(text, SamplingOptions(), seed)
            rows.append({"prompt": text, "seed": seed, "stop": res["onnx"].stop_reason,
                         "frames": len(res["onnx"].codes), "torch_stop": res["torch"].stop_reason,
                         "torch_frames": len(res["torch"].codes)})
    ratios = [r["frames"] / max(r["torch_frames"], 1) for r in rows]
    return {"runs": rows, "eoc_rate": sum(r["stop"] == "eoc" for r in rows) / len(rows),
            "torch_eoc_rate": sum(r["torch_stop"] == "eoc" for r in rows) / len(rows),
            "mean_duration_ratio": float(np.mean(ratios))}
