"""`llm_decoder`: the Qwen3 body, built by onnxruntime-genai's ModelBuilder (called directly; Olive's ModelBuilder
pass is broken with genai 0.18, toolchain G7) with `exclude_embeds` and `exclude_lm_head`.

I/O (cpu fp32/int4 graph, toolchain §2.4):
    inputs_embeds [B, S, D] float, attention_mask [B, total] int64, past_key_values.{i}.key/.value [B, KV, past, hd]
    -> hidden_states [B, S, D] (after the final RMSNorm), present.{i}.key/.value [B, KV, total, hd]
int4 on cpu: ModelBuilder's int4 path holds an fp32 copy of every weight (~25 GB for 4B, G8), so the decoder is
built in fp32 (streamed to external data) and quantized by `higgs_onnx.quantize` one weight at a time.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

NAME = "llm_decoder"
FILE = "llm_decoder.onnx"
EP_NAMES = {"cpu": "cpu", "cuda": "cuda", "dml": "dml"}  # ModelBuilder execution_provider names


def _model_builder(qwen3_dir: Path, out: Path, precision: str, ep: str, cache: Path, **options) -> None:
    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    kv = [f"{k}={v}" for k, v in {"exclude_embeds": "true", "exclude_lm_head": "true", "filename": FILE,
                                  **options}.items()]
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    sink = io.StringIO()  # ModelBuilder prints a lot; keep it for DEBUG logging only
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        opts = parse_extra_options(None, str(qwen3_dir), str(out), precision, EP_NAMES[ep], str(cache), kv)
        create_model(None, str(qwen3_dir), str(out), precision, EP_NAMES[ep], str(cache), **opts)
    log.debug("ModelBuilder output:\n%s", sink.getvalue())


def build(qwen3_dir: Path, out: Path, precision: str, ep: str, work: Path, block_size: int = 32,
          accuracy_level: int = 4, streaming: bool = True) -> None:
    """Build `out/llm_decoder.onnx` (+ `.data`) and `out/genai_config.json` from an extracted Qwen3 folder."""
    from ..quantize import quantize_model_int4

    if precision == "int4" and ep == "cpu" and streaming:
        fp32 = work / "fp32"
        _model_builder(qwen3_dir, fp32, "fp32", ep, work / "mb_cache")
        n = quantize_model_int4(fp32 / FILE, out / FILE, block_size=block_size, accuracy_level=accuracy_level)
        log.info("quantized %d MatMuls to int4 (block %d, accuracy level %d)", n, block_size, accuracy_level)
        shutil.copyfile(fp32 / "genai_config.json", out / "genai_config.json")
        shutil.rmtree(fp32)
        return
    options = {"block_size": block_size, "accuracy_level": accuracy_level} if precision == "int4" else {}
    _model_builder(qwen3_dir, out, precision, ep, work / "mb_cache", **options)
