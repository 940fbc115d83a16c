"""The portable decoder (standard ONNX ops only): op set per precision, parity with the reference, and the same
hidden states as ModelBuilder's GQA decoder through the runtime's `SimpleDecoder`."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

GREEDY_STEPS = 12


@pytest.fixture(scope="module")
def qwen3_dir(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from higgs_onnx.checkpoint import extract_qwen3

    return extract_qwen3(tiny_ckpt, tmp_path_factory.mktemp("pd_qwen3"))


@pytest.fixture(scope="module")
def portable(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from higgs_onnx.parts.portable_decoder import build_portable_decoder

    root = tmp_path_factory.mktemp("portable")
    return {p: build_portable_decoder(qwen3_dir, root / p, p) for p in ("fp32", "int4", "fp16")}


@pytest.fixture(scope="module")
def model_builder(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from higgs_onnx.parts.llm_decoder import FILE, build_from_qwen3

    root = tmp_path_factory.mktemp("mb")
    build_from_qwen3(qwen3_dir, root / "out", "fp32", "cpu", root / "work")
    return root / "out" / FILE


def op_types(path: Path) -> collections.Counter:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return collections.Counter((n.domain or "", n.op_type) for n in model.graph.node)


def test_ops_fp32_standard_only(portable):
    ops = op_types(portable["fp32"])
    assert {d for d, _ in ops} == {""}, ops
    types = {t for _, t in ops}
    assert not types & {"GroupQueryAttention", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                        "RotaryEmbedding", "MatMulNBits"}
    assert {"MatMul", "Softmax", "ReduceMean", "Sqrt", "CumSum", "Concat"} <= types
    assert set(op_types(portable["fp16"])) == set(ops)  # fp16: the same op types (more Casts)


def test_ops_int4_only_matmulnbits_contrib(portable, qwen3_dir):
    import onnx

    ops = op_types(portable["int4"])
    contrib = {t for d, t in ops if d}
    assert contrib == {"MatMulNBits"}, ops
    assert {d for d, _ in ops} == {"", "com.microsoft"}
    layers = json.loads((qwen3_dir / "config.json").read_text())["num_hidden_layers"]
    assert ops[("com.microsoft", "MatMulNBits")] == 5 * layers  # qkv, o, gate, up, down per layer
    assert ops[("", "MatMul")] == 2 * layers  # only the attention MatMuls stay float
    model = onnx.load(str(portable["int4"]), load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}[""] == 17


def test_io_names_match_model_builder(portable, model_builder):
    import onnxruntime as ort

    def io(path):
        s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return ({i.name: (i.type, len(i.shape)) for i in s.get_inputs()},
                {o.name: (o.type, len(o.shape)) for o in s.get_outputs()})

    want = io(model_builder)
    assert io(portable["fp32"]) == want
    assert io(portable["int4"]) == want
    genai = json.loads((portable["int4"].parent / "genai_config.json").read_text())
    mb = json.loads((model_builder.parent / "genai_config.json").read_text())
    for key in ("head_size", "num_key_value_heads", "num_attention_heads", "num_hidden_layers", "hidden_size",
                "filename", "inputs", "outputs"):
        assert genai["model"]["decoder"][key] == mb["model"]["decoder"][key], key
    assert genai["model"]["context_length"] == mb["model"]["context_length"]
    assert genai["search"]["past_present_share_buffer"] is False


@pytest.mark.parametrize("precision", ["fp32", "int4", "fp16"])
def test_parity(portable, reference, precision):
    from higgs_onnx.parity import check_part

    fig = check_part("llm_decoder", portable[precision], reference, precision)
    assert fig["ok"], fig
    if precision == "int4":
        assert fig["cosine_vs_dequantized"] > 0.999, fig


def test_greedy_identity_with_model_builder(portable, model_builder, reference):
    """Greedy audio generation: the portable decoder picks each step's codes (argmax of the audio head), the
    ModelBuilder decoder is fed the same rows; hidden states agree to 1e-4, codes are identical, and both match
    one full reference forward."""
    from higgs_onnx.parity import cosine, max_abs
    from higgs_onnx.runtime.decoder import SimpleDecoder
    from higgs_onnx.runtime.session import Part

    f = reference.facts
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(0, reference.tokenizer.get_vocab_size(), 9))
    prompt = reference.text_embed(ids).float().numpy()
    ours, theirs = (SimpleDecoder(Part("llm_decoder", p), f) for p in (portable["fp32"], model_builder))
    c_ours, c_theirs = ours.new_cache(64), theirs.new_cache(64)
    rows, got_ours, got_theirs, codes_ours, codes_theirs = [prompt], [], [], [], []
    step = prompt
    for _ in range(GREEDY_STEPS + 1):
        h_ours, h_theirs = ours.run(c_ours, step), theirs.run(c_theirs, step)
        got_ours.append(h_ours)
        got_theirs.append(h_theirs)
        pick = [reference.audio_head(torch.from_numpy(h[-1:])).argmax(-1) for h in (h_ours, h_theirs)]
        codes_ours.append(pick[0].numpy())
        codes_theirs.append(pick[1].numpy())
        step = reference.fused_embed(pick[0].clamp(max=f.codebook_size - 1)).float().numpy()  # (1, D)
        rows.append(step)
    hidden_ours, hidden_theirs = np.concatenate(got_ours), np.concatenate(got_theirs)
    assert hidden_ours.shape == (len(prompt) + GREEDY_STEPS, f.hidden)
    assert max_abs(hidden_ours, hidden_theirs) <= 1e-4 * max(1.0, float(np.abs(hidden_theirs).max()))
    assert np.array_equal(np.concatenate(codes_ours), np.concatenate(codes_theirs))
    for kind in ("key", "value"):  # the caches agree too
        for i in range(f.layers):
            n = f"past_key_values.{i}.{kind}"
            assert c_ours.arrays[n].shape == c_theirs.arrays[n].shape
            assert max_abs(c_ours.arrays[n], c_theirs.arrays[n]) <= 1e-4 * max(1.0, np.abs(c_theirs.arrays[n]).max())
    want = reference.hidden_states(np.concatenate(rows[:-1]))
    assert cosine(want, hidden_ours) > 0.9999
    assert max_abs(want, hidden_ours) <= 1e-4 * max(1.0, float(np.abs(want).max()))


def test_left_padded_batch(portable, reference):
    """Batch of two with a left-padded row: positions come from the mask's cumsum, padded keys are masked, so
    each row's hidden states equal its own unbatched run (prefill then one step)."""
    from higgs_onnx.runtime.session import Part

    f = reference.facts
    part = Part("llm_decoder", portable["fp32"])
    rng = np.random.default_rng(2)
    long, pad = 6, 2
    x = rng.standard_normal((2, long + 1, f.hidden)).astype(np.float32)
    x[1, :pad] = 0.0

    def empty(b):
        return {n: np.zeros((b, f.kv_heads, 0, f.head_dim), np.float32) for n in part.input_types
                if n.startswith("past_key_values.")}

    def run(embeds, mask, past):
        outs = part(inputs_embeds=embeds, attention_mask=mask, **past)
        return outs["hidden_states"], {n: outs[n.replace("past_key_values.", "present.")] for n in past}

    mask = np.ones((2, long), np.int64)
    mask[1, :pad] = 0
    h, past = run(x[:, :long], mask, empty(2))
    h2, _ = run(x[:, long:], np.concatenate([mask, np.ones((2, 1), np.int64)], 1), past)
    for b, start in ((0, 0), (1, pad)):
        want, p1 = run(x[b:b + 1, start:long], np.ones((1, long - start), np.int64), empty(1))
        want2, _ = run(x[b:b + 1, long:], np.ones((1, long - start + 1), np.int64), p1)
        np.testing.assert_allclose(h[b, start:], want[0], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(h2[b], want2[0], atol=1e-4, rtol=1e-4)
