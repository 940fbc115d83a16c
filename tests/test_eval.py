"""eval.py end to end: passes on good exports (also of a checkpoint with other dimensions than the presets), points at
the broken part of a bad one, and writes both reports (with plots) whatever failed."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from higgs_onnx.evaluation import SECTIONS, EvalOptions, Evaluator, Outputs, apply_gates, to_markdown, write_reports
from higgs_onnx.evaluation.report import RENDER
from higgs_onnx.evaluation.sections import teacher_codes
from higgs_onnx.generation.sampling import GREEDY
from higgs_onnx.runtime.model import HiggsTTS

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
eval_script = importlib.import_module("eval")  # the top-level eval.py


def eval_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "eval.py"), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "CI": "1"}, timeout=900)


def reports(folder: Path) -> tuple[dict, str]:
    """The JSON and the Markdown written to `folder`, after checking both hold every section."""
    rep, md = json.loads((folder / "r.json").read_text()), (folder / "r.md").read_text()
    assert list(rep["sections"]) == list(SECTIONS)
    for name in SECTIONS:
        assert f"## {RENDER[name][0]}" in md, name
    return rep, md


def test_fp32_passes_tight_gates_never_diverges_and_plots(builds, tiny_ckpt, tmp_path, capsys):
    rc = eval_script.main(["--model-path", str(builds["fp32"]), "--checkpoint", str(tiny_ckpt), "--runs", "1",
                           "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")])
    out = capsys.readouterr()
    assert rc == 0, out.out[-3000:] + out.err
    rep, md = reports(tmp_path)
    s = rep["sections"]
    assert rep["passed"] and not rep["failures"] and "PASS" in out.out
    for part, fig in s["parts"].items():
        assert fig["ok"], part
        if "cosine" in fig:
            assert fig["cosine"] >= 0.99999, part
    assert all(g["first_divergence"] is None for g in s["greedy"]["prompts"])
    assert all(t["top1"] == 1.0 and t["logit_cosine"] > 0.99999 for t in s["teacher_forced"]["prompts"])
    assert min(x["cosine"] for x in s["decoder_steps"]["per_step"]) > 0.99999
    assert len(s["decoder_steps"]["per_step"]) == EvalOptions.decode_steps + 1
    assert s["text_lm"]["next_token_agreement"] == 1.0 and s["text_lm"]["first_difference"] is None
    assert s["encoder"]["agreement"] == 1.0 and len(s["encoder"]["recordings"]) == 2
    assert s["audio"]["onnx_seconds"] == s["audio"]["torch_seconds"] > 0
    assert s["teacher_codes"] == {"skipped": "not asked (no --teacher-codes file)"}
    for png in ("decoder_steps", "teacher_top1", "greedy_rows", "spectrogram"):
        assert (tmp_path / "r_plots" / f"{png}.png").stat().st_size > 5000
        assert f"](r_plots/{png}.png)" in md


def test_int4_shows_small_losses_and_a_failing_gate_still_writes_both_reports(builds, reference, tmp_path):
    ev = Evaluator(HiggsTTS(builds["int4"]), reference, EvalOptions(runs=1))
    rep = ev.run()
    assert not rep.failures, rep.failures
    s = rep.sections
    dec = s["parts"]["llm_decoder"]
    assert 0.98 < dec["cosine"] < 0.99999 and dec["cosine_vs_dequantized"] > 0.999
    assert all(0.5 <= t["top1"] < 1.0 for t in s["teacher_forced"]["prompts"])
    assert s["sampled"]["eoc_rate"] == 1.0
    diverged = [g for g in s["greedy"]["prompts"] if g["first_divergence"] is not None]
    assert diverged and all(g["margin"] >= 0 and g["logit_scale"] > 0 for g in diverged)
    assert "| llm_decoder | int4 |" in to_markdown(rep)
    kv = s["kv_cache"]  # the int8 cache against its fp32 twin on the same weights, gated as at build time
    assert kv["mode"] == "PER_CHANNEL" and kv["hidden_cosine"] > 0.9995 and 0.9 <= kv["top1_agreement"] < 1.0
    gates = [c for c in rep.checks if c.section == "kv_cache"]
    assert {c.gate for c in gates} == set(kv["thresholds"]) and all(c.ok for c in gates)
    assert "## int8 KV cache" in to_markdown(rep)
    # the same figures under a gate that allows no divergence at all: the greedy gate fails, nothing else changes
    rep.checks = apply_gates(rep.sections, {**ev.gates, "greedy_near_tie": 0.0})
    assert len(rep.failures) == len(diverged) and all("divergence at row" in f for f in rep.failures)
    write_reports(rep, Outputs.resolve(tmp_path / "r.json", tmp_path / "r.md", None))
    saved, md = reports(tmp_path)
    assert not saved["passed"] and saved["failures"] == rep.failures and "**FAIL**" in md
    assert (tmp_path / "r_plots" / "greedy_rows.png").is_file()


def test_failing_gates_in_two_sections_still_write_both_reports(builds, tiny_ckpt, tmp_path, capsys):
    """--max-rows 24 is too short for the tiny model's EOC (sampled gate) and a teacher-forced cosine above 1 can
    never pass: exit 1, every section still ran and is in both reports."""
    (tmp_path / "p.txt").write_text("Hello there.\n<|emotion:elation|>A second line.\n")
    rc = eval_script.main(["--model-path", str(builds["fp32"]), "--checkpoint", str(tiny_ckpt), "--runs", "1",
                           "--max-rows", "24", "--prompts", str(tmp_path / "p.txt"), "--threshold",
                           "teacher_cosine=1.5", "--json", str(tmp_path / "r.json"), "--markdown",
                           str(tmp_path / "r.md"), "--no-plots"])
    err = capsys.readouterr().err
    assert rc == 1 and "FAILED: 2 check(s)" in err
    rep, md = reports(tmp_path)
    assert [c["gate"] for c in rep["checks"] if not c["ok"]] == ["teacher_cosine", "eoc_rate"]
    skipped = {k: v["skipped"] for k, v in rep["sections"].items() if "skipped" in v}
    assert skipped.pop("teacher_codes").startswith("not asked")
    assert skipped.pop("kv_cache") == "nothing to compare (the KV cache is fp32)"
    assert skipped.pop("route", "nothing to compare (the export has no int8 route)") == (
        "nothing to compare (the export has no int8 route)")
    assert not skipped or list(skipped) == ["intelligibility"] and "faster-whisper" in skipped["intelligibility"]
    assert not any("error" in v for v in rep["sections"].values())
    q = rep["sections"]["quality"]  # DNSMOS: the tiny model's audio does not sound like speech
    assert len(q["rows"]) == 2 and q["onnx_ovrl"] < 2.0 and q["torch_ovrl"] < 2.0 and "## Quality (DNSMOS)" in md
    assert not (tmp_path / "r_plots").exists() and "![" not in md


def test_teacher_codes_from_elsewhere(builds, reference, tmp_path):
    rows = reference.generate(EvalOptions.prompts[0], sampling=GREEDY).rows
    np.save(tmp_path / "rows.npy", rows)
    bad = rows.copy()
    bad[10:, 3] = (bad[10:, 3] + 17) % 1024
    np.save(tmp_path / "bad.npy", bad)
    tts = HiggsTTS(builds["fp32"])
    for name, want in (("rows.npy", 1.0), ("bad.npy", None)):
        ev = Evaluator(tts, reference, EvalOptions(runs=0, teacher_codes=tmp_path / name, tolerance=1e-3))
        tc = teacher_codes(ev)
        if want:
            assert tc["within_tolerance"] == want and tc["rows_outside"] == []
        else:
            assert tc["per_codebook"][3] < 0.5 and tc["rows_outside"][0] >= 10


def test_broken_decoder_is_pointed_at(builds, tiny_ckpt, tmp_path):
    """A decoder built from a checkpoint whose weights were changed, swapped into a good export."""
    from higgs_onnx.checkpoint import TensorFile, extract_qwen3
    from higgs_onnx.manifest import rewrite_manifest, sha256_file
    from higgs_onnx.parts.llm_decoder import build_from_qwen3 as build
    from higgs_onnx.st_stream import write_streaming

    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "changed")
    src = TensorFile(tiny_ckpt / "model.safetensors")
    victim = "body.layers.1.mlp.down_proj.weight"

    def produce(name):
        raw = src.raw(name)
        if name != victim:
            return raw
        w = np.frombuffer(raw, ml_dtypes.bfloat16).astype(np.float32)
        return (-0.5 * w).astype(ml_dtypes.bfloat16).tobytes()  # changed weights, same shape and dtype

    specs = [(n, i["dtype"], tuple(i["shape"])) for n, i in sorted(src.header.items())]
    write_streaming(ckpt / "model.safetensors", specs, produce)
    build(extract_qwen3(ckpt, tmp_path / "q"), tmp_path / "dec", "fp32", "cpu", tmp_path / "w")
    export = shutil.copytree(builds["fp32"], tmp_path / "export")
    manifest = json.loads((export / "manifest.json").read_text())
    for name, meta in manifest["parts"]["llm_decoder"]["files"].items():
        shutil.copyfile(tmp_path / "dec" / name, export / name)
        meta.update(size=(export / name).stat().st_size, sha256=sha256_file(export / name))
    rewrite_manifest(export, manifest)  # a deliberate edit: the manifest's digest is recomputed
    r = eval_cli("--model-path", export, "--checkpoint", tiny_ckpt, "--runs", "1", "--json", tmp_path / "r.json",
                 "--markdown", tmp_path / "r.md", "--no-plots")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "part llm_decoder" in r.stderr and "| llm_decoder | fp32 |" in r.stdout
    assert "| audio_heads | fp32 | maxabs" in r.stdout
    # the decoder's part row and its check in the summary, and the same two for the step graph (which runs on the
    # decoder's weights file)
    assert r.stdout.count("| NO |") == 4 and "part llm_step (fp32)" in r.stdout
    rep, md = reports(tmp_path)
    s = rep["sections"]
    assert s["encoder"]["agreement"] == 1.0  # runs through no decoder: not skipped
    for name in ("decoder_steps", "greedy", "teacher_forced", "sampled", "text_lm"):
        assert s[name]["skipped"].startswith("part llm_decoder failed its parity check"), name
    assert "Skipped: part llm_decoder failed its parity check" in md


def test_a_checkpoint_with_other_dimensions(tmp_path, capsys):
    """Not a preset: other width, depth, head counts, FFN size, context and vocabulary, exported fresh at fp32."""
    from higgs_onnx.export import Exporter, ExportOptions
    from higgs_onnx.synthetic import PRESETS, Plant, build

    dims = replace(PRESETS["tiny"], hidden=96, intermediate=160, layers=3, heads=6, kv_heads=3, head_dim=16,
                   max_positions=2048, base_vocab=768, vocab_size=896)
    # EOC after ~2 audio rows per text token (tiny: 6), so that --max-rows 120 sees clean stops
    ckpt = build(dims, tmp_path / "ckpt", seed=3, plant=Plant(eoc_ratio=2.0), progress=False)
    export = Exporter(str(ckpt), tmp_path / "onnx", ExportOptions("cpu", "fp32")).run()
    (tmp_path / "p.txt").write_text("Hello there.\n<|emotion:elation|>Speech from other dimensions.\n")
    rc = eval_script.main(["--model-path", str(export), "--checkpoint", str(ckpt), "--runs", "1", "--max-rows",
                           "120", "--prompts", str(tmp_path / "p.txt"), "--json", str(tmp_path / "r.json"),
                           "--markdown", str(tmp_path / "r.md")])
    out = capsys.readouterr()
    assert rc == 0, out.out[-3000:] + out.err
    rep, md = reports(tmp_path)
    assert rep["passed"] and rep["sections"]["parts"]["llm_decoder"]["ok"]
    assert rep["sections"]["sampled"]["eoc_rate"] == 1.0
    assert len(list((tmp_path / "r_plots").glob("*.png"))) == 4


def test_bad_arguments(builds, tmp_path, capsys):
    for args, message in ((["--threshold", "nonsense=1"], "GATE=VALUE"),
                          (["--recordings", str(tmp_path / "none.wav")], "none.wav does not exist"),
                          (["--json", str(tmp_path / "missing" / "r.json")], "missing does not exist"),
                          (["--runs", "-1"], "--runs must be >= 0")):
        assert eval_script.main(["--model-path", str(builds["fp32"]), *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
