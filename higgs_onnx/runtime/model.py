"""`HiggsTTS`: load an `onnx/<device>_<precision>/` folder once, generate many times. ONNX Runtime only.

    tts = HiggsTTS("onnx/cpu_int4")
    speech = tts.generate("Hello there.", ref_audio="me.wav", ref_text="What I said.", temperature=0.8)
    speech.waveform, speech.sample_rate, speech.codes, speech.rows, speech.stats
    for chunk in tts.stream("Hello there."):       # audio while the model is still talking
        play(chunk.samples)

Thread safety: one `HiggsTTS` may be shared by threads. Each call makes its own `Request` (KV cache, sampler RNG,
rows), the ONNX Runtime sessions allow concurrent runs, and the lazily made sessions and the voice cache are
guarded by a lock; concurrent calls compete for the same cores, so they do not run faster together (batching
them into one decoder call is what the server does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import providers
from ..audio import load_reference, prepare_reference
from ..checkpoint import ModelFacts
from ..generation.contract import ContractError, Limits, check_max_rows, min_rows
from ..generation.engine import Request, prompt_embeddings
from ..generation.options import GenerationOptions
from ..generation.pipeline import Speech, Synthesizer, reference_rows
from ..generation.prompt import PromptTokens, build_prefix, encode_user_text
from ..generation.scheduler import PrefillPolicy, Scheduler
from ..generation.stream import AudioChunk
from ..manifest import ManifestError, load_manifest
from .decoder import BoundDecoder, ConcatDecoder, SimpleDecoder
from .session import Part, check_threads, open_part
from .stream import CodecStream, StatefulCodecStream, StreamOptions
from .voice_cache import DEFAULT_VOICE_CACHE_BYTES, VoiceCache

log = logging.getLogger(__name__)

STATEFUL_CODEC = "audio_tokenizer_stream"


VOICE_FILE = "a voice file is the .npz written by inference.py --save-voice (or HiggsTTS.make_voice(...).save(path))"
# what np.load / reading an archive member raises on a file that is not an intact .npz
_NPZ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


class VoiceFileError(ValueError):
    """A file given as a voice that `Voice.save` did not write (or that was damaged since)."""


def _read_voice(path: Path) -> dict:
    """The fields of a `Voice` from an .npz written by `Voice.save`, checked; VoiceFileError says what is wrong."""
    try:
        npz = np.load(path, allow_pickle=False)
    except _NPZ_ERRORS:
        raise VoiceFileError("not an .npz archive") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise VoiceFileError("a single .npy array, not an .npz archive")
    with npz:
        missing = [k for k in ("rows", "prefix", "meta") if k not in npz.files]
        if not any(k.startswith("kv:") for k in npz.files):
            missing.append("kv:* (the prefill state)")
        if missing:
            raise VoiceFileError(f"missing {', '.join(missing)}")
        try:
            a = {k: npz[k] for k in npz.files}
        except _NPZ_ERRORS:
            raise VoiceFileError("a damaged or non-numeric array inside") from None
    try:
        meta = json.loads(str(a["meta"]))
        ref_text, model_id = meta["ref_text"], meta["model_id"]
        if not isinstance(model_id, str) or not isinstance(ref_text, (str, type(None))):
            raise TypeError(meta)
    except (ValueError, KeyError, TypeError):
        raise VoiceFileError("meta is not the JSON Voice.save writes") from None
    rows, prefix, state = a["rows"], a["prefix"], {k[3:]: v for k, v in a.items() if k.startswith("kv:")}
    if rows.ndim != 2 or rows.dtype.kind not in "iu":
        raise VoiceFileError(f"rows must be integer codes (R, N), got {rows.dtype} {rows.shape}")
    if prefix.ndim != 1 or prefix.dtype.kind not in "iu":
        raise VoiceFileError(f"prefix must be integer token ids (P,), got {prefix.dtype} {prefix.shape}")
    for name, kv in state.items():  # (1, kv_heads, P, head_dim): the cache after the P prefix positions
        if kv.dtype.kind != "f" or kv.ndim != 4 or kv.shape[2] != len(prefix):
            raise VoiceFileError(f"kv:{name} must be a float (1, H, {len(prefix)}, D) cache, got {kv.dtype} "
                                 f"{kv.shape}")
    return {"rows": rows.astype(np.int64), "ref_text": ref_text, "prefix": prefix.astype(np.int64).tolist(),
            "state": state, "model_id": model_id}


@dataclass
class Voice:
    """A reference voice, ready to reuse: its delayed code rows and the decoder state after its prompt prefix."""

    rows: np.ndarray  # (R, N) delayed reference rows
    ref_text: str | None
    prefix: list[int]  # prompt ids before <|text|>
    state: dict[str, np.ndarray]  # KV cache of the prefix, per past input name
    model_id: str  # the export it belongs to

    def save(self, path: str | os.PathLike) -> Path:
        """An .npz (no pickle) with the rows, the prefix ids, the KV state and the owning export's id."""
        path = Path(path)
        meta = json.dumps({"ref_text": self.ref_text, "model_id": self.model_id})
        tmp = path.with_name(path.name + ".partial.npz")
        np.savez(tmp, rows=self.rows, prefix=np.asarray(self.prefix, np.int64), meta=np.asarray(meta),
                 **{f"kv:{n}": a for n, a in self.state.items()})
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model_id: str) -> Voice:
        """A voice saved by `save`; anything else is refused with what makes a voice file."""
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"voice file {path} is a folder; {VOICE_FILE}")
        if not path.is_file():
            raise FileNotFoundError(f"voice file {path} does not exist")
        try:
            voice = cls(**_read_voice(path))
        except VoiceFileError as e:
            raise VoiceFileError(f"{path} is not a voice file ({e}); {VOICE_FILE}") from None
        if voice.model_id != model_id:
            raise ValueError(f"{path} was made with another export; make it again with --save-voice")
        return voice


class OnnxBackend:
    """The generation `Backend` protocol on the exported parts; every request gets its own KV cache."""

    def __init__(self, tts: HiggsTTS, kv_cache: str = "bound"):
        self.tts = tts
        part = tts.part("llm_decoder")
        p = providers.get(tts.provider)
        if kv_cache != "bound" or p.ort_name is None:  # the OpenVINO runtime: host arrays in and out
            self.decoder = SimpleDecoder(part, tts.facts)
        elif tts.manifest.decoder["cache"] == "concat":
            self.decoder = ConcatDecoder(part, tts.facts, p.memory)
        else:
            self.decoder = BoundDecoder(part, tts.facts, p.memory, p.offset_binding)

    def embed_text(self, ids: np.ndarray) -> np.ndarray:
        return self.tts.part("text_embed")(input_ids=ids[None])["embeddings"][0].astype(np.float32, copy=False)

    def embed_audio(self, rows: np.ndarray) -> np.ndarray:
        return self.tts.part("audio_embed")(audio_codes=rows[None])["embeddings"][0].astype(np.float32, copy=False)

    def new_cache(self, max_len: int, state: dict | None = None):
        return self.decoder.new_cache(max_len, state)

    def prefill(self, cache, embeds: np.ndarray) -> np.ndarray:
        return self.decoder.run(cache, embeds)[-1]

    def decode(self, cache, embed: np.ndarray) -> np.ndarray:
        return self.decoder.run(cache, embed)[-1]

    def audio_logits(self, hidden: np.ndarray) -> np.ndarray:
        """(B, D) -> (B, N, V): the B rows go through the head as positions of one sequence."""
        return self.tts.part("audio_heads")(hidden_states=hidden[None])["logits"][0].astype(np.float32, copy=False)

    def pool(self, slots: int, max_len: int):
        """Slots for continuous batching: one batched decoder call per step on the GQA graph (`SlotPool`), rows
        stepped one by one otherwise (`SerialPool`)."""
        return self.decoder.pool(slots, max_len)

    def decode_batch(self, caches: list, embeds: np.ndarray) -> np.ndarray:
        return caches[0].pool.run_batch(caches, embeds)


class HiggsTTS:
    """One exported model folder: its manifest, tokenizer and ONNX Runtime sessions (created on first use)."""

    def __init__(self, model_path: str | os.PathLike, provider: str | None = None, threads: int = 0,
                 verify: bool = True, kv_cache: str = "bound", voice_cache_bytes: int = DEFAULT_VOICE_CACHE_BYTES):
        from tokenizers import Tokenizer

        check_threads(threads)  # before the (slow) hashing of the model files
        self.manifest = load_manifest(model_path, verify=verify)
        built_for = self.manifest.data["device"]
        self.provider = provider or built_for
        if self.provider not in providers.runners(built_for):
            raise ValueError(f"{model_path} was built for {self.manifest.data['execution_provider']} "
                             f"(device {built_for}); run it with --provider {built_for}, or build a "
                             f"{self.provider} export: python optimize.py --device {self.provider} ...")
        folder = self.manifest.folder
        try:
            self.facts = ModelFacts.from_dict(self.manifest.model)
        except ValueError as e:
            raise ManifestError(f"{folder}/manifest.json: {e}") from None
        tok_path = self.manifest.path(self.manifest.data["tokenizer"])
        try:
            self.tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a bare Exception on unreadable files
            raise ManifestError(f"cannot load the tokenizer {tok_path}: {e}") from None
        self.tokens = PromptTokens.from_tokenizer(self.tokenizer, self.facts.placeholder)  # ids by string
        if self.manifest.data["tokens"] != dataclasses.asdict(self.tokens):
            raise ManifestError(f"{folder}: the token ids in manifest.json disagree with {tok_path.name}")
        self._check_genai_config()
        self.threads, self.kv_cache = threads, kv_cache
        self._parts: dict[str, Part] = {}
        self._synth: Synthesizer | None = None
        self.voices = VoiceCache(voice_cache_bytes)  # voices made from references, LRU by bytes
        self._lock = threading.RLock()  # sessions and the voice cache are made once, whichever thread asks first

    def _check_genai_config(self) -> None:
        import json

        path = self.manifest.path(self.manifest.data.get("genai_config", "genai_config.json"))
        try:
            dec = json.loads(path.read_text())["model"]["decoder"]
            ok = (dec["head_size"], dec["num_key_value_heads"]) == (self.facts.head_dim, self.facts.kv_heads)
        except (OSError, ValueError, KeyError, TypeError):
            raise ManifestError(f"{path} is missing or malformed (rebuild with optimize.py --force)") from None
        if not ok:
            raise ManifestError(f"{path}: head size / KV heads disagree with the manifest's model facts")

    def part(self, name: str) -> Part:
        if name not in self._parts:
            with self._lock:
                if name not in self._parts:
                    part = open_part(name, self.manifest.part_file(name), self.provider, self.threads)
                    self._check_io(name, part)
                    self._parts[name] = part
        return self._parts[name]

    def ran_on(self) -> dict[str, str]:
        """{part: the provider/device its session runs on} for the parts loaded so far (each was checked at load:
        a part that would fall back to another device is an error, never a silent fallback)."""
        return {n: p.session.get_providers()[0] for n, p in sorted(self._parts.items())}

    def _check_io(self, name: str, part: Part) -> None:
        """The session's I/O must be what the manifest recorded and fit the model facts (readable diff if not)."""
        entry = self.manifest.parts[name]
        recorded = {x["name"] for x in entry["inputs"]}, {x["name"] for x in entry["outputs"]}
        actual = {i.name for i in part.session.get_inputs()}, {o.name for o in part.session.get_outputs()}
        if recorded != actual:
            raise ManifestError(f"{name}: the graph's inputs/outputs {sorted(actual[0])} -> {sorted(actual[1])} differ "
                                f"from the manifest's {sorted(recorded[0])} -> {sorted(recorded[1])}")
        f = self.facts
        want = {"llm_decoder": ("inputs_embeds", -1, f.hidden), "text_embed": ("embeddings", -1, f.hidden),
                "audio_embed": ("audio_codes", -1, f.num_codebooks), "audio_heads": ("logits", -1, f.codebook_vocab),
                "audio_tokenizer": ("audio_codes", 1, f.num_codebooks),
                STATEFUL_CODEC: ("audio_codes", 1, f.num_codebooks)}.get(name)
        if want:
            io, axis, size = want
            shapes = {x.name: x.shape for x in part.session.get_inputs() + part.session.get_outputs()}
            dim = shapes[io][axis]
            if isinstance(dim, int) and dim != size:
                raise ManifestError(f"{name}: {io} has size {dim} on axis {axis}; the manifest's model facts say "
                                    f"{size}")

    @property
    def synthesizer(self) -> Synthesizer:
        if self._synth is None:
            with self._lock:
                if self._synth is None:
                    self._synth = Synthesizer(OnnxBackend(self, self.kv_cache), self, self.tokenizer, self.tokens,
                                              self.facts)
        return self._synth

    @property
    def backend(self) -> OnnxBackend:
        return self.synthesizer.backend

    # -- codec ------------------------------------------------------------------------------------------------
    def encode_audio(self, wav: np.ndarray) -> np.ndarray:
        """(L,) float32 mono at the codec rate -> (T, N) int64 codes."""
        return self.part("audio_encoder")(waveform=wav[None])["audio_codes"][0].T.astype(np.int64)

    def decode_audio(self, codes: np.ndarray) -> np.ndarray:
        """(1, N, T) int64 codes in [0, codebook_size) -> (hop*T,) float32."""
        return self.part("audio_tokenizer")(audio_codes=codes)["waveform"][0, 0].astype(np.float32, copy=False)

    def reference(self, ref_audio) -> np.ndarray:
        """A file path, or (waveform, sample_rate) -> mono waveform at the codec rate."""
        if isinstance(ref_audio, (str, os.PathLike)):
            return load_reference(ref_audio, self.facts.sample_rate)
        wav, sr = ref_audio
        return prepare_reference(np.asarray(wav), int(sr), self.facts.sample_rate)

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
        here: nothing is cut to fit later.
        """
        started = time.perf_counter()
        options = GenerationOptions.make(options, **keywords)
        if ref_text is not None and ref_audio is None:
            raise ValueError("ref_text (a transcript of the reference) needs ref_audio")
        if voice is not None and ref_audio is not None:
            raise ValueError("give either voice or ref_audio, not both")
        if voice is None and ref_audio is not None:
            # what can be refused without the voice is refused before it is made (the synthesizer checks it all)
            check_max_rows(options.max_rows, self.facts.num_codebooks, self.limits(slot))
            encode_user_text(self.tokenizer, self.tokens, text)
            voice = self.make_voice(ref_audio, ref_text)  # made once per reference, then cached
        voice_s = time.perf_counter() - started
        kwargs = {} if voice is None else {"ref_rows": voice.rows, "ref_text": voice.ref_text,
                                           "prefix": (len(voice.prefix), voice.state)}
        return self.synthesizer.request(text, options, voice_s=voice_s, started=time.perf_counter(),
                                        history=list(history), slot=slot, continues=continues, **kwargs)

    def limits(self, slot: int | None = None) -> Limits:
        """The positions a request may use: the model's context, and the batching slot's when it runs in one."""
        return Limits(self.facts.max_positions, slot)

    def generate(self, text: str, ref_audio=None, ref_text: str | None = None, voice: Voice | None = None,
                 options: GenerationOptions | None = None, *, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 max_rows: int | None = None, on_row: Callable[[int], None] | None = None,
                 max_frames: int | None = None) -> Speech:
        """Speech for `text`, decoded once at the end (see `request` for the arguments; `stream` for audio as it is
        made). A voice made from `ref_audio` is kept in memory, so the next clone with the same reference skips the
        codec encoder and the reference's prefill. `max_frames` is the old name of `max_rows`."""
        req = self.request(text, ref_audio, ref_text, voice, options, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=seed, max_rows=_rows(max_rows, max_frames))
        with self.scheduler() as sched:  # a batch of one, on a cache of its own
            return sched.submit(req, "speech", on_row=on_row).speech()

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
        sched = self.scheduler()  # a batch of one, on a cache of its own
        try:
            handle = sched.submit(req, "stream", stream_options or StreamOptions(), on_row=on_row)
        except BaseException:
            sched.close()
            raise
        return _closing(handle.chunks(), sched)

    def scheduler(self, slots: int = 1, positions: int | None = None, prefill: PrefillPolicy | None = None,
                  max_waiting: int | None = None) -> Scheduler:
        """A `Scheduler` on this model: `slots` requests decoded together in one pool of `positions` per slot
        (None: a batch of one on caches of their own, as `generate` / `stream` use). Requests for it are made with
        `request(..., slot=positions)`. Caller-driven until `start()` gives it a thread."""
        return Scheduler(self.backend, self, slots, positions, prefill, max_waiting)

    @property
    def has_stateful_codec(self) -> bool:
        """Whether the export has the stateful streaming codec (folders built before it decode windows)."""
        return STATEFUL_CODEC in self.manifest.parts

    def codec_stream(self, options: StreamOptions):
        """The incremental codec decoder for one stream (see `runtime.stream`): the stateful graph (every frame
        decoded once) unless the export predates it or `options.codec` asks for overlapping windows."""
        f = self.facts
        if options.codec == "stateful" and not self.has_stateful_codec:
            raise ValueError(f"{self.manifest.folder} has no {STATEFUL_CODEC} part (built before it existed); "
                             f"rebuild with optimize.py, or stream with codec='window'")
        if options.codec != "window" and self.has_stateful_codec:
            return StatefulCodecStream(self.part(STATEFUL_CODEC), f.hop, f.codebook_size, options)
        return CodecStream(self.decode_audio, f.hop, f.codebook_size, options)

    @property
    def model_id(self) -> str:
        """Identity of the parts a voice state depends on (hashes from the manifest)."""
        parts = self.manifest.parts
        hashes = [parts[p]["files"][parts[p]["file"]]["sha256"] for p in
                  ("llm_decoder", "text_embed", "audio_embed", "audio_encoder")]
        return hashlib.sha256("".join(hashes).encode()).hexdigest()

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
            rows = make_rows()
            prefix = build_prefix(self.tokenizer, self.tokens, len(rows), ref_text)
            room = self.facts.max_positions - len(prefix)
            if room < min_rows(self.facts.num_codebooks) + 3:  # + <|text|>, one token, <|audio|>
                raise ContractError(f"the voice's prompt is {len(prefix)} positions ({len(rows)} reference rows and "
                                    f"its transcript), but the model's context holds {self.facts.max_positions}: "
                                    f"use a shorter reference clip or transcript", "ref_text" if ref_text else "file",
                                    "context_length_exceeded")
            be = self.backend
            embeds = prompt_embeddings(be, prefix, self.facts.placeholder, rows)
            cache = be.new_cache(len(prefix))
            be.prefill(cache, embeds)
            voice = Voice(rows=rows, ref_text=ref_text, prefix=prefix, state=be.decoder.snapshot(cache),
                          model_id=self.model_id)
            voice = self.voices.put(key, voice)
        return voice

    def forget_voice(self, voice: Voice) -> bool:
        """Drop a voice from the cache (a deleted voice): its memory is freed once no request uses it."""
        return self.voices.forget(voice) > 0

    def decode_rows(self, rows: np.ndarray, delayed: bool = True) -> np.ndarray:
        """Code rows from elsewhere -> waveform; `delayed` rows are reversed first, codes >= codebook size -> 0."""
        from ..generation.delay import codes_for_codec, reverse_delay

        raw = reverse_delay(rows) if delayed else rows
        return self.decode_audio(codes_for_codec(raw, self.facts.codebook_size))


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
