"""The step graph (`parts/llm_step.py`): the audio embedding, the decoder and the audio heads composed into one graph
at assembly, so a decode step is one runtime call. It holds no weights of its own, replaces the decoder session
(never loaded beside it), gives exactly the codes of the three parts driven apart, and an export without it (older
folders) still runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from higgs_onnx.manifest import MANIFEST, link_or_copy, load_manifest, rewrite_manifest
from higgs_onnx.parts import llm_step
from higgs_onnx.runtime.model import HiggsTTS

pytestmark = pytest.mark.slow  # every test here needs the tiny exports
ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "tests" / "data" / "ref_en_24k.wav"


def _copy(export: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in export.iterdir():
        if f.is_file():
            (shutil.copyfile if f.name in (MANIFEST, llm_step.FILE) else link_or_copy)(f, dst / f.name)
    return dst


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_composed_from_the_parts_files_without_weights_of_its_own(builds, precision):
    m = load_manifest(builds[precision], verify=True)
    entry = m.parts["llm_step"]
    assert entry["uses"] == ["llm_decoder", "audio_embed", "audio_heads"] and entry["derived"]
    assert entry["parity"] == {"max_rel_diff": 0.0, "argmax_equal": True, "rows": 3, "ok": True}
    assert entry["precision"] == m.parts["llm_decoder"]["precision"]
    assert list(entry["files"]) == ["llm_step.onnx"]
    graph = onnx.load(str(m.part_file("llm_step")), load_external_data=False).graph
    where = {e.value for t in graph.initializer for e in t.external_data if e.key == "location"}
    assert where == {"llm_decoder.onnx.data", "audio_embed.onnx.data", "audio_heads.onnx.data"}
    inline = sum(len(t.raw_data) for t in graph.initializer)
    decoder_data = m.path("llm_decoder.onnx.data").stat().st_size
    assert inline < 0.01 * decoder_data, (inline, decoder_data)  # constants only: the weights stay in the parts' files
    names = {i["name"] for i in entry["inputs"]} | {o["name"] for o in entry["outputs"]}
    assert {"inputs_embeds", "audio_codes", "attention_mask", "hidden_states", "logits"} <= names


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_same_codes_as_the_parts_apart(builds, precision):
    """Zero-shot and cloned, sampled, alone and as a batch of three of different lengths, and streamed."""
    # the route off: the parts apart have none, and it rounds differently from int4 (tests/test_route.py)
    step, parts = (HiggsTTS(builds[precision], step_graph=s, route="off") for s in (True, False))
    assert step.backend.fused and step.backend.decoder_part == "llm_step"
    assert not parts.backend.fused and parts.backend.decoder_part == "llm_decoder"
    for seed in (1, 2):
        a = step.generate("Hello there, one more test.", seed=seed, max_rows=70)
        b = parts.generate("Hello there, one more test.", seed=seed, max_rows=70)
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.waveform, b.waveform)
    a = step.generate("A cloned line.", ref_audio=REF, seed=3, max_rows=50).codes
    np.testing.assert_array_equal(a, parts.generate("A cloned line.", ref_audio=REF, seed=3, max_rows=50).codes)
    rows = []
    for tts in (step, parts):
        with tts.scheduler(3, 512) as sched:
            hs = [sched.submit(tts.request(t, seed=i, slot=512, max_rows=30 + 15 * i), "speech")
                  for i, t in enumerate(("One.", "Two words here.", "And a third, longer line of text."))]
            sched.run_until_idle()
            rows.append([h.speech().codes for h in hs])
    for x, y in zip(*rows, strict=True):
        np.testing.assert_array_equal(x, y)
    chunks = [np.concatenate([c.samples for c in tts.stream("Streamed words.", seed=5, max_rows=40)])
              for tts in (step, parts)]
    np.testing.assert_array_equal(*chunks)


def test_one_runtime_call_per_decode_step(builds):
    """After the prefill (and the heads once on its last hidden state) each row costs one call of the step graph:
    the audio embedding and heads sessions are not called again."""
    tts = HiggsTTS(builds["int4"], route="off")  # the int8 route would take the prefill (tests/test_route.py)
    tts.generate("Warm up.", max_rows=10)
    calls = {"llm_step": 0, "audio_heads": 0, "audio_embed": 0}

    def counting(name, run):
        def counted(*args, **kwargs):
            calls[name] += 1
            return run(*args, **kwargs)
        return counted

    step = tts.part("llm_step").session
    step.run_with_iobinding = counting("llm_step", step.run_with_iobinding)
    for name in ("audio_heads", "audio_embed"):
        s = tts.part(name).session
        s.run = counting(name, s.run)
    speech = tts.generate("Count my calls, please.", seed=0, max_rows=40)
    rows = len(speech.rows)
    assert rows > 10
    # one prefill call (a short prompt is one chunk), then one call per fed row (the last row is never fed)
    assert calls == {"llm_step": 1 + rows - 1, "audio_heads": 1, "audio_embed": 0}


def test_only_one_decoder_session_is_loaded(builds):
    tts = HiggsTTS(builds["int4"])
    ran = tts.preload()
    assert "llm_step" in ran and "llm_decoder" not in ran  # the same weights are never in memory twice
    assert "llm_decoder" in HiggsTTS(builds["int4"], step_graph=False).preload()


def test_an_export_without_the_step_graph_runs_as_before(builds, tmp_path):
    old = _copy(builds["int4"], tmp_path / "old")
    data = json.loads((old / MANIFEST).read_text())
    del data["parts"]["llm_step"]
    rewrite_manifest(old, data)
    (old / llm_step.FILE).unlink()
    tts = HiggsTTS(old)
    assert tts.backend.decoder_part == "llm_decoder" and not tts.backend.fused
    assert tts.backend.route_part is None  # the route is the step graph's twin: never without it
    want = HiggsTTS(builds["int4"], route="off").generate("Older folders.", seed=4, max_rows=40).codes
    np.testing.assert_array_equal(tts.generate("Older folders.", seed=4, max_rows=40).codes, want)


def test_the_check_refuses_a_step_graph_that_disagrees_with_its_parts(builds, tmp_path):
    """Logits scaled by 1.001 inside the graph (argmax unchanged) are beyond float rounding: the check says so, and
    a build with such a graph stops instead of shipping it."""
    folder = _copy(builds["fp32"], tmp_path / "off")
    path = folder / llm_step.FILE
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    last = next(n for n in g.node if "logits" in n.output)
    last.output[:] = ["logits_exact"]
    g.initializer.append(helper.make_tensor("off_by", onnx.TensorProto.FLOAT, [], [1.001]))
    g.node.append(helper.make_node("Mul", ["logits_exact", "off_by"], ["logits"]))
    onnx.save(model, str(path))
    import onnxruntime as ort

    tts = HiggsTTS(builds["fp32"], step_graph=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    fig = llm_step.check(tts, session)
    assert not fig["ok"] and fig["argmax_equal"] and 5e-4 < fig["max_rel_diff"] < 2e-3
    good = ort.InferenceSession(str(builds["fp32"] / llm_step.FILE), providers=["CPUExecutionProvider"])
    assert llm_step.check(tts, good)["ok"]


def test_a_build_whose_step_graph_disagrees_stops_and_keeps_the_old_folder(tiny_ckpt, tmp_path, monkeypatch):
    from higgs_onnx.export import Exporter, ExportOptions

    root = tmp_path / "bad_step"
    monkeypatch.setattr(llm_step, "check", lambda tts, session, **kw: {"max_rel_diff": 0.5, "argmax_equal": False,
                                                                      "rows": 3, "ok": False})
    with pytest.raises(RuntimeError, match="step graph disagrees with its parts"):
        Exporter(str(tiny_ckpt), root, ExportOptions("cpu", "fp32")).run()
    assert not (root / "cpu_fp32").exists()  # nothing that looks complete


def test_portable_decoder_gets_a_step_graph_too(tiny_ckpt, out_root):
    """The concat-cache graph (OpenVINO's ONNX route, DirectML) composes the same way."""
    from higgs_onnx.export import Exporter, ExportOptions

    export = Exporter(str(tiny_ckpt), out_root, ExportOptions("cpu", "fp32", attention="portable")).run()
    step, parts = (HiggsTTS(export, step_graph=s) for s in (True, False))
    assert type(step.backend.decoder).__name__ == "ConcatDecoder" and step.backend.fused
    assert load_manifest(export).parts["llm_step"]["parity"]["ok"]
    a = step.generate("Portable steps.", seed=6, max_rows=40).codes
    np.testing.assert_array_equal(a, parts.generate("Portable steps.", seed=6, max_rows=40).codes)


def test_bad_runtime_options_are_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match="kv_cache must be one of bound, host, got 'gpu'"):
        HiggsTTS(tmp_path / "nowhere", kv_cache="gpu")
    with pytest.raises(TypeError, match="step_graph must be True or False, got 'yes'"):
        HiggsTTS(tmp_path / "nowhere", step_graph="yes")
