"""`GenerationOptions`: what one request may choose (sampling, seed, length limit), validated once, frozen.

The length limit is counted in **rows**: one row is one decoder step, i.e. one delayed code row of N codebooks.
A run of L rows holds L - N + 1 audio frames (25 per second), because codebook c starts c rows late (spec §5.1);
`max_rows` is the only name of the limit, in the API, the CLI (`--max-rows`) and the reports.
`HiggsTTS` and the PyTorch `ReferenceModel` take the same options object and the same plain keywords.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

from .sampling import SamplingOptions

DEFAULT_MAX_ROWS = 2048  # SGO/Replicate max_new_tokens: delayed rows, ~81.6 s of audio
# positions (prompt + rows) per slot of a batching pool: the default row limit plus a long clone prompt. The cache
# is sized up front for every slot and ORT touches far more of it than a request writes (4 slots of the real
# model's 32,768 positions took 4.6 GB after one prefill each), so the model's own maximum is too much here.
POOL_POSITIONS = DEFAULT_MAX_ROWS + 1024
# an int8 KV cache takes a quarter of the bytes: its slots hold twice the positions at half the fp32 slot's memory
# (4b geometry: 6,144 x 72 KiB = 432 MB against 3,072 x 288 KiB = 864 MB)
POOL_POSITIONS_INT8 = 2 * POOL_POSITIONS
_DEFAULT_SAMPLING = SamplingOptions()


@dataclass(frozen=True)
class GenerationOptions:
    temperature: float = _DEFAULT_SAMPLING.temperature  # 0 = greedy
    top_k: int = _DEFAULT_SAMPLING.top_k  # 0 = off
    top_p: float = _DEFAULT_SAMPLING.top_p  # 1 = off
    seed: int = 0  # the request's own sampler RNG: same seed, same codes, whatever else runs in the process
    # most decoder steps (delayed rows) to generate. None (the default): DEFAULT_MAX_ROWS or what fits after the
    # prompt, and a text too long for that is refused; a number: that budget, refused if it does not fit (contract)
    max_rows: int | None = None
    ignore_eoc: bool = False  # benchmarks: run to max_rows whatever the model says (sglang/vLLM's ignore_eos)
    # the guard's online checks (higgs_onnx/guard/): a loop or a take far past its text stops at once, with the
    # verdict as its stop reason ("loop", "overlong") instead of running to max_rows
    guard: bool = True

    def __post_init__(self) -> None:
        for name in ("top_k", "seed", "max_rows"):
            if name == "max_rows" and self.max_rows is None:
                continue
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a whole number, got {getattr(self, name)!r}")
            try:
                object.__setattr__(self, name, operator.index(getattr(self, name)))
            except TypeError:
                raise ValueError(f"{name} must be a whole number, got {getattr(self, name)!r}") from None
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r:.40}")
        try:
            object.__setattr__(self, "temperature", float(self.temperature))
            object.__setattr__(self, "top_p", float(self.top_p))
        except (TypeError, ValueError):
            raise ValueError(f"temperature and top_p must be numbers, got {self.temperature!r}, "
                             f"{self.top_p!r}") from None
        self.sampling  # noqa: B018 - validates temperature / top_k / top_p
        for name in ("ignore_eoc", "guard"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")

    @property
    def sampling(self) -> SamplingOptions:
        return SamplingOptions(self.temperature, self.top_k, self.top_p)

    @classmethod
    def make(cls, options: GenerationOptions | None = None, sampling: SamplingOptions | None = None,
             **overrides) -> GenerationOptions:
        """`options` (or the defaults) with the plain keywords that are not None laid over it; `sampling` sets
        temperature / top_k / top_p at once (the older `sampling=` argument)."""
        base = options if options is not None else cls()
        if not isinstance(base, GenerationOptions):
            raise TypeError(f"options must be a GenerationOptions, got {type(base).__name__}")
        if sampling is not None:
            base = dataclasses.replace(base, temperature=sampling.temperature, top_k=sampling.top_k,
                                       top_p=sampling.top_p)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown generation option(s) {', '.join(sorted(unknown))}")
        changes = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(base, **changes) if changes else base


GREEDY_OPTIONS = GenerationOptions(temperature=0.0, top_k=0, top_p=1.0)
