"""eval.py: the report passes on good tiny exports and points at the broken part of a bad one."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from higgs_onnx.evaluate import Evaluator, to_markdown
from higgs_onnx.runtime.model import HiggsTTS

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def eval_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "eval.py"), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "CI": "1"}, timeout=900)


def test_fp32_passes_tight_gates_and_never_diverges(builds, tiny_ckpt, tmp_path):
    r = eval_cli("--model-path", builds["fp32"], "--checkpoint", tiny_ckpt, "--runs", "1", "--json",
                 tmp_path / "r.json", "--markdown", tmp_path / "r.md")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["passed"] and not rep["failures"]
    for part, fig in rep["parts"].items():
        assert fig["ok"], part
        if "cosine" in fig:
            assert fig["cosine"] >= 0.99999, part
    assert all(g["first_divergence"] is None and g["identical"] for g in rep["greedy"])
    assert all(t["top1"] == 1.0 and t["logit_cosine"] > 0.99999 for t in rep["teacher_forced"])
    assert min(s["cosine"] for s in rep["parts"]["llm_decoder"]["teacher_forced_steps"]) > 0.99999
    assert rep["text_lm"]["next_token_agreement"] == 1.0 and rep["text_lm"]["first_difference"] is None
    assert all(r["agreement"] == 1.0 for r in rep["parts"]["audio_encoder"]["recordings"].values())
    assert "## Parts" in (tmp_path / "r.md").read_text() and "PASS" in r.stdout


def test_int4_shows_small_losses_and_passes(builds, reference):
    rep = Evaluator(HiggsTTS(builds["int4"]), reference, runs=1).run()
    assert not rep.failures, rep.failures
    dec = rep.sections["parts"]["llm_decoder"]
    assert 0.98 < dec["cosine"] < 0.99999 and dec["cosine_vs_dequantized"] > 0.999
    assert all(0.5 <= t["top1"] < 1.0 for t in rep.sections["teacher_forced"])
    assert rep.sections["sampled"]["eoc_rate"] == 1.0
    md = to_markdown(rep)
    assert "| llm_decoder | int4 |" in md and "PASS" in md


def test_teacher_codes_from_elsewhere(builds, reference, tmp_path):
    tts = HiggsTTS(builds["fp32"])
    ev = Evaluator(tts, reference, runs=0)
    rows = reference.generate(ev.prompts[0], sampling=__import__("higgs_onnx.generation.sampling",
                                                                  fromlist=["GREEDY"]).GREEDY).rows
    np.save(tmp_path / "rows.npy", rows)
    bad = rows.copy()
    bad[10:, 3] = (bad[10:, 3] + 17) % 1024
    np.save(tmp_path / "bad.npy", bad)
    from higgs_onnx.evaluate import Report

    for name, want in (("rows.npy", 1.0), ("bad.npy", None)):
        rep = Report(meta={})
        ev.teacher_codes(rep, tmp_path / name, tolerance=1e-3)
        tc = rep.sections["teacher_codes"]
        if want:
            assert tc["within_tolerance"] == want and tc["rows_outside"] == []
        else:
            assert tc["per_codebook"][3] < 0.5 and tc["rows_outside"][0] >= 10


def test_broken_decoder_is_pointed_at(builds, tiny_ckpt, tmp_path):
    """A decoder built from a checkpoint whose weights were changed, swapped into a good export."""
    from higgs_onnx.checkpoint import TensorFile, extract_qwen3
    from higgs_onnx.manifest import sha256_file
    from higgs_onnx.parts.llm_decoder import build
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
    (export / "manifest.json").write_text(json.dumps(manifest))
    r = eval_cli("--model-path", export, "--checkpoint", tiny_ckpt, "--runs", "1")
    assert r.returncode == 1
    assert "part llm_decoder" in r.stderr and "| llm_decoder | fp32 |" in r.stdout
    assert "| audio_heads | fp32 | maxabs" in r.stdout
    assert r.stdout.count("| NO |") == 1  # only the decoder row fails


def test_bad_arguments(builds):
    r = eval_cli("--model-path", builds["fp32"], "--threshold", "nonsense=1")
    assert r.returncode == 2 and "GATE=VALUE" in r.stderr and "Traceback" not in r.stderr
