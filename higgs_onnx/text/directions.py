"""Stage directions and OpenAI's `instructions`, mapped to the model's own control tags.

One table (`WORDS`: a word people write -> the tag it means) serves both:
- a stage direction in the text, `[laughs]`, `(sighs)`, `*whispers*`, becomes that tag where the tokenizer has it
  (`stage_directions="tags"`), or is removed (`"remove"`); `"keep"` (the default) leaves the text as written. Square
  brackets are always a direction (chat apps write them for nothing else); parentheses and asterisks only when every
  word inside is in the table, so "(see below)" and "*really*" stay prose.
- `instructions` ("speak cheerfully, a bit slowly") become the tags of the words it names, placed at the start of the
  text (the model reads emotion, style and speed tags at the start of a sentence). A word that is neither in the table
  nor a filler ("speak", "in", "a", "voice", ...) is refused, naming it: nothing is accepted and ignored.

The tags are looked up in the tokenizer's own control tags: a table entry whose tag the tokenizer lacks maps to
nothing (a direction is then removed, an instruction refused).
"""

from __future__ import annotations

import re

MODES = ("keep", "tags", "remove")

WORDS = {
    # sound effects: inline, at the exact place
    "laugh": "sfx:laughter", "laughs": "sfx:laughter", "laughing": "sfx:laughter", "laughter": "sfx:laughter",
    "chuckles": "sfx:laughter", "chuckle": "sfx:laughter", "giggles": "sfx:laughter", "lol": "sfx:laughter",
    "sigh": "sfx:sigh", "sighs": "sfx:sigh", "sighing": "sfx:sigh",
    "cough": "sfx:cough", "coughs": "sfx:cough", "coughing": "sfx:cough", "clears throat": "sfx:cough",
    "cries": "sfx:crying", "crying": "sfx:crying", "sobs": "sfx:crying", "sobbing": "sfx:crying",
    "screams": "sfx:screaming", "screaming": "sfx:screaming", "scream": "sfx:screaming",
    "burps": "sfx:burping", "burp": "sfx:burping", "hums": "sfx:humming", "humming": "sfx:humming",
    "sniffs": "sfx:sniff", "sniff": "sfx:sniff", "sniffles": "sfx:sniff", "sneezes": "sfx:sneeze",
    "sneeze": "sfx:sneeze",
    "pause": "prosody:pause", "pauses": "prosody:pause", "beat": "prosody:pause", "long pause": "prosody:long_pause",
    # style
    "whispers": "style:whispering", "whispering": "style:whispering", "whisper": "style:whispering",
    "whispered": "style:whispering", "softly": "style:whispering",
    "shouts": "style:shouting", "shouting": "style:shouting", "shout": "style:shouting", "yells": "style:shouting",
    "yelling": "style:shouting", "loudly": "style:shouting",
    "sings": "style:singing", "singing": "style:singing", "sing": "style:singing",
    # emotions
    "happy": "emotion:elation", "happily": "emotion:elation", "joyful": "emotion:elation",
    "cheerful": "emotion:elation",
    "cheerfully": "emotion:elation", "elated": "emotion:elation", "excited": "emotion:enthusiasm",
    "excitedly": "emotion:enthusiasm", "enthusiastic": "emotion:enthusiasm", "enthusiastically": "emotion:enthusiasm",
    "amused": "emotion:amusement", "playful": "emotion:amusement", "playfully": "emotion:amusement",
    "determined": "emotion:determination", "firmly": "emotion:determination", "proud": "emotion:pride",
    "proudly": "emotion:pride", "content": "emotion:contentment", "calm": "emotion:contentment",
    "calmly": "emotion:contentment", "warm": "emotion:affection", "warmly": "emotion:affection",
    "affectionate": "emotion:affection", "tenderly": "emotion:affection", "relieved": "emotion:relief",
    "thoughtful": "emotion:contemplation", "thoughtfully": "emotion:contemplation",
    "confused": "emotion:confusion", "surprised": "emotion:surprise", "gasps": "emotion:surprise",
    "awed": "emotion:awe", "in awe": "emotion:awe", "wistful": "emotion:longing", "wistfully": "emotion:longing",
    "angry": "emotion:anger", "angrily": "emotion:anger", "furious": "emotion:anger", "scared": "emotion:fear",
    "afraid": "emotion:fear", "fearful": "emotion:fear", "nervously": "emotion:fear", "disgusted": "emotion:disgust",
    "bitter": "emotion:bitterness", "bitterly": "emotion:bitterness", "sad": "emotion:sadness",
    "sadly": "emotion:sadness", "ashamed": "emotion:shame", "helpless": "emotion:helplessness",
    # prosody
    "slow": "prosody:speed_slow", "slowly": "prosody:speed_slow", "very slowly": "prosody:speed_very_slow",
    "fast": "prosody:speed_fast", "quickly": "prosody:speed_fast", "very fast": "prosody:speed_very_fast",
    "very quickly": "prosody:speed_very_fast", "low": "prosody:pitch_low", "deep": "prosody:pitch_low",
    "high": "prosody:pitch_high", "high-pitched": "prosody:pitch_high", "expressive": "prosody:expressive_high",
    "dramatic": "prosody:expressive_high", "dramatically": "prosody:expressive_high",
    "monotone": "prosody:expressive_low", "flat": "prosody:expressive_low", "flatly": "prosody:expressive_low",
}
FILLERS = frozenset("""a an the and or but with in into of to for at on by as like be very bit little slightly
rather quite somewhat please speak speaks speaking say said talk talking read reading sound sounding voice tone
manner way style pitch pace speed sentence text this it that you your use using more less lot much""".split())

SQUARE = re.compile(r"\[([^\[\]\n]{1,40})\]")
ROUND = re.compile(r"\(([A-Za-z][A-Za-z' -]{0,30})\)")
STARS = re.compile(r"(?<![*\w])\*([A-Za-z][A-Za-z' -]{0,30})\*(?![*\w])")


class DirectionError(ValueError):
    """instructions with words the table cannot map; `words` names them."""

    def __init__(self, message: str, words: list[str]):
        super().__init__(message)
        self.words = words


def check_mode(value, label: str = "stage_directions") -> str:
    if value not in MODES:
        raise ValueError(f"{label} must be one of {', '.join(MODES)}, got {value!r}")
    return value


def _tag(phrase: str, tags) -> str | None:
    name = WORDS.get(" ".join(phrase.lower().split()))
    tag = f"<|{name}|>" if name else None
    return tag if tag in tags else None


def _known(phrase: str) -> bool:
    return " ".join(phrase.lower().split()) in WORDS


def stage_directions(text: str, mode: str, tags) -> str:
    """`text` with its stage directions made tags (`mode` "tags"), removed ("remove"), or as written ("keep")."""
    if mode == "keep":
        return text

    def swap(m: re.Match, always: bool) -> str:
        phrase = m.group(1).strip()
        if not always and not _known(phrase):
            return m.group()
        tag = _tag(phrase, tags) if mode == "tags" else None
        return tag or ""

    for pattern, always in ((SQUARE, True), (ROUND, False), (STARS, False)):
        text = pattern.sub(lambda m, a=always: swap(m, a), text)
    return re.sub(r"[ \t]{2,}", " ", re.sub(r"(\|>)[ \t]+", r"\1", text)).strip()


def instruction_tags(instructions: str, tags) -> list[str]:
    """The tags `instructions` asks for, in order, once each; DirectionError naming every word it cannot map."""
    out, unknown = [], []
    for phrase in _phrases(instructions):
        tag = _tag(phrase, tags)
        if tag is None:
            unknown.append(phrase)
        elif tag not in out:
            out.append(tag)
    if unknown:
        raise DirectionError(f"instructions: cannot map {', '.join(repr(w) for w in unknown)} to the model's tags "
                             f"(docs/text.md lists the words it knows: emotions such as 'cheerful' or 'sad', "
                             f"'whispering', 'shouting', 'slowly', 'quickly', 'low', 'high', 'expressive')", unknown)
    return out


def _phrases(instructions: str):
    """The words and two-word phrases of `instructions` that are not fillers, in order."""
    words = re.findall(r"[A-Za-z][A-Za-z'-]*", instructions.lower())
    i = 0
    while i < len(words):
        two = " ".join(words[i:i + 2])
        if len(words) > i + 1 and two in WORDS:
            phrase, i = two, i + 2
        else:
            phrase, i = words[i], i + 1
        if phrase not in FILLERS:
            yield phrase


def paces(instructions: str) -> list[str]:
    """The phrases of `instructions` that set a pace ('slowly', 'very fast'): a `speed` beside them contradicts
    them (`job.options.RULES`)."""
    return [p for p in _phrases(instructions) if WORDS.get(p, "").startswith("prosody:speed_")]


def table(tags) -> list[tuple[str, str]]:
    """(word, tag) for every table word whose tag the tokenizer has: docs/text.md's table, read from the tokenizer."""
    return [(w, f"<|{t}|>") for w, t in WORDS.items() if f"<|{t}|>" in tags]


def markdown_table(tags) -> str:
    """docs/text.md's table: each tag the tokenizer has and the words that mean it (a test checks the page)."""
    words: dict[str, list[str]] = {}
    for word, tag in table(tags):
        words.setdefault(tag, []).append(word)
    rows = [f"| `{tag}` | {', '.join(ws)} |" for tag, ws in sorted(words.items())]
    return "\n".join(["| tag | words (a stage direction or an instruction) |", "|---|---|", *rows])


SPEED_RANGE = (0.25, 4.0)  # the speeds a job may ask for (the `speed` option, SSML's <prosody rate>)


def speed_tag(speed: float, tags) -> str | None:
    """`speed` as the model's own prosody tag, where the tokenizer has it (`tags`: its control tags); None at 1."""
    name = ("speed_very_slow" if speed <= 0.6 else "speed_slow" if speed < 0.9 else None if speed <= 1.1 else
            "speed_fast" if speed < 1.6 else "speed_very_fast")
    tag = f"<|prosody:{name}|>" if name else None
    return tag if tag in tags else None
