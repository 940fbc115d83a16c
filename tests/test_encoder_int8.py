"""The codec encoder on the int8 GEMM (`parts/encoder_int8.py`): the rewrite of each Conv1d / MatMul against fp32
on small graphs (every stride, dilation and padding the codec uses), what stays fp32, the gate's verdict, and the
tiny int4 export's encoder as built (its form, figures and codes)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from higgs_onnx.parts import encoder_int8

# (name, C_in, C_out, kernel, stride, dilation, pads, bias): the DAC residual convs (dilations 1, 3, 9), its strided
# block convs (kernel 2r, stride r), HuBERT's feature extractor (no pads, stride 2), the pointwise convs
CONVS = [("/acoustic_encoder/res/conv1/Conv", 16, 64, 7, 1, 3, (9, 9), True),
         ("/acoustic_encoder/res/conv2/Conv", 64, 64, 1, 1, 1, (0, 0), True),
         ("/acoustic_encoder/block/conv1/Conv", 64, 32, 10, 5, 1, (3, 3), True),
         ("/semantic_model/feature_extractor/conv/Conv", 32, 32, 3, 2, 1, (0, 0), False),
         ("/encoder_semantic/conv/Conv", 32, 64, 3, 1, 1, (1, 1), False)]


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _chain() -> onnx.ModelProto:
    """x [1, 16, L] through the convs of `CONVS` in order (a Sin between, like the Snake), then a projection by
    a weight under HuBERT's scope, a grouped conv and a shallow one (both stay fp32), and `fc` (stays fp32)."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i, (name, cin, cout, k, s, d, pads, bias) in enumerate(CONVS):
        w = numpy_helper.from_array((rng.standard_normal((cout, cin, k)) / np.sqrt(cin * k)).astype(np.float32),
                                    f"w{i}")
        inits.append(w)
        ins = [x, w.name]
        if bias:
            inits.append(numpy_helper.from_array((0.1 * rng.standard_normal(cout)).astype(np.float32), f"b{i}"))
            ins.append(f"b{i}")
        nodes += [helper.make_node("Conv", ins, [f"c{i}"], name=name, kernel_shape=[k], strides=[s], dilations=[d],
                                   pads=list(pads)),
                  helper.make_node("Sin", [f"c{i}"], [f"s{i}"], name=f"{name}/act")]
        x = f"s{i}"
    inits += [numpy_helper.from_array((rng.standard_normal((64, 2, 5)) / 3).astype(np.float32), "wg"),
              numpy_helper.from_array((rng.standard_normal((64, 1, 1))).astype(np.float32), "ws"),
              numpy_helper.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float32), "wm"),
              numpy_helper.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float32), "wf")]
    nodes += [helper.make_node("Conv", [x, "wg"], ["g"], name="/semantic_model/pos_conv/Conv", group=32,
                               kernel_shape=[5], pads=[2, 2]),
              helper.make_node("Conv", ["g", "ws"], ["sh"], name="/acoustic_encoder/depthwise/Conv", group=64,
                               kernel_shape=[1]),
              helper.make_node("Transpose", ["sh"], ["t"], name="/semantic_model/t", perm=[0, 2, 1]),
              helper.make_node("MatMul", ["t", "wm"], ["m"], name="/semantic_model/proj/MatMul"),
              helper.make_node("MatMul", ["m", "wf"], ["y"], name="/fc/MatMul")]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, "L"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("length", [1000, 1237])  # the strided convs' output length follows an odd input
def test_rewrite_matches_fp32(tmp_path, length):
    fp32 = _chain()
    int8, counts = encoder_int8.rewrite(fp32, tmp_path)
    assert counts == {"convs": len(CONVS), "matmuls": 1}
    ops = [(n.op_type, n.name) for n in int8.graph.node]
    # the grouped and the shallow conv and `fc` stay fp32; every other conv and projection is on the integer GEMM
    assert [name for op, name in ops if op in ("Conv", "MatMul")] == [
        "/semantic_model/pos_conv/Conv", "/acoustic_encoder/depthwise/Conv", "/fc/MatMul"]
    assert sum(op == "MatMulInteger" for op, _ in ops) == len(CONVS) + 1
    w8 = [numpy_helper.to_array(t) for t in int8.graph.initializer if t.name.endswith("/w8")]
    assert all(w.dtype == np.int8 and np.abs(w).max() == 2 ** (encoder_int8.BITS - 1) - 1 for w in w8)
    x = np.random.default_rng(1).standard_normal((1, 16, length)).astype(np.float32)
    want = _session(fp32).run(None, {"x": x})[0]
    got = _session(int8).run(None, {"x": x})[0]
    assert got.shape == want.shape
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 0.05, rel  # 7-bit weights, u8 activations per tensor, through six GEMMs
    # one conv alone: the tap layout (kernel, dilation, stride, pads) is exact up to quantization: < 2 %
    one = helper.make_model(helper.make_graph([fp32.graph.node[4]], "one",
                                              [helper.make_tensor_value_info("s1", TensorProto.FLOAT, [1, 64, "L"])],
                                              [helper.make_tensor_value_info("c2", TensorProto.FLOAT, None)],
                                              [t for t in fp32.graph.initializer if t.name in ("w2", "b2")]),
                            opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    one8, _ = encoder_int8.rewrite(one, tmp_path)
    x = np.random.default_rng(3).standard_normal((1, 64, length)).astype(np.float32)
    a, b = _session(one).run(None, {"s1": x})[0], _session(one8).run(None, {"s1": x})[0]
    assert a.shape == b.shape == (1, 32, (length + 6 - 10) // 5 + 1)
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.02


def test_write_keeps_the_source_and_reads_external_data(tmp_path):
    src = tmp_path / "src" / "audio_encoder.onnx"
    src.parent.mkdir()
    onnx.save(_chain(), str(src), save_as_external_data=True, location="audio_encoder.onnx.data", size_threshold=0)
    before = (src.parent / "audio_encoder.onnx.data").read_bytes()
    dst = tmp_path / "dst" / "audio_encoder.onnx"
    dst.parent.mkdir()
    assert encoder_int8.write(src, dst, 7, encoder_int8.SEMANTIC) == {"convs": 2, "matmuls": 1}
    assert (src.parent / "audio_encoder.onnx.data").read_bytes() == before
    x = np.random.default_rng(2).standard_normal((1, 16, 900)).astype(np.float32)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    got = ort.InferenceSession(str(dst), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = _session(_chain()).run(None, {"x": x})[0]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05


def test_judge():
    names = ["a.flac", "b.flac"]
    dither = [[0.9, 0.8], [0.8, 0.7]]
    ok = encoder_int8.judge(names, [[0.95, 0.8], [0.8, 0.7]], dither)
    assert ok["ok"] and not ok["failed"] and ok["recordings"]["a.flac"]["mean"] == 0.875
    bad = encoder_int8.judge(names, [[0.95, 0.8], [0.79, 0.9]], dither)  # b: mean above, first codebook below
    assert not bad["ok"] and bad["failed"] == ["b.flac: first 0.790 < dithered 0.800"]
    worse = encoder_int8.judge(names, [[0.5, 0.5], [0.8, 0.7]], dither)
    assert [f.split(":")[0] for f in worse["failed"]] == ["a.flac", "a.flac"]


@pytest.mark.slow
def test_tiny_export_encoder(builds, reference):
    """The tiny int4 build's encoder: a form kept and recorded with every form's figures, its graph on the integer
    GEMM, and its codes of a bundled recording as the gate measured them (>= the dithered fp32's)."""
    from higgs_onnx.audio import load_reference
    from higgs_onnx.manifest import load_manifest

    m = load_manifest(builds["int4"], verify=True)
    e = m.parts["audio_encoder"]
    info = e["int8"]
    assert e["precision"] == "int8" and info["form"] in encoder_int8.FORMS and "MatMulInteger" in e["ops"]
    assert info["policy"] == encoder_int8.POLICY and info["bits"] == encoder_int8.BITS
    kept = info["forms"][info["form"]]
    assert kept["ok"] and set(kept["recordings"]) == {p.name for p in encoder_int8.recordings()}
    path = encoder_int8.recordings()[0]
    wav = load_reference(path, m.model["sample_rate"])
    got = encoder_int8.encode_all(m.part_file("audio_encoder"), [wav])[0]
    want = reference.encode_audio(wav).T  # (N, T), the PyTorch fp32 codec
    row = kept["recordings"][path.name]
    assert got.shape == want.shape
    assert (got == want).mean() >= row["dither_mean"] - 0.02  # the PyTorch codes, not the fp32 graph's: near-ties
    assert load_manifest(builds["fp32"], verify=False).parts["audio_encoder"]["precision"] == "fp32"
