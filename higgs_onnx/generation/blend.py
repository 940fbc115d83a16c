"""Voice blending: one utterance in a mix of N voices, spoken as N rows of one batch that never diverge.

sglang-omni blends voices this way (`sglang_omni/models/higgs_tts/fusion.py`): every voice prefills its own prompt
(its reference, its transcript, the same text) into its own cache, one batch row each. At every step each row's
audio heads give its (N, V) logits, the rows' distributions are mixed per codebook with the weights wᵢ (sum 1),

    mixture (the default):  x = log Σᵢ wᵢ · softmax(logitsᵢ / T)    the voices' next-code distributions mixed
    product:                x = Σᵢ wᵢ · logitsᵢ / T                  their weighted geometric mean (up to a constant)

then top-k / top-p filter x and ONE draw (the leader's RNG, the same inverse CDF as `sample_codes`) picks the row.
Every member is fed the codes drawn, so all rows stay in lockstep (same positions, same state machine) and the
leader's rows are the audio. Greedy (T = 0) takes the argmax of Σᵢ wᵢ · softmax(logitsᵢ) (product:
Σᵢ wᵢ · log softmax(logitsᵢ)). A weight of 0 leaves its voice out of the sum (its row still runs); one nonzero
weight is exactly that voice's `sample_codes` draw, so a blend (1, 0) gives voice 1's codes.

sglang-omni later moved from the mixture to the product ("log-linear pool"): they measured that equal weights of
two distinct voices made every take sound like one or the other, never between, since a mixture only puts mass
where one voice does. That has not been measured here (the test models have random weights): `mode="product"`
offers their choice; the default stays the mixture this project's issue asks for.

- `Blend`: what a caller asks for (voices, weights normalised to sum 1, mode), validated once;
- `parse_spec` / `parse_members`: `alice:0.7,bob:0.3` (the CLI's `--voice`, the server's `voice`) and the server's
  list form `[{"voice": "alice", "weight": 0.7}, ...]` -> (name, weight) pairs;
- `sample_blend`: the mixing and the one draw (pure NumPy, seeded);
- `BlendRequest`: a `Request` (the leader, voice 1's) that holds the other voices' requests; the engine admits,
  prefills and feeds each member as a row of its own (`Request.members`), the scheduler counts its slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .engine import Request
from .sampling import SamplingOptions, draw, sample_codes, softmax, truncate

MODES = ("mixture", "product")
# voices in one blend: each is a batch row (a pool slot) and a full decoder row per step, so N voices cost about
# what a batch of N costs; beyond a handful the mix of timbres is not worth what it takes from the batch
MAX_VOICES = 8


def parse_weight(text: Any, name: str, what: str) -> float:
    """One voice's weight: a finite number >= 0 (a string from the command line, a JSON number from a client)."""
    if isinstance(text, bool):
        raise ValueError(f"{what}: the weight of {name!r} must be a number, got {text!r}")
    try:
        w = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: the weight of {name!r} must be a number, got {text!r} (write NAME:WEIGHT, "
                         f"e.g. alice:0.7,bob:0.3)") from None
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"{what}: the weight of {name!r} must be a finite number >= 0, got {text!r}")
    return w


def normalise_weights(weights: list[float | None], what: str = "the blend") -> tuple[float, ...]:
    """Weights -> the same divided by their sum; all None = equal. Refuses some-but-not-all given, negative,
    non-finite, or all zero."""
    if all(w is None for w in weights):
        weights = [1.0] * len(weights)
    elif any(w is None for w in weights):
        raise ValueError(f"{what}: give a weight to every voice or to none (none = equal weights)")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"{what}: weights must be finite numbers >= 0, got {w!r}")
    total = float(sum(weights))
    if not math.isfinite(total):  # each finite, the sum not (1e308 twice): relative weights need no such size
        raise ValueError(f"{what}: the weights add up past the largest number; they are relative, so use smaller "
                         f"ones (e.g. 0.7 and 0.3)")
    if total <= 0:
        raise ValueError(f"{what}: every weight is 0; at least one voice needs a weight > 0")
    return tuple(float(w) / total for w in weights)


def check_names(pairs: list[tuple[str, float | None]], what: str) -> list[tuple[str, float | None]]:
    if len(pairs) > MAX_VOICES:
        raise ValueError(f"{what}: a blend takes at most {MAX_VOICES} voices, got {len(pairs)}")
    seen = set()
    for name, _ in pairs:
        if name in seen:
            raise ValueError(f"{what}: voice {name!r} is named twice; give it once with the sum of its weights")
        seen.add(name)
    return pairs


def parse_spec(spec: str, what: str = "--voice") -> list[tuple[str, float | None]]:
    """`a:0.7,b:0.3` (or `a,b`: equal weights) -> [(name, weight or None), ...]. A weight is what follows an item's
    last ':' (unless that holds a path separator: `C:\\v\\a.npz` is a name). One line of ValueError per mistake."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{what} is empty: name a voice, or a blend such as alice:0.7,bob:0.3")
    pairs = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"{what} {spec!r}: an empty voice between commas (write alice:0.7,bob:0.3)")
        head, sep, tail = item.rpartition(":")
        if sep and not any(c in tail for c in "/\\"):
            if not head.strip():
                raise ValueError(f"{what} {spec!r}: {item!r} has a weight but no voice")
            pairs.append((head.strip(), parse_weight(tail.strip(), head.strip(), what)))
        else:
            pairs.append((item, None))
    return check_names(pairs, what)


def parse_members(value: Any, what: str = "voice") -> list[tuple[str, float | None]]:
    """The server's blend forms: the string `alice:0.7,bob:0.3`, or a list of `{"voice": name, "weight": w}`
    (`"id"` for `"voice"` too, OpenAI's voice-object key) -> [(name, weight or None), ...]."""
    if isinstance(value, str):
        return parse_spec(value, what)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a voice name, a blend string (alice:0.7,bob:0.3) or a non-empty list of "
                         f'{{"voice": NAME, "weight": W}}')
    pairs = []
    for i, item in enumerate(value):
        where = f"{what}[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f'{where} must be an object {{"voice": NAME, "weight": W}}, got {type(item).__name__}')
        names = [item[k] for k in ("voice", "id") if k in item]
        if len(names) != 1 or not isinstance(names[0], str) or not names[0]:
            raise ValueError(f'{where} needs one voice name: {{"voice": NAME, "weight": W}}')
        unknown = set(item) - {"voice", "id", "weight"}
        if unknown:
            raise ValueError(f"{where} has unknown field(s) {', '.join(sorted(unknown))}; it takes voice and weight")
        weight = item.get("weight")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))):
            raise ValueError(f"{where}: weight must be a number, got {weight!r}")
        pairs.append((names[0], None if weight is None else parse_weight(weight, names[0], what)))
    return check_names(pairs, what)


@dataclass(frozen=True)
class Blend:
    """A mix of voices to speak in: `voices` (each a `Voice`, or None for the zero-shot voice), `weights`
    normalised to sum 1, `mode` ("mixture" or "product", see the module docstring), `names` for messages. Pass it
    wherever a voice goes (`HiggsTTS.request(voice=...)`, `generate`, `stream`); it runs as one row per voice."""

    voices: tuple
    weights: tuple[float, ...]
    mode: str = "mixture"
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.voices) < 2:
            raise ValueError(f"a blend needs at least 2 voices, got {len(self.voices)}")
        if len(self.voices) > MAX_VOICES:
            raise ValueError(f"a blend takes at most {MAX_VOICES} voices, got {len(self.voices)}")
        if len(self.weights) != len(self.voices):
            raise ValueError(f"a blend of {len(self.voices)} voices needs as many weights, got {len(self.weights)}")
        if self.mode not in MODES:
            raise ValueError(f"blend mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        object.__setattr__(self, "voices", tuple(self.voices))
        object.__setattr__(self, "weights", normalise_weights(list(self.weights)))
        object.__setattr__(self, "names", tuple(self.names) or tuple(f"voice {i + 1}" for i in range(self.width)))

    @classmethod
    def make(cls, voices, weights=None, mode: str = "mixture", names=()) -> Blend:
        """`weights` None = equal; otherwise any non-negative numbers with a positive sum (normalised here)."""
        return cls(tuple(voices), tuple(weights) if weights is not None else (None,) * len(voices), mode, names)

    @property
    def width(self) -> int:
        return len(self.voices)

    def describe(self) -> str:
        return ", ".join(f"{n} {w:.2f}" for n, w in zip(self.names, self.weights, strict=True))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def mix_logits(logits: np.ndarray, weights: np.ndarray, temperature: float, mode: str = "mixture") -> np.ndarray:
    """(M, N, V) logits of M voices, (M,) weights > 0 summing to 1 -> (N, V) float64 log-weights of the blend at
    `temperature` (> 0): log Σᵢ wᵢ softmax(logitsᵢ / T) ("mixture") or Σᵢ wᵢ logitsᵢ / T ("product")."""
    z = (logits.astype(np.float32) / np.float32(temperature)).astype(np.float64)  # as `filter_logits` scales
    w = np.asarray(weights, np.float64)[:, None, None]
    if mode == "product":
        return (w * z).sum(axis=0)
    return np.logaddexp.reduce(np.log(w) + _log_softmax(z), axis=0)


def sample_blend(logits: np.ndarray, weights, rng: np.random.Generator, opts: SamplingOptions,
                 mode: str = "mixture") -> np.ndarray:
    """(M, N, V) logits of M voices -> (N,) int64 codes: one draw from their blend (module docstring). Voices of
    weight 0 are left out; one voice left is exactly `sample_codes` on its logits (same draw, same RNG use)."""
    w = np.asarray(weights, np.float64)
    live = np.flatnonzero(w > 0)
    if len(live) == 1:
        return sample_codes(logits[live[0]], rng, opts)
    lg, w = logits[live], w[live] / w[live].sum()
    if opts.greedy:  # the blend at T = 1, its most likely code per codebook
        z = lg.astype(np.float64)
        score = (w[:, None, None] * (_log_softmax(z) if mode == "product" else softmax(z))).sum(axis=0)
        return score.argmax(axis=-1).astype(np.int64)
    x = truncate(mix_logits(lg, w, opts.temperature, mode), opts)
    return draw(softmax(x), rng)


class BlendRequest(Request):
    """A voice blend in flight: voice 1's request (the leader, taken over whole: its prompt, cache, RNG, the
    guard's watch, rows and timings are this request's) and the other voices' requests (`followers`), one batch
    row each. Each step the engine gives every member's logits to `accept`, which draws once from their blend and
    writes the same row into every member, so they stop together; the leader's rows are the audio.

    Members must be requests for the same text and options (the same row budget): `HiggsTTS.request(voice=Blend)`
    makes them. Not for teacher forcing, kept logits or KV continuation."""

    def __init__(self, members: list[Request], weights, mode: str = "mixture"):
        if len(members) < 2:
            raise ValueError(f"a blend needs at least 2 voices, got {len(members)}")
        if mode not in MODES:
            raise ValueError(f"blend mode must be one of {', '.join(MODES)}, got {mode!r}")
        lead = members[0]
        for m in members:
            if m.teacher_rows is not None or m.keep_logits or (m.prefix is not None and m.prefix[1] is None):
                raise ValueError("a voice blend cannot be teacher-forced, keep logits or continue a KV cache")
            if m.options != lead.options or m.max_rows != lead.max_rows:
                raise ValueError("the voices of a blend need the same options and row budget")
        self.__dict__.update(lead.__dict__)  # the leader *is* voice 1's request
        self.followers = list(members[1:])
        for f in self.followers:
            f.watch = None  # the guard watches the leader; the followers' rows are the same
        self.weights = normalise_weights(list(weights))
        if len(self.weights) != len(members):
            raise ValueError(f"a blend of {len(members)} voices needs as many weights, got {len(self.weights)}")
        self.mode = mode

    @property
    def members(self) -> tuple[Request, ...]:
        return (self, *self.followers)

    @property
    def prefilling(self) -> bool:
        return any(m.embeds is not None for m in self.members)

    @property
    def decoding(self) -> bool:
        """Every voice prefilled and not done: the blend's next row can be drawn."""
        return self.hidden is not None and not self.done and all(f.hidden is not None for f in self.followers)

    def sample(self, logits: np.ndarray) -> np.ndarray:
        """(M, N, V) logits, one (N, V) per voice -> one (N,) draw from their blend with the leader's RNG."""
        return sample_blend(logits, self.weights, self.rng, self.options.sampling, self.mode)

    def accept(self, logits: np.ndarray) -> np.ndarray:
        codes = super().accept(logits)
        step = self.n - 1
        for f in self.followers:  # the same row, the same state: they stop with the leader
            f.rows[step] = codes
            f.n, f.countdown, f.stop_reason = self.n, self.countdown, self.stop_reason
        return codes

    def release(self) -> None:
        super().release()
        for f in self.followers:
            f.release()

    def hand_over(self) -> Any:
        raise ValueError("a voice blend cannot be continued (its cache is one per voice)")

    def redraw(self, options) -> BlendRequest:
        """A new draw of the same blend (a retried take): every voice's request drawn again."""
        return BlendRequest([Request.redraw(self, options), *(f.redraw(options) for f in self.followers)],
                            self.weights, self.mode)
