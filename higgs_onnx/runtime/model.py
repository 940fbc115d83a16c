"""`HiggsTTS`: load an `onnx/<device>_<precision>/` folder once, generate many times. ONNX Runtime only.

    tts = HiggsTTS("onnx/cpu_int4")
    speech = tts.generate("Hello there.", ref_audio="me.wav", ref_text="What I said.", temperature=0.8)
    speech.waveform, speech.sample_rate, speech.codes, speech.rows, speech.stats
    for chunk in tts.stream("Hello there."):       # audio while the model is still talking
        play(chunk.samples)
    sched = tts.scheduler(4, 1024)                  # several requests, one batched decoder call per step
    h = sched.submit(tts.request("Hi.", seed=1, slot=1024), "speech"); sched.run_until_idle(); h.speech()
    tts.unload(); tts.load()                        # sessions let go (voices kept), made again (serve --idle-unload)

`HiggsTTS` is the facade only: it composes the pieces and every job goes through its scheduler.

- `runtime.parts.ModelParts` (`tts.parts`): the manifest checked, facts, tokenizer, the parts' sessions;
- `runtime.backend.OnnxBackend` (`tts.backend`): the generation backend on those parts (decoder + KV cache);
- `runtime.codec.OnnxCodec` (`tts.codec`): reference audio -> codes -> audio, streamed or in one piece;
- `runtime.voice.Voice` and `runtime.voice_cache.VoiceCache` (`tts.voices`): voices made once, kept, saved;
- `generation.scheduler.Scheduler` (`tts.scheduler()`): `generate` / `stream` / `run` are a batch of one on it.

Thread safety: one `HiggsTTS` may be shared by threads. Each call makes its own `Request` (KV cache, sampler RNG,
rows), the ONNX Runtime sessions allow concurrent runs, and the lazily made sessions, the backend and the voice
cache are guarded by locks (a call running while another thread unloads keeps its session until it returns);
concurrent calls compete for the same cores, so they do not run faster together (batching them into one decoder
call is what a shared `scheduler(slots, positions)` does).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from ..generation.blend import Blend, BlendRequest
from ..generation.codec_stream import StreamOptions
from ..generation.contract import Limits, check_max_rows
from ..generation.engine import Request
from ..generation.options import GenerationOptions
from ..generation.pipeline import Speech, Synthesizer, reference_rows, speech_from
from ..generation.prompt import encode_user_text
from ..generation.scheduler import PrefillPolicy, Scheduler
from ..generation.stream import AudioChunk
from ..guard import GuardOptions, RetryPolicy
from .backend import KV_LAYOUTS, OnnxBackend
from .codec import OnnxCodec
from .parts import STATEFUL_CODEC, ModelParts
from .route import check_mode as check_route
from .session import Part
from .voice import VOICE_FILE, Voice, VoiceFileError, prefill_voice
from .voice_cache import DEFAULT_VOICE_CACHE_BYTES, VoiceCache

__all__ = ["STATEFUL_CODEC", "VOICE_FILE", "HiggsTTS", "OnnxBackend", "Voice", "VoiceFileError"]


class HiggsTTS:
    """One exported model folder: its parts (sessions created on first use), backend, codec, voices and scheduler.

    `provider`: the runtime (default: the folder's device); `threads`: intra-op threads per session (0: ONNX
    Runtime's default); `verify`: check the files' hashes at load; `kv_cache`: "bound" (the decoder graph's own
    layout on the provider's device) or "host" (NumPy arrays); `voice_cache_bytes` bounds the voices kept;
    `step_graph`: decode through the export's one-call step graph where it has one (False: the three parts apart,
    for comparisons); `guard`: the guard's thresholds (`guard.GuardOptions`; None: the defaults, docs/guard.md);
    `route`: the int8 GEMM route for calls of many rows, where the export has one: "auto" (its measured crossover),
    "off" (int4 for every call) or "on" (every call of two or more rows); None: `$HIGGS_ROUTE`, else "auto"
    (`runtime/route.py`)."""

    def __init__(self, model_path: str | os.PathLike, provider: str | None = None, threads: int = 0,
                 verify: bool = True, kv_cache: str = "bound", voice_cache_bytes: int = DEFAULT_VOICE_CACHE_BYTES,
                 step_graph: bool = True, guard: GuardOptions | None = None, route: str | None = None):
        opening = time.perf_counter()
        if kv_cache not in KV_LAYOUTS:  # before the (slow) hashing of the model files
            raise ValueError(f"kv_cache must be one of {', '.join(KV_LAYOUTS)}, got {kv_cache!r}")
        route = check_route(route)
        if not isinstance(step_graph, bool):
            raise TypeError(f"step_graph must be True or False, got {step_graph!r}")
        if guard is not None and not isinstance(guard, GuardOptions):
            raise TypeError(f"guard must be a guard.GuardOptions, got {type(guard).__name__}")
        self.guard = guard
        self.parts = ModelParts(model_path, provider, threads, verify)
        p = self.parts
        self.manifest, self.provider, self.facts = p.manifest, p.provider, p.facts
        self.tokenizer, self.tokens, self.threads = p.tokenizer, p.tokens, p.threads
        self.kv_cache, self.step_graph, self.route = kv_cache, step_graph, route
        self.codec = OnnxCodec(p)
        self.voices = VoiceCache(voice_cache_bytes)  # voices made from references, LRU by bytes
        self._backend: OnnxBackend | None = None
        self._synth: Synthesizer | None = None
        self._prompts: Synthesizer | None = None
        self._reload: tuple[str, ...] = ()  # the parts `unload` let go, made again by `load`
        self._lock = threading.Lock()  # the backend and the synthesizer are made once, whichever thread asks first
        self.opened_s = time.perf_counter() - opening  # the folder opened: manifest, hashes, tokenizer

    # -- the parts -------------------------------------------------------------------------------------------
    def part(self, name: str) -> Part:
        """The part's session, made on first use and checked against the manifest (`ModelParts.part`)."""
        return self.parts.part(name)

    @property
    def source(self):
        """Where the folder came from when it was fetched from the Hub (`hub.HubExport`: repo, folder, revision,
        the commit, the local path; str() reads "hf://... at commit abc123 -> /path"); None for a local folder."""
        return self.parts.source

    def ran_on(self) -> dict[str, str]:
        """{part: the provider/device its session runs on} for the parts loaded so far (each was checked at load:
        a part that would fall back to another device is an error, never a silent fallback)."""
        return self.parts.ran_on()

    def preload(self, names: tuple[str, ...] | None = None) -> dict[str, str]:
        """Make the sessions of `names` (default: every part a request may run) and the backend now, so that the
        first request does not pay for loading them; returns `ran_on()`. Only one of the decoder and the step graph
        is loaded (they hold the same weights): the one the backend runs."""
        backend = self.backend  # the decoder's session and its KV-cache layout (and the route's, where it runs)
        unused = {"llm_decoder", "llm_step", "llm_route"} - {backend.decoder_part, backend.route_part}
        for name in [n for n in self.manifest.parts if n not in unused] if names is None else names:
            self.part(name)
        return self.ran_on()

    @property
    def backend(self) -> OnnxBackend:
        """The generation backend (`runtime.backend.OnnxBackend`), public: `backend.decoder` is the KV-cache
        decoder (benchmarks time its steps), `backend.pool(slots, positions)` a slot pool, `backend.kv_memory`
        where the cache lives. Made on first use (again after `unload`)."""
        backend = self._backend  # a local: `unload` may let it go from another thread meanwhile
        if backend is None:
            with self._lock:
                backend = self._backend
                if backend is None:
                    backend = self._backend = OnnxBackend(self.parts, self.kv_cache, self.step_graph, self.route)
        return backend

    # -- idle unload ---------------------------------------------------------------------------------------------
    def unload(self) -> list[str]:
        """Let go of every ONNX Runtime session (the parts', the backend's decoder, the synthesizer on it) and give
        the memory back to the system; the manifest, tokenizer, facts and voices stay. Returns the parts that were
        loaded. Whatever runs next makes what it needs again (`load` makes them all at once). The caller makes sure
        nothing holds a KV cache of this model (a scheduler does it when idle: `scheduler(idle_unload=...)`); a call
        already running keeps its session until it returns."""
        from ..memory import release_memory

        with self._lock:
            self._backend = self._synth = None
            names = self.parts.unload()
        # made again by `load`: every part loaded before an unload (not a stateful twin: the backend makes that)
        self._reload = tuple(sorted({*self._reload, *(n for n in names if n in self.manifest.parts)}))
        release_memory()  # the sessions' heap (weights, arenas) back to the system, not kept by the allocator
        return names

    def load(self) -> OnnxBackend:
        """Make again the sessions `unload` let go (before any unload: the backend's) and return the backend."""
        self.preload(self._reload)
        return self.backend

    @property
    def loaded(self) -> bool:
        """Whether any session of the model exists (its memory is held)."""
        return self._backend is not None or bool(self.parts.loaded())

    @property
    def load_s(self) -> float:
        """Seconds spent loading so far: the folder opened (`opened_s`: manifest, file hashes, tokenizer) and every
        session made since (the int8 route's by the first call taking it); the CLI's summary shows it apart."""
        return self.opened_s + self.parts.load_s

    @property
    def loaded_at(self) -> float:
        """`time.monotonic()` when the last session was made (0: never)."""
        return self.parts.made_at

    @property
    def kv_memory(self) -> str:
        """Where the decoder's KV cache lives: "cpu", "cuda", "dml" (the ORT memory of its buffers), "state" (inside
        OpenVINO's stateful compiled model) or "host"
        (NumPy arrays fed back each step: the OpenVINO runtime, `kv_cache="host"`)."""
        return self.backend.kv_memory

    @property
    def kv_bytes_per_position(self) -> int:
        """Bytes one position takes in the decoder's KV cache, every layer's K and V (fp32: 4 per value; int8: 1)."""
        f, types = self.facts, self.backend.decoder.part.input_types
        return sum(np.dtype(t).itemsize for n, t in types.items() if n.startswith("past_key_values.")) * \
            f.kv_heads * f.head_dim

    @property
    def slot_positions(self) -> int:
        """Positions of one batching-pool slot (the server, long-form lanes, the corpus, `--out-dir` lines): the
        model's context or `POOL_POSITIONS`, whichever is smaller; twice that with an int8 KV cache."""
        from ..generation.options import POOL_POSITIONS, POOL_POSITIONS_INT8

        int8 = self.manifest.kv_cache == "int8"  # the manifest says it: no decoder session is needed
        return min(self.facts.max_positions, POOL_POSITIONS_INT8 if int8 else POOL_POSITIONS)

    @property
    def prompts(self) -> Synthesizer:
        """The prompt side alone (text + voice -> a checked `Request`), with no backend: building and checking a
        request loads no part (`inference.py --dry-run`, the server's `dry_run`); running it needs the backend."""
        if self._prompts is None:
            with self._lock:
                if self._prompts is None:
                    self._prompts = Synthesizer(None, self, self.tokenizer, self.tokens, self.facts)
                    self._prompts.guard = self.guard
        return self._prompts

    @property
    def synthesizer(self) -> Synthesizer:
        """The prompt side (text + voice -> `Request`) on this model's backend and codec. Internal: run requests
        with `run(request, ...)` or a `scheduler()`, not with `synthesizer.speak` / `synthesizer.engine`."""
        synth = self._synth  # a local, as `backend`'s
        if synth is None:
            backend = self.backend
            with self._lock:
                synth = self._synth
                if synth is None:
                    synth = self._synth = Synthesizer(backend, self, self.tokenizer, self.tokens, self.facts)
                    synth.guard = self.guard
        return synth

    @property
    def model_id(self) -> str:
        """Identity of the parts a voice state depends on (hashes from the manifest)."""
        return self.parts.model_id

    # -- codec ------------------------------------------------------------------------------------------------
    def encode_audio(self, wav: np.ndarray) -> np.ndarray:
        """(L,) float32 mono at the codec rate -> (T, N) int64 codes."""
        return self.codec.encode_audio(wav)

    def decode_audio(self, codes: np.ndarray) -> np.ndarray:
        """(1, N, T) int64 codes in [0, codebook_size) -> (hop*T,) float32."""
        return self.codec.decode_audio(codes)

    def reference(self, ref_audio) -> np.ndarray:
        """A file path, or (waveform, sample_rate) -> mono waveform at the codec rate."""
        return self.codec.reference(ref_audio)

    @property
    def has_stateful_codec(self) -> bool:
        """Whether the export has the stateful streaming codec (folders built before it decode windows)."""
        return self.codec.has_stateful_codec

    def codec_stream(self, options: StreamOptions):
        """The incremental codec decoder for one stream (see `generation.codec_stream`): the stateful graph (every frame
        decoded once) unless the export predates it or `options.codec` asks for overlapping windows."""
        return self.codec.codec_stream(options, self.decode_audio)

    def decode_rows(self, rows: np.ndarray, delayed: bool = True) -> np.ndarray:
        """Code rows from elsewhere -> waveform; `delayed` rows are reversed first, codes >= codebook size -> 0."""
        return self.codec.decode_rows(rows, delayed, self.decode_audio)

    # -- generation ----------------------------------------------------------------------------------------------
    def request(self, text: str, ref_audio=None, ref_text: str | None = None, voice: Voice | None = None,
                options: GenerationOptions | None = None, history: list[tuple[str, np.ndarray]] = (),
                slot: int | None = None, continues: Request | None = None, **keywords) -> Request:
        """The `Request` for one utterance (validated: bad options, text or reference raise here, before any work).

        `ref_audio` (a path or (waveform, rate)) clones a voice, `ref_text` is its transcript; `voice` (from
        `make_voice` / `Voice.load`) reuses an encoded reference and its prefill state. `options` and the plain
        keywords (`temperature`, `top_k`, `top_p`, `seed`, `max_rows`) choose sampling and the row limit. `slot` is
        the positions of the batching pool's slot that will run it (None: a cache of its own). `continues`: a
        finished request (kept by the scheduler) whose KV cache this one continues; `history` then ends with its
        turn (see `Synthesizer.request`). Everything the request contract (`generation.contract`) says is checked
        here: nothing is cut to fit later. `voice` may be a `generation.blend.Blend` (a mix of voices): the request
        is then a `BlendRequest`, one batch row per voice (`blend_request`).
        """
        started = time.perf_counter()
        options = GenerationOptions.make(options, **keywords)
        if ref_text is not None and ref_audio is None:
            raise ValueError("ref_text (a transcript of the reference) needs ref_audio")
        if voice is not None and ref_audio is not None:
            raise ValueError("give either voice or ref_audio, not both")
        if isinstance(voice, Blend):
            return self.blend_request(text, voice, options, slot=slot, history=history, continues=continues)
        if voice is None and ref_audio is not None:
            # what can be refused without the voice is refused before it is made (the synthesizer checks it all)
            check_max_rows(options.max_rows, self.facts.num_codebooks, self.limits(slot))
            encode_user_text(self.tokenizer, self.tokens, text)
            voice = self.make_voice(ref_audio, ref_text)  # made once per reference, then cached
        voice_s = time.perf_counter() - started
        kwargs = {} if voice is None else {"ref_rows": voice.rows, "ref_text": voice.ref_text,
                                           "prefix": (len(voice.prefix), voice.state)}
        return self.prompts.request(text, options, voice_s=voice_s, started=time.perf_counter(),
                                        history=list(history), slot=slot, continues=continues, **kwargs)

    def prompt_figures(self, text: str, req) -> dict:
        """What a dry run shows of a built request for `text` (`request`): the text, its own tokens, the prompt's
        positions (`voice_positions` of them a saved voice's), the row budget and the voices (a blend: a request
        per voice, the first one's figures)."""
        members = getattr(req, "members", [req])
        first = members[0]
        return {"read": text, "text_tokens": len(encode_user_text(self.tokenizer, self.tokens, text)),
                "prompt_positions": len(first.prompt), "voice_positions": first.cached, "max_rows": first.max_rows,
                "voices": len(members)}

    def blend_request(self, text: str, blend: Blend, options: GenerationOptions | None = None, *,
                      slot: int | None = None, history=(), continues: Request | None = None) -> BlendRequest:
        """The request for `text` in a mix of voices: one request per voice (each checked by the contract like any
        other), one row budget for all of them (the smallest: every row stops together), as one `BlendRequest`.
        A blend runs on its own rows from the start: no history or KV continuation (long-form, dialogue and the
        text-in WebSocket refuse it)."""
        import dataclasses

        if history or continues is not None:
            raise ValueError("a voice blend cannot continue earlier speech (long-form, a dialogue, the text-in "
                             "WebSocket): it runs a cache per voice; use one voice there")
        options = GenerationOptions.make(options)
        members = [self.request(text, voice=v, options=options, slot=slot) for v in blend.voices]
        rows = min(m.max_rows for m in members)
        if any(m.max_rows != rows for m in members):  # the voices' prompts differ: the shortest budget for all
            options = dataclasses.replace(options, max_rows=rows)
            members = [self.request(text, voice=v, options=options, slot=slot) for v in blend.voices]
        return BlendRequest(members, blend.weights, blend.mode)

    def limits(self, slot: int | None = None) -> Limits:
        """The positions a request may use: the model's context, and the batching slot's when it runs in one."""
        return Limits(self.facts.max_positions, slot)

    def generate(self, text: str, ref_audio=None, ref_text: str | None = None, voice: Voice | None = None,
                 options: GenerationOptions | None = None, *, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 max_rows: int | None = None, on_row: Callable[[int], None] | None = None,
                 max_frames: int | None = None, retries: int | RetryPolicy | None = None) -> Speech:
        """Speech for `text`, decoded once at the end (see `request` for the arguments; `stream` for audio as it is
        made). A voice made from `ref_audio` is kept in memory, so the next clone with the same reference skips the
        codec encoder and the reference's prefill. `max_frames` is the old name of `max_rows`. The guard judges the
        take (`Speech.verdict`); `retries` (a count, or a `guard.RetryPolicy`) draws a degenerate take again with a
        new seed and a cooler temperature (`Speech.takes` lists them all)."""
        policy = retry_policy(retries)
        req = self.request(text, ref_audio, ref_text, voice, options, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=seed, max_rows=_rows(max_rows, max_frames))
        return self.run(req, "speech", on_row=on_row, retry=policy)

    def draw_takes(self, text: str, seeds: list[int], voice: Voice | None = None,
                   options: GenerationOptions | None = None) -> list[Request]:
        """One request drawn once per seed, as rows of one batch, to their end (rows only: decode a take with
        `speech_of`). The prompt is prefilled once: every take starts from its saved state and last hidden state (a
        voice's prefix included), so the takes cost what batching the rows costs. The policy that judges and
        chooses them is the job's (`job.run.best_of`)."""
        import dataclasses

        from ..generation.engine import prompt_embeddings

        options = GenerationOptions.make(options)
        positions = self.slot_positions
        first = self.request(text, voice=voice, options=options, slot=positions)
        f, be = self.facts, self.backend
        prompt, cached = first.prompt, first.cached
        state = None if first.prefix is None else first.prefix[1]
        if np.count_nonzero(np.asarray(prompt[cached:]) == f.placeholder):  # reference rows still to prefill
            raise ValueError("takes need the voice made first (make_voice): its rows are then in its prefix")
        cache = be.new_cache(len(prompt), state)  # the whole prompt, prefilled once for every take
        hidden = be.prefill(cache, prompt_embeddings(be, prompt[cached:], f.placeholder, None))
        shared = (len(prompt), be.snapshot(cache))
        del cache
        kw = {} if voice is None else {"ref_rows": voice.rows, "ref_text": voice.ref_text}
        reqs = [self.prompts.request(text, dataclasses.replace(options, seed=seed), prefix=shared, slot=positions,
                                     **kw) for seed in seeds]
        for r in reqs:
            r.start_hidden = hidden  # the prompt's last hidden state: each take samples its first row from it
        with self.scheduler(len(reqs), positions) as sched:
            handles = [sched.submit(r, None) for r in reqs]  # rows only: only the takes it needs get decoded
            return [h.wait() for h in handles]

    def speech_of(self, req: Request) -> Speech:
        """A finished request's audio, decoded in one codec call (every frame of its rows)."""
        f = self.facts
        return speech_from(req, req.new_frames(), self.decode_audio, f.sample_rate, f.codebook_size)

    def stream(self, text: str, ref_audio=None, ref_text: str | None = None, voice: Voice | None = None,
               options: GenerationOptions | None = None, stream_options: StreamOptions | None = None, *,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None, max_rows: int | None = None, on_row: Callable[[int], None] | None = None
               ) -> Iterator[AudioChunk]:
        """Speech for `text` as `AudioChunk`s while it is generated (arguments as `generate`; `stream_options`
        sizes the chunks). The chunks concatenate to `generate`'s waveform for the same request and seed. Stopping
        early (closing the iterator) frees the request's state. Bad arguments raise here, not at the first chunk."""
        req = self.request(text, ref_audio, ref_text, voice, options, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=seed, max_rows=max_rows)
        return self.run(req, "stream", stream_options, on_row=on_row)

    def run(self, request: Request, audio: str | None = "speech", stream_options: StreamOptions | None = None, *,
            on_row: Callable[[int], None] | None = None, retry: RetryPolicy | None = None):
        """Run one prepared `request` (from `request(...)`, no slot) to its end as a batch of one on a scheduler of
        its own: `audio="speech"` returns its `Speech` (one codec decode at the end), `"stream"` an iterator of
        `AudioChunk`s while it is made (closing it early frees the request), None the finished `Request` (its
        `generated` rows, no audio). `on_row(n)` is called after each row. For several requests decoded together,
        use one `scheduler(slots, positions)`. A voice blend runs on a pool of its own, a slot per voice, so its
        voices share each decoder call."""
        loads = self.parts.load_clock()  # sessions made before it runs (the backend's, a stream's codec): its load
        if audio == "stream":
            sched = self._own_scheduler(request)
            try:
                handle = sched.submit(request, "stream", stream_options or StreamOptions(), on_row=on_row)
            except BaseException:
                sched.close()
                raise
            request.load_s += self.parts.load_clock() - loads
            return _closing(handle.chunks(), sched)
        with self._own_scheduler(request) as sched:
            handle = sched.submit(request, audio, on_row=on_row, retry=retry)
            request.load_s += self.parts.load_clock() - loads
            return handle.wait()

    def _own_scheduler(self, request: Request) -> Scheduler:
        """A batch of one: caches of their own; a blend, a pool of a slot per voice sized for its longest member."""
        if request.width == 1:
            return self.scheduler()
        return self.scheduler(request.width, max(len(m.prompt) + m.max_rows for m in request.members))

    def scheduler(self, slots: int = 1, positions: int | None = None, prefill: PrefillPolicy | None = None,
                  max_waiting: int | None = None, idle_unload: float | None = None) -> Scheduler:
        """A `Scheduler` on this model: `slots` requests decoded together in one pool of `positions` per slot
        (None: a batch of one on caches of their own, as `generate` / `stream` use). Requests for it are made with
        `request(..., slot=positions)`. Caller-driven until `start()` gives it a thread. `idle_unload`: seconds
        with nothing in flight, queued or kept after which its thread unloads this model (`unload`), loaded again
        before the next request starts (the server's --idle-unload)."""
        return Scheduler(self.backend, self, slots, positions, prefill, max_waiting, idle_unload=idle_unload)

    def make_voice(self, ref_audio, ref_text: str | None = None) -> Voice:
        """Encode a reference and prefill its prompt prefix once; kept in memory for later calls."""
        if ref_text is not None:  # before the (slow) encoding
            encode_user_text(self.tokenizer, self.tokens, ref_text, "the reference transcript", "ref_text")
        wav = self.reference(ref_audio)
        return self._voice(("wav", hashlib.sha256(wav.tobytes()).hexdigest(), ref_text),
                           lambda: reference_rows(self, self.facts, wav), ref_text)

    def voice_from_codes(self, codes: np.ndarray, ref_text: str | None = None) -> Voice:
        """A voice from raw codes (T, N) this model generated (long-form keeps the voice its first chunk chose)."""
        from ..generation.delay import apply_delay

        raw = np.where(codes >= self.facts.codebook_size, 0, codes).astype(np.int64)
        return self._voice(("codes", hashlib.sha256(raw.tobytes()).hexdigest(), ref_text),
                           lambda: apply_delay(raw, self.facts.boc, self.facts.eoc), ref_text)

    def _voice(self, key: tuple, make_rows: Callable[[], np.ndarray], ref_text: str | None) -> Voice:
        voice = self.voices.get(key)
        if voice is None:
            voice = prefill_voice(self.backend, self.tokenizer, self.tokens, self.facts, make_rows(), ref_text,
                                  self.model_id)
            voice = self.voices.put(key, voice)
        return voice

    def forget_voice(self, voice: Voice) -> bool:
        """Drop a voice from the cache (a deleted voice): its memory is freed once no request uses it."""
        return self.voices.forget(voice) > 0




def retry_policy(retries: int | RetryPolicy | None) -> RetryPolicy | None:
    """A retry count (0 or None: no retries) or a policy -> the policy, or None."""
    if retries is None or isinstance(retries, RetryPolicy):
        return retries
    if isinstance(retries, bool) or not isinstance(retries, int):
        raise ValueError(f"retries must be a whole number, got {retries!r}")
    return RetryPolicy(retries=retries) if retries else None


def _closing(chunks: Iterator[AudioChunk], sched: Scheduler) -> Iterator[AudioChunk]:
    """`chunks`, closing their private scheduler at the end (or when the consumer stops early)."""
    try:
        yield from chunks
    finally:
        chunks.close()
        sched.close()


def _rows(max_rows: int | None, max_frames: int | None) -> int | None:
    if max_frames is not None:
        import warnings

        if max_rows is not None:
            raise TypeError("give max_rows only (max_frames is its old name)")
        warnings.warn("max_frames is now called max_rows", DeprecationWarning, stacklevel=3)
        return max_frames
    return max_rows
