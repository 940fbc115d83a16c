"""Can the decode rows of a running batch ride along a new request's prefill chunk in ONE decoder call?

Issue 21 asked to measure whether one call of (B, S) inputs (decode rows right-padded to the chunk's S positions,
per-row lengths in the attention mask) beats a batched decode step plus a separate prefill chunk. This probe makes
that call on the export's decoder (two slots: one decodes a step, one prefills S positions) and compares it with
the two separate calls, for correctness first, then time.

    python benchmarks/ride_along.py --model-path onnx/cpu_int4 [--chunk 16]

On ModelBuilder's GroupQueryAttention graph (onnxruntime 1.32, pinned) the call is refused: "batch_size must be 1 when
sequence_length > 1 and past context is given"; the kernel places a row's S new tokens at [total - S, total), so a
padded decode row would also overwrite S - 1 of its own cached positions. The scheduler therefore runs a prefill
chunk and the decode step as separate calls (`generation/scheduler.py`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def probe(model_path: Path, chunk: int = 16) -> dict:
    import onnxruntime as ort

    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(model_path, verify=False, step_graph=False)  # the decoder graph's own kernel is what is probed
    dec, d = tts.backend.decoder, tts.facts.hidden
    if not hasattr(dec, "offset_binding"):
        return {"supported": False, "reason": f"{type(dec).__name__} has no batched slot pool"}
    rng = np.random.default_rng(0)
    history = [rng.standard_normal((n, d)).astype(np.float32) * 0.1 for n in (10, 5)]
    step = rng.standard_normal((1, d)).astype(np.float32) * 0.1
    new = rng.standard_normal((chunk, d)).astype(np.float32) * 0.1

    def pool():
        p = dec.pool(2, 64 + chunk)
        slots = [p.acquire(64 + chunk) for _ in history]
        for s, h in zip(slots, history, strict=True):
            p.run_one(s, h)
        return p, slots

    p, (a, b) = pool()
    t0 = time.perf_counter()
    want_a, want_b = p.run_one(a, step)[-1], p.run_one(b, new)
    separate_s = time.perf_counter() - t0
    p, _ = pool()
    io, _ = p._binding(0, 2)
    feed = np.zeros((2, chunk, d), p.embed_dtype)
    feed[0, 0], feed[1] = step[0], new
    la, lb = p.lengths[0], p.lengths[1]
    mask = np.zeros((2, max(la + 1, lb + chunk)), np.int64)
    mask[0, :la + 1], mask[1, :lb + chunk] = 1, 1
    out = ort.OrtValue.ortvalue_from_shape_and_type((2, chunk, d), p.embed_dtype, p.memory, 0)
    io.bind_cpu_input("inputs_embeds", feed)
    io.bind_cpu_input("attention_mask", mask)
    io.bind_ortvalue_output("hidden_states", out)
    try:
        t0 = time.perf_counter()
        p.session.run_with_iobinding(io)
        one_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - the answer of the probe
        return {"supported": False, "reason": str(e).split("Status Message: ")[-1].split("\n")[0].split("\x1b")[0],
                "separate_s": separate_s}
    h = out.numpy()
    return {"supported": True, "decode_row_max_diff": float(np.abs(h[0, 0] - want_a).max()),
            "prefill_max_diff": float(np.abs(h[1] - want_b).max()), "one_call_s": one_s, "separate_s": separate_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, required=True)
    ap.add_argument("--chunk", type=int, default=16)
    args = ap.parse_args(argv)
    r = probe(args.model_path, args.chunk)
    if not r["supported"]:
        print(f"one call: refused ({r['reason']}); the scheduler uses separate calls")
    else:
        print(f"one call: decode row differs by {r['decode_row_max_diff']:.2e}, prefill by {r['prefill_max_diff']:.2e};"
              f" {r['one_call_s'] * 1e3:.1f} ms vs {r['separate_s'] * 1e3:.1f} ms separately")
    return 0


if __name__ == "__main__":
    sys.exit(main())
