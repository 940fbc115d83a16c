"""The optimize pipeline: checkpoint -> six verified ONNX parts -> one self-contained `onnx/<device>_<precision>/`.

Steps: resolve/download -> extract the Qwen3 body -> build each part -> assemble the folder + manifest.
- Every part is built in a work folder (`onnx/.build/<name>/<part>`), verified (ONNX checker, expected ops,
  numbers against the PyTorch reference) and only then stamped with the hash of its inputs and options; a part
  whose stamp matches is skipped. `--force` rebuilds everything, `components` rebuilds the named parts.
- The output folder is assembled beside the old one and swapped in at the end; `manifest.json` is written last.
  An interrupted or failed build never leaves a folder that looks complete and never damages a previous build.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .checkpoint import ModelFacts, extract_qwen3, files_digest, resolve, validate
from .manifest import MANIFEST, PART_NAMES, SCHEMA_VERSION, sha256_file
from .parity import summary

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
EXECUTION_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "dml": "DmlExecutionProvider"}
# Decoder precisions ModelBuilder can build per device. fp16 on cpu builds but its decode step fails (toolchain §2.4).
VALID = {"cpu": ("int4", "fp32"), "cuda": ("int4", "fp16", "fp32"), "dml": ("int4", "fp16")}
PART_PRECISIONS = {  # default precision of each part for a global precision (the table)
    "int4": {"llm_decoder": "int4", "text_embed": "fp16", "audio_embed": "int4", "audio_heads": "int4",
             "audio_encoder": "fp32", "audio_tokenizer": "fp32"},
    "fp16": {"llm_decoder": "fp16", "text_embed": "fp16", "audio_embed": "fp16", "audio_heads": "fp16",
             "audio_encoder": "fp32", "audio_tokenizer": "fp32"},  # codec stays fp32 (SGO: unstable in 16 bit)
    "fp32": dict.fromkeys(PART_NAMES, "fp32"),
}
ALLOWED = {"text_embed": ("int4", "fp16", "fp32"), "audio_embed": ("int4", "fp16", "fp32"),
           "audio_heads": ("int4", "fp16", "fp32"), "audio_encoder": ("fp32",), "audio_tokenizer": ("fp16", "fp32")}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# bump when a change of the build code must invalidate existing part stamps (2: Olive parts with external data)
BUILD_VERSION = {"llm_decoder": 1, "olive": 2}


@dataclass(frozen=True)
class ExportOptions:
    device: str = "cpu"
    precision: str = "int4"
    part_precision: dict = field(default_factory=dict)  # overrides, e.g. {"audio_heads": "fp16"}
    block_size: int = 32
    accuracy_level: int | None = None  # None: 4 on cpu (int8 activations, VNNI), 0 elsewhere
    components: tuple = ()  # parts to rebuild even when up to date
    force: bool = False

    def __post_init__(self) -> None:
        if self.device not in VALID:
            raise ValueError(f"unknown device {self.device!r}; choose one of {', '.join(VALID)}")
        if self.precision not in VALID[self.device]:
            combos = ", ".join(f"{d}/{p}" for d, ps in VALID.items() for p in ps)
            raise ValueError(f"--device {self.device} --precision {self.precision} cannot work (ModelBuilder's "
                             f"{self.precision} decoder on {self.device}); valid combinations: {combos}")
        for part, prec in self.part_precision.items():
            if part not in PART_NAMES:
                raise ValueError(f"unknown part {part!r} in --part-precision; parts: {', '.join(PART_NAMES)}")
            allowed = VALID[self.device] if part == "llm_decoder" else ALLOWED[part]
            if prec not in allowed:
                raise ValueError(f"{part} cannot be built at {prec} on {self.device}; allowed: {', '.join(allowed)}")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise ValueError(f"block size must be one of 16, 32, 64, 128, 256, got {self.block_size}")
        bad = set(self.components) - set(PART_NAMES)
        if bad:
            raise ValueError(f"unknown components {sorted(bad)}; parts: {', '.join(PART_NAMES)}")

    @property
    def precisions(self) -> dict[str, str]:
        return {**PART_PRECISIONS[self.precision], **self.part_precision}

    @property
    def accuracy(self) -> int:
        return self.accuracy_level if self.accuracy_level is not None else (4 if self.device == "cpu" else 0)

    @property
    def name(self) -> str:
        return f"{self.device}_{self.precision}"


# ---------------------------------------------------------------------------------------------------------------
# building one part


def _olive_passes(precision: str, block_size: int, accuracy: int, opset: int) -> dict:
    passes = {"conversion": {"type": "OnnxConversion", "target_opset": opset}}
    if precision == "int4":
        passes["int4"] = {"type": "OnnxBlockWiseRtnQuantization", "block_size": block_size,
                          **({"accuracy_level": accuracy} if accuracy else {})}
    elif precision == "fp16":
        passes["fp16"] = {"type": "OnnxFloatToFloat16"}
    return passes


def build_olive_part(part: str, ckpt: Path, out: Path, precision: str, opts: ExportOptions, work: Path) -> Path:
    """Convert (and quantize) one torch part with Olive; the result is `out/<part>.onnx`."""
    os.environ.setdefault("CI", "1")  # before importing olive: no telemetry heartbeat (toolchain G3)
    import onnx
    from olive.workflows import run as olive_run

    from . import parts

    module = parts.module(part)
    config = {
        "input_model": {"type": "PyTorchModel", "model_path": str(ckpt), "model_script": str(ROOT / "user_script.py"),
                        "script_dir": str(ROOT), "model_loader": f"get_{part}_model",
                        "dummy_inputs_func": f"get_{part}_dummy_inputs", "io_config": f"get_{part}_io_config"},
        # conversion and weight quantization are device independent: run them on the cpu whatever the target EP
        "systems": {"local": {"type": "LocalSystem",
                              "accelerators": [{"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}]}},
        "passes": _olive_passes(precision, opts.block_size, opts.accuracy, getattr(module, "OPSET", 17)),
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
        result = olive_run(config)
    if result is None or not result.has_output_model():  # olive logs pass failures and returns (G5)
        raise RuntimeError(f"Olive produced no model for {part} (see the log above; rerun with --log-level DEBUG)")
    model = onnx.load(result.get_best_candidate().model_path)
    out.mkdir(parents=True, exist_ok=True)
    dst = out / f"{part}.onnx"
    # weights in an external file: onnxruntime memory-maps it, so a 0.8 GB text table costs only the rows a prompt
    # touches (measured on the 4b geometry: 70 MB RSS instead of 806 MB, and no 1.5 GB load peak); it also keeps
    # every graph below protobuf's 2 GB limit
    onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
              location=f"{part}.onnx.data", size_threshold=1024)
    shutil.rmtree(work / "olive_out", ignore_errors=True)
    shutil.rmtree(work / "olive_cache", ignore_errors=True)
    return dst


def _drop_run_history(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(("run history", "Please install tabulate", "No run history"))


EXPECTED_OPS = {("llm_decoder", "int4"): "MatMulNBits", ("audio_heads", "int4"): "MatMulNBits",
                ("audio_embed", "int4"): "GatherBlockQuantized", ("text_embed", "int4"): "GatherBlockQuantized",
                ("llm_decoder", "fp32"): "GroupQueryAttention"}


def verify_graph(part: str, path: Path, precision: str, block_size: int) -> dict:
    """ONNX checker + the ops the precision implies (ModelBuilder silently ignores misspelled options, G4)."""
    import onnx

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
    want = EXPECTED_OPS.get((part, precision))
    if want and want not in ops:
        raise RuntimeError(f"{part} at {precision} should contain {want} but has only {ops}")
    if want == "MatMulNBits":
        sizes = {a.i for n in model.graph.node if n.op_type == want for a in n.attribute if a.name == "block_size"}
        if sizes != {block_size}:
            raise RuntimeError(f"{part}: MatMulNBits block sizes {sizes}, expected {block_size}")
    if precision == "int4" and part in ("llm_decoder", "audio_heads") and "MatMul" in ops:
        raise RuntimeError(f"{part}: some MatMul was left unquantized at int4")
    return {"ops": ops, "nodes": len(model.graph.node), "checker": checker}


def io_signature(path: Path) -> dict:
    """Names, dtypes and (symbolic) dims of a graph's inputs and outputs, for the manifest."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def entry(v):
        t = v.type.tensor_type
        dims = [d.dim_param or d.dim_value for d in t.shape.dim]
        return {"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": dims}

    return {"inputs": [entry(v) for v in model.graph.input], "outputs": [entry(v) for v in model.graph.output]}


# ---------------------------------------------------------------------------------------------------------------
# the pipeline


class Exporter:
    def __init__(self, model: str, out_root: Path, opts: ExportOptions, revision: str | None = None,
                 token: str | None = None, synthetic: str | None = None):
        self.opts, self.out_root = opts, out_root
        self.model_arg, self.revision, self.token, self.synthetic = model, revision, token, synthetic
        self.final = out_root / opts.name
        self.work = out_root / ".build"  # shared by every <device>_<precision>: identical parts are built once

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

    def part_stamp(self, part: str, ckpt_digest: str) -> str:
        """Hash of everything a part's files depend on. Olive parts are built on the cpu for every target device,
        so their stamp leaves the device out and `cpu_int4` and `cuda_int4` share them."""
        o = self.opts
        key = {"part": part, "precision": o.precisions[part], "block": o.block_size, "accuracy": o.accuracy,
               "checkpoint": ckpt_digest, "version": BUILD_VERSION.get(part, BUILD_VERSION["olive"])}
        if part == "llm_decoder":
            key["device"] = o.device
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    def part_dir(self, part: str, stamp: str) -> Path:
        return self.work / "parts" / f"{part}-{stamp[:16]}"

    def build_part(self, part: str, ckpt: Path, ref, digest: str) -> dict:
        """Build (or reuse) one part in its work folder; returns its manifest entry (without file hashes)."""
        from .parity import check_part
        from .parts import llm_decoder

        o, precision = self.opts, self.opts.precisions[part]
        stamp = self.part_stamp(part, digest)
        done = self.part_dir(part, stamp)
        stamp_file = done / "stamp.json"
        if not o.force and part not in o.components and stamp_file.is_file():
            entry = json.loads(stamp_file.read_text())
            if entry.get("stamp") == stamp and all((done / n).is_file() for n in entry["files"]):
                entry["skipped"] = True
                return entry
        tmp = done.with_name(done.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.perf_counter()
        if part == "llm_decoder":
            need, free = self.disk_needed(ckpt), shutil.disk_usage(self.work.parent).free
            if free < need:
                raise OSError(errno.ENOSPC, f"{self.out_root} has {free / 2**30:.1f} GB free; building the decoder "
                                            f"needs about {need / 2**30:.1f} GB (the previous build is left as it is)")
            qwen3 = extract_qwen3(ckpt, self.work / f"qwen3-{digest[:16]}")
            llm_decoder.build(qwen3, tmp, precision, o.device, self.work / "mb", o.block_size, o.accuracy)
        else:
            build_olive_part(part, ckpt, tmp, precision, o, self.work / "olive")
        seconds = time.perf_counter() - t0
        path = tmp / f"{part}.onnx"
        graph = verify_graph(part, path, precision, o.block_size)
        runnable = part != "llm_decoder" or o.device == "cpu"  # a cuda/dml decoder graph does not run on the cpu EP
        parity = check_part(part, path, ref, precision) if runnable else {"skipped": f"{o.device} graph"}
        if not parity.get("ok", True):
            raise RuntimeError(f"{part} ({precision}) failed its parity check against the PyTorch reference: {parity}")
        files = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name.startswith(part))
        extra = ["genai_config.json"] if part == "llm_decoder" else []
        entry = {"stamp": stamp, "part": part, "precision": precision, "file": path.name, "files": files + extra,
                 "build_seconds": round(seconds, 2), "parity": parity, **graph, **io_signature(path)}
        (tmp / "stamp.json").write_text(json.dumps(entry, indent=2))
        shutil.rmtree(done, ignore_errors=True)
        os.replace(tmp, done)
        entry["skipped"] = False
        return entry

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
                _link_or_copy(src, staging / name)
                if name != "genai_config.json":
                    files[name] = {"size": src.stat().st_size, "sha256": _cached_sha256(src)}
            parts_manifest[part] = {k: v for k, v in entry.items() if k not in ("files", "skipped")}
            parts_manifest[part]["files"] = files
        for name in TOKENIZER_FILES:
            if (ckpt / name).is_file():
                shutil.copyfile(ckpt / name, staging / name)
        manifest = self.manifest(ckpt, facts, parts_manifest)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks the folder complete
        old = self.out_root / f".{self.opts.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if self.final.exists():
            os.replace(self.final, old)
        os.replace(staging, self.final)
        shutil.rmtree(old, ignore_errors=True)
        return self.final

    def manifest(self, ckpt: Path, facts: ModelFacts, parts: dict) -> dict:
        from tokenizers import Tokenizer

        from .generation.prompt import PromptTokens

        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        tokens = asdict(PromptTokens.from_tokenizer(tok, facts.placeholder))
        source = {"repo_id": None if self.synthetic or Path(self.model_arg).exists() else self.model_arg,
                  "revision": self.revision, "synthetic": self.synthetic, "path": str(ckpt),
                  "files": {n: _cached_sha256(ckpt / n) for n in ("config.json", "model.safetensors", *TOKENIZER_FILES)
                            if (ckpt / n).is_file()}}
        return {"schema_version": SCHEMA_VERSION, "format": "higgs-onnx", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                               time.gmtime()),
                "device": self.opts.device, "precision": self.opts.precision,
                "execution_provider": EXECUTION_PROVIDERS[self.opts.device],
                "model": {**asdict(facts), "frame_rate": facts.frame_rate}, "tokens": tokens,
                "tokenizer": "tokenizer.json", "genai_config": "genai_config.json",
                "parts": parts, "source": source, "tools": _tool_versions()}

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
            return self._run()
        finally:
            lock.release()

    def _run(self) -> Path:
        t0 = time.perf_counter()
        ckpt, facts = self.step_resolve()
        need = self.disk_needed(ckpt)
        try:
            return self._build(ckpt, facts, t0)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise OSError(errno.ENOSPC, f"out of disk space while building into {self.out_root}: this build needs "
                                        f"about {need / 2**30:.1f} GB free (the previous build is intact)") from None

    def disk_needed(self, ckpt: Path) -> int:
        """A generous estimate of the free space a decoder build needs: the extracted body (1x the weights), the
        fp32 decoder before quantization (2x) and the finished parts (< 1x)."""
        return int(4 * (ckpt / "model.safetensors").stat().st_size)

    def _build(self, ckpt: Path, facts: ModelFacts, t0: float) -> Path:
        from .reference.model import ReferenceModel, parity_dtype

        digest = files_digest(ckpt)
        print(f"[1/4] checkpoint {ckpt} ({facts.layers} layers, hidden {facts.hidden})", flush=True)
        ref = ReferenceModel(ckpt, dtype=parity_dtype(facts))
        entries = {}
        for i, part in enumerate(PART_NAMES, 1):
            print(f"[2/4] part {i}/{len(PART_NAMES)}: {part} ({self.opts.precisions[part]}) ...", flush=True)
            entries[part] = self.build_part(part, ckpt, ref, digest)
            e = entries[part]
            print(f"      {'up to date' if e['skipped'] else 'built'}: {summary(e['parity'])}", flush=True)
            if part == "llm_decoder":
                ref.release_body()  # only the decoder check needs the body: free it
        manifest_path = self.final / MANIFEST
        if manifest_path.is_file() and all(e["skipped"] for e in entries.values()):
            try:
                old = json.loads(manifest_path.read_text()).get("parts", {})
            except (ValueError, AttributeError):  # a damaged manifest: assemble the folder again
                old = {}
            if all(isinstance(old.get(p), dict) and old[p].get("stamp") == e["stamp"] for p, e in entries.items()):
                print(f"[3/4] {self.final} is up to date: nothing to do", flush=True)
                self.print_summary(entries, time.perf_counter() - t0)
                return self.final
        print(f"[3/4] assembling {self.final}", flush=True)
        self.assemble(ckpt, facts, entries)
        print("[4/4] manifest written", flush=True)
        self.print_summary(entries, time.perf_counter() - t0)
        return self.final

    def print_summary(self, entries: dict, seconds: float) -> None:
        print(f"\n{'part':<16}{'precision':<10}{'size':>11}{'build s':>9}  parity")
        total = 0
        for part, e in entries.items():
            size = sum((self.part_dir(part, e["stamp"]) / n).stat().st_size for n in e["files"])
            total += size
            built = "cached" if e["skipped"] else f"{e['build_seconds']:.1f}"
            print(f"{part:<16}{e['precision']:<10}{size / 2**20:>9.1f}MB{built:>9}  {summary(e['parity'])}")
        print(f"{'total':<26}{total / 2**20:>9.1f}MB   in {seconds:.1f} s -> {self.final}")


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


_SHA_CACHE: dict[tuple, str] = {}


def _cached_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        _SHA_CACHE[key] = sha256_file(path)
    return _SHA_CACHE[key]


def _tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("onnxruntime", "onnxruntime-genai", "olive-ai", "onnx", "torch", "transformers", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out
