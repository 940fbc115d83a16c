"""The int4 layout sweep (issue 53 item 3): per block size x quantizer, the weights' error against fp32 and the
one-row `MatMulNBits` time of a decode step's projections.

Usage:
    python benchmarks/int4_layout.py error QWEN3_DIR [--layers 0 17 35]
    flock /tmp/lead/4b.lock python benchmarks/int4_layout.py time [--layers 6] [--rounds 30]

`error`: relative Frobenius error ||W - deq(q(W))|| / ||W|| of every projection of the sampled layers (the
extracted Qwen3 body's safetensors), per layout in `quantize.LAYOUTS`.
`time`: one graph holding `--layers` layers' worth of the 4b projections (qkv 2560x6144, o 4096x2560, gate and up
2560x9728, down 9728x2560), every weight a distinct random copy (a microbenchmark that reuses one weight times the
cache, not memory), run at one row; the variants timed in turn, round after round, best and median scaled to 36
layers, beside the bytes the kernel reads (`quantize.read_bytes_per_weight`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_onnx.quantize import LAYOUTS, dequantize_block, quantize_block  # noqa: E402

SHAPES = (("qkv", 2560, 6144), ("o", 4096, 2560), ("gate", 2560, 9728), ("up", 2560, 9728), ("down", 9728, 2560))
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


def error(qwen3: Path, layers: list[int], blocks: list[int]) -> None:
    from safetensors import safe_open

    with safe_open(str(qwen3 / "model.safetensors"), "pt") as f:
        print(f"{'layout':<16}" + "".join(f"{p.split('.')[-1]:>10}" for p in PROJ) + f"{'all':>10}")
        for bs in blocks:
            for kind in LAYOUTS:
                num = den = 0.0
                row = []
                for proj in PROJ:
                    e2 = w2 = 0.0
                    for i in layers:
                        w = f.get_tensor(f"model.layers.{i}.{proj}.weight").float().numpy().T  # (K, N)
                        packed, scales, zp = quantize_block(w, bs, kind)
                        d = dequantize_block(packed, scales, w.shape[0], zp) - w
                        e2, w2 = e2 + float((d * d).sum()), w2 + float((w * w).sum())
                    row.append((e2 / w2) ** 0.5)
                    num, den = num + e2, den + w2
                print(f"{f'b{bs} {kind}':<16}" + "".join(f"{r:>10.4f}" for r in row) + f"{(num / den) ** 0.5:>10.4f}",
                      flush=True)


VARIANTS = (  # (block, zero points, accuracy level); the quantizers "rtn" and "search" share a format (and a time)
    (32, False, 4), (32, False, 0), (32, True, 4), (64, False, 4), (64, True, 4), (128, False, 4), (128, True, 4),
    (128, False, 0))


def _label(v) -> str:
    bs, asym, level = v
    return f"b{bs} {'asym' if asym else 'sym'} acc{level}"


def _graph(layers: int, v, path: Path) -> int:
    """A graph of `layers` x `SHAPES` MatMulNBits, each with distinct random bytes; returns the bytes one run
    reads (`quantize.read_bytes_per_weight`)."""
    import onnx
    from onnx import TensorProto, helper

    from higgs_onnx.quantize import DataWriter, read_bytes_per_weight

    bs, asym, level = v
    ft = TensorProto.FLOAT
    rng = np.random.default_rng(abs(hash(v)) % 2**32)
    writer = DataWriter(path.with_name(path.name + ".data"))
    nodes, inits, outs, total = [], [], [], 0
    for i in range(layers):
        for name, k, n in SHAPES:
            kb = k // bs
            w = f"l{i}.{name}"
            q = writer.add(w + "_Q4", rng.integers(0, 256, (n, kb, bs // 2), dtype=np.uint8))
            s = writer.add(w + "_scales", rng.random((n, kb), dtype=np.float32) * 0.01 + 0.001)
            ins = [f"x{k}", q.name, s.name]
            inits += [q, s]
            total += round(k * n * read_bytes_per_weight(bs, level, asym))
            if asym:
                z = writer.add(w + "_zp", rng.integers(0, 256, (n, (kb + 1) // 2), dtype=np.uint8))
                inits.append(z)
                ins.append(z.name)
            nodes.append(helper.make_node("MatMulNBits", ins, [w + "_y"], domain="com.microsoft", K=k, N=n, bits=4,
                                          block_size=bs, accuracy_level=level))
            outs.append(helper.make_tensor_value_info(w + "_y", ft, [1, n]))
    writer.close()
    ins = [helper.make_tensor_value_info(f"x{k}", ft, [1, k]) for k in sorted({k for _, k, _ in SHAPES})]
    g = helper.make_graph(nodes, "sweep", ins, outs, initializer=inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(
        "com.microsoft", 1)], ir_version=10), str(path))
    return total


def timing(layers: int, rounds: int, scratch: Path) -> None:
    """Every variant's session open at once and timed in turn, round after round (ratios within one run survive a
    busy machine): best and median of `rounds`."""
    import onnxruntime as ort

    from higgs_onnx import providers

    scratch.mkdir(parents=True, exist_ok=True)
    sessions = {}
    for v in VARIANTS:
        path = scratch / f"{_label(v).replace(' ', '_')}.onnx"
        nbytes = _graph(layers, v, path)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        sess = ort.InferenceSession(str(path), so, providers=[providers.get("cpu").ort_name])
        for p in (path, path.with_name(path.name + ".data")):
            p.unlink()
        feeds = {f"x{k}": np.random.default_rng(k).standard_normal((1, k)).astype(np.float32)
                 for k in sorted({k for _, k, _ in SHAPES})}
        sess.run(None, feeds)
        sessions[v] = (sess, feeds, nbytes, [])
    for _ in range(rounds):
        for sess, feeds, _, times in sessions.values():
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
    scale = 36 / layers
    base = min(sessions[VARIANTS[0]][3])
    print(f"{'layout':<24}{'best ms/36 layers':>18}{'median':>8}{'x b32':>7}{'GB read':>9}{'GB/s':>7}")
    for v, (_, _, nbytes, times) in sessions.items():
        best = min(times)
        print(f"{_label(v):<24}{best * 1e3 * scale:>18.1f}{np.median(times) * 1e3 * scale:>8.1f}{best / base:>7.2f}"
              f"{nbytes * scale / 1e9:>9.3f}{nbytes / best / 1e9:>7.1f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("error")
    e.add_argument("qwen3", type=Path)
    e.add_argument("--layers", type=int, nargs="+", default=[0, 17, 35])
    e.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128])
    t = sub.add_parser("time")
    t.add_argument("--layers", type=int, default=6)
    t.add_argument("--rounds", type=int, default=30)
    t.add_argument("--scratch", type=Path, default=Path("/tmp/int4_sweep"))
    args = ap.parse_args(argv)
    if args.what == "error":
        error(args.qwen3, args.layers, args.blocks)
    else:
        timing(args.layers, args.rounds, args.scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
