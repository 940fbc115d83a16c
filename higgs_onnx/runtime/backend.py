"""`OnnxBackend`: the generation `Backend` / `BatchBackend` protocol (generation.engine) on an export's parts.

    be = OnnxBackend(parts)                     # parts: a runtime.parts.ModelParts (or anything with part(),
                                                # provider, facts, manifest: a HiggsTTS too)
    be.embed_text(ids); be.embed_audio(rows); be.audio_logits(hidden)
    cache = be.new_cache(max_len); be.prefill(cache, embeds); be.decode(cache, embed)
    pool = be.pool(slots, positions); be.decode_batch([slot, ...], embeds)
    be.fused; be.decode_codes(cache, codes); be.decode_batch_codes([slot, ...], codes)   # the step graph

Public beside the protocol: `decoder` (the KV-cache decoder of runtime.decoder the export's graph needs:
`BoundDecoder`, `ConcatDecoder` or `SimpleDecoder`; benchmarks time its `run` alone), `kv_memory` (where the KV cache
lives) and `snapshot(cache)` (a cache's rows as host arrays: a voice's saved state). Every request gets its own KV
cache (or a slot of a pool); the backend holds none.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import providers
from ..part_facts import ROUTE_PART, STEP_PART
from . import route as routes
from .decoder import BoundDecoder, ConcatDecoder, SimpleDecoder, StatefulDecoder

KV_LAYOUTS = ("bound", "host")  # where a request's KV cache lives (see OnnxBackend)


class OnnxBackend:
    """The generation `Backend` protocol on the exported parts; every request gets its own KV cache.

    `kv_cache`: "bound" (default: the cache layout the export's decoder graph was built for, on the provider's
    device; on the OpenVINO runtime, a stateful compiled model holding it, `StatefulDecoder`) or "host" (growing
    host arrays fed back through NumPy, `SimpleDecoder`: the plain path). `step_graph`: run the export's step graph
    (`llm_step`: codes in, logits out, one call per decode step) in place of the decoder where the export has one;
    False drives the three parts apart. `route`: "auto" / "off" / "on" for the step graph's int8 GEMM twin where the
    export has one (`runtime/route.py`; it needs the bound cache and the step graph)."""

    def __init__(self, parts, kv_cache: str = "bound", step_graph: bool = True, route: str | None = None):
        self.parts = parts
        if kv_cache not in KV_LAYOUTS:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_LAYOUTS)}, got {kv_cache!r}")
        route = routes.check_mode(route)
        self.decoder_part = decoder_part(parts.manifest, step_graph)
        p = providers.get(parts.provider)
        if kv_cache == "bound" and p.ort_name is None:  # the OpenVINO runtime: the cache is the model's state
            self.decoder = StatefulDecoder(parts.part(self.decoder_part, stateful=True), parts.facts)
            self.fused = self.decoder.fused
            return
        part = parts.part(self.decoder_part)
        if kv_cache != "bound" or p.ort_name is None:  # host arrays in and out
            self.decoder = SimpleDecoder(part, parts.facts)
        elif parts.manifest.decoder["cache"] == "concat":
            self.decoder = ConcatDecoder(part, parts.facts, p.memory)
        else:
            policy = routes.NEVER
            if self.decoder_part == STEP_PART and ROUTE_PART in parts.manifest.parts:
                policy = routes.policy(parts.manifest.decoder.get("route"), route)
                if policy.active and not routes.fits(route_bytes(parts.manifest)):
                    policy = routes.NEVER
            elif route == "on":  # asked for by name: say why every call stays on int4
                routes.log.warning("route 'on': no int8 route next to the step graph here (an export built with "
                                   "--prefill-route none, refused by its gate or not cpu int4, or step_graph=False); "
                                   "every call runs on int4")
            self.decoder = BoundDecoder(part, parts.facts, p.memory, p.offset_binding,
                                        route=(lambda: parts.part(ROUTE_PART)) if policy.active else None,
                                        policy=policy)  # the route's session: made by the first call taking it
        self.fused = self.decoder.fused  # decode steps from codes to logits in one call

    @property
    def route_part(self) -> str | None:
        """The route's part name where calls may take it (`runtime/route.py`; its session is made by the first call
        that does, or by `HiggsTTS.preload`), else None."""
        return ROUTE_PART if getattr(self.decoder, "has_route", False) else None
    @property
    def load_clock(self) -> Callable[[], float] | None:
        """The parts' clock (`ModelParts.load_clock`: seconds this thread has spent making sessions), which the
        engine leaves out of a request's prefill and decode time. A request keeps it: it holds no session (a
        finished request kept by its handle must not keep the decoder's session past an idle unload)."""
        return getattr(self.parts, "load_clock", None)

    @property
    def kv_memory(self) -> str:
        """Where the KV cache lives: the ORT memory name of the decoder's buffers ("cpu", "cuda", ...), "state" (inside
        OpenVINO's stateful compiled model), or "host" for caches of NumPy arrays fed back every step
        (`SimpleDecoder`)."""
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

    def decode_codes(self, cache, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(step graph) (N,) sampled codes appended -> (D,) hidden state, (N, V) float32 logits of the next row."""
        return self.decoder.step(cache, codes)

    def decode_batch_codes(self, caches: list, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(step graph) one step of several requests of one pool: (B, N) codes -> (B, D), (B, N, V)."""
        return caches[0].pool.step_batch(caches, codes)


def route_bytes(manifest) -> int:
    """Bytes the int8 route's session adds: its int8 weights, the decoder part's files its manifest entry names."""
    names = manifest.decoder.get("route", {}).get("weights", [])
    files = manifest.parts.get("llm_decoder", {}).get("files", {})
    return sum(files[n]["size"] for n in names if n in files)


def decoder_part(manifest, step_graph: bool = True) -> str:
    """The part whose session holds the decoder's weights at run time: the step graph where the export has one
    (and `step_graph`), else the decoder. Only one of the two is ever loaded (they share the weights' file)."""
    return STEP_PART if step_graph and STEP_PART in manifest.parts else "llm_decoder"
