"""The OpenVINO runtime (`runtime.openvino`): OvPart against onnxruntime on the tiny exports, refusal of ops OpenVINO
cannot run, and `to_ir` (int4 weight compression keeps the decoder close to fp32)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import openvino  # noqa: F401 - pinned in requirements.txt: a broken install fails here, it is not skipped
import pytest

from higgs_onnx.generation.codec_stream import END_UNKNOWN
from higgs_onnx.manifest import PART_NAMES
from higgs_onnx.parts.kv_cache import fp32_twin
from higgs_onnx.parts.openvino_ir import describe_ir, ir_signature, to_ir, weight_types
from higgs_onnx.runtime.openvino import OvPart, check_supported, read_model
from higgs_onnx.runtime.session import Part, ProviderError

pytestmark = pytest.mark.slow


def facts(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())["model"]


def random_feeds(name: str, part: Part, f: dict, rng: np.random.Generator, past: int = 5, seq: int = 3) -> dict:
    """Valid random inputs for each part, shaped from the ORT session and the model facts."""
    ins = {i.name: i for i in part.session.get_inputs()}
    if name == "llm_decoder":
        out = {"inputs_embeds": rng.standard_normal((1, seq, f["hidden"]), np.float32),
               "attention_mask": np.ones((1, past + seq), np.int64)}
        out.update({n: rng.standard_normal((1, f["kv_heads"], past, f["head_dim"]), np.float32)
                    for n in ins if n.startswith("past_key_values.")})
        return out
    if name == "text_embed":
        return {"input_ids": rng.integers(0, f["vocab_size"], (1, 7))}
    if name == "audio_embed":
        return {"audio_codes": rng.integers(0, f["codebook_vocab"], (1, 6, f["num_codebooks"]))}
    if name == "audio_heads":
        return {"hidden_states": rng.standard_normal((1, 4, f["hidden"]), np.float32)}
    if name == "audio_encoder":
        return {"waveform": 0.1 * rng.standard_normal((1, f["sample_rate"]), np.float32)}
    codes = rng.integers(0, f["codebook_size"], (1, f["num_codebooks"], 6))
    if name == "audio_tokenizer":
        return {"audio_codes": codes}
    assert name == "audio_tokenizer_stream"
    # END_UNKNOWN (2**62) does not fit int32, which the CPU plugin computes int64 in: OvPart saturates it
    states = {n: rng.standard_normal((1, *i.shape[1:]), np.float32) * 0.1 for n, i in ins.items()
              if n.startswith("state_in.")}
    return {"audio_codes": codes, "start": np.array([3]), "end": np.array([END_UNKNOWN]), **states}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def assert_same(a: dict, b: dict, rtol: float = 1e-4) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        if a[k].dtype.kind == "f":
            scale = max(float(np.abs(a[k]).max()), 1e-6)
            assert float(np.abs(a[k] - b[k]).max()) <= rtol * scale, (k, float(np.abs(a[k] - b[k]).max()), scale)
        else:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("name", PART_NAMES)
def test_fp32_parts_match_onnxruntime(builds, name):
    folder = builds["fp32"]
    ort_part, ov_part = Part(name, folder / f"{name}.onnx", "cpu", 1), OvPart(name, folder / f"{name}.onnx", 1)
    # the session facade shows what onnxruntime shows (names, dims incl. dim names, types, metadata)
    for mine, theirs in ((ov_part.session.get_inputs(), ort_part.session.get_inputs()),
                         (ov_part.session.get_outputs(), ort_part.session.get_outputs())):
        assert [(x.name, x.shape, x.type) for x in mine] == [(x.name, x.shape, x.type) for x in theirs]
    assert ov_part.input_types == ort_part.input_types and ov_part.output_names == ort_part.output_names
    assert ov_part.session.get_modelmeta().custom_metadata_map == ort_part.session.get_modelmeta().custom_metadata_map
    assert ov_part.inference_precision == "f32"  # not the bf16 OpenVINO picks by default on AVX-512-BF16 CPUs
    rng = np.random.default_rng(0)
    for _ in range(2):
        feeds = random_feeds(name, ort_part, facts(folder), rng)
        assert_same(ort_part(**feeds), ov_part(**feeds))


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_decoder_prefill_and_steps(builds, precision):
    """The ModelBuilder decoder (GroupQueryAttention; MatMulNBits at int4) through the ONNX front end, from an
    empty cache (past 0) and stepping with the presents fed back, as the runtime drives it."""
    folder = builds[precision]
    path = folder / "llm_decoder.onnx"
    ort_part, ov_part = Part("llm_decoder", path, "cpu", 1), OvPart("llm_decoder", path, 1)
    f, rng = facts(folder), np.random.default_rng(1)
    feeds = random_feeds("llm_decoder", ort_part, f, rng, past=0, seq=6)
    for step in range(4):
        a, b = ort_part(**feeds), ov_part(**feeds)
        if precision == "fp32":
            assert_same(a, b)
        else:  # int4 matmul kernels differ (ORT's accuracy level 4 quantizes activations)
            assert cosine(a["hidden_states"], b["hidden_states"]) > 0.999, step
        past = {k.replace("present.", "past_key_values."): v for k, v in a.items() if k.startswith("present.")}
        assert past["past_key_values.0.key"].shape[2] == 6 + step
        feeds = {"inputs_embeds": rng.standard_normal((1, 1, f["hidden"]), np.float32),
                 "attention_mask": np.ones((1, 7 + step), np.int64), **past}


def test_outputs_and_inputs_stay_intact_across_calls(builds):
    """Outputs are handed over without a copy and inputs are lent without one: neither may change when later
    calls (other shapes, as a growing cache has) run on the same pooled request."""
    path = builds["fp32"] / "llm_decoder.onnx"
    ort_part, ov_part = Part("llm_decoder", path, "cpu", 1), OvPart("llm_decoder", path, 1)
    f = facts(builds["fp32"])
    feeds = [random_feeds("llm_decoder", ort_part, f, np.random.default_rng(i), past=p, seq=1)
             for i, p in enumerate((128, 128, 131, 0, 7))]
    sent = [{k: v.copy() for k, v in x.items()} for x in feeds]
    got = [ov_part(**x) for x in feeds]
    for x in feeds[::-1]:
        ov_part(**x)
    for x, y, out in zip(feeds, sent, got, strict=True):
        assert all(np.array_equal(x[k], y[k]) for k in x)
        assert_same(ort_part(**y), out)
        assert all(v.flags.writeable for v in out.values())


def test_concurrent_calls(builds):
    path = builds["fp32"] / "llm_decoder.onnx"
    ort_part, ov_part = Part("llm_decoder", path, "cpu", 1), OvPart("llm_decoder", path, 1)
    f = facts(builds["fp32"])
    feeds = [random_feeds("llm_decoder", ort_part, f, np.random.default_rng(i), past=i, seq=2) for i in range(6)]
    want = [ort_part(**x)["hidden_states"] for x in feeds]
    wrong: list[int] = []

    def work(j: int) -> None:
        for r in range(12):
            i = (j + r) % len(feeds)
            if not np.allclose(ov_part(**feeds[i])["hidden_states"], want[i], atol=1e-4):
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(j,)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    with pytest.raises(KeyError, match="missing inputs"):  # a pooled request must not reuse stale inputs
        ov_part(**{k: v for k, v in feeds[0].items() if k != "attention_mask"})
    with pytest.raises(KeyError, match="no inputs named"):
        ov_part(**feeds[0], bogus=np.zeros(1))


def _graph_with(tmp_path: Path, op: str, domain: str) -> Path:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 3])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="pre"),
             helper.make_node(op, ["r"], ["y"], name="odd/node_0", domain=domain)]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    path = tmp_path / f"{op}.onnx"
    onnx.save(model, str(path))
    return path


def test_unsupported_op_is_a_provider_error(tmp_path):
    # com.microsoft Inverse: onnxruntime's CPU EP runs it, OpenVINO's ONNX front end has no conversion for it
    path = _graph_with(tmp_path, "Inverse", "com.microsoft")
    x = np.eye(3, dtype=np.float32)[None].repeat(2, 0) * 2
    np.testing.assert_allclose(Part("inv", path)(x=x)["y"], x / 4, rtol=1e-6)
    with pytest.raises(ProviderError) as e:
        OvPart("audio_heads", path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("audio_heads: OpenVINO CPU cannot run com.microsoft.Inverse")
    assert "odd/node_0" in msg
    with pytest.raises(ProviderError, match=r"^text_embed: .*custom\.test\.Frobnicate.*odd/node_0"):
        OvPart("text_embed", _graph_with(tmp_path, "Frobnicate", "custom.test"))


def test_device_unsupported_nodes_are_a_provider_error(tmp_path):
    """The `query_model` check: a model holding a node the device has no kernel for (here the front end's
    placeholder for an unconverted op, which `convert_partially` keeps)."""
    from openvino.frontend import FrontEndManager

    fem = FrontEndManager()  # these three must outlive the model (its placeholder nodes point into them)
    fe = fem.load_by_framework("onnx")
    source = fe.load(str(_graph_with(tmp_path, "Inverse", "com.microsoft")))
    model = fe.convert_partially(source)
    with pytest.raises(ProviderError, match=r"^audio_encoder: OpenVINO CPU cannot run \S*FrameworkNode"):
        check_supported("audio_encoder", model, "CPU")
    del model
    del source, fe, fem
    check_supported("fine", read_model(_graph_with(tmp_path, "Relu", ""))[0], "CPU")


def test_missing_device_is_a_provider_error(builds):
    with pytest.raises(ProviderError, match="llm_decoder: OpenVINO has no device NOSUCHDEVICE"):
        OvPart("llm_decoder", builds["fp32"] / "llm_decoder.onnx", device="NOSUCHDEVICE")


def test_to_ir_int4_compresses_and_stays_close(builds, tmp_path):
    fp32, int4 = builds["fp32"], builds["int4"]
    xml = to_ir(fp32 / "llm_decoder.onnx", tmp_path / "ov" / "llm_decoder.xml", "int4", block_size=32)
    assert xml.is_file() and xml.with_suffix(".bin").is_file()
    model, _ = read_model(xml)
    weights = weight_types(model)
    assert weights.get("i4", 0) >= 5 * facts(fp32)["layers"], weights  # q, k, v, o, gate, up, down per layer
    described = describe_ir(xml, "int4")  # also: no MatMul kept a float weight
    assert described["weights"] == weights
    # the IR is much smaller than the fp32 weights
    assert xml.with_suffix(".bin").stat().st_size < 0.6 * (fp32 / "llm_decoder.onnx.data").stat().st_size
    # I/O as the ONNX file declares it (names, dim names), for the manifest
    onnx_part = Part("llm_decoder", fp32 / "llm_decoder.onnx")
    sig = ir_signature(xml)
    assert [x["name"] for x in sig["inputs"]] == [i.name for i in onnx_part.session.get_inputs()]
    assert [x["shape"] for x in sig["inputs"]] == [i.shape for i in onnx_part.session.get_inputs()]
    ov_part = OvPart("llm_decoder", xml, 1)
    twin = fp32_twin(int4, tmp_path / "int4_fp32_cache")  # the int4 weights with the fp32 cache the IR has
    ort_int4 = Part("llm_decoder", twin / "llm_decoder.onnx")
    rng = np.random.default_rng(2)
    for past, seq in ((0, 6), (9, 1)):
        feeds = random_feeds("llm_decoder", onnx_part, facts(fp32), rng, past=past, seq=seq)
        ref, mine, theirs = (p(**feeds)["hidden_states"] for p in (onnx_part, ov_part, ort_int4))
        assert cosine(ref, mine) > 0.9  # random tiny weights: int4 loses more than on a trained model
        # both symmetric block-32 int4 of the same weights: NNCF rounds to nearest, the ORT export's scales come
        # from its layout gate's search (parts/int4_layout.py, 0.987 here); both land close together
        assert cosine(mine, theirs) > 0.98 and cosine(ref, theirs) > 0.9
    with pytest.raises(RuntimeError, match="without u4/i4 weights"):
        describe_ir(to_ir(fp32 / "llm_decoder.onnx", tmp_path / "f" / "llm_decoder.xml", "fp32"), "int4")


def test_to_ir_fp32_keeps_numbers_names_and_metadata(builds, tmp_path):
    name = "audio_tokenizer_stream"
    src = builds["fp32"] / f"{name}.onnx"
    xml = to_ir(src, tmp_path / f"{name}.xml", "fp32")
    ort_part, ov_part = Part(name, src, "cpu", 1), OvPart(name, xml, 1)
    assert ov_part.session.get_modelmeta().custom_metadata_map == ort_part.session.get_modelmeta().custom_metadata_map
    assert [(i.name, i.type) for i in ov_part.session.get_inputs()] == \
        [(i.name, i.type) for i in ort_part.session.get_inputs()]
    feeds = random_feeds(name, ort_part, facts(builds["fp32"]), np.random.default_rng(3))
    assert_same(ort_part(**feeds), ov_part(**feeds))
    with pytest.raises(ValueError, match="precision"):
        to_ir(src, tmp_path / "x.xml", "int8")
