"""`OnnxBackend`: the generation `Backend` / `BatchBackend` protocol (generation.engine) on an export's parts.

    be = OnnxBackend(parts)                     # parts: a runtime.parts.ModelParts (or anything with part(),
                                                # provider, facts, manifest: a HiggsTTS too)
    be.embed_text(ids); be.embed_audio(rows); be.audio_logits(hidden)
    cache = be.new_cache(max_len); be.prefill(cache, embeds); be.decode(cache, embed)
    pool = be.pool(slots, positions); be.decode_batch([slot, ...], embeds)

Public beside the protocol: `decoder` (the KV-cache decoder of runtime.decoder the export's graph needs:
`BoundDecoder`, `ConcatDecoder` or `SimpleDecoder`; benchmarks time its `run` alone), `kv_memory` (where the KV cache
lives) and `snapshot(cache)` (a cache's rows as host arrays: a voice's saved state). Every request gets its own KV
cache (or a slot of a pool); the backend holds none.
"""

from __future__ import annotations

import numpy as np

from .. import providers
from .decoder import BoundDecoder, ConcatDecoder, SimpleDecoder


class OnnxBackend:
    """The generation `Backend` protocol on the exported parts; every request gets its own KV cache.

    `kv_cache`: "bound" (default: the cache layout the export's decoder graph was built for, on the provider's
    device) or "host" (growing host arrays fed back through NumPy, `SimpleDecoder`: the plain path; the OpenVINO
    runtime always takes it)."""

    def __init__(self, parts, kv_cache: str = "bound"):
        self.parts = parts
        part = parts.part("llm_decoder")
        p = providers.get(parts.provider)
        if kv_cache != "bound" or p.ort_name is None:  # the OpenVINO runtime: host arrays in and out
            self.decoder = SimpleDecoder(part, parts.facts)
        elif parts.manifest.decoder["cache"] == "concat":
            self.decoder = ConcatDecoder(part, parts.facts, p.memory)
        else:
            self.decoder = BoundDecoder(part, parts.facts, p.memory, p.offset_binding)

    @property
    def kv_memory(self) -> str:
        """Where the KV cache lives: the ORT memory name of the decoder's buffers ("cpu", "cuda", ...), or "host"
        for caches of NumPy arrays fed back every step (`SimpleDecoder`)."""
        return getattr(self.decoder, "memory", "host")

    def embed_text(self, ids: np.ndarray) -> np.ndarray:
        return self.parts.part("text_embed")(input_ids=ids[None])["embeddings"][0].astype(np.float32, copy=False)

    def embed_audio(self, rows: np.ndarray) -> np.ndarray:
        out = self.parts.part("audio_embed")(audio_codes=rows[None])["embeddings"][0]
        return out.astype(np.float32, copy=False)

    def new_cache(self, max_len: int, state: dict | None = None):
        return self.decoder.new_cache(max_len, state)

    def snapshot(self, cache) -> dict[str, np.ndarray]:
        """The cache's rows so far as host arrays, per past input name (what `Voice.state` holds)."""
        return self.decoder.snapshot(cache)

    def prefill(self, cache, embeds: np.ndarray) -> np.ndarray:
        return self.decoder.run(cache, embeds)[-1]

    def decode(self, cache, embed: np.ndarray) -> np.ndarray:
        return self.decoder.run(cache, embed)[-1]

    def audio_logits(self, hidden: np.ndarray) -> np.ndarray:
        """(B, D) -> (B, N, V): the B rows go through the head as positions of one sequence."""
        out = self.parts.part("audio_heads")(hidden_states=hidden[None])["logits"][0]
        return out.astype(np.float32, copy=False)

    def pool(self, slots: int, max_len: int):
        """Slots for continuous batching: one batched decoder call per step on the GQA graph (`SlotPool`), rows
        stepped one by one otherwise (`SerialPool`)."""
        return self.decoder.pool(slots, max_len)

    def decode_batch(self, caches: list, embeds: np.ndarray) -> np.ndarray:
        return caches[0].pool.run_batch(caches, embeds)
