"""The shape of an inline tag in a text, `<|...|>`: what the request contract counts as no speech and the guard leaves
out of a text's length (one pattern for both)."""

from __future__ import annotations

import re

CONTROL_TAG = re.compile(r"<\|[^<>|]*\|>")
