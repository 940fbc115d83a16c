"""One module per exported part, all of the same shape: `NAME`, `INPUTS`, `OUTPUTS`, `BUILD_VERSION` and
`build(job)`, which writes `job.out/<NAME>.onnx` (+ external data). Olive-built parts also have the Olive hooks
`load(model_path)`, `io_config(model_path)`, `dummy_inputs(model_path)`; the decoder is built by ModelBuilder.
A derived part (`llm_step`) is made at assembly from built ones (`compose(folder, files)`, `check(...)`).

What the rest of the project needs to know of a part without importing its build (which imports PyTorch: the
runtime never does) is its `PartFacts` line in `FACTS` below: its I/O names, the dim checked against the model
facts at load, whether its graph depends on the device, its extra files, whether it is derived. The part's module
takes `NAME`, `INPUTS` and `OUTPUTS` from that line. Adding a part is its module, its line here, its tests.
The exporter reaches every part through `module(name)`: no part is special-cased outside its own module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from ..manifest import DERIVED_PARTS, PART_NAMES


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
    PartFacts("llm_step", ("inputs_embeds", "audio_codes", "attention_mask"), ("hidden_states", "logits"),
              ("logits", -1, "codebook_vocab"), uses=("llm_decoder", "audio_embed", "audio_heads")),
)}
assert set(FACTS) == set(PART_NAMES + DERIVED_PARTS)


def facts(name: str) -> PartFacts:
    if name not in FACTS:
        raise ValueError(f"unknown part {name!r}; parts: {', '.join(FACTS)}")
    return FACTS[name]


@dataclass(frozen=True)
class BuildJob:
    """What a part build needs: the checkpoint, the output folder, a scratch folder and the export options."""

    ckpt: Path
    out: Path  # the part's files go here (a fresh folder)
    work: Path  # scratch space shared by builds (Olive cache, ModelBuilder cache, extracted body)
    precision: str
    device: str
    attention: str  # decoder graph (providers.ATTENTIONS); only the decoder reads it
    block_size: int
    accuracy_level: int
    digest: str  # cheap identity of the checkpoint files (checkpoint.files_digest)
    say: Callable[[str], None] = field(default=print, compare=False)  # progress lines of long sub-steps


def module(name: str) -> ModuleType:
    facts(name)  # a clear error for an unknown part
    return importlib.import_module(f"{__name__}.{name}")


def device_specific(name: str) -> bool:
    """Whether the part's graph depends on the target device (else one build serves every device)."""
    return facts(name).device_specific


def extra_files(name: str) -> tuple[str, ...]:
    return facts(name).extra_files
