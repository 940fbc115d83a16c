"""`llm_decoder`: the Qwen3 body, built by onnxruntime-genai's ModelBuilder (called directly; Olive's ModelBuilder
pass is broken with genai 0.18, toolchain G7) with `exclude_embeds` and `exclude_lm_head` ("gqa" graph), or by
`portable_decoder` from standard ONNX ops ("portable" graph, concat cache). For a provider whose runtime is
OpenVINO the portable fp32 graph is converted to OpenVINO IR with OpenVINO's own weight compression.

I/O (cpu fp32/int4 graph, toolchain §2.4):
    inputs_embeds [B, S, D] float, attention_mask [B, total] int64, past_key_values.{i}.key/.value [B, KV, past, hd]
    -> hidden_states [B, S, D] (after the final RMSNorm), present.{i}.key/.value [B, KV, total, hd]
int4 on cpu: ModelBuilder's int4 path holds an fp32 copy of every weight (~25 GB for 4B, G8), so the decoder is
built in fp32 (streamed to external data) and quantized by `higgs_onnx.quantize` one weight at a time.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import shutil
from pathlib import Path

from .. import providers
from ..memory import DropMappedPages, release_memory
from . import BuildJob

log = logging.getLogger(__name__)

NAME = "llm_decoder"
FILE = "llm_decoder.onnx"
BUILD_VERSION = 1  # bump to invalidate existing decoder stamps
INT8_WEIGHTS = "llm_decoder_int8.onnx"  # the int8 GEMM route's weights (an index graph + its .data; llm_route.py)
# its facts (FACTS["llm_decoder"] in parts/__init__.py): device-specific (ModelBuilder makes EP-specific graphs,
# toolchain G9: one build per device), and genai_config.json beside the graph


def _model_builder(qwen3_dir: Path, out: Path, precision: str, ep: str, cache: Path, **options) -> None:
    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    kv = [f"{k}={v}" for k, v in {"exclude_embeds": "true", "exclude_lm_head": "true", "filename": FILE,
                                  **options}.items()]
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    sink = io.StringIO()  # ModelBuilder prints a lot; keep it for DEBUG logging only
    from ..checkpoint import WEIGHTS

    weights = qwen3_dir / WEIGHTS
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), DropMappedPages(weights):
        builder_ep = providers.get(ep).builder_ep
        opts = parse_extra_options(None, str(qwen3_dir), str(out), precision, builder_ep, str(cache), kv)
        create_model(None, str(qwen3_dir), str(out), precision, builder_ep, str(cache), **opts)
    log.debug("ModelBuilder output:\n%s", sink.getvalue())
    # ModelBuilder's objects form reference cycles that keep the HF model (a memory map of the whole checkpoint,
    # 5.6 GB resident on the 4b geometry) alive until the next collection: free them before anything else runs
    release_memory()


def disk_needed(ckpt: Path, extracted: Path | None = None) -> int:
    """A generous estimate of the free space a decoder build needs: the extracted body (1x the weights, nothing
    when `extracted` already holds it), the fp32 decoder before quantization (2x) and the finished parts (< 1x)."""
    from ..checkpoint import WEIGHTS, is_extracted

    body = 0 if extracted is not None and is_extracted(ckpt, extracted) else 1
    return int((3 + body) * (ckpt / WEIGHTS).stat().st_size)


def build(job: BuildJob) -> Path:
    """Extract the Qwen3 body (once per checkpoint) and build the decoder from it into `job.out`."""
    from ..checkpoint import extract_qwen3

    body = job.work / f"qwen3-{job.digest[:16]}"
    need, free = disk_needed(job.ckpt, body), shutil.disk_usage(job.work).free
    if free < need:
        raise OSError(errno.ENOSPC, f"{job.work} has {free / 2**30:.1f} GB free; building the decoder needs about "
                                    f"{need / 2**30:.1f} GB (the previous build is left as it is)")
    job.say("extracting the Qwen3 body (tensor by tensor: RAM holds one)")
    qwen3 = extract_qwen3(job.ckpt, body)
    provider = providers.get(job.device)
    if provider.ir:
        return build_openvino(qwen3, job)
    if job.attention == "portable":
        from .portable_decoder import build_portable_decoder

        job.say(f"portable decoder (standard ONNX ops, concat cache): {job.precision}")
        return build_portable_decoder(qwen3, job.out, job.precision, job.block_size, job.accuracy_level)
    job.say(f"ModelBuilder: {job.precision} decoder for {job.device}"
            + (" (fp32 graph, streamed to disk, then quantized one weight at a time)"
               if job.precision == "int4" and provider.memory == providers.HOST_MEMORY else ""))
    build_from_qwen3(qwen3, job.out, job.precision, job.device, job.work / "mb",
                     None if job.gate_layout else job.block_size, job.accuracy_level, int8=job.route,
                     int8_bits=job.route_bits, ckpt=job.ckpt, say=job.say)
    return job.out / FILE


def build_from_qwen3(qwen3_dir: Path, out: Path, precision: str, ep: str, work: Path, block_size: int | None = 32,
                     accuracy_level: int = 4, streaming: bool = True, int8: bool = False, int8_bits: int = 7,
                     ckpt: Path | None = None, say=print) -> None:
    """Build `out/llm_decoder.onnx` (+ `.data`) and `out/genai_config.json` from an extracted Qwen3 folder.
    `int8` (the streaming int4 path only): also write every projection at `int8_bits` per output column from the
    same fp32 weights (`INT8_WEIGHTS`), for the int8 GEMM route (`parts/llm_route.py`). `block_size` None (the
    streaming int4 path only): the int4 layout chosen by its gate against the fp32 reference of `ckpt`
    (`parts/int4_layout.py`)."""
    from ..quantize import quantize_model_int4

    # the CPU-memory path of ModelBuilder's int4 holds an fp32 copy of every weight (G8): quantize ourselves
    if precision == "int4" and providers.get(ep).builder_ep == providers.BUILD_PROVIDER.builder_ep and streaming:
        fp32 = work / "fp32"
        _model_builder(qwen3_dir, fp32, "fp32", ep, work / "mb_cache")
        int8_dst = out / INT8_WEIGHTS if int8 else None
        if block_size is None:
            from . import int4_layout

            info = int4_layout.choose(fp32 / FILE, out / FILE, ckpt, accuracy_level, say, int8_dst, int8_bits)
            say(f"int4 layout: {int4_layout.summary(info)}")
        else:
            n = quantize_model_int4(fp32 / FILE, out / FILE, block_size=block_size, accuracy_level=accuracy_level,
                                    int8_dst=int8_dst, int8_bits=int8_bits)
            log.info("quantized %d MatMuls to int4 (block %d, accuracy level %d)%s", n, block_size, accuracy_level,
                     f" and to {int8_bits}-bit per column" if int8 else "")
        shutil.copyfile(fp32 / "genai_config.json", out / "genai_config.json")
        shutil.rmtree(fp32)
        return
    if int8:
        raise ValueError("the int8 GEMM route's weights come from the streaming int4 build (cpu, int4)")
    block_size = 32 if block_size is None else block_size  # the gate runs on the streaming path only
    options = {"block_size": block_size, "accuracy_level": accuracy_level} if precision == "int4" else {}
    _model_builder(qwen3_dir, out, precision, ep, work / "mb_cache", **options)


def build_openvino(qwen3: Path, job: BuildJob) -> Path:
    """The portable fp32 graph, converted to OpenVINO IR at `job.precision` (int4: OpenVINO's weight compression
    with group size `job.block_size`; fp16: fp16 weights) -> `job.out/llm_decoder.xml` + `.bin`."""
    from .openvino_ir import to_ir
    from .portable_decoder import build_portable_decoder

    scratch = job.work / f"ov-fp32-{job.digest[:16]}"
    shutil.rmtree(scratch, ignore_errors=True)
    job.say("portable fp32 decoder (standard ONNX ops), then OpenVINO IR")
    onnx_path = build_portable_decoder(qwen3, scratch, "fp32", job.block_size, job.accuracy_level)
    job.say(f"converting to OpenVINO IR at {job.precision}")
    xml = to_ir(onnx_path, job.out / "llm_decoder.xml", job.precision, job.block_size)
    shutil.copyfile(scratch / "genai_config.json", job.out / "genai_config.json")
    shutil.rmtree(scratch, ignore_errors=True)
    return xml
