"""Build one torch part with Olive: `OnnxConversion` from the `user_script.py` hooks, then the precision's pass
(int4/int8: block-wise RTN weight quantization -> MatMulNBits / GatherBlockQuantized; fp16: float16 conversion).
Conversion and weight quantization are device independent, so they run on the cpu whatever the target EP.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import warnings
from pathlib import Path

from ..providers import BUILD_PROVIDER
from . import BuildJob
from .common import write_source

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent.parent  # holds user_script.py (a checkout)
# an installed wheel carries the top-level scripts inside the package (pyproject.toml: higgs_onnx._scripts)
HOOKS = next((p for p in (Path(__file__).resolve().parent.parent / "_scripts" / "user_script.py",
                          ROOT / "user_script.py") if p.is_file()), ROOT / "user_script.py")
BUILD_VERSION = 2  # bump to invalidate every Olive part's stamp (2: external data)
BITS = {"int4": 4, "int8": 8}


def passes(precision: str, block_size: int, accuracy: int, opset: int, fp16_in_torch: bool = False) -> dict:
    """Olive passes for a precision. `fp16_in_torch`: the module was loaded in fp16, so the conversion alone gives
    the fp16 graph (no fp32 copy of the weights on the way: the 4b text table would need 11 GB otherwise)."""
    out = {"conversion": {"type": "OnnxConversion", "target_opset": opset}}
    if fp16_in_torch and precision == "fp16":
        out["conversion"]["torch_dtype"] = "float16"
    elif precision in BITS:
        out["rtn"] = {"type": "OnnxBlockWiseRtnQuantization", "bits": BITS[precision], "block_size": block_size,
                      **({"accuracy_level": accuracy} if accuracy else {})}
    elif precision == "fp16":
        out["fp16"] = {"type": "OnnxFloatToFloat16"}
    return out


def build(part: str, job: BuildJob, opset: int = 17, fp16_in_torch: bool = False) -> Path:
    """Convert (and quantize) `part` with Olive; the result is `job.out/<part>.onnx` + `<part>.onnx.data`."""
    os.environ.setdefault("CI", "1")  # before importing olive: no telemetry heartbeat (toolchain G3)
    from olive.workflows import run as olive_run

    work = job.work / "olive"
    # Olive hashes every file under model_path and script_dir to identify the input model: give it a small
    # stand-in for the checkpoint (parts.common) and no script_dir (this process already imports higgs_onnx;
    # the repo root holds onnx/ and .venv/, which it would otherwise hash too)
    torch_fp16 = fp16_in_torch and job.precision == "fp16"
    dtype = "float16" if torch_fp16 else "float32"
    source = write_source(work / f"source-{job.digest[:16]}-{dtype}", job.ckpt, job.digest, dtype)
    final = list(passes(job.precision, job.block_size, job.accuracy_level, opset, torch_fp16).items())
    # the last pass writes the weights as one external file with its final name: no load and save again here
    final[-1][1].update(save_as_external_data=True, all_tensors_to_one_file=True,
                        external_data_name=f"{part}.onnx.data", size_threshold=1024)
    config = {
        "input_model": {"type": "PyTorchModel", "model_path": str(source),
                        "model_script": str(HOOKS), "model_loader": f"get_{part}_model",
                        "dummy_inputs_func": f"get_{part}_dummy_inputs", "io_config": f"get_{part}_io_config"},
        "systems": {"local": {"type": "LocalSystem",  # parts other than the decoder are built (and run) on the CPU EP
                              "accelerators": [{"device": BUILD_PROVIDER.name,
                                                "execution_providers": [BUILD_PROVIDER.ort_name]}]}},
        "passes": dict(final),
        "host": "local", "target": "local", "cache_dir": str(work / "olive_cache"),
        "output_dir": str(work / "olive_out"), "log_severity_level": 3, "clean_cache": True,
    }
    quiet = not log.isEnabledFor(logging.DEBUG)
    with warnings.catch_warnings():  # the tracer's warnings concern code paths the parity check covers
        if quiet:
            warnings.simplefilter("ignore")
            logging.getLogger("olive").setLevel(logging.ERROR)
            # Olive forces INFO to print its run history; drop those records unless debugging
            logging.getLogger("olive.engine.engine").addFilter(_drop_run_history)
        sink = io.StringIO()  # the float16 converter prints shape-inference notes on stdout
        with contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
            result = olive_run(config)
    if result is None or not result.has_output_model():  # olive logs pass failures and returns (G5)
        raise RuntimeError(f"Olive produced no model for {part} (see the log above; rerun with --log-level DEBUG)")
    # weights in an external file: onnxruntime memory-maps it, so a 0.8 GB text table costs only the rows a prompt
    # touches (measured on the 4b geometry: 70 MB RSS instead of 806 MB, and no 1.5 GB load peak); it also keeps
    # every graph below protobuf's 2 GB limit. The graph file may be renamed; the data file keeps its name.
    made = Path(result.get_best_candidate().model_path)
    graph = made if made.is_file() else made / "model.onnx"
    data = graph.parent / f"{part}.onnx.data"
    job.out.mkdir(parents=True, exist_ok=True)
    dst = job.out / f"{part}.onnx"
    shutil.move(graph, dst)
    if data.is_file():
        shutil.move(data, job.out / data.name)
    shutil.rmtree(work / "olive_out", ignore_errors=True)
    shutil.rmtree(work / "olive_cache", ignore_errors=True)
    return dst


def _drop_run_history(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(("run history", "Please install tabulate", "No run history"))
