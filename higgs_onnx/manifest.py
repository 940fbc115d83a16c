"""`manifest.json`: the single contract between `optimize.py` and the runtime / eval.

Written last by the exporter (its presence marks a complete folder), read first by inference and eval through
`load_manifest`, which checks the schema version, the manifest's own digest, that every file entry is a plain name
inside the folder, and (unless told not to) each file's size and sha256: hashed once per file identity, the verdict
kept beside the export or in the user's cache (`hash_verdicts`).

The digest (`manifest_sha256`: sha256 of the canonical JSON of every other field, see `manifest_digest`) makes a
manifest that was edited by hand or damaged since it was written an error at load, with the command that rebuilds
it; it is checked always (hashing a few kB costs nothing, unlike the part files' sha256 that `--no-verify` skips).
Manifests written before the digest existed load as before. Tests that edit a manifest on purpose (to exercise the
other checks) write it back with `rewrite_manifest`, which recomputes the digest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .hash_verdicts import Verdicts, sha256_file  # noqa: F401 - sha256_file re-exported: the exporter's hashes
from .outputs import write_atomic

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
DIGEST = "manifest_sha256"  # the manifest's own digest (see `manifest_digest`)
PART_NAMES = ("llm_decoder", "text_embed", "audio_embed", "audio_heads", "audio_encoder", "audio_tokenizer",
              "audio_tokenizer_stream")
# parts an export may lack: folders built before they existed still run (streaming then decodes overlapping windows)
OPTIONAL_PARTS = ("audio_tokenizer_stream",)
REQUIRED_PARTS = tuple(p for p in PART_NAMES if p not in OPTIONAL_PARTS)
# parts made at assembly from the built ones (parts/llm_step.py: the one-call decode step; parts/llm_route.py: its
# int8 GEMM twin for many rows); optional: older exports
# and OpenVINO IR decoders have none
DERIVED_PARTS = ("llm_step", "llm_route")
# the decoder's route entry (`decoder.route`): the int8 GEMM route's kind, or "none" (refused by its gate at build);
# its crossover's sizes, each a whole number >= 1 or null (never): positions of a one-row call, rows of a batched step
ROUTE_KIND = "int8-gemm"
ROUTE_KINDS = (ROUTE_KIND, "none")
CROSSOVER_SIZES = ("prefill", "batch")
# the route's weight form (`decoder.route.form`) -> the bits of its symmetric weights. MLAS's u8s8 GEMM without an
# int8 dot product (AVX2: vpmaddubsw) adds pairs of u8 x s8 products in 16 bits: 255 x 127 x 2 = 64770 saturates,
# 255 x 63 x 2 = 32130 < 32767 cannot. "s7" (weights in [-63, 63], ONNX Runtime's `reduce_range`) is exact on every
# x86 kernel (AVX2, VNNI, AMX); "s8" ([-127, 127]) only where the CPU has VNNI or AMX. An entry without it: s8
ROUTE_FORMS = {"s7": 7, "s8": 8}
ROUTE_FORM_DEFAULT = "s7"  # one export that runs everywhere (exports are shared on the Hub)
ROUTE_FORM_WORDS = {"s7": "7-bit weights, exact on every x86 int8 kernel (AVX2, VNNI, AMX)",
                    "s8": "8-bit weights, for CPUs with an int8 dot product (VNNI or AMX)"}


def route_form(route: dict) -> str:
    """The weight form of an export's `decoder.route` (checked at load): "s8" for one built before the field."""
    return route.get("form", "s8")


# what a manifest without a "decoder" entry (written before the portable decoder existed) describes
DEFAULT_DECODER = {"attention": "gqa", "cache": "shared-buffer", "format": "onnx", "kv_cache": {"dtype": "fp32"}}


def new_manifest(*, device: str, precision: str, execution_provider: str, model: dict, tokens: dict, parts: dict,
                 source: dict, decoder: dict | None = None) -> dict:
    """The manifest of a finished export: what `load_manifest` checks and the runtime reads. `decoder` says which
    decoder graph it holds: attention ("gqa" | "portable"), cache layout ("shared-buffer" | "concat") and format
    ("onnx" | "openvino-ir")."""
    return {"schema_version": SCHEMA_VERSION, "format": "higgs-onnx",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": device, "precision": precision,
            "execution_provider": execution_provider, "decoder": decoder or dict(DEFAULT_DECODER), "model": model,
            "tokens": tokens, "tokenizer": "tokenizer.json",
            "genai_config": "genai_config.json", "parts": parts, "source": source, "tools": tool_versions()}


def manifest_digest(data: dict) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces, ASCII) of every field but the digest itself: the same
    for the dict that was written and the one read back, whatever the indentation."""
    body = {k: v for k, v in data.items() if k != DIGEST}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canon.encode("ascii")).hexdigest()


def _dump(path: Path, data: dict) -> Path:
    """`data` with its digest, written whole or not at all (a temporary file renamed over `path`)."""
    data = {**{k: v for k, v in data.items() if k != DIGEST}, DIGEST: manifest_digest(data)}
    return write_atomic(path, json.dumps(data, indent=2) + "\n")


def link_or_copy(src: Path, dst: Path) -> None:
    """A hard link of `src` at `dst` (an export's files cost no space twice), or a copy where links fail."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def write_manifest(folder: Path, data: dict) -> Path:
    """Write `folder/manifest.json` with its digest; the exporter calls this last, so its presence marks a complete
    folder."""
    check_schema(data, folder / MANIFEST)
    return _dump(folder / MANIFEST, data)


def rewrite_manifest(folder: str | os.PathLike, data: dict) -> Path:
    """Write `data` as `folder/manifest.json` with a fresh digest and no schema check: for tests (and tools) that
    change a manifest on purpose. A manifest edited any other way is refused at load."""
    return _dump(Path(folder) / MANIFEST, data)


def tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("onnxruntime", "onnxruntime-genai", "olive-ai", "onnx", "torch", "transformers", "numpy", "openvino",
                "nncf"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


class ManifestError(ValueError):
    """The model folder is not a usable export; the message says what is wrong and how to fix it."""


def safe_member(folder: Path, name: str) -> Path:
    """`folder/name` for a plain file name; refuses absolute paths, `..`, sub-folders and links leaving the folder."""
    if not isinstance(name, str) or not name or name != os.path.basename(name) or name in (".", ".."):
        raise ManifestError(f"manifest file entry {name!r} is not a plain file name inside the model folder")
    path = folder / name
    real_folder = folder.resolve()
    if path.is_symlink() and path.resolve().parent != real_folder and not hub_blob(folder, path):
        raise ManifestError(f"manifest file entry {name!r} is a link pointing outside the model folder")
    return path


def hub_blob(folder: Path, path: Path) -> bool:
    """Whether the link `path` in `folder` is a Hugging Face cache snapshot's link to its repo's blob store: a folder
    `<repo>/snapshots/<commit>/<sub>/` whose files link to `<repo>/blobs/<hash>` (how huggingface_hub keeps a
    download; the blob is the file)."""
    parts = folder.absolute().parts
    if "snapshots" not in parts:
        return False
    repo = Path(*parts[:len(parts) - parts[::-1].index("snapshots") - 1]).resolve()
    target = path.resolve()
    return target.parent == repo / "blobs" and target.is_file()


@dataclass(frozen=True)
class Manifest:
    folder: Path
    data: dict

    @property
    def parts(self) -> dict[str, dict]:
        return self.data["parts"]

    @property
    def model(self) -> dict:
        return self.data["model"]

    @property
    def decoder(self) -> dict:
        """The decoder graph: {"attention", "cache", "format", "kv_cache"} (older manifests: ModelBuilder's GQA graph
        with an fp32 cache)."""
        return {**DEFAULT_DECODER, **self.data.get("decoder", {})}

    @property
    def device(self) -> str:
        """The device the export was built for (`optimize.py --device`)."""
        return self.data["device"]

    @property
    def precision(self) -> str:
        return self.data["precision"]

    @property
    def execution_provider(self) -> str:
        return self.data["execution_provider"]

    @property
    def tokenizer(self) -> str:
        """The tokenizer file's name in the folder."""
        return self.data["tokenizer"]

    @property
    def tokens(self) -> dict:
        """The prompt's token ids as read from the checkpoint's tokenizer at build time."""
        return self.data["tokens"]

    @property
    def kv_cache(self) -> str:
        """What the decoder's KV cache holds: "fp32" or "int8" (`optimize.py --kv-cache`)."""
        return self.decoder["kv_cache"]["dtype"]

    @property
    def genai_config(self) -> str:
        """ModelBuilder's genai_config.json beside the decoder (its file name in the folder)."""
        return self.data.get("genai_config", "genai_config.json")

    @property
    def source(self) -> dict:
        """Where the export came from: {"repo_id", "revision", "synthetic", "path", "files"} (empty if unknown)."""
        return self.data.get("source") or {}

    def path(self, name: str) -> Path:
        return safe_member(self.folder, name)

    def part_file(self, part: str) -> Path:
        return self.path(self.parts[part]["file"])


def crossover_words(route: dict) -> str:
    """An export's int8 route crossover (its manifest's `decoder.route`) in words: the one wording of the build's
    line, eval's report, the model card and benchmarks/routes.py. "one-row calls from 64 positions, batched steps
    never; given at build (--route-crossover), not measured; built on <CPU>; s7: 7-bit weights, ...", or "...;
    measured on <CPU>; ..." (the weight form says which CPUs run it)."""
    c, given = route.get("crossover") or {}, bool(route.get("crossover_given"))
    never = "never" if given else "never (int4 won at every size timed)"
    prefill = f"from {c['prefill']} positions" if c.get("prefill") else never
    batch = f"from {c['batch']} rows" if c.get("batch") else never
    cpu = (route.get("cpu") or {}).get("model", "an unrecorded CPU")
    how = f"given at build (--route-crossover), not measured; built on {cpu}" if given else f"measured on {cpu}"
    form = route_form(route)
    return f"one-row calls {prefill}, batched steps {batch}; {how}; {form}: {ROUTE_FORM_WORDS.get(form, 'unknown')}"


def load_manifest(folder: str | os.PathLike, verify: bool = True) -> Manifest:
    """Read and check `folder/manifest.json`; `verify` also checks every file's size and sha256."""
    folder = Path(folder)
    if folder.is_file():
        raise NotADirectoryError(f"model folder {folder} is a file, not an export folder (an onnx/<device>_<precision> "
                                 f"folder made by optimize.py)")
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist; build it with: python optimize.py "
                                f"--device cpu --precision int4")
    mf = folder / MANIFEST
    if not mf.is_file():
        raise ManifestError(f"{folder} has no {MANIFEST}: not a finished export (rerun optimize.py to complete it)")
    try:
        data = json.loads(mf.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ManifestError(f"{mf} is corrupt ({str(e)[:120]}); rebuild with optimize.py --force") from None
    if not isinstance(data, dict) or not isinstance(data.get("schema_version"), int):
        raise ManifestError(f"{mf} has no schema_version: not a higgs-onnx manifest (nor a Higgs ONNX export in the "
                            f"community layout: a manifest with sub_models)")
    if data["schema_version"] > SCHEMA_VERSION:
        raise ManifestError(f"{mf} has schema version {data['schema_version']}, newer than this toolkit "
                            f"understands ({SCHEMA_VERSION}); update higgs-onnx")
    if data["schema_version"] < SCHEMA_VERSION:
        raise ManifestError(f"{mf} has old schema version {data['schema_version']}; rebuild with optimize.py --force")
    check_digest(data, mf)
    check_schema(data, mf)
    verdicts = Verdicts(folder, shared=hub_blob(folder, mf)) if verify else None
    for part, entry in data["parts"].items():
        for name, meta in entry["files"].items():
            path = safe_member(folder, name)
            if not path.is_file():
                raise ManifestError(f"{part}: file {name} is missing from {folder}")
            if path.stat().st_size != meta["size"]:
                raise ManifestError(f"{part}: file {name} is {path.stat().st_size} bytes, the manifest says "
                                    f"{meta['size']} (truncated or replaced?)")
            if verdicts is not None and not verdicts.matches(path, meta["sha256"]):
                verdicts.save()  # the files that were sound keep their verdict
                raise not_its_sha256(folder, part, name, path)
    if verdicts is not None:
        verdicts.save()
    return Manifest(folder=folder, data=data)


def not_its_sha256(folder: Path, part: str, name: str, path: Path) -> ManifestError:
    """The error for a file whose content is not the sha256 its manifest records: a download in the Hub cache is
    fetched anew once deleted (never run with --no-verify); a folder of one's own is rebuilt."""
    if path.is_symlink() and hub_blob(folder, path):
        return ManifestError(f"{part}: file {name} is a corrupt download (its content does not match its sha256): "
                             f"delete {path.resolve()} and run the same command again to fetch it anew")
    return ManifestError(f"{part}: file {name} does not match its sha256 in the manifest (corrupt or modified; "
                         f"rebuild, or pass --no-verify to skip this check)")


def rebuild_hint(data: dict) -> str:
    """The optimize.py command that makes the folder again (device and precision from the manifest when it has
    them)."""
    device, precision = data.get("device"), data.get("precision")
    args = " ".join(f"--{k} {v}" for k, v in (("device", device), ("precision", precision)) if isinstance(v, str)
                    and v.replace("_", "").isalnum())
    return (f"python optimize.py {args + ' ' if args else ''}--force, with the --model-dir and --output it was "
            f"built with")


def check_digest(data: dict, mf: Path) -> None:
    """The manifest must be what the exporter wrote: its digest must match its content (absent: an older export)."""
    if DIGEST not in data:
        log.debug("%s has no %s (written before manifests carried one): its content is not checked", mf, DIGEST)
        return
    try:
        ok = data[DIGEST] == manifest_digest(data)
    except (TypeError, ValueError):  # a value JSON cannot write back (NaN ...): not what the exporter wrote
        ok = False
    if not ok:
        raise ManifestError(f"{mf} was changed after it was written (edited by hand or damaged: its {DIGEST} does "
                            f"not match its content); rebuild the folder: {rebuild_hint(data)}")


def _expect(ok: bool, mf: Path, what: str) -> None:
    if not ok:
        raise ManifestError(f"{mf} is malformed: {what} (rebuild with optimize.py --force)")


def check_schema(data: dict, mf: Path) -> None:
    """Keys and types the runtime relies on; any mismatch is one ManifestError, never a KeyError deep inside."""
    for key in ("device", "precision", "execution_provider", "tokenizer"):
        _expect(isinstance(data.get(key), str), mf, f"'{key}' must be a string")
    parts = data.get("parts")
    _expect(isinstance(parts, dict) and set(REQUIRED_PARTS) <= set(parts) <= set(PART_NAMES + DERIVED_PARTS), mf,
            f"'parts' must list {', '.join(REQUIRED_PARTS)} (and may list "
            f"{', '.join(OPTIONAL_PARTS + DERIVED_PARTS)})")
    for part, entry in parts.items():
        _expect(isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("precision"),
                                                                                             str), mf,
                f"part {part} needs 'file' and 'precision'")
        files = entry.get("files")
        _expect(isinstance(files, dict) and entry["file"] in files, mf, f"part {part} must list its files")
        for name, meta in files.items():
            _expect(isinstance(meta, dict) and type(meta.get("size")) is int and isinstance(meta.get("sha256"), str),
                    mf, f"file {name!r} needs an integer 'size' and a 'sha256'")
        for io in ("inputs", "outputs"):
            _expect(isinstance(entry.get(io), list) and all(isinstance(x, dict) and isinstance(x.get("name"), str)
                                                            for x in entry[io]), mf, f"part {part} '{io}' malformed")
    decoder = data.get("decoder", DEFAULT_DECODER)
    _expect(isinstance(decoder, dict) and decoder.get("cache") in ("shared-buffer", "concat")
            and decoder.get("format") in ("onnx", "openvino-ir"), mf,
            "'decoder' must give a cache layout (shared-buffer | concat) and a format (onnx | openvino-ir)")
    kv = decoder.get("kv_cache", {"dtype": "fp32"})
    _expect(isinstance(kv, dict) and kv.get("dtype") in ("fp32", "int8"), mf,
            "'decoder.kv_cache' must give the cache dtype (fp32 | int8)")
    model = data.get("model")
    _expect(isinstance(model, dict), mf, "'model' must be an object")
    tokens = data.get("tokens")
    _expect(isinstance(tokens, dict) and isinstance(tokens.get("control_tags"), dict), mf, "'tokens' malformed")
    if "route" in decoder:
        check_route(decoder["route"], mf)


def check_route(route, mf: Path) -> None:
    """`decoder.route`: its kind, and for the int8 route a crossover whose sizes are whole numbers >= 1 or null. A
    value that is none of these is one ManifestError naming the field (it would send every call to int4 unseen)."""
    _expect(isinstance(route, dict), mf, f"'decoder.route' must be an object, got {route!r:.40}")
    _expect(route.get("kind") in ROUTE_KINDS, mf, f"'decoder.route.kind' must be one of {', '.join(ROUTE_KINDS)}, "
            f"got {route.get('kind')!r:.40}")
    if route["kind"] != ROUTE_KIND:
        return
    _expect(route_form(route) in ROUTE_FORMS, mf, f"'decoder.route.form' must be one of {', '.join(ROUTE_FORMS)} "
            f"(the int8 weights' range), got {route.get('form')!r:.40}")
    cross = route.get("crossover")
    _expect(isinstance(cross, dict), mf, f"'decoder.route.crossover' must be an object with "
            f"{' and '.join(CROSSOVER_SIZES)}, got {cross!r:.40}")
    for size in CROSSOVER_SIZES:
        value = cross.get(size)
        _expect(size in cross and (value is None or (type(value) is int and value >= 1)), mf,
                f"'decoder.route.crossover.{size}' must be a whole number >= 1 or null (never), "
                f"{f'got {value!r:.40}' if size in cross else 'it is missing'}")

