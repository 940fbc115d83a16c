"""The long-form text splitter (higgs_onnx.longform.split): table-driven, no model, well under a second."""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import pytest

from higgs_onnx.longform.split import TAG, Piece, plan_stats, split_text

ONE = (1, 600)  # target 1: every sentence is its own piece, so a row shows the sentence boundaries
DEFAULT = (300, 600)
P = "¶"  # an expected piece ending in " ¶" ends a paragraph

# (id, text, (target_chars, max_chars), expected pieces)
EXACT = [
    ("stops", "One. Two! Three? Four… Five... Six?!", ONE,
     ["One.", "Two!", "Three?", "Four…", "Five...", "Six?! ¶"]),
    ("titles", "Dr. Smith met Mr. Jones. Mrs. Brown, Ms. Green and Prof. White came too.", ONE,
     ["Dr. Smith met Mr. Jones.", "Mrs. Brown, Ms. Green and Prof. White came too. ¶"]),
    ("st_jr_vs", "St. Paul vs. Minneapolis is old. Martin Luther King Jr. was born in Atlanta.", ONE,
     ["St. Paul vs. Minneapolis is old.", "Martin Luther King Jr. was born in Atlanta. ¶"]),
    ("etc_mid_and_end", "Bring pens, paper, etc. and a bag. We had pens, paper, etc. Then we left.", ONE,
     ["Bring pens, paper, etc. and a bag.", "We had pens, paper, etc.", "Then we left. ¶"]),
    ("eg_ie", "Use a tool, e.g. Python. It is fast, i.e. Quick to run.", ONE,
     ["Use a tool, e.g. Python.", "It is fast, i.e. Quick to run. ¶"]),
    ("am_pm_us", "We met at 9 a.m. in the U.S. embassy. It closed at 5 p.m. The guards left.", ONE,
     ["We met at 9 a.m. in the U.S. embassy.", "It closed at 5 p.m.", "The guards left. ¶"]),
    ("initials", "J. R. R. Tolkien wrote it. George R. R. Martin did not.", ONE,
     ["J. R. R. Tolkien wrote it.", "George R. R. Martin did not. ¶"]),
    ("decimals_versions", "Pi is 3.14 and v1.2 costs $4.50 now. Growth was 0.5%.", ONE,
     ["Pi is 3.14 and v1.2 costs $4.50 now.", "Growth was 0.5%. ¶"]),
    ("times", "The train left at 7:45. It arrived at 10.30 sharp.", ONE,
     ["The train left at 7:45.", "It arrived at 10.30 sharp. ¶"]),
    ("urls_emails", "See https://example.com/a.b?x=1 or mail jo.doe@mail.example.org now. Then call.", ONE,
     ["See https://example.com/a.b?x=1 or mail jo.doe@mail.example.org now.", "Then call. ¶"]),
    ("quote_closes_sentence", 'He said "Stop." Then he left.', ONE, ['He said "Stop."', "Then he left. ¶"]),
    ("quote_then_lowercase", '"Really?" she asked. "Yes!" He nodded.', ONE,
     ['"Really?" she asked.', '"Yes!"', "He nodded. ¶"]),
    ("curly_quotes_brackets", "She wrote “Done.” (It was late.) They slept.", ONE,
     ["She wrote “Done.”", "(It was late.)", "They slept. ¶"]),
    ("ellipsis_inside_vs_end", "And then... nothing happened. I waited… Nobody came.", ONE,
     ["And then... nothing happened.", "I waited…", "Nobody came. ¶"]),
    ("wordless_lead", "... So it began. Then more.", ONE, ["... So it began.", "Then more. ¶"]),
    ("cjk", "今天天气很好。我们去公园吧！你来吗？", (5, 600), ["今天天气很好。", "我们去公园吧！", "你来吗？ ¶"]),
    ("cjk_quotes", "他说：“走吧。”我们走了。", ONE, ["他说：“走吧。”", "我们走了。 ¶"]),
    ("packing", "The cat sat on the mat. It was warm. The dog barked loudly at it. Then all was quiet again. The end.",
     (40, 80), ["The cat sat on the mat. It was warm.", "The dog barked loudly at it.",
                "Then all was quiet again. The end. ¶"]),
    ("short_text_one_piece", "Hi there. Bye now.", DEFAULT, ["Hi there. Bye now. ¶"]),
    ("paragraphs", "First line\nsame paragraph. More.\n\n\nSecond paragraph.\n  \t\nThird.", DEFAULT,
     ["First line same paragraph. More. ¶", "Second paragraph. ¶", "Third. ¶"]),
    ("crlf_paragraphs", "One here.\r\n\r\nTwo here.", DEFAULT, ["One here. ¶", "Two here. ¶"]),
    ("whitespace_normalised", "  Hello\tthere,\n  world.  ", DEFAULT, ["Hello there, world. ¶"]),
    ("empty", "", DEFAULT, []),
    ("only_whitespace", " \n\t\n\n  ", DEFAULT, []),
    ("tags_lead_sentences", "Hello. <|emotion:elation|>Great news! <|prosody:pause|> See you.", ONE,
     ["Hello.", "<|emotion:elation|>Great news!", "<|prosody:pause|> See you. ¶"]),
    ("tag_after_stop_no_space", "Hi.<|emotion:elation|>There you are.", ONE,
     ["Hi.", "<|emotion:elation|>There you are. ¶"]),
    ("trailing_tag_joins_last", "Hello. Bye. <|prosody:pause|>", ONE, ["Hello.", "Bye. <|prosody:pause|> ¶"]),
    ("tag_paragraphs_join_text", "<|emotion:elation|>\n\nHello there.\n\n<|prosody:pause|>", ONE,
     ["<|emotion:elation|> Hello there. <|prosody:pause|> ¶"]),
    # nothing to speak: one piece of tags all the same; the caller's check_text refuses it ("only control tags")
    ("only_tags", "<|emotion:elation|>\n<|prosody:pause|>", DEFAULT, ["<|emotion:elation|> <|prosody:pause|> ¶"]),
]

WORDS = "time people way year government day man world life part house course case system place end group".split()


def _words(n: int, seed: int = 0, every: int = 0, insert: str = "") -> str:
    """n words; `insert` (a tag or punctuation) after every `every`-th word."""
    rng = random.Random(seed)
    out = []
    for i in range(1, n + 1):
        out.append(rng.choice(WORDS))
        if every and i % every == 0:
            out[-1] += insert
    return " ".join(out)


def _whole_words(pieces: list[Piece], text: str) -> bool:
    return [w for p in pieces for w in p.text.split()] == text.split()


def _tags_intact(pieces: list[Piece], _: str) -> bool:
    return all(TAG.sub("", p.text).count("<|") == 0 and "|>" not in TAG.sub("", p.text) for p in pieces)


LONG_PLAIN = _words(340)  # ~2,000 characters, no punctuation at all
LONG_CLAUSES = _words(340, seed=1, every=9, insert=",")
LONG_DASHES = _words(340, seed=2, every=13, insert=" —")
LONG_TAGGED = _words(340, seed=3, every=11, insert=" <|prosody:pause|>")
LONG_CJK = "我们一起去公园散步然后回家吃饭" * 90  # 1,350 characters, no stop, no space

# (id, text, (target_chars, max_chars), check(pieces, text)) for shapes too long to spell out
SHAPES: list[tuple[str, str, tuple[int, int], Callable[[list[Piece], str], bool]]] = [
    ("long_sentence_word_cuts", LONG_PLAIN, DEFAULT,
     lambda ps, t: len(t) > 1900 and len(ps) >= 4 and _whole_words(ps, t) and all(200 <= len(p.text) <= 600
                                                                                  for p in ps)),
    ("long_sentence_clause_cuts", LONG_CLAUSES, DEFAULT,
     lambda ps, t: len(ps) >= 4 and _whole_words(ps, t) and all(p.text.endswith(",") for p in ps[:-1])),
    ("long_sentence_dash_cuts", LONG_DASHES, DEFAULT,
     lambda ps, t: len(ps) >= 4 and _whole_words(ps, t) and all(p.text.endswith(" —") for p in ps[:-1])),
    ("long_sentence_tags_lead", LONG_TAGGED, DEFAULT,
     lambda ps, t: _whole_words(ps, t) and _tags_intact(ps, t) and not any(p.text.endswith("|>") for p in ps[:-1])),
    ("long_word_hard_cut", "x" * 1300, DEFAULT,
     lambda ps, t: "".join(p.text for p in ps) == t and all(len(p.text) <= 600 for p in ps)),
    ("long_cjk_hard_cut", LONG_CJK, DEFAULT,
     lambda ps, t: "".join(p.text for p in ps) == t and all(len(p.text) <= 600 for p in ps)),
    ("tag_never_hard_cut", "<|emotion:elation|>" + "y" * 40, (5, 10), _tags_intact),
    ("paragraph_never_crossed", "Short one.\n\nShort two.\n\nShort three.", DEFAULT,
     lambda ps, t: [p.paragraph_end for p in ps] == [True] * 3),
]


def _rendered(pieces: list[Piece]) -> list[str]:
    return [p.text + (f" {P}" if p.paragraph_end else "") for p in pieces]


def _check_invariants(text: str, target: int, limit: int, pieces: list[Piece]) -> None:
    """Rules 7 and 8 on any input: every non-space character kept in order, tidy pieces, deterministic."""
    assert "".join(" ".join(p.text for p in pieces).split()) == "".join(text.split())
    assert all(p.text and p.text == " ".join(p.text.split()) for p in pieces)
    assert all(len(p.text) <= limit for p in pieces if not TAG.search(p.text))
    assert (pieces[-1].paragraph_end if pieces else True)
    assert split_text(text, target, limit) == pieces


@pytest.mark.parametrize(("text", "sizes", "expected"), [r[1:] for r in EXACT], ids=[r[0] for r in EXACT])
def test_exact(text: str, sizes: tuple[int, int], expected: list[str]) -> None:
    pieces = split_text(text, *sizes)
    assert _rendered(pieces) == expected
    _check_invariants(text, *sizes, pieces)


@pytest.mark.parametrize(("text", "sizes", "check"), [r[1:] for r in SHAPES], ids=[r[0] for r in SHAPES])
def test_shape(text: str, sizes: tuple[int, int], check: Callable[[list[Piece], str], bool]) -> None:
    pieces = split_text(text, *sizes)
    assert check(pieces, text), _rendered(pieces)
    _check_invariants(text, *sizes, pieces)


def _book(n_words: int = 1500, seed: int = 7) -> str:
    """A deterministic ~1,500-word text with every kind of hazard the rules name."""
    rng = random.Random(seed)
    extras = ["Dr.", "Mr.", "e.g.", "i.e.", "3.5", "7:45", "v1.2", "a.m.", "U.S.", "J.", "etc.", "and then...",
              "“quoted,”", "(aside)", "<|emotion:elation|>", "<|prosody:pause|>", "https://x.org/a.b", "今天。"]
    stops = [".", "!", "?", "...", "…", '."', ".)", "。"]
    out, sentence, cap = [], 0, True
    for _ in range(n_words):
        word = rng.choice(extras) if rng.random() < 0.1 else rng.choice(WORDS)
        word, sentence = word.capitalize() if cap else word, sentence + 1
        cap = sentence > rng.randint(4, 30)
        if cap:  # a stop, and most often a capital after it
            word, sentence, cap = word + rng.choice(stops), 0, rng.random() < 0.8
        out.append(word + ("\n\n" if sentence == 0 and rng.random() < 0.1 else ""))
    return " ".join(out)


def test_generated_book() -> None:
    text = _book()
    assert len(text.split()) >= 1500
    pieces = split_text(text)
    _check_invariants(text, 300, 600, pieces)
    assert all(re.search(r"\w", TAG.sub("", p.text)) for p in pieces)  # no piece is only tags
    stats = plan_stats(pieces)
    assert stats["count"] == len(pieces) > 10 and stats["max_chars"] <= 600
    assert stats["min_chars"] <= stats["mean_chars"] <= stats["max_chars"]
    # idempotent: the pieces written back (spaces in a paragraph, blank lines between) split the same way
    again = " ".join(p.text + ("\n\n" if p.paragraph_end else "") for p in pieces)
    assert split_text(again) == pieces


def test_plan_stats_and_bad_arguments() -> None:
    assert plan_stats([]) == {"count": 0, "min_chars": 0, "mean_chars": 0.0, "max_chars": 0}
    assert plan_stats([Piece("ab", False), Piece("abcd", True)]) == {
        "count": 2, "min_chars": 2, "mean_chars": 3.0, "max_chars": 4}
    with pytest.raises(ValueError, match="target_chars"):
        split_text("Hi.", 700, 600)
    with pytest.raises(ValueError, match="string"):
        split_text(None)  # type: ignore[arg-type]
