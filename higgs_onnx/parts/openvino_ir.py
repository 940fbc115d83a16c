"""ONNX -> OpenVINO IR, the build side of the OpenVINO route (the runtime side, `OvPart`, is `runtime.openvino`):

    to_ir(Path("llm_decoder.onnx"), Path("out/llm_decoder.xml"), "int4", block_size=32)
    describe_ir(xml, "int4")      # the build's graph check: ops, nodes, compressed weights at int4
    ir_signature(xml)             # the manifest's inputs/outputs, as the ONNX file declared them

`parts/llm_decoder.py` calls `to_ir` when it builds for `--device openvino`; the exporter's graph check and the
manifest's I/O signature read an `.xml` through the two functions below.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..runtime.openvino import PRECISIONS, RT_KEY, io_info, port_names, read_model


def to_ir(onnx_path: Path, out_xml: Path, precision: str, block_size: int = 32, mode: str = "int4_sym") -> Path:
    """Convert one ONNX part to OpenVINO IR (`out_xml` + its `.bin`) at `precision`:
    - "fp32": weights as they are; "fp16": fp16 weights (decompressed to f32 at compile time on the CPU);
    - "int4": nncf's data-free weight compression, `mode` INT4_SYM by default (symmetric RTN like
      `higgs_onnx.quantize`, so it lands next to the ORT export's int4; and faster on the CPU plugin: 4b step
      82-88 ms vs 98 ms for INT4_ASYM), group `block_size`, ratio 1.0 and all_layers (every MatMul/Gather weight
      at int4, as the MatMulNBits decoder has it; nncf would otherwise keep the last layer at int8). No data.
    The ONNX io names, dim names and metadata_props go into the IR's rt_info for `OvPart`. Works on the portable
    decoder and on ModelBuilder's GQA decoder alike.

    Why openvino + nncf directly and not Olive's OpenVINOConversion / OpenVINOWeightCompression (which call the
    same `ov.convert_model` / `nncf.compress_weights`): see `OLIVE_NOTE`."""
    import openvino as ov

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if mode not in ("int4_sym", "int4_asym"):
        raise ValueError(f"mode must be int4_sym or int4_asym, got {mode!r}")
    onnx_path, out_xml = Path(onnx_path), Path(out_xml)
    model, info = read_model(onnx_path, onnx_path.stem)
    model.set_rt_info(info.to_json(), [RT_KEY, "graph"])
    model.set_rt_info(precision, [RT_KEY, "precision"])
    if precision == "int4":
        import nncf

        nncf.set_log_level(logging.ERROR)
        _type_empty_constants(model)
        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode[mode.upper()], group_size=block_size,
                                      ratio=1.0, all_layers=True)
        model.set_rt_info(str(block_size), [RT_KEY, "block_size"])
    out_xml.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(out_xml), compress_to_fp16=precision == "fp16")
    del model
    return out_xml


def _type_empty_constants(model) -> None:
    """The ONNX front end feeds GroupQueryAttention's absent optional inputs as empty Constants of element type
    `dynamic`, which nncf's graph builder refuses ("NNCF is not yet supported OpenVINO data type: dynamic"): give
    them f32 (they stay empty; the op only checks that they are absent)."""
    import openvino as ov

    for node in model.get_ordered_ops():
        if node.get_type_name() == "Constant" and node.get_output_element_type(0).is_dynamic() \
                and node.get_output_partial_shape(0).is_static and node.get_output_shape(0) == [0]:
            node.output(0).replace(ov.op.Constant(ov.Type.f32, ov.Shape([0]), []).output(0))
    model.validate_nodes_and_infer_types()


OLIVE_NOTE = (
    "Olive's OpenVINOWeightCompression re-reads the converted IR with a bare ov.Core() that lacks OpenVINO's "
    "GroupQueryAttention IR extension, so it fails on a ModelBuilder decoder ('Cannot create GroupQueryAttention "
    "layer ... from unsupported opset: extension'); on other graphs it works (tested: audio_heads -> i4 IR) but "
    "writes a full-precision intermediate IR first (16 GB more disk for the 4b decoder), saves with "
    "compress_to_fp16 on, and cannot carry the ONNX dim names/metadata this module keeps in rt_info.")


def weight_types(model) -> dict[str, int]:
    """Element type -> count over the model's weight Constants (those with more than 1024 elements)."""
    counts: dict[str, int] = {}
    for n in model.get_ordered_ops():
        if n.get_type_name() == "Constant" and np.prod(n.get_output_shape(0), dtype=np.int64) > 1024:
            t = n.get_output_element_type(0).get_type_name()
            counts[t] = counts.get(t, 0) + 1
    return counts


def describe_ir(path: Path, precision: str) -> dict:
    """The op types and weight types of an IR, for the export's graph check; at int4 the weights must be
    compressed (u4/i4 constants) and no MatMul may keep a float weight. RuntimeError otherwise."""
    model, _ = read_model(Path(path))
    ops = sorted({n.get_type_name() for n in model.get_ordered_ops()})
    weights = weight_types(model)
    if precision == "int4":
        if not {"u4", "i4"} & set(weights):
            raise RuntimeError(f"{Path(path).name}: an int4 IR without u4/i4 weights (weights: {weights})")
        float_mm = [n.get_friendly_name() for n in model.get_ordered_ops() if n.get_type_name() == "MatMul"
                    and any(_float_const(i.get_source_output().get_node()) for i in n.inputs())]
        if float_mm:
            raise RuntimeError(f"{Path(path).name}: {len(float_mm)} MatMul(s) kept float weights at int4, e.g. "
                               f"{float_mm[0]}")
    return {"ops": ops, "nodes": len(model.get_ordered_ops()), "weights": weights, "checker": "openvino read_model"}


def _float_const(node) -> bool:
    return (node.get_type_name() == "Constant" and node.get_output_element_type(0).get_type_name() in ("f32", "f16")
            and np.prod(node.get_output_shape(0), dtype=np.int64) > 1024)


def ir_signature(path: Path) -> dict:
    """Names, dtypes and (named) dims of an IR's inputs and outputs, like `export.io_signature`."""
    model, info = read_model(Path(path))
    ins = port_names(model.inputs, info.inputs)
    outs = port_names(model.outputs, info.outputs)

    def entry(port, name):
        io = io_info(port, name, info.dims.get(name))
        return {"name": name, "dtype": np.dtype(port.get_element_type().to_dtype()).name, "shape": io.shape}

    return {"inputs": [entry(p, n) for p, n in zip(model.inputs, ins, strict=True)],
            "outputs": [entry(p, n) for p, n in zip(model.outputs, outs, strict=True)]}
