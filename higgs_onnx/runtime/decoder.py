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

    def pool(self, slots: int, max_len: int) -> SlotPool:
        """KV buffers for `slots` requests decoded together (continuous batching, see `SlotPool`)."""
        return SlotPool(self, slots, max_len)

    def run(self, cache: BoundCache | Slot, embeds: np.ndarray) -> np.ndarray:
        """(S, D) new positions appended to `cache` -> (S, D) hidden states."""
        import onnxruntime as ort

        if isinstance(cache, Slot):
            return cache.pool.run_one(cache, embeds)

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


class Slot:
    """One request's rows in a `SlotPool`: the cache handle the engine keeps in `Request.cache`."""

    def __init__(self, pool: SlotPool, index: int):
        self.pool, self.index = pool, index

    @property
    def length(self) -> int:
        return self.pool.lengths[self.index]

    def free(self) -> None:
        """Give the slot back (idempotent); its rows are overwritten by the next request's prefill."""
        if self.pool is not None:
            self.pool.release(self.index)
            self.pool = None


class SlotPool:
    """KV buffers for up to `slots` requests decoded together: one (slots, KV heads, max_len, head dim) array per
    layer and key/value, bound as both past and present (toolchain §9).

    A request is prefilled alone into its slot through the contiguous view `buf[i:i+1]`; a batched step runs rows
    0..hi (hi = the highest slot stepped) with an attention mask whose row b holds `length_b + 1` leading ones (right
    padding): GroupQueryAttention takes each row's position and write offset from its mask sum, so every row attends
    to its own positions only. A row that is not stepped (a free slot, a hole between slots) rides along: it writes
    one position past its length, which its own next step (or the next prefill of the slot) overwrites first.
    Used by one thread at a time (the scheduler's engine thread).
    """

    def __init__(self, decoder: BoundDecoder, slots: int, max_len: int):
        import onnxruntime as ort

        if slots < 1:
            raise ValueError(f"a slot pool needs >= 1 slot, got {slots}")
        f, self.decoder = decoder.facts, decoder
        self.session, self.embed_dtype, self.hidden = decoder.session, decoder.embed_dtype, f.hidden
        self.slots, self.capacity = slots, max_len
        # np.zeros maps pages lazily: only positions a request writes cost memory
        self.arrays = {n: np.zeros((slots, f.kv_heads, max_len, f.head_dim), decoder.part.input_types[n])
                       for n in decoder.past}
        self.lengths = [0] * slots
        self.free_slots = list(range(slots))
        self.mask = np.ones((slots, max_len), np.int64)
        self._ort = ort
        self._views: dict[tuple[int, int], tuple] = {}  # (first row, rows) -> (IOBinding, step output)

    def acquire(self, capacity: int, state: dict[str, np.ndarray] | None = None) -> Slot:
        """A free slot for a request of up to `capacity` positions, empty or holding a voice's saved prefix."""
        if capacity > self.capacity:
            raise ValueError(f"a request of {capacity} positions does not fit the pool's {self.capacity}")
        if not self.free_slots:
            raise RuntimeError(f"all {self.slots} slots are in use")
        i = self.free_slots.pop(0)
        length = 0
        if state is not None:
            length = next(iter(state.values())).shape[2]
            for n, a in self.arrays.items():
                a[i, :, :length] = state[n][0]
        self.lengths[i] = length
        return Slot(self, i)

    def release(self, index: int) -> None:
        if index not in self.free_slots:
            self.lengths[index] = 0
            self.free_slots.append(index)
            self.free_slots.sort()

    @property
    def in_use(self) -> int:
        return self.slots - len(self.free_slots)

    def _binding(self, first: int, rows: int):
        key = (first, rows)
        if key not in self._views:
            io = self.session.io_binding()
            for n, a in self.arrays.items():  # a contiguous view: ORT reads and writes the pool's memory
                buf = self._ort.OrtValue.ortvalue_from_numpy(a[first:first + rows])
                io.bind_ortvalue_input(n, buf)
                io.bind_ortvalue_output(n.replace(PAST, PRESENT), buf)
            out = self._ort.OrtValue.ortvalue_from_shape_and_type((rows, 1, self.hidden), self.embed_dtype, "cpu")
            self._views[key] = (io, out)
        return self._views[key]

    def run_one(self, slot: Slot, embeds: np.ndarray) -> np.ndarray:
        """(S, D) new positions of one slot (a prefill, or a lone step) -> (S, D) hidden states."""
        i, start = slot.index, self.lengths[slot.index]
        if start + len(embeds) > self.capacity:
            raise ValueError(f"sequence of {start + len(embeds)} positions exceeds the KV buffer of {self.capacity}")
        io, step_out = self._binding(i, 1)
        io.bind_cpu_input("inputs_embeds", np.ascontiguousarray(embeds[None], self.embed_dtype))
        io.bind_cpu_input("attention_mask", self.mask[:1, :start + len(embeds)])
        out = step_out if len(embeds) == 1 else self._ort.OrtValue.ortvalue_from_shape_and_type(
            (1, len(embeds), self.hidden), self.embed_dtype, "cpu")
        io.bind_ortvalue_output("hidden_states", out)
        self.session.run_with_iobinding(io)
        self.lengths[i] = start + len(embeds)
        return _check(out.numpy()[0])

    def run_batch(self, slots: list[Slot], embeds: np.ndarray) -> np.ndarray:
        """One decode step of several slots in one call: (B, D) next inputs -> (B, D) hidden states."""
        idx = [s.index for s in slots]
        rows = max(idx) + 1
        for i in idx:
            if self.lengths[i] + 1 > self.capacity:
                raise ValueError(f"sequence of {self.lengths[i] + 1} positions exceeds the KV buffer of "
                                 f"{self.capacity}")
        feed = np.zeros((rows, 1, self.hidden), self.embed_dtype)
        feed[idx, 0] = embeds
        lengths = np.asarray(self.lengths[:rows])
        mask = (np.arange(lengths.max() + 1)[None] <= lengths[:, None]).astype(np.int64)  # length + 1 ones per row
        io, out = self._binding(0, rows)
        io.bind_cpu_input("inputs_embeds", feed)
        io.bind_cpu_input("attention_mask", mask)
        io.bind_ortvalue_output("hidden_states", out)
        self.session.run_with_iobinding(io)
        for i in idx:
            self.lengths[i] += 1
        hidden = out.numpy()[idx, 0]
        return _check(hidden)
