"""The exported Qwen3 decoder with its KV cache.

Positions come from `attention_mask` (no position_ids in the cpu graph, toolchain G10); past/present names and
shapes are read from the session and the model facts, never hard-coded. Feeds take the dtypes the graph declares
(an fp16 decoder gets fp16 embeddings and cache).

- `BoundDecoder` (ModelBuilder's GQA graph, "shared-buffer" cache; the default): one preallocated buffer per layer
  and key/value, bound through IOBinding as both `past_key_values.{i}.*` and `present.{i}.*`; GroupQueryAttention
  writes the new rows in place (toolchain §8). The buffers live where the decoder runs (`providers.Provider.memory`):
  NumPy-backed host memory on the CPU (zero-copy), `OrtValue`s in device memory on cuda/dml, so a GPU step never
  moves the cache across the bus; only the new row's embedding goes in and its hidden state comes out.
- `ConcatDecoder` (the portable graph, "concat" cache): present = past + the new rows; the presents stay
  `OrtValue`s on the provider's device and are bound as the next step's past (no NumPy round trip).
- `SimpleDecoder`: growing caches fed back through NumPy; the plain path the others are tested against, and the
  one the OpenVINO runtime drives.
- `SerialPool`: the batching interface (`acquire`, `run_batch`) for decoders without a batched graph path: rows
  are stepped one after another.
"""

from __future__ import annotations

import numpy as np

from .. import providers

PAST, PRESENT = "past_key_values.", "present."


def _check(hidden: np.ndarray) -> np.ndarray:
    if not np.isfinite(hidden).all():
        raise FloatingPointError("llm_decoder produced NaN/Inf hidden states")
    if not np.any(hidden):
        raise FloatingPointError("llm_decoder produced all-zero hidden states (a broken attention kernel for this "
                                 "provider/precision?)")
    return hidden.astype(np.float32, copy=False)


def _check_truncate(length: int, to: int) -> None:
    if not 0 <= to <= length:
        raise ValueError(f"cannot truncate a cache of {length} positions to {to}")


class _Pooled:
    """A cache that a `SerialPool` may hand out as a slot: `free()` gives it back."""

    pool = None

    def free(self) -> None:
        if self.pool is not None:
            self.pool.release(self)
            self.pool = None


class SimpleCache(_Pooled):
    """One request's growing cache (NumPy arrays per past input)."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays
        self.length = next(iter(arrays.values())).shape[2]

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (a retried turn of a continued cache)."""
        _check_truncate(self.length, length)
        self.arrays = {n: a[:, :, :length].copy() for n, a in self.arrays.items()}
        self.length = length


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

    def pool(self, slots: int, max_len: int) -> SerialPool:
        return SerialPool(self, slots, max_len)

    def run(self, cache: SimpleCache, embeds: np.ndarray) -> np.ndarray:
        """(S, D) new positions appended to `cache` -> (S, D) hidden states."""
        cache.length += len(embeds)
        outs = self.part(inputs_embeds=embeds[None], attention_mask=np.ones((1, cache.length), np.int64),
                         **cache.arrays)
        for n in self.past:
            cache.arrays[n] = outs[n.replace(PAST, PRESENT)]
        return _check(outs["hidden_states"][0])


class DeviceCopy:
    """Writes host arrays into device buffers at a byte offset, through an Identity graph whose output is bound
    to the destination (ONNX Runtime's Python API has no memcpy into a slice of an `OrtValue`). Used to put a saved
    prompt prefix into a device-resident cache; one run per (layer, KV head) of the prefix, once per request."""

    def __init__(self, provider_ort: list[str], memory: str):
        import onnx
        import onnxruntime as ort
        from onnx import helper

        self.memory, self._sessions, self._ort = memory, {}, ort
        self._providers, self._onnx, self._helper = provider_ort, onnx, helper

    def _session(self, dtype):
        key = np.dtype(dtype)
        if key not in self._sessions:
            h = self._helper
            elem = h.np_dtype_to_tensor_dtype(key)
            graph = h.make_graph([h.make_node("Identity", ["x"], ["y"])], "copy",
                                 [h.make_tensor_value_info("x", elem, ["n"])],
                                 [h.make_tensor_value_info("y", elem, ["n"])])
            model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=10)
            self._sessions[key] = self._ort.InferenceSession(model.SerializeToString(), providers=self._providers)
        return self._sessions[key]

    def write(self, dst_ptr: int, src: np.ndarray) -> None:
        """Copy the contiguous `src` to the device address `dst_ptr` (as one flat run of elements)."""
        src = np.ascontiguousarray(src).reshape(-1)
        sess = self._session(src.dtype)
        io = sess.io_binding()
        io.bind_cpu_input("x", src)
        io.bind_output("y", self.memory, 0, src.dtype, [src.size], dst_ptr)
        sess.run_with_iobinding(io)


def _write_rows(copy: DeviceCopy, buf, index: int, rows: np.ndarray) -> None:
    """Put `rows` (KV heads, L, head dim) at positions [0, L) of slot `index` of a device buffer
    (slots, KV heads, capacity, head dim): one contiguous run per KV head."""
    _, heads, capacity, hd = buf.shape()
    item = np.dtype(rows.dtype).itemsize
    base = buf.data_ptr() + index * heads * capacity * hd * item
    for h in range(heads):
        copy.write(base + h * capacity * hd * item, rows[h])


class BoundCache:
    """One request's KV buffers: one (1, KV heads, max_len, head dim) buffer per layer and key/value, bound as both
    past and present, plus its own IOBinding and step output. Host memory: NumPy arrays wrapped without a copy as
    `OrtValue`s; device memory: `OrtValue`s allocated on the device (`arrays` is then None)."""

    def __init__(self, session, buffers: dict, embed_dtype, hidden: int, memory: str = "cpu",
                 arrays: dict[str, np.ndarray] | None = None):
        import onnxruntime as ort

        self.arrays = arrays  # host memory: ORT writes the new rows into these in place
        self.buffers, self.memory = buffers, memory
        self.capacity = next(iter(buffers.values())).shape()[2]
        self.mask = np.ones((1, self.capacity), np.int64)
        self.length = 0
        self.io = session.io_binding()
        for n, buf in self.buffers.items():
            self.io.bind_ortvalue_input(n, buf)
            self.io.bind_ortvalue_output(n.replace(PAST, PRESENT), buf)
        self.step_out = ort.OrtValue.ortvalue_from_shape_and_type((1, 1, hidden), embed_dtype, memory, 0)

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on: the next run overwrites them (GQA reads only [0, length))."""
        _check_truncate(self.length, length)
        self.length = length


class BoundDecoder:
    """Past/present buffers shared through IOBinding: no per-step cache copies or cache-sized allocations.

    Every request gets its own `BoundCache` (`new_cache`), so requests in flight together never touch each other's
    rows; the decoder itself keeps nothing between calls (ORT sessions allow concurrent `run` calls).
    """

    def __init__(self, part, facts, memory: str = "cpu", offset_binding: bool = True, device_resident: bool = False):
        """`memory`: where the buffers live (`providers.Provider.memory`). On "cpu" they are NumPy-backed unless
        `device_resident` asks for ORT-allocated `OrtValue`s as on a GPU (the same code path, testable here)."""
        self.part, self.facts, self.memory = part, facts, memory
        self.host = memory == providers.HOST_MEMORY and not device_resident
        self.offset_binding = offset_binding
        self.session = part.session
        self.past = [n for n in part.input_types if n.startswith(PAST)]
        self.embed_dtype = part.input_types["inputs_embeds"]
        self._copy: DeviceCopy | None = None

    @property
    def copier(self) -> DeviceCopy:
        if self._copy is None:
            self._copy = DeviceCopy(self.session.get_providers(), self.memory)
        return self._copy

    def allocate(self, shape: tuple, name: str):
        """One KV buffer: (host array or None, OrtValue). np.zeros maps untouched pages lazily, so only the
        positions written cost memory; device buffers are left uninitialised (GQA reads only written rows)."""
        import onnxruntime as ort

        dtype = self.part.input_types[name]
        if self.host:
            a = np.zeros(shape, dtype)
            return a, ort.OrtValue.ortvalue_from_numpy(a)
        return None, ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, self.memory, 0)

    def new_cache(self, max_len: int, state: dict[str, np.ndarray] | None = None) -> BoundCache:
        """Buffers for `max_len` positions (prompt + generated rows), empty or holding a `snapshot`'s prefix."""
        f = self.facts
        length = 0 if state is None else next(iter(state.values())).shape[2]
        if length > max_len:
            raise ValueError(f"a saved prefix of {length} positions does not fit a cache of {max_len}")
        made = {n: self.allocate((1, f.kv_heads, max_len, f.head_dim), n) for n in self.past}
        buffers = {n: v for n, (_, v) in made.items()}
        arrays = {n: a for n, (a, _) in made.items()} if self.host else None
        if state is not None:
            for n in self.past:
                rows = np.asarray(state[n][0], self.part.input_types[n])
                if self.host:
                    arrays[n][0, :, :length] = rows
                else:
                    _write_rows(self.copier, buffers[n], 0, rows)
        cache = BoundCache(self.session, buffers, self.embed_dtype, f.hidden, self.memory, arrays)
        cache.length = length
        return cache

    def snapshot(self, cache: BoundCache) -> dict[str, np.ndarray]:
        """A copy of the cache rows written so far: the reusable prefill state of a prompt prefix."""
        if cache.arrays is None:  # device memory: one copy of each buffer to the host
            return {n: b.numpy()[:, :, :cache.length].copy() for n, b in cache.buffers.items()}
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
                                                            self.memory, 0)
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

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def truncate(self, length: int) -> None:
        """Forget every position of this slot from `length` on (the next run overwrites them)."""
        _check_truncate(self.length, length)
        self.pool.lengths[self.index] = length

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
        if slots > 1 and not decoder.offset_binding:
            raise ValueError(f"batched decoding with {slots} slots needs KV buffers bound at an offset, which "
                             f"{decoder.memory} memory does not allow; use one slot (--max-batch 1)")
        f, self.decoder = decoder.facts, decoder
        self.session, self.embed_dtype, self.hidden = decoder.session, decoder.embed_dtype, f.hidden
        self.slots, self.capacity, self.memory = slots, max_len, decoder.memory
        made = {n: decoder.allocate((slots, f.kv_heads, max_len, f.head_dim), n) for n in decoder.past}
        self.buffers = {n: v for n, (_, v) in made.items()}
        self.arrays = {n: a for n, (a, _) in made.items()} if decoder.host else None
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
            for n, buf in self.buffers.items():
                rows = np.asarray(state[n][0], self.decoder.part.input_types[n])
                if self.arrays is not None:
                    self.arrays[n][i, :, :length] = rows
                else:
                    _write_rows(self.decoder.copier, buf, i, rows)
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
            for n, buf in self.buffers.items():  # a contiguous view: ORT reads and writes the pool's memory
                present = n.replace(PAST, PRESENT)
                if (first, rows) == (0, self.slots):
                    io.bind_ortvalue_input(n, buf)
                    io.bind_ortvalue_output(present, buf)
                    continue
                shape = buf.shape()
                dtype = self.decoder.part.input_types[n]
                ptr = buf.data_ptr() + first * int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
                view = [rows, *shape[1:]]
                io.bind_input(n, self.memory, 0, dtype, view, ptr)
                io.bind_output(present, self.memory, 0, dtype, view, ptr)
            out = self._ort.OrtValue.ortvalue_from_shape_and_type((rows, 1, self.hidden), self.embed_dtype,
                                                                  self.memory, 0)
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
            (1, len(embeds), self.hidden), self.embed_dtype, self.memory, 0)
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


class ConcatCache(_Pooled):
    """One request's growing cache for the portable graph: the last presents, kept as `OrtValue`s where the
    decoder runs, bound as the next step's past."""

    def __init__(self, values: dict, length: int, capacity: int):
        self.values, self.length, self.capacity = values, length, capacity

    def truncate(self, length: int) -> None:
        import onnxruntime as ort

        _check_truncate(self.length, length)
        if length < self.length:  # a rare retry: one copy through the host
            self.values = {n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, :length]),
                                                               v.device_name(), 0) for n, v in self.values.items()}
        self.length = length


class ConcatDecoder:
    """The portable decoder ("concat" cache): present = past + the new rows, a new tensor every step. The presents
    never cross to NumPy: ORT allocates them on the provider's device and they are bound as the next past; only
    the new rows' hidden states come back. Each step copies the cache once inside the graph (its Concat), the
    price of standard ops; the GQA graph writes in place instead."""

    def __init__(self, part, facts, memory: str = "cpu"):
        self.part, self.facts, self.memory = part, facts, memory
        self.session = part.session
        self.past = [n for n in part.input_types if n.startswith(PAST)]
        self.embed_dtype = part.input_types["inputs_embeds"]
        self.outputs = part.output_names

    def new_cache(self, max_len: int, state: dict[str, np.ndarray] | None = None) -> ConcatCache:
        import onnxruntime as ort

        f = self.facts
        arrays = {n: (np.zeros((1, f.kv_heads, 0, f.head_dim)) if state is None else state[n]) for n in self.past}
        values = {n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a, self.part.input_types[n]), self.memory, 0)
                  for n, a in arrays.items()}
        length = next(iter(arrays.values())).shape[2]
        if length > max_len:
            raise ValueError(f"a saved prefix of {length} positions does not fit a cache of {max_len}")
        return ConcatCache(values, length, max_len)

    def snapshot(self, cache: ConcatCache) -> dict[str, np.ndarray]:
        return {n: v.numpy() for n, v in cache.values.items()}

    def pool(self, slots: int, max_len: int) -> SerialPool:
        return SerialPool(self, slots, max_len)

    def run(self, cache: ConcatCache, embeds: np.ndarray) -> np.ndarray:
        """(S, D) new positions appended to `cache` -> (S, D) hidden states."""
        if cache.length + len(embeds) > cache.capacity:
            raise ValueError(f"sequence of {cache.length + len(embeds)} positions exceeds the cache of "
                             f"{cache.capacity}")
        io = self.session.io_binding()
        io.bind_cpu_input("inputs_embeds", np.ascontiguousarray(embeds[None], self.embed_dtype))
        io.bind_cpu_input("attention_mask", np.ones((1, cache.length + len(embeds)), np.int64))
        for n, v in cache.values.items():
            io.bind_ortvalue_input(n, v)
        for name in self.outputs:
            io.bind_output(name, self.memory, 0)
        self.session.run_with_iobinding(io)
        outs = dict(zip(self.outputs, io.get_outputs(), strict=True))
        cache.values = {n: outs[n.replace(PAST, PRESENT)] for n in self.past}
        cache.length += len(embeds)
        return _check(outs["hidden_states"].numpy()[0])


class SerialPool:
    """The batching interface over a decoder without a batched cache (`ConcatDecoder`, `SimpleDecoder`): each slot
    is an ordinary cache of its own and a batched step runs the rows one after another. Correct everywhere; the
    speed of batching needs the GQA graph's `SlotPool`."""

    def __init__(self, decoder, slots: int, max_len: int):
        if slots < 1:
            raise ValueError(f"a slot pool needs >= 1 slot, got {slots}")
        self.decoder, self.slots, self.capacity = decoder, slots, max_len
        self.taken: list = []

    def acquire(self, capacity: int, state: dict[str, np.ndarray] | None = None):
        if capacity > self.capacity:
            raise ValueError(f"a request of {capacity} positions does not fit the pool's {self.capacity}")
        if len(self.taken) >= self.slots:
            raise RuntimeError(f"all {self.slots} slots are in use")
        cache = self.decoder.new_cache(capacity, state)
        cache.pool = self
        self.taken.append(cache)
        return cache

    def release(self, cache) -> None:
        if cache in self.taken:
            self.taken.remove(cache)

    @property
    def in_use(self) -> int:
        return len(self.taken)

    def run_batch(self, caches: list, embeds: np.ndarray) -> np.ndarray:
        return np.stack([self.decoder.run(c, embeds[i:i + 1])[-1] for i, c in enumerate(caches)])
