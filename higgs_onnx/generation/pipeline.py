"""Text (+ reference voice) -> waveform, on any backend: prompt, reference codes, loop, codec (spec §3, §5)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer

from ..checkpoint import ModelFacts
from .delay import apply_delay, codes_for_codec
from .loop import Backend, GenerationResult, StopRules, generate
from .prompt import PromptTokens, build_prompt
from .sampling import SamplingOptions

DEFAULT_MAX_ROWS = 2048  # SGO/Replicate max_new_tokens: delayed rows, ~81.6 s of audio
DEFAULT_SAMPLING = SamplingOptions()


class Codec(Protocol):
    def encode_audio(self, wav: np.ndarray) -> np.ndarray: ...  # (L,) float32 at the codec rate -> (T, N) int64
    def decode_audio(self, codes: np.ndarray) -> np.ndarray: ...  # (1, N, T) int64 -> (hop*T,) float32


@dataclass
class Speech:
    waveform: np.ndarray  # (samples,) float32
    sample_rate: int
    rows: np.ndarray  # (L, N) delayed rows as generated
    codes: np.ndarray  # (T, N) raw codes fed to the codec (BOC/EOC leftovers mapped to 0)
    stop_reason: str  # "eoc" (clean stop) or "max_rows"
    stats: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.waveform.size / self.sample_rate


def stop_rules(facts: ModelFacts) -> StopRules:
    return StopRules(num_codebooks=facts.num_codebooks, boc=facts.boc, eoc=facts.eoc)


def reference_rows(codec: Codec, facts: ModelFacts, ref_wav: np.ndarray) -> np.ndarray:
    """(L,) reference waveform at the codec rate -> (T + N - 1, N) delayed rows for the prompt placeholders."""
    return apply_delay(codec.encode_audio(ref_wav), facts.boc, facts.eoc)


def synthesize(backend: Backend, codec: Codec, tokenizer: Tokenizer, tokens: PromptTokens, facts: ModelFacts,
               text: str, ref_wav: np.ndarray | None = None, ref_text: str | None = None,
               sampling: SamplingOptions = DEFAULT_SAMPLING, seed: int = 0, max_rows: int = DEFAULT_MAX_ROWS,
               on_row: Callable[[int], None] | None = None, ref_rows: np.ndarray | None = None,
               keep_logits: bool = False, cached_prefix: tuple[int, dict] | None = None
               ) -> tuple[Speech, GenerationResult]:
    """Generate speech for `text`; `ref_wav` (mono, codec rate) clones a voice, `ref_text` is its transcript.

    `ref_rows` may carry already-delayed reference rows (skips the codec encoder); `cached_prefix` the backend's
    prefill state of the voice prefix (skips its prefill, see `generation.loop.generate`).
    """
    t0 = time.perf_counter()
    if ref_text is not None and ref_wav is None and ref_rows is None:
        raise ValueError("a reference transcript (ref_text) needs reference audio (ref_audio)")
    if ref_rows is None and ref_wav is not None:
        ref_rows = reference_rows(codec, facts, ref_wav)
    t_enc = time.perf_counter()
    n_ref = 0 if ref_rows is None else len(ref_rows)
    prompt = build_prompt(tokenizer, tokens, text, ref_rows=n_ref, ref_text=ref_text)
    limit = facts.max_positions
    if max_rows < 1 or max_rows >= limit:
        raise ValueError(f"max frames must be in [1, {limit}) (the model's context), got {max_rows}")
    if len(prompt) + facts.num_codebooks >= limit:
        raise ValueError(f"the prompt is {len(prompt)} positions long; the model's context is {limit}: shorten the "
                         f"text or the reference audio")
    max_rows = min(max_rows, limit - len(prompt))  # the context bounds prompt + generated rows
    result = generate(backend, prompt, stop_rules(facts), sampling, np.random.default_rng(seed), max_rows,
                      facts.placeholder, ref_rows=ref_rows, on_row=on_row, keep_logits=keep_logits,
                      cached_prefix=cached_prefix)
    codes = codes_for_codec(result.codes, facts.codebook_size)
    t_dec = time.perf_counter()
    wav = codec.decode_audio(codes) if codes.shape[-1] else np.zeros(0, np.float32)
    t_end = time.perf_counter()
    speech = Speech(waveform=wav, sample_rate=facts.sample_rate, rows=result.rows, codes=codes[0].T,
                    stop_reason=result.stop_reason)
    speech.stats = {
        "prompt_tokens": len(prompt), "reference_rows": n_ref, "rows": len(result.rows), "frames": codes.shape[-1],
        "audio_s": speech.seconds, "encode_s": t_enc - t0, "prefill_s": result.prefill_s,
        "decode_s": result.decode_s, "codec_s": t_end - t_dec, "wall_s": t_end - t0,
        "stop_reason": result.stop_reason,
    }
    return speech, result
