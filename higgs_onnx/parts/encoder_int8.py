"""The codec encoder (`audio_encoder`) on ONNX Runtime's u8s8 integer GEMM: a rewrite of its fp32 graph.

On the CPU the fp32 encoder spends its time in 1-D convolutions (the DAC acoustic encoder at 24 kHz, HuBERT's
feature extractor, the semantic encoder) and HuBERT's projections (ORT profiler, 4b geometry, 10 s of reference,
2 threads: Conv 49 %, MatMul 23 %, the Snake activations' Sin 14 %). ONNX Runtime's `ConvInteger` multiplies
u8 x u8 through im2col and runs no faster than fp32 here; its `MatMulInteger` with u8 activations and s8 weights
is MLAS's fast integer GEMM (VNNI or AMX; 2.4-10 x fp32's GEMM on an AVX-512 VNNI EPYC, 2 threads). So each
convolution becomes that GEMM on its input laid out channels-last:

    x [B, C, L] -> Transpose [B, L, C] -> DynamicQuantizeLinear (u8, one scale and zero point per tensor)
      -> Pad with the zero point -> k taps as strided Slices, Concat [B, L', k*C] (im2col in u8)
      -> MatMulInteger(., W8 [k*C, C_out], zero point) -> int32 -> float * (scale x column scales) + bias
      -> Transpose [B, C_out, L']

and each projection (`MatMul` by a weight) the same GEMM on its input quantized the same way. The weights are
symmetric per output column (`quantize.quantize_columns`) at `BITS` bits: 7-bit weights keep MLAS's u8s8 kernel
exact on a CPU without an int8 dot product too (AVX2's `vpmaddubsw` sums pairs of u8 x s8 in 16 bits: 2 x 255 x 63
fits, 2 x 255 x 127 does not). Only the three encoders are rewritten (`SCOPES`): `fc` and the residual vector
quantizer, whose argmax picks the codes, stay fp32, as do convolutions too shallow for a GEMM (`MIN_DEPTH`) and
HuBERT's grouped positional convolution.

At build time (`choose`, called by `export.Exporter.encoder`) the forms in `FORMS` are tried in order, fastest first
(all three encoders; the semantic branch alone), each gated against the fp32 graph on the bundled recordings: the
share of equal codes, per codebook. The threshold is the encoder's own sensitivity: the same fp32 graph on the same
recordings with white noise at `DITHER_RMS` (-60 dBFS, below a quiet room's noise floor: an inaudible change of the
reference) added. A form passes if, on every recording, its codes agree with fp32's at least as often as the
dithered recording's do, over all codebooks and on the first (the coarse one the decoder leans on most): int8 may
change a clone's codes no more than re-recording the reference with that noise. The first form that passes is
kept, else the fp32 graph; the manifest's `audio_encoder.int8` holds every form's figures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

PART = "audio_encoder"
SEMANTIC = ("/semantic_model/", "/encoder_semantic/")  # HuBERT and the semantic encoder
SCOPES = (*SEMANTIC, "/acoustic_encoder/")
FORMS = {"all": SCOPES, "semantic": SEMANTIC}  # tried in this order (fastest first); else fp32
DITHER_RMS = 1e-3  # the gate's reference change of the input: white noise at -60 dBFS
GATE_SEED = 0
POLICY = 1  # bump when the forms or the gate change: a build whose encoder was refused or kept tries again
MIN_DEPTH = 64  # a GEMM whose inner dimension (C_in x kernel) is below this stays fp32 (conv1: 1 x 7)
BITS = 7
INT64_MAX = 2 ** 63 - 1


def _eligible(node, weights: dict, scopes: tuple = SCOPES) -> bool:
    if node.op_type not in ("Conv", "MatMul") or not node.name.startswith(scopes) or node.input[1] not in weights:
        return False
    w = weights[node.input[1]]
    if node.op_type == "MatMul":
        return w.ndim == 2 and w.shape[0] >= MIN_DEPTH
    if node.op_type == "Conv":  # 1-D, one group, explicit pads (the exporter writes them; auto_pad is not read here)
        attrs = {a.name: a for a in node.attribute}
        group = attrs["group"].i if "group" in attrs else 1
        auto = attrs["auto_pad"].s if "auto_pad" in attrs else b"NOTSET"
        return w.ndim == 3 and group == 1 and auto == b"NOTSET" and w.shape[1] * w.shape[2] >= MIN_DEPTH
    return False


class _Graph:
    """Nodes and initializers of the rewritten graph, with unique names under `enc8/`."""

    def __init__(self, bits: int):
        self.nodes, self.inits, self.bits = [], [], bits

    def node(self, op: str, inputs: list[str], out: str, **attrs) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def const(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def quantized(self, x: str, n: str) -> tuple[str, str, str]:
        """x (float) -> its u8 tensor, scale and zero point (one per tensor)."""
        from onnx import helper

        q, s, z = n + "/q", n + "/q_scale", n + "/q_zero"
        self.nodes.append(helper.make_node("DynamicQuantizeLinear", [x], [q, s, z], name=n + "/quantize"))
        return q, s, z

    def gemm(self, q: str, s: str, z: str, w: np.ndarray, n: str, out: str, bias: str | None) -> str:
        """u8 q [.., K] x float w [K, N] on MatMulInteger, back to float (`out`)."""
        from onnx import TensorProto

        from ..quantize import quantize_columns

        w8, cols = quantize_columns(w, self.bits)
        acc = self.node("MatMulInteger", [q, self.const(n + "/w8", w8), z], n + "/i32")
        f = self.node("Cast", [acc], n + "/f32", to=TensorProto.FLOAT)
        scale = self.node("Mul", [s, self.const(n + "/w_scale", cols)], n + "/scale")
        if bias is None:
            return self.node("Mul", [f, scale], out)
        return self.node("Add", [self.node("Mul", [f, scale], n + "/scaled"), bias], out)

def _conv(g: _Graph, node, w: np.ndarray) -> None:
    """One Conv1d (group 1) as channels-last im2col in u8 + MatMulInteger (see the module docstring)."""
    attrs = {a.name: list(a.ints) for a in node.attribute if a.ints}
    k = w.shape[2]
    d, s = attrs.get("dilations", [1])[0], attrs.get("strides", [1])[0]
    p0, p1 = attrs.get("pads", [0, 0])
    n = "enc8" + node.name
    q, sc, z = g.quantized(g.node("Transpose", [node.input[0]], n + "/nlc", perm=[0, 2, 1]), n)
    if p0 or p1:
        q = g.node("Pad", [q, g.const(n + "/pads", np.array([0, p0, 0, 0, p1, 0], np.int64)), z], n + "/pad")
    taps = [q] if k == 1 and s == 1 else []
    for j in range(k if not taps else 0):  # tap j: x[j*d :: s], as many as the output has frames
        end = -(k - 1 - j) * d or INT64_MAX
        ends = [g.const(f"{n}/{what}{j}", np.array([v], np.int64)) for what, v in (("start", j * d), ("end", end))]
        axes = [g.const(f"{n}/axes", np.array([1], np.int64)), g.const(f"{n}/steps", np.array([s], np.int64))] \
            if j == 0 else [f"{n}/axes", f"{n}/steps"]
        taps.append(g.node("Slice", [q, *ends, *axes], f"{n}/tap{j}"))
    cols = taps[0] if len(taps) == 1 else g.node("Concat", taps, n + "/im2col", axis=2)  # [B, L', k*C]
    wk = np.ascontiguousarray(w.transpose(2, 1, 0).reshape(k * w.shape[1], w.shape[0]))  # [(tap, c), C_out]
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    y = g.gemm(cols, sc, z, wk, n, n + "/y", bias)
    g.node("Transpose", [y], node.output[0], perm=[0, 2, 1])


def rewrite(model, base: Path, bits: int = BITS, scopes: tuple = SCOPES):
    """The fp32 encoder ModelProto `model` (external data in folder `base`) -> a new ModelProto with its encoders'
    convolutions and projections on the integer GEMM; returns (model, {"convs": n, "matmuls": n})."""
    import onnx
    from onnx import numpy_helper

    from ..quantize import read_weight

    weights = {t.name: np.asarray(read_weight(t, base)) for t in model.graph.initializer}
    g = _Graph(bits)
    counts = {"Conv": 0, "MatMul": 0}
    for node in model.graph.node:
        if not _eligible(node, weights, scopes):
            g.nodes.append(node)
            continue
        counts[node.op_type] += 1
        if node.op_type == "Conv":
            _conv(g, node, weights[node.input[1]])
        else:
            n = "enc8" + node.name
            q, sc, z = g.quantized(node.input[0], n)
            g.gemm(q, sc, z, weights[node.input[1]], n, node.output[0], None)
    used = {i for nd in g.nodes for i in nd.input}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(g.nodes)
    kept = [numpy_helper.from_array(weights[t.name], t.name) for t in model.graph.initializer if t.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept + g.inits)
    return out, {"convs": counts["Conv"], "matmuls": counts["MatMul"]}


def write(src: Path, dst: Path, bits: int = BITS, scopes: tuple = SCOPES) -> dict:
    """Rewrite the fp32 encoder graph `src` (+ its external data) into `dst` + `dst.name.data` (new files)."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)  # its data is read with memmap (hard links refused)
    out, counts = rewrite(model, src.parent, bits, scopes)
    del model
    data = dst.with_name(dst.name + ".data")
    for p in (dst, data):
        p.unlink(missing_ok=True)
    onnx.save(out, str(dst), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
              size_threshold=1024)
    data.chmod(dst.stat().st_mode & 0o777)  # onnx writes the data owner-only; the graph's mode follows the umask
    return counts


# ---------------------------------------------------------------------------------------------------------------
# the gate: each form's codes against fp32's on the bundled recordings


def recordings() -> list[Path]:
    """The bundled recordings (odd lengths; one 22.05 kHz stereo): what the gate encodes."""
    folder = Path(__file__).resolve().parent.parent / "assets" / "recordings"
    return sorted(folder.glob("*.flac"))


def encode_all(path: Path, wavs: list[np.ndarray]) -> list[np.ndarray]:
    """(N, T) codes of each waveform through the encoder graph `path` (its session released afterwards)."""
    from ..providers import BUILD_PROVIDER
    from ..runtime.session import create_session

    session = create_session(path, BUILD_PROVIDER.name, name=PART)
    out = [session.run(None, {"waveform": w[None]})[0][0] for w in wavs]
    del session
    return out


def agreement(want: list[np.ndarray], got: list[np.ndarray]) -> list[list[float]]:
    """Per recording, the share of equal codes per codebook (0 where the frame counts differ)."""
    return [(a == b).mean(1).tolist() if a.shape == b.shape else [0.0] * len(a) for a, b in zip(want, got, strict=True)]


def judge(names: list[str], form: list[list[float]], dither: list[list[float]]) -> dict:
    """A form's per-codebook agreement with fp32 against the dithered fp32's, per recording -> figures and `ok`."""
    rows, failed = {}, []
    for name, f, d in zip(names, form, dither, strict=True):
        rows[name] = {"per_codebook": [round(x, 4) for x in f], "mean": round(float(np.mean(f)), 4),
                      "dither_mean": round(float(np.mean(d)), 4), "first": round(f[0], 4),
                      "dither_first": round(d[0], 4)}
        r = rows[name]
        failed += [f"{name}: {what} {r[what]:.3f} < dithered {r['dither_' + what]:.3f}"
                   for what in ("mean", "first") if r[what] < r["dither_" + what]]
    return {"recordings": rows, "failed": failed, "ok": not failed}


def choose(src: Path, work: Path, sample_rate: int, say=print) -> tuple[Path | None, dict]:
    """Try `FORMS` on the fp32 encoder graph `src` (codec rate `sample_rate`), writing each into `work`; returns (the
    first form's graph that
    passes its gate, or None: keep fp32) and the figures for the manifest."""
    from ..audio import load_reference

    paths = recordings()
    wavs = [load_reference(p, sample_rate) for p in paths]
    rng = np.random.default_rng(GATE_SEED)
    dithered = [w + (DITHER_RMS * rng.standard_normal(w.size)).astype(np.float32) for w in wavs]
    base = encode_all(src, wavs + dithered)
    base, dither = base[:len(wavs)], agreement(base[:len(wavs)], base[len(wavs):])
    info = {"policy": POLICY, "bits": BITS, "dither_rms": DITHER_RMS, "forms": {}, "form": None}
    for form, scopes in FORMS.items():
        dst = work / form / src.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        counts = write(src, dst, BITS, scopes)
        verdict = judge([p.name for p in paths], agreement(base, encode_all(dst, wavs)), dither)
        info["forms"][form] = {"scopes": list(scopes), **counts, **verdict}
        say(f"int8 encoder, {form}: " + ("passes its gate" if verdict["ok"] else "; ".join(verdict["failed"])))
        if verdict["ok"]:
            info["form"] = form
            return dst, info
    return None, info


def summary(info: dict) -> str:
    """One line: the kept form and its worst figures against the dithered fp32's, or why none was kept."""
    if info.get("form") is None:
        return "no form passed: " + "; ".join(f"{k}: {', '.join(v['failed'])}" for k, v in info["forms"].items())
    rows = info["forms"][info["form"]]["recordings"].values()
    return (f"{info['bits']}-bit weights, codes equal to fp32's: {min(r['mean'] for r in rows):.1%} (first codebook "
            f"{min(r['first'] for r in rows):.1%}) against {min(r['dither_mean'] for r in rows):.1%} "
            f"({min(r['dither_first'] for r in rows):.1%}) for the recordings with -60 dBFS noise, worst recording")
