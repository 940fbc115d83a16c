"""The int4 decoder's weight layout (block size and quantizer), chosen at build time by a gate against fp32.

A one-row decode step is bound by the bytes it reads. On x86, ONNX Runtime's `MatMulNBits` at accuracy level 4
reads per weight the packed codes (0.5 B), the block's fp32 scale and an fp32 block sum MLAS makes from it at
session creation (`quantize.read_bytes_per_weight`): 0.75 B at block 32, 0.625 at 64, 0.5625 at 128. A larger
block rounds coarser, so it is taken only where the model stays as close to fp32 as today's layout (block 32,
round to nearest):

- the reference: the int8 route gate's prompts (`parity.real_prompts` of `parity.GATE_TEXTS`: two zero-shot
  lines and the bundled reference's clone prefix) through the fp32 PyTorch reference: hidden states over every
  position and the audio head's logits on them (the exact fp32 head);
- the baseline, `BASELINE`, quantized from the decoder's fp32 graph (the build makes it anyway), then candidates,
  each prefilled on the same prompts through ONNX Runtime (one session at a time; the quantizer streams one weight
  at a time); a candidate passes when its worst prompt is no further from fp32 than the baseline's (1 - cosine,
  hidden states and logits, x `ALLOWANCE`);
- the candidates: `QUANTIZER` up `LADDER` (block 64, then 128) while each passes: a larger block with the same
  quantizer rounds coarser, so once one is refused the next is not tried (on the 4b geometry each candidate costs
  a quantizing pass and a prefill, about 80 s); the largest that passes is the layout. None passes: block 32 with
  `QUANTIZER` if it passes (the same bytes, nearer fp32), else the baseline. `--block-size` skips the gate.

The figures go to the manifest (the decoder's `int4_layout`), taken by the exporter from the build's
`parts.BUILD_FACTS`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

POLICY = 1  # bump when the candidates or the rule change: the decoder part is built (and gated) again
BASELINE = (32, "rtn")  # the layout every build had before the gate: block 32, MLAS's round to nearest
# the candidates' quantizer: "search" is never further from a block's fp32 weights than "rtn" at the same block
# (its ratios include RTN's scale); asymmetric blocks read more bytes (zero points) and ran no faster
# (benchmarks/int4_layout.py, docs/building.md "The int4 layout")
QUANTIZER = "search"
LADDER = (64, 128)  # the larger blocks, climbed while each passes
ALLOWANCE = 1.0  # a candidate may be at most this many times further from fp32 than the baseline: no further


def reference(ckpt: Path) -> tuple[list[tuple[str, np.ndarray, np.ndarray]], np.ndarray]:
    """The gate prompts through the fp32 reference: [(name, (P, D) embeddings, (P, D) hidden states)] and the
    audio head's matrix (N*V, D) float32; the reference is released before returning."""
    from ..memory import release_memory
    from ..parity import GATE_TEXTS, real_prompts
    from ..reference.model import ReferenceBackend, ReferenceModel

    ref = ReferenceModel(ckpt, dtype="fp32")
    prompts = real_prompts(ReferenceBackend(ref), ref, ref.tokenizer, ref.tokens, ref.facts, GATE_TEXTS)
    out = [(name, embeds, ref.hidden_states(embeds)) for name, embeds in prompts]
    head = ref.audio_matrix.float().numpy().copy()
    del ref
    release_memory()
    return out, head


def distances(path: Path, facts, prompts: list, head: np.ndarray) -> dict:
    """The int4 decoder `path` on the gate prompts: worst over them of 1 - cosine against the reference's hidden
    states and logits."""
    from ..memory import release_memory
    from ..parity import cosine, decoder_trace
    from ..runtime.decoder import SimpleDecoder
    from ..runtime.session import open_part

    decoder = SimpleDecoder(open_part("llm_decoder", path), facts)
    worst = {"hidden_distance": 0.0, "logit_distance": 0.0}
    for _, embeds, want in prompts:
        got = decoder_trace(decoder, embeds, len(embeds))
        worst["hidden_distance"] = max(worst["hidden_distance"], 1.0 - cosine(want, got))
        worst["logit_distance"] = max(worst["logit_distance"], 1.0 - cosine(want @ head.T, got @ head.T))
    del decoder
    release_memory()
    return worst


def failures(got: dict, baseline: dict) -> list[str]:
    """Why a candidate is refused: each distance above the baseline's x `ALLOWANCE` (none: it passes)."""
    return [f"{k} {got[k]:.3e} > {BASELINE[0]}-{BASELINE[1]}'s {baseline[k]:.3e}"
            + (f" x {ALLOWANCE}" if ALLOWANCE != 1.0 else "")
            for k in ("hidden_distance", "logit_distance") if not got[k] <= ALLOWANCE * baseline[k]]


def choose(fp32_graph: Path, out_graph: Path, ckpt: Path, accuracy_level: int, say=print,
           int8_dst: Path | None = None, int8_bits: int = 8) -> dict:
    """Quantize `fp32_graph` into `out_graph` (+ `.data`) at the layout the gate chooses; returns its figures (also
    written beside `out_graph` to `parts.BUILD_FACTS`, as `int4_layout`). `int8_dst`/`int8_bits`: the route's
    weights, written once with the baseline (they do not depend on the int4 layout)."""
    from ..checkpoint import validate
    from ..quantize import quantize_model_int4, read_bytes_per_weight
    from . import BUILD_FACTS

    t0 = time.perf_counter()
    facts = validate(ckpt)
    say("int4 layout: the gate prompts through the fp32 reference")
    prompts, head = reference(ckpt)
    rows = []

    def row(block: int, quantizer: str, figures: dict, verdict: str) -> dict:
        r = {"block_size": block, "quantizer": quantizer, "accuracy_level": accuracy_level,
             "bytes_per_weight": read_bytes_per_weight(block, accuracy_level), **figures, "verdict": verdict}
        rows.append(r)
        say(f"int4 layout: block {block} {quantizer} ({r['bytes_per_weight']:.4f} B/weight read): 1 - cosine vs "
            f"fp32 hidden {figures['hidden_distance']:.3e}, logits {figures['logit_distance']:.3e}: {verdict}")
        return r

    quantize_model_int4(fp32_graph, out_graph, block_size=BASELINE[0], accuracy_level=accuracy_level,
                        layout=BASELINE[1], int8_dst=int8_dst, int8_bits=int8_bits)
    baseline = distances(out_graph, facts, prompts, head)
    row(*BASELINE, baseline, "baseline")

    def passes(block: int) -> bool:
        """Gate (block, `QUANTIZER`); one that passes takes the baseline's place in `out_graph`'s folder."""
        scratch = out_graph.parent.with_name(f"{out_graph.parent.name}.b{block}-{QUANTIZER}")
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        try:
            cand = scratch / out_graph.name
            quantize_model_int4(fp32_graph, cand, block_size=block, accuracy_level=accuracy_level, layout=QUANTIZER)
            figures = distances(cand, facts, prompts, head)
            failed = failures(figures, baseline)
            row(block, QUANTIZER, figures, "refused: " + "; ".join(failed) if failed else "passes")
            if not failed:
                for name in (out_graph.name, out_graph.name + ".data"):  # new files in place of the last ones
                    os.replace(scratch / name, out_graph.parent / name)
            return not failed
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    chosen = BASELINE
    for block in LADDER:
        if not passes(block):
            break
        chosen = (block, QUANTIZER)
    if chosen == BASELINE and passes(BASELINE[0]):
        chosen = (BASELINE[0], QUANTIZER)
    info = {"policy": POLICY, "block_size": chosen[0], "quantizer": chosen[1], "accuracy_level": accuracy_level,
            "bytes_per_weight": read_bytes_per_weight(chosen[0], accuracy_level), "allowance": ALLOWANCE,
            "prompts": [name for name, _, _ in prompts], "candidates": rows,
            "seconds": round(time.perf_counter() - t0, 1)}
    (out_graph.parent / BUILD_FACTS).write_text(json.dumps({"int4_layout": info}, indent=1))
    return info


def summary(info: dict) -> str:
    return (f"block {info['block_size']} {info['quantizer']} ({info['bytes_per_weight']:.4f} B/weight read), "
            f"gated against fp32 in {info['seconds']:.0f} s")
