"""The int8 KV cache (`parts/kv_cache.py`): what ONNX Runtime's GroupQueryAttention stores, the default cpu int4
build (calibrated, gated against the fp32 cache on the same weights, recorded in the manifest), the fp32 choice,
the refusals, a build whose gates fail, and the fp32 twin that eval.py and bench.py compare with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from higgs_onnx.parts import kv_cache

ROOT = Path(__file__).resolve().parent.parent


def _gqa(quant: bool, scale: float, heads=4, kv=2, hd=16):
    import onnxruntime as ort

    cache = T.INT8 if quant else T.FLOAT
    inputs = [h.make_tensor_value_info("q", T.FLOAT, [1, "S", heads * hd]),
              h.make_tensor_value_info("k", T.FLOAT, [1, "S", kv * hd]),
              h.make_tensor_value_info("v", T.FLOAT, [1, "S", kv * hd]),
              h.make_tensor_value_info("pk", cache, [1, kv, "P", hd]),
              h.make_tensor_value_info("pv", cache, [1, kv, "P", hd]),
              h.make_tensor_value_info("sk", T.INT32, [1]), h.make_tensor_value_info("tl", T.INT32, [])]
    names, inits, attrs = ["q", "k", "v", "pk", "pv", "sk", "tl"], [], {"num_heads": heads, "kv_num_heads": kv}
    if quant:
        names += [""] * (kv_cache.K_SCALE - len(names)) + ["ks", "vs"]
        inits = [h.make_tensor("ks", T.FLOAT, [1], [scale]), h.make_tensor("vs", T.FLOAT, [1], [scale])]
        attrs.update(k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=8)
    node = h.make_node("GroupQueryAttention", names, ["o", "pko", "pvo"], domain="com.microsoft", **attrs)
    outs = [h.make_tensor_value_info("o", T.FLOAT, None), h.make_tensor_value_info("pko", cache, None),
            h.make_tensor_value_info("pvo", cache, None)]
    model = h.make_model(h.make_graph([node], "gqa", inputs, outs, inits),
                         opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_gqa_stores_x_over_scale_rounded_and_reads_it_back():
    """The fact the calibration relies on (ORT 1.32, CPU EP): int8 cache = round(x / scale), saturating."""
    rng = np.random.default_rng(0)
    s = 4
    feeds = {"q": rng.standard_normal((1, s, 64), np.float32), "k": rng.standard_normal((1, s, 32), np.float32),
             "v": rng.standard_normal((1, s, 32), np.float32), "sk": np.array([s - 1], np.int32),
             "tl": np.array(s, np.int32)}
    o32, k32, _ = _gqa(False, 0.0).run(None, {**feeds, "pk": np.zeros((1, 2, 0, 16), np.float32),
                                              "pv": np.zeros((1, 2, 0, 16), np.float32)})
    scale = float(max(np.abs(feeds["k"]).max(), np.abs(feeds["v"]).max()) / 127)
    o8, k8, _ = _gqa(True, scale).run(None, {**feeds, "pk": np.zeros((1, 2, 0, 16), np.int8),
                                             "pv": np.zeros((1, 2, 0, 16), np.int8)})
    assert k8.dtype == np.int8
    np.testing.assert_array_equal(k8, np.clip(np.round(k32 / scale), -128, 127).astype(np.int8))
    assert 0 < np.abs(o8 - o32).max() < 0.1 * np.abs(o32).max()  # close, and really read from the int8 cache


def test_scales_per_channel_and_per_tensor():
    top = np.array([[1.0, 2.0], [4.0, 0.0]])
    pc, pt = kv_cache.scales(top, "PER_CHANNEL"), kv_cache.scales(top, "PER_TENSOR")
    assert pc.shape == (1, 2, 1, 2) and pt.shape == (1,) and pc.dtype == pt.dtype == np.float32
    np.testing.assert_allclose(pc[0, :, 0], np.maximum(top * kv_cache.MARGIN / 127, 1e-8), rtol=1e-6)
    assert pc[0, 1, 0, 1] > 0  # a channel that never moved still gets a usable scale
    np.testing.assert_allclose(pt, [4.0 * kv_cache.MARGIN / 127], rtol=1e-6)
    with pytest.raises(ValueError, match="PER_CHANNEL"):
        kv_cache.scales(top, "PER_ROW")


@pytest.mark.slow
def test_the_default_int4_build_keeps_an_int8_cache_that_passed_its_gates(builds):
    from higgs_onnx.manifest import load_manifest
    from higgs_onnx.runtime.model import HiggsTTS

    m = load_manifest(builds["int4"], verify=True)
    kv = m.decoder["kv_cache"]
    assert kv["dtype"] == "int8" and kv["mode"] == "PER_CHANNEL" and kv["bits"] == 8
    int4 = m.parts["llm_decoder"]["parity"]["cosine_vs_dequantized"]
    assert kv["int4_cosine"] == int4 and kv["thresholds"] == kv_cache.gates(int4)
    assert not kv_cache.failed_gates(kv["gates"], kv["thresholds"])
    assert 1 - kv["thresholds"]["hidden_cosine"] == pytest.approx(kv_cache.BUDGET * (1 - int4))
    assert kv_cache.cache_dtype(builds["int4"] / "llm_decoder.onnx") == "int8"
    assert {e["dtype"] for e in m.parts["llm_decoder"]["inputs"] if e["name"].startswith("past_")} == {"int8"}
    assert load_manifest(builds["fp32"], verify=True).decoder["kv_cache"] == {"dtype": "fp32"}
    tts = HiggsTTS(builds["int4"], verify=False)
    f = tts.facts
    assert tts.kv_bytes_per_position == 2 * f.layers * f.kv_heads * f.head_dim  # K and V, a byte a value
    assert HiggsTTS(builds["fp32"], verify=False).kv_bytes_per_position == 4 * tts.kv_bytes_per_position
    speech = tts.generate("The int8 cache speaks.", seed=1, max_rows=60)
    assert len(speech.rows) > 8 and speech.waveform.size > 0


@pytest.mark.slow
def test_the_fp32_twin_is_the_fp32_cache_build_on_the_same_weights(builds, tiny_ckpt, out_root, tmp_path):
    """`--kv-cache fp32` builds beside the default (its own folder); undoing the rewrite gives a graph that computes
    exactly what that build's graph does, and the two caches on the same weights stay close (the build's gates)."""
    from higgs_onnx.export import Exporter, ExportOptions
    from higgs_onnx.runtime.model import HiggsTTS

    opts = ExportOptions("cpu", "int4", kv_cache="fp32")
    assert opts.name == "cpu_int4_kvfp32" and ExportOptions("cpu", "int4").name == "cpu_int4"
    plain = Exporter(str(tiny_ckpt), out_root, opts).run()
    assert kv_cache.cache_dtype(plain / "llm_decoder.onnx") == "fp32"
    twin = kv_cache.fp32_twin(builds["int4"], tmp_path / "twin")
    # the int8 route off: each export measured its own crossover (tests/test_route.py)
    a = HiggsTTS(plain, verify=True, route="off").generate("Twins.", temperature=0, max_rows=40).rows
    b = HiggsTTS(twin, verify=True, route="off").generate("Twins.", temperature=0, max_rows=40).rows
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="quantized already"):
        kv_cache.quantize_cache(builds["int4"] / "llm_decoder.onnx", tmp_path / "x.onnx",
                                kv_cache.calibrate(twin))


@pytest.mark.slow
def test_failing_gates_keep_the_fp32_cache_or_fail_the_asked_build(tiny_ckpt, tmp_path, monkeypatch, capsys):
    from higgs_onnx.export import Exporter, ExportOptions
    from higgs_onnx.manifest import load_manifest

    monkeypatch.setattr(kv_cache, "TOP1", 1.01)  # no int8 cache can pass
    root = tmp_path / "gates"  # not the session's out_root: other tests check every folder there is complete
    folder = Exporter(str(tiny_ckpt), root, ExportOptions("cpu", "int4")).run()
    kv = load_manifest(folder).decoder["kv_cache"]
    assert kv["dtype"] == "fp32" and kv["int8_refused"]["dtype"] == "int8"
    assert "fails its gates (top1_agreement" in capsys.readouterr().out
    assert kv_cache.cache_dtype(folder / "llm_decoder.onnx") == "fp32"
    with pytest.raises(RuntimeError, match="int8 KV cache fails its gates.*--kv-cache fp32"):
        Exporter(str(tiny_ckpt), root, ExportOptions("cpu", "int4", kv_cache="int8", force=False)).run()
    assert kv_cache.cache_dtype(folder / "llm_decoder.onnx") == "fp32"  # the folder was left as it was


def test_an_int8_cache_is_refused_where_attention_keeps_none():
    from higgs_onnx.export import ExportOptions

    for kwargs in ({"device": "cpu", "attention": "portable"}, {"device": "cuda"}, {"device": "openvino"}):
        with pytest.raises(ValueError, match="int8 KV cache needs a GroupQueryAttention decoder"):
            ExportOptions(precision="int4", kv_cache="int8", **kwargs)
    assert ExportOptions("cpu", "fp32").cache_dtype == "fp32" and ExportOptions("cuda", "int4").cache_dtype == "fp32"
    r = subprocess.run([sys.executable, str(ROOT / "optimize.py"), "--synthetic", "tiny", "--attention", "portable",
                        "--kv-cache", "int8"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "CI": "1"}, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: an int8 KV cache needs"), r.stderr


def test_quantize_cache_refuses_a_graph_without_gqa(tmp_path):
    node = h.make_node("Identity", ["x"], ["y"])
    graph = h.make_graph([node], "g", [h.make_tensor_value_info("x", T.FLOAT, [1])],
                         [h.make_tensor_value_info("y", T.FLOAT, [1])])
    onnx.save(h.make_model(graph), str(tmp_path / "m.onnx"))
    with pytest.raises(ValueError, match="not a gqa decoder"):
        kv_cache.quantize_cache(tmp_path / "m.onnx", tmp_path / "o.onnx", {})
    assert json.loads(json.dumps(kv_cache.gates(0.999))) == kv_cache.gates(0.999)  # as the manifest stores them
    assert kv_cache.gates(None) == kv_cache.GATES and kv_cache.gates(0.999)["hidden_cosine"] == pytest.approx(0.995)
