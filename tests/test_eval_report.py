"""eval's gates, runner and report writers on hand-made figures (no export needed: fast)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from higgs_onnx.evaluation import (
    GATES,
    NEAR_TIE_REL,
    RECORDINGS,
    EvalOptions,
    Outputs,
    Report,
    apply_gates,
    judge_divergence,
    parse_thresholds,
    write_reports,
)
from higgs_onnx.evaluation import runner as runner_module
from higgs_onnx.evaluation.gates import gates_for
from higgs_onnx.evaluation.report import RENDER
from higgs_onnx.evaluation.runner import GENERATION, Evaluator, Section

ROOT = Path(__file__).resolve().parent.parent
META = {"model_path": "onnx/cpu_fp32", "precision": "fp32", "checkpoint": "ckpt", "gates": GATES["fp32"],
        "seconds": {}}


def greedy_prompt(margin: float | None, row: int | None = 140, scale: float = 12.0) -> dict:
    """One prompt's greedy figures as the greedy section writes them."""
    window = {"start": 124, "onnx": [[5, 6, 7, 8]] * 32, "torch": [[5, 6, 7, 8]] * 16 + [[5, 9, 7, 8]] * 16}
    return {"prompt": "Hello there.", "first_divergence": row, "codebook": None if row is None else 1,
            "margin": margin, "logit_scale": None if margin is None else scale, "onnx_rows": 300, "torch_rows": 298,
            "onnx_stop": "eoc", "torch_stop": "eoc", "duration_ratio": 1.01, "window": window}


def test_near_tie_divergence_passes():
    """The case that failed a real fp32 export: a divergence at row 140 with a margin of 6e-5."""
    checks = apply_gates({"greedy": {"prompts": [greedy_prompt(6e-5)]}}, GATES["fp32"])
    assert len(checks) == 1 and checks[0].ok, checks
    assert checks[0].value == 6e-5 and checks[0].limit == pytest.approx(NEAR_TIE_REL * 12.0)
    assert "near-tie divergence at row 140" in checks[0].detail
    assert judge_divergence(greedy_prompt(6e-5), NEAR_TIE_REL)[1] == "near-tie divergence"


def test_wide_margin_divergence_fails():
    checks = apply_gates({"greedy": {"prompts": [greedy_prompt(None, row=None), greedy_prompt(0.5)]}},
                         GATES["fp32"])
    assert [c.ok for c in checks] == [True, False]
    assert "wide-margin divergence at row 140" in checks[1].detail and "a bug" in checks[1].detail
    assert checks[1].limit == pytest.approx(NEAR_TIE_REL * 12.0) and checks[1].value == 0.5


def test_divergence_is_reported_not_gated_below_fp32():
    assert apply_gates({"greedy": {"prompts": [greedy_prompt(0.5)]}}, GATES["int4"]) == []
    assert judge_divergence(greedy_prompt(0.5), None) == (pytest.approx(NEAR_TIE_REL * 12.0),
                                                           "wide-margin divergence")
    switched_off = gates_for("fp32", parse_thresholds(["greedy_near_tie=none"]))
    assert apply_gates({"greedy": {"prompts": [greedy_prompt(0.5)]}}, switched_off) == []


def test_thresholds_and_options_are_checked():
    assert parse_thresholds(["eoc_rate=0.9", "greedy_near_tie=1e-3"]) == (("eoc_rate", 0.9),
                                                                          ("greedy_near_tie", 1e-3))
    for bad in ("nonsense=1", "eoc_rate", "eoc_rate=lots"):
        with pytest.raises(ValueError, match="eoc_rate|GATE=VALUE"):
            parse_thresholds([bad])
    with pytest.raises(ValueError, match="runs"):
        EvalOptions(runs=-1)
    with pytest.raises(FileNotFoundError, match="nowhere.wav"):
        EvalOptions(recordings=(Path("nowhere.wav"),))
    with pytest.raises(ValueError, match="precision"):
        gates_for("int3")


def test_recordings_ship_with_the_package():
    """Package code reads no tests/data: the report's recordings are package data (sample-identical FLAC copies)."""
    package = ROOT / "higgs_onnx"
    assert sorted(p.name for p in RECORDINGS) == ["ref_de_22k_stereo.flac", "ref_en_24k.flac"]
    for path in RECORDINGS:
        assert path.is_relative_to(package) and path.with_suffix(".txt").is_file()
        a, sr_a = sf.read(path, dtype="int16")
        b, sr_b = sf.read(ROOT / "tests" / "data" / f"{path.stem}.wav", dtype="int16")
        assert sr_a == sr_b and np.array_equal(a, b)
    code = "".join(p.read_text() for p in (package / "evaluation").glob("*.py"))
    assert '"tests"' not in code and "'tests'" not in code  # no path built into the test folder


def test_plot_folder_defaults_beside_the_markdown(tmp_path):
    md = tmp_path / "r.md"
    assert Outputs.resolve(None, md, None).plots == tmp_path / "r_plots"
    assert Outputs.resolve(None, md, None, draw=False).plots is None
    assert Outputs.resolve(None, None, None).plots is None
    assert Outputs.resolve(None, md, tmp_path / "figs").plots == tmp_path / "figs"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Outputs(json=tmp_path / "missing" / "r.json").check()


def fake_evaluator(monkeypatch, sections: dict[str, Section]) -> Evaluator:
    """An Evaluator whose sections are `sections` (no export, no reference)."""
    monkeypatch.setattr(runner_module, "SECTIONS", sections)
    ev = object.__new__(Evaluator)
    ev.options, ev.gates = EvalOptions(runs=0), GATES["fp32"]
    ev.meta = lambda: {**META, "seconds": {}}
    ev.ran_on = lambda: {"llm_decoder": "CPUExecutionProvider"}
    return ev


def test_runner_skips_only_behind_a_failed_part_and_survives_a_broken_section(monkeypatch, tmp_path):
    def boom(ev):
        raise RuntimeError("ORT said no")

    parts = {"llm_decoder": {"precision": "fp32", "ok": False, "error": "Fail: bad graph"},
             "audio_encoder": {"precision": "fp32", "ok": True, "agreement": 1.0, "frames": 3}}
    ev = fake_evaluator(monkeypatch, {
        "parts": Section(lambda ev: parts),
        "encoder": Section(lambda ev: {"recordings": {"a.flac": {"samples": 9, "frames": 3, "agreement": 1.0,
                                                                 "per_codebook": [1.0]}}, "agreement": 1.0},
                           ("audio_encoder",)),
        "greedy": Section(lambda ev: {"prompts": [greedy_prompt(0.5)]}, GENERATION),
        "speed": Section(boom),
        "sampled": Section(lambda ev: {}, (), runner_module._not_asked_sampled),
    })
    report = ev.run(progress=lambda line: None)
    s = report.sections
    assert s["encoder"]["agreement"] == 1.0  # needs only the encoder: ran
    assert s["greedy"]["skipped"].startswith("part llm_decoder failed")
    assert s["speed"] == {"error": "RuntimeError: ORT said no"}
    assert s["sampled"] == {"skipped": "not asked (--runs 0)"}
    assert sorted(f.split(" ")[0] + " " + f.split(" ")[1] for f in report.failures) == ["part llm_decoder",
                                                                                      "speed broke:"]
    md = write_reports(report, Outputs(tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r_plots"))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert list(saved["sections"]) == ["parts", "encoder", "greedy", "speed", "sampled"] and not saved["passed"]
    assert "Skipped: part llm_decoder failed" in md and "**Broke**: RuntimeError: ORT said no" in md
    assert (tmp_path / "r.md").read_text() == md and "## Failures" in md


def hand_made_report() -> Report:
    """Every kind of figures the plots draw, one failing gate (the greedy divergence)."""
    steps = [{"step": k, "position": 16 + k, "cosine": 1 - 1e-9 * k, "max_abs": 1e-6 * (k + 1)} for k in range(9)]
    t = np.arange(24000) / 24000
    report = Report(meta=META)
    report.add("decoder_steps", {"per_step": steps, "max_abs": 9e-6, "cosine": 1.0, "limit_max_abs": 1e-3,
                                 "ok": True, "ref_max_abs": 10.0})
    report.add("greedy", {"prompts": [greedy_prompt(0.5), greedy_prompt(None, row=None)]})
    report.add("teacher_forced", {"prompts": [{"prompt": "Hello there.", "rows": 300, "top1": 0.99,
                                               "top1_per_codebook": [1.0, 0.98, 0.99, 1.0], "logit_cosine": 0.9999,
                                               "logit_max_abs": 0.1, "logit_scale": 30.0, "kl": 1e-4}]})
    report.add("audio", {"prompt": "Hello there.", "sample_rate": 24000, "onnx_seconds": 1.0, "torch_seconds": 1.0,
                         "log_spectral_distance_db": 0.5, "_onnx": np.sin(2 * np.pi * 440 * t).astype(np.float32),
                         "_torch": np.sin(2 * np.pi * 450 * t).astype(np.float32)})
    report.add("text_lm", {"skipped": "part text_embed failed its parity check"})
    report.checks = apply_gates(report.sections, GATES["fp32"])
    return report


def test_plots_are_written_and_embedded(tmp_path):
    report = hand_made_report()
    assert report.failures and "wide-margin divergence" in report.failures[0]
    (tmp_path / "out").mkdir()
    md = write_reports(report, Outputs.resolve(tmp_path / "out" / "r.json", tmp_path / "out" / "r.md", None))
    pngs = sorted(p.name for p in (tmp_path / "out" / "r_plots").iterdir())
    assert pngs == ["decoder_steps.png", "greedy_rows.png", "spectrogram.png", "teacher_top1.png"]
    for png in pngs:
        assert f"](r_plots/{png})" in md  # relative to the Markdown file
        assert (tmp_path / "out" / "r_plots" / png).read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "out" / "r.json").read_text())
    assert "_onnx" not in saved["sections"]["audio"] and "onnx" not in saved["sections"]["audio"]
    for name in report.sections:
        assert f"## {RENDER[name][0]}" in md
    assert "Skipped: part text_embed failed" in md


def test_json_is_strict(tmp_path):
    report = Report(meta=META)
    report.add("parts", {"audio_tokenizer": {"precision": "fp32", "ok": True, "snr_db": float("inf"),
                                             "max_abs": 0.0, "limit_max_abs": 1e-4}})
    write_reports(report, Outputs(json=tmp_path / "r.json"))
    text = (tmp_path / "r.json").read_text()
    assert "Infinity" not in text and json.loads(text)["sections"]["parts"]["audio_tokenizer"]["snr_db"] == "inf"
