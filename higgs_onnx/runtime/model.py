"""`HiggsTTS`: load an `onnx/<device>_<precision>/` folder once, generate many times. ONNX Runtime only.

    tts = HiggsTTS("onnx/cpu_int4")
    speech = tts.generate("Hello there.", ref_audio="me.wav", ref_text="What I said.", temperature=0.8)
    speech.waveform, speech.sample_rate, speech.codes, speech.rows, speech.stats
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..audio import load_reference, prepare_reference
from ..checkpoint import ModelFacts
from ..generation.pipeline import DEFAULT_MAX_ROWS, Speech, reference_rows, synthesize
from ..generation.prompt import PromptTokens
from ..generation.sampling import SamplingOptions
from ..manifest import load_manifest
from .decoder import BoundDecoder, SimpleDecoder
from .session import Part

log = logging.getLogger(__name__)

# which runtime providers can run a folder built for each device
COMPATIBLE = {"cpu": ("cpu", "openvino"), "cuda": ("cuda",), "dml": ("dml",)}


class OnnxBackend:
    """The generation `Backend` protocol on the exported parts."""

    def __init__(self, tts: HiggsTTS, kv_cache: str = "bound"):
        self.tts = tts
        part = tts.part("llm_decoder")
        self.decoder = BoundDecoder(part, tts.facts) if kv_cache == "bound" else SimpleDecoder(part, tts.facts)

    def embed_text(self, ids: np.ndarray) -> np.ndarray:
        return self.tts.part("text_embed")(input_ids=ids[None])["embeddings"][0].astype(np.float32, copy=False)

    def embed_audio(self, rows: np.ndarray) -> np.ndarray:
        return self.tts.part("audio_embed")(audio_codes=rows[None])["embeddings"][0].astype(np.float32, copy=False)

    def prefill(self, embeds: np.ndarray, max_len: int) -> np.ndarray:
        return self.decoder.prefill(embeds, max_len)[-1]

    def decode(self, embed: np.ndarray) -> np.ndarray:
        return self.decoder.step(embed)[-1]

    def audio_logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.tts.part("audio_heads")(hidden_states=hidden[None, None])["logits"][0, 0].astype(np.float32)


class HiggsTTS:
    """One exported model folder: its manifest, tokenizer and ONNX Runtime sessions (created on first use)."""

    def __init__(self, model_path: str | os.PathLike, provider: str | None = None, threads: int = 0,
                 verify: bool = True, kv_cache: str = "bound"):
        from tokenizers import Tokenizer

        self.manifest = load_manifest(model_path, verify=verify)
        built_for = self.manifest.data["device"]
        self.provider = provider or built_for
        if self.provider not in COMPATIBLE.get(built_for, ()):
            raise ValueError(f"{model_path} was built for {self.manifest.data['execution_provider']} "
                             f"(device {built_for}); run it with --provider {built_for}, or build a "
                             f"{self.provider} export: python optimize.py --device {self.provider} ...")
        names = {f.name for f in dataclasses.fields(ModelFacts)}
        self.facts = ModelFacts(**{k: v for k, v in self.manifest.model.items() if k in names})
        self.tokenizer = Tokenizer.from_file(str(self.manifest.path(self.manifest.data["tokenizer"])))
        self.tokens = PromptTokens(**self.manifest.data["tokens"])
        self.threads, self.kv_cache = threads, kv_cache
        self._parts: dict[str, Part] = {}
        self._backend: OnnxBackend | None = None

    def part(self, name: str) -> Part:
        if name not in self._parts:
            self._parts[name] = Part(name, self.manifest.part_file(name), self.provider, self.threads)
        return self._parts[name]

    @property
    def backend(self) -> OnnxBackend:
        if self._backend is None:
            self._backend = OnnxBackend(self, self.kv_cache)
        return self._backend

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

    # -- generation -------------------------------------------------------------------------------------------
    def generate(self, text: str, ref_audio=None, ref_text: str | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 max_frames: int = DEFAULT_MAX_ROWS, on_row: Callable[[int], None] | None = None) -> Speech:
        """Speech for `text`; `ref_audio` (a path or (waveform, rate)) clones a voice, `ref_text` is its transcript.

        Sampling values left None take the defaults of `SamplingOptions`. `max_frames` bounds the generated rows.
        """
        d = SamplingOptions()
        sampling = SamplingOptions(d.temperature if temperature is None else temperature,
                                   d.top_k if top_k is None else top_k, d.top_p if top_p is None else top_p)
        if ref_text is not None and ref_audio is None:
            raise ValueError("ref_text (a transcript of the reference) needs ref_audio")
        ref_wav = None if ref_audio is None else self.reference(ref_audio)
        speech, _ = synthesize(self.backend, self, self.tokenizer, self.tokens, self.facts, text, ref_wav=ref_wav,
                               ref_text=ref_text, sampling=sampling, seed=seed, max_rows=max_frames, on_row=on_row)
        return speech

    def decode_rows(self, rows: np.ndarray, delayed: bool = True) -> np.ndarray:
        """Code rows from elsewhere -> waveform; `delayed` rows are reversed first, codes >= codebook size -> 0."""
        from ..generation.delay import codes_for_codec, reverse_delay

        raw = reverse_delay(rows) if delayed else rows
        return self.decode_audio(codes_for_codec(raw, self.facts.codebook_size))

    def reference_rows(self, ref_audio) -> np.ndarray:
        return reference_rows(self, self.facts, self.reference(ref_audio))


def load(model_path: str | Path, **kwargs) -> HiggsTTS:
    return HiggsTTS(model_path, **kwargs)
