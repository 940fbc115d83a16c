"""higgs_onnx.text.markdown: chat text (markdown) read as prose.

The cases are in tests/data/text/markdown_cases.tsv (category, input, expected; "\\n", "\\t" and "\\\\" in a cell are a
newline, a tab and a backslash). A category "emoji-<mode>" runs with that emoji mode, every other one with "drop".
"""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

import pytest

from higgs_onnx.tags import CONTROL_TAG
from higgs_onnx.text.markdown import EMOJI_MODES, short_url, to_prose

CASES = Path(__file__).parent / "data" / "text" / "markdown_cases.tsv"
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def _decode(cell: str) -> str:
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], cell)


def _cases() -> list:
    lines = CASES.read_text(encoding="utf-8").split("\n")
    assert lines[0] == "category\tinput\texpected"
    params = []
    for number, line in enumerate(lines[1:], start=2):
        if not line:
            continue
        category, source, expected = line.split("\t")
        params.append(pytest.param(category, _decode(source), _decode(expected), id=f"line{number}-{category}"))
    return params


CASE_PARAMS = _cases()


@pytest.mark.parametrize(("category", "source", "expected"), CASE_PARAMS)
def test_case(category: str, source: str, expected: str):
    mode = category.removeprefix("emoji-") if category.startswith("emoji-") else "drop"
    assert to_prose(source, emoji=mode) == expected


def test_the_table_covers_every_rule():
    counts = Counter(param.values[0] for param in CASE_PARAMS)
    assert sum(counts.values()) >= 110
    rules = "plain whitespace inline strike heading list table code link image url email quote rule html entity tags"
    for category in [*rules.split(), "nasty", *(f"emoji-{mode}" for mode in EMOJI_MODES)]:
        assert counts[category] >= 3, category


def test_a_single_line_sentence_comes_back_identical():
    sentence = "Well, the 3 tests (a, b and c) passed at 10:42 - and nothing else changed?"
    assert to_prose(sentence) == sentence


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("https://www.github.com/org/repo?x=1", "github.com"),
        ("http://Example.COM:8080/a/b#frag", "example.com"),
        ("www.python.org/downloads", "python.org"),
        ("github.com/org", "github.com"),
        ("https://user:secret@www.a.example/", "a.example"),
        ("https://www.", "https://www."),
        ("mailto:me@example.com", "mailto:me@example.com"),
        ("/relative/path", "/relative/path"),
        ("https://[broken", "https://[broken"),
        ("", ""),
    ],
)
def test_short_url(url: str, host: str):
    assert short_url(url) == host


@pytest.mark.parametrize("bad", [None, 3, b"bytes", ["a"]])
def test_a_text_that_is_not_a_string_is_a_type_error(bad):
    with pytest.raises(TypeError, match="text must be a string"):
        to_prose(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="url must be a string"):
        short_url(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["Drop", "names", "", None, "remove"])
def test_an_unknown_emoji_mode_is_a_value_error(mode):
    with pytest.raises(ValueError, match=re.escape(f"emoji must be one of drop, name, keep, got {mode!r}")):
        to_prose("hi 👍", emoji=mode)  # type: ignore[arg-type]


# markdown's characters one by one, then longer pieces (space-separated), then whitespace pieces
_PIECES = [
    *"ab1 2.*_~`#|-+>[]()!<&;:/\\=",
    *"<|a:b|> <|x|> https://www.x.com/p www. <https://a.b> 👍 🇫🇷 ❤️ © \ue000 é 日本".split(),
    *"``` &amp; <b> </b> <br> |-| ~~ ** ![ ](".split(),
    *["\n", "\n\n", "\t", "    ", "1. ", "- ", "# ", "> ", "\u2028", "\x00"],
]


def _random_text(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 30)))
    chars = (chr(rng.choice([rng.randint(32, 126), rng.randint(0, 0x10FFFF)])) for _ in range(rng.randint(0, 30)))
    return "".join(ch for ch in chars if not 0xD800 <= ord(ch) <= 0xDFFF)


def test_fuzz_never_raises_keeps_tags_and_whitespace_rules():
    rng = random.Random(20240611)
    for _ in range(400):
        text = _random_text(rng)
        for mode in EMOJI_MODES:
            prose = to_prose(text, emoji=mode)
            assert isinstance(prose, str)
            assert prose == prose.strip() and "  " not in prose and "\n\n" not in prose, (text, prose)
            before, after = Counter(CONTROL_TAG.findall(text)), Counter(CONTROL_TAG.findall(prose))
            assert all(after[tag] >= n for tag, n in before.items()), (text, prose)
