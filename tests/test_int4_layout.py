"""The int4 layout: the quantizers (`quantize.quantize_block`), the bytes a step reads (`quantize.read_bytes`), the
build-time gate that chooses the decoder's block size and quantizer (`parts/int4_layout.py`) and its manifest
figures."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from higgs_onnx.export import ExportOptions
from higgs_onnx.manifest import load_manifest
from higgs_onnx.parts import int4_layout
from higgs_onnx.quantize import (
    LAYOUTS,
    dequantize_block,
    quantize_block,
    quantize_model_int4,
    read_bytes,
    read_bytes_per_weight,
)


def _weights(k: int = 256, n: int = 48) -> np.ndarray:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.02
    w[rng.integers(0, k, 20), rng.integers(0, n, 20)] *= 8  # a few outliers, as real weights have
    return w


def _block_sse(w: np.ndarray, layout: str, bs: int) -> np.ndarray:
    d = dequantize_block(*quantize_block(w, bs, layout)[:2], w.shape[0]) - w  # symmetric layouts only
    return (d.T.reshape(w.shape[1], -1, bs) ** 2).sum(-1)


@pytest.mark.parametrize("bs", [32, 64, 128])
def test_search_never_further_than_rtn(bs):
    """Its ratios include RTN's scale: no block is further from its weights, and some are nearer."""
    w = _weights()
    rtn, search = _block_sse(w, "rtn", bs), _block_sse(w, "search", bs)
    assert (search <= rtn * (1 + 1e-5) + 1e-12).all() and search.sum() < 0.97 * rtn.sum()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bs", [32, 64])
def test_matmulnbits_computes_the_dequantized_weights(layout, bs):
    """ONNX Runtime's kernel (accuracy level 0: fp32) multiplies by what `dequantize_block` reads back, zero points
    and a K that is not a multiple of the block included."""
    k, n = 200, 24
    w = _weights(k, n)
    packed, scales, zp = quantize_block(w, bs, layout)
    assert (zp is not None) == (layout == "asym")
    inits = [numpy_helper.from_array(packed, "q"), numpy_helper.from_array(scales, "s")]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "z"))
    node = helper.make_node("MatMulNBits", ["x", *(t.name for t in inits)], ["y"], domain="com.microsoft", K=k, N=n,
                            bits=4, block_size=bs, accuracy_level=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(
        "com.microsoft", 1)], ir_version=10)
    x = np.random.default_rng(1).standard_normal((3, k)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x @ dequantize_block(packed, scales, k, zp)
    assert np.abs(y - want).max() <= 1e-4 * np.abs(want).max()
    err = np.linalg.norm(dequantize_block(packed, scales, k, zp) - w) / np.linalg.norm(w)
    assert 0.02 < err < 0.2  # quantized, not copied, and not wrecked


def test_read_bytes_per_weight():
    """Codes 0.5 B, an fp32 scale per block, and at accuracy level 4 MLAS's fp32 block sum beside it."""
    assert read_bytes_per_weight(32, 4) == 0.75 and read_bytes_per_weight(32, 0) == 0.625
    assert read_bytes_per_weight(64, 4) == 0.625 and read_bytes_per_weight(128, 4) == 0.5625
    assert read_bytes_per_weight(32, 4, zero_points=True) == 0.5 + 8.5 / 32


def test_read_bytes_counts_the_kernel_not_the_file(tmp_path):
    k, n = 256, 64
    w = numpy_helper.from_array(_weights(k, n), "w")
    norm = numpy_helper.from_array(np.ones(k, np.float32), "norm")
    nodes = [helper.make_node("Mul", ["x", "norm"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], initializer=[w, norm])
    src = tmp_path / "fp32.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), str(src))
    assert read_bytes(src) == k * n * 4 + k * 4  # a float graph: as stored
    for bs, level in ((32, 4), (128, 4), (32, 0)):
        dst = tmp_path / f"b{bs}_{level}" / "q.onnx"
        assert quantize_model_int4(src, dst, block_size=bs, accuracy_level=level, layout="search") == 1
        assert read_bytes(dst) == k * n * read_bytes_per_weight(bs, level) + k * 4


def test_failures_rule():
    base = {"hidden_distance": 1e-3, "logit_distance": 2e-3}
    assert int4_layout.failures(dict(base), base) == []  # equal: no further
    got = int4_layout.failures({"hidden_distance": 1.1e-3, "logit_distance": 1e-3}, base)
    assert len(got) == 1 and got[0].startswith("hidden_distance 1.100e-03 > 32-rtn's 1.000e-03")


def test_the_gate_runs_where_the_build_quantizes():
    assert ExportOptions("cpu", "int4").gate_layout
    assert not ExportOptions("cpu", "int4", block_size=32).gate_layout  # an explicit block size wins
    assert not ExportOptions("cpu", "int4", attention="portable").gate_layout
    assert not ExportOptions("cuda", "int4").gate_layout and not ExportOptions("cpu", "fp32").gate_layout
    assert ExportOptions("cpu", "int4").block == 32 and ExportOptions("cpu", "int4", block_size=128).block == 128


def expected_layout(rows: list[dict]) -> tuple[list[tuple], tuple]:
    """The gate's rule replayed on its rows: the layouts it gates in order, and the one it chooses."""
    base, order, chosen, i = rows[0], [], int4_layout.BASELINE, 1
    for block in int4_layout.LADDER:
        order.append((block, int4_layout.QUANTIZER))
        if i >= len(rows) or int4_layout.failures(rows[i], base):
            i += 1
            break
        chosen, i = (block, int4_layout.QUANTIZER), i + 1
    if chosen == int4_layout.BASELINE:
        order.append((int4_layout.BASELINE[0], int4_layout.QUANTIZER))
        if not int4_layout.failures(rows[i], base):
            chosen = (int4_layout.BASELINE[0], int4_layout.QUANTIZER)
    return order, chosen


def test_the_rule_climbs_while_blocks_pass():
    row = {"block_size": 0, "quantizer": "", "hidden_distance": 1e-3, "logit_distance": 1e-3}
    far, near = dict(row, hidden_distance=2e-3), dict(row, hidden_distance=5e-4)
    assert expected_layout([row, far, far]) == ([(64, "search"), (32, "search")], (32, "rtn"))
    assert expected_layout([row, far, near]) == ([(64, "search"), (32, "search")], (32, "search"))
    assert expected_layout([row, near, far]) == ([(64, "search"), (128, "search")], (64, "search"))
    assert expected_layout([row, row, near]) == ([(64, "search"), (128, "search")], (128, "search"))


@pytest.mark.slow
def test_the_manifest_holds_the_chosen_layout_and_its_figures(builds):
    """The tiny int4 export's decoder: the gate's rows (the baseline first, then the candidates as the rule climbs),
    the rule applied to them, and the graph at the chosen block size."""
    m = load_manifest(builds["int4"], verify=False)
    info = m.parts["llm_decoder"]["int4_layout"]
    rows = info["candidates"]
    base = rows[0]
    assert (base["block_size"], base["quantizer"], base["verdict"]) == (*int4_layout.BASELINE, "baseline")
    order, chosen = expected_layout(rows)
    assert [(r["block_size"], r["quantizer"]) for r in rows[1:]] == order
    assert (info["block_size"], info["quantizer"]) == chosen
    assert len(info["prompts"]) == 3 and info["policy"] == int4_layout.POLICY
    for r in rows:
        ok = not int4_layout.failures(r, base)
        assert r["verdict"] == "baseline" if r is base else (r["verdict"] == "passes") == ok
        assert 0 < r["hidden_distance"] < 0.05 and 0 < r["logit_distance"] < 0.05  # tiny: int4 rounding, not noise
    dec = onnx.load(str(m.part_file("llm_decoder")), load_external_data=False)
    blocks = {a.i for n in dec.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "block_size"}
    assert blocks == {info["block_size"]}
    assert info["bytes_per_weight"] == read_bytes_per_weight(info["block_size"], 4)


@pytest.mark.slow
def test_the_floor_counts_what_the_step_reads(builds):
    """`bench.py`'s floor (`quantize.read_bytes`): every initializer of the int4 graph as stored plus MLAS's fp32
    block sums (one per scale, accuracy level 4); the graph's own, not the int8 route's weights that the decoder
    part's files also hold (the old floor summed the files)."""
    m = load_manifest(builds["int4"], verify=False)
    dec = onnx.load(str(m.part_file("llm_decoder")), load_external_data=False)
    stored = sum(int(np.prod(t.dims)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                 for t in dec.graph.initializer)
    sums = sum(4 * int(np.prod(t.dims)) for t in dec.graph.initializer if t.name.endswith("_scales"))
    assert sums > 0 and read_bytes(m.part_file("llm_decoder")) == stored + sums
