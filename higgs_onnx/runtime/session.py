"""ONNX Runtime sessions fed by name, with dtype casting, provider verification and output guards.

The checks the OpenVINO runtime shares (`ProviderError`, `check_threads`, `check_finite`) live in `checks` and are
re-exported here; `open_part` reaches the OpenVINO runtime (`openvino.OvPart`) lazily.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from .. import providers
from .checks import (  # noqa: F401 - re-exported: callers import them from here
    UNGUARDED_PREFIX,
    ProviderError,
    check_finite,
    check_threads,
    max_threads,
)

log = logging.getLogger(__name__)

PROVIDERS = tuple(providers.PROVIDERS)  # what --provider takes
DECODER_SESSIONS = ("llm_decoder", "llm_step")  # the sessions that run every step (spinning intra-op threads)
SPIN_ENV = "HIGGS_ORT_SPIN"
ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(bool)": np.bool_}


def session_options(threads: int = 0, spin: bool = False):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = check_threads(threads)
    so.log_severity_level = 3
    # Five sessions take turns every frame; on a 2-core machine a small part's spinning pool steals the decoder's
    # cores. Measured on the 4b geometry, per frame: all spinning 192 ms, none 131-144 ms, decoder only 111 ms.
    # $HIGGS_ORT_SPIN=0 switches spinning off for the decoder too: for a machine whose cores several processes share
    # (the test suite runs two workers on two cores, where a spinning pool burns the other worker's core)
    spin = spin and os.environ.get(SPIN_ENV, "1").strip() != "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return so


def check_assignment(name: str, assigned, wanted: str) -> None:
    """Every node of part `name` must run on `wanted`: a node the session put on the CPU EP beside it is a fallback,
    and a fallback is an error naming the part and the op (shape arithmetic the EP leaves on the host by design,
    `providers.SHAPE_OPS`, is allowed). `assigned`: the session's `get_provider_graph_assignment_info()`."""
    if wanted == providers.BUILD_PROVIDER.ort_name:
        return
    fallen = [(n.op_type, n.name) for sg in assigned if sg.ep_name != wanted for n in sg.get_nodes()
              if n.op_type not in providers.SHAPE_OPS]
    if fallen:
        ops = sorted({op for op, _ in fallen})
        raise ProviderError(f"{name}: {wanted} does not run {', '.join(ops)} (e.g. node {fallen[0][1]}); "
                            f"{len(fallen)} node(s) would fall back to the CPU")


def create_session(path: Path, provider: str = "cpu", threads: int = 0, spin: bool = False, name: str | None = None,
                   optimized: tuple[Path, dict] | None = None):
    """An InferenceSession on `provider`; a requested accelerator that is missing, or that leaves any node of the
    graph to the CPU EP, is a ProviderError naming the part (and the op). `optimized`: (a path, session config
    entries) to write the optimized graph to as the session is made (`runtime.prepared`)."""
    import onnxruntime as ort

    p = providers.get(provider)
    name = name or path.stem
    if p.ort_name is None:
        raise ProviderError(f"{name}: provider {provider} is not run by ONNX Runtime (use open_part)")
    wanted = p.ort_name
    if wanted not in ort.get_available_providers():
        raise ProviderError(f"{name}: execution provider {wanted} is not available in this onnxruntime build "
                            f"(available: {', '.join(ort.get_available_providers())}); install {p.install}")
    cpu = providers.BUILD_PROVIDER.ort_name
    options = session_options(threads, spin)
    if wanted != cpu:
        options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if optimized is not None:
        options.optimized_model_filepath = str(optimized[0])
        for key, value in optimized[1].items():
            options.add_session_config_entry(key, value)
    try:
        chosen = (wanted, dict(p.ort_options)) if p.ort_options else wanted
        sess = ort.InferenceSession(str(path), options, providers=[chosen] if wanted == cpu else [chosen, cpu])
    except Exception as e:  # noqa: BLE001 - a damaged graph raises ORT's Fail/InvalidProtobuf or even UnicodeDecodeError
        raise RuntimeError(f"ONNX Runtime cannot load {path.name}: {e} (a damaged file? the sha256 check at load, "
                           f"skipped with --no-verify, finds those)") from None
    if sess.get_providers()[0] != wanted:
        raise ProviderError(f"{name}: asked for {wanted} but the session runs on {sess.get_providers()[0]}")
    if wanted != cpu:
        check_assignment(name, sess.get_provider_graph_assignment_info(), wanted)
    return sess


def open_part(name: str, path: Path, provider: str = "cpu", threads: int = 0, stateful: bool = False):
    """A part on `provider`'s runtime: an ONNX Runtime `Part`, or an `OvPart` on the OpenVINO runtime; both take
    keyword inputs and return {output name: array}. `stateful` (OpenVINO only): the decoder with its KV cache held
    as the compiled model's state."""
    p = providers.get(provider)
    if p.ort_name is None:  # not ONNX Runtime: the OpenVINO runtime
        from .openvino import OvPart

        return OvPart(name, path, threads, device=p.ov_device, stateful=stateful)
    if stateful:
        raise ValueError(f"{name}: a stateful decoder is OpenVINO's; ONNX Runtime binds the cache instead")
    return Part(name, path, provider, threads)


class Part:
    """One exported part: call with keyword inputs; returns {output name: array}. Checks outputs for NaN/Inf."""

    def __init__(self, name: str, path: Path, provider: str = "cpu", threads: int = 0,
                 optimized: tuple[Path, dict] | None = None):
        self.name, self.path = name, path
        # only the decoder's pool may spin (it runs most of the time); see session_options
        self.session = create_session(path, provider, threads, spin=name in DECODER_SESSIONS, name=name,
                                      optimized=optimized)
        self.input_types = {i.name: ORT_DTYPES.get(i.type, np.float32) for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.output_types = {o.name: ORT_DTYPES.get(o.type, np.float32) for o in self.session.get_outputs()}

    def __call__(self, **feeds: np.ndarray) -> dict[str, np.ndarray]:
        unknown = set(feeds) - set(self.input_types)
        if unknown:
            raise KeyError(f"{self.name}: no inputs named {sorted(unknown)} (has {sorted(self.input_types)})")
        cast = {k: np.ascontiguousarray(v, dtype=self.input_types[k]) for k, v in feeds.items()}
        return check_finite(self.name, dict(zip(self.output_names, self.session.run(None, cast), strict=True)))
