"""Text that arrives in pieces (an LLM's tokens) cut into segments to speak as soon as each is whole.

`TextSegmenter.feed(text)` returns the segments completed so far, `flush()` the rest at the end. A segment ends
where `longform.split` ends a sentence (the same rules: titles, initials, decimals and a lowercase next word do not
end one), and only once the next word has begun to arrive, so "Dr." or "3." followed by more text is never cut. A
blank line ends a segment too. `granularity="clause"` also cuts at , ; : and their CJK forms (earlier first audio,
shorter segments). A sentence that grows past `max_chars` without an end is cut the way long-form cuts one. Tags
with no words after them wait for the text they lead. Whitespace inside a segment is collapsed to single spaces.
"""

from __future__ import annotations

from .longform.split import CLAUSE_END, PARAGRAPH_BREAK, TAG, in_tag, is_speakable, sentence_ends, split_text

GRANULARITIES = ("sentence", "clause")
MAX_CHARS = 600  # as long-form's pieces: about 40 s of speech
MAX_BUFFER = 100_000  # characters waiting for a segment end: more is a client error, not text


class TextSegmenter:
    def __init__(self, granularity: str = "sentence", max_chars: int = MAX_CHARS):
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        self.clause, self.max_chars = granularity == "clause", max_chars
        self.buf = ""  # text not yet in a segment (raw, as it came)
        self.lead = ""  # wordless text (tags) waiting for the words it leads

    def feed(self, text: str) -> list[str]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        self.buf += text.replace("\r\n", "\n").replace("\r", "\n")
        out: list[str] = []
        *paragraphs, self.buf = PARAGRAPH_BREAK.split(self.buf)
        for p in paragraphs:  # whole paragraphs: every sentence in them is done
            out += self._cut(" ".join(p.split()), final=True)
        tail = " ".join(self.buf.split())
        if tail and self.buf[-1].isspace():
            tail += " "  # the next piece starts a new word
        self.buf = ""
        out += self._cut(tail, final=False)
        if len(self.buf) > MAX_BUFFER:
            raise ValueError(f"more than {MAX_BUFFER} characters arrived without a place to cut them")
        return self._lead(out)

    def flush(self) -> list[str]:
        """The text left (the input is over)."""
        rest, self.buf = " ".join(self.buf.split()), ""
        out = self._lead(self._cut(rest, final=True))
        if self.lead:  # tags with no words after them: spoken with the last segment, or alone
            out = out[:-1] + [f"{out[-1]} {self.lead}"] if out else [self.lead]
            self.lead = ""
        return out

    def _cut(self, para: str, final: bool) -> list[str]:
        """`para`'s complete segments; what is not complete goes back to the buffer (unless `final`)."""
        if not para.strip():
            return []
        tags = [m.span() for m in TAG.finditer(para)]
        ends = set(sentence_ends(para, tags))
        if self.clause:
            ends |= {m.end() for m in CLAUSE_END.finditer(para) if not in_tag(tags, m.start())}
        if not final:  # an end counts once the next word has begun to arrive
            ends = {e for e in ends if para[e:].strip()}
        out, start = [], 0
        for e in sorted(ends):
            out.append(para[start:e].strip())
            start = e
        rest = para[start:]
        if final:
            out.append(rest.strip())
        else:
            if len(rest) > self.max_chars:  # no end in sight: cut as long-form cuts a long sentence
                pieces = split_text(rest, self.max_chars // 2, self.max_chars)
                out += [p.text for p in pieces[:-1]]
                rest = pieces[-1].text + (" " if rest[-1:] == " " else "")
            self.buf = rest.lstrip()
        return [s for s in out if s]

    def _lead(self, segments: list[str]) -> list[str]:
        out = []
        for s in segments:
            if not is_speakable(s):
                self.lead = f"{self.lead} {s}".strip()
                continue
            out.append(f"{self.lead} {s}".strip())
            self.lead = ""
        return out
