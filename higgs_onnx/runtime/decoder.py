"""The exported Qwen3 decoder (ModelBuilder GQA graph) with its KV cache.

Positions come from `attention_mask` (no position_ids in the cpu graph, toolchain G10); past/present names and
shapes are read from the session and the model facts, never hard-coded.

- `BoundDecoder` (default): one preallocated buffer per layer and key/value, bound through IOBinding as both
  `past_key_values.{i}.*` and `present.{i}.*`; GroupQueryAttention writes the new rows in place (toolchain §8).
  No cache crosses NumPy per step; per-step host work is binding the new row and a growing mask view.
- `SimpleDecoder`: growing caches fed back through NumPy; the plain path the bound one is tested against.
"""

from __future__ import annotations

import numpy as np

PAST, PRESENT = "past_key_values.", "present."


def _check(hidden: np.ndarray) -> np.ndarray:
    if not np.isfinite(hidden).all():
        raise FloatingPointError("llm_decoder produced NaN/Inf hidden states")
    if not np.any(hidden):
        raise FloatingPointError("llm_decoder produced all-zero hidden states (a broken attention kernel for this "
                                 "provider/precision?)")
    return hidden.astype(np.float32, copy=False)


class SimpleDecoder:
    """Growing caches fed back through NumPy (copies the whole cache every step)."""

    def __init__(self, part, facts):
        self.part, self.facts = part, facts
        self.past = [n for n in part.input_types if n.startswith(PAST)]

    def prefill(self, embeds: np.ndarray, max_len: int | None = None) -> np.ndarray:
        """(S, D) -> (S, D) hidden states; starts a new sequence."""
        f = self.facts
        self.cache = {n: np.zeros((1, f.kv_heads, 0, f.head_dim), self.part.input_types[n]) for n in self.past}
        self.length = 0
        return self._run(embeds)

    def step(self, embeds: np.ndarray) -> np.ndarray:
        return self._run(embeds)

    def snapshot(self) -> dict[str, np.ndarray]:
        return {n: c.copy() for n, c in self.cache.items()}

    def prefill_cached(self, state: dict[str, np.ndarray], embeds: np.ndarray, max_len: int | None = None):
        self.cache = {n: c.copy() for n, c in state.items()}
        self.length = next(iter(state.values())).shape[2]
        return self._run(embeds)

    def _run(self, embeds: np.ndarray) -> np.ndarray:
        self.length += len(embeds)
        outs = self.part(inputs_embeds=embeds[None], attention_mask=np.ones((1, self.length), np.int64), **self.cache)
        for n in self.past:
            self.cache[n] = outs[n.replace(PAST, PRESENT)]
        return _check(outs["hidden_states"][0])


class BoundDecoder:
    """Shared past/present buffers through IOBinding: no per-step cache copies or cache-sized allocations."""

    def __init__(self, part, facts, device: str = "cpu"):
        self.part, self.facts, self.device = part, facts, device
        self.session = part.session
        self.past = [n for n in part.input_types if n.startswith(PAST)]
        self.embed_dtype = part.input_types["inputs_embeds"]
        self.capacity = 0

    def _allocate(self, max_len: int) -> None:
        import onnxruntime as ort

        f = self.facts
        # NumPy arrays wrapped without a copy: ORT writes into them, snapshot/restore read and write them
        self.arrays = {n: np.zeros((1, f.kv_heads, max_len, f.head_dim), self.part.input_types[n]) for n in self.past}
        self.buffers = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in self.arrays.items()}
        self.mask = np.ones((1, max_len), np.int64)
        self.capacity = max_len

    def _bind(self, max_len: int, length: int) -> None:
        if max_len > self.capacity:
            self._allocate(max_len)
        self.io = self.session.io_binding()
        for n, buf in self.buffers.items():
            self.io.bind_ortvalue_input(n, buf)
            self.io.bind_ortvalue_output(n.replace(PAST, PRESENT), buf)
        self.length = length

    def prefill(self, embeds: np.ndarray, max_len: int) -> np.ndarray:
        """(S, D) -> (S, D); `max_len` bounds prompt + generated rows (sizes the buffers, reused when big enough)."""
        self._bind(max_len, 0)
        return self._run(embeds)

    def snapshot(self) -> dict[str, np.ndarray]:
        """A copy of the cache rows written so far: the reusable prefill state of a prompt prefix."""
        return {n: a[:, :, :self.length].copy() for n, a in self.arrays.items()}

    def prefill_cached(self, state: dict[str, np.ndarray], embeds: np.ndarray, max_len: int) -> np.ndarray:
        """Continue from a `snapshot` (a cached prefix): (S, D) new positions -> (S, D) hidden states."""
        length = next(iter(state.values())).shape[2]
        self._bind(max_len, length)
        for n, a in state.items():
            self.arrays[n][:, :, :length] = a
        return self._run(embeds)

    def step(self, embeds: np.ndarray) -> np.ndarray:
        return self._run(embeds)

    def _run(self, embeds: np.ndarray) -> np.ndarray:
        self.length += len(embeds)
        if self.length > self.capacity:
            raise ValueError(f"sequence of {self.length} positions exceeds the KV buffer of {self.capacity}")
        self.io.bind_cpu_input("inputs_embeds", np.ascontiguousarray(embeds[None], self.embed_dtype))
        self.io.bind_cpu_input("attention_mask", self.mask[:, :self.length])
        out = self._hidden_out(len(embeds))
        self.io.bind_ortvalue_output("hidden_states", out)
        self.session.run_with_iobinding(self.io)
        return _check(out.numpy()[0])  # only the new rows' hidden states cross to NumPy, never the cache

    def _hidden_out(self, rows: int):
        import onnxruntime as ort

        if rows != 1:  # prefill: a one-off buffer
            return ort.OrtValue.ortvalue_from_shape_and_type((1, rows, self.facts.hidden), self.embed_dtype, "cpu")
        if getattr(self, "_step_out", None) is None:
            self._step_out = ort.OrtValue.ortvalue_from_shape_and_type((1, 1, self.facts.hidden), self.embed_dtype,
                                                                       "cpu")
        return self._step_out
