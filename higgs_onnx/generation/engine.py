"""The generation engine: a `Request` owns one utterance's state, an `Engine` advances requests on a `Backend`.

The autoregressive loop of spec §5.2 (SGO sampler state machine), the same for every backend:

    E = embed(prompt); h = backbone(E)              # prefill; h at <|audio|> predicts the first row
    for step in range(max_rows):
        codes = sample(audio_heads(h))               # (N,) one draw per codebook
        ramp-in  (step < N):  codebooks > step are forced to BOC
        wind-down: after EOC on codebook 0, N-2 more rows, then stop (the finishing row is kept)
        h = backbone(audio_embed(codes))
    raw = reverse_delay(rows); codes >= codebook_size -> 0; waveform = codec(raw)

Everything one utterance needs lives in its `Request`: the prompt, its own KV cache (made by the backend, or a slot
of a pool), its own sampler RNG, the ramp-in/wind-down countdown, the rows so far and its timings. The engine holds
no per-request state. Its three operations are what the scheduler (`generation.scheduler`) interleaves:

- `admit(req)`: a cache for the request (a pool slot, a cache of its own, or the cache a finished request left,
  for KV continuation) and the embeddings of the prompt positions not in it yet;
- `prefill(req, limit)`: the next `limit` of those positions (chunked prefill); the last chunk leaves the hidden
  state that predicts the first row;
- `step(requests)`: every decoding request advances one row: heads, sampler and embedding once for all of them,
  and, with a pool, the decoder once for all of them (one batched call).

`start` (admit + the whole prefill) and `run` (one request alone) are the plain paths tests and eval use.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from .contract import ContractError
from .delay import reverse_delay
from .options import DEFAULT_MAX_ROWS, GenerationOptions
from .sampling import sample_codes


class Backend(Protocol):
    """What the engine needs from a model. Shapes: D hidden size, N codebooks, V codebook vocabulary (N*V rows).

    A cache is whatever the backend keeps per request (its KV cache); the engine only hands it back.
    """

    def embed_text(self, ids: np.ndarray) -> np.ndarray: ...  # (L,) int64 -> (L, D)
    def embed_audio(self, rows: np.ndarray) -> np.ndarray: ...  # (L, N) int64 -> (L, D)
    def new_cache(self, max_len: int, state: dict | None = None) -> Any: ...  # empty, or holding a saved prefix
    def prefill(self, cache: Any, embeds: np.ndarray) -> np.ndarray: ...  # (L, D) appended -> (D,) last hidden
    def decode(self, cache: Any, embed: np.ndarray) -> np.ndarray: ...  # (1, D) appended -> (D,) hidden
    def audio_logits(self, hidden: np.ndarray) -> np.ndarray: ...  # (B, D) -> (B, N, V) float32


class BatchBackend(Backend, Protocol):
    """A backend that can decode several requests in one call: their caches are slots of one `pool`."""

    def pool(self, slots: int, max_len: int) -> Any: ...  # .acquire(capacity, state) -> cache with .free()
    def decode_batch(self, caches: list, embeds: np.ndarray) -> np.ndarray: ...  # (B, D) -> (B, D)


class StepBackend(BatchBackend, Protocol):
    """A backend whose decode step is one call from the sampled codes to the next logits (`fused` true)."""

    fused: bool
    def decode_codes(self, cache: Any, codes: np.ndarray) -> tuple: ...  # (N,) -> (D,) hidden, (N, V) logits
    def decode_batch_codes(self, caches: list, codes: np.ndarray) -> tuple: ...  # (B, N) -> (B, D), (B, N, V)


@dataclass(frozen=True)
class StopRules:
    num_codebooks: int
    boc: int
    eoc: int

    @property
    def wind_down(self) -> int:
        return self.num_codebooks - 2  # rows after the EOC row still generated (SGO: countdown = 8 - 2)


@dataclass(frozen=True)
class GenerationStats:
    """The figures of one finished request, made in one place (`Request.stats`). Times in seconds, all measured
    from the call that made the request (`wall_s`, `first_audio_s`) or as a sum of its own phases."""

    prompt_tokens: int
    reference_rows: int
    rows: int  # decoder steps (delayed rows) generated
    frames: int  # audio frames after reversing the delay: rows - N + 1
    audio_s: float
    voice_s: float  # encoding + prefill of the reference voice (0 for zero-shot or a cached voice)
    prefill_s: float
    decode_s: float  # the row loop: heads, sampling, embedding, decoder steps
    codec_s: float  # the codec decoder (one call, or the sum of the streamed windows)
    first_row_s: float  # until the first row could be sampled (voice + prefill)
    first_audio_s: float  # until the first audio sample was handed out (one-shot: the whole waveform)
    wall_s: float
    chunks: int  # audio pieces handed out (1 for one-shot)
    stop_reason: str  # "eoc" (the model ended the speech), "max_rows" (cut at the limit), "teacher"
    # sessions made while the call waited (the int8 route's on its first call, a part's first use): in wall_s, not
    # in prefill_s / decode_s
    load_s: float = 0.0

    @property
    def rtf(self) -> float:
        """Real-time factor over generation: (wall time - session loads) / audio time (below 1 = faster than real
        time)."""
        return (self.wall_s - self.load_s) / max(self.audio_s, 1e-9)

    def as_dict(self) -> dict:
        return {**asdict(self), "rtf": self.rtf}


@dataclass
class GenerationResult:
    rows: np.ndarray  # (L, N) delayed rows as generated
    codes: np.ndarray  # (T, N) raw codes after reversing the delay (may hold BOC/EOC leftovers)
    stop_reason: str  # "eoc", "max_rows" or "teacher"
    prompt_len: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    logits: list[np.ndarray] = field(default_factory=list)  # per-step (N, V), kept only when asked


def prompt_embeddings(backend: Backend, prompt: list[int], placeholder: int,
                      ref_rows: np.ndarray | None) -> np.ndarray:
    """(P, D): text positions embed their token, placeholder positions the k-th delayed reference row."""
    ids = np.asarray(prompt, dtype=np.int64)
    slots = np.flatnonzero(ids == placeholder)
    n_ref = 0 if ref_rows is None else len(ref_rows)
    if len(slots) != n_ref:
        raise ValueError(f"prompt has {len(slots)} audio placeholders but {n_ref} reference rows were given")
    text_pos = np.flatnonzero(ids != placeholder)
    text = backend.embed_text(ids[text_pos])
    embeds = np.empty((len(ids), text.shape[-1]), dtype=text.dtype)
    embeds[text_pos] = text
    if n_ref:
        embeds[slots] = backend.embed_audio(ref_rows)
    return embeds


def next_state(codes: np.ndarray, step: int, countdown: int, rules: StopRules, ignore_eoc: bool = False
               ) -> tuple[int, bool]:
    """Apply ramp-in / wind-down to this step's `codes` in place; returns (countdown, done)."""
    if step < rules.num_codebooks:  # ramp-in: codebook c starts at row c
        codes[step + 1:] = rules.boc
        return countdown, False
    if countdown >= 0:
        countdown -= 1
        return countdown, countdown <= 0
    if codes[0] == rules.eoc and not ignore_eoc:
        return rules.wind_down, False
    return countdown, False


class Request:
    """One utterance in flight: prompt, cache, RNG, state machine, rows so far, timings.

    `prefix` = (n, state): the first n prompt positions are already in `state` (a voice's saved KV rows), only the
    rest of the prompt is prefilled. `teacher_rows` (L, N) are fed instead of the picks (teacher forcing, eval).
    """

    def __init__(self, prompt: list[int], rules: StopRules, options: GenerationOptions, placeholder: int,
                 ref_rows: np.ndarray | None = None, prefix: tuple[int, dict] | None = None,
                 teacher_rows: np.ndarray | None = None, keep_logits: bool = False, voice_s: float = 0.0,
                 started: float | None = None, history_rows: np.ndarray | None = None, watch: Any = None):
        self.prompt, self.rules, self.options, self.placeholder = list(prompt), rules, options, placeholder
        self.history_rows = history_rows  # rows of earlier turns (long-form), after the reference's placeholders
        # prompt positions already in the cache it starts from: a voice's saved prefix, or (KV continuation) the
        # prompt and rows of the request whose cache it takes over (`Engine.admit(req, cache=...)`)
        self.cached = 0 if prefix is None else prefix[0]
        self.embeds: np.ndarray | None = None  # positions still to prefill (set by `Engine.admit`)
        self.prefilled = 0  # of `embeds`
        # offsets into `embeds` where a prefill chunk must end, whatever the chunk size: a resumed long-form piece
        # replays the calls that built the cache it would have continued (each fed row a call of its own)
        self.breaks: tuple[int, ...] = ()
        self.ref_rows, self.prefix, self.teacher_rows, self.keep_logits = ref_rows, prefix, teacher_rows, keep_logits
        self.max_rows = DEFAULT_MAX_ROWS if options.max_rows is None else options.max_rows
        self.rng = np.random.default_rng(options.seed)
        self.rows = np.empty((self.max_rows, rules.num_codebooks), dtype=np.int64)
        self.n = 0  # rows generated
        self.countdown = -1
        self.stop_reason: str | None = None  # set when done
        self.text: str | None = None  # the text it speaks (set by the synthesizer; the guard's verdicts read it)
        # with a `prefix` holding the whole prompt: the last prompt position's hidden state (nothing to prefill)
        self.start_hidden: np.ndarray | None = None
        # the guard's online check (guard.RowWatch: `see(rows, n)` -> a verdict that stops it now, or None); not
        # for teacher-forced or ignore_eoc runs, which must run their given length
        self.watch = watch if teacher_rows is None and not options.ignore_eoc else None
        self.cache: Any = None  # the backend's KV cache, from prefill until done
        self.hidden: np.ndarray | None = None  # the hidden state that predicts the next row
        self.next_logits: np.ndarray | None = None  # its (N, V) logits, when the step graph gave them already
        self.logits: list[np.ndarray] = []
        self.frames_out = 0  # raw frames handed to the audio side (`new_frames`)
        # timings
        self.started = time.perf_counter() if started is None else started
        self.voice_s, self.prefill_s, self.decode_s, self.codec_s = voice_s, 0.0, 0.0, 0.0
        self.load_s = 0.0  # sessions made while its calls waited (`loads`: the backend's load clock)
        self.clock: Callable[[], float] | None = None  # the engine's load clock, set at admission
        self.first_audio_at: float | None = None
        self.chunks = 0

    def loads(self) -> float:
        """This thread's load clock (seconds spent making sessions; 0 before admission): a phase that reads it
        before and after leaves the sessions it waited for out of its time and adds them to `load_s`."""
        return self.clock() if self.clock is not None else 0.0

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def decoding(self) -> bool:
        """Prefilled and not done: its next row can be sampled."""
        return self.hidden is not None and not self.done

    @property
    def members(self) -> tuple[Request, ...]:
        """The batch rows this request occupies, each with its own cache: itself (a voice blend, `BlendRequest`:
        one per voice, all fed the same codes)."""
        return (self,)

    @property
    def width(self) -> int:
        """Batch rows (pool slots) this request needs."""
        return len(self.members)

    @property
    def prefilling(self) -> bool:
        """Admitted with prompt positions still to prefill."""
        return self.embeds is not None

    @property
    def positions(self) -> int:
        """Positions this request's cache holds when it is done: its prompt and every row but the last (the last
        row is sampled, never fed). A request that continues it starts from exactly these."""
        return len(self.prompt) + max(self.n - 1, 0)

    def placeholder_rows(self) -> np.ndarray | None:
        """The rows for the placeholders of `prompt[cached:]` (those before `cached` are in the cache already)."""
        rows = [r for r in (self.ref_rows, self.history_rows) if r is not None]
        if not rows:
            return None
        rows = np.concatenate(rows)
        skip = int(np.count_nonzero(np.asarray(self.prompt[:self.cached]) == self.placeholder))
        return rows[skip:]

    @property
    def generated(self) -> np.ndarray:
        """(n, N) the delayed rows so far."""
        return self.rows[:self.n]

    def accept(self, logits: np.ndarray) -> np.ndarray:
        """Sample this step's row from (N, V) logits, apply ramp-in / wind-down, store it; returns the row."""
        if self.keep_logits:
            self.logits.append(logits)
        step = self.n
        codes = self.sample(logits)
        self.countdown, finished = next_state(codes, step, self.countdown, self.rules, self.options.ignore_eoc)
        stop = "eoc"
        if self.teacher_rows is not None:  # feed the given rows; stop where they end
            codes, finished, stop = self.teacher_rows[step].copy(), step + 1 == len(self.teacher_rows), "teacher"
        self.rows[step] = codes
        self.n = step + 1
        if finished:
            self.stop_reason = stop
        elif self.n == self.max_rows:
            self.stop_reason = "max_rows"
        elif self.watch is not None:
            self.stop_reason = self.watch.see(self.rows, self.n)  # "loop", "overlong" or None
        return codes

    def sample(self, logits: np.ndarray) -> np.ndarray:
        """(N, V) logits -> this step's (N,) codes, drawn with the request's own RNG."""
        return sample_codes(logits, self.rng, self.options.sampling)

    def new_frames(self) -> np.ndarray:
        """(k, N) raw frames completed since the last call. Frame t needs rows t..t+N-1 (codebook c sits c rows
        late), so while generating, frame t is final once row t+N-1 exists; at the end every frame is."""
        n_cb = self.rules.num_codebooks
        ready = max(self.n - n_cb + 1, 0)
        start, self.frames_out = self.frames_out, ready
        if ready <= start:
            return np.zeros((0, n_cb), np.int64)
        return reverse_delay(self.rows[start:ready + n_cb - 1])

    def audio_out(self, samples: int) -> None:
        """The audio side handed out `samples` samples (marks the first audio)."""
        if samples and self.first_audio_at is None:
            self.first_audio_at = time.perf_counter()
        self.chunks += 1

    def result(self) -> GenerationResult:
        rows = self.generated.copy()
        return GenerationResult(rows=rows, codes=reverse_delay(rows), stop_reason=self.stop_reason or "running",
                                prompt_len=len(self.prompt), prefill_s=self.prefill_s, decode_s=self.decode_s,
                                logits=self.logits)

    def stats(self, audio_samples: int, sample_rate: int) -> GenerationStats:
        end = time.perf_counter()
        first = self.first_audio_at if self.first_audio_at is not None else end
        return GenerationStats(
            prompt_tokens=len(self.prompt), reference_rows=0 if self.ref_rows is None else len(self.ref_rows),
            rows=self.n, frames=max(self.n - self.rules.num_codebooks + 1, 0), audio_s=audio_samples / sample_rate,
            voice_s=self.voice_s, prefill_s=self.prefill_s, decode_s=self.decode_s, codec_s=self.codec_s,
            first_row_s=self.voice_s + self.prefill_s, first_audio_s=first - self.started + self.voice_s,
            wall_s=end - self.started + self.voice_s, chunks=self.chunks, stop_reason=self.stop_reason or "running",
            load_s=self.load_s)

    def redraw(self, options: GenerationOptions) -> Request:
        """A new draw of the same prompt (same voice prefix, reference and history rows) with other `options`: a
        retried take. Not for a request that continues another's cache (its prefix is that cache, now gone)."""
        if self.prefix is not None and self.prefix[1] is None:
            raise ValueError("a request that continued another's cache cannot be drawn again")
        req = Request(self.prompt, self.rules, options, self.placeholder, ref_rows=self.ref_rows, prefix=self.prefix,
                      voice_s=self.voice_s, started=self.started, history_rows=self.history_rows,
                      watch=None if self.watch is None else self.watch.fresh())
        req.text, req.load_s = self.text, self.load_s  # its wall time counts from the first draw's start, loads too
        return req

    def release(self) -> None:
        """Drop the KV cache (done, or abandoned by its consumer); a pool slot goes back to its pool."""
        free = getattr(self.cache, "free", None)
        if free is not None:
            free()
        self.cache = self.hidden = self.embeds = self.next_logits = None

    def hand_over(self) -> Any:
        """The cache of this finished request, for a request that continues it (KV continuation); it is then no
        longer this request's to release."""
        if not self.done or self.cache is None:
            raise ValueError("only a finished request that kept its cache can be continued")
        cache, self.cache, self.hidden, self.next_logits = self.cache, None, None, None
        return cache


def _no_loads() -> float:
    return 0.0


class Engine:
    """Advances requests on one backend. Holds no per-request state: requests carry their own.

    Without a `pool` every request gets a cache of its own (any number in flight, from any thread). With one
    (`backend.pool(slots, max_len)`, continuous batching) requests take a slot when they start and give it back when
    they end, and `step` advances all of them with one decoder call.
    """

    def __init__(self, backend: Backend, pool: Any = None):
        self.backend, self.pool = backend, pool

    @property
    def clock(self) -> Callable[[], float]:
        """The backend's load clock (seconds this thread has waited for its sessions to be made; a backend without
        lazy sessions: always 0); a request's phases leave them out (`Request.load_s`). The backend's own callable,
        never a method of this engine: a request keeps it, and must not keep the engine's pool."""
        clock = getattr(self.backend, "load_clock", None)
        return clock if callable(clock) else _no_loads

    def load_clock(self) -> float:
        return self.clock()

    def admit(self, req: Request, cache: Any = None) -> None:
        """Give `req` its cache and the embeddings of the prompt positions still to prefill (`req.embeds`); a voice
        blend, each of its members (a slot each). On failure the caller releases the request (all its members).

        `cache`: the cache a finished request left (KV continuation); it must hold exactly `req.cached` positions.
        Otherwise a slot of the pool (or a cache of its own), empty or holding the voice's saved prefix."""
        if cache is not None and req.width > 1:
            raise ValueError("a voice blend cannot continue a KV cache")
        clock = self.clock
        loads = clock()
        req.clock = clock
        for row in req.members:
            row.clock = clock
            self._admit_row(row, cache)
        req.load_s += clock() - loads  # the embeddings' sessions, made on first use

    def _admit_row(self, req: Request, cache: Any) -> None:
        if cache is None and self.pool is not None and len(req.prompt) + req.max_rows > self.pool.capacity:
            # never cut to fit: the request should have been made for this slot (`HiggsTTS.request(slot=...)`)
            raise ContractError(f"the prompt is {len(req.prompt)} positions and the request asks for {req.max_rows} "
                                f"rows, but this engine's slots hold {self.pool.capacity} positions", "max_rows",
                                "context_length_exceeded")
        be = self.backend
        whole = req.cached == len(req.prompt)  # the prompt's state and its last hidden state are given (takes)
        if whole and req.start_hidden is None:
            raise ValueError("a request whose whole prompt is cached needs its last hidden state (start_hidden)")
        req.embeds = None if whole else prompt_embeddings(be, req.prompt[req.cached:], req.placeholder,
                                                          req.placeholder_rows())
        req.prefilled = 0
        if cache is not None:
            capacity = getattr(cache, "capacity", None)
            if cache.length != req.cached:
                raise ValueError(f"a continued cache holds {cache.length} positions, the request expects "
                                 f"{req.cached}")
            if capacity is not None and len(req.prompt) + req.max_rows > capacity:
                raise ContractError(f"the continued prompt is {len(req.prompt)} positions and the request asks for "
                                    f"{req.max_rows} rows, but its cache holds {capacity} positions", "max_rows",
                                    "context_length_exceeded")
            req.cache = cache
            return
        state = None if req.prefix is None else req.prefix[1]
        capacity = len(req.prompt) + req.max_rows
        req.cache = be.new_cache(capacity, state) if self.pool is None else self.pool.acquire(capacity, state)
        if whole:
            req.hidden = req.start_hidden  # nothing to prefill: its next row can be sampled

    def prefill(self, req: Request, limit: int | None = None) -> int:
        """Prefill the next `limit` (None: all) of the request's remaining prompt positions; returns how many.
        After the last chunk the request is `decoding`. A failed prefill gives the cache back and raises."""
        t0, loads = time.perf_counter(), self.load_clock()
        row = next(m for m in req.members if m.embeds is not None)  # a blend prefills its voices one by one
        left = len(row.embeds) - row.prefilled
        n = left if limit is None else max(1, min(limit, left))
        if row.breaks:
            i = bisect.bisect_right(row.breaks, row.prefilled)
            if i < len(row.breaks):
                n = min(n, row.breaks[i] - row.prefilled)
        try:
            hidden = self.backend.prefill(row.cache, row.embeds[row.prefilled:row.prefilled + n])
        except BaseException:
            req.release()
            raise
        row.prefilled += n
        if row.prefilled == len(row.embeds):
            row.hidden, row.embeds = hidden, None
        loaded = self.load_clock() - loads
        req.load_s += loaded
        req.prefill_s += time.perf_counter() - t0 - loaded
        return n

    def start(self, req: Request) -> None:
        """Admit the request and prefill its whole prompt (a blend: every voice's); then its next row can be sampled."""
        self.admit(req)
        while req.prefilling:
            self.prefill(req)

    def step(self, requests: list[Request], keep: frozenset = frozenset()) -> None:
        """Advance each decoding request by one row: heads -> sampler -> state machine -> embed -> decoder.

        The heads and the embedding run once for all of them (rows of one call are independent positions); each
        request samples with its own RNG; with a pool, the decoder runs once for all of them too. With the step
        graph (`backend.fused`) embed -> decoder -> heads is one call that also gives the next step's logits, so a
        step is one runtime call (the heads run apart only after a prefill). A request that finishes releases its
        cache unless its id is in `keep` (it will be continued).

        A voice blend (`BlendRequest`) is a row per voice: their logits come from the same heads call, it mixes
        them and draws once, and every row is fed the codes drawn, in the same decoder call as the rest."""
        live = [r for r in requests if r.decoding]
        if not live:
            return
        be, t0, loads = self.backend, time.perf_counter(), self.load_clock()
        need = [m for r in live for m in r.members if m.next_logits is None]
        if need:
            for m, lg in zip(need, be.audio_logits(np.stack([m.hidden for m in need])), strict=True):  # (B, N, V)
                m.next_logits = lg
        going, rows = [], []  # the batch rows still going (every member of a request), and the codes each is fed
        for req in live:
            logits = [m.next_logits for m in req.members]
            for m in req.members:
                m.next_logits = None
            codes = req.accept(logits[0] if req.width == 1 else np.stack(logits))  # a blend: (M, N, V)
            if req.done:
                if id(req) not in keep:
                    req.release()
            else:
                going += req.members
                rows += [codes] * req.width
        if going:
            batched = self.pool is not None and len(going) > 1
            caches = [r.cache for r in going]
            if getattr(be, "fused", False):
                if batched:
                    hidden, logits = be.decode_batch_codes(caches, np.stack(rows))
                else:
                    steps = [be.decode_codes(c, codes) for c, codes in zip(caches, rows, strict=True)]
                    hidden, logits = [h for h, _ in steps], [lg for _, lg in steps]
                for req, h, lg in zip(going, hidden, logits, strict=True):
                    req.hidden, req.next_logits = h, lg
            else:
                embeds = be.embed_audio(np.stack(rows))  # (B', D)
                if batched:
                    hidden = be.decode_batch(caches, embeds)
                else:
                    hidden = [be.decode(c, embeds[i:i + 1]) for i, c in enumerate(caches)]
                for req, h in zip(going, hidden, strict=True):
                    req.hidden = h
        loaded = self.load_clock() - loads
        spent = time.perf_counter() - t0 - loaded
        for req in live:
            req.decode_s += spent
            req.load_s += loaded

    def rows(self, req: Request) -> Iterator[int]:
        """Run one request to its end, yielding its row count after each row. Closing the iterator early (a
        consumer that stops) releases the request's cache."""
        try:
            if req.cache is None and not req.done:
                self.start(req)
            while not req.done:
                self.step([req])
                yield req.n
        finally:
            req.release()

    def run(self, req: Request) -> GenerationResult:
        for _ in self.rows(req):
            pass
        return req.result()


def generate(backend: Backend, prompt: list[int], rules: StopRules, options: GenerationOptions, placeholder: int,
             ref_rows: np.ndarray | None = None, keep_logits: bool = False,
             teacher_rows: np.ndarray | None = None) -> GenerationResult:
    """One request from prompt ids to rows on `backend` (eval and benchmarks; speech goes through `pipeline`)."""
    req = Request(prompt, rules, options, placeholder, ref_rows=ref_rows, teacher_rows=teacher_rows,
                  keep_logits=keep_logits)
    return Engine(backend).run(req)
