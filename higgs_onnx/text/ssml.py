"""An SSML subset, read as text and the model's own tags (the `ssml` text step; docs/text.md, "SSML").

The document is parsed by a real XML parser through defusedxml (pinned): no DTD at all, so no entity expansion and
no external entity (a billion-laughs document is refused, not expanded). What each element becomes:

- `<speak>`: the root (a text without one is read as if it had it); `xml:lang` and `version` are allowed;
- `<break time="300ms"/>` or `strength=`: `<|prosody:pause|>`, or `<|prosody:long_pause|>` from LONG_PAUSE_S; nothing
  for 0 s or `strength="none"`;
- `<prosody rate=... pitch=...>`: the speed tag (`x-slow` .. `x-fast`, or a percentage, as the `speed` field maps
  it) and `<|prosody:pitch_high|>` / `pitch_low`, before the enclosed text;
- `<say-as interpret-as=...>`: `characters` (`spell-out`) letter by letter; `cardinal`, `ordinal`, `date`
  (`format` ymd, mdy, dmy, ...), `telephone` read as words (normalize.say_as);
- `<sub alias="...">`: the alias instead of the enclosed text;
- `<emphasis level=...>`: `<|prosody:expressive_high|>` (strong, moderate) or `expressive_low` (reduced) before the
  enclosed text.

Any other element or attribute is refused by name, as is one in a foreign namespace (`foo:rate` is not SSML's `rate`;
SSML's own namespace and `xml:` are read), a processing instruction (`<?name ...?>`), a DTD (`<!DOCTYPE ...>`, with or
without an XML declaration), a document over MAX_CHARS, nested deeper than MAX_DEPTH, or one that is not well formed.
The model's tags have no end: a rate, pitch or emphasis tag is placed before the text it applies to, and what
follows is the model's to decide. A tag the tokenizer lacks is left out.
"""

from __future__ import annotations

import re

from .directions import SPEED_RANGE, speed_tag

ELEMENTS = ("speak", "break", "prosody", "say-as", "sub", "emphasis")
ATTRIBUTES = {"speak": {"version", "lang", "base", "xmlns"}, "break": {"time", "strength"},
              "prosody": {"rate", "pitch"}, "say-as": {"interpret-as", "format", "detail"}, "sub": {"alias"},
              "emphasis": {"level"}}
SAY_AS = ("characters", "spell-out", "cardinal", "number", "ordinal", "date", "telephone")
RATES = {"x-slow": 0.5, "slow": 0.8, "medium": 1.0, "default": 1.0, "fast": 1.3, "x-fast": 1.7}
PITCHES = {"x-low": "pitch_low", "low": "pitch_low", "medium": None, "default": None, "high": "pitch_high",
           "x-high": "pitch_high"}
STRENGTHS = {"none": 0.0, "x-weak": 0.2, "weak": 0.3, "medium": 0.5, "strong": 0.8, "x-strong": 1.2}
EMPHASIS = {"strong": "expressive_high", "moderate": "expressive_high", "none": None, "reduced": "expressive_low"}
LONG_PAUSE_S = 0.8  # a break this long or longer is the long pause tag
MAX_BREAK_S = 10.0
MAX_CHARS = 100_000
MAX_DEPTH = 32
SSML_NS = "http://www.w3.org/2001/10/synthesis"
XML_NS = "http://www.w3.org/XML/1998/namespace"  # xml:lang, xml:base
_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*$")
_PERCENT = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)\s*%\s*$")


class SsmlError(ValueError):
    """A document this reader refuses: one line, naming the element or attribute."""


def local(name: str) -> str:
    """An element's or attribute's name without its namespace (`{http://www.w3.org/2001/10/synthesis}speak`)."""
    return name.rsplit("}", 1)[-1]


def namespace(name: str) -> str:
    """The namespace of a parsed name ("" for none)."""
    return name[1:].split("}", 1)[0] if name.startswith("{") else ""


def parse(text: str):
    """The document's root element (defusedxml: DTDs, entities and external references are refused; a processing
    instruction is refused by name, never dropped)."""
    import xml.etree.ElementTree as ET

    from defusedxml import DefusedXmlException
    from defusedxml.ElementTree import ParseError, XMLParser

    class Builder(ET.TreeBuilder):  # ElementTree drops processing instructions unless its target takes them
        def __init__(self):
            super().__init__()
            self.instructions: list[str] = []

        def pi(self, target, data=None):
            self.instructions.append(target)

    if len(text) > MAX_CHARS:
        raise SsmlError(f"the SSML document is {len(text):,} characters; the limit is {MAX_CHARS:,}")
    source = text.strip()
    if not source.startswith(("<speak", "<?xml", "<!DOCTYPE")):  # a DTD is refused as one, not read as text
        source = f"<speak>{source}</speak>"  # a fragment: read as the content of <speak>
    builder = Builder()
    try:
        parser = XMLParser(target=builder, forbid_dtd=True, forbid_entities=True, forbid_external=True)
        parser.feed(source)
        root = parser.close()
    except DefusedXmlException as e:
        raise SsmlError(f"the SSML document is refused: {type(e).__name__} (no DTD, entities or external "
                        "references are read)") from None
    except ParseError as e:
        raise SsmlError(f"the SSML document is not well-formed XML: {e}") from None
    if builder.instructions:
        raise SsmlError(f"the SSML document's processing instruction <?{builder.instructions[0]} ...?> is not "
                        f"read: remove it")
    if local(root.tag) != "speak":
        raise SsmlError(f"the SSML document's root must be <speak>, got <{local(root.tag)}>")
    return root


def seconds(value: str, where: str) -> float:
    m = _TIME.match(value)
    if not m:
        raise SsmlError(f'{where}: time="{value}" is not a duration such as "300ms" or "1.5s"')
    s = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    if s > MAX_BREAK_S:
        raise SsmlError(f'{where}: time="{value}" is longer than {MAX_BREAK_S:g} s')
    return s


def rate_of(value: str) -> float:
    if value in RATES:
        return RATES[value]
    m = _PERCENT.match(value)
    if not m:
        raise SsmlError(f'<prosody rate="{value}">: use x-slow, slow, medium, fast, x-fast or a percentage ("80%")')
    pct = float(m.group(1))
    rate = 1 + pct / 100 if m.group(1)[0] in "+-" else pct / 100
    if not SPEED_RANGE[0] <= rate <= SPEED_RANGE[1]:
        raise SsmlError(f'<prosody rate="{value}">: the rate must be {SPEED_RANGE[0]:.0%} to {SPEED_RANGE[1]:.0%}')
    return rate


def to_text(text: str, tags, language: str = "en") -> str:
    """The document as what the model reads: its text, with the model's tags where the elements ask for them."""
    from .normalize import say_as

    root = parse(text)
    out: list[str] = []

    def tag(name: str | None) -> None:
        if name and f"<|prosody:{name}|>" in tags:
            out.append(f"<|prosody:{name}|>")

    def walk(el, depth: int) -> None:
        name = local(el.tag)
        if depth > MAX_DEPTH:
            raise SsmlError(f"the SSML document is nested deeper than {MAX_DEPTH} elements")
        if namespace(el.tag) not in ("", SSML_NS):
            raise SsmlError(f"element <{name}> is in the namespace {namespace(el.tag)}, not SSML's: it is not read "
                            f"(remove it)")
        for key in el.attrib:
            if namespace(key) not in ("", SSML_NS, XML_NS):
                raise SsmlError(f'attribute {local(key)}="..." of <{name}> is in the namespace {namespace(key)}, '
                                f"not SSML's: it is not read (remove it)")
        if name not in ELEMENTS:
            raise SsmlError(f"SSML element <{name}> is not supported (supported: "
                            f"{', '.join(f'<{e}>' for e in ELEMENTS)})")
        if name == "speak" and depth > 0:
            raise SsmlError("<speak> may only be the root")
        attrs = {local(k): v for k, v in el.attrib.items()}
        for key in attrs:
            if key not in ATTRIBUTES[name]:
                raise SsmlError(f'SSML attribute {key}="..." of <{name}> is not supported (supported: '
                                f"{', '.join(sorted(ATTRIBUTES[name])) or 'none'})")
        if name == "break":
            if len(el) or (el.text or "").strip():
                raise SsmlError("<break> is empty: it has no text or elements inside")
            if "time" in attrs:
                pause = seconds(attrs["time"], "<break>")
            else:
                strength = attrs.get("strength", "medium")
                if strength not in STRENGTHS:
                    raise SsmlError(f'<break strength="{strength}">: use one of {", ".join(STRENGTHS)}')
                pause = STRENGTHS[strength]
            if pause > 0:
                tag("long_pause" if pause >= LONG_PAUSE_S else "pause")
        elif name == "sub":
            if "alias" not in attrs:
                raise SsmlError("<sub> needs an alias attribute")
            if len(el):
                raise SsmlError("<sub> holds text only (no elements inside)")
            out.append(attrs["alias"])
        elif name == "say-as":
            kind = attrs.get("interpret-as")
            if kind is None:
                raise SsmlError(f'<say-as> needs an interpret-as attribute ({", ".join(SAY_AS)})')
            if kind not in SAY_AS:
                raise SsmlError(f'<say-as interpret-as="{kind}"> is not supported (supported: {", ".join(SAY_AS)})')
            if len(el):
                raise SsmlError("<say-as> holds text only (no elements inside)")
            try:
                out.append(say_as({"spell-out": "characters", "number": "cardinal"}.get(kind, kind),
                                  (el.text or "").strip(), attrs.get("format"), language))
            except ValueError as e:
                raise SsmlError(f'<say-as interpret-as="{kind}">: {e}') from None
        else:
            if name == "prosody":
                if "rate" in attrs:
                    out.append(speed_tag(rate_of(attrs["rate"]), tags) or "")
                if "pitch" in attrs:
                    if attrs["pitch"] not in PITCHES:
                        raise SsmlError(f'<prosody pitch="{attrs["pitch"]}">: use one of {", ".join(PITCHES)}')
                    tag(PITCHES[attrs["pitch"]])
            elif name == "emphasis":
                level = attrs.get("level", "moderate")
                if level not in EMPHASIS:
                    raise SsmlError(f'<emphasis level="{level}">: use one of {", ".join(EMPHASIS)}')
                tag(EMPHASIS[level])
            out.append(el.text or "")
            for child in el:
                walk(child, depth + 1)
                out.append(child.tail or "")
            return
        # a leaf element's own tail is added by its parent

    walk(root, 0)
    return re.sub(r"[ \t\r\n]+", " ", "".join(out)).strip()
