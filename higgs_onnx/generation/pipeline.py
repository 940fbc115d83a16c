"""Text (+ reference voice) -> waveform, on any backend: prompt, reference codes, request, engine, codec (spec §3, §5).

`Synthesizer` is what `HiggsTTS` (ONNX Runtime) and `ReferenceModel` (PyTorch) share: `request` turns text and
options into a `Request` (prompt checked against the model's context), `speak` runs it and decodes the audio once.
Streaming (audio while the model still talks) is `HiggsTTS.stream`, on the same requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer

from ..checkpoint import ModelFacts
from .contract import Limits, NoAudioError, row_budget
from .delay import apply_delay, codes_for_codec
from .engine import Backend, Engine, GenerationStats, Request, StopRules
from .options import DEFAULT_MAX_ROWS, GenerationOptions  # noqa: F401 - DEFAULT_MAX_ROWS re-exported
from .prompt import PromptTokens, build_prompt


class Codec(Protocol):
    def encode_audio(self, wav: np.ndarray) -> np.ndarray: ...  # (L,) float32 at the codec rate -> (T, N) int64
    def decode_audio(self, codes: np.ndarray) -> np.ndarray: ...  # (1, N, T) int64 -> (hop*T,) float32


@dataclass
class Speech:
    waveform: np.ndarray  # (samples,) float32
    sample_rate: int
    rows: np.ndarray  # (L, N) delayed rows as generated
    codes: np.ndarray  # (T, N) raw codes fed to the codec (BOC/EOC leftovers mapped to 0)
    stop_reason: str  # "eoc" (clean stop), "max_rows", or the guard's "loop" / "overlong" (higgs_onnx/guard)
    stats: GenerationStats
    verdict: object = None  # the guard's `Verdict` of this take (guard.judge), when it was judged
    takes: list = field(default_factory=list)  # every take drawn for it, in order (`guard.take_record`), this last

    @property
    def seconds(self) -> float:
        return self.waveform.size / self.sample_rate


def speech_from(req: Request, raw: np.ndarray, decode_audio: Callable[[np.ndarray], np.ndarray], sample_rate: int,
                codebook_size: int) -> Speech:
    """A finished request's `Speech`: its raw frames `raw` decoded in one codec call (the codec time counted on the
    request); a request without one audio frame is a NoAudioError."""
    codes = codes_for_codec(raw, codebook_size)
    if not codes.shape[-1]:
        raise NoAudioError(f"the generation ended after {req.n} rows without one audio frame")
    t0, loads = time.perf_counter(), req.loads()
    wav = decode_audio(codes)
    loaded = req.loads() - loads  # the codec's session, made on first use: load, not codec time
    req.load_s += loaded
    req.codec_s += time.perf_counter() - t0 - loaded
    req.audio_out(wav.size)
    return Speech(waveform=wav, sample_rate=sample_rate, rows=req.generated.copy(), codes=codes[0].T,
                  stop_reason=req.stop_reason, stats=req.stats(wav.size, sample_rate))


def stop_rules(facts: ModelFacts) -> StopRules:
    return StopRules(num_codebooks=facts.num_codebooks, boc=facts.boc, eoc=facts.eoc)


def reference_rows(codec: Codec, facts: ModelFacts, ref_wav: np.ndarray) -> np.ndarray:
    """(L,) reference waveform at the codec rate -> (T + N - 1, N) delayed rows for the prompt placeholders."""
    return apply_delay(codec.encode_audio(ref_wav), facts.boc, facts.eoc)


def continues_at(prev: Request, prompt: list[int], placeholder: int) -> int:
    """The positions of `prompt` that `prev`'s cache already holds: `prev`'s prompt, then its rows as placeholders
    (all but its last row, which was sampled and never fed). Refuses a prompt that does not start that way."""
    if not prev.done:
        raise ValueError("only a finished request can be continued")
    head = list(prev.prompt) + [placeholder] * prev.n
    if list(prompt[:len(head)]) != head or len(prompt) <= len(head):
        raise ValueError("a continued prompt must start with the earlier request's prompt and rows (the earlier "
                         "turn as the last of its history)")
    return prev.positions


class Synthesizer:
    """A backend, a codec and the prompt vocabulary: text -> `Request` -> `Speech`."""

    def __init__(self, backend: Backend, codec: Codec, tokenizer: Tokenizer, tokens: PromptTokens, facts: ModelFacts):
        self.backend, self.codec, self.tokenizer, self.tokens, self.facts = backend, codec, tokenizer, tokens, facts
        self.engine = Engine(backend)
        self.rules = stop_rules(facts)
        self.guard = None  # guard.GuardOptions for the online watch (None: the defaults)

    def request(self, text: str, options: GenerationOptions, ref_rows: np.ndarray | None = None,
                ref_text: str | None = None, prefix: tuple[int, dict] | None = None, voice_s: float = 0.0,
                started: float | None = None, history: list[tuple[str, np.ndarray]] = (),
                slot: int | None = None, continues: Request | None = None) -> Request:
        """A request for `text`; `ref_rows` (delayed reference rows) clone a voice whose transcript is `ref_text`;
        `prefix` is a voice's saved prefill state (see `Request`); `slot` is the positions of the batching pool's
        slot that will run it (None: a cache of its own, the model's context). The contract (`contract`) is checked
        here, before any work: a request that does not fit is refused, never cut. `continues`: a finished request
        whose cache this one takes over (KV continuation): its prompt and rows must be where this prompt starts
        (its text and rows the last turn of `history`), and only the rest is prefilled."""
        import dataclasses

        f = self.facts
        limits = self.limits(slot)
        n_ref = 0 if ref_rows is None else len(ref_rows)
        prompt = build_prompt(self.tokenizer, self.tokens, text, ref_rows=n_ref, ref_text=ref_text,
                              history=[(t, len(r)) for t, r in history])
        budget = row_budget(len(prompt), options.max_rows, text, limits, f.num_codebooks, f.frame_rate)
        options = dataclasses.replace(options, max_rows=budget)
        if continues is not None:
            prefix = (continues_at(continues, prompt, f.placeholder), None)
        watch = None
        if options.guard:
            from ..guard import GuardOptions, RowWatch, expected_rows

            g = self.guard or GuardOptions()
            watch = RowWatch(g, expected_rows(text, f.frame_rate, f.num_codebooks, g), f.num_codebooks, f.frame_rate)
        req = Request(prompt, self.rules, options, f.placeholder, ref_rows=ref_rows, prefix=prefix,
                      voice_s=voice_s, started=started, watch=watch,
                      history_rows=np.concatenate([r for _, r in history]) if history else None)
        req.text = text
        return req

    def limits(self, slot: int | None = None) -> Limits:
        return Limits(self.facts.max_positions, slot)

    def speak(self, req: Request, on_row: Callable[[int], None] | None = None) -> Speech:
        """Run `req` to its end, then decode its codes in one codec call."""
        for n in self.engine.rows(req):
            if on_row:
                on_row(n)
        f = self.facts  # every frame (the request is done), in one codec call
        return speech_from(req, req.new_frames(), self.codec.decode_audio, f.sample_rate, f.codebook_size)
