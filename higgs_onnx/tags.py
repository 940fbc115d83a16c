"""The shape of an inline tag in a text, `<|...|>`: what the request contract counts as no speech and the guard leaves
out of a text's length (one pattern for both)."""

from __future__ import annotations

import re

CONTROL_TAG = re.compile(r"<\|[^<>|]*\|>")


def between_tags(text: str, fn) -> str:
    """`text` with `fn` applied to each run of text between its control tags; the tags themselves are untouched."""
    out, at = [], 0
    for m in CONTROL_TAG.finditer(text):
        out += [fn(text[at:m.start()]), m.group()]
        at = m.end()
    out.append(fn(text[at:]))
    return "".join(out)
