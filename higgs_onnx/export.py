"""The optimize pipeline: checkpoint -> verified ONNX parts -> one self-contained `onnx/<device>_<precision>/`.

Steps: resolve/download -> extract the Qwen3 body -> build each part -> assemble the folder + manifest.
- Every part is built in a work folder (`onnx/.build/<name>/<part>`), verified (ONNX checker, expected ops,
  numbers against the PyTorch reference) and only then stamped with the hash of its inputs and options; a part
  whose stamp matches is skipped. `--force` rebuilds everything, `components` rebuilds the named parts.
- The output folder is assembled beside the old one and swapped in at the end; `manifest.json` is written last.
  An interrupted or failed build never leaves a folder that looks complete and never damages a previous build.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import parts, providers
from .checkpoint import ModelFacts, files_digest, resolve, validate
from .manifest import (
    MANIFEST,
    PART_NAMES,
    ROUTE_FORM_DEFAULT,
    ROUTE_FORMS,
    check_digest,
    link_or_copy,
    new_manifest,
    route_form,
    sha256_file,
    write_manifest,
)
from .memory import peak_rss, release_memory, rss
from .parity import summary
from .parts.cache import PartCache
from .parts.kv_cache import KV_CACHES
from .parts.kv_cache import POLICY as KV_POLICY
from .parts.llm_route import KIND, ROUTES
from .parts.llm_route import POLICY as ROUTE_POLICY
from .parts.olive import BITS
from .runtime.prepared import held_off

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
PART_PRECISIONS = {  # default precision of each part for a global precision
    # voice-critical parts stay above int4 in an int4 build (README, "Voice-critical parts"; 4b preset, one run):
    # the tied audio head's argmax agreement with the exact head is 84.9 % at int4 (one code in seven changes
    # before the decoder has any say), 98.5 % at int8, 99.9 % at fp16, 100 % at fp32, and fp32 is also the
    # cheapest of the last three on the CPU EP (1.8 ms a step against fp16's 2.2 ms: no fast fp16 GEMV), < 1 % of
    # a decode step. The audio embedding is a Gather of 8 rows: ~0.1 ms at any precision, fp16 halves its bytes.
    "int4": {"llm_decoder": "int4", "text_embed": "fp16", "audio_embed": "fp16", "audio_heads": "fp32",
             "audio_encoder": "fp32", "audio_tokenizer": "fp32", "audio_tokenizer_stream": "fp32"},
    "fp16": {"llm_decoder": "fp16", "text_embed": "fp16", "audio_embed": "fp16", "audio_heads": "fp16",
             "audio_encoder": "fp32", "audio_tokenizer": "fp32",  # codec stays fp32 (SGO: unstable in 16 bit)
             "audio_tokenizer_stream": "fp32"},
    "fp32": dict.fromkeys(PART_NAMES, "fp32"),
}
ALLOWED = {"text_embed": ("int4", "int8", "fp16", "fp32"), "audio_embed": ("int4", "int8", "fp16", "fp32"),
           "audio_heads": ("int4", "int8", "fp16", "fp32"), "audio_encoder": ("fp32",),
           "audio_tokenizer": ("fp16", "fp32"), "audio_tokenizer_stream": ("fp16", "fp32")}
ENCODERS = ("int8", "fp32")  # optimize.py --encoder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class ExportOptions:
    device: str = "cpu"
    precision: str = "int4"
    attention: str | None = None  # decoder graph: "gqa" or "portable"; None = the device's default (providers.py)
    part_precision: dict = field(default_factory=dict)  # overrides, e.g. {"audio_heads": "fp16"}
    # int4 block size; None: the decoder's chosen by its gate against fp32 where it is quantized here (cpu int4 gqa:
    # parts/int4_layout.py), 32 elsewhere (the other int4 parts, other devices)
    block_size: int | None = None
    accuracy_level: int | None = None  # None: 4 on cpu (int8 activations, VNNI), 0 elsewhere
    components: tuple = ()  # parts to rebuild even when up to date
    force: bool = False
    kv_cache: str | None = None  # "int8" | "fp32"; None: int8 for the cpu gqa int4 decoder if its gates hold
    prefill_route: str | None = None  # "int8" | "none"; None: int8 where possible (cpu gqa int4) if its gate holds
    # (positions, rows) from which one-row calls / batched steps take the route, instead of measuring it here (a build
    # for another machine, or a reproducible one); None in either: never
    route_crossover: tuple | None = None
    # the route's int8 weights (manifest.ROUTE_FORMS): s7 runs exactly on every x86 CPU, s8 only with VNNI/AMX
    route_form: str | None = None  # the route's weights (manifest.ROUTE_FORMS); None: ROUTE_FORM_DEFAULT
    # the codec encoder (parts/encoder_int8.py): "int8" | "fp32"; None: int8 in a cpu int4 build (the provider runs
    # the int8 GEMM) if a form's gate holds, else fp32
    encoder: str | None = None


    def __post_init__(self) -> None:
        provider = providers.get(self.device)
        provider.check(self.precision, self.attention)
        for part, prec in self.part_precision.items():
            if part not in PART_NAMES:
                raise ValueError(f"unknown part {part!r} in --part-precision; parts: {', '.join(PART_NAMES)}")
            allowed = provider.precisions[self.decoder_attention] if part == "llm_decoder" else ALLOWED[part]
            if prec not in allowed:
                raise ValueError(f"{part} cannot be built at {prec} on {self.device}; allowed: {', '.join(allowed)}")
        if self.block_size not in (None, 16, 32, 64, 128, 256):
            raise ValueError(f"block size must be one of 16, 32, 64, 128, 256, got {self.block_size}")
        bad = set(self.components) - set(PART_NAMES)
        if bad:
            raise ValueError(f"unknown components {sorted(bad)}; parts: {', '.join(PART_NAMES)}")
        if self.kv_cache is not None and self.kv_cache not in KV_CACHES:
            raise ValueError(f"--kv-cache must be one of {', '.join(KV_CACHES)}, got {self.kv_cache!r}")
        if self.prefill_route is not None and self.prefill_route not in ROUTES:
            raise ValueError(f"--prefill-route must be one of {', '.join(ROUTES)}, got {self.prefill_route!r}")
        if self.prefill_route == "int8" and not self.route_possible:
            raise ValueError(f"the int8 prefill route runs beside an int4 GroupQueryAttention decoder on the CPU "
                             f"(--device cpu --precision int4 --attention gqa), not {self.device} "
                             f"{self.precisions['llm_decoder']} with the {self.decoder_attention} graph")
        if self.encoder is not None and self.encoder not in ENCODERS:
            raise ValueError(f"--encoder must be one of {', '.join(ENCODERS)}, got {self.encoder!r}")
        if self.encoder == "int8" and not self.provider.int8_gemm_route:
            raise ValueError(f"the int8 codec encoder runs on ONNX Runtime's CPU int8 GEMM (--device cpu), not "
                             f"{self.device}")
        if self.route_form is not None:
            if self.route_form not in ROUTE_FORMS:
                raise ValueError(f"--route-form must be one of {', '.join(ROUTE_FORMS)}, got {self.route_form!r}")
            if not self.route:
                raise ValueError("--route-form sets the int8 route's weights, but this build makes no route")
        object.__setattr__(self, "route_form", self.route_form or ROUTE_FORM_DEFAULT)  # given or the default, once
        if self.route_crossover is not None:
            if not self.route:
                raise ValueError("--route-crossover sets the int8 route's crossover, but this build makes no route")
            if len(self.route_crossover) != 2 or not all(
                    v is None or (type(v) is int and v >= 1) for v in self.route_crossover):
                raise ValueError(f"--route-crossover takes two sizes >= 1 (or none): positions of a one-row call and "
                                 f"rows of a batched step, got {self.route_crossover!r}")
        if self.kv_cache == "int8" and not self.int8_cache_possible:
            raise ValueError(f"an int8 KV cache needs a GroupQueryAttention decoder on a device whose attention "
                             f"keeps one (cpu, --attention gqa), not {self.device} with the {self.decoder_attention} "
                             f"graph")

    @property
    def int8_cache_possible(self) -> bool:
        return self.provider.int8_kv_cache and self.decoder_attention == "gqa"

    @property
    def route_possible(self) -> bool:
        return (self.provider.int8_gemm_route and self.decoder_attention == "gqa"
                and self.precisions["llm_decoder"] == "int4")

    @property
    def encoder_int8(self) -> bool:
        """Whether the build tries the codec encoder on the int8 GEMM: asked for, or by default in a cpu int4 build
        (an fp32 build stays exact unless asked)."""
        if self.encoder is None:
            return self.provider.int8_gemm_route and self.precision == "int4"
        return self.encoder == "int8"

    @property
    def route(self) -> bool:
        """Whether the build makes the int8 GEMM route (`parts/llm_route.py`): asked for, or by default where
        possible."""
        return self.route_possible if self.prefill_route is None else self.prefill_route == "int8"

    @property
    def cache_dtype(self) -> str:
        """The KV cache the build aims for: `kv_cache`, or int8 for a cpu gqa int4 decoder (if its gates hold)."""
        return self.kv_cache if self.kv_cache is not None else self.default_cache_dtype

    @property
    def default_cache_dtype(self) -> str:
        return "int8" if self.int8_cache_possible and self.precision == "int4" else "fp32"

    @property
    def precisions(self) -> dict[str, str]:
        return {**PART_PRECISIONS[self.precision], **self.part_precision}

    @property
    def provider(self) -> providers.Provider:
        return providers.get(self.device)

    @property
    def decoder_attention(self) -> str:
        return self.attention or self.provider.default_attention

    @property
    def block(self) -> int:
        """The block size of every int4 weight the build does not gate: `block_size`, or 32."""
        return self.block_size if self.block_size is not None else 32

    @property
    def gate_layout(self) -> bool:
        """Whether the decoder's int4 layout is chosen by its gate (`parts/int4_layout.py`): no block size asked
        for, and the decoder quantized by this project's streaming quantizer (cpu, int4, gqa)."""
        return (self.block_size is None and self.precisions["llm_decoder"] == "int4"
                and self.decoder_attention == "gqa" and not self.provider.ir
                and self.provider.builder_ep == providers.BUILD_PROVIDER.builder_ep)

    @property
    def accuracy(self) -> int:
        return self.accuracy_level if self.accuracy_level is not None else self.provider.int4_accuracy

    @property
    def name(self) -> str:
        """`<device>_<precision>`, plus `_<attention>` when the decoder graph is not the device's default."""
        suffix = "" if self.decoder_attention == self.provider.default_attention else f"_{self.decoder_attention}"
        kv = "" if self.cache_dtype == self.default_cache_dtype else f"_kv{self.cache_dtype}"
        return f"{self.device}_{self.precision}{suffix}{kv}"


# ---------------------------------------------------------------------------------------------------------------
# building one part


EXPECTED_OPS = {("llm_decoder", "int4"): "MatMulNBits", ("audio_heads", "int4"): "MatMulNBits",
                ("audio_embed", "int4"): "GatherBlockQuantized", ("text_embed", "int4"): "GatherBlockQuantized",
                ("audio_heads", "int8"): "MatMulNBits", ("audio_embed", "int8"): "GatherBlockQuantized",
                ("text_embed", "int8"): "GatherBlockQuantized", ("llm_decoder", "fp32"): "GroupQueryAttention",
                ("audio_encoder", "int8"): "MatMulInteger"}


# the only non-standard op a portable decoder may hold (its int4 weights); OpenVINO and the CPU EP both run it
PORTABLE_CONTRIB = {"int4": {"MatMulNBits"}, "fp32": set(), "fp16": set()}


def verify_graph(part: str, path: Path, precision: str, block_size: int, attention: str = "gqa") -> dict:
    """ONNX checker + the ops the precision implies (ModelBuilder silently ignores misspelled options, G4); a
    portable decoder must hold standard ops only; an OpenVINO IR decoder must hold compressed weights at int4."""
    import onnx

    if path.suffix == ".xml":
        from .parts.openvino_ir import describe_ir

        return describe_ir(path, precision)

    try:
        onnx.checker.check_model(str(path))
        checker = "passed"
    except onnx.checker.ValidationError as e:
        # ModelBuilder puts ORT-only ops (SimplifiedLayerNormalization ...) in the default domain; the checker does
        # not know them. Creating the ORT session in the parity check validates those graphs instead.
        if "No Op registered for" not in str(e):
            raise
        checker = "ORT-only ops: validated by onnxruntime"
    model = onnx.load(str(path), load_external_data=False)
    ops = sorted({n.op_type for n in model.graph.node})
    if part == "llm_decoder" and attention == "portable":
        contrib = {n.op_type for n in model.graph.node if n.domain not in ("", "ai.onnx")}
        if contrib - PORTABLE_CONTRIB[precision]:
            raise RuntimeError(f"the portable decoder holds non-standard ops {sorted(contrib)}")
        want = "MatMulNBits" if precision == "int4" else None
    else:
        want = EXPECTED_OPS.get((part, precision))
    if want and want not in ops:
        raise RuntimeError(f"{part} at {precision} should contain {want} but has only {ops}")
    if want == "MatMulNBits":
        attrs = [{a.name: a.i for a in n.attribute} for n in model.graph.node if n.op_type == want]
        found = {(a["bits"], a["block_size"]) for a in attrs}
        if found != {(BITS[precision], block_size)}:
            raise RuntimeError(f"{part}: MatMulNBits (bits, block size) {found}, expected "
                               f"{(BITS[precision], block_size)}")
        weights = {t.name for t in model.graph.initializer}  # the portable graph's attention MatMuls stay float
        if any(n.op_type == "MatMul" and n.input[1] in weights for n in model.graph.node):
            raise RuntimeError(f"{part}: some MatMul was left unquantized at {precision}")
    return {"ops": ops, "nodes": len(model.graph.node), "checker": checker}


def io_signature(path: Path) -> dict:
    """Names, dtypes and (symbolic) dims of a graph's inputs and outputs, for the manifest."""
    import onnx

    if path.suffix == ".xml":
        from .parts.openvino_ir import ir_signature

        return ir_signature(path)

    model = onnx.load(str(path), load_external_data=False)

    def entry(v):
        t = v.type.tensor_type
        dims = [d.dim_param or d.dim_value for d in t.shape.dim]
        return {"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": dims}

    return {"inputs": [entry(v) for v in model.graph.input], "outputs": [entry(v) for v in model.graph.output]}


# ---------------------------------------------------------------------------------------------------------------
# the pipeline


PART_CACHE_ENV = "HIGGS_PART_CACHE"


def part_cache_root(work: Path, part_cache: Path | None = None) -> Path:
    """Where finished part builds are kept (`parts/cache.py`): `part_cache` (optimize.py --part-cache), else
    `$HIGGS_PART_CACHE`, else `<output>/.build/parts`. A part's stamp names everything its files depend on, so
    exports under other output roots can share one cache safely."""
    if part_cache is not None:
        return Path(part_cache)
    env = os.environ.get(PART_CACHE_ENV, "").strip()
    return Path(env) if env else Path(work) / "parts"


class Exporter:
    def __init__(self, model: str, out_root: Path, opts: ExportOptions, revision: str | None = None,
                 token: str | None = None, synthetic: str | None = None, part_cache: Path | None = None):
        self.opts, self.out_root = opts, out_root
        self.model_arg, self.revision, self.token, self.synthetic = model, revision, token, synthetic
        self.final = out_root / opts.name
        self.work = out_root / ".build"  # shared by every <device>_<precision>: identical parts are built once
        self.cache = PartCache(part_cache_root(self.work, part_cache), opts)  # finished parts, by stamp

    # -- steps --------------------------------------------------------------------------------------------------
    def step_resolve(self) -> tuple[Path, ModelFacts]:
        if self.synthetic:
            from .synthetic import build as build_synthetic

            ckpt = self.work / f"synthetic_{self.synthetic}"
            if not (ckpt / "config.json").is_file():
                print(f"[1/4] building the {self.synthetic} synthetic checkpoint in {ckpt}", flush=True)
                build_synthetic(self.synthetic, ckpt, progress=sys.stderr.isatty())
        else:
            ckpt = resolve(self.model_arg, revision=self.revision, token=self.token)
        return ckpt, validate(ckpt)

    def part_dir(self, part: str, stamp: str) -> Path:
        return self.cache.folder(part, stamp)

    def build_part(self, part: str, ckpt: Path, facts: ModelFacts, digest: str) -> dict:
        """Build (or reuse) one part in its work folder, verify it and check it against a fresh PyTorch reference
        that is released afterwards; returns its manifest entry (without file hashes)."""
        from .parity import check_part
        from .reference.model import ReferenceModel, parity_dtype

        o, precision = self.opts, self.opts.precisions[part]
        stamp = self.cache.stamp(part, digest)
        cached = self.cache.get(part, stamp)
        if cached:
            return cached
        tmp = self.cache.scratch(part, stamp)
        job = parts.BuildJob(ckpt=ckpt, out=tmp, work=self.work, precision=precision, device=o.device,
                             attention=o.decoder_attention, block_size=o.block, accuracy_level=o.accuracy,
                             digest=digest, say=say, route=o.route and part == "llm_decoder",
                             route_bits=ROUTE_FORMS[o.route_form], gate_layout=o.gate_layout and part == "llm_decoder")
        t0 = time.perf_counter()
        path = parts.module(part).build(job)
        seconds = time.perf_counter() - t0
        release_memory()
        layout = parts.build_facts(tmp)  # what the build chose (the decoder's int4 layout), for its entry
        graph = verify_graph(part, path, precision, layout.get("int4_layout", {}).get("block_size", o.block),
                             o.decoder_attention)
        t0 = time.perf_counter()
        # a device-specific graph is checked on its own provider, where this project can run that one (e.g. the
        # openvino decoder on the OpenVINO runtime); a cuda decoder graph does not run on the cpu EP
        check_on = o.device if parts.device_specific(part) else providers.BUILD_PROVIDER.name
        if providers.get(check_on).status != providers.VERIFIED:
            parity = {"skipped": f"{o.device} graph ({providers.BUILT_ONLY})"}
        else:
            ref = ReferenceModel(ckpt, dtype=parity_dtype(facts))
            say(f"built in {seconds:.0f} s; checking against the PyTorch reference ({_holds(part, ref)})")
            parity = check_part(part, path, ref, precision, provider=check_on)
            del ref
            release_memory()
        if not parity.get("ok", True):
            raise RuntimeError(f"{part} ({precision}) failed its parity check against the PyTorch reference: {parity}")
        files = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name.startswith(part))
        entry = {"stamp": stamp, "part": part, "precision": precision, "file": path.name,
                 "files": files + list(parts.extra_files(part)), "build_seconds": round(seconds, 2),
                 "check_seconds": round(time.perf_counter() - t0, 2), "parity": parity, **graph, **layout,
                 **io_signature(path)}
        return self.cache.put(part, stamp, entry)

    def assemble(self, ckpt: Path, facts: ModelFacts, entries: dict[str, dict]) -> Path:
        """Link every part into a fresh folder beside the old one, write the manifest last, swap it in."""
        staging = self.out_root / f".{self.opts.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        parts_manifest = {}
        for part, entry in entries.items():
            files = {}
            for name in entry["files"]:
                src = self.part_dir(part, entry["stamp"]) / name
                link_or_copy(src, staging / name)
                if name not in parts.extra_files(part):
                    files[name] = {"size": src.stat().st_size, "sha256": _cached_sha256(src)}
            parts_manifest[part] = {k: v for k, v in entry.items() if k not in ("files", "skipped")}
            parts_manifest[part]["files"] = files
        for name in TOKENIZER_FILES:
            if (ckpt / name).is_file():
                shutil.copyfile(ckpt / name, staging / name)
        if self.opts.encoder_int8:
            self.encoder(staging, facts, parts_manifest["audio_encoder"])
        kv = {"dtype": "fp32"}
        if self.opts.cache_dtype == "int8":
            kv = self.int8_cache(staging, ckpt, facts, parts_manifest)
        if not self.opts.provider.ir:  # the one-call decode step, composed from the final decoder graph
            self.step_graph(staging, ckpt, facts, parts_manifest, kv)
        route = self.route(staging, ckpt, facts, parts_manifest, kv) if self.opts.route else None
        # last: marks the folder complete
        write_manifest(staging, self.manifest(ckpt, facts, parts_manifest, kv, route))
        old = self.out_root / f".{self.opts.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if self.final.exists():
            os.replace(self.final, old)
        os.replace(staging, self.final)
        shutil.rmtree(old, ignore_errors=True)
        return self.final

    def encoder(self, staging: Path, facts: ModelFacts, entry: dict) -> None:
        """The codec encoder on the int8 GEMM (`parts/encoder_int8.py`): its forms gated against the fp32 graph on
        the bundled recordings; the first that passes replaces the fp32 files in `staging` (new files: the part
        cache keeps its own) and `entry` (the part's manifest entry) says which form, with every form's figures
        (`int8`). None passes: the fp32 encoder stays, with one line saying why (an error for `--encoder int8`)."""
        from .parts import encoder_int8

        work = staging.with_name(staging.name + ".enc8")
        t0 = time.perf_counter()
        say("int8 codec encoder: rewriting the fp32 graph and gating each form against it on the bundled recordings")
        try:
            path, info = encoder_int8.choose(staging / entry["file"], work, facts.sample_rate, say)
            info["seconds"] = round(time.perf_counter() - t0, 1)
            entry["int8"] = info
            if path is None:
                why = "; ".join(f"{k}: {'; '.join(v['failed'])}" for k, v in info["forms"].items())
                if self.opts.encoder == "int8":
                    raise RuntimeError(f"no int8 form of the codec encoder passes its gate ({why}); build with "
                                       f"--encoder fp32")
                say("int8 codec encoder refused: keeping the fp32 encoder")
                return
            for name in entry["files"]:
                (staging / name).unlink()
            files = {}
            for p in sorted(path.parent.iterdir()):
                os.replace(p, staging / p.name)
                files[p.name] = {"size": (staging / p.name).stat().st_size, "sha256": sha256_file(staging / p.name)}
            entry.update(precision="int8", files=files, **verify_graph(encoder_int8.PART, staging / path.name, "int8",
                                                                          self.opts.block_size))
            say(f"int8 codec encoder: form {info['form']} kept ({encoder_int8.summary(info)})")
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def int8_cache(self, staging: Path, ckpt: Path, facts: ModelFacts, parts_manifest: dict) -> dict:
        """Rewrite the assembled decoder for an int8 KV cache (`parts/kv_cache.py`): calibrate on the fp32-cache
        graph, quantize, and gate the int8-cache graph against it on the same weights. The decoder entry of
        `parts_manifest` is updated in place; returns the manifest's `kv_cache`. Gates that fail: an error when
        int8 was asked for, else the fp32 cache with one line saying why."""
        from .parts import kv_cache, llm_decoder
        from .runtime.model import HiggsTTS

        write_manifest(staging, self.manifest(ckpt, facts, parts_manifest))  # loadable as it is (fp32 cache)
        say("int8 KV cache: calibrating the scales on the fp32-cache graph")
        t0 = time.perf_counter()
        absmax = kv_cache.calibrate_apart(staging)
        q = staging.with_name(staging.name + ".kv8")
        try:
            kv_cache.int8_twin(staging, q, absmax, kv_cache.MODE)
            entry = json.loads((q / MANIFEST).read_text())["parts"]["llm_decoder"]
            say(f"int8 KV cache: {facts.layers} attention nodes rewritten ({kv_cache.MODE}); gating it against the "
                f"fp32 cache")
            gates = kv_cache.compare(lambda: HiggsTTS(staging, verify=False), lambda: HiggsTTS(q, verify=False),
                                     rows=kv_cache.gate_rows(facts))  # one model in memory at a time
            int4 = parts_manifest["llm_decoder"].get("parity", {}).get("cosine_vs_dequantized")
            limits = kv_cache.gates(int4)
            failed = kv_cache.failed_gates(gates, limits)
            info = {"dtype": "int8", "mode": kv_cache.MODE, "bits": 8, "margin": kv_cache.MARGIN,
                    "policy": kv_cache.POLICY, "gates": {k: v for k, v in gates.items() if k != "texts"},
                    "thresholds": limits, "int4_cosine": int4, "seconds": round(time.perf_counter() - t0, 1)}
            if failed:
                why = "; ".join(failed)
                if self.opts.kv_cache == "int8":
                    raise RuntimeError(f"the int8 KV cache fails its gates against the fp32 cache: {why} (build "
                                       f"with --kv-cache fp32)")
                say(f"int8 KV cache fails its gates ({why}): keeping the fp32 cache")
                return {"dtype": "fp32", "int8_refused": info}
            os.replace(q / llm_decoder.FILE, staging / llm_decoder.FILE)  # a new file: the part cache keeps its own
            parts_manifest["llm_decoder"] = entry
            say(f"int8 KV cache: {kv_cache.summary(gates)}")
            return info
        finally:
            shutil.rmtree(q, ignore_errors=True)

    def step_graph(self, staging: Path, ckpt: Path, facts: ModelFacts, parts_manifest: dict, kv: dict) -> None:
        """Compose `llm_step` (parts/llm_step.py) from the assembled decoder, audio embedding and heads, check it
        against the three parts chained where this machine can run the graph, and add its manifest entry. A step
        graph that disagrees with its parts is a bug: the build stops rather than ship it."""
        from .parts import llm_step
        from .runtime.model import HiggsTTS
        from .runtime.session import create_session

        t0 = time.perf_counter()
        path = llm_step.compose(staging, {p: parts_manifest[p]["file"] for p in llm_step.USES})
        if self.opts.provider.status == providers.VERIFIED:
            write_manifest(staging, self.manifest(ckpt, facts, parts_manifest, kv))  # the parts path, loadable
            parity = llm_step.check(lambda: HiggsTTS(staging, verify=False, step_graph=False),
                                    lambda: create_session(path, self.opts.device, name=llm_step.NAME))
            release_memory()
            if not parity["ok"]:
                raise RuntimeError(f"the composed step graph disagrees with its parts: {parity}")
        else:
            parity = {"skipped": f"{self.opts.device} graph ({providers.BUILT_ONLY})"}
        parts_manifest[llm_step.NAME] = {
            "part": llm_step.NAME, "precision": parts_manifest["llm_decoder"]["precision"], "file": path.name,
            "uses": list(llm_step.USES), "derived": True, "parity": parity,
            "build_seconds": round(time.perf_counter() - t0, 2),
            "files": {path.name: {"size": path.stat().st_size, "sha256": sha256_file(path)}}, **io_signature(path)}
        say(f"step graph: {path.name} composed from {', '.join(llm_step.USES)}: {summary(parity)}")

    def route(self, staging: Path, ckpt: Path, facts: ModelFacts, parts_manifest: dict, kv: dict) -> dict:
        """Compose the int8 GEMM route (`parts/llm_route.py`) from the assembled decoder and the int8 weights its
        build wrote, gate it against an fp32 reference beside the int4 route, and time both for the crossover;
        returns the manifest's `decoder.route`. A route that fails its gate is not written (its graph and weights
        leave the folder) and the figures are printed: an error when `--prefill-route int8` asked for it."""
        from .manifest import CROSSOVER_SIZES, crossover_words
        from .parts import llm_route, llm_step
        from .parts.llm_decoder import INT8_WEIGHTS
        from .runtime.route import cpu_summary

        t0 = time.perf_counter()
        if not (staging / INT8_WEIGHTS).is_file():
            raise RuntimeError(f"the decoder build has no {INT8_WEIGHTS}: rebuild it (--components llm_decoder)")
        path = llm_route.compose(staging, {p: parts_manifest[p]["file"] for p in llm_route.USES})
        parts_manifest[llm_route.NAME] = {
            "part": llm_route.NAME, "precision": "int8", "file": path.name, "uses": list(llm_route.USES),
            "derived": True, "parity": {"skipped": "not gated yet"},
            "files": {path.name: {"size": path.stat().st_size, "sha256": sha256_file(path)}}, **io_signature(path)}
        # loadable with the route (its crossover not measured yet: the gate and the timing force each route)
        weights = [INT8_WEIGHTS, INT8_WEIGHTS + ".data"]  # the decoder part's files the route's session loads
        form = self.opts.route_form
        write_manifest(staging, self.manifest(ckpt, facts, parts_manifest, kv,
                                              {"kind": llm_route.KIND, "weights": weights, "form": form,
                                               "crossover": dict.fromkeys(CROSSOVER_SIZES)}))
        say(f"int8 route: {path.name} composed (the step graph's projections on the int8 GEMM, {form} weights); "
            f"prefilling real prompts on each route, one session at a time, then gating both against fp32")
        gate, timing = self.route_figures(staging, ckpt)
        info = {"kind": llm_route.KIND, "part": llm_route.NAME, "policy": llm_route.POLICY, "weights": weights,
                "form": form, "gate": {k: v for k, v in gate.items() if k != "ok"}, "cpu": cpu_summary()}
        if not gate["ok"]:
            why = "; ".join(gate["failed"])
            for name in (path.name, *weights):
                (staging / name).unlink(missing_ok=True)
                parts_manifest["llm_decoder"]["files"].pop(name, None)
            del parts_manifest[llm_route.NAME]
            if self.opts.prefill_route == "int8":
                raise RuntimeError(f"the int8 route fails its gate against fp32: {why} ({llm_route.summary(gate)}); "
                                   f"build with --prefill-route none")
            say(f"int8 route refused, not written: {why} ({llm_route.summary(gate)})")
            return {"kind": "none", "refused": info}
        w = gate["worst"]  # its parity: the gate's worst prompt, hidden states against the fp32 reference
        parts_manifest[llm_route.NAME]["parity"] = {"ok": True, "cosine": 1.0 - w["int8"]["hidden_distance"],
                                                    "int4_cosine": 1.0 - w["int4"]["hidden_distance"],
                                                    "against": "fp32 reference, the gate's worst prompt"}
        if self.opts.route_crossover is not None:  # given: not measured on this machine
            say(f"int8 route: {llm_route.summary(gate)}; crossover given (--route-crossover), not measured")
            info["crossover"] = dict(zip(CROSSOVER_SIZES, self.opts.route_crossover, strict=True))
            info["crossover_given"] = True
        else:
            say(f"int8 route: {llm_route.summary(gate)}; both routes timed for the crossover")
            info["crossover"] = {k: v["crossover"] for k, v in timing.items()}
            info["timings_ms"] = {k: v["ms"] for k, v in timing.items()}  # {size: [int4, route]}
        info["seconds"] = round(time.perf_counter() - t0, 1)
        say(f"int8 route: {crossover_words(info)}")
        assert llm_step.NAME in parts_manifest  # the route is the step graph's twin: it never exists alone
        return info

    def route_figures(self, staging: Path, ckpt: Path) -> tuple[dict, dict | None]:
        """The route's gate and (unless `--route-crossover` gave it) both routes' timings, with one decoder's
        weights in memory at a time: the int4 step graph's prefills of the gate's prompts and its timings, then the
        route's session alone on the same prompts and sizes, then the fp32 reference (hidden states and logits are
        small arrays). Returns (the gate, `llm_route.timings` or None)."""
        from .parts import llm_route
        from .reference.model import ReferenceModel
        from .runtime.backend import route_bytes
        from .runtime.model import HiggsTTS
        from .runtime.route import fits

        measure = self.opts.route_crossover is None
        tts = HiggsTTS(staging, verify=False, route="off")  # the int4 step graph, and the parts the prompts need
        prompts = llm_route.gate_prompts(tts)
        hidden = {"int4": llm_route.prefills(tts.backend.decoder, prompts, False)}
        int4_times = llm_route.time_ladders(tts.backend.decoder, False) if measure else None
        manifest = tts.manifest
        say(f"int8 route: the int4 step graph's prefills{' and timings' if measure else ''} done; releasing it")
        del tts
        release_memory()
        if not fits(route_bytes(manifest)):  # too little memory here to load it (logged)
            return {"prompts": [], "worst": {}, "failed": ["not enough free memory to load the route and gate it"],
                    "ok": False}, None
        route = llm_route.alone(staging)
        hidden["int8"] = llm_route.prefills(route, prompts, True)
        route_times = llm_route.time_ladders(route, True, against=int4_times) if measure else None
        if measure:  # and once more, the better kept: one slow reading at the top size alone gave "never"
            route_times = llm_route.time_again(route, True, route_times)
        say(f"int8 route: its session's prefills{' and timings' if measure else ''} done, alone; releasing it for "
            f"the fp32 reference")
        del route
        release_memory()
        if measure:  # int4 once more, after the route: the better of its two phases (`llm_route.time_again`)
            tts = HiggsTTS(staging, verify=False, route="off")
            int4_times = llm_route.time_again(tts.backend.decoder, False, {  # the sizes both timed
                kind: {size: int4_times[kind][size] for size in sizes} for kind, sizes in route_times.items()})
            say("int8 route: the int4 step graph timed once more, after the route (the better of its two phases kept)")
            del tts
            release_memory()
        ref = ReferenceModel(ckpt, dtype="fp32")
        try:
            gate = llm_route.judge(ref, prompts, hidden)
        finally:
            del ref
            release_memory()
        return gate, llm_route.timings(int4_times, route_times) if measure else None

    def manifest(self, ckpt: Path, facts: ModelFacts, parts: dict, kv: dict | None = None,
                 route: dict | None = None) -> dict:
        from tokenizers import Tokenizer

        from .generation.prompt import PromptTokens

        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        source = {"repo_id": None if self.synthetic or Path(self.model_arg).exists() else self.model_arg,
                  # absolute: eval.py finds the reference from any folder, not only the one the build ran in
                  "revision": self.revision, "synthetic": self.synthetic, "path": os.path.abspath(ckpt),
                  "files": {n: _cached_sha256(ckpt / n) for n in ("config.json", "model.safetensors", *TOKENIZER_FILES)
                            if (ckpt / n).is_file()}}
        o = self.opts
        decoder = {"attention": o.decoder_attention, "cache": providers.CACHE_LAYOUT[o.decoder_attention],
                   "format": "openvino-ir" if o.provider.ir else "onnx", "kv_cache": kv or {"dtype": "fp32"},
                   "route": route or {"kind": "none"}}
        return new_manifest(device=o.device, precision=o.precision, decoder=decoder,
                            execution_provider=o.provider.ort_name or f"OpenVINO {o.provider.ov_device}",
                            model={**asdict(facts), "frame_rate": facts.frame_rate},
                            tokens=asdict(PromptTokens.from_tokenizer(tok, facts.placeholder)), parts=parts,
                            source=source)

    # -- driver -------------------------------------------------------------------------------------------------
    def run(self) -> Path:
        from filelock import FileLock, Timeout

        self.out_root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.out_root / f".{self.opts.name}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise RuntimeError(f"another optimize.py is building {self.final} right now (lock "
                               f"{lock.lock_file}); wait for it to finish") from None
        try:
            with held_off():  # the gates load staging folders: nothing to prepare for later loads (runtime/prepared)
                return self._run()
        finally:
            lock.release()

    def _run(self) -> Path:
        t0 = time.perf_counter()
        self.work.mkdir(parents=True, exist_ok=True)  # the build's scratch (the part cache may live elsewhere)
        ckpt, facts = self.step_resolve()
        need = sum(getattr(parts.module(p), "disk_needed", lambda c: 0)(ckpt) for p in PART_NAMES)
        try:
            return self._build(ckpt, facts, t0)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise OSError(errno.ENOSPC, f"out of disk space while building into {self.out_root}: this build needs "
                                        f"about {need / 2**30:.1f} GB free (the previous build is intact)") from None

    def _build(self, ckpt: Path, facts: ModelFacts, t0: float) -> Path:
        digest = files_digest(ckpt)
        print(f"[1/4] checkpoint {ckpt} ({facts.layers} layers, hidden {facts.hidden})", flush=True)
        entries = {}
        for i, part in enumerate(PART_NAMES, 1):
            print(f"[2/4] part {i}/{len(PART_NAMES)}: {part} ({self.opts.precisions[part]}) ...", flush=True)
            entries[part] = self.build_part(part, ckpt, facts, digest)
            e = entries[part]
            say(f"{'up to date' if e['skipped'] else 'built and checked'}: {summary(e['parity'])}")
        manifest_path = self.final / MANIFEST
        if manifest_path.is_file() and all(e["skipped"] for e in entries.values()):
            try:
                data = json.loads(manifest_path.read_text())
                check_digest(data, manifest_path)  # edited or damaged since it was written: assemble it again
                old = data.get("parts", {})
            except (ValueError, AttributeError):  # a damaged manifest: assemble the folder again
                old = {}
            kv = data.get("decoder", {}).get("kv_cache", {}) if isinstance(data.get("decoder"), dict) else {}
            refused = kv.get("int8_refused") if isinstance(kv, dict) else None
            same_kv = isinstance(kv, dict) and (kv.get("dtype") == self.opts.cache_dtype or (
                isinstance(refused, dict) and refused.get("policy") == KV_POLICY and self.opts.kv_cache is None))
            if same_kv and self.same_route(data.get("decoder")) and self.same_encoder(old.get("audio_encoder")) and all(
                    isinstance(old.get(p), dict) and old[p].get("stamp") == e["stamp"] for p, e in entries.items()):
                print(f"[3/4] {self.final} is up to date: nothing to do", flush=True)
                self.print_summary(entries, time.perf_counter() - t0)
                return self.final
        print(f"[3/4] assembling {self.final}", flush=True)
        self.assemble(ckpt, facts, entries)
        print("[4/4] manifest written", flush=True)
        self.print_summary(entries, time.perf_counter() - t0)
        return self.final

    def same_route(self, decoder) -> bool:
        """Whether an existing folder's route is what this build would make: written, or refused under the same
        gate policy when not asked for by name; none when none is wanted."""
        route = decoder.get("route", {}) if isinstance(decoder, dict) else {}
        route = route if isinstance(route, dict) else {}
        if not self.opts.route:
            return route.get("kind", "none") == "none" and "refused" not in route
        same_form = route_form(route) == self.opts.route_form
        if route.get("kind") == KIND and route.get("policy") == ROUTE_POLICY and same_form:
            given = self.opts.route_crossover
            return given is None or route.get("crossover") == dict(zip(("prefill", "batch"), given, strict=True))
        refused = route.get("refused")
        return (isinstance(refused, dict) and refused.get("policy") == ROUTE_POLICY and self.opts.prefill_route is None
                and route_form(refused) == self.opts.route_form)

    def same_encoder(self, entry) -> bool:
        """Whether an existing folder's codec encoder is what this build would make: its int8 forms tried under the
        same gate policy (kept or refused) when wanted, untried when not."""
        from .parts.encoder_int8 import POLICY

        tried = entry.get("int8") if isinstance(entry, dict) else None
        if not self.opts.encoder_int8:
            return tried is None
        return isinstance(tried, dict) and tried.get("policy") == POLICY and (
            tried.get("form") is not None or self.opts.encoder is None)

    def print_summary(self, entries: dict, seconds: float) -> None:
        """The table of parts as the folder holds them: precision, size and parity from its manifest where
        assembly changed a part (the int8 codec encoder), else from the part's build."""
        from .parts import encoder_int8

        try:
            final = json.loads((self.final / MANIFEST).read_text()).get("parts", {})
        except (OSError, ValueError, AttributeError):
            final = {}
        w = max(map(len, PART_NAMES)) + 2
        print(f"\n{'part':<{w}}{'precision':<10}{'size':>11}{'build s':>9}  parity")
        total = 0
        for part, e in entries.items():
            m = final.get(part) if isinstance(final.get(part), dict) else {}
            files = m.get("files") if isinstance(m.get("files"), dict) else None
            size = (sum(f.get("size", 0) for f in files.values()) if files else
                    sum((self.part_dir(part, e["stamp"]) / n).stat().st_size for n in e["files"]))
            total += size
            built = "cached" if e["skipped"] else f"{e['build_seconds']:.1f}"
            int8 = m.get("int8") if isinstance(m.get("int8"), dict) else {}
            parity = (f"int8 {int8['form']}: {encoder_int8.summary(int8)}" if int8.get("form")
                      else summary(e["parity"]))
            print(f"{part:<{w}}{m.get('precision', e['precision']):<10}{size / 2**20:>9.1f}MB{built:>9}  {parity}")
        print(f"{'total':<{w + 10}}{total / 2**20:>9.1f}MB   in {seconds:.1f} s, peak RSS {peak_rss() / 1e9:.2f} GB "
              f"-> {self.final}")


def say(message: str) -> None:
    """A progress line that says what the process holds now and at most so far."""
    print(f"      {message}  [RSS {rss() / 1e9:.2f} GB, peak {peak_rss() / 1e9:.2f} GB]", flush=True)


def _holds(part: str, ref) -> str:
    dtype = str(ref.dtype).removeprefix("torch.").replace("float", "fp").replace("bfp", "bf")
    if part == "llm_decoder":
        how = "streamed, one layer at a time" if ref.body.streamed else "resident"
        return f"{dtype} body {how}, plus the ONNX session"
    return f"holds the reference's {part} weights in {dtype} and the ONNX session"


_SHA_CACHE: dict[tuple, str] = {}


def _cached_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        _SHA_CACHE[key] = sha256_file(path)
    return _SHA_CACHE[key]
