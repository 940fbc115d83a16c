"""A portable `llm_decoder`: the Qwen3 body as a graph of standard ONNX ops only, for execution providers that lack
(or break) onnxruntime's contrib attention (`GroupQueryAttention`, `SimplifiedLayerNormalization`,
`SkipSimplifiedLayerNormalization`, `RotaryEmbedding` of ModelBuilder's graph).

The graph is written node by node with `onnx.helper`; every dimension comes from the extracted body's config.json.
Weights are streamed from the safetensors file into the external data file one tensor at a time (bf16 -> fp32/fp16
on the way), so RAM holds one weight whatever the model size.

I/O: the names, dtypes and shapes of ModelBuilder's cpu graph, so `runtime.decoder.SimpleDecoder` and the parity
code drive it unchanged:
    inputs_embeds [B, S, D], attention_mask int64 [B, T] (T = past + S),
    past_key_values.{i}.key / .value [B, KV, past, hd]
    -> hidden_states [B, S, D] (after the final RMSNorm), present.{i}.key / .value [B, KV, T, hd]
Float I/O is float32 for fp32 and int4, float16 for fp16 (like ModelBuilder's fp16 graphs; `Part` casts feeds).

Cache layout: a growing "concat" cache. present = Concat(past, new rows) on axis 2; nothing is written in place,
so `past_present_share_buffer` is false and `BoundDecoder` (shared buffers) does not apply: use `SimpleDecoder`.

Ops (default domain, opset 17): MatMul, Add, Mul, Div, Sub, Neg, Pow, Sqrt, ReduceMean, Sigmoid, Softmax, Cos, Sin,
CumSum, Range, Shape, Gather, Slice, Reshape, Transpose, Unsqueeze, Split, Concat, Cast, LessOrEqual, And, Where,
Identity.
fp16 keeps RMSNorm, RoPE angles and softmax in fp32 (Cast around them). int4: the fp32 graph with every weight
MatMul replaced by com.microsoft MatMulNBits (`higgs_onnx.quantize`, block-wise symmetric RTN) - the only contrib op.

Per layer (Qwen3, transformers conventions):
    h = RMSNorm(x) (x / Sqrt(ReduceMean(x^2) + eps) * w)
    q, k, v = Split(h @ W_qkv)          one fused MatMul (q, k, v rows concatenated, like ModelBuilder)
    q, k = per-head RMSNorm (q_norm, k_norm), then RoPE (rotate-half: x * cos + cat(-x2, x1) * sin)
    present = Concat(past, k|v)
    GQA without copying K/V: the H query heads are regrouped [B, H, S, hd] -> [B, KV, g*S, hd] (g = H / KV, head h
    uses KV head h // g, as transformers' repeat_kv), so scores = q @ K^T is one batched MatMul per KV head and the
    cache is never repeated; scores are viewed as [B, H, S, T] to add the mask bias, softmaxed in fp32, and
    multiplied with V the same grouped way.
    x = x + o_proj(attn); x = x + down(SiLU(gate(h2)) * up(h2)) with h2 = RMSNorm(x)
Positions: cumsum(attention_mask) - 1, last S columns (like ModelBuilder). Mask: key t is visible to new row s when
attention_mask[t] == 1 and t <= past + s (causal over the new rows, all past rows); masked scores get float32's
lowest value (a fully masked row softmaxes to uniform, never NaN).

Initializer names follow ModelBuilder's (`model.layers.{i}.attn.qkv_proj.MatMul.weight`, `...mlp.gate_proj...`), so
the int4 graph's quantized weights are found by `parity.dequantized_body` and `quantize.DequantizedWeights`.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

log = logging.getLogger(__name__)

FILE = "llm_decoder.onnx"
OPSET = 17
IR_VERSION = 8  # the IR version that goes with opset 17: readable by every onnxruntime >= 1.14
PRECISIONS = ("fp32", "fp16", "int4")
SCRATCH = "_portable_fp32"  # fp32 graph before int4 quantization, inside `out`, removed afterwards


@dataclass(frozen=True)
class Geometry:
    """The Qwen3 body's dimensions, from an extracted folder's config.json."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_positions: int
    bos: int | None
    eos: int | None
    pad: int | None
    vocab_size: int | None

    @classmethod
    def from_config(cls, cfg: dict) -> Geometry:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in (None, "default"):
            raise NotImplementedError(f"rope type {kind!r}: the portable decoder implements default RoPE only")
        heads = int(cfg["num_attention_heads"])
        g = cls(hidden=int(cfg["hidden_size"]), intermediate=int(cfg["intermediate_size"]),
                layers=int(cfg["num_hidden_layers"]), heads=heads, kv_heads=int(cfg["num_key_value_heads"]),
                head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                rms_eps=float(cfg["rms_norm_eps"]),
                # older configs carry rope_theta null in sub-configs; loaders then use Qwen3's 1e6 (checkpoint.py)
                rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 1e6),
                max_positions=int(cfg["max_position_embeddings"]),
                bos=cfg.get("bos_token_id"), eos=cfg.get("eos_token_id"), pad=cfg.get("pad_token_id"),
                vocab_size=cfg.get("vocab_size"))
        if g.heads % g.kv_heads or g.head_dim % 2:
            raise ValueError(f"{g.heads} heads / {g.kv_heads} KV heads / head dim {g.head_dim}: not a GQA layout")
        return g


def _to_float(raw: bytes, st_dtype: str, shape: list[int]) -> np.ndarray:
    """Raw safetensors bytes -> float32 array."""
    if st_dtype == "BF16":
        a = (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4")
    elif st_dtype == "F16":
        a = np.frombuffer(raw, "<f2").astype(np.float32)
    elif st_dtype == "F32":
        a = np.frombuffer(raw, "<f4").copy()
    else:
        raise ValueError(f"unsupported weight dtype {st_dtype}")
    return a.reshape(shape)


class _GraphWriter:
    """Nodes and initializers of the graph being written; weights go straight to the external data file."""

    def __init__(self, writer, dtype: int):
        self.writer, self.dtype = writer, dtype  # dtype: TensorProto.FLOAT or FLOAT16 (activations and weights)
        self.np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
        self.nodes: list = []
        self.inits: list = []
        self.consts: dict[tuple, str] = {}

    def op(self, op_type: str, inputs: list[str], name: str, outputs: int | list[str] = 1, **attrs):
        outs = outputs if isinstance(outputs, list) else [f"{name}/output_{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def const(self, value, dtype=np.int64) -> str:
        """A small inline initializer (shared between uses)."""
        a = np.asarray(value, dtype)
        key = (a.dtype.str, a.shape, a.tobytes())
        if key not in self.consts:
            tag = a.tolist() if a.size <= 8 else len(self.consts)
            name = f"/model/constants/{a.dtype.name}/{tag}"
            self.inits.append(numpy_helper.from_array(a, name))
            self.consts[key] = name
        return self.consts[key]

    def weight(self, name: str, array: np.ndarray) -> str:
        self.inits.append(self.writer.add(name, np.ascontiguousarray(array, self.np_dtype)))
        return name


def _build_graph(geo: Geometry, read, writer, dtype: int):
    """The whole graph: returns (nodes, initializers, inputs, outputs). `read(name)` -> float32 array."""
    g = _GraphWriter(writer, dtype)
    f32 = TensorProto.FLOAT
    low = dtype != f32  # fp16: casts around norms, RoPE angles and softmax
    H, KV, hd, D = geo.heads, geo.kv_heads, geo.head_dim, geo.hidden

    def to32(x, name):
        return g.op("Cast", [x], name, to=f32) if low else x

    def from32(x, name):
        return g.op("Cast", [x], name, to=dtype) if low else x

    eps = g.const(geo.rms_eps, np.float32)
    two = g.const(2.0, np.float32)

    def rms_norm(x: str, w: str, name: str) -> str:
        x32 = to32(x, f"{name}/Cast")
        var = g.op("ReduceMean", [g.op("Pow", [x32, two], f"{name}/Pow")], f"{name}/ReduceMean", axes=[-1],
                   keepdims=1)
        den = g.op("Sqrt", [g.op("Add", [var, eps], f"{name}/Add")], f"{name}/Sqrt")
        y = from32(g.op("Div", [x32, den], f"{name}/Div"), f"{name}/Cast_1")
        return g.op("Mul", [y, w], f"{name}/Mul")

    # --- shared: sizes, positions, RoPE angles, mask bias ----------------------------------------------------
    m = "/model/attn_mask"
    zero, one = g.const(0), g.const(1)
    seq = g.op("Gather", [g.op("Shape", ["inputs_embeds"], f"{m}/Shape"), one], f"{m}/Gather", axis=0)  # S
    total = g.op("Gather", [g.op("Shape", ["attention_mask"], f"{m}/Shape_1"), one], f"{m}/Gather_1", axis=0)  # T
    past = g.op("Sub", [total, seq], f"{m}/Sub")  # P
    cums = g.op("CumSum", ["attention_mask", one], f"{m}/CumSum")
    pos_all = g.op("Sub", [cums, one], f"{m}/Sub_1")  # [B, T]
    axis0 = g.const([0])
    positions = g.op("Slice", [pos_all, g.op("Unsqueeze", [past, axis0], f"{m}/Unsqueeze"),
                               g.op("Unsqueeze", [total, axis0], f"{m}/Unsqueeze_1"), g.const([1])],
                     f"{m}/Slice")  # [B, S]
    rows = g.op("Unsqueeze", [g.op("Range", [past, total, one], f"{m}/Range"), g.const([1])], f"{m}/Unsqueeze_2")
    cols = g.op("Unsqueeze", [g.op("Range", [zero, total, one], f"{m}/Range_1"), axis0], f"{m}/Unsqueeze_3")
    causal = g.op("LessOrEqual", [cols, rows], f"{m}/LessOrEqual")  # [S, T]
    valid = g.op("Unsqueeze", [g.op("Cast", ["attention_mask"], f"{m}/Cast", to=TensorProto.BOOL), g.const([1, 2])],
                 f"{m}/Unsqueeze_4")  # [B, 1, 1, T]
    allowed = g.op("And", [causal, valid], f"{m}/And")  # [B, 1, S, T]
    bias = g.op("Where", [allowed, g.const(0.0, np.float32), g.const(np.finfo(np.float32).min, np.float32)],
                f"{m}/Where")

    r = "/model/rotary_emb"
    inv_freq = 1.0 / (geo.rope_theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))
    freqs = g.op("Mul", [g.op("Unsqueeze", [g.op("Cast", [positions], f"{r}/Cast", to=f32), g.const([-1])],
                              f"{r}/Unsqueeze"), g.const(inv_freq.astype(np.float32), np.float32)], f"{r}/Mul")
    emb = g.op("Concat", [freqs, freqs], f"{r}/Concat", axis=-1)  # [B, S, hd]
    cos = from32(g.op("Unsqueeze", [g.op("Cos", [emb], f"{r}/Cos"), g.const([2])], f"{r}/Unsqueeze_1"),
                 f"{r}/Cast_1")  # [B, S, 1, hd]
    sin = from32(g.op("Unsqueeze", [g.op("Sin", [emb], f"{r}/Sin"), g.const([2])], f"{r}/Unsqueeze_2"),
                 f"{r}/Cast_2")
    half = g.const([hd // 2, hd // 2])

    def rope(x: str, name: str) -> str:  # x [B, S, heads, hd]
        x1, x2 = g.op("Split", [x, half], f"{name}/Split", outputs=2, axis=-1)
        rot = g.op("Concat", [g.op("Neg", [x2], f"{name}/Neg"), x1], f"{name}/Concat", axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos], f"{name}/Mul"), g.op("Mul", [rot, sin], f"{name}/Mul_1")],
                    f"{name}/Add")

    scale = g.const(1.0 / np.sqrt(hd), helper.tensor_dtype_to_np_dtype(dtype))
    qkv_split = g.const([H * hd, KV * hd, KV * hd])
    shape_q, shape_kv = g.const([0, 0, H, hd]), g.const([0, 0, KV, hd])
    grouped, ungrouped = g.const([0, KV, -1, hd]), g.const([0, H, -1, hd])
    by_head, by_group = g.const([0, H, -1, 0]), g.const([0, KV, -1, 0])
    merged = g.const([0, 0, H * hd])

    # --- layers --------------------------------------------------------------------------------------------
    x = "inputs_embeds"
    outputs = []
    for i in range(geo.layers):
        p, w = f"/model/layers.{i}", f"model.layers.{i}"
        src = f"model.layers.{i}."
        h = rms_norm(x, g.weight(f"{w}.input_layernorm.weight", read(src + "input_layernorm.weight")),
                     f"{p}/input_layernorm")
        wqkv = np.concatenate([read(src + f"self_attn.{n}_proj.weight") for n in "qkv"]).T
        qkv = g.op("MatMul", [h, g.weight(f"{w}.attn.qkv_proj.MatMul.weight", wqkv)], f"{p}/attn/qkv_proj/MatMul")
        del wqkv
        q, k, v = g.op("Split", [qkv, qkv_split], f"{p}/attn/qkv_proj/Split", outputs=3, axis=-1)
        q = rms_norm(g.op("Reshape", [q, shape_q], f"{p}/attn/q_norm/Reshape"),
                     g.weight(f"{w}.attn.q_norm.layernorm.weight", read(src + "self_attn.q_norm.weight")),
                     f"{p}/attn/q_norm")
        k = rms_norm(g.op("Reshape", [k, shape_kv], f"{p}/attn/k_norm/Reshape"),
                     g.weight(f"{w}.attn.k_norm.layernorm.weight", read(src + "self_attn.k_norm.weight")),
                     f"{p}/attn/k_norm")
        q = g.op("Mul", [rope(q, f"{p}/attn/q_rotary"), scale], f"{p}/attn/q_scale")
        k = rope(k, f"{p}/attn/k_rotary")
        v = g.op("Reshape", [v, shape_kv], f"{p}/attn/v/Reshape")
        q = g.op("Transpose", [q], f"{p}/attn/q/Transpose", perm=[0, 2, 1, 3])  # [B, H, S, hd]
        k = g.op("Transpose", [k], f"{p}/attn/k/Transpose", perm=[0, 2, 1, 3])  # [B, KV, S, hd]
        v = g.op("Transpose", [v], f"{p}/attn/v/Transpose", perm=[0, 2, 1, 3])
        key = g.op("Concat", [f"past_key_values.{i}.key", k], f"{p}/attn/present_key", outputs=[f"present.{i}.key"],
                   axis=2)
        value = g.op("Concat", [f"past_key_values.{i}.value", v], f"{p}/attn/present_value",
                     outputs=[f"present.{i}.value"], axis=2)
        outputs += [key, value]
        qg = g.op("Reshape", [q, grouped], f"{p}/attn/q/Reshape_group")  # [B, KV, g*S, hd]
        kt = g.op("Transpose", [key], f"{p}/attn/k/Transpose_1", perm=[0, 1, 3, 2])  # [B, KV, hd, T]
        scores = g.op("Reshape", [g.op("MatMul", [qg, kt], f"{p}/attn/scores/MatMul"), by_head],
                      f"{p}/attn/scores/Reshape")  # [B, H, S, T]
        scores = g.op("Add", [to32(scores, f"{p}/attn/scores/Cast"), bias], f"{p}/attn/scores/Add")
        probs = from32(g.op("Softmax", [scores], f"{p}/attn/Softmax", axis=-1), f"{p}/attn/Softmax/Cast")
        probs = g.op("Reshape", [probs, by_group], f"{p}/attn/probs/Reshape")  # [B, KV, g*S, T]
        ctx = g.op("Reshape", [g.op("MatMul", [probs, value], f"{p}/attn/context/MatMul"), ungrouped],
                   f"{p}/attn/context/Reshape")  # [B, H, S, hd]
        ctx = g.op("Reshape", [g.op("Transpose", [ctx], f"{p}/attn/context/Transpose", perm=[0, 2, 1, 3]), merged],
                   f"{p}/attn/context/Reshape_1")  # [B, S, H*hd]
        o = g.op("MatMul", [ctx, g.weight(f"{w}.attn.o_proj.MatMul.weight", read(src + "self_attn.o_proj.weight").T)],
                 f"{p}/attn/o_proj/MatMul")
        x = g.op("Add", [x, o], f"{p}/attn/residual/Add")
        h = rms_norm(x, g.weight(f"{w}.post_attention_layernorm.weight", read(src + "post_attention_layernorm.weight")),
                     f"{p}/post_attention_layernorm")
        gate = g.op("MatMul", [h, g.weight(f"{w}.mlp.gate_proj.MatMul.weight", read(src + "mlp.gate_proj.weight").T)],
                    f"{p}/mlp/gate_proj/MatMul")
        up = g.op("MatMul", [h, g.weight(f"{w}.mlp.up_proj.MatMul.weight", read(src + "mlp.up_proj.weight").T)],
                  f"{p}/mlp/up_proj/MatMul")
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}/mlp/act_fn/Sigmoid")], f"{p}/mlp/act_fn/Mul")
        down = g.op("MatMul", [g.op("Mul", [act, up], f"{p}/mlp/Mul"),
                               g.weight(f"{w}.mlp.down_proj.MatMul.weight", read(src + "mlp.down_proj.weight").T)],
                    f"{p}/mlp/down_proj/MatMul")
        x = g.op("Add", [x, down], f"{p}/mlp/residual/Add")
    final = rms_norm(x, g.weight("model.norm.weight", read("model.norm.weight")), "/model/norm")
    g.op("Identity", [final], "/model/norm/Identity", outputs=["hidden_states"])

    def vi(name, elem, shape):
        return helper.make_tensor_value_info(name, elem, shape)

    kv_in = lambda n: vi(n, dtype, ["batch_size", KV, "past_sequence_length", hd])  # noqa: E731
    kv_out = lambda n: vi(n, dtype, ["batch_size", KV, "total_sequence_length", hd])  # noqa: E731
    inputs = [vi("inputs_embeds", dtype, ["batch_size", "sequence_length", D]),
              vi("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])]
    outs = [vi("hidden_states", dtype, ["batch_size", "sequence_length", D])]
    for i in range(geo.layers):
        inputs += [kv_in(f"past_key_values.{i}.key"), kv_in(f"past_key_values.{i}.value")]
        outs += [kv_out(f"present.{i}.key"), kv_out(f"present.{i}.value")]
    return g.nodes, g.inits, inputs, outs


def _write_graph(qwen3_dir: Path, path: Path, dtype: int) -> Geometry:
    import onnx

    from ..checkpoint import WEIGHTS, TensorFile, load_json
    from ..quantize import DataWriter

    geo = Geometry.from_config(load_json(qwen3_dir / "config.json"))
    tf = TensorFile(qwen3_dir / WEIGHTS)

    def read(name: str) -> np.ndarray:
        if name not in tf.header:
            raise KeyError(f"{qwen3_dir / WEIGHTS} lacks tensor {name}")
        meta = tf.header[name]
        return _to_float(tf.raw(name), meta["dtype"], meta["shape"])

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = DataWriter(path.with_name(path.name + ".data"))
    try:
        nodes, inits, inputs, outputs = _build_graph(geo, read, writer, dtype)
    finally:
        writer.close()
    graph = helper.make_graph(nodes, "portable_qwen3_decoder", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="higgs_onnx",
                              producer_version="portable_decoder")
    model.ir_version = IR_VERSION
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path))  # by path: external data resolved next to the graph
    return geo


def genai_config(geo: Geometry) -> dict:
    """ModelBuilder's genai_config.json layout, with a concat (not shared) KV cache."""
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": FILE, "head_size": geo.head_dim, "hidden_size": geo.hidden,
        "inputs": {"inputs_embeds": "inputs_embeds", "attention_mask": "attention_mask",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"present_key_names": "present.%d.key", "present_value_names": "present.%d.value"},
        "num_attention_heads": geo.heads, "num_hidden_layers": geo.layers, "num_key_value_heads": geo.kv_heads,
    }
    model = {"context_length": geo.max_positions, "decoder": decoder, "type": "qwen3"}
    for key, value in (("bos_token_id", geo.bos), ("eos_token_id", geo.eos), ("pad_token_id", geo.pad),
                       ("vocab_size", geo.vocab_size)):
        if value is not None:
            model[key] = value
    return {"model": model,
            "search": {"do_sample": False, "max_length": geo.max_positions, "num_beams": 1,
                       "past_present_share_buffer": False}}


def build_portable_decoder(qwen3_dir: Path, out: Path, precision: str, block_size: int = 32,
                           accuracy_level: int = 4) -> Path:
    """Write `out/llm_decoder.onnx` (+ `.onnx.data`) and `out/genai_config.json` from an extracted Qwen3 folder
    (`checkpoint.extract_qwen3`). precision: fp32, fp16 (fp16 weights and I/O; norms, RoPE and softmax in fp32) or
    int4 (the fp32 graph, built in `out/_portable_fp32` and quantized to MatMulNBits one weight at a time, then
    removed). Returns the graph's path."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: the portable decoder is built at {', '.join(PRECISIONS)}")
    qwen3_dir, out = Path(qwen3_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if precision == "int4":
        from ..quantize import quantize_model_int4

        scratch = out / SCRATCH
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            geo = _write_graph(qwen3_dir, scratch / FILE, TensorProto.FLOAT)
            n = quantize_model_int4(scratch / FILE, out / FILE, block_size=block_size, accuracy_level=accuracy_level)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log.info("portable decoder: quantized %d MatMuls to int4 (block %d, accuracy level %d)", n, block_size,
                 accuracy_level)
    else:
        geo = _write_graph(qwen3_dir, out / FILE, TensorProto.FLOAT16 if precision == "fp16" else TensorProto.FLOAT)
    (out / "genai_config.json").write_text(json.dumps(genai_config(geo), indent=4) + "\n")
    return out / FILE
