"""Each part's facts that the runtime and the exporter both read (torch-free, no other import of the package but the
manifest's part names): its graph's inputs and outputs, the io whose size must agree with the model's facts, whether
it is built per device, and the parts a derived one is made from. `parts/` builds them, `runtime/` loads them."""

from __future__ import annotations

from dataclasses import dataclass

from .manifest import DERIVED_PARTS, PART_NAMES

STEP_PART = "llm_step"  # the one-call step graph (parts/llm_step.py), made from the decoder, embedding and heads
ROUTE_PART = "llm_route"  # its twin on the int8 GEMM for many rows (parts/llm_route.py), sharing its KV cache


@dataclass(frozen=True)
class PartFacts:
    """A part's facts that the runtime and the exporter read (torch-free)."""

    name: str
    inputs: tuple[str, ...]  # the graph's named inputs (the decoder's past_key_values.* come from the model facts)
    outputs: tuple[str, ...]
    sized: tuple[str, int, str] | None = None  # (io name, axis, ModelFacts field) that must agree at load
    device_specific: bool = False  # its graph depends on the target EP: one build per device
    extra_files: tuple[str, ...] = ()  # files the part brings besides its graph (not hashed as its own)
    uses: tuple[str, ...] = ()  # a derived part: the built parts it is made from

    @property
    def derived(self) -> bool:
        return bool(self.uses)


FACTS = {f.name: f for f in (
    PartFacts("llm_decoder", ("inputs_embeds", "attention_mask"), ("hidden_states",), ("inputs_embeds", -1, "hidden"),
              device_specific=True, extra_files=("genai_config.json",)),
    PartFacts("text_embed", ("input_ids",), ("embeddings",), ("embeddings", -1, "hidden")),
    PartFacts("audio_embed", ("audio_codes",), ("embeddings",), ("audio_codes", -1, "num_codebooks")),
    PartFacts("audio_heads", ("hidden_states",), ("logits",), ("logits", -1, "codebook_vocab")),
    PartFacts("audio_encoder", ("waveform",), ("audio_codes",)),
    PartFacts("audio_tokenizer", ("audio_codes",), ("waveform",), ("audio_codes", 1, "num_codebooks")),
    PartFacts("audio_tokenizer_stream", ("audio_codes", "start", "end"), ("waveform",),  # + state_in/out.{k}
              ("audio_codes", 1, "num_codebooks")),
    PartFacts(STEP_PART, ("inputs_embeds", "audio_codes", "attention_mask"), ("hidden_states", "logits"),
              ("logits", -1, "codebook_vocab"), uses=("llm_decoder", "audio_embed", "audio_heads")),
    PartFacts(ROUTE_PART, ("inputs_embeds", "audio_codes", "attention_mask"), ("hidden_states", "logits"),
              ("logits", -1, "codebook_vocab"), uses=("llm_decoder", "audio_embed", "audio_heads")),
)}
assert set(FACTS) == set(PART_NAMES + DERIVED_PARTS)
