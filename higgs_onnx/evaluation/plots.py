"""PNG plots of a report, embedded by the Markdown report: what people look at before they read a table.

matplotlib is imported lazily and drawn on an Agg canvas (no pyplot, no display, no global figure state).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..outputs import atomic
from .gates import judge_divergence
from .generation import HOP, log_spectrogram
from .options import require_matplotlib
from .report import Report

log = logging.getLogger(__name__)
DYNAMIC_RANGE_DB = 100  # spectrogram colours span the loudest bin down to this many dB below it


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def decoder_steps(fig, s: dict, report: Report) -> None:
    steps = s["per_step"]
    x = [p["step"] for p in steps]
    tiny = 1e-12  # floor so that exact agreement (0) still shows on a log axis
    ax1, ax2 = fig.subplots(1, 2)
    ax1.semilogy(x, [max(1 - p["cosine"], tiny) for p in steps], "o-")
    ax1.set(title="1 - cosine per step (floor 1e-12)", xlabel="step (0 = last prefill position)", ylabel="1 - cosine")
    ax2.semilogy(x, [max(p["max_abs"], tiny) for p in steps], "o-", color="tab:red")
    if "limit_max_abs" in s:
        ax2.axhline(s["limit_max_abs"], ls="--", color="gray", label="fp32 limit")
        ax2.legend()
    ax2.set(title="max |ONNX - PyTorch| per step", xlabel="step (0 = last prefill position)", ylabel="max abs")
    fig.suptitle("Decoder hidden states vs the reference")


def teacher_forced(fig, s: dict, report: Report) -> None:
    ax = fig.subplots()
    prompts = s["prompts"]
    n = len(prompts[0]["top1_per_codebook"])
    width = 0.8 / len(prompts)
    for k, p in enumerate(prompts):
        ax.bar(np.arange(n) + (k - (len(prompts) - 1) / 2) * width, p["top1_per_codebook"], width,
               label=p["prompt"][:30])
    gate = report.meta["gates"].get("teacher_top1")
    if gate is not None:
        ax.axhline(gate, ls="--", color="gray", label=f"gate {gate} (all codebooks, worst prompt)")
    ax.set(title="Teacher-forced top-1 agreement per codebook", xlabel="codebook", ylabel="share of rows",
           ylim=(0, 1.05), xticks=range(n))
    fig.legend(fontsize="small", loc="outside lower center", ncol=2)


def greedy(fig, s: dict, report: Report) -> None:
    diverged = [p for p in s["prompts"] if p["first_divergence"] is not None]
    p = min(diverged, key=lambda q: q["first_divergence"]) if diverged else s["prompts"][0]
    w = p["window"]
    onnx, torch = np.asarray(w["onnx"]), np.asarray(w["torch"])  # (rows, N)
    axes = fig.subplots(onnx.shape[1], 1, sharex=True, squeeze=False)[:, 0]
    for c, ax in enumerate(axes):
        ax.step(w["start"] + np.arange(len(onnx)), onnx[:, c], where="post", label="ONNX")  # row r spans [r, r+1)
        ax.step(w["start"] + np.arange(len(torch)), torch[:, c], where="post", ls="--", label="PyTorch")
        if p["first_divergence"] is not None:
            ax.axvline(p["first_divergence"], color="red", lw=0.8)
        ax.set_ylabel(f"cb {c}", rotation=0, labelpad=18)
    axes[0].legend(loc="upper right", fontsize="small", ncol=2)
    axes[-1].set_xlabel("row")
    tolerance, verdict = judge_divergence(p, report.meta["gates"]["greedy_near_tie"])
    detail = "" if p["first_divergence"] is None else f" at row {p['first_divergence']}"
    detail += "" if p.get("margin") is None else f": margin {p['margin']:.3g}, tolerance {tolerance:.3g}"
    fig.suptitle(f"Greedy codes per codebook, '{p['prompt'][:50]}'\n{verdict}{detail}")


def spectrogram(fig, s: dict, report: Report) -> None:
    wavs = report.arrays.get("audio", {})
    specs = {k: log_spectrogram(wavs[k]) for k in ("onnx", "torch")}
    top = max(float(x.max()) for x in specs.values())
    axes = fig.subplots(1, 2, sharey=True)
    sr = s["sample_rate"]
    for ax, (name, spec) in zip(axes, specs.items(), strict=True):
        extent = (0, spec.shape[1] * HOP / sr, 0, sr / 2000)
        im = ax.imshow(spec, origin="lower", aspect="auto", extent=extent, vmin=top - DYNAMIC_RANGE_DB, vmax=top,
                       cmap="magma")
        ax.set(title=f"{'ONNX' if name == 'onnx' else 'PyTorch'} ({s[name + '_seconds']:.2f} s)", xlabel="s")
    axes[0].set_ylabel("kHz")
    fig.colorbar(im, ax=axes, label="dB")
    fig.suptitle(f"Greedy audio, '{s['prompt'][:40]}' (log-spectral distance {s['log_spectral_distance_db']:.3g} dB)")


# section -> (file name, figure size in inches, drawer)
PLOTS: dict[str, tuple[str, tuple[float, float], Callable]] = {
    "decoder_steps": ("decoder_steps.png", (10, 3.5), decoder_steps),
    "teacher_forced": ("teacher_top1.png", (8, 4.5), teacher_forced),
    "greedy": ("greedy_rows.png", (10, 9), greedy),
    "audio": ("spectrogram.png", (11, 4), spectrogram),
}


def write_plots(report: Report, folder: Path) -> dict[str, Path]:
    """Draw every plot whose section ran; {section: PNG path}. A plot that cannot be drawn is a warning, not a
    lost report; a PNG left from an earlier run whose section did not run now is removed."""
    require_matplotlib()
    folder = Path(folder)
    folder.mkdir(exist_ok=True)
    out = {}
    for name, (file, size, draw) in PLOTS.items():
        path, figures = folder / file, report.sections.get(name, {})
        path.unlink(missing_ok=True)
        if not figures or "skipped" in figures or "error" in figures:
            continue
        try:
            fig = _figure(*size)
            draw(fig, figures, report)
            with atomic(path, ".png") as tmp:
                fig.savefig(tmp)
        except Exception as e:  # a plot is an aid: the report is written without it
            log.warning("plot %s not drawn: %s: %s", file, type(e).__name__, e)
            continue
        out[name] = path
    return out
