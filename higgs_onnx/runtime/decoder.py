"""The exported Qwen3 decoder (ModelBuilder GQA graph) with its KV cache.

Positions come from `attention_mask` (no position_ids in the cpu graph, toolchain G10); past/present names and
head size are read from the session and the model facts, never hard-coded.
"""

from __future__ import annotations

import numpy as np


class SimpleDecoder:
    """Growing caches fed back through NumPy: the plain reference path (also used by the build checks)."""

    def __init__(self, part, facts):
        self.part, self.facts = part, facts
        names = list(part.input_types)
        self.past = [n for n in names if n.startswith("past_key_values.")]
        self.dtype = part.input_types["inputs_embeds"]

    def prefill(self, embeds: np.ndarray) -> np.ndarray:
        """(S, D) -> (S, D) hidden states; starts a new sequence."""
        f = self.facts
        self.cache = {n: np.zeros((1, f.kv_heads, 0, f.head_dim), self.part.input_types[n]) for n in self.past}
        self.length = 0
        return self._run(embeds)

    def step(self, embeds: np.ndarray) -> np.ndarray:
        return self._run(embeds)

    def _run(self, embeds: np.ndarray) -> np.ndarray:
        self.length += len(embeds)
        outs = self.part(inputs_embeds=embeds[None], attention_mask=np.ones((1, self.length), np.int64), **self.cache)
        for n in self.past:
            self.cache[n] = outs[n.replace("past_key_values.", "present.")]
        hidden = outs["hidden_states"][0]
        if not np.any(hidden):
            raise FloatingPointError("llm_decoder produced all-zero hidden states (broken attention kernel?)")
        return hidden.astype(np.float32)
