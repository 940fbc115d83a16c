"""Split a text of any length into pieces the model can speak in one turn (stdlib only).

The model speaks ~15 characters of English a second and was trained on utterances up to ~80 s, so a piece aims at
`target_chars` (300 ≈ 20 s) and never exceeds `max_chars` (600 ≈ 40 s), bar tags (see below).

    paragraphs  blank line(s) separate them; a piece never crosses one (`Piece.paragraph_end` marks the last piece)
    sentences   end at . ! ? … ... (+ closing quotes/brackets) before a space, a tag or the end, or at 。！？;
                not after titles ("Dr.", "e.g."), single initials ("J."), or when the next word is lowercase
                ("etc. and", "U.S. in", "and then... nothing", `"Stop!" he said`); decimals, times, URLs and
                e-mails have no space after their dots, so they are never candidates
    packing     whole sentences per piece; the split of a paragraph minimises Σ (len - target)², so pieces are even
    too long    a sentence over `max_chars` is cut into ~even parts near `target_chars`: at the clause boundary
                (, ; : — – and CJK ，；：、) nearest the even share, else the word boundary nearest it, else (one
                word over `max_chars`, or CJK with no punctuation) a hard cut there; never inside a tag
    tags        `<|...|>` tags are never split; tags with no words after them (a sentence or a whole paragraph)
                join the text they lead, or, at the very end, the text before it (so a piece may pass `max_chars`
                by those tags); a text of only tags gives one piece of tags, which `check_text` refuses later

Whitespace inside a piece is collapsed to single spaces; no other character is added, dropped or reordered, so the
pieces joined with spaces hold every non-space character of the input in order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..tags import CONTROL_TAG

TAG = CONTROL_TAG  # the one inline-tag pattern (tags.py)
CLOSERS = "\"”’')]»」』）】"
OPENERS = "\"“‘'([«¿¡「『（【"
_C = f"[{re.escape(CLOSERS)}]*"  # closing quotes and brackets stay with the sentence or clause they close
PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*\n|\u2029")
SENTENCE_END = re.compile(rf"[。！？][。！？!?]*{_C}|(?P<end>[.!?…]+){_C}(?=\s|$|<\|)")
CLAUSE_END = re.compile(rf"[,;:]{_C}(?= )|[，；：、]{_C}| [—–](?= )")  # CJK punctuation has no space after it
# A "." after these never ends a sentence (titles lead a name; "e.g." and "i.e." lead an example).
NEVER_END = frozenset("dr. mr. mrs. ms. mx. prof. st. mt. rev. fr. gen. col. capt. lt. sgt. gov. sen. rep. hon. "
                      "vs. e.g. i.e. cf. viz.".split())

Span = tuple[int, int]  # [start, end) in a normalised paragraph


@dataclass(frozen=True)
class Piece:
    """One turn of speech: `text` to speak; `paragraph_end` when a paragraph ends with it (a longer pause)."""

    text: str
    paragraph_end: bool


def split_text(text: str, target_chars: int = 300, max_chars: int = 600) -> list[Piece]:
    """`text` as pieces of whole sentences near `target_chars` and at most `max_chars` (see the module docstring)."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    if not 0 < target_chars <= max_chars:
        raise ValueError(f"need 0 < target_chars <= max_chars, got {target_chars} and {max_chars}")
    pieces: list[Piece] = []
    lead = ""  # wordless paragraphs (tags) waiting for the text they lead
    for raw in PARAGRAPH_BREAK.split(text.replace("\r\n", "\n").replace("\r", "\n")):
        para = " ".join(raw.split())
        if not para:
            continue
        if not is_speakable(para):
            lead = f"{lead} {para}".strip()
            continue
        para, lead = f"{lead} {para}".strip(), ""
        spans = _pack(_units(para, target_chars, max_chars), target_chars, max_chars)
        pieces += [Piece(para[a:b], i == len(spans) - 1) for i, (a, b) in enumerate(spans)]
    if lead:  # trailing wordless paragraphs: the end of the last piece, or the only piece
        pieces[-1:] = [Piece(f"{pieces[-1].text} {lead}" if pieces else lead, True)]
    return pieces


def plan_stats(pieces: list[Piece]) -> dict[str, float]:
    """Count and min/mean/max characters of `pieces`, for progress lines."""
    sizes = [len(p.text) for p in pieces]
    if not sizes:
        return {"count": 0, "min_chars": 0, "mean_chars": 0.0, "max_chars": 0}
    return {"count": len(sizes), "min_chars": min(sizes), "mean_chars": round(sum(sizes) / len(sizes), 1),
            "max_chars": max(sizes)}


def is_speakable(s: str) -> bool:
    """True when `s` has a letter or digit outside control tags."""
    return any(c.isalnum() for c in TAG.sub("", s))


def in_tag(tags: list[Span], i: int) -> Span | None:
    """The tag that strictly contains position `i` (a cut there would split it), if any."""
    return next((t for t in tags if t[0] < i < t[1]), None)


def _units(para: str, target: int, limit: int) -> list[Span]:
    """The sentences of `para`, those over `limit` cut smaller, wordless ones joined to a neighbour."""
    tags = [m.span() for m in TAG.finditer(para)]
    units, start = [], 0
    for end in sentence_ends(para, tags):
        units += _cut_long(para, start, end, target, limit, tags)
        start = end + (end < len(para) and para[end] == " ")
    if start < len(para):
        units += _cut_long(para, start, len(para), target, limit, tags)
    merged: list[Span] = []
    pending = None  # start of wordless units waiting for the text they lead
    for a, b in units:
        if not is_speakable(para[a:b]):
            pending = a if pending is None else pending
            continue
        merged.append((a if pending is None else pending, b))
        pending = None
    if pending is not None:  # wordless tail: the paragraph is speakable, so there is a unit before it
        merged[-1] = (merged[-1][0], len(para))
    return merged


def sentence_ends(para: str, tags: list[Span]) -> list[int]:
    """Positions just past each sentence end in `para` (closing quotes included), the paragraph end excluded."""
    ends = []
    for m in SENTENCE_END.finditer(para):
        if m.end() >= len(para) or in_tag(tags, m.start()) or in_tag(tags, m.end()):
            continue
        if m["end"] is not None and not _ends_sentence(para, m.start(), m["end"], m.end()):
            continue
        ends.append(m.end())
    return ends


def _ends_sentence(para: str, at: int, stop: str, after: int) -> bool:
    """Whether the Latin stop `stop` at `at` (its closers end at `after`) ends a sentence."""
    rest = para[after:].lstrip()
    word = TAG.sub("", para[para.rfind(" ", 0, at) + 1:at + len(stop)]).lstrip(OPENERS)
    if stop == "." and (word.lower() in NEVER_END or re.fullmatch(r"[A-Z]\.", word)):
        return False
    if rest.startswith("<|"):
        return True
    first = rest.lstrip(OPENERS)[:1]
    return not first.islower()


def _cut_long(para: str, a: int, b: int, target: int, limit: int, tags: list[Span]) -> list[Span]:
    """[a, b) as even spans of at most `limit` characters when it is longer than `limit`, else as it is.

    It aims at n = ceil(len / target) parts; each cut is the clause boundary nearest the even share of what is
    left (no nearer than half of it), else the word boundary nearest it, else (no space: one long word, or CJK) a
    hard cut there, moved out of any tag."""
    spans: list[Span] = []
    parts = -(-(b - a) // target) if b - a > limit else 1
    while a < b and (b - a > limit or len(spans) < parts - 1):
        goal = (b - a) / max(parts - len(spans), 2)
        window = para[a:min(b, a + limit + 1)]
        ok = range(1, min(limit, b - a - 1) + 1)  # a cut leaves something on both sides and at most `limit` before
        clauses = [m.end() for m in CLAUSE_END.finditer(window) if m.end() in ok and m.end() >= goal / 2
                   and not in_tag(tags, a + m.end())]
        words = [i for i, c in enumerate(window) if c == " " and i in ok and not in_tag(tags, a + i)]
        untagged = [i for i in words if not window[:i].endswith("|>")]  # keep a tag with the words it leads
        options = clauses or untagged or words
        if options:
            cut = min(options, key=lambda i: (abs(i - goal), i))
        else:
            cut = min(max(round(goal), 1), limit)
            tag = in_tag(tags, a + cut)
            cut = cut if tag is None else (tag[0] - a if tag[0] > a else tag[1] - a)
        spans.append((a, a + len(para[a:a + cut].rstrip())))
        a += cut + (para[a + cut:a + cut + 1] == " ")
    return spans + [(a, b)] if a < b else spans


def _pack(units: list[Span], target: int, limit: int) -> list[Span]:
    """Group consecutive units into pieces of at most `limit` characters minimising Σ (len - target)²."""
    best: list[tuple[int, int]] = [(0, 0)]  # best[j] = (cost of units[:j], start index of its last piece)
    for j in range(1, len(units) + 1):
        options = []
        for i in range(j - 1, -1, -1):
            size = units[j - 1][1] - units[i][0]
            if size > limit and i < j - 1:
                break
            options.append((best[i][0] + (size - target) ** 2, i))
        best.append(min(options, key=lambda o: (o[0], -o[1])))
    spans, j = [], len(units)
    while j:
        i = best[j][1]
        spans.append((units[i][0], units[j - 1][1]))
        j = i
    return spans[::-1]
