"""Prompt layouts of spec §3 (SGO `text_tokenizer.py`): token ids appended directly, no chat template.

    zero-shot:            <|tts|> <|text|> tok(text) <|audio|>
    clone, no transcript: <|tts|> <|ref_audio|> [audio]*R <|text|> tok(text) <|audio|>
    clone + transcript:   <|tts|> <|ref_text|> tok(ref_text) <|ref_audio|> [audio]*R <|text|> tok(text) <|audio|>

[audio] is the checkpoint's `audio_token_id` placeholder (-100); R = delayed reference rows. Every special id is
looked up by string in the tokenizer, never hard-coded. Control tags (`<|emotion:elation|>` ...) are added
tokens, so they tokenize to single ids as part of the text.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from dataclasses import dataclass

from tokenizers import Tokenizer

from ..tags import CONTROL_TAG

log = logging.getLogger(__name__)
SPECIAL_NAMES = ("tts", "text", "audio", "ref_audio", "ref_text")
TAG_PATTERN = CONTROL_TAG  # the one inline-tag pattern (tags.py)
CONTROL_TAG_SHAPE = re.compile(r"<\|[a-z_]+:[a-z_]+\|>")  # <|category:name|>


@dataclass(frozen=True)
class PromptTokens:
    """Special and control-tag ids of one tokenizer, looked up by string."""

    tts: int
    text: int
    audio: int
    ref_audio: int
    ref_text: int
    placeholder: int  # config.audio_token_id
    control_tags: dict[str, int]  # "<|emotion:elation|>" -> id

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer, placeholder: int) -> PromptTokens:
        added = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
        missing = [f"<|{n}|>" for n in SPECIAL_NAMES if f"<|{n}|>" not in added]
        if missing:
            raise ValueError(f"tokenizer lacks the Higgs special tokens {missing}: not a Higgs v3 tokenizer")
        tags = {s: i for s, i in added.items() if re.fullmatch(r"<\|[a-z_]+:[a-z_]+\|>", s)}
        return cls(**{n: added[f"<|{n}|>"] for n in SPECIAL_NAMES}, placeholder=placeholder, control_tags=tags)

    def unknown_tags(self, text: str, tok: Tokenizer) -> list[str]:
        """`<|...|>` spans in `text` that are not single added tokens (they will be read as plain text)."""
        added = {t.content for t in tok.get_added_tokens_decoder().values()}
        return [m for m in TAG_PATTERN.findall(text) if m not in added]


def check_text(text: str, what: str = "text") -> str:
    """Refuse text that cannot be spoken: not a string, empty, control characters, or no words (only tags,
    punctuation or invisible characters)."""
    check_characters(text, what)
    check_words(text, what)
    return text


def check_characters(text: str, what: str = "text") -> None:
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string, got {type(text).__name__}")
    if any(unicodedata.category(c) == "Cs" for c in text):  # what Python makes of bytes that are not UTF-8
        raise ValueError(f"{what} holds bytes that are not UTF-8 text (check the terminal's or the file's encoding)")
    bad = sorted({c for c in text if unicodedata.category(c) == "Cc" and c not in "\n\t\r"})
    if bad:
        raise ValueError(f"{what} contains control characters ({', '.join(f'U+{ord(c):04X}' for c in bad)}); "
                         f"remove them")
    if not text.strip():
        raise ValueError(f"{what} is empty")


def check_words(text: str, what: str = "text") -> None:
    rest = CONTROL_TAG_SHAPE.sub("", text)  # `<|audio|>` is not a control tag: refused as a special token instead
    if not rest.strip():
        raise ValueError(f"{what} has only control tags and no words to speak")
    if not any(unicodedata.category(c)[0] in "LN" for c in rest):
        raise ValueError(f"{what} has no letters or digits to speak (only punctuation, symbols or invisible "
                         f"characters)")


def build_prompt(tok: Tokenizer, ids: PromptTokens, text: str, ref_rows: int = 0,
                 ref_text: str | None = None, history: list[tuple[str, int]] = ()) -> list[int]:
    """The prompt ids; `ref_rows` placeholders are spliced with delayed reference rows by the caller.

    `history` = earlier turns (text, rows) of the same recording (long-form), laid out as finished turns between
    the voice and the new text: `<|text|> tok(text) <|audio|> [audio]*rows` each, their placeholders filled with
    the turn's delayed rows after the reference's."""
    if ref_text is not None and ref_rows == 0:
        raise ValueError("a reference transcript needs reference audio")
    check_text(text)
    unknown = ids.unknown_tags(text, tok)
    if unknown:
        log.warning("unknown tag(s) %s will be read as plain text", ", ".join(unknown))
    turns = [t for past, rows in history for t in (*build_suffix(tok, ids, past), *([ids.placeholder] * rows))]
    return build_prefix(tok, ids, ref_rows, ref_text) + turns + build_suffix(tok, ids, text)


def build_prefix(tok: Tokenizer, ids: PromptTokens, ref_rows: int = 0, ref_text: str | None = None) -> list[int]:
    """The part of a prompt that depends only on the voice: everything before <|text|>."""
    prefix = [ids.tts]
    if ref_text is not None:
        prefix += [ids.ref_text, *encode_user_text(tok, ids, ref_text, "the reference transcript",
                                                                "ref_text")]
    if ref_rows:
        prefix += [ids.ref_audio, *([ids.placeholder] * ref_rows)]
    return prefix


def build_suffix(tok: Tokenizer, ids: PromptTokens, text: str) -> list[int]:
    return [ids.text, *encode_user_text(tok, ids, text), ids.audio]


def encode_user_text(tok: Tokenizer, ids: PromptTokens, text: str, what: str = "text", param: str = "input"
                     ) -> list[int]:
    """The token ids of text a user wrote: checked (`check_text`), and refused when the tokenizer would make any
    added/special token of it other than a documented control tag (they would enter the prompt as structure)."""
    from .contract import ContractError, special_tokens_in

    check_characters(text, what)
    encoded = tok.encode(text, add_special_tokens=False).ids
    special = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
    bad = special_tokens_in(encoded, special, set(ids.control_tags.values()))
    if bad:
        raise ContractError(f"{what} contains the special token{'s' if len(bad) > 1 else ''} {', '.join(bad)}, "
                            f"which only the toolkit may place; inline control tags such as <|emotion:elation|> "
                            f"are allowed (remove or rephrase the rest)", param, "special_token")
    check_words(text, what)
    return encoded
