"""The rewrite of a fused GroupQueryAttention node (`cpu_graph.unfuse`, passed in), checked where it can be: the
fused node cannot run on the CPU EP, so its rewrite runs as a one-node graph there (random Q/K/V, random norm
weights, the node's geometry and attributes) against a NumPy reference of what the fused op computes: per-head RMS
norm with the weight, then rotary embedding, then grouped causal attention; the output and the cache rows it writes
are compared. The op's input slots and defaults are defined here (ORT 1.32's contrib schema)."""

from __future__ import annotations

import numpy as np

from .. import providers

MS = "com.microsoft"
GQA = "GroupQueryAttention"
Q_NORM, K_NORM = 14, 15  # GroupQueryAttention's q_norm_weight / k_norm_weight inputs (ORT 1.32's schema)
DEFAULT_EPS = 1e-6  # the op's qk_norm_epsilon default
CPU_EP = providers.BUILD_PROVIDER.ort_name

ROWS = 5  # prefill rows of the check
MODELED = ("num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved", "softcap", "local_window_size",
           "qk_norm_epsilon", "q_norm_epsilon", "k_norm_epsilon")  # attributes the reference computes
TOLERANCE = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 1e-2}  # max abs error / max abs value


def attrs_of(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def self_check(graph, node, rewrite) -> float:
    """The relative error of `rewrite(model, [0])` (in place: `cpu_graph.unfuse`) of `node` (of `graph`) as a
    one-node model against the reference; RuntimeError above the tolerance of the node's float type, ValueError if
    its norm weights are not initializers of the graph."""
    import onnxruntime as ort

    a = attrs_of(node)
    weights = {t.name: t for t in graph.initializer}
    names = [node.input[i] for i in (Q_NORM, K_NORM) if len(node.input) > i and node.input[i]]
    if not all(n in weights for n in names):
        raise ValueError(f"{node.name}: its q/k norm weights {names} are not initializers of the graph")
    from onnx import helper

    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(weights[names[0]].data_type))
    head_dim = int(weights[names[0]].dims[-1])
    inputs, mini = _mini_graph(node, a, dtype, head_dim)
    ref = reference(inputs, a, head_dim)
    rewrite(mini, [0])
    sess = ort.InferenceSession(mini.SerializeToString(), providers=[CPU_EP])
    feeds = {k: v for k, v in inputs.items() if k in {i.name for i in sess.get_inputs()}}
    got = dict(zip(("out", "present_key"), sess.run(["out", "present_key"], feeds), strict=True))
    err = max(np.abs(got[k].astype(np.float64) - ref[k]).max() / np.abs(ref[k]).max() for k in ref)
    if not err <= TOLERANCE.get(dtype, 1e-2):
        raise RuntimeError(f"{node.name}: the fused q/k norm moved out for the CPU EP does not match the op's "
                           f"semantics (relative error {err:.2e}); this onnxruntime cannot run the graph on the CPU")
    return float(err)


def _mini_graph(node, a: dict, dtype: np.dtype, head_dim: int):
    """(feeds incl. the norm weights, a one-node model of the fused op with the node's geometry)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    nh, kvh = a["num_heads"], a["kv_num_heads"]
    packed = len(node.input) < 2 or not node.input[1]
    f = {n: rng.standard_normal((1, ROWS, h * head_dim)).astype(dtype) for n, h in
         (("query", nh), ("key", kvh), ("value", kvh))}
    angles = np.arange(ROWS)[:, None] * 10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim)
    f.update(cos=np.cos(angles).astype(dtype), sin=np.sin(angles).astype(dtype),
             q_w=rng.uniform(0.5, 1.5, head_dim).astype(dtype), k_w=rng.uniform(0.5, 1.5, head_dim).astype(dtype),
             past_key=np.zeros((1, kvh, 0, head_dim), dtype), past_value=np.zeros((1, kvh, 0, head_dim), dtype))
    has = {"q_w": len(node.input) > Q_NORM and bool(node.input[Q_NORM]),
           "k_w": len(node.input) > K_NORM and bool(node.input[K_NORM])}
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    qkv = ["qkv", "", ""] if packed else ["query", "key", "value"]
    if packed:
        f["qkv"] = np.concatenate([f["query"], f["key"], f["value"]], axis=-1)
    ins = qkv + ["past_key", "past_value", "seqlens_k", "total", "cos", "sin", "", "", "", "", ""]
    ins += ["q_w" if has["q_w"] else "", "k_w" if has["k_w"] else ""]
    gqa = helper.make_node(GQA, ins, ["out", "present_key", "present_value"], "gqa", domain=MS,
                           **{k: v for k, v in a.items() if k in MODELED})
    f.update(seqlens_k=np.array([ROWS - 1], np.int32), total=np.array(ROWS, np.int32))
    int32 = helper.np_dtype_to_tensor_dtype(np.dtype(np.int32))
    graph = helper.make_graph(
        [gqa], "gqa_check",
        [helper.make_tensor_value_info(n, elem, None) for n in [x for x in qkv if x] + ["past_key", "past_value"]]
        + [helper.make_tensor_value_info(n, int32, None) for n in ("seqlens_k", "total")],
        [helper.make_tensor_value_info(n, elem, None) for n in ("out", "present_key", "present_value")],
        [numpy_helper.from_array(f[n], n) for n in ("cos", "sin", "q_w", "k_w") if n in ("cos", "sin") or has[n]])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                              ir_version=10)
    if not has["q_w"]:
        f["q_w"] = None
    if not has["k_w"]:
        f["k_w"] = None
    return f, model


def reference(f: dict, a: dict, head_dim: int) -> dict[str, np.ndarray]:
    """What the fused op computes on a prefill from an empty cache (float64): {"out", "present_key"}."""
    nh, kvh = a["num_heads"], a["kv_num_heads"]
    eps = a.get("qk_norm_epsilon", DEFAULT_EPS)
    q = f["query"].astype(np.float64).reshape(1, ROWS, nh, head_dim)
    k = f["key"].astype(np.float64).reshape(1, ROWS, kvh, head_dim)
    v = f["value"].astype(np.float64).reshape(1, ROWS, kvh, head_dim)
    for x, w, e in ((q, f["q_w"], a.get("q_norm_epsilon", eps)), (k, f["k_w"], a.get("k_norm_epsilon", eps))):
        if w is not None:
            x[:] = x / np.sqrt((x * x).mean(-1, keepdims=True) + e) * w.astype(np.float64)
    if a.get("do_rotary", 0):
        q, k = (_rotary(x, f["cos"], f["sin"], a.get("rotary_interleaved", 0)) for x in (q, k))
    group = nh // kvh
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, kk) * (a.get("scale") or 1 / np.sqrt(head_dim))
    if a.get("softcap", 0.0) > 0:
        scores = a["softcap"] * np.tanh(scores / a["softcap"])
    i, j = np.arange(ROWS)[:, None], np.arange(ROWS)[None, :]
    window = a.get("local_window_size", -1)
    allowed = (j <= i) & ((j > i - window) if window > 0 else True)
    scores = np.where(allowed, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p, vv).reshape(1, ROWS, nh * head_dim)
    return {"out": out, "present_key": k.transpose(0, 2, 1, 3)}


def _rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: int) -> np.ndarray:
    c, s = cos.astype(np.float64)[None, :, None, :], sin.astype(np.float64)[None, :, None, :]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        y = np.empty_like(x)
        y[..., 0::2], y[..., 1::2] = x1 * c - x2 * s, x2 * c + x1 * s
        return y
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
