"""The request contract: what every request must satisfy before any work starts, checked in one place.

Every job (the CLI, long-form, the server, the corpus, eval) builds its requests through `Synthesizer.request`
(`HiggsTTS.request`), which calls the checks here; nothing is cut to fit afterwards.

- **Text** (`encode_user_text`): only the documented inline control tags (`<|emotion:elation|>` ...) may become
  special tokens. Any other text the tokenizer would turn into an added or special token (`<|audio|>`,
  `<|im_start|>`, `<|endoftext|>`, `<think>` ...) is refused, naming it, instead of entering the prompt as structure.
- **Positions** (`row_budget`): the prompt's positions plus the row budget must fit both the model's context and
  the cache slot that will run the request (a batching pool's slot is smaller than the real model's context).
  An explicit `max_rows` that does not fit is refused with the numbers; with the default (`max_rows=None`) the
  budget is `DEFAULT_MAX_ROWS` or what fits, and a text that cannot be spoken within it is refused.
- **Audio** (`min_rows`): a request must be able to yield at least one audio frame, i.e. at least N rows (N
  codebooks: the delay pattern puts codebook c c rows late); a generation that still ends without a frame raises
  `NoAudioError`.

`ContractError` is a `ValueError` (exit code 2 in the CLIs) that also carries the HTTP status, the field it is
about and an error code, so the server answers it as an OpenAI-style 400/413 body.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..tags import CONTROL_TAG
from .options import DEFAULT_MAX_ROWS

# A fast reader speaks ~15 characters a second (about 200 words a minute); no natural speech gets past this many,
# so `chars / FAST_CHARS_PER_S` seconds is a lower bound of what a text needs (CJK scripts need more per character:
# the bound stays a lower bound there).
FAST_CHARS_PER_S = 20.0
LONG_FORM_HINT = "split it into shorter requests, or read it as one recording with long-form: " \
                 "python inference.py --text-file FILE --out OUT.wav"


class ContractError(ValueError):
    """A request that breaks the contract; `status`/`param`/`code` are what the server answers with."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


class NoAudioError(RuntimeError):
    """A generation that ended without one audio frame (never reported as a success)."""


@dataclass(frozen=True)
class Limits:
    """Where a request will run: the model's context and, in a batching pool, the positions of one slot."""

    context: int
    slot: int | None = None

    @property
    def positions(self) -> int:
        return self.context if self.slot is None else min(self.context, self.slot)

    def describe(self) -> str:
        if self.slot is None or self.slot >= self.context:
            return f"the model's context holds {self.context} positions"
        return f"a batch slot here holds {self.slot} positions (the model's context: {self.context})"


def min_rows(num_codebooks: int) -> int:
    """The fewest rows that hold one audio frame: frames = rows - N + 1."""
    return num_codebooks


def spoken_chars(text: str) -> int:
    """Characters that take time to say: tags removed, runs of whitespace counted once."""
    return len(" ".join(CONTROL_TAG.sub(" ", text).split()))


def needed_rows(text: str, frame_rate: float, num_codebooks: int) -> int:
    """A lower bound of the rows `text` needs: its characters at `FAST_CHARS_PER_S`, plus the delay ramp."""
    return int(spoken_chars(text) / FAST_CHARS_PER_S * frame_rate) + num_codebooks - 1


def special_tokens_in(ids: list[int], special: dict[int, str], allowed: set[int]) -> list[str]:
    """The added/special tokens among `ids` that are not allowed in user text, in order, without repeats."""
    return list(dict.fromkeys(special[i] for i in ids if i in special and i not in allowed))


def check_max_rows(max_rows: int | None, num_codebooks: int, limits: Limits) -> None:
    """What can be said of an explicit `max_rows` before the prompt is known."""
    if max_rows is None:
        return
    low = min_rows(num_codebooks)
    if max_rows < low:
        raise ContractError(f"max_rows is {max_rows}; at least {low} rows are needed for one audio frame (the "
                            f"{num_codebooks} codebooks start one row apart)", "max_rows")
    if max_rows >= limits.positions:
        raise ContractError(f"max_rows is {max_rows}, but {limits.describe()}, prompt included: ask for fewer",
                            "max_rows", "context_length_exceeded")


def row_budget(prompt_len: int, max_rows: int | None, text: str, limits: Limits, num_codebooks: int,
               frame_rate: float) -> int:
    """The row budget of a request whose prompt is `prompt_len` positions, or ContractError naming the numbers."""
    check_max_rows(max_rows, num_codebooks, limits)
    low, room = min_rows(num_codebooks), limits.positions - prompt_len
    if room < low:
        raise ContractError(f"the prompt is {prompt_len} positions long (voice, transcript and text), but "
                            f"{limits.describe()} and the speech needs at least {low} more: shorten the text or "
                            f"the voice's transcript/reference", "input", "context_length_exceeded", 413)
    if max_rows is not None:
        if prompt_len + max_rows > limits.positions:
            raise ContractError(f"the prompt is {prompt_len} positions and max_rows asks for {max_rows} rows "
                                f"({prompt_len + max_rows} positions), but {limits.describe()}: at most {room} rows "
                                f"fit; lower max_rows or shorten the text", "max_rows", "context_length_exceeded")
        return max_rows
    budget = min(DEFAULT_MAX_ROWS, room)
    need = needed_rows(text, frame_rate, num_codebooks)
    if need > budget:
        fit = f"a request makes at most {budget} rows (the default limit)" if budget == DEFAULT_MAX_ROWS else \
            f"only {budget} rows fit after its {prompt_len}-position prompt ({limits.describe()})"
        raise ContractError(f"the text is {spoken_chars(text)} characters, which needs at least {need} rows "
                            f"(~{need / frame_rate:.0f} s of speech), but {fit}; {LONG_FORM_HINT}", "input",
                            "context_length_exceeded", 413)
    return budget
