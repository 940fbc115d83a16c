"""The PyTorch reference: the ground truth that export, inference and eval are compared against.

- Qwen3 body: transformers `Qwen3Model` with the checkpoint's `body.*` / text-embedding tensors (spec §2.1 mapping).
- Fused audio embedding / tied audio head: one [N*V, D] matrix (spec §4): embed = sum of N rows, head = h @ W^T.
- Codec: transformers `HiggsAudioV2TokenizerModel` from the codec config and the checkpoint's codec tensors,
  always fp32 (SGO: ConvTranspose is unstable in bf16).
`ReferenceBackend` implements the generation `Backend` protocol, so the reference runs the shared loop.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from ..audio import load_reference
from ..checkpoint import (
    AUDIO_EMBED,
    CODEC_PREFIX,
    TEXT_EMBED,
    WEIGHTS,
    codec_config,
    validate,
)
from ..generation.options import GenerationOptions
from ..generation.pipeline import Speech, Synthesizer, reference_rows
from ..generation.prompt import PromptTokens
from ..generation.sampling import SamplingOptions
from .body import forward, load_body

log = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def codec_kwargs(ccfg: dict) -> dict:
    """Codec config -> HiggsAudioV2TokenizerConfig kwargs (drop the keys the class must not receive, spec §6)."""
    return {k: v for k, v in ccfg.items() if k not in ("model_type", "architectures", "dtype", "transformers_version")}


def load_codec(folder: Path) -> torch.nn.Module:
    """The codec of a checkpoint folder as an fp32 `HiggsAudioV2TokenizerModel` in eval mode."""
    from transformers import HiggsAudioV2TokenizerConfig

    from .torchaudio_shim import load_codec_class

    cls = load_codec_class()
    with torch.device("meta"):
        codec = cls(HiggsAudioV2TokenizerConfig(**codec_kwargs(codec_config(folder))))
    state = {}
    with safe_open(folder / WEIGHTS, "pt") as f:
        for name in f.keys():
            if name.startswith(CODEC_PREFIX):
                state[name[len(CODEC_PREFIX):]] = f.get_tensor(name).float()
    state.pop("semantic_model.masked_spec_embed", None)  # present in the real file, unused (mask_time_prob 0)
    missing, unexpected = codec.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"codec tensors do not match the codec config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return codec.eval()


def load_tensor(folder: Path, name: str, dtype: torch.dtype) -> torch.Tensor:
    with safe_open(folder / WEIGHTS, "pt") as f:
        return f.get_tensor(name).to(dtype)


def parity_dtype(facts) -> str:
    """The reference precision for parity checks: fp32, or bf16 for full-size models (an fp32 4B body is 16 GB)."""
    return "fp32" if facts.hidden < 1024 else "bf16"


class ReferenceModel:
    """All PyTorch parts of one checkpoint folder."""

    def __init__(self, folder: str | Path, dtype: str = "fp32", stream: bool | None = None):
        """`stream`: hold the body one layer at a time (None: when it is larger than 1 GiB, see `body.py`)."""
        from tokenizers import Tokenizer

        self.folder, self.stream = Path(folder), stream
        self.facts = validate(self.folder)
        self.dtype = DTYPES[dtype]
        self._body = self._codec = self._audio = self._text = None  # loaded on first use
        self.tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        f = self.facts
        self.offsets = torch.arange(f.num_codebooks) * f.codebook_vocab  # row offset of each codebook
        self.tokens = PromptTokens.from_tokenizer(self.tokenizer, f.placeholder)

    def generate(self, text: str, ref_audio: str | Path | np.ndarray | None = None, ref_text: str | None = None,
                 options: GenerationOptions | None = None, *, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 max_rows: int | None = None, on_row=None, sampling: SamplingOptions | None = None) -> Speech:
        """Codes and a waveform for `text`, with the same options and keywords as `HiggsTTS.generate`;
        `ref_audio` is a file or a mono waveform at the codec rate; `sampling` sets the three sampling values."""
        import time

        started = time.perf_counter()
        options = GenerationOptions.make(options, sampling, temperature=temperature, top_k=top_k, top_p=top_p,
                                         seed=seed, max_rows=max_rows)
        if ref_text is not None and ref_audio is None:
            raise ValueError("ref_text (a transcript of the reference) needs ref_audio")
        ref_rows = None
        if isinstance(ref_audio, (str, Path)):
            ref_rows = reference_rows(self, self.facts, load_reference(ref_audio, self.facts.sample_rate))
        elif ref_audio is not None:
            ref_rows = reference_rows(self, self.facts, np.asarray(ref_audio, np.float32))
        synth = Synthesizer(ReferenceBackend(self), self, self.tokenizer, self.tokens, self.facts)
        req = synth.request(text, options, ref_rows=ref_rows, ref_text=ref_text,
                            voice_s=time.perf_counter() - started, started=time.perf_counter())
        return synth.speak(req, on_row)

    @property
    def body(self) -> torch.nn.Module:
        if self._body is None:
            self._body = load_body(self.folder, self.dtype, self.stream)
        return self._body

    def release_body(self) -> None:
        self._body = None

    def hidden_states(self, embeds: np.ndarray) -> np.ndarray:
        """(S, D) input embeddings -> (S, D) float32 last hidden states (after the final norm), one full forward."""
        return forward(self.body, embeds, self.dtype)

    def release_codec(self) -> None:
        """Drop the fp32 codec (0.8 GB on the real geometry); the next use loads it again."""
        self._codec = None

    @property
    def codec(self) -> torch.nn.Module:
        if self._codec is None:
            self._codec = load_codec(self.folder)
        return self._codec

    @property
    def audio_matrix(self) -> torch.Tensor:
        """The fused audio embedding = tied audio head, [N*V, D]."""
        if self._audio is None:
            self._audio = load_tensor(self.folder, AUDIO_EMBED, self.dtype)
        return self._audio

    @property
    def text_table(self) -> torch.Tensor:
        """The text embedding = tied text head, [vocab, D]."""
        if self._text is None:
            self._text = load_tensor(self.folder, TEXT_EMBED, self.dtype)
        return self._text

    # -- parts, torch in / torch out (used by export parity checks) ---------------------------------------------
    @torch.no_grad()
    def fused_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """(..., N) codes in [0, V) -> (..., D): sum of the N codebook rows."""
        return self.audio_matrix[codes + self.offsets].sum(dim=-2)

    @torch.no_grad()
    def audio_head(self, hidden: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """(..., D) -> (..., N, V) float32 logits, in the reference dtype and upcast after the matmul as SGO does;
        `exact`: in fp32 from the same weights (a bf16 matmul rounds logits of ~400 to steps of 2, so its argmax
        is a coin toss between close codes: export checks compare against the exact head instead)."""
        if exact:
            logits = hidden.float() @ self.audio_matrix.float().T
        else:
            logits = (hidden.to(self.dtype) @ self.audio_matrix.T).float()
        return logits.unflatten(-1, (self.facts.num_codebooks, self.facts.codebook_vocab))

    @torch.no_grad()
    def text_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text_table[ids]

    @torch.no_grad()
    def encode_audio(self, wav: np.ndarray) -> np.ndarray:
        """(L,) float32 mono at the codec rate -> (T, N) int64 codes."""
        codes = self.codec.encode(torch.from_numpy(np.ascontiguousarray(wav, np.float32))[None, None],
                                  return_dict=False)
        return codes[0].T.numpy().astype(np.int64)

    @torch.no_grad()
    def decode_audio(self, codes: np.ndarray) -> np.ndarray:
        """(1, N, T) int64 codes (already mapped to [0, codebook_size)) -> (hop*T,) float32 waveform."""
        return self.codec.decode(torch.from_numpy(codes), return_dict=False)[0, 0].numpy()


class ReferenceBackend:
    """The generation `Backend` protocol on the PyTorch reference; a request's cache is its own DynamicCache."""

    def __init__(self, model: ReferenceModel):
        self.model = model

    def _run(self, cache, embeds: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.ascontiguousarray(embeds, np.float32)).to(self.model.dtype)[None]
        with torch.no_grad():  # the DynamicCache is updated in place
            out = self.model.body(inputs_embeds=x, cache=cache, use_cache=True)
        return out.last_hidden_state[0, -1].float().numpy()

    def embed_text(self, ids: np.ndarray) -> np.ndarray:
        return self.model.text_embed(torch.from_numpy(ids)).float().numpy()

    def embed_audio(self, rows: np.ndarray) -> np.ndarray:
        return self.model.fused_embed(torch.from_numpy(rows)).float().numpy()

    def new_cache(self, max_len: int, state: dict | None = None):
        from transformers import DynamicCache

        if state is not None:
            raise NotImplementedError("the reference prefills every prompt in full (no saved voice states)")
        return DynamicCache(config=self.model.body.config)

    def prefill(self, cache, embeds: np.ndarray) -> np.ndarray:
        return self._run(cache, embeds)

    def decode(self, cache, embed: np.ndarray) -> np.ndarray:
        return self._run(cache, embed)

    def audio_logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.model.audio_head(torch.from_numpy(hidden)).numpy()
