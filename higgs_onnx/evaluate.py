"""eval.py's report: an export against the PyTorch reference, part by part and step by step.

The same generation loop runs on the ONNX backend and on the PyTorch backend, so every difference is numerics.
Gates (the thresholds of `GATES`, per precision, overridable) decide the exit code.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .generation.loop import generate
from .generation.pipeline import stop_rules
from .generation.prompt import build_prompt
from .generation.sampling import GREEDY, SamplingOptions, softmax
from .parity import check_part, cosine, max_abs

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = ("Hello there, how are you today?",
                   "<|emotion:elation|>The quick brown fox jumps over the lazy dog.",
                   "Speech synthesis turns written words into sound, one frame at a time.")
# Gates per export precision: teacher-forced top-1 agreement of the audio codes and logit cosine; whether greedy
# free-running must match the reference row for row; sampled runs that must stop cleanly.
GATES = {
    "fp32": {"teacher_top1": 0.999, "teacher_cosine": 0.99999, "greedy_identical": 1.0, "eoc_rate": 0.5},
    "fp16": {"teacher_top1": 0.95, "teacher_cosine": 0.999, "greedy_identical": 0.0, "eoc_rate": 0.5},
    "int4": {"teacher_top1": 0.5, "teacher_cosine": 0.95, "greedy_identical": 0.0, "eoc_rate": 0.5},
}


@dataclass
class Report:
    meta: dict
    sections: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failures.append(what)


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray, temperature: float) -> float:
    """Mean KL(p || q) over rows of the softmax at `temperature` (the sampler's distributions before filtering)."""
    p, q = softmax(p_logits / temperature), softmax(q_logits / temperature)
    return float(np.mean(np.sum(p * (np.log(p + 1e-12) - np.log(q + 1e-12)), axis=-1)))


class Evaluator:
    def __init__(self, tts, ref, prompts=DEFAULT_PROMPTS, runs: int = 2, max_frames: int = 600,
                 gates: dict | None = None, decode_steps: int = 8, text_tokens: int = 16):
        self.tts, self.ref, self.prompts, self.runs, self.max_frames = tts, ref, list(prompts), runs, max_frames
        self.precision = tts.manifest.data["precision"]
        self.gates = {**GATES[self.precision], **(gates or {})}
        self.decode_steps, self.text_tokens = decode_steps, text_tokens
        from .reference.model import ReferenceBackend

        self.ref_backend = ReferenceBackend(ref)
        self.rules = stop_rules(tts.facts)

    # -- sections ---------------------------------------------------------------------------------------------
    def parts(self, report: Report) -> None:
        rows = {}
        for part, entry in self.tts.manifest.parts.items():
            try:
                fig = check_part(part, self.tts.manifest.part_file(part), self.ref, entry["precision"], seed=101)
            except (FloatingPointError, RuntimeError, ValueError) as e:  # a wrecked part: report it, go on
                fig = {"ok": False, "error": str(e)}
            rows[part] = {"precision": entry["precision"], **fig}
            if not fig.get("ok", True):
                report.fail(f"part {part}: {fig}")
        report.sections["parts"] = rows
        if report.failures:  # generation through a failed part only repeats its error
            return
        rows["llm_decoder"]["teacher_forced_steps"] = self.decoder_steps()
        rows["audio_encoder"]["recordings"] = self.encoder_on_recordings()

    def decoder_steps(self) -> list[dict]:
        """Hidden states of N single-row decode steps after a prefill, vs one full reference forward."""
        import torch

        from .runtime.decoder import SimpleDecoder

        f, rng = self.tts.facts, np.random.default_rng(7)
        prompt = build_prompt(self.tts.tokenizer, self.tts.tokens, self.prompts[0])
        rows = rng.integers(0, f.codebook_size, (self.decode_steps, f.num_codebooks))
        be = self.tts.backend
        embeds = np.concatenate([be.embed_text(np.asarray(prompt)), be.embed_audio(rows)])
        with torch.no_grad():
            want = self.ref.body(inputs_embeds=torch.from_numpy(embeds)[None].to(self.ref.dtype))
        want = want.last_hidden_state[0].float().numpy()
        dec = SimpleDecoder(self.tts.part("llm_decoder"), f)
        got = [dec.prefill(embeds[:len(prompt)])[-1]] + [dec.step(embeds[i:i + 1])[-1]
                                                         for i in range(len(prompt), len(embeds))]
        idx = range(len(prompt) - 1, len(embeds))
        return [{"step": k, "cosine": cosine(want[i], g), "max_abs": max_abs(want[i], g)}
                for k, (i, g) in enumerate(zip(idx, got, strict=True))]

    def encoder_on_recordings(self) -> dict:
        from .audio import load_reference

        out = {}
        for wav_path in sorted((Path(__file__).resolve().parent.parent / "tests" / "data").glob("*.wav")):
            wav = load_reference(wav_path, self.tts.facts.sample_rate)
            a, b = self.tts.encode_audio(wav), self.ref.encode_audio(wav)
            same = a.shape == b.shape
            out[wav_path.name] = {"samples": int(wav.size), "frames": int(b.shape[0]),
                                  "agreement": float((a == b).mean()) if same else 0.0,
                                  "per_codebook": [float((a[:, c] == b[:, c]).mean()) for c in range(a.shape[1])]
                                  if same else []}
        return out

    def run_both(self, text: str, sampling: SamplingOptions, seed: int, teacher: np.ndarray | None = None):
        prompt = build_prompt(self.tts.tokenizer, self.tts.tokens, text)
        out = {}
        for name, backend in (("onnx", self.tts.backend), ("torch", self.ref_backend)):
            t0 = time.perf_counter()
            res = generate(backend, prompt, self.rules, sampling, np.random.default_rng(seed), self.max_frames,
                           self.tts.facts.placeholder, keep_logits=True,
                           teacher_rows=teacher if name == "onnx" else None)
            res.wall = time.perf_counter() - t0
            out[name] = res
        return out

    def generation(self, report: Report) -> None:
        teacher, free, speed = [], [], {"onnx": [0.0, 0], "torch": [0.0, 0]}
        for text in self.prompts:
            greedy = self.run_both(text, GREEDY, 0)
            o, t = greedy["onnx"], greedy["torch"]
            for name, res in greedy.items():
                speed[name][0] += res.wall
                speed[name][1] += len(res.rows)
            n = min(len(o.rows), len(t.rows))
            diff = [i for i in range(n) if (o.rows[i] != t.rows[i]).any()]
            step = diff[0] if diff else None
            margin = None
            if step is not None:
                c = int(np.flatnonzero(o.rows[step] != t.rows[step])[0])
                top2 = np.sort(t.logits[step][c])[-2:]
                margin = float(top2[1] - top2[0])
            free.append({"prompt": text, "first_divergence": step, "top1_top2_margin": margin,
                         "onnx_rows": len(o.rows), "torch_rows": len(t.rows),
                         "duration_ratio": len(o.codes) / max(len(t.codes), 1),
                         "identical": step is None and len(o.rows) == len(t.rows)})
            forced = self.run_both(text, GREEDY, 0, teacher=t.rows)["onnx"]
            lo, lt = np.stack(forced.logits), np.stack(t.logits)  # (L, N, V)
            teacher.append({"prompt": text, "rows": len(t.rows),
                            "top1_per_codebook": (lo.argmax(-1) == lt.argmax(-1)).mean(0).tolist(),
                            "top1": float((lo.argmax(-1) == lt.argmax(-1)).mean()),
                            "logit_cosine": cosine(lo, lt), "kl": kl_divergence(lt, lo, SamplingOptions().temperature)})
        report.sections["teacher_forced"] = teacher
        report.sections["greedy"] = free
        report.sections["speed"] = {k: {"frames_per_s": n / max(s, 1e-9),
                                        "rtf": s / max(n / self.tts.facts.frame_rate, 1e-9)}
                                    for k, (s, n) in speed.items()}
        g = self.gates
        if min(x["top1"] for x in teacher) < g["teacher_top1"]:
            report.fail(f"teacher-forced top-1 agreement below {g['teacher_top1']}")
        if min(x["logit_cosine"] for x in teacher) < g["teacher_cosine"]:
            report.fail(f"teacher-forced logit cosine below {g['teacher_cosine']}")
        if np.mean([x["identical"] for x in free]) < g["greedy_identical"]:
            report.fail("greedy free-running diverges from the reference")

    def sampled(self, report: Report) -> None:
        rows, eoc, ratios = [], 0, []
        for text in self.prompts:
            for seed in range(self.runs):
                res = self.run_both(text, SamplingOptions(), seed)
                eoc += res["onnx"].stop_reason == "eoc"
                ratios.append(len(res["onnx"].codes) / max(len(res["torch"].codes), 1))
                rows.append({"prompt": text, "seed": seed, "stop": res["onnx"].stop_reason,
                             "frames": len(res["onnx"].codes), "torch_frames": len(res["torch"].codes)})
        total = max(len(rows), 1)
        mean_ratio = float(np.mean(ratios)) if ratios else None
        report.sections["sampled"] = {"runs": rows, "eoc_rate": eoc / total, "mean_duration_ratio": mean_ratio}
        if eoc / total < self.gates["eoc_rate"]:
            report.fail(f"only {eoc}/{total} sampled runs stopped cleanly")

    def text_lm(self, report: Report) -> None:
        """The decoder as a plain text LM with the tied text head applied outside the graph."""
        import torch

        from .runtime.decoder import SimpleDecoder

        table = self.ref.text_table.float()
        ids = self.tts.tokenizer.encode(self.prompts[-1], add_special_tokens=False).ids
        dec = SimpleDecoder(self.tts.part("llm_decoder"), self.tts.facts)
        be = self.tts.backend
        o_seq, t_seq = list(ids), list(ids)
        h = dec.prefill(be.embed_text(np.asarray(o_seq)))
        with torch.no_grad():
            th = self.ref.body(inputs_embeds=table[torch.tensor(t_seq)][None].to(self.ref.dtype)).last_hidden_state
        head = table.numpy().T  # tied text head: hidden @ text_embedding^T
        o_logits, t_logits = h @ head, th[0].float().numpy() @ head
        agreement = float((o_logits.argmax(-1) == t_logits.argmax(-1)).mean())
        o_seq.append(int(o_logits[-1].argmax()))
        t_seq.append(int(t_logits[-1].argmax()))
        for _ in range(self.text_tokens - 1):
            o_seq.append(int((dec.step(be.embed_text(np.asarray(o_seq[-1:])))[-1] @ head).argmax()))
            with torch.no_grad():
                th = self.ref.body(inputs_embeds=table[torch.tensor(t_seq)][None].to(self.ref.dtype)).last_hidden_state
            t_seq.append(int((th[0, -1].float().numpy() @ head).argmax()))
        gen_o, gen_t = o_seq[len(ids):], t_seq[len(ids):]
        same = next((i for i, (a, b) in enumerate(zip(gen_o, gen_t, strict=True)) if a != b), None)
        report.sections["text_lm"] = {"next_token_agreement": agreement, "continuation_tokens": self.text_tokens,
                                      "first_difference": same, "onnx": gen_o, "torch": gen_t}

    def teacher_codes(self, report: Report, path: Path, tolerance: float) -> None:
        rows = np.load(path, allow_pickle=False).astype(np.int64)
        prompt_text = self.prompts[0]
        res = generate(self.tts.backend, build_prompt(self.tts.tokenizer, self.tts.tokens, prompt_text), self.rules,
                       GREEDY, np.random.default_rng(0), len(rows), self.tts.facts.placeholder, keep_logits=True,
                       teacher_rows=rows)
        logits = np.stack(res.logits)  # (L, N, V)
        picked = np.take_along_axis(logits, rows[:len(logits), :, None], axis=-1)[..., 0]
        n = self.tts.facts.num_codebooks
        forced = np.triu(np.ones((len(logits), n), bool), k=1)  # ramp-in BOCs are forced, not sampled: not judged
        within = (picked >= logits.max(-1) - tolerance) | forced
        report.sections["teacher_codes"] = {"file": str(path), "prompt": prompt_text, "tolerance": tolerance,
                                            "rows": len(logits), "within_tolerance": float(within.mean()),
                                            "per_codebook": within.mean(0).tolist(),
                                            "rows_outside": np.flatnonzero(~within.all(-1)).tolist()[:50]}

    def asr(self, report: Report) -> None:
        """WER of greedy ONNX and PyTorch audio against the prompt text, with faster-whisper + jiwer if installed.

        The ASR model is `$HIGGS_ASR_MODEL` (default `base`), fetched by faster-whisper on first use.
        """
        import importlib.util
        import os

        if importlib.util.find_spec("faster_whisper") is None or importlib.util.find_spec("jiwer") is None:
            report.sections["intelligibility"] = {"skipped": "faster-whisper/jiwer are not installed (pip install "
                                                  "faster-whisper jiwer); WER is meaningful only on real weights"}
            return
        import jiwer
        from faster_whisper import WhisperModel

        from .audio import resample
        from .generation.prompt import TAG_PATTERN

        name = os.environ.get("HIGGS_ASR_MODEL", "base")
        try:
            asr = WhisperModel(name, device="cpu", compute_type="int8")
        except Exception as e:  # no network, unknown model name ...: say so instead of failing the report
            report.sections["intelligibility"] = {"skipped": f"could not load ASR model {name!r}: {e}"}
            return
        norm = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation(), jiwer.RemoveMultipleSpaces(),
                              jiwer.Strip(), jiwer.ReduceToListOfListOfWords()])
        rows = []
        for text in self.prompts:
            truth = TAG_PATTERN.sub(" ", text)
            wavs = {"onnx": self.tts.generate(text, temperature=0, max_frames=self.max_frames).waveform,
                    "torch": self.ref.generate(text, sampling=GREEDY, max_rows=self.max_frames).waveform}
            row = {"prompt": text}
            for k, wav in wavs.items():
                segments, _ = asr.transcribe(resample(wav, self.tts.facts.sample_rate, 16000), beam_size=1)
                heard = " ".join(s.text for s in segments)
                row[f"{k}_text"] = heard
                row[f"{k}_wer"] = jiwer.wer(truth, heard or "-", reference_transform=norm, hypothesis_transform=norm)
            rows.append(row)
        report.sections["intelligibility"] = {"asr_model": name, "rows": rows,
                                              "onnx_wer": float(np.mean([r["onnx_wer"] for r in rows])),
                                              "torch_wer": float(np.mean([r["torch_wer"] for r in rows]))}

    def run(self, teacher_codes: Path | None = None, tolerance: float = 1.0) -> Report:
        m = self.tts.manifest.data
        report = Report(meta={"model_path": str(self.tts.manifest.folder), "precision": self.precision,
                              "device": m["device"], "checkpoint": str(self.ref.folder), "gates": self.gates,
                              "prompts": self.prompts})
        for name, fn in (("parts", self.parts), ("generation", self.generation), ("sampled", self.sampled),
                         ("text LM", self.text_lm), ("intelligibility", self.asr)):
            if report.failures and name != "parts":
                print(f"skipping {name}: a part failed", flush=True)
                continue
            print(f"evaluating {name} ...", flush=True)
            fn(report)
        if teacher_codes is not None and not report.failures:
            self.teacher_codes(report, teacher_codes, tolerance)
        return report


def to_json(report: Report) -> str:
    return json.dumps({"meta": report.meta, **report.sections, "failures": report.failures,
                       "passed": not report.failures}, indent=2, default=float)


def _asr_line(section: dict) -> str:
    if "skipped" in section:
        return f"skipped: {section['skipped']}"
    return (f"WER with faster-whisper `{section['asr_model']}`: ONNX {section['onnx_wer'] * 100:.1f}%, PyTorch "
            f"{section['torch_wer'] * 100:.1f}%")


def to_markdown(report: Report) -> str:
    s = report.sections
    lines = [f"# Parity report: `{report.meta['model_path']}` ({report.meta['precision']})", "",
             f"Reference: `{report.meta['checkpoint']}` (PyTorch). Result: "
             f"**{'PASS' if not report.failures else 'FAIL'}**", "", "## Parts", "",
             "| part | precision | figure | ok |", "|---|---|---|---|"]
    from .parity import summary

    for part, fig in s["parts"].items():
        figure = "error" if "error" in fig else summary(fig)
        lines.append(f"| {part} | {fig['precision']} | {figure} | {'yes' if fig.get('ok', True) else 'NO'} |")
    if "teacher_forced" not in s:
        errors = [f"- {p}: {f.get('error', 'below threshold')}" for p, f in s["parts"].items() if not f.get("ok", True)]
        return "\n".join(lines + ["", "Generation sections skipped: a part failed.", *errors]) + "\n"
    steps = s["parts"]["llm_decoder"]["teacher_forced_steps"]
    lines += ["", f"Decoder hidden states over {len(steps)} steps (prefill, then decode): cosine min "
              f"{min(x['cosine'] for x in steps):.6f}, max abs max {max(x['max_abs'] for x in steps):.3g}.", ""]
    for name, rec in s["parts"]["audio_encoder"]["recordings"].items():
        lines.append(f"Encoder on `{name}` ({rec['samples']} samples): {rec['agreement'] * 100:.2f}% of codes equal.")
    lines += ["", "## Generation", "", "| prompt | teacher top-1 | logit cos | KL | greedy divergence | margin | "
              "duration ratio |", "|---|---|---|---|---|---|---|"]
    for tf, gr in zip(s["teacher_forced"], s["greedy"], strict=True):
        div = "none" if gr["first_divergence"] is None else f"row {gr['first_divergence']}"
        margin = "" if gr["top1_top2_margin"] is None else f"{gr['top1_top2_margin']:.3g}"
        lines.append(f"| {tf['prompt'][:40]} | {tf['top1']:.4f} | {tf['logit_cosine']:.6f} | {tf['kl']:.2e} | {div} | "
                     f"{margin} | {gr['duration_ratio']:.2f} |")
    sm, sp, lm = s["sampled"], s["speed"], s["text_lm"]
    lines += ["", f"Sampled runs: {len(sm['runs'])}, clean EOC stops {sm['eoc_rate'] * 100:.0f}%, mean duration ratio "
              f"{sm['mean_duration_ratio']:.2f}.", "",
              f"Speed: ONNX {sp['onnx']['frames_per_s']:.1f} rows/s (RTF {sp['onnx']['rtf']:.2f}), PyTorch "
              f"{sp['torch']['frames_per_s']:.1f} rows/s (RTF {sp['torch']['rtf']:.2f}).", "",
              f"Text LM (tied text head): next-token agreement {lm['next_token_agreement'] * 100:.1f}%, greedy "
              f"continuation of {lm['continuation_tokens']} tokens first differs at "
              f"{'never' if lm['first_difference'] is None else lm['first_difference']}.", "",
              f"Intelligibility: {_asr_line(s['intelligibility'])}", ""]
    if "teacher_codes" in s:
        tc = s["teacher_codes"]
        lines.append(f"Teacher codes `{tc['file']}`: {tc['within_tolerance'] * 100:.1f}% of codes within "
                     f"{tc['tolerance']} of the export's top logit.")
    if report.failures:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in report.failures]
    return "\n".join(lines) + "\n"
