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

from ..part_facts import FACTS, PartFacts


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
    route: bool = False  # the decoder only: also write the int8 GEMM route's weights (parts/llm_route.py)
    route_bits: int = 7  # ... at this many bits (the route's form, manifest.ROUTE_FORMS)
    gate_layout: bool = False  # the decoder only: the int4 layout chosen by its gate (parts/int4_layout.py)
    say: Callable[[str], None] = field(default=print, compare=False)  # progress lines of long sub-steps


BUILD_FACTS = "build_facts.json"  # in a part's build folder: what its build chose, for its manifest entry


def build_facts(out: Path) -> dict:
    """{key: value} a part's build left in `out/BUILD_FACTS` for its manifest entry (the decoder's int4 layout and
    its gate figures), else {}."""
    import json

    path = out / BUILD_FACTS
    return json.loads(path.read_text()) if path.is_file() else {}


def module(name: str) -> ModuleType:
    facts(name)  # a clear error for an unknown part
    return importlib.import_module(f"{__name__}.{name}")


def device_specific(name: str) -> bool:
    """Whether the part's graph depends on the target device (else one build serves every device)."""
    return facts(name).device_specific


def extra_files(name: str) -> tuple[str, ...]:
    return facts(name).extra_files
