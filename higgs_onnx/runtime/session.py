"""ONNX Runtime sessions fed by name, with dtype casting, provider verification and output guards."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "dml": "DmlExecutionProvider",
             "openvino": "OpenVINOExecutionProvider"}
ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


class ProviderError(RuntimeError):
    """A requested execution provider is not available or was not used."""


def check_threads(threads: int) -> int:
    """An intra-op thread count: 0 lets ONNX Runtime choose (one per physical core); negative counts are refused
    (ORT would take them without complaint)."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = ONNX Runtime's default, one per core); got {threads}")
    return threads


def session_options(threads: int = 0, spin: bool = False):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = check_threads(threads)
    so.log_severity_level = 3
    # Five sessions take turns every frame; on a 2-core machine a small part's spinning pool steals the decoder's
    # cores. Measured on the 4b geometry, per frame: all spinning 192 ms, none 131-144 ms, decoder only 111 ms.
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return so


def create_session(path: Path, provider: str = "cpu", threads: int = 0, spin: bool = False):
    """An InferenceSession on `provider`; a requested accelerator that silently fell back to CPU is an error."""
    import onnxruntime as ort

    wanted = PROVIDERS[provider]
    if wanted not in ort.get_available_providers():
        raise ProviderError(f"execution provider {wanted} is not available in this onnxruntime build "
                            f"(available: {', '.join(ort.get_available_providers())}); install the matching "
                            f"onnxruntime package (e.g. onnxruntime-gpu, onnxruntime-directml)")
    providers = [wanted] if wanted == "CPUExecutionProvider" else [wanted, "CPUExecutionProvider"]
    options = session_options(threads, spin)
    try:
        sess = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as e:  # noqa: BLE001 - a damaged graph raises ORT's Fail/InvalidProtobuf or even UnicodeDecodeError
        raise RuntimeError(f"ONNX Runtime cannot load {path.name}: {e} (a damaged file? the sha256 check at load, "
                           f"skipped with --no-verify, finds those)") from None
    if sess.get_providers()[0] != wanted:
        raise ProviderError(f"{path.name}: asked for {wanted} but the session runs on {sess.get_providers()[0]}")
    return sess


class Part:
    """One exported part: call with keyword inputs; returns {output name: array}. Checks outputs for NaN/Inf."""

    def __init__(self, name: str, path: Path, provider: str = "cpu", threads: int = 0):
        self.name, self.path = name, path
        # only the decoder's pool may spin (it runs most of the time); see session_options
        self.session = create_session(path, provider, threads, spin=name == "llm_decoder")
        self.input_types = {i.name: ORT_DTYPES.get(i.type, np.float32) for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]

    def __call__(self, **feeds: np.ndarray) -> dict[str, np.ndarray]:
        unknown = set(feeds) - set(self.input_types)
        if unknown:
            raise KeyError(f"{self.name}: no inputs named {sorted(unknown)} (has {sorted(self.input_types)})")
        cast = {k: np.ascontiguousarray(v, dtype=self.input_types[k]) for k, v in feeds.items()}
        outs = dict(zip(self.output_names, self.session.run(None, cast), strict=True))
        for k, v in outs.items():
            if v.dtype.kind == "f" and not np.isfinite(v).all():
                raise FloatingPointError(f"{self.name} produced NaN/Inf in output {k}")
        return outs
