"""Exports of this model in another layout, run as they are: the community's Higgs ONNX layout (the design card's six
parts, e.g. `onnx-community/higgs-audio-v3-tts-4b`'s `cuda_int4/` and `cuda_fp16/` folders).

    load_export("path/to/cuda_int4")     # exports.load_export calls `adopt` for such a folder

What that layout is (from the toolkit it came from and public drivers of it): a `manifest.json` of
`{"device", "precision", "execution_provider", "sub_models": {part: {"filename": ..., ...}}}` (the decoder's entry also
has `num_layers`, `num_kv_heads`; older ones a `standalone_dir` holding the decoder; a part it does not list is
found by its file name `<part>.onnx`); ModelBuilder's decoder (float16 activations and KV cache in the cuda builds)
and its `genai_config.json`; `tokenizer.json`. Their I/O differs from ours in names (`inputs_embeds`, `audio_embeds`,
`audio_logits`, `codes`, `input_values`) and in the encoder's input ([B, 1, T], T a multiple of the hop).

`adopt` maps each part's graph I/O to ours by name, alias, then the one I/O left (never by position among several),
derives the model facts from the graphs, `genai_config.json` and the tokenizer, and returns a `Manifest` of ours over
the folder as it is. The folder is never written to (a download is read-only in the Hub cache): the derived manifest
is kept in our cache (`user_cache`, kind "adopted"), keyed by the folder's files. What the layout lacks (streaming
codec, step graph, int8 KV cache, int8 route) the runtime does without; `lacks(manifest)` names it in one line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

import numpy as np

from .hash_verdicts import Verdicts
from .manifest import (
    DEFAULT_DECODER,
    MANIFEST,
    SCHEMA_VERSION,
    Manifest,
    ManifestError,
    hub_blob,
    not_its_sha256,
    sha256_file,
)
from .outputs import write_atomic

log = logging.getLogger(__name__)

LAYOUT = "community"
ADOPT_VERSION = 1  # bump when the derived manifest changes shape: older cache entries are derived again
SIX = ("text_embed", "audio_encoder", "audio_embed", "llm_decoder", "audio_heads", "audio_tokenizer")
# Facts of Higgs Audio v3 the layout does not record and no graph shows, from the design card
# (../shared/spec/higgs-v3.md: the codec's 24 kHz output and 16 kHz semantic input, config.audio_token_id -100,
# RoPE theta 1e6); the runtime reads only sample_rate and placeholder of these.
CARD_FACTS = {"sample_rate": 24000, "semantic_sample_rate": 16000, "placeholder": -100, "rope_theta": 1e6}
# our I/O name -> the names other layouts give it
ALIASES = {"embeddings": ("inputs_embeds", "audio_embeds", "embeds"), "audio_codes": ("codes",),
           "logits": ("audio_logits",), "waveform": ("input_values", "audio"), "input_ids": ("ids",),
           "hidden_states": ("hidden",)}
# the parts' I/O in our names (the decoder's are checked apart: its names are ModelBuilder's in both layouts)
OURS = {"text_embed": (("input_ids",), ("embeddings",)), "audio_encoder": (("waveform",), ("audio_codes",)),
        "audio_embed": (("audio_codes",), ("embeddings",)), "audio_heads": (("hidden_states",), ("logits",)),
        "audio_tokenizer": (("audio_codes",), ("waveform",))}
LACKS = ("no streaming codec (streams decode overlapping windows)",
         "no step graph (the decoder, embedding and heads run apart)", "no int8 KV cache", "no int8 prefill route")
_DTYPES = {1: "float32", 10: "float16", 7: "int64", 6: "int32", 11: "float64", 16: "bfloat16"}


# model facts such a folder cannot show (no graph or config holds them; the runtime reads none of them)
UNKNOWN_FACTS = ("intermediate", "rope_theta", "semantic_sample_rate")


def comparable(facts, manifest: Manifest) -> dict:
    """A `ModelFacts` as a dict of what the export's manifest can know: for a foreign layout without the facts no
    graph shows, and rms_eps at float32 (a graph attribute's precision)."""
    import dataclasses

    out = dataclasses.asdict(facts)
    if manifest.data.get("layout") == LAYOUT:
        out = {k: v for k, v in out.items() if k not in UNKNOWN_FACTS}
        out["rms_eps"] = float(np.float32(out["rms_eps"]))
    return out


def is_foreign(folder: Path) -> bool:
    """Whether `folder` holds an export in the community layout: a manifest with `sub_models` and no schema version
    (a folder with no manifest is an unfinished export of ours: refused as such)."""
    mf = folder / MANIFEST
    if not mf.is_file():
        return False
    try:
        data = json.loads(mf.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    return isinstance(data, dict) and "schema_version" not in data and isinstance(data.get("sub_models"), dict)


class ForeignManifest(Manifest):
    """A manifest derived for a folder in another layout: the same contract; file names may sit one sub-folder down
    (an older export's `standalone_dir`)."""

    def path(self, name: str) -> Path:
        from .manifest import safe_member

        sub, _, base = name.rpartition("/")
        if not sub:
            return safe_member(self.folder, name)
        if sub not in self.data.get("subfolders", []):
            raise ManifestError(f"file entry {name!r} is not in a sub-folder of the export's manifest")
        return safe_member(self.folder / sub, base)


def adopt(folder: str | os.PathLike, verify: bool = True) -> ForeignManifest:
    """The manifest of ours for a community-layout `folder` (derived once, kept in our cache); each file's size is
    checked, and with `verify` its sha256."""
    folder = Path(folder)
    theirs = _their_manifest(folder)
    files = _part_files(folder, theirs)
    key = _cache_key(folder, theirs, files)
    from .user_cache import cache_dir, cache_writes

    kept = cache_dir("adopted", key, make=False) / MANIFEST  # a read-only cache that holds it still serves it
    data = None
    if kept.is_file():
        try:
            data = json.loads(kept.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None
    if data is None:
        data = derive(folder, theirs, files)
        kept = cache_dir("adopted", key) / MANIFEST
        with cache_writes(kept.parent):
            write_atomic(kept, json.dumps(data, indent=2) + "\n")
        log.info("%s: a %s-layout export; its manifest derived into %s", folder, LAYOUT, kept.parent)
    manifest = ForeignManifest(folder=folder, data=data)
    verdicts = Verdicts(folder, shared=hub_blob(folder, folder / MANIFEST)) if verify else None
    for part, entry in data["parts"].items():
        for name, meta in entry["files"].items():
            path = manifest.path(name)
            if not path.is_file() or path.stat().st_size != meta["size"]:
                raise ManifestError(f"{folder}: {part}'s file {name} changed while it was read (run again)")
            if verdicts is not None and not verdicts.matches(path, meta["sha256"]):
                verdicts.save()
                raise not_its_sha256(path.parent, part, name, path)
    if verdicts is not None:
        verdicts.save()
    return manifest


def lacks(manifest: Manifest) -> str | None:
    """One line naming what a foreign export lacks that ours have (None for our own exports)."""
    if manifest.data.get("layout") != LAYOUT:
        return None
    return f"{manifest.folder} is a {LAYOUT}-layout export: " + "; ".join(LACKS)


def _their_manifest(folder: Path) -> dict:
    mf = folder / MANIFEST
    data = json.loads(mf.read_text(encoding="utf-8"))
    subs = data.get("sub_models")
    if not all(isinstance(e, dict) for e in subs.values()):
        raise ManifestError(f"{mf}: sub_models entries must be objects")
    for key in ("device", "precision", "execution_provider"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ManifestError(f"{mf}: {key} must be a string, got {data[key]!r:.40}")
    return data


def _part_files(folder: Path, theirs: dict) -> dict[str, str]:
    """{part: its graph's name relative to the folder}: by the manifest's `filename` (in its `standalone_dir` when
    the file is there), else `<part>.onnx`; a part not found is one error naming it."""
    subs = theirs.get("sub_models", {})
    out = {}
    for part in SIX:
        entry = subs.get(part, {})
        name = entry.get("filename", f"{part}.onnx")
        sub = entry.get("standalone_dir")
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise ManifestError(f"{folder}/{MANIFEST}: {part}'s filename {name!r} is not a plain file name")
        if isinstance(sub, str) and not (folder / name).is_file():
            if os.path.basename(sub.rstrip("/")) != sub.rstrip("/") or sub in (".", ".."):
                raise ManifestError(f"{folder}/{MANIFEST}: {part}'s standalone_dir {sub!r} is not a sub-folder name")
            name = f"{sub.rstrip('/')}/{name}"
        if not (folder / name).is_file():
            raise ManifestError(f"{folder} has no {part} part ({name}): not a complete Higgs ONNX export")
        out[part] = name
    return out


def _cache_key(folder: Path, theirs: dict, files: dict[str, str]) -> str:
    """A hash of what the derived manifest depends on: the layout's manifest and the name, size and mtime of each
    file the parts use (a graph, its weights beside it, the configs); other files (notes, voices) are not in it."""
    h = hashlib.sha256(f"v{ADOPT_VERSION}\n{folder.resolve()}\n".encode())
    h.update(json.dumps(theirs, sort_keys=True).encode())
    used = set()
    for name in files.values():
        sub = (folder / name).parent
        used |= {p for p in sub.iterdir() if p.name.startswith(Path(name).name)}
        used |= {sub / c for c in ("genai_config.json", "tokenizer.json")}
    used.add(folder / "tokenizer.json")
    for p in sorted(used):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(folder)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def _graph(path: Path):
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise ManifestError(f"{path} is not a readable ONNX graph: {e}") from None


def _io(values) -> list[dict]:
    def dim(d):
        return d.dim_value if d.HasField("dim_value") else (d.dim_param or None)

    return [{"name": v.name, "dtype": _DTYPES.get(v.type.tensor_type.elem_type, str(v.type.tensor_type.elem_type)),
             "shape": [dim(d) for d in v.type.tensor_type.shape.dim]} for v in values]


def match(part: str, ours: tuple[str, ...], graph: list[dict], kind: str) -> dict[str, str]:
    """{our name: the graph's name} for each of `ours`: the same name, else a known alias, else the one graph I/O
    left; one error naming the part and the I/O that could not be matched."""
    names = [x["name"] for x in graph]
    out, left = {}, list(names)
    for name in ours:
        found = name if name in left else next((a for a in ALIASES.get(name, ()) if a in left), None)
        if found is None and len(ours) == 1 and len(left) == 1:
            found = left[0]
        if found is None:
            raise ManifestError(f"{part}: cannot match {kind} {name!r} to the graph's {kind}s {names}")
        out[name] = found
        left.remove(found)
    if left:
        raise ManifestError(f"{part}: the graph's {kind}s {left} are not ones this runtime feeds or reads")
    return out


def _data_files(graph, folder: Path, name: str) -> list[str]:
    """The graph's file and its external-data files, as names relative to the folder."""
    sub = name.rpartition("/")[0]
    locs = {d.value for t in graph.graph.initializer if t.data_location == 1 for d in t.external_data
            if d.key == "location"}
    for loc in locs:
        if os.path.basename(loc) != loc or loc in (".", ".."):
            raise ManifestError(f"{folder / name}: external data {loc!r} is not a file beside the graph")
        if not (folder / sub / loc).is_file():
            raise ManifestError(f"{folder}: {name}'s weights file {loc} is missing (an incomplete download?)")
    return [name] + sorted(f"{sub}/{loc}" if sub else loc for loc in locs)


def _sha256(path: Path) -> str:
    """A file's sha256; a Hub cache blob is named by it (LFS files), so a download costs no second read."""
    blob = Path(os.path.realpath(path)).name
    return blob if re.fullmatch(r"[0-9a-f]{64}", blob) else sha256_file(path)


def _decoder_entry(graph, io: tuple[list, list], layers: int) -> None:
    """The decoder must be ModelBuilder's GQA graph of `layers` layers: one error naming any other I/O."""
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    want_in = {"inputs_embeds", "attention_mask", *past}
    want_out = {"hidden_states", *(p.replace("past_key_values", "present") for p in past)}
    got_in, got_out = {x["name"] for x in io[0]}, {x["name"] for x in io[1]}
    for kind, want, got in (("input", want_in, got_in), ("output", want_out, got_out)):
        if got - want:
            raise ManifestError(f"llm_decoder: the graph's {kind}s {sorted(got - want)} are not ones this runtime "
                                f"feeds or reads (it drives ModelBuilder's GroupQueryAttention decoder)")
        if want - got:
            raise ManifestError(f"llm_decoder: cannot match {kind}s {sorted(want - got)[:4]} in the graph")
    if not any(n.op_type == "GroupQueryAttention" for n in graph.graph.node):
        raise ManifestError("llm_decoder: no GroupQueryAttention node: not a decoder this runtime can drive")


def _count(data: dict, key: str, where: str, default: int | None = None) -> int:
    """A positive integer field of a config; one error naming the file and the field otherwise."""
    value = data.get(key, default)
    if type(value) is not int or value <= 0:
        raise ManifestError(f"{where}: {key} must be a positive integer, got {value!r:.40}")
    return value


def _genai(folder: Path, name: str) -> tuple[dict, tuple[int, int, int, int, int]]:
    """ModelBuilder's genai_config.json: its model section and (layers, heads, KV heads, head size, hidden size)."""
    try:
        genai = json.loads((folder / name).read_text(encoding="utf-8"))["model"]
        dec = genai["decoder"]
        if not isinstance(genai, dict) or not isinstance(dec, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise ManifestError(f"{folder}: {name} (ModelBuilder's decoder config) is missing or malformed") from None
    keys = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_size", "hidden_size")
    return genai, tuple(_count(dec, k, f"{folder / name}: decoder") for k in keys)


def _decoder_agrees(graph, io: tuple[list, list], genai_name: str, **want: int) -> None:
    """genai_config.json must describe the decoder graph beside it: its attention nodes' heads and KV heads, its
    cache's KV heads and head size, its embedding width."""
    got: dict[str, set] = {k: set() for k in want}
    for node in graph.graph.node:
        if node.op_type == "GroupQueryAttention":
            attrs = {a.name: a.i for a in node.attribute}
            got["heads"].add(attrs.get("num_heads"))
            got["kv_heads"].add(attrs.get("kv_num_heads"))
    shapes = {x["name"]: x["shape"] for x in io[0]}
    past = shapes.get("past_key_values.0.key", [])
    for key, dims in (("kv_heads", past[1:2]), ("head_dim", past[3:4]), ("hidden", shapes["inputs_embeds"][-1:])):
        got[key].update(d for d in dims if isinstance(d, int))
    for key, value in want.items():
        if got[key] - {None, value}:
            raise ManifestError(f"llm_decoder: {genai_name} says {key} {value}, the decoder graph has "
                                f"{sorted(got[key] - {None})}")


def _session(path: Path):
    import onnxruntime as ort

    from . import providers

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=[providers.BUILD_PROVIDER.ort_name])


def _run(part: str, path: Path, entry: dict, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One run of a small part on fixed inputs (our names in, ours out); an error names the part and its file."""
    ins = entry["io"]["inputs"]
    types = {x["name"]: x["dtype"] for x in entry["inputs"]}
    kinds = {"float16": np.float16, "float32": np.float32, "int64": np.int64, "int32": np.int32}
    theirs = {ins[k]: np.asarray(v, kinds.get(types[ins[k]], v.dtype)) for k, v in feeds.items()}
    try:
        out = _session(path).run(None, theirs)
    except Exception as e:  # noqa: BLE001 - ORT's InvalidArgument/Fail ... : the graph is not this part
        first = str(e).strip().splitlines()[0][:200]
        raise ManifestError(f"{part}: {path.name} does not run as the {part} part ({first})") from None
    names = {v: k for k, v in entry["io"]["outputs"].items()}
    sess_out = [x["name"] for x in entry["outputs"]]
    return {names.get(n, n): v for n, v in zip(sess_out, out, strict=False)}


def _expect(part: str, what: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise ManifestError(f"{part}: {what} is {list(got)} where the graphs' declared shapes and genai_config.json "
                            f"say {list(want)}: not the {part} of this export")


def smoke(folder: Path, files: dict[str, str], parts: dict, facts: dict) -> int:
    """Each small part run once on fixed inputs, its output's shape checked against what the others say (a part
    swapped for another's graph, or a head that lies about its vocabulary, is refused by name); returns the codec's
    hop, measured: samples per frame of the audio tokenizer."""
    n, v, d = facts["num_codebooks"], facts["codebook_vocab"], facts["hidden"]
    run = {p: (lambda feeds, p=p: _run(p, folder / files[p], parts[p], feeds)) for p in OURS}
    emb = run["text_embed"]({"input_ids": np.array([[0, 1]], np.int64)})["embeddings"]
    _expect("text_embed", "its output's shape", emb.shape, (1, 2, d))
    codes = np.stack([np.zeros((1, n)), np.full((1, n), v - 1)], axis=1).astype(np.int64)  # code 0, then EOC
    _expect("audio_embed", "its output's shape", run["audio_embed"]({"audio_codes": codes})["embeddings"].shape,
            (1, 2, d))
    logits = run["audio_heads"]({"hidden_states": np.zeros((1, 2, d), np.float32)})["logits"]
    _expect("audio_heads", "its output's shape", logits.shape, (1, 2, n, v))
    wav = run["audio_tokenizer"]({"audio_codes": np.zeros((1, n, 2), np.int64)})["waveform"]
    if wav.ndim != 3 or wav.shape[:2] != (1, 1) or wav.shape[-1] < 2 or wav.shape[-1] % 2:
        raise ManifestError(f"audio_tokenizer: two frames gave a waveform of shape {list(wav.shape)}: not a codec")
    hop = wav.shape[-1] // 2
    rank = parts["audio_encoder"]["io"].get("input_rank", 2)
    samples = np.zeros((1, 1, 2 * hop) if rank == 3 else (1, 2 * hop), np.float32)
    got = run["audio_encoder"]({"waveform": samples})["audio_codes"]
    if got.ndim != 3 or got.shape[:2] != (1, n) or not np.issubdtype(got.dtype, np.integer) or \
            got.min() < 0 or got.max() >= v - 2:
        span = f", codes {got.min()}..{got.max()}" if got.size and np.issubdtype(got.dtype, np.integer) else ""
        raise ManifestError(f"audio_encoder: {2 * hop} samples gave codes of shape {list(got.shape)} ({got.dtype}"
                            f"{span}) where the heads say {n} codebooks of {v - 2} codes: the encoder and the heads "
                            f"are not of one model")
    return hop


def _device(theirs: dict) -> str:
    """Our device name for the layout's: its `device` where we know it, else its execution provider's."""
    from . import providers

    device = theirs.get("device")
    if isinstance(device, str) and device in providers.PROVIDERS:
        return device
    ep = theirs.get("execution_provider")
    by_ep = {p.ort_name: p.name for p in providers.PROVIDERS.values() if p.ort_name}
    if isinstance(ep, str) and ep in by_ep:
        return by_ep[ep]
    if device is None and ep is None:
        return "cpu"
    raise ManifestError(f"{MANIFEST}: device {device!r:.40} / execution provider {ep!r:.60} is not one this runtime "
                        f"knows ({', '.join(providers.PROVIDERS)})")


def derive(folder: Path, theirs: dict, files: dict[str, str]) -> dict:
    """The manifest of ours for the folder: parts with their I/O maps, model facts, tokens, decoder entry."""
    from tokenizers import Tokenizer

    from .generation.prompt import PromptTokens

    sub = files["llm_decoder"].rpartition("/")[0]
    genai_name = f"{sub}/genai_config.json" if sub else "genai_config.json"
    genai, (layers, heads, kv, hd, hidden) = _genai(folder, genai_name)
    parts, graphs = {}, {}
    for part, name in files.items():
        g = graphs[part] = _graph(folder / name)
        io = (_io(g.graph.input), _io([o for o in g.graph.output]))
        init = {t.name for t in g.graph.initializer}
        io = ([x for x in io[0] if x["name"] not in init], io[1])
        entry = {"file": name, "precision": str(theirs.get("precision", "unknown")), "inputs": io[0],
                 "outputs": io[1], "files": {f: {"size": (folder / f).stat().st_size, "sha256": _sha256(folder / f)}
                                             for f in _data_files(g, folder, name)}}
        if part == "llm_decoder":
            _decoder_entry(g, io, layers)
            _decoder_agrees(g, io, genai_name, heads=heads, kv_heads=kv, head_dim=hd, hidden=hidden)
            entry["files"][genai_name] = {"size": (folder / genai_name).stat().st_size,
                                          "sha256": sha256_file(folder / genai_name)}
        else:
            ins, outs = OURS[part]
            entry["io"] = {"inputs": match(part, ins, io[0], "input"), "outputs": match(part, outs, io[1], "output")}
            if part == "audio_encoder":
                entry["io"]["input_rank"] = len(io[0][0]["shape"])
        parts[part] = entry
    shape = {p: {x["name"]: x["shape"] for x in parts[p]["inputs"] + parts[p]["outputs"]} for p in parts}
    heads_out = shape["audio_heads"][parts["audio_heads"]["io"]["outputs"]["logits"]]
    codebooks, vocab = heads_out[-2], heads_out[-1]
    if not (isinstance(codebooks, int) and isinstance(vocab, int)):
        raise ManifestError(f"audio_heads: output shape {heads_out} does not give the codebooks and their vocabulary")
    eps = next((a.f for n in graphs["llm_decoder"].graph.node if "LayerNormalization" in n.op_type
                for a in n.attribute if a.name == "epsilon"), 1e-6)
    facts = {"hidden": hidden, "intermediate": 0, "layers": layers, "heads": heads, "kv_heads": kv, "head_dim": hd,
             "vocab_size": _count(genai, "vocab_size", genai_name, 0),
             "max_positions": _count(genai, "context_length", genai_name, 4096),
             "rope_theta": CARD_FACTS["rope_theta"], "rms_eps": float(eps), "num_codebooks": codebooks,
             "codebook_vocab": vocab, "boc": vocab - 2, "eoc": vocab - 1, "placeholder": CARD_FACTS["placeholder"],
             "codebook_size": vocab - 2, "sample_rate": CARD_FACTS["sample_rate"],
             "semantic_sample_rate": CARD_FACTS["semantic_sample_rate"],
             "hop": 0, "num_quantizers": codebooks}
    facts["hop"] = smoke(folder, files, parts, facts)
    tok_name = "tokenizer.json" if (folder / "tokenizer.json").is_file() else (f"{sub}/tokenizer.json" if sub else "")
    if not tok_name or not (folder / tok_name).is_file():
        raise ManifestError(f"{folder} has no tokenizer.json (a file): not a complete Higgs ONNX export")
    try:
        tokens = PromptTokens.from_tokenizer(Tokenizer.from_file(str(folder / tok_name)), facts["placeholder"])
    except Exception as e:  # noqa: BLE001 - tokenizers raises bare Exceptions; PromptTokens a ValueError
        raise ManifestError(f"{folder}: tokenizer.json: {e}") from None
    import dataclasses

    from . import providers

    device = _device(theirs)
    return {"schema_version": SCHEMA_VERSION, "format": "higgs-onnx", "layout": LAYOUT,
            "device": device, "precision": str(theirs.get("precision", "unknown")),
            "execution_provider": str(theirs.get("execution_provider") or providers.get(device).ort_name),
            "decoder": {**DEFAULT_DECODER, "route": {"kind": "none"}}, "model": facts,
            "tokens": dataclasses.asdict(tokens), "tokenizer": tok_name, "genai_config": genai_name,
            "parts": parts, "subfolders": [sub] if sub else [],
            "source": {"layout": LAYOUT, "path": str(folder), "manifest": theirs or None}}
