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


class SimpleCache:
    """One request's growing cache (NumPy arrays per past input)."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays
        self.length = next(iter(arrays.values())).shape[2]


class SimpleDecoder:
    """Growing caches fed back through NumPy (copies the whole cache every step)."""

    def __init__(self, part, facts):
        self.part, self.facts = part, facts
        self.past = [n for n in part.input_types if n.startswith(PAST)]

    def new_cache(self, max_len: int, state: dict[str, np.ndarray] | None = None) -> SimpleCache:
        """An empty cache, or a copy of a `snapshot` (a cached prompt prefix); `max_len` is not needed here."""
        f = self.facts
        if state is None:
            return SimpleCache({n: np.zeros((1, f.kv_heads, 0, f.head_dim), self.part.input_types[n])
                                for n in self.past})
        return SimpleCache({n: np.array(state[n], self.part.input_types[n]) for n in self.past})

    def snapshot(self, cache: SimpleCache) -> dict[str, np.ndarray]:
        return {n: c.copy() for n, c in cache.arrays.items()}

    def run(self, cache: SimpleCache, embeds: np.ndarray) -> np.ndarray:
        """(S, D) new positions appended to `cache` -> (S, D) hidden states."""
        cache.length += len(embeds)
        outs = self.part(inputs_embeds=embeds[None], attention_mask=np.ones((1, cache.length), np.int64),
                         **cache.arrays)
        for n in self.past:
            cache.arrays[n] = outs[n.replace(PAST, PRESENT)]
        return _check(outs["hidden_states"][0])


class BoundCache:
    """One request's KV buffers: one (1, KV heads, max_len, head dim) array per layer and key/value, wrapped
    without a copy as the `OrtValue` bound as both past and present, plus its own IOBinding and step output."""

    def __init__(self, session, arrays: dict[str, np.ndarray], embed_dtype, hidden: int):
        import onnxruntime as ort

        self.arrays = arrays  # ORT writes the new rows into these in place
        self.buffers = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in arrays.items()}
        self.capacity = next(iter(arrays.values())).shape[2]
        self.mask = np.ones((1, self.capacity), np.int64)
        self.length = 0
        self.io = session.io_binding()
        for n, buf in self.buffers.items():
            self.io.bind_ortvalue_input(n, buf)
            self.io.bind_ortvalue_output(n.replace(PAST, PRESENT), buf)
        self.step_out = ort.OrtValue.ortvalue_from_shape_and_type((1, 1, hidden), embed_dtype, "cpu")


class BoundDecoder:
    """Past/present buffers shared through IOBinding: no per-step cache copies or cache-sized allocations.

    Every request gets its own `BoundCache` (`new_cache`), so requests in flight together never touch each other's
    rows; the decoder itself keeps nothing between calls (ORT sessions allow concurrent `run` calls).
    """

    def __init__(self, part, facts, device: str = "cpu"):
        self.part, self.facts, self.device = part, facts, device
        self.session = part.session
        self.past = [n for n in part.input_types if n.startswith(PAST)]
        self.embed_dtype = part.input_types["inputs_embeds"]

    def new_cache(self, max_len: int, state: dict[str, np.ndarray] | None = None) -> BoundCache:
        """Buffers for `max_len` positions (prompt + generated rows), empty or holding a `snapshot`'s prefix.
        np.zeros maps untouched pages lazily, so only the positions written cost memory."""
        f = self.facts
        length = 0 if state is None else next(iter(state.values())).shape[2]
        if length > max_len:
            raise ValueError(f"a saved prefix of {length} positions does not fit a cache of {max_len}")
        arrays = {n: np.zeros((1, f.kv_heads, max_len, f.head_dim), self.part.input_types[n]) for n in self.past}
        if state is not None:
            for n, a in arrays.items():
                a[:, :, :length] = state[n]
        cache = BoundCache(self.session, arrays, self.embed_dtype, f.hidden)
        cache.length = length
        return cache

    def snapshot(self, cache: BoundCache) -> dict[str, np.ndarray]:
        """A copy of the cache rows written so far: the reusable prefill state of a prompt prefix."""
        return {n: a[:, :, :cache.length].copy() for n, a in cache.arrays.items()}

    def run(self, cache: BoundCache, embeds: np.ndarray) -> np.ndarray:
        """(S, D) new positions appended to `cache` -> (S, D) hidden states."""
        import onnxruntime as ort

        if cache.length + len(embeds) > cache.capacity:
            raise ValueError(f"sequence of {cache.length + len(embeds)} positions exceeds the KV buffer of "
                             f"{cache.capacity}")
        cache.length += len(embeds)
        io = cache.io
        io.bind_cpu_input("inputs_embeds", np.ascontiguousarray(embeds[None], self.embed_dtype))
        io.bind_cpu_input("attention_mask", cache.mask[:, :cache.length])
        if len(embeds) == 1:
            out = cache.step_out
        else:  # prefill: a one-off buffer
            out = ort.OrtValue.ortvalue_from_shape_and_type((1, len(embeds), self.facts.hidden), self.embed_dtype,
                                                            "cpu")
        io.bind_ortvalue_output("hidden_states", out)
        self.session.run_with_iobinding(io)
        return _check(out.numpy()[0])  # only the new rows' hidden states cross to NumPy, never the cache
