"""The checks every runtime shares (ONNX Runtime `session.Part` and OpenVINO `openvino.OvPart`): the provider error,
the intra-op thread count and the NaN/Inf guard on a part's outputs.

Both runtimes import this module and neither imports the other at load time (`session.open_part` picks the
OpenVINO runtime lazily), so there is no import circle between them.
"""

from __future__ import annotations

import os

import numpy as np

# Outputs the NaN/Inf guard skips: a decoder's KV cache (tens of MB a step on the 4b geometry, ~10 ms to scan). A
# non-finite cache row reaches the next step's hidden states, which the decoder checks (decoder._check).
UNGUARDED_PREFIX = "present."


class ProviderError(RuntimeError):
    """A requested execution provider is not available or was not used."""


def check_finite(name: str, outs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for k, v in outs.items():
        if v.dtype.kind == "f" and not k.startswith(UNGUARDED_PREFIX) and not np.isfinite(v).all():
            raise FloatingPointError(f"{name} produced NaN/Inf in output {k}")
    return outs


def check_threads(threads: int) -> int:
    """An intra-op thread count: 0 lets ONNX Runtime choose (one per physical core); negative counts are refused
    (ORT would take them without complaint)."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = ONNX Runtime's default, one per core); got {threads}")
    most = max_threads()
    if threads > most:
        raise ValueError(f"threads must be at most {most} (4 per core of this machine's {os.cpu_count() or 1}); "
                         f"got {threads}: more threads than cores only slow a run down")
    return threads


def max_threads() -> int:
    return 4 * (os.cpu_count() or 1)
