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


def read_weight(t: TensorProto, base: Path) -> np.ndarray:
    if t.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(t)
    info = _external_info(t)
    dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
    return np.memmap(base / info["location"], dtype=dtype, mode="r", offset=int(info.get("offset", 0)),
                     shape=tuple(t.dims))


# the int4 layouts (benchmarks/int4_layout.py measures them): "rtn" symmetric round to nearest, the block's
# largest |w| (with its sign) at -8 (MLAS's `quantize_matmul_4bits`, the stock quantizer's); "search" symmetric, the
# block's scale chosen among `SEARCH_RATIOS` x RTN's to minimise the block's squared error (clipping the extreme
# for finer steps elsewhere); "asym" MLAS's asymmetric form, the block's [min, max] on 16 levels with a zero point
LAYOUTS = ("rtn", "search", "asym")
SEARCH_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def _pack(q: np.ndarray) -> np.ndarray:
    """(..., bs) codes 0..15 -> (..., bs/2) uint8, low nibble = even element."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _search(w: np.ndarray, block_size: int, chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(K, N) float32 (K a multiple of the block) -> packed (N, K/bs, bs/2), scales (N, K/bs): each block's scale
    the one of `SEARCH_RATIOS` x RTN's with the least squared error. `chunk` output columns at a time (in the
    cache: 4x faster than the whole weight at once), the chunks on every core (NumPy releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    k, n = w.shape
    kb = k // block_size
    packed = np.empty((n, kb, block_size // 2), np.uint8)
    scales = np.empty((n, kb), np.float32)

    def one(c: int) -> None:
        blocks = np.ascontiguousarray(w[:, c:c + chunk].T, np.float32).reshape(-1, kb, block_size)
        base = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1) / np.float32(-8.0)
        base[base == 0] = 1.0  # RTN's scale: the extreme at -8 (an all-zero block: any scale)
        t = np.empty_like(blocks)
        best_err = best = None
        for r in SEARCH_RATIOS:
            s = base * np.float32(r)
            np.divide(blocks, s, out=t)
            np.rint(t, out=t)
            np.clip(t, -8, 7, out=t)
            t *= s
            t -= blocks
            t *= t
            err = t.sum(-1, keepdims=True)
            if best is None:
                best_err, best = err, s
            else:
                better = err < best_err
                best_err, best = np.where(better, err, best_err), np.where(better, s, best)
        np.divide(blocks, best, out=t)
        np.rint(t, out=t)
        np.clip(t, -8, 7, out=t)
        packed[c:c + chunk] = _pack((t + 8).astype(np.uint8))
        scales[c:c + chunk] = best[..., 0]

    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        list(pool.map(one, range(0, n, chunk)))
    return packed, scales


def quantize_block(w: np.ndarray, block_size: int, layout: str = "rtn"
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(K, N) float32 weight -> packed uint8 (N, K/bs, bs/2), float32 scales (N, K/bs) and, for "asym", packed
    uint8 zero points (N, ceil(K/bs / 2)) (else None); `layout` one of `LAYOUTS`."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    if layout not in LAYOUTS:
        raise ValueError(f"int4 layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    k, n = w.shape
    k_blocks = (k + block_size - 1) // block_size
    if k_blocks * block_size != k:
        w = np.pad(w, ((0, k_blocks * block_size - k), (0, 0)))
    if layout == "search":
        packed, scales = _search(w, block_size)
        return packed, scales, None
    packed = np.zeros((n, k_blocks, block_size // 2), dtype=np.uint8)
    scales = np.zeros((n, k_blocks), dtype=np.float32)
    zero_points = np.zeros((n, (k_blocks + 1) // 2), dtype=np.uint8)
    quantize_matmul_4bits(packed, np.ascontiguousarray(w, np.float32), scales, zero_points, block_size, n, k,
                          layout == "rtn")
    return packed, scales, zero_points if layout == "asym" else None


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
                        int8_bits: int = 8, layout: str = "rtn") -> int:
    """Quantize every MatMul with a 2-D constant weight in `src` to MatMulNBits into `dst` (+ `<dst>.data`).

    Other initializers are copied as they are. Returns the number of quantized MatMuls. `int8_dst`: also write
    each such weight at int8 per output column (`quantize_columns` at `int8_bits`: `<weight>_Q8`,
    `<weight>_Q8_scales`) into `<int8_dst>.data`, indexed by the node-less graph `int8_dst`; each weight is read
    once for both. `layout`: the int4 quantizer ("rtn" or "search", `LAYOUTS`; symmetric: no zero points).
    """
    if layout not in ("rtn", "search"):
        raise ValueError(f"the decoder's int4 weights are symmetric (rtn or search), got {layout!r}")
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
            w = read_weight(t, base)
            if writer8 is not None:
                q8, s8 = quantize_columns(w, int8_bits)
                int8 += [writer8.add(t.name + INT8_SUFFIX, q8), writer8.add(t.name + INT8_SCALES_SUFFIX, s8)]
            packed, scales, _ = quantize_block(w, block_size, layout)
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
                new_inits.append(writer.add(t.name, read_weight(t, base)) if t.data_location ==
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


def read_bytes_per_weight(block_size: int, accuracy_level: int, zero_points: bool = False) -> float:
    """Bytes one row of `MatMulNBits` reads per weight on x86 MLAS: the packed codes (0.5), the block's fp32 scale,
    its zero point (4 bits) if any, and at accuracy level 4 (int8 activations) the fp32 block sum MLAS derives
    from the scales and zero points at session creation and reads beside them (measured: a session's resident
    weights are 0.5 + 12/bs B per weight at level 4 (the scales kept twice), 0.5 + 4/bs at level 0; one row of
    block 128 runs at 0.74-0.75 x block 32's time, the ratio of these figures, not the 0.85 of the files')."""
    per_block = 4 + (0.5 if zero_points else 0) + (4 if accuracy_level == 4 else 0)
    return 0.5 + per_block / block_size


def read_bytes(path: Path) -> int:
    """The bytes of weights one decode step of the graph `path` reads: each `MatMulNBits` at
    `read_bytes_per_weight`, every other initializer as stored (norms, rotary caches; a float MatMul's weight)."""
    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    size = {n: int(np.prod(t.dims)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
            for n, t in inits.items()}
    total, counted = 0, set()
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        a = {x.name: x.i for x in node.attribute}
        total += round(a["K"] * a["N"] * read_bytes_per_weight(a["block_size"], a.get("accuracy_level", 0),
                                                               len(node.input) > 3 and bool(node.input[3])))
        counted |= set(node.input[1:])
    return total + sum(v for n, v in size.items() if n not in counted)


def dequantize_block(packed: np.ndarray, scales: np.ndarray, k: int, zero_points: np.ndarray | None = None
                     ) -> np.ndarray:
    """Inverse of `quantize_block` -> (K, N) float32. Low nibble = even element (and even block of the zero
    points); no zero points: symmetric, zero point 8."""
    n, k_blocks, half = packed.shape
    q = np.empty((n, k_blocks, half * 2), dtype=np.int8)
    q[..., 0::2] = packed & 0x0F
    q[..., 1::2] = packed >> 4
    if zero_points is None:
        zp = np.float32(8.0)
    else:
        z = np.empty((n, zero_points.shape[1] * 2), dtype=np.float32)
        z[:, 0::2], z[:, 1::2] = zero_points & 0x0F, zero_points >> 4
        zp = z[:, :k_blocks, None]
    w = (q.astype(np.float32) - zp) * scales[..., None]
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
        packed = np.asarray(read_weight(q, self.path.parent))
        scales = np.asarray(read_weight(s, self.path.parent), np.float32)
        return dequantize_block(packed, scales, attrs["K"])
