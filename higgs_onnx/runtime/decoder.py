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
- `SimpleDecoder`: growing caches fed back through NumPy; the plain path the others are tested against (and the
  OpenVINO runtime's with `kv_cache="host"`).
- `StatefulDecoder` (the OpenVINO runtime): the cache is the state of an infer request of a stateful compiled model
  (`OvPart(stateful=True)`), one request per cache; only the new rows' embeddings go in and hidden states come out.
- `SerialPool`: the batching interface (`acquire`, `run_batch`) for decoders without a batched graph path: rows
  are stepped one after another.

Each takes the decoder graph or the step graph (`parts/llm_step.py`: the audio embedding, the decoder and the audio
heads in one graph, which prefills too). With the step graph, `step(cache, codes)` / `step_batch(slots, codes)` run a
decode step in one call, codes in and (hidden, logits) out; `run(cache, embeds)` prefills as on the plain decoder
(no codes), so every other user of the decoder is unchanged.
"""

from __future__ import annotations

import numpy as np

from .. import providers

PAST, PRESENT = "past_key_values.", "present."
EMBEDS, CODES, HIDDEN, LOGITS = "inputs_embeds", "audio_codes", "hidden_states", "logits"


class _Graph:
    """What the decoder classes read from the graph they drive: its past inputs, the embedding dtype, and whether it
    is the step graph (codes in, logits out) with the shapes of its new-position inputs."""

    def _graph(self, part, facts) -> None:
        self.past = [n for n in part.input_types if n.startswith(PAST)]
        self.embed_dtype = part.input_types[EMBEDS]
        self.fused = CODES in part.input_types  # the step graph (parts/llm_step.py)
        self.logits_shape = (facts.num_codebooks, facts.codebook_vocab)
        self.logits_dtype = getattr(part, "output_types", {}).get(LOGITS, np.float32)

    def new_positions(self, embeds: np.ndarray | None, codes: np.ndarray | None, rows: int = 1) -> dict:
        """The feeds of the new positions: `embeds` (S, D) of one row or (B, S, D) of B rows, or (step graph)
        `codes` (B, N), one position of each of B rows; the other input is empty."""
        if codes is None:
            x = np.ascontiguousarray(embeds if embeds.ndim == 3 else embeds[None], self.embed_dtype)
            feeds = {EMBEDS: x}
            if self.fused:
                feeds[CODES] = np.zeros((len(x), 0, self.facts.num_codebooks), np.int64)
            return feeds
        if not self.fused:
            raise RuntimeError("decode steps from codes need the step graph (llm_step)")
        return {EMBEDS: np.zeros((rows, 0, self.facts.hidden), self.embed_dtype),
                CODES: np.ascontiguousarray(np.asarray(codes, np.int64).reshape(rows, 1, -1))}

    # a decoder class gives `_run(cache, embeds, codes) -> (hidden (S, D), logits (N, V) or None)`
    def run(self, cache, embeds: np.ndarray) -> np.ndarray:
        """(S, D) new positions appended to `cache` -> (S, D) hidden states."""
        return self._run(cache, embeds, None)[0]

    def step(self, cache, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(step graph) one row of (N,) codes appended -> its (D,) hidden state and (N, V) logits, in one call."""
        hidden, logits = self._run(cache, None, codes)
        return hidden[-1], logits

    def pool(self, slots: int, max_len: int) -> SerialPool:
        """Slots stepped one after another (a decoder without a batched cache)."""
        return SerialPool(self, slots, max_len)


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


class SimpleDecoder(_Graph):
    """Growing caches fed back through NumPy (copies the whole cache every step)."""

    def __init__(self, part, facts):
        self.part, self.facts = part, facts
        self._graph(part, facts)

    def new_cache(self, max_len: int, state: dict[str, np.ndarray] | None = None) -> SimpleCache:
        """An empty cache, or a copy of a `snapshot` (a cached prompt prefix); `max_len` is not needed here."""
        f = self.facts
        if state is None:
            return SimpleCache({n: np.zeros((1, f.kv_heads, 0, f.head_dim), self.part.input_types[n])
                                for n in self.past})
        return SimpleCache({n: np.array(state[n], self.part.input_types[n]) for n in self.past})

    def snapshot(self, cache: SimpleCache) -> dict[str, np.ndarray]:
        return {n: c.copy() for n, c in cache.arrays.items()}

    def _run(self, cache: SimpleCache, embeds, codes):
        cache.length += 1 if embeds is None else len(embeds)
        outs = self.part(**self.new_positions(embeds, codes), attention_mask=np.ones((1, cache.length), np.int64),
                         **cache.arrays)
        for n in self.past:
            cache.arrays[n] = outs[n.replace(PAST, PRESENT)]
        logits = outs[LOGITS][0, -1].astype(np.float32, copy=False) if self.fused else None
        return _check(outs[HIDDEN][0]), logits


class StatefulCache(_Pooled):
    """One request's cache held as the state of its own OpenVINO infer request (`runtime.openvino.OvState`)."""

    def __init__(self, state, length: int, capacity: int):
        self.state, self.length, self.capacity = state, length, capacity

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (a rare retry: the states are read, cut and written back)."""
        _check_truncate(self.length, length)
        if length < self.length:
            self.state.write(self.state.read(length))
        self.length = length


class StatefulDecoder(_Graph):
    """The decoder with its KV cache inside the compiled model (OpenVINO's stateful model): no cache crosses to the
    host between steps, unlike `SimpleDecoder`, which feeds the whole cache in and gets it back every call."""

    memory = "state"

    def __init__(self, part, facts):
        self.part, self.facts = part, facts
        self._graph(part, facts)

    def new_cache(self, max_len: int, state: dict[str, np.ndarray] | None = None) -> StatefulCache:
        f = self.facts
        if state is None:
            arrays = {n: np.zeros((1, f.kv_heads, 0, f.head_dim), self.part.input_types[n]) for n in self.past}
        else:
            arrays = {n: state[n] for n in self.past}
        length = next(iter(arrays.values())).shape[2]
        if length > max_len:
            raise ValueError(f"a saved prefix of {length} positions does not fit a cache of {max_len}")
        return StatefulCache(self.part.new_state(arrays), length, max_len)

    def snapshot(self, cache: StatefulCache) -> dict[str, np.ndarray]:
        return cache.state.read(cache.length)

    def _run(self, cache: StatefulCache, embeds, codes):
        new = 1 if embeds is None else len(embeds)
        if cache.length + new > cache.capacity:
            raise ValueError(f"sequence of {cache.length + new} positions exceeds the cache of {cache.capacity}")
        outs = cache.state.infer(**self.new_positions(embeds, codes),
                                 attention_mask=np.ones((1, cache.length + new), np.int64))
        cache.length += new
        logits = outs[LOGITS][0, -1].astype(np.float32, copy=False) if self.fused else None
        return _check(outs[HIDDEN][0]), logits


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
    past and present, plus its own IOBinding and step outputs. Host memory: NumPy arrays wrapped without a copy as
    `OrtValue`s; device memory: `OrtValue`s allocated on the device (`arrays` is then None)."""

    def __init__(self, decoder: BoundDecoder, buffers: dict, arrays: dict[str, np.ndarray] | None = None):
        self.arrays = arrays  # host memory: ORT writes the new rows into these in place
        self.buffers, self.memory = buffers, decoder.memory
        self.capacity = next(iter(buffers.values())).shape()[2]
        self.mask = np.ones((1, self.capacity), np.int64)
        self.length = 0
        self._decoder = decoder
        self._io: dict[bool, object] = {}
        self.io = self.io_for(False)
        self.step_out, self.logits_out = decoder.step_outputs(1)

    def io_for(self, route: bool):
        """The IOBinding of the int4 session or of the route's (made on first use), both over the same buffers."""
        if route not in self._io:
            io = self._decoder.session_for(route).io_binding()
            for n, buf in self.buffers.items():
                io.bind_ortvalue_input(n, buf)
                io.bind_ortvalue_output(n.replace(PAST, PRESENT), buf)
            self._io[route] = io
        return self._io[route]

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on: the next run overwrites them (GQA reads only [0, length))."""
        _check_truncate(self.length, length)
        self.length = length


class BoundDecoder(_Graph):
    """Past/present buffers shared through IOBinding: no per-step cache copies or cache-sized allocations.

    Every request gets its own `BoundCache` (`new_cache`), so requests in flight together never touch each other's
    rows; the decoder itself keeps nothing between calls (ORT sessions allow concurrent `run` calls).

    `route`: the step graph's int8 GEMM twin (`parts/llm_route.py`, a `Part` with the same I/O, or a function of no
    arguments that makes it: then its session is made by the first call that takes the route, so a run whose calls
    all stay on int4 never holds its weights), bound to the same buffers; `policy` (`runtime.route.RoutePolicy`)
    sends each call to it or to `part` by its row count.
    """

    def __init__(self, part, facts, memory: str = "cpu", offset_binding: bool = True, device_resident: bool = False,
                 route=None, policy=None):
        """`memory`: where the buffers live (`providers.Provider.memory`). On "cpu" they are NumPy-backed unless
        `device_resident` asks for ORT-allocated `OrtValue`s as on a GPU (the same code path, testable here)."""
        from .route import NEVER

        self.part, self.facts, self.memory = part, facts, memory
        self.host = memory == providers.HOST_MEMORY and not device_resident
        self.offset_binding = offset_binding
        self.session = part.session
        self._route = route  # the Part, or what makes it (`route`)
        self.has_route = route is not None
        self.policy = policy if route is not None and policy is not None else NEVER
        self.calls = {False: 0, True: 0}  # calls run on int4 / on the route (figures for benchmarks and tests)
        self._graph(part, facts)
        self._copy: DeviceCopy | None = None

    @property
    def route(self):
        """The route's `Part` (None: no route), its session made here on first use when it was given as a function
        (`ModelParts.part` makes it once, under its lock)."""
        if self._route is not None and not hasattr(self._route, "session"):
            self._route = self._route()
        return self._route

    def session_for(self, route: bool):
        """The session a call runs on: the route's or the int4 step graph's (the same buffers bound to either)."""
        return self.route.session if route else self.session

    def routed(self, rows: int, batched: bool) -> bool:
        """Whether a call of `rows` positions (one row) or rows (a batched step) runs on the route; counted."""
        use = self.has_route and self.policy.use(rows, batched)
        self.calls[use] += 1
        return use

    def step_outputs(self, rows: int) -> tuple:
        """Preallocated outputs of a one-position call of `rows` rows: hidden states, and the step graph's logits."""
        import onnxruntime as ort

        hidden = ort.OrtValue.ortvalue_from_shape_and_type((rows, 1, self.facts.hidden), self.embed_dtype,
                                                           self.memory, 0)
        logits = ort.OrtValue.ortvalue_from_shape_and_type((rows, 1, *self.logits_shape), self.logits_dtype,
                                                           self.memory, 0) if self.fused else None
        return hidden, logits

    def bind_call(self, io, feeds: dict, hidden, logits) -> None:
        """Bind one call's new-position inputs and its outputs (the cache is bound already)."""
        for name, value in feeds.items():
            io.bind_cpu_input(name, value)
        io.bind_ortvalue_output(HIDDEN, hidden)
        if logits is not None:
            io.bind_ortvalue_output(LOGITS, logits)

    def prefill_outputs(self, positions: int) -> tuple:
        import onnxruntime as ort

        hidden = ort.OrtValue.ortvalue_from_shape_and_type((1, positions, self.facts.hidden), self.embed_dtype,
                                                           self.memory, 0)
        return hidden, self.step_outputs(1)[1]

    @property
    def copier(self) -> DeviceCopy:
        if self._copy is None:
            self._copy = DeviceCopy(self.session.get_providers(), self.memory)
        return self._copy

    def allocate(self, shape: tuple, name: str):
        """One KV buffer: (host array or None, OrtValue). np.zeros maps untouched pages lazily, so only the
        positions written cost memory. Device buffers are zeroed too (one host-to-device copy when made): CUDA's
        attention reads past the written rows and weighs them by zero, and uninitialised memory holding a NaN turns
        that zero into NaN (NaN hidden states on an H200 with ORT 1.31.1 before this)."""
        import onnxruntime as ort

        dtype = self.part.input_types[name]
        if self.host:
            a = np.zeros(shape, dtype)
            return a, ort.OrtValue.ortvalue_from_numpy(a)
        return None, ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype), self.memory, 0)

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
        cache = BoundCache(self, buffers, arrays)
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
        if isinstance(cache, Slot):
            return cache.pool.run_one(cache, embeds)
        return self._run(cache, embeds, None)[0]

    def step(self, cache: BoundCache | Slot, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(step graph) one row of (N,) codes appended -> its (D,) hidden state and (N, V) logits, in one call."""
        if isinstance(cache, Slot):
            hidden, logits = cache.pool.step_batch([cache], np.asarray(codes)[None])
            return hidden[0], logits[0]
        hidden, logits = self._run(cache, None, codes)
        return hidden[-1], logits

    def _run(self, cache: BoundCache, embeds, codes):
        new = 1 if embeds is None else len(embeds)
        if cache.length + new > cache.capacity:
            raise ValueError(f"sequence of {cache.length + new} positions exceeds the KV buffer of "
                             f"{cache.capacity}")
        cache.length += new
        route = self.routed(new, False)
        io = cache.io_for(route)
        io.bind_cpu_input("attention_mask", cache.mask[:, :cache.length])
        # one position: the cache's own outputs; a prefill: one-off buffers
        hidden, logits = (cache.step_out, cache.logits_out) if new == 1 else self.prefill_outputs(new)
        self.bind_call(io, self.new_positions(embeds, codes), hidden, logits)
        self.session_for(route).run_with_iobinding(io)
        # only the new rows' hidden states (and logits) cross to NumPy, never the cache
        logits = _logits(logits)
        return _check(hidden.numpy()[0]), None if logits is None else logits[0]


def _logits(value) -> np.ndarray | None:
    """(rows, 1, N, V) step-graph logits -> (rows, N, V) float32 (a copy: the buffer is the next call's output);
    None stays None."""
    return None if value is None else np.array(value.numpy()[:, 0], np.float32)


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
        self.fused = decoder.fused
        self.slots, self.capacity, self.memory = slots, max_len, decoder.memory
        made = {n: decoder.allocate((slots, f.kv_heads, max_len, f.head_dim), n) for n in decoder.past}
        self.buffers = {n: v for n, (_, v) in made.items()}
        self.arrays = {n: a for n, (a, _) in made.items()} if decoder.host else None
        self.lengths = [0] * slots
        self.free_slots = list(range(slots))
        self.mask = np.ones((slots, max_len), np.int64)
        self._ort = ort
        self._views: dict[tuple[int, int, bool], tuple] = {}  # (first row, rows, route) -> (IOBinding, step output)

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

    def _binding(self, first: int, rows: int, route: bool = False):
        """(IOBinding of rows [first, first + rows) of every buffer on the int4 session or the route's, its
        one-position outputs)."""
        key = (first, rows, route)
        if key not in self._views:
            io = self.decoder.session_for(route).io_binding()
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
            self._views[key] = (io, self.decoder.step_outputs(rows))
        return self._views[key]

    def run_one(self, slot: Slot, embeds: np.ndarray) -> np.ndarray:
        """(S, D) new positions of one slot (a prefill, or a lone step) -> (S, D) hidden states."""
        i, start = slot.index, self.lengths[slot.index]
        if start + len(embeds) > self.capacity:
            raise ValueError(f"sequence of {start + len(embeds)} positions exceeds the KV buffer of {self.capacity}")
        route = self.decoder.routed(len(embeds), False)
        io, outs = self._binding(i, 1, route)
        io.bind_cpu_input("attention_mask", self.mask[:1, :start + len(embeds)])
        hidden, logits = outs if len(embeds) == 1 else self.decoder.prefill_outputs(len(embeds))
        self.decoder.bind_call(io, self.decoder.new_positions(embeds, None), hidden, logits)
        self.decoder.session_for(route).run_with_iobinding(io)
        self.lengths[i] = start + len(embeds)
        return _check(hidden.numpy()[0])

    def run_batch(self, slots: list[Slot], embeds: np.ndarray) -> np.ndarray:
        """One decode step of several slots in one call: (B, D) next inputs -> (B, D) hidden states."""
        return self._batch(slots, embeds, None)[0]

    def step_batch(self, slots: list[Slot], codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(step graph) one decode step of several slots in one call: (B, N) codes -> (B, D) hidden states and
        (B, N, V) logits."""
        return self._batch(slots, None, codes)

    def _batch(self, slots: list[Slot], embeds, codes):
        idx = [s.index for s in slots]
        rows = max(idx) + 1
        for i in idx:
            if self.lengths[i] + 1 > self.capacity:
                raise ValueError(f"sequence of {self.lengths[i] + 1} positions exceeds the KV buffer of "
                                 f"{self.capacity}")
        if codes is None:
            feed = np.zeros((rows, self.hidden), self.embed_dtype)
            feed[idx] = embeds
            feeds = self.decoder.new_positions(feed[:, None], None)
        else:  # rows between the stepped ones ride along on code 0 (their written position is overwritten later)
            feed = np.zeros((rows, np.shape(codes)[-1]), np.int64)
            feed[idx] = codes
            feeds = self.decoder.new_positions(None, feed, rows)
        lengths = np.asarray(self.lengths[:rows])
        mask = (np.arange(lengths.max() + 1)[None] <= lengths[:, None]).astype(np.int64)  # length + 1 ones per row
        route = self.decoder.routed(rows, True)  # the GEMMs see every row, ride-alongs included
        io, (hidden, logits) = self._binding(0, rows, route)
        io.bind_cpu_input("attention_mask", mask)
        self.decoder.bind_call(io, feeds, hidden, logits)
        self.decoder.session_for(route).run_with_iobinding(io)
        for i in idx:
            self.lengths[i] += 1
        logits = _logits(logits)
        return _check(hidden.numpy()[idx, 0]), None if logits is None else logits[idx]


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


class ConcatDecoder(_Graph):
    """The portable decoder ("concat" cache): present = past + the new rows, a new tensor every step. The presents
    never cross to NumPy: ORT allocates them on the provider's device and they are bound as the next past; only
    the new rows' hidden states come back. Each step copies the cache once inside the graph (its Concat), the
    price of standard ops; the GQA graph writes in place instead."""

    def __init__(self, part, facts, memory: str = "cpu"):
        self.part, self.facts, self.memory = part, facts, memory
        self.session = part.session
        self._graph(part, facts)
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

    def _run(self, cache: ConcatCache, embeds, codes):
        new = 1 if embeds is None else len(embeds)
        if cache.length + new > cache.capacity:
            raise ValueError(f"sequence of {cache.length + new} positions exceeds the cache of "
                             f"{cache.capacity}")
        io = self.session.io_binding()
        for name, value in self.new_positions(embeds, codes).items():
            io.bind_cpu_input(name, value)
        io.bind_cpu_input("attention_mask", np.ones((1, cache.length + new), np.int64))
        for n, v in cache.values.items():
            io.bind_ortvalue_input(n, v)
        for name in self.outputs:
            io.bind_output(name, self.memory, 0)
        self.session.run_with_iobinding(io)
        outs = dict(zip(self.outputs, io.get_outputs(), strict=True))
        cache.values = {n: outs[n.replace(PAST, PRESENT)] for n in self.past}
        cache.length += new
        logits = _logits(outs.get(LOGITS))
        return _check(outs[HIDDEN].numpy()[0]), None if logits is None else logits[0]


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

    def step_batch(self, caches: list, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        steps = [self.decoder.step(c, codes[i]) for i, c in enumerate(caches)]
        return np.stack([h for h, _ in steps]), np.stack([lg for _, lg in steps])
