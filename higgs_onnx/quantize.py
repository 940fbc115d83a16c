"""Streaming int4 weight quantization of an ONNX model with external data: MatMul -> MatMulNBits.

ModelBuilder's own int4 path materialises an fp32 copy of every weight (toolchain G8: ~25 GB for Qwen3-4B), and
onnxruntime's `MatMulNBitsQuantizer` loads the whole model too (~18 GB). Here the fp32 graph is loaded without its
weights, each MatMul weight is read from the external data file through a memory map, quantized with the same
MLAS kernel the stock quantizer calls (`quantize_matmul_4bits`: symmetric RTN, block-wise along K), and written
out at once, so RAM holds one weight at a time. Node, attribute and initializer names follow the stock quantizer
(`<weight>_Q4`, `<weight>_scales`), so the quantized weights equal those of ModelBuilder's own int4 build (tested).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

log = logging.getLogger(__name__)


def _external_info(t: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _read_weight(t: TensorProto, base: Path) -> np.ndarray:
    if t.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(t)
    info = _external_info(t)
    dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
    return np.memmap(base / info["location"], dtype=dtype, mode="r", offset=int(info.get("offset", 0)),
                     shape=tuple(t.dims))


def quantize_block(w: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(K, N) float32 weight -> packed uint8 (N, K/bs, bs/2) and float32 scales (N, K/bs), symmetric."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    k, n = w.shape
    k_blocks = (k + block_size - 1) // block_size
    if k_blocks * block_size != k:
        w = np.pad(w, ((0, k_blocks * block_size - k), (0, 0)))
    packed = np.zeros((n, k_blocks, block_size // 2), dtype=np.uint8)
    scales = np.zeros((n, k_blocks), dtype=np.float32)
    zero_points = np.zeros((n, (k_blocks + 1) // 2), dtype=np.uint8)
    quantize_matmul_4bits(packed, np.ascontiguousarray(w, np.float32), scales, zero_points, block_size, n, k, True)
    return packed, scales


class DataWriter:
    """Appends tensors to one external data file, 4 KiB aligned like onnx's own writer."""

    def __init__(self, path: Path):
        self.path, self.f, self.offset = path, open(path, "wb"), 0

    def add(self, name: str, array: np.ndarray) -> TensorProto:
        pad = -self.offset % 4096
        self.f.write(b"\0" * pad)
        self.offset += pad
        data = np.ascontiguousarray(array).tobytes()
        self.f.write(data)
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(self.offset)), ("length", str(len(data)))):
            t.external_data.add(key=key, value=value)
        self.offset += len(data)
        return t

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def quantize_columns(w: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(K, N) float weight -> int8 (K, N) and float32 scales (N,): symmetric, one scale per output column (the
    largest |w| of the column maps to 2**(bits-1) - 1: 127 at 8 bits, 63 at 7), round to nearest. What the int8
    GEMM route multiplies (`parts/llm_route.py`; its form, `manifest.ROUTE_FORMS`, gives `bits`)."""
    if bits not in (7, 8):
        raise ValueError(f"the route's weights are 7 or 8 bits, got {bits}")
    top = 2 ** (bits - 1) - 1
    w = np.asarray(w, np.float32)
    scales = np.maximum(np.abs(w).max(axis=0), 1e-12) / top
    q = np.clip(np.rint(w / scales), -top, top).astype(np.int8)
    return q, scales.astype(np.float32)


INT8_SUFFIX, INT8_SCALES_SUFFIX = "_Q8", "_Q8_scales"  # the int8 twin of a MatMul weight and its column scales


def write_int8_index(dst: Path, tensors: list[TensorProto]) -> None:
    """`dst`: a graph without nodes whose initializers are `tensors` (their data in the external file beside it):
    the index the route's graph takes its int8 weights from."""
    graph = helper.make_graph([], "int8_weights", [], [], initializer=tensors)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), str(dst))


def quantize_model_int4(src: Path, dst: Path, block_size: int = 32, accuracy_level: int = 4,
                        progress: Callable[[int, int], None] | None = None, int8_dst: Path | None = None,
                        int8_bits: int = 8) -> int:
    """Quantize every MatMul with a 2-D constant weight in `src` to MatMulNBits into `dst` (+ `<dst>.data`).

    Other initializers are copied as they are. Returns the number of quantized MatMuls. `int8_dst`: also write
    each such weight at int8 per output column (`quantize_columns` at `int8_bits`: `<weight>_Q8`,
    `<weight>_Q8_scales`) into `<int8_dst>.data`, indexed by the node-less graph `int8_dst`; each weight is read
    once for both.
    """
    model = onnx.load(str(src), load_external_data=False)
    graph, base = model.graph, src.parent
    inits = {t.name: t for t in graph.initializer}
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = DataWriter(dst.with_name(dst.name + ".data"))
    writer8 = DataWriter(int8_dst.with_name(int8_dst.name + ".data")) if int8_dst is not None else None
    int8: list[TensorProto] = []
    new_inits: list[TensorProto] = []
    new_nodes: list[onnx.NodeProto] = []
    targets = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits
               and len(inits[n.input[1]].dims) == 2 and inits[n.input[1]].data_type == TensorProto.FLOAT]
    quantized = {n.input[1] for n in targets}
    done = 0
    try:
        for node in graph.node:
            if node not in targets:
                new_nodes.append(node)
                continue
            t = inits[node.input[1]]
            k, n = t.dims
            w = _read_weight(t, base)
            if writer8 is not None:
                q8, s8 = quantize_columns(w, int8_bits)
                int8 += [writer8.add(t.name + INT8_SUFFIX, q8), writer8.add(t.name + INT8_SCALES_SUFFIX, s8)]
            packed, scales = quantize_block(w, block_size)
            q = writer.add(t.name + "_Q4", packed)
            s = writer.add(t.name + "_scales", scales)
            new_inits += [q, s]
            attrs = {"K": k, "N": n, "bits": 4, "block_size": block_size}
            if accuracy_level:
                attrs["accuracy_level"] = accuracy_level
            new_nodes.append(helper.make_node("MatMulNBits", [node.input[0], q.name, s.name], list(node.output),
                                              name=node.name + "_Q4" if node.name else "", domain="com.microsoft",
                                              **attrs))
            done += 1
            if progress:
                progress(done, len(targets))
        for t in graph.initializer:  # everything else (norm weights, rotary caches): copied through
            if t.name not in quantized:
                new_inits.append(writer.add(t.name, _read_weight(t, base)) if t.data_location ==
                                 TensorProto.EXTERNAL else t)
    finally:
        writer.close()
        if writer8 is not None:
            writer8.close()
    if int8_dst is not None:
        write_int8_index(int8_dst, int8)
    del graph.node[:]
    graph.node.extend(new_nodes)
    del graph.initializer[:]
    graph.initializer.extend(new_inits)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(dst))
    return done


def dequantize_block(packed: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    """Inverse of `quantize_block` (symmetric: zero point 8): -> (K, N) float32. Low nibble = even element."""
    n, k_blocks, half = packed.shape
    q = np.empty((n, k_blocks, half * 2), dtype=np.int8)
    q[..., 0::2] = packed & 0x0F
    q[..., 1::2] = packed >> 4
    w = (q.astype(np.float32) - 8.0) * scales[..., None]
    return w.reshape(n, k_blocks * half * 2)[:, :k].T


class DequantizedWeights:
    """The MatMulNBits weights of an int4 model, dequantized on request: `get(name)` -> (K, N) float32 for the
    original MatMul weight name (e.g. `model.layers.3.attn.qkv_proj.MatMul.weight`). Only the graph is loaded;
    each weight is read from the external data when asked for, so RAM holds one at a time."""

    def __init__(self, path: Path):
        self.path = Path(path)
        model = onnx.load(str(path), load_external_data=False)
        inits = {t.name: t for t in model.graph.initializer}
        self.nodes = {n.input[1].removesuffix("_Q4"): (n, inits[n.input[1]], inits[n.input[2]])
                      for n in model.graph.node if n.op_type == "MatMulNBits"}

    def names(self) -> list[str]:
        return list(self.nodes)

    def get(self, name: str) -> np.ndarray:
        node, q, s = self.nodes[name]
        attrs = {a.name: a.i for a in node.attribute}
        packed = np.asarray(_read_weight(q, self.path.parent))
        scales = np.asarray(_read_weight(s, self.path.parent), np.float32)
        return dequantize_block(packed, scales, attrs["K"])
