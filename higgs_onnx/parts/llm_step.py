"""`llm_step`: the decode step as one graph, composed from the assembled parts (no weights of its own).

    inputs_embeds [B, S, D]   (prefill: the prompt's embeddings; a step: S = 0)
    audio_codes   [B, R, N]   (a step: the sampled codes, R = 1; prefill: R = 0)
    attention_mask, past_key_values.*          (as the decoder's)
 -> hidden_states [B, S + R, D], logits [B, 1, N, V] (the last position's), present.*

`audio_embed` -> Concat after the prompt embeddings -> `llm_decoder` -> the last position -> `audio_heads`, so a
decode step is one `run`: the codes go in, the next logits come out, and the hidden state never leaves the
runtime (no host round trip per step, which is what a GPU needs; on a CPU it saves two session calls and their
copies). The same graph prefills (no codes), so the runtime loads the decoder's weights once: this graph *replaces*
the decoder session, it does not sit beside it.

The graph is derived at assembly from the three part files in the export folder: their nodes are merged (names of
the two small parts prefixed), their initializers keep pointing at the parts' own external-data files, so the
composed file is a few kB and the weights exist once on disk. A cast is inserted wherever the parts' dtypes differ
(an fp16 audio embedding into an fp32 decoder). `check` runs it against the parts chained on the same inputs before
the manifest lists it: the logits must agree to float rounding and the argmax exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..outputs import atomic
from ..part_facts import STEP_PART
from . import FACTS

NAME = STEP_PART
FILE = "llm_step.onnx"
USES = FACTS[NAME].uses  # the parts it is composed from (their files hold its weights); derived, not built
EMBEDS, CODES, HIDDEN, LOGITS = "inputs_embeds", "audio_codes", "hidden_states", "logits"
TOLERANCE = 1e-4  # max |logit difference| / max |logit| against the chained parts (float rounding of a fused graph)


def _prefixed(graph, prefix: str, inputs: dict[str, str]):
    """The graph's nodes and initializers with every name prefixed, its inputs renamed by `inputs`; returns
    (nodes, initializers, {old output name: new})."""
    import onnx

    names = {t.name: prefix + t.name for t in graph.initializer}
    names.update(inputs)
    for node in graph.node:
        for out in node.output:
            if out:
                names[out] = prefix + out
    nodes = []
    for node in graph.node:
        n = onnx.NodeProto()
        n.CopyFrom(node)
        n.name = prefix + (node.name or node.op_type)
        n.input[:] = [names.get(x, x) if x else x for x in node.input]
        n.output[:] = [names[x] if x else x for x in node.output]
        nodes.append(n)
    inits = []
    for t in graph.initializer:
        c = onnx.TensorProto()
        c.CopyFrom(t)
        c.name = names[t.name]
        inits.append(c)
    return nodes, inits, {o.name: names[o.name] for o in graph.output}


def _elem(graph, name: str) -> int:
    for v in list(graph.input) + list(graph.output):
        if v.name == name:
            return v.type.tensor_type.elem_type
    raise KeyError(name)


def compose(folder: Path, files: dict[str, str], decoder=None, file: str = FILE, name: str = NAME) -> Path:
    """Write `folder/llm_step.onnx` from the parts' graph files in `folder` ({part: file name}); returns its path.
    `decoder`: a decoder ModelProto to compose in place of the decoder's file (the int8 GEMM route's twin,
    `parts/llm_route.py`), written as `file`; initializers no node reads are left out."""
    import onnx
    from onnx import TensorProto, helper

    load = {p: onnx.load(str(folder / files[p]), load_external_data=False) for p in USES}
    if decoder is not None:
        load["llm_decoder"] = decoder
    dec, emb, heads = load["llm_decoder"].graph, load["audio_embed"].graph, load["audio_heads"].graph
    if EMBEDS not in {i.name for i in dec.input}:
        raise ValueError(f"{files['llm_decoder']} has no {EMBEDS} input: not a decoder graph this can compose")
    embed_elem, dec_elem = _elem(emb, emb.output[0].name), _elem(dec, EMBEDS)
    hidden_elem, heads_elem = _elem(dec, HIDDEN), _elem(heads, heads.input[0].name)

    e_nodes, e_inits, e_out = _prefixed(emb, "step/embed/", {emb.input[0].name: CODES})
    codes_embeds = e_out[emb.output[0].name]
    nodes = list(e_nodes)
    if embed_elem != dec_elem:
        nodes.append(helper.make_node("Cast", [codes_embeds], ["step/codes_embeds"], to=dec_elem, name="step/cast_in"))
        codes_embeds = "step/codes_embeds"
    nodes.append(helper.make_node("Concat", [EMBEDS, codes_embeds], ["step/inputs_embeds"], axis=1,
                                  name="step/concat"))
    for node in dec.node:
        n = onnx.NodeProto()
        n.CopyFrom(node)
        n.input[:] = ["step/inputs_embeds" if x == EMBEDS else x for x in node.input]
        nodes.append(n)
    consts = [helper.make_tensor("step/last_start", TensorProto.INT64, [1], [-1]),
              helper.make_tensor("step/last_end", TensorProto.INT64, [1], [np.iinfo(np.int64).max]),
              helper.make_tensor("step/last_axis", TensorProto.INT64, [1], [1])]
    nodes.append(helper.make_node("Slice", [HIDDEN, "step/last_start", "step/last_end", "step/last_axis"],
                                  ["step/last"], name="step/last"))
    last = "step/last"
    if hidden_elem != heads_elem:
        nodes.append(helper.make_node("Cast", [last], ["step/last_cast"], to=heads_elem, name="step/cast_out"))
        last = "step/last_cast"
    h_nodes, h_inits, h_out = _prefixed(heads, "step/heads/", {heads.input[0].name: last})
    h_nodes[-1].output[:] = [LOGITS if x == h_out[heads.output[0].name] else x for x in h_nodes[-1].output]
    if h_out[heads.output[0].name] != h_nodes[-1].output[0] and LOGITS not in h_nodes[-1].output:
        raise ValueError("audio_heads' output is not made by its last node")
    nodes += h_nodes

    codes_in = helper.make_tensor_value_info(CODES, TensorProto.INT64, ["batch", "codes_sequence",
                                                                        _dim(emb.input[0], -1)])
    logits_out = helper.make_tensor_value_info(LOGITS, heads_elem, ["batch", 1, *[_dim(heads.output[0], i)
                                                                                  for i in (-2, -1)]])
    used = {x for n in nodes for x in n.input}
    inits = [t for t in [*dec.initializer, *e_inits, *h_inits, *consts] if t.name in used]
    graph = helper.make_graph(nodes, name, [*dec.input, codes_in], [*dec.output, logits_out], initializer=inits)
    opsets = {}
    for m in load.values():
        for o in m.opset_import:
            opsets[o.domain] = max(opsets.get(o.domain, 0), o.version)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                              ir_version=max(m.ir_version for m in load.values()), producer_name="higgs-onnx")
    path = folder / file
    with atomic(path) as tmp:
        onnx.save(model, str(tmp))  # the initializers keep their external-data references (nothing is loaded)
    return path


def _dim(value_info, axis: int):
    d = value_info.type.tensor_type.shape.dim[axis]
    return d.dim_value if d.HasField("dim_value") else d.dim_param


def check(tts, step_session, rows: int = 3, seed: int = 0) -> dict:
    """The step graph against the parts chained: a prefill of a few random embeddings, then `rows` steps of random
    codes. `tts` is a `HiggsTTS` on the same folder driving the parts apart (or a function that loads one) and
    `step_session` an ONNX Runtime session of the step graph (or a function that makes one): given as functions,
    the two are loaded one after the other, never together (a 4b build would hold the decoder twice). Returns the
    worst relative logit difference and whether every argmax agreed (`ok`: within float rounding)."""
    from ..memory import release_memory
    from ..runtime.decoder import SimpleDecoder

    model = tts() if callable(tts) else tts
    f, rng = model.facts, np.random.default_rng(seed)
    feeds = [(rng.standard_normal((5, f.hidden)).astype(np.float32) * 0.05, np.zeros((0, f.num_codebooks), np.int64))]
    feeds += [(np.zeros((0, f.hidden), np.float32), rng.integers(0, f.codebook_size, (1, f.num_codebooks)))
              for _ in range(rows)]
    dec = SimpleDecoder(model.part("llm_decoder"), f)
    cache, want = dec.new_cache(64), []
    empty = {n: a.copy() for n, a in cache.arrays.items()}
    for embeds, codes in feeds:
        if len(codes):
            embeds = model.part("audio_embed")(audio_codes=codes[None])["embeddings"][0].astype(np.float32)
        hidden = dec.run(cache, embeds)[-1:]
        want.append(model.part("audio_heads")(hidden_states=hidden[None])["logits"][0].astype(np.float32))
    del model, dec, cache
    release_memory()
    session = step_session() if callable(step_session) else step_session
    types = {i.name: i.type for i in session.get_inputs()}
    ort_dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    names = [o.name for o in session.get_outputs()]
    past, length, worst, argmax_ok = empty, 0, 0.0, True
    for (embeds, codes), lg in zip(feeds, want, strict=True):
        length += len(embeds) + len(codes)
        outs = dict(zip(names, session.run(None, {EMBEDS: embeds[None].astype(ort_dtype[types[EMBEDS]]),
                                                  CODES: codes[None], "attention_mask": np.ones((1, length), np.int64),
                                                  **past}), strict=True))
        past = {n: outs[n.replace("past_key_values.", "present.")] for n in past}
        got = outs[LOGITS][0].astype(np.float32)
        worst = max(worst, float(np.abs(got - lg).max() / max(np.abs(lg).max(), 1e-12)))
        argmax_ok &= bool((got.argmax(-1) == lg.argmax(-1)).all())
    return {"max_rel_diff": worst, "argmax_equal": argmax_ok, "rows": rows, "ok": worst <= TOLERANCE and argmax_ok}
