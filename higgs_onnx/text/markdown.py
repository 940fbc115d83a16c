"""Chat text (markdown) made into prose a TTS model reads aloud: `to_prose(text, emoji="drop")`.

LLM chat replies (Open WebUI, voice agents) arrive as markdown. The text is parsed with markdown-it-py (CommonMark,
plus the GFM table and strikethrough rules; no linkify, no typographer) and its token stream is read back as plain
sentences. Nothing is stripped by pattern: what is markup is what the parser says is markup.

Rules:

- **Inline markup.** Emphasis, strong and inline code read as their text. Strikethrough text is *dropped*: struck text
  is what the writer withdrew ("~~$10~~ $8" reads "$8"). Emphasis written with `*` between two digits ("2*3*4") is
  read as the asterisks it was meant as.
- **Blocks.** Each paragraph, heading, list item and table row is its own line of the output; lines are separated by
  a single "\\n" (paragraph breaks and soft line breaks alike), blank lines are removed, each line is stripped and
  runs of spaces are made one. Block quotes read as their text; a horizontal rule is a paragraph break.
- **Headings** read as their text, as a sentence: a period is added when the text has no end of its own.
- **Lists** (bullet, numbered, nested): each item reads as its own sentence, without its marker; a period is added
  when the item has no end. An ordered "list" that starts at 1000 or more ("2024. What a year.") is a year, not a
  list: it keeps its number and is read as a paragraph.
- **A sentence's end** is one of . ! ? … 。！？ or a clause mark (, ; : and their full-width forms), which the writer
  chose as the pause; closing quotes and brackets and trailing control tags are looked through, and a period goes
  before trailing tags ("Hello<|x|>" becomes "Hello.<|x|>").
- **Tables**: each body row reads as one sentence, "Header: cell, Header: cell." Empty cells are skipped, a cell's
  trailing . , ; : is dropped, a column without a header reads as the bare cell. A table with no body reads its
  header row as one sentence.
- **Code blocks** (fenced and indented) are dropped: a chat reply's code cannot be read aloud. The text before one is
  closed as a sentence when more text follows, a trailing clause mark becoming a period ("Run this:" + code +
  "Then restart" reads "Run this.\\nThen restart"), so dropping never merges two sentences.
- **Links** read as their text; a link with no text reads as its host when it is a web address. Images read as their
  alt text (nothing when it is empty). Autolinks (`<https://x.y/z>`) and bare web addresses in the text
  (`http://…`, `https://…`, `www.…`) read as `short_url(...)`: the host, lowercased, without "www.", scheme, port,
  path or query. E-mail addresses (bare or `<me@x.y>`) are left as they are.
- **HTML.** Inline tags of known HTML elements, comments and declarations are removed, the text between them kept
  (`<b>x</b>` reads "x", `<br>` is a line break); HTML blocks are dropped like code. Something that only looks like
  a tag (`x<y and y>z`, `<your-name>`) is not an HTML element and is kept as written. Entities (`&amp;`, `&#233;`)
  read as the character.
- **Emoji** (`emoji=`): "drop" removes them and the space they leave ("Done 👍." reads "Done."), "name" replaces each
  by its CLDR name from the `emoji` package ("👍" reads "thumbs up"), "keep" leaves them. Characters whose default
  presentation is text (©, ®, ™, ↔, a bare ❤ without its emoji selector) are typography, not emoji, and are kept.
- **Control tags** `<|category:name|>` (higgs_onnx.tags.CONTROL_TAG) survive byte for byte wherever they are, table
  cells and code blocks included (a dropped block leaves its tags behind); they are swapped for private-use
  characters before parsing, so the `|` in them is never a table delimiter, and restored after. A tag in a table's
  header is read once, on its first row.
- **Plain text** with no markdown in it comes out as it went in, up to the whitespace rules. Text that only looks
  like markdown ("5 * 3 = 15", "a_b_c", "C++", "#hashtag", "a | b") is not markdown to the parser either.

`to_prose` raises TypeError for a text that is not a string and ValueError for an unknown emoji mode; it never
raises on a string. Limits: blocks nested deeper than 20 (markdown-it's maxNesting: "> > > ..." twenty times) are
not read; GFM task-list boxes ("- [ ] todo") are not markdown to CommonMark and are read as written.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import emoji as emoji_lib
from markdown_it import MarkdownIt
from markdown_it.token import Token

from ..tags import CONTROL_TAG

EMOJI_MODES = ("drop", "name", "keep")

_MD = MarkdownIt("commonmark", {"html": True, "linkify": False, "typographer": False}).enable(
    ["table", "strikethrough"]
)
_PRIVATE_USE = ((0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD))
_SENTENCE_ENDS = ".!?…。！？"
_CLAUSE_MARKS = ",;:，；："
_CLOSERS = "\"”’')]»」』）】"
_CELL_TRAIL = ".,;:"
_YEAR_START = 1000  # an ordered list starting here or later is a number in the text, not a list
_SPACES = re.compile(r"[^\S\n]{2,}|[\t\r\f\v]")
_BARE_URL = re.compile(r"(?<![\w@./-])(?:https?://|www\.)[\w\-.~:/?#\[\]@!$&'()*+,;=%]+", re.IGNORECASE)
_URL_TRAIL = ".,;:!?'\"*"
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*://", re.IGNORECASE)
_OTHER_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:(?!\d)", re.IGNORECASE)  # mailto:, tel:... (not host:port)
_HTML_NAME = re.compile(r"</?([A-Za-z][A-Za-z0-9-]*)")
_HTML_ELEMENTS = frozenset(
    "a abbr address area article aside audio b base bdi bdo big blockquote body br button canvas caption center "
    "cite code col colgroup data datalist dd del details dfn dialog div dl dt em embed fieldset figcaption figure "
    "font footer form h1 h2 h3 h4 h5 h6 head header hgroup hr html i iframe img input ins kbd label legend li link "
    "main map mark math menu meta meter nav noscript object ol optgroup option output p param picture pre progress "
    "q rp rt ruby s samp script section select small source span strike strong style sub summary sup svg table "
    "tbody td template textarea tfoot th thead time title tr track tt u ul var video wbr".split()
)
_UNQUALIFIED = emoji_lib.STATUS["unqualified"]


def to_prose(text: str, *, emoji: str = "drop") -> str:
    """`text` (markdown) as the prose to read aloud; the rules are in the module docstring."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    if emoji not in EMOJI_MODES:
        raise ValueError(f"emoji must be one of {', '.join(EMOJI_MODES)}, got {emoji!r}")
    protected, tags = _protect_tags(text)
    reader = _ProseReader(_Context(marks=frozenset(tags), emoji=emoji))
    reader.read(_MD.parse(protected))
    prose = "\n".join(reader.lines)
    missing = [mark for mark in tags if mark not in prose]  # a safety net: no rule should lose a tag
    if missing:
        prose = f"{prose} {' '.join(missing)}".strip()
    return prose.translate({ord(mark): tag for mark, tag in tags.items()})


def short_url(url: str) -> str:
    """The host of a web address, lowercased and without "www.": "https://www.github.com/org/repo?x=1" -> "github.com".

    An address with no host to find (a relative path, "mailto:...") is returned as it is.
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a string, got {type(url).__name__}")
    address = url.strip()
    if not _SCHEME.match(address):
        if _OTHER_SCHEME.match(address) and not address.lower().startswith("www."):
            return url
        address = "//" + address
    try:
        host = urlsplit(address).hostname
    except ValueError:  # a broken [IPv6] host
        return url
    host = (host or "").rstrip(".")
    if host.startswith("www.") and len(host) > 4:
        host = host[4:]
    return url if host in ("", "www") else host


# control tags


def _private_chars(taken: set[str]) -> Iterator[str]:
    for low, high in _PRIVATE_USE:
        for code in range(low, high + 1):
            if chr(code) not in taken:
                yield chr(code)


def _protect_tags(text: str) -> tuple[str, dict[str, str]]:
    """`text` with each control tag swapped for a private-use character the text does not use, and the swaps."""
    spare = _private_chars(set(text) | set(unquote(text)))  # unquoted too: a link's href is percent-encoded
    tags: dict[str, str] = {}

    def swap(match: re.Match[str]) -> str:
        mark = next(spare, None)
        if mark is None:  # more tags than private-use characters: the rest go to the parser as they are
            return match.group()
        tags[mark] = match.group()
        return mark

    return CONTROL_TAG.sub(swap, text), tags


@dataclass(frozen=True)
class _Context:
    marks: frozenset[str]  # the private-use characters that stand for control tags
    emoji: str

    def tags_in(self, text: str, *, encoded: bool = False) -> str:
        """The tag marks in `text` (percent-encoded: a link's href), space-separated: what a dropped piece leaves."""
        if not self.marks:
            return ""
        return " ".join(ch for ch in (unquote(text) if encoded else text) if ch in self.marks)

    def without_tags(self, text: str) -> str:
        return _tidy("".join(ch for ch in text if ch not in self.marks))


# sentences and whitespace


def _tidy(text: str) -> str:
    """Each line stripped, runs of spaces made one, empty lines removed."""
    lines = (_SPACES.sub(" ", line).strip() for line in text.split("\n"))
    return "\n".join(line for line in lines if line)


def _end_sentence(text: str, marks: frozenset[str], *, clause_ends: bool = True) -> str:
    """`text` ended as a sentence: a period added before trailing tags when it has no end.

    With clause_ends=False a trailing , ; or : is no end either and becomes the period.
    """
    end = len(text)
    while end and (text[end - 1].isspace() or text[end - 1] in marks):
        end -= 1
    core = text[:end].rstrip(_CLOSERS)
    if not core or core[-1] in _SENTENCE_ENDS:
        return text
    if core[-1] in _CLAUSE_MARKS:
        if clause_ends:
            return text
        return f"{core[:-1]}.{text[len(core) :]}"
    return f"{text[:end]}.{text[end:]}"


# emoji


def _emoji_spans(text: str) -> list[tuple[int, int, str]]:
    found = emoji_lib.emoji_list(text)
    return [
        (m["match_start"], m["match_end"], m["emoji"])
        for m in found
        if emoji_lib.EMOJI_DATA.get(m["emoji"], {}).get("status") != _UNQUALIFIED
    ]


def _emoji_name(char: str) -> str:
    return " ".join(emoji_lib.demojize(char, delimiters=(" ", " ")).replace("_", " ").split())


def _join_dropped(left: str, right: str) -> str:
    """`left` and `right` joined where an emoji was dropped between them, without the space it leaves."""
    if left[-1:].isspace() and (not right or right[0].isspace() or right[0] in ".,;:!?…)"):
        return left.rstrip(" \t") + right
    if left[-1:].isalnum() and right[:1].isalnum():
        return f"{left} {right}"
    return left + right


def read_emoji(text: str, mode: str) -> str:
    """Only the emoji of `text` dropped, named or kept (`emoji` without `markdown`); control tags untouched."""
    if mode not in EMOJI_MODES:
        raise ValueError(f"emoji must be one of {', '.join(EMOJI_MODES)}, got {mode!r}")
    protected, tags = _protect_tags(text)
    out = _read_emoji(protected, mode)
    for key, tag in tags.items():
        out = out.replace(key, tag)
    return out


def _read_emoji(text: str, mode: str) -> str:
    spans = [] if mode == "keep" else _emoji_spans(text)
    if not spans:
        return text
    out, pos = "", 0
    for start, end, char in spans:
        segment, pos = text[pos:start], end
        if mode == "drop":
            out = _join_dropped(out, segment)
            continue
        out += segment
        if out and not out[-1].isspace():
            out += " "
        out += _emoji_name(char)
        if text[end : end + 1].isalnum():
            out += " "
    tail = text[pos:]
    return _join_dropped(out, tail) if mode == "drop" else out + tail


# web addresses


def _trim_url(url: str) -> str:
    """A matched address without the sentence punctuation and unbalanced brackets after it."""
    while url:
        last = url[-1]
        if last in _URL_TRAIL or (last == ")" and url.count(")") > url.count("(")):
            url = url[:-1]
        elif last == "]" and url.count("]") > url.count("["):
            url = url[:-1]
        else:
            break
    return url


def _short_bare_url(match: re.Match[str]) -> str:
    found = match.group()
    address = _trim_url(found)
    host = short_url(address)
    if host == address:  # nothing that reads as a host
        return found
    return host + found[len(address) :]


def _shorten_urls(text: str) -> str:
    return _BARE_URL.sub(_short_bare_url, text)


def _is_html(raw: str) -> bool:
    """Whether raw HTML the parser found is HTML (a known element, a comment, a declaration), not "<y and y>"."""
    if raw.startswith(("<!", "<?")):
        return True
    name = _HTML_NAME.match(raw)
    return bool(name) and name.group(1).lower() in _HTML_ELEMENTS


# inline tokens


@dataclass
class _Inline:
    """One inline token stream read as text."""

    ctx: _Context
    out: list[str] = field(default_factory=list)
    struck: int = 0
    literal: list[bool] = field(default_factory=list)  # per open emphasis: read as its markup
    links: list[tuple[int, str]] = field(default_factory=list)  # per open link: where its text starts, its href
    autolink: list[str] | None = None  # the text of the autolink being read

    def read(self, tokens: list[Token]) -> str:
        for index, token in enumerate(tokens):
            nxt = tokens[index + 1] if index + 1 < len(tokens) else None
            self._token(token, nxt)
        return "".join(self.out)

    def _put(self, text: str) -> None:
        self.out.append(self.ctx.tags_in(text) if self.struck else text)

    def _token(self, token: Token, nxt: Token | None) -> None:
        kind = token.type
        if self.autolink is not None:
            self._autolink_part(token)
        elif kind in ("text", "text_special"):
            self._put(_shorten_urls(token.content))
        elif kind == "code_inline":
            self._put(token.content)
        elif kind in ("softbreak", "hardbreak"):
            self.out.append("\n")
        elif kind in ("em_open", "strong_open"):
            self._emphasis_open(token, nxt)
        elif kind in ("em_close", "strong_close"):
            if self.literal.pop() if self.literal else False:
                self._put(token.markup)
        elif kind == "s_open":
            self.struck += 1
        elif kind == "s_close":
            self.struck = max(0, self.struck - 1)
        elif kind == "link_open":
            self._link_open(token)
        elif kind == "link_close":
            self._link_close()
        elif kind == "image":
            alt = _Inline(self.ctx).read(token.children or [])
            self._put(" ".join(part for part in (alt, self._attr_tags(token)) if part))
        elif kind == "html_inline":
            self._html(token.content)
        else:  # a token type this reader does not know: its text, if any
            self._put(token.content)

    def _emphasis_open(self, token: Token, nxt: Token | None) -> None:
        before = "".join(self.out)[-1:]
        after = nxt.content[:1] if nxt is not None and nxt.type == "text" else ""
        literal = token.markup.startswith("*") and before.isdigit() and after.isdigit()
        self.literal.append(literal)
        if literal:
            self._put(token.markup)

    def _attr_tags(self, token: Token) -> str:
        return " ".join(filter(None, (self.ctx.tags_in(str(value), encoded=True) for value in token.attrs.values())))

    def _link_open(self, token: Token) -> None:
        if token.markup == "autolink":
            self.autolink = [str(token.attrs.get("href", ""))]
            return
        self.links.append((len(self.out), str(token.attrs.get("href", ""))))
        tags = self._attr_tags(token)
        if tags:
            self.out.append(" ")
            self._put(tags)
            self.out.append(" ")

    def _link_close(self) -> None:
        if not self.links:
            return
        start, href = self.links.pop()
        if not self.ctx.without_tags("".join(self.out[start:])) and re.match(r"https?://", href, re.IGNORECASE):
            self._put(" " + short_url(href) + " ")

    def _autolink_part(self, token: Token) -> None:
        assert self.autolink is not None
        if token.type != "link_close":
            self.autolink.append(token.content)
            return
        href, *parts = self.autolink
        self.autolink = None
        text = "".join(parts)
        spoken = text if href.lower().startswith("mailto:") else short_url(self.ctx.without_tags(text))
        tags = self.ctx.tags_in(text)
        self._put(f"{spoken} {tags}" if tags else spoken)

    def _html(self, raw: str) -> None:
        if not _is_html(raw):
            self._put(raw)
            return
        tags = self.ctx.tags_in(raw)
        self.out.append(f" {tags} " if tags else "")
        name = _HTML_NAME.match(raw)
        if name and name.group(1).lower() == "br":
            self.out.append("\n")


# block tokens


@dataclass
class _Table:
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    row: list[str] = field(default_factory=list)
    in_head: bool = False

    def sentences(self, ctx: _Context) -> list[str]:
        if not self.rows:
            cells = [cell for cell in map(_cell, self.header) if cell]
            return [_end_sentence(", ".join(cells), ctx.marks)] if cells else []
        out = []
        for number, row in enumerate(self.rows):
            labels = [_cell(h if number == 0 else ctx.without_tags(h)) for h in self.header]  # its tags read once
            sentence = _row_sentence(labels, [_cell(cell) for cell in row])
            if sentence:
                out.append(_end_sentence(sentence, ctx.marks))
        return out


def _row_sentence(labels: list[str], cells: list[str]) -> str:
    """One row as "Header: cell, Header: cell": empty cells skipped, a cell without a header read bare."""
    labels = labels + [""] * (len(cells) - len(labels))
    return ", ".join(f"{label}: {cell}" if label else cell for label, cell in zip(labels, cells, strict=False) if cell)


def _cell(text: str) -> str:
    return " ".join(text.split()).rstrip(_CELL_TRAIL).rstrip()


class _ProseReader:
    """The block token stream read as lines of prose."""

    def __init__(self, ctx: _Context):
        self.ctx = ctx
        self.lines: list[str] = []
        self.last_text: int | None = None  # the index of the last line with text (not only dropped tags)
        self.close_pending = False  # a block was dropped after that line
        self.lists: list[str] = []  # per open list: "list", or "text" for a year read as a paragraph
        self.prefix = ""  # a kept list number, for the next line
        self.block = "paragraph"  # what the next inline token is: paragraph, heading or cell
        self.table: _Table | None = None

    def read(self, tokens: list[Token]) -> None:
        for token in tokens:
            handler = getattr(self, "_" + token.type, None)
            if handler is not None:
                handler(token)

    def _emit(self, text: str) -> None:
        text = _tidy(text)
        if not text:
            return
        text, self.prefix = self.prefix + text, ""
        if self.close_pending and self.last_text is not None:
            self.lines[self.last_text] = _end_sentence(self.lines[self.last_text], self.ctx.marks, clause_ends=False)
        self.close_pending = False
        self.lines.append(text)
        self.last_text = len(self.lines) - 1

    def _drop(self, raw: str) -> None:
        tags = self.ctx.tags_in(raw)
        if tags:
            self.lines.append(tags)
        self.close_pending = True

    def _in_list(self) -> bool:
        return any(kind == "list" for kind in self.lists)

    def _inline(self, token: Token) -> None:
        text = _tidy(_read_emoji(_Inline(self.ctx).read(token.children or []), self.ctx.emoji))
        if self.block == "cell":
            if self.table is not None:
                self.table.row.append(text)
            return
        if self.block == "heading" or self._in_list():
            text = _end_sentence(text, self.ctx.marks)
        self._emit(text)

    def _paragraph_open(self, token: Token) -> None:
        self.block = "paragraph"

    def _heading_open(self, token: Token) -> None:
        self.block = "heading"

    def _heading_close(self, token: Token) -> None:
        self.block = "paragraph"

    def _fence(self, token: Token) -> None:
        self._drop(token.info + "\n" + token.content)

    def _code_block(self, token: Token) -> None:
        self._drop(token.content)

    def _html_block(self, token: Token) -> None:
        if _is_html(token.content.lstrip()):
            self._drop(token.content)
        else:  # "<your-name>" alone on a line: text that looks like a tag
            self._emit(token.content)

    def _bullet_list_open(self, token: Token) -> None:
        self.lists.append("list")

    def _ordered_list_open(self, token: Token) -> None:
        start = token.attrs.get("start", 1)
        self.lists.append("text" if isinstance(start, int) and start >= _YEAR_START else "list")

    def _bullet_list_close(self, token: Token) -> None:
        if self.lists:
            self.lists.pop()

    _ordered_list_close = _bullet_list_close

    def _list_item_open(self, token: Token) -> None:
        if self.lists and self.lists[-1] == "text":
            self.prefix = f"{token.info}{token.markup} "

    def _table_open(self, token: Token) -> None:
        self.table = _Table()

    def _thead_open(self, token: Token) -> None:
        if self.table is not None:
            self.table.in_head = True

    def _thead_close(self, token: Token) -> None:
        if self.table is not None:
            self.table.in_head = False

    def _tr_open(self, token: Token) -> None:
        if self.table is not None:
            self.table.row = []

    def _tr_close(self, token: Token) -> None:
        table = self.table
        if table is None:
            return
        if table.in_head:
            table.header = table.row
        else:
            table.rows.append(table.row)

    def _th_open(self, token: Token) -> None:
        self.block = "cell"

    _td_open = _th_open

    def _table_close(self, token: Token) -> None:
        table, self.table = self.table, None
        self.block = "paragraph"
        for sentence in table.sentences(self.ctx) if table is not None else []:
            self._emit(sentence)
