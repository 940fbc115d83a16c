"""Writes a folder in the community's Higgs ONNX layout (the one `onnx-community/higgs-audio-v3-tts-4b` holds: the
design card's six parts under their own I/O names, a `manifest.json` with `sub_models`) from one of our own exports
of the same checkpoint, for the tests of `runtime/foreign.py`.

The small parts are our graphs under the other layout's names (an Identity node per renamed input or output; the
encoder takes `input_values` [B, 1, T] through a Squeeze); the decoder is our cpu fp32 ModelBuilder graph
(`decoder="fp32"`), or a ModelBuilder `-e cuda` build with float16 activations and KV cache (`decoder="fp16"`, built
from the checkpoint's Qwen3 body; `fused_norm=True` keeps ModelBuilder's default of the Q/K norm inside the attention
node, which the CPU provider refuses; False builds it apart, as older onnxruntime-genai releases did).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
from onnx import helper

SIX = ("text_embed", "audio_encoder", "audio_embed", "llm_decoder", "audio_heads", "audio_tokenizer")
# part -> ({our input: theirs}, {our output: theirs})
RENAMES = {
    "text_embed": ({}, {"embeddings": "inputs_embeds"}),
    "audio_embed": ({"audio_codes": "codes"}, {"embeddings": "audio_embeds"}),
    "audio_heads": ({}, {"logits": "audio_logits"}),
    "audio_tokenizer": ({}, {}),
}


def _renamed(src: Path, dst: Path, inputs: dict[str, str], outputs: dict[str, str], squeeze: str | None = None):
    """`src` saved as `dst` (weights in `dst.name + '.data'`) with its inputs/outputs renamed by Identity nodes;
    `squeeze`: the one input fed as [B, 1, T] under that name and squeezed to our [B, T]."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # onnx refuses external data with several hard links (ours)
        for f in (src, src.with_name(src.name + ".data")):
            if f.exists():
                shutil.copyfile(f, Path(tmp) / f.name)
        model = onnx.load(str(Path(tmp) / src.name))
    g = model.graph
    nodes = []
    for x in g.input:
        new = squeeze if squeeze else inputs.get(x.name)
        if not new:
            continue
        if squeeze:
            axes = helper.make_tensor("squeeze_axes", onnx.TensorProto.INT64, [1], [1])
            g.initializer.append(axes)
            nodes.append(helper.make_node("Squeeze", [new, "squeeze_axes"], [x.name]))
            x.type.tensor_type.shape.Clear()
            for d in ("batch", 1, "samples"):
                dim = x.type.tensor_type.shape.dim.add()
                if isinstance(d, str):
                    dim.dim_param = d
                else:
                    dim.dim_value = d
        else:
            nodes.append(helper.make_node("Identity", [new], [x.name]))
        x.name = new
    rest = list(g.node)
    del g.node[:]
    g.node.extend(nodes + rest)
    for y in g.output:
        if y.name in outputs:
            g.node.append(helper.make_node("Identity", [y.name], [outputs[y.name]]))
            y.name = outputs[y.name]
    onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data", size_threshold=1024)


def _decoder_fp16(ckpt: Path, out: Path, work: Path, fused_norm: bool) -> None:
    """A ModelBuilder `-e cuda` fp16 decoder of the checkpoint's body -> out/llm_decoder.onnx (+ .data)."""
    from higgs_onnx.checkpoint import extract_qwen3
    from higgs_onnx.parts.llm_decoder import _model_builder

    qwen3 = extract_qwen3(ckpt, work / "qwen3")
    built = work / "mb"
    _model_builder(qwen3, built, "fp16", "cuda", work / "mb_cache",
                   **({} if fused_norm else {"fuse_qk_norm_gqa": "false"}))
    for name in ("llm_decoder.onnx", "llm_decoder.onnx.data", "genai_config.json"):
        shutil.copyfile(built / name, out / name)


def write_community(export: Path, out: Path, *, decoder: str = "fp32", ckpt: Path | None = None,
                    fused_norm: bool = False, work: Path | None = None) -> Path:
    """Our cpu fp32 `export` written as a community-layout folder `out` (decoder "fp32": its own graph; "fp16":
    a cuda fp16 build of `ckpt`'s body, made in `work`)."""
    out.mkdir(parents=True, exist_ok=True)
    for part, (ins, outs) in RENAMES.items():
        _renamed(export / f"{part}.onnx", out / f"{part}.onnx", ins, outs)
    _renamed(export / "audio_encoder.onnx", out / "audio_encoder.onnx", {}, {}, squeeze="input_values")
    if decoder == "fp32":
        for name in ("llm_decoder.onnx", "llm_decoder.onnx.data", "genai_config.json"):
            shutil.copyfile(export / name, out / name)
        device, precision, ep = "cpu", "fp32", "CPUExecutionProvider"
    else:
        _decoder_fp16(ckpt, out, work or out.parent / f".work-{out.name}", fused_norm)
        device, precision, ep = "cuda", "fp16", "CUDAExecutionProvider"
    shutil.copyfile(export / "tokenizer.json", out / "tokenizer.json")
    cfg = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    subs = {p: {"filename": f"{p}.onnx"} for p in SIX}
    subs["llm_decoder"].update(num_layers=cfg["num_hidden_layers"], num_kv_heads=cfg["num_key_value_heads"])
    (out / "manifest.json").write_text(json.dumps({"device": device, "precision": precision,
                                                   "execution_provider": ep, "sub_models": subs}, indent=2))
    return out


def with_standalone_dir(folder: Path, sub: str = "decoder") -> Path:
    """The folder's decoder (graph, weights, genai_config.json) moved into `sub/`, its manifest naming that
    `standalone_dir`, as older exports of this layout have it."""
    (folder / sub).mkdir()
    for name in ("llm_decoder.onnx", "llm_decoder.onnx.data", "genai_config.json"):
        (folder / name).rename(folder / sub / name)
    data = json.loads((folder / "manifest.json").read_text())
    data["sub_models"]["llm_decoder"]["standalone_dir"] = sub
    (folder / "manifest.json").write_text(json.dumps(data))
    return folder
