"""Sections that measure one part or the decoder on fixed inputs; each returns its figures (a dict), none judges.

`ev` is an `EvalContext` (context.py; `runner.Evaluator` is one): the export (`ev.tts`), the PyTorch reference
(`ev.ref`) and the options.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..generation.delay import read_code_rows
from ..generation.engine import generate
from ..generation.options import GREEDY_OPTIONS
from ..parity import check_part, compare_decoder
from ..part_facts import ROUTE_PART

if TYPE_CHECKING:
    from .context import EvalContext

PARTS_SEED = 101  # fixed inputs of the per-part checks (optimize.py uses its own seed: two draws, not one)
DECODER_SEED = 7  # random audio rows fed after the first prompt in the decoder-steps section
# Text-table rows upcast at once for the tied text head: 8192 x 2560 x 4 B = 84 MB on the 4B geometry, where a full
# fp32 copy of the table (151936 x 2560) would be 1.5 GB of the 8 GB budget.
TEXT_HEAD_ROWS = 8192


def parts(ev: EvalContext) -> dict:
    """Every exported part on fixed inputs vs the reference: {part: figures with `ok` and `precision`}."""
    rows = {}
    for part, entry in ev.tts.manifest.parts.items():
        if part == ROUTE_PART:  # its figures are the route section's, beside the int4 route's
            rows[part] = {"precision": entry["precision"], "skipped": "the int8 route: see the route section"}
            continue
        try:
            fig = check_part(part, ev.tts.manifest.part_file(part), ev.ref, entry["precision"], ev.tts.provider,
                             seed=PARTS_SEED, part=ev.tts.parts.part(part))
        except Exception as e:  # a wrecked part (ORT refuses it, NaNs ...) is a failed row; the others still run
            fig = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        rows[part] = {"precision": entry["precision"], **fig}
    return rows


def decoder_steps(ev: EvalContext) -> dict:
    """The decoder on the first prompt, then `decode_steps` single-row decode steps of random audio rows, vs one
    full reference forward over the same (reference) embeddings: figures with `per_step` cosine / max abs."""
    f, rng = ev.tts.facts, np.random.default_rng(DECODER_SEED)
    prompt = ev.prompt(ev.options.prompts[0])
    rows = rng.integers(0, f.codebook_size, (ev.options.decode_steps, f.num_codebooks))
    be = ev.ref_backend
    embeds = np.concatenate([be.embed_text(np.asarray(prompt)), be.embed_audio(rows)])  # (P + steps, D)
    precision = ev.tts.manifest.parts["llm_decoder"]["precision"]
    # the decoder the backend runs, on its route (bound buffers, OpenVINO state or host arrays; the step graph where
    # the export has one): the same weights, loaded once, and the cache kept the way generation keeps it
    fig, _ = compare_decoder(ev.tts.backend.decoder, ev.ref, embeds, len(prompt), precision)
    return fig


def encoder(ev: EvalContext) -> dict:
    """The export's codec encoder vs the reference's on real recordings: share of equal codes, per codebook; and its
    form (fp32, or an int8 form with the build's gate figures against the fp32 graph: `parts/encoder_int8.py`)."""
    from ..audio import load_reference
    from ..parts.encoder_int8 import summary as int8_summary

    out = {}
    for path in ev.options.recordings:
        wav = load_reference(path, ev.tts.facts.sample_rate)
        a, b = ev.tts.encode_audio(wav), ev.ref.encode_audio(wav)  # (T, N) each
        same = a.shape == b.shape
        out[Path(path).name] = {"samples": int(wav.size), "frames": int(b.shape[0]),
                                "agreement": float((a == b).mean()) if same else 0.0,
                                "per_codebook": (a == b).mean(0).tolist() if same else []}
    ev.ref.release_codec()  # 0.8 GB on the real geometry: eval must fit in 8 GB beside the decoder session
    entry = ev.tts.manifest.parts["audio_encoder"]
    tried = entry.get("int8")
    return {"recordings": out, "agreement": min(r["agreement"] for r in out.values()),
            "precision": entry["precision"], "int8": tried, "int8_summary": int8_summary(tried) if tried else None}


def text_argmax(table, hidden: np.ndarray) -> np.ndarray:
    """(S, D) hidden -> (S,) argmax of the tied text head `hidden @ table^T`, upcasting `TEXT_HEAD_ROWS` rows of the
    (vocab, D) table at a time (first index on ties, like argmax)."""
    import torch

    h = torch.from_numpy(np.ascontiguousarray(hidden, np.float32))
    best = torch.full((len(h),), -torch.inf)
    arg = torch.zeros(len(h), dtype=torch.long)
    with torch.no_grad():
        for start in range(0, table.shape[0], TEXT_HEAD_ROWS):
            value, index = (h @ table[start:start + TEXT_HEAD_ROWS].float().T).max(-1)
            better = value > best
            best, arg = torch.where(better, value, best), torch.where(better, index + start, arg)
    return arg.numpy()


def text_lm(ev: EvalContext) -> dict:
    """The decoder as a plain text LM with the tied text head applied outside the graph: next-token agreement over
    the last prompt and a greedy continuation of `text_tokens` tokens on both."""
    table, n = ev.ref.text_table, ev.options.text_tokens
    ids = ev.tts.tokenizer.encode(ev.options.prompts[-1], add_special_tokens=False).ids
    be, rb = ev.tts.backend, ev.ref_backend
    dec = be.decoder  # the route's own decoder and cache (see decoder_steps)
    o_seq, t_seq = list(ids), list(ids)
    cache = dec.new_cache(len(ids) + n)
    o_next = text_argmax(table, dec.run(cache, be.embed_text(np.asarray(o_seq))))  # (S,)
    t_next = text_argmax(table, ev.ref.hidden_states(rb.embed_text(np.asarray(t_seq))))
    agreement = float((o_next == t_next).mean())
    o_seq.append(int(o_next[-1]))
    t_seq.append(int(t_next[-1]))
    for _ in range(n - 1):
        o_seq.append(int(text_argmax(table, dec.run(cache, be.embed_text(np.asarray(o_seq[-1:])))[-1:])[0]))
        t_seq.append(int(text_argmax(table, ev.ref.hidden_states(rb.embed_text(np.asarray(t_seq)))[-1:])[0]))
    gen_o, gen_t = o_seq[len(ids):], t_seq[len(ids):]
    first = next((i for i, (a, b) in enumerate(zip(gen_o, gen_t, strict=True)) if a != b), None)
    return {"next_token_agreement": agreement, "prompt_tokens": len(ids), "continuation_tokens": n,
            "first_difference": first, "onnx": gen_o, "torch": gen_t}


def teacher_codes(ev: EvalContext) -> dict:
    """Delayed rows from another implementation teacher-forced through the export: share of codes within
    `tolerance` of the export's top logit (ramp-in BOCs are forced, not sampled, and not judged)."""
    o = ev.options
    f = ev.tts.facts
    rows = read_code_rows(o.teacher_codes, f.num_codebooks, f.codebook_vocab, "--teacher-codes")  # (L, N)
    res = generate(ev.tts.backend, ev.prompt(o.prompts[0]), ev.rules,
                   dataclasses.replace(GREEDY_OPTIONS, max_rows=len(rows)), f.placeholder, keep_logits=True,
                   teacher_rows=rows)
    logits = np.stack(res.logits)  # (L, N, V)
    picked = np.take_along_axis(logits, rows[:len(logits), :, None], axis=-1)[..., 0]
    forced = np.triu(np.ones((len(logits), f.num_codebooks), bool), k=1)
    within = (picked >= logits.max(-1) - o.tolerance) | forced
    return {"file": str(o.teacher_codes), "prompt": o.prompts[0], "tolerance": o.tolerance, "rows": len(logits),
            "within_tolerance": float(within.mean()), "per_codebook": within.mean(0).tolist(),
            "rows_outside": np.flatnonzero(~within.all(-1)).tolist()[:50]}


def kv_cache(ev: EvalContext) -> dict:
    """An int8-cache export against the same export with an fp32 cache (`parts/kv_cache.fp32_twin`: the same
    weights, the cache rewrite undone): the build's gates (hidden-state and logit cosine, top-1 agreement,
    teacher-forced) and greedy agreement, measured again here."""
    import tempfile

    from ..parts import kv_cache as kv
    from ..runtime.model import HiggsTTS

    info = ev.tts.manifest.decoder.get("kv_cache", {})
    with tempfile.TemporaryDirectory(prefix="higgs-kv-") as tmp:
        folder = kv.fp32_twin(ev.tts.manifest.folder, Path(tmp) / "fp32-cache")
        # the twin is loaded for its own pass only (a second 4b decoder beside the export and the reference)
        figures = kv.compare(lambda: HiggsTTS(folder, provider=ev.tts.provider, verify=False,  # on the same route
                                             kv_cache=ev.tts.kv_cache, step_graph=ev.tts.step_graph), ev.tts,
                             rows=kv.gate_rows(ev.tts.facts))
    int4 = ev.tts.manifest.parts["llm_decoder"].get("parity", {}).get("cosine_vs_dequantized")
    return {**figures, "mode": info.get("mode"), "thresholds": kv.gates(int4)}


def route(ev: EvalContext) -> dict:
    """Both decoder routes side by side (`parts/llm_route.py`). Per part: the build's gate measured again, prefill
    hidden states and logits of real prompts against the reference (1 - cosine, top-1 codes), int4 and int8.
    End to end: a cloned voice's prefill timed on each route, and greedy rows of the first prompt decoded with its
    prefill on either route (the steps on int4 both times)."""
    from ..generation.pipeline import stop_rules
    from ..generation.prompt import build_prompt
    from ..manifest import crossover_words
    from ..parts import llm_route
    from ..runtime.model import HiggsTTS
    from ..runtime.route import NEVER, RoutePolicy, forced

    info = ev.tts.manifest.decoder.get("route", {})
    tts = ev.tts
    if getattr(tts.backend.decoder, "route", None) is None:  # not loaded under this CPU's policy: load it to measure
        tts = HiggsTTS(ev.tts.manifest.folder, provider=ev.tts.provider, verify=False, route="on")
    dec = tts.backend.decoder
    prompts = llm_route.gate_prompts(tts)  # once: the clone's voice is encoded once for both uses
    gate = llm_route.gate(tts, ev.ref, prompts)
    clone = dict(prompts)["clone prefix"]
    prefill_ms = {label: round(llm_route.time_prefill(dec, clone, route) * 1e3, 2)
                  for label, route in (("int4", False), ("int8", True))}
    text = ev.options.prompts[0]
    options = dataclasses.replace(GREEDY_OPTIONS, max_rows=ev.options.max_rows)
    rows = {}
    for label, policy in (("int4", NEVER), ("int8", RoutePolicy(prefill=2))):
        with forced(dec, policy):
            rows[label] = generate(tts.backend, build_prompt(tts.tokenizer, tts.tokens, text), stop_rules(tts.facts),
                                   options, tts.facts.placeholder).rows
    a, b = rows["int4"], rows["int8"]
    m = min(len(a), len(b))
    same = (a[:m] == b[:m]).all(axis=1) if m else np.ones(0, bool)
    return {"kind": info.get("kind", "none"), "crossover": info.get("crossover"),
            "crossover_words": crossover_words(info), "gate": gate,
            "reference": str(ev.ref.dtype).removeprefix("torch."), "clone_positions": len(clone),
            "clone_prefill_ms": prefill_ms, "greedy_rows": [len(a), len(b)],
            "greedy_equal": float(same.mean()) if m else 1.0,
            "greedy_first_difference": None if same.all() else int(np.argmin(same))}


def intelligibility(ev: EvalContext) -> dict:
    """WER (CER for Chinese/Japanese) of greedy ONNX and PyTorch audio against the prompt text, heard by
    faster-whisper if installed (`asr.Transcriber`). The ASR model is `$HIGGS_ASR_MODEL` (default `base`): a local
    folder, or a name faster-whisper fetches on first use."""
    import importlib.util
    import os

    from ..asr import AsrUnavailable, Transcriber

    if importlib.util.find_spec("faster_whisper") is None:
        return {"skipped": "faster-whisper is not installed (pip install faster-whisper); WER is meaningful only "
                           "on real weights"}
    name = os.environ.get("HIGGS_ASR_MODEL", "base")
    try:
        asr = Transcriber.load(name, local_only=Path(name).is_dir())
    except AsrUnavailable as e:  # no network, unknown model name ...: say so instead of failing the report
        return {"skipped": str(e)}
    rows = [_wer_row(ev, asr, text) for text in ev.options.prompts]
    return {"asr_model": name, "rows": rows, "onnx_wer": float(np.mean([r["onnx_wer"] for r in rows])),
            "torch_wer": float(np.mean([r["torch_wer"] for r in rows]))}


def quality(ev: EvalContext) -> dict:
    """DNSMOS (`quality.Dnsmos`: sig, bak, ovrl on a 1-5 scale) of greedy ONNX and PyTorch audio of each prompt:
    whether it sounds like clean speech (real speech ~3-3.5; noise and the tiny synthetic model ~1.1; silence ~1.8).
    Skipped, said by name, when the speechmos wheel is missing."""
    from ..quality import NoDnsmos, dnsmos

    try:
        scorer = dnsmos()
    except NoDnsmos as e:
        return {"skipped": str(e)}
    options = dataclasses.replace(GREEDY_OPTIONS, max_rows=ev.options.max_rows)
    rows = []
    for text in ev.options.prompts:
        row = {"prompt": text}
        for k, model in (("onnx", ev.tts), ("torch", ev.ref)):
            row[k] = scorer.score(model.generate(text, options=options).waveform, ev.tts.facts.sample_rate)
        rows.append(row)
    return {"rows": rows, **{f"{k}_ovrl": float(np.mean([r[k]["ovrl"] for r in rows])) for k in ("onnx", "torch")}}


def _wer_row(ev: EvalContext, asr, text: str) -> dict:
    from ..asr import error_rate

    options = dataclasses.replace(GREEDY_OPTIONS, max_rows=ev.options.max_rows)
    wavs = {"onnx": ev.tts.generate(text, options=options).waveform,
            "torch": ev.ref.generate(text, options=options).waveform}
    row = {"prompt": text}
    for k, wav in wavs.items():
        heard = asr.hear(wav, ev.tts.facts.sample_rate)
        row[f"{k}_text"] = heard
        row[f"{k}_wer"] = error_rate(text, heard)[1]
    return row
