"""What the model reads: the text as written, through the steps a job asks for, in this order.

0. SSML (ssml.py): a `<speak>` document read as its text and the model's tags;
1. stage directions (`[laughs]` -> `<|sfx:laughter|>`, directions.py), before markdown reads `*whispers*` as emphasis;
2. markdown -> prose (markdown.py), emoji dropped, named or kept;
3. the lexicon's respellings (lexicon.py), on the words as written (so an entry can overrule the normaliser: "3M");
4. normalisation (normalize.py): numbers, dates, money, units, URLs ... as words;
5. `instructions` -> tags at the start (directions.py).

Every step is off by default, and then the text is not touched at all (the reference pipeline sends it to the
tokenizer as it is). `Reading.steps` records the text after each step that ran: the dry run shows them.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import directions
from .lexicon import Lexicon
from .normalize import AUTO, check_language, normalize

EMOJI = ("drop", "name", "keep")


@dataclass(frozen=True)
class Reading:
    text: str  # what the model reads
    steps: tuple[tuple[str, str], ...] = ()  # (step, text after it), for the steps that ran


@dataclass(frozen=True)
class TextOptions:
    """The text steps of one job (checked where they are built: `job.options`)."""

    normalize: str | None = None  # None: off; "auto", "en", "zh"
    ssml: bool = False
    markdown: bool = False
    emoji: str | None = None  # None: "drop" with markdown, else the text's emoji are kept
    stage_directions: str = "keep"
    lexicon: Lexicon | None = None
    instructions: str | None = None

    @property
    def plain(self) -> bool:
        """Nothing to do: the text goes to the tokenizer as written."""
        return (self.normalize is None and not self.ssml and not self.markdown and self.emoji in (None, "keep")
                and self.stage_directions == "keep" and not self.lexicon and not (self.instructions or "").strip())

    def read(self, text: str, tags) -> Reading:
        """`text` through the steps; `tags`: the tokenizer's control tags. DirectionError for instructions it
        cannot map, ssml.SsmlError for a document it refuses."""
        if self.plain:
            return Reading(text)
        steps = []

        def step(name: str, new: str) -> str:
            steps.append((name, new))
            return new

        if self.ssml:
            from .ssml import to_text

            text = step("ssml", to_text(text, tags, self.normalize or "en"))
        if self.stage_directions != "keep":
            text = step(f"stage_directions={self.stage_directions}",
                        directions.stage_directions(text, self.stage_directions, tags))
        emoji = self.emoji or ("drop" if self.markdown else "keep")
        if self.markdown or emoji != "keep":
            from .markdown import read_emoji, to_prose

            text = step("markdown" if self.markdown else f"emoji={emoji}",
                        to_prose(text, emoji=emoji) if self.markdown else read_emoji(text, emoji))
        if self.lexicon:
            text = step("lexicon", self.lexicon.apply(text))
        if self.normalize is not None:
            text = step(f"normalize={self.normalize}", normalize(text, self.normalize))
        if (self.instructions or "").strip():
            text = step("instructions", "".join(directions.instruction_tags(self.instructions, tags)) + text)
        return Reading(text, tuple(steps))


def check_normalize(value, label: str = "normalize") -> str | None:
    """false / true (auto) / a language -> None or the language."""
    if value is False or value is None:
        return None
    if value is True:
        return AUTO
    try:
        return check_language(value)
    except ValueError:
        raise ValueError(f"{label} must be true, false or one of {AUTO}, en, zh, got {value!r}") from None


def check_emoji(value, label: str = "emoji") -> str | None:
    if value is not None and value not in EMOJI:
        raise ValueError(f"{label} must be one of {', '.join(EMOJI)}, got {value!r}")
    return value
