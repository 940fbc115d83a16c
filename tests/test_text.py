"""The text steps (higgs_onnx/text): normalisation on our own tables of cases, stage directions and instructions on
the tokenizer's own tags, the lexicon's rules, and plain text left exactly as written."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from pathlib import Path

import pytest

from higgs_onnx.job.options import OptionError, SpeechOptions
from higgs_onnx.text import directions
from higgs_onnx.text.lexicon import Lexicon, LexiconError, load
from higgs_onnx.text.normalize import language_of, normalize
from higgs_onnx.text.pipeline import TextOptions

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT / "tests" / "data" / "text"
# what the normaliser must reach on the tables (measured: docs/text.md: 180/180, 178/178, and on the held-out
# tables, written by someone who had not seen the patterns, 158/163 and 153/163; the text gaps' cases, written before
# their code, 41/41; titles, labels before a number, kitchen units and a unit after "per", written before their code:
# 17/47 before, 47/47 after); a change that reads fewer fails
FLOOR = {"en": 1.0, "zh": 1.0, "en_heldout": 0.96, "zh_heldout": 0.93, "en_gaps": 1.0, "en_abbrev": 1.0}
SIZE = {"en": 100, "zh": 100, "en_heldout": 160, "zh_heldout": 160, "en_gaps": 40, "en_abbrev": 45}


def tokenizer_tags() -> set[str]:
    """The control tags of the real vocabulary (the asset the synthetic checkpoints carry)."""
    data = json.loads(gzip.open(ROOT / "higgs_onnx" / "assets" / "qwen3_higgs_tokenizer.json.gz").read())
    return {t["content"] for t in data["added_tokens"] if re.fullmatch(r"<\|[a-z_]+:[a-z_]+\|>", t["content"])}


TAGS = tokenizer_tags()


def _measure():
    """scripts/measure_normalizers.py: the one reader of the tables and the one comparison of readings."""
    spec = importlib.util.spec_from_file_location("measure_normalizers", ROOT / "scripts" / "measure_normalizers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MEASURE = _measure()


def table(name: str) -> list[tuple[str, str, list[str]]]:
    return MEASURE.load_table(TABLES / f"normalize_{name}.tsv")


def same(a: str, b: str) -> bool:
    return MEASURE.canon(a) == MEASURE.canon(b)


@pytest.mark.parametrize("name", list(FLOOR))
def test_the_tables_are_read_as_people_read_them(name):
    cases, language = table(name), name[:2]
    assert len(cases) >= SIZE[name], f"normalize_{name}.tsv has {len(cases)} cases"
    hits = [any(same(normalize(i, language), e) for e in x) for _, i, x in cases]
    rate = sum(hits) / len(hits)
    misses = [(c, i, normalize(i, language)) for (c, i, _), h in zip(cases, hits, strict=True) if not h]
    assert rate >= FLOOR[name] - 1e-9, f"{name}: {sum(hits)} of {len(cases)}; misses: {misses[:12]}"


@pytest.mark.parametrize("language", ["en", "zh"])
def test_plain_text_comes_back_unchanged(language):
    plain = [i for c, i, _ in table(language) if c == "plain"]
    assert len(plain) >= 10
    for text in plain:
        assert normalize(text, language) == text


def test_tags_are_never_touched_and_auto_picks_the_language():
    text = "<|emotion:elation|>I have 3 cats.<|prosody:pause|> 2 dogs."
    assert normalize(text, "en") == "<|emotion:elation|>I have three cats.<|prosody:pause|> two dogs."
    assert language_of("今天是2026年12月3日") == "zh" and language_of("It is 3 pm") == "en"
    assert normalize("价格是3.5元", "auto") == "价格是三点五元"
    with pytest.raises(ValueError, match="normalize must be one of"):
        normalize("1", "fr")
    with pytest.raises(TypeError):
        normalize(5, "en")


def test_stage_directions_become_the_tokenizers_own_tags():
    got = directions.stage_directions("[laughs] That was good. (sighs) Fine. *whispers* Come here.", "tags", TAGS)
    assert got == "<|sfx:laughter|>That was good. <|sfx:sigh|>Fine. <|style:whispering|>Come here."
    assert directions.stage_directions("[laughs] Hi (see below) and *really* so.", "tags", TAGS) == \
        "<|sfx:laughter|>Hi (see below) and *really* so."  # prose in brackets and emphasis stay
    assert directions.stage_directions("[dramatic music] Hi.", "tags", TAGS) == "Hi."  # no tag for it: removed
    assert directions.stage_directions("[laughs] Hi (sighs).", "remove", TAGS) == "Hi ."
    assert directions.stage_directions("[laughs] Hi.", "keep", TAGS) == "[laughs] Hi."
    # a tokenizer without the tag: the direction is removed, never a tag the model does not have
    assert directions.stage_directions("[laughs] Hi.", "tags", TAGS - {"<|sfx:laughter|>"}) == "Hi."
    # the table holds no tag the real tokenizer lacks
    assert {f"<|{t}|>" for t in directions.WORDS.values()} <= TAGS


def test_instructions_map_to_tags_or_are_refused_naming_the_words():
    assert directions.instruction_tags("Speak cheerfully and a bit slowly, please.", TAGS) == \
        ["<|emotion:elation|>", "<|prosody:speed_slow|>"]
    assert directions.instruction_tags("whispering, very slowly", TAGS) == \
        ["<|style:whispering|>", "<|prosody:speed_very_slow|>"]
    with pytest.raises(directions.DirectionError) as e:
        directions.instruction_tags("Sound like a pirate with a British accent", TAGS)
    assert e.value.words == ["pirate", "british", "accent"] and "'pirate'" in str(e.value)


def test_the_lexicon_rules():
    lex = Lexicon({"nguyen": "win", "US": "U S", "New York": "Noo York", "New York City": "the Big Apple"})
    assert lex.apply("Nguyen met nguyen and NGUYEN.") == "Win met win and Win."
    assert lex.apply("The US and us.") == "The U S and us."  # an entry with capitals: that case only
    assert lex.apply("New York City, New York.") == "the Big Apple, Noo York."  # the longest wins
    assert Lexicon({"ann": "anne"}).apply("Ann's and Anna.") == "Anne's and Anna."  # whole words
    assert Lexicon({"elation": "joy"}).apply("<|emotion:elation|>elation") == "<|emotion:elation|>joy"
    assert Lexicon({}).apply("same") == "same"
    for bad, why in (({"a": 5}, "must be a string"), ({"": "x"}, "empty"), ({"x": "<|sfx:cough|>"}, "control tags"),
                     ({"-x": "y"}, "whole words"), (["a"], "object")):
        with pytest.raises(LexiconError, match=why):
            Lexicon(bad)


def test_lexicon_files(tmp_path):
    (tmp_path / "a.tsv").write_text("# names\nNguyen\tWin\nSiobhan = Shivawn\n\n", encoding="utf-8")
    assert load(tmp_path / "a.tsv").entries == {"Nguyen": "Win", "Siobhan": "Shivawn"}
    (tmp_path / "b.json").write_text('{"Nguyen": "Win"}', encoding="utf-8")
    assert len(load(tmp_path / "b.json")) == 1
    (tmp_path / "c.tsv").write_text("no separator here\n", encoding="utf-8")
    for path, why in ((tmp_path / "c.tsv", r"c.tsv:1: write"), (tmp_path / "none", "no such file"),
                      (tmp_path, "is a folder")):
        with pytest.raises(LexiconError, match=why):
            load(path)
    (tmp_path / "d.json").write_text("{oops", encoding="utf-8")
    with pytest.raises(LexiconError, match="not JSON"):
        load(tmp_path / "d.json")


def test_the_steps_run_in_order_and_plain_text_is_not_touched():
    assert TextOptions().plain and TextOptions().read("3 **x** [laughs]", TAGS).text == "3 **x** [laughs]"
    job = SpeechOptions.build({"normalize": "en", "stage_directions": "tags", "lexicon": {"nguyen": "win"},
                               "instructions": "sadly"}, "http")
    reading = job.read("[sighs] Nguyen paid $5.", TAGS)
    assert reading.text == "<|sfx:sigh|>Win paid five dollars."
    assert [s for s, _ in reading.steps] == ["stage_directions=tags", "lexicon", "normalize=en"]
    assert job.lead(TAGS) == "<|emotion:sadness|>"
    # a server's lexicon under a request's: the request's entries win, the server's others stay
    server = SpeechOptions.build({"lexicon": {"nguyen": "win", "ann": "anne"}}, "cli")
    mine = SpeechOptions.build({"lexicon": {"nguyen": "nuh-win"}}, "http", server)
    assert mine.text.lexicon.entries == {"nguyen": "nuh-win", "ann": "anne"}


@pytest.mark.parametrize("field, value, message", [
    ("normalize", "fr", "normalize must be true, false or one of auto, en, zh, got 'fr'"),
    ("markdown", "yes", "markdown must be true or false, got 'yes'"),
    ("emoji", "smile", "emoji must be one of drop, name, keep, got 'smile'"),
    ("stage_directions", "shout", "stage_directions must be one of keep, tags, remove, got 'shout'"),
    ("lexicon", {"a": 1}, "lexicon: every word and respelling must be a string"),
    ("instructions", "x" * 1001, "instructions is 1001 characters long; the limit is 1000"),
])
def test_text_fields_are_checked_once(field, value, message):
    with pytest.raises(OptionError) as e:
        SpeechOptions.build({field: value}, "http")
    assert str(e.value).startswith(message) and e.value.param == field


def test_docs_hold_the_directions_table_as_the_code_makes_it():
    page = (ROOT / "docs" / "text.md").read_text(encoding="utf-8")
    assert directions.markdown_table(TAGS) in page, "docs/text.md: the stage directions table is stale"


def test_hostile_text_never_breaks_the_normaliser():
    """Numbers past the libraries' words are read digit by digit; random text never raises."""
    import random

    assert normalize("I have " + "1" * 40 + " coins.", "en") == "I have " + " ".join(["one"] * 40) + " coins."
    assert normalize("共" + "9" * 20 + "元", "zh") == "共" + "九" * 20 + "元"
    rng = random.Random(7)
    alphabet = "0123456789 .,:/-%$€£¥½°²‰abcXYZ@年月日点：，。<|>"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        for language in ("en", "zh"):
            assert isinstance(normalize(text, language), str)


@pytest.mark.parametrize("text, said", [
    ("1e308", "one e308"), ("Set 5x zoom", "Set five x zoom"), ("A 3D print", "A three D print"),
    ("Meet on 2026-13-45.", "Meet on two thousand and twenty-six dash thirteen dash forty-five."),
    ("2026-02-30", "two thousand and twenty-six dash two dash thirty"),
    ("31/02/2026", "thirty-one slash two slash two thousand and twenty-six"),
    ("At 25:61 sharp.", "At twenty-five colon sixty-one sharp."),
    ("2024-02-29", "February twenty-ninth, twenty twenty-four"),  # a leap day is a date
    ("at 7:45 pm", "at seven forty-five p m"),
])
def test_numbers_never_glue_to_letters_and_impossible_dates_read_as_written(text, said):
    assert normalize(text, "en") == said


@pytest.mark.parametrize("text, said", [
    ("Gen Z likes it.", "Gen Z likes it."),  # a word without its period is a word
    ("room no 12", "room no twelve"), ("No, I don't.", "No, I don't."),
    ("the Dr. said so", "the Doctor said so"),  # a title fitting no place reads as its first sense
    ("Go down Main St.", "Go down Main Street."), ("Dr. Who? Dr.", "Doctor Who? Doctor"),
    ("Visit 5th Ave. today", "Visit fifth Avenue today"),  # after an ordinal, a street
    ("Lakers vs. Celtics", "Lakers versus Celtics"),
    ("apples, pears, etc. The end.", "apples, pears, et cetera. The end."),
    ("e.g., apples", "for example, apples"), ("Mr. & Mrs. Smith", "Mister & Missus Smith"),
    ("See Fig. 3 and pp. 10-12.", "See Figure three and pages ten to twelve."),
    ("per cent, per se, per h", "per cent, per se, per hour"), ("3 a m", "three a m"),  # one letter after "a" stays
    ("$20/h", "twenty dollars per hour"), ("1 1/2 tsp", "one and a half teaspoons"),
    ("Sift 3 c. Then", "Sift three cups. Then"),
])
def test_abbreviations_and_units_are_read_by_their_neighbours(text, said):
    assert normalize(text, "en") == said


def test_impossible_dates_and_times_in_chinese_read_as_written():
    assert normalize("会议在2026-13-45举行", "zh") == "会议在二千零二十六杠十三杠四十五举行"
    assert normalize("时间是25:61", "zh") == "时间是二十五冒号六十一"
    assert normalize("2026-02-03", "zh") == "二零二六年二月三日"


@pytest.mark.parametrize("lang, text", [("zh", "1" * 50_000), ("zh", "一" + "1234567890" * 5_000),
                                        ("en", "1,111" * 10_000), ("en", "In 1990 and 2020. " * 2_800)])
def test_the_longest_input_normalizes_in_linear_time(lang, text):
    """The input bound (100,000 characters) of digits once took 30 s and more (a pattern tried again inside every
    number, a cue searched in the whole text before each number): now ~0.3 s at 50,000 characters; 5 s leaves
    room for a slow machine and still fails the quadratic version."""
    import time

    t0 = time.perf_counter()
    out = normalize(text, lang)
    assert time.perf_counter() - t0 < 5.0 and out and not any(c.isdigit() for c in out[:1000])
