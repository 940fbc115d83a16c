"""Checkpoint access: resolve a local folder or a Hugging Face repo, validate the layout, read the model facts,
and extract the standalone Qwen3 body (streamed tensor by tensor).

Everything the toolkit knows about a model comes from here: dims from `config.json`, BOC/EOC from the audio
vocabulary, codec facts from the codec config (the folder's own, else the bundled copy of
`bosonai/higgs-audio-v2-tokenizer`'s config, spec §6).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from .st_stream import read_header, write_streaming
from .tokenizer_files import ASSETS

log = logging.getLogger(__name__)

DEFAULT_REPO = "bosonai/higgs-tts-3-4b"
MODEL_TYPE = "higgs_multimodal_qwen3"
WEIGHTS = "model.safetensors"
REQUIRED_FILES = ("config.json", WEIGHTS, "tokenizer.json", "tokenizer_config.json")
OPTIONAL_FILES = ("model.safetensors.index.json", "chat_template.jinja", "higgs_audio_v2_tokenizer_config.json")
CODEC_CONFIG_FILE = "higgs_audio_v2_tokenizer_config.json"
CODEC_PREFIX = "tied.embedding.modality_embeddings.0.model."
TEXT_EMBED = "tied.embedding.text_embedding.weight"
AUDIO_EMBED = "tied.embedding.modality_embeddings.0.embedding.weight"
# checkpoint name prefix -> standalone Qwen3ForCausalLM name prefix (spec §2.1)
QWEN3_NAME_MAP = (("tied.embedding.text_embedding.", "model.embed_tokens."), ("body.layers.", "model.layers."),
                  ("body.norm.", "model.norm."))


class CheckpointError(ValueError):
    """The checkpoint folder is incomplete or inconsistent; the message says what and where."""


# ---------------------------------------------------------------------------------------------------------------
# resolve


def resolve(model: str | os.PathLike, revision: str | None = None, token: str | None = None,
            cache_dir: str | os.PathLike | None = None) -> Path:
    """A local checkpoint folder, or download the needed files of a Hub repo (resumable, progress shown)."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; expected a checkpoint folder")
        return path
    if str(model).count("/") != 1 or str(model).startswith((".", "/", "~")):
        raise FileNotFoundError(f"checkpoint folder {model} does not exist (and is not a Hub repo id like "
                                f"{DEFAULT_REPO})")
    from huggingface_hub import snapshot_download

    log.info("downloading %s%s from the Hugging Face Hub", model, f"@{revision}" if revision else "")
    return Path(snapshot_download(repo_id=str(model), revision=revision, token=token, cache_dir=cache_dir,
                                  allow_patterns=list(REQUIRED_FILES + OPTIONAL_FILES)))


# ---------------------------------------------------------------------------------------------------------------
# facts


def load_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"missing file {path.name} in {path.parent}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def codec_config(folder: Path) -> dict:
    """The folder's codec config, else the bundled real one (the real TTS repo ships none)."""
    own = folder / CODEC_CONFIG_FILE
    return load_json(own if own.is_file() else ASSETS / CODEC_CONFIG_FILE)


@dataclass(frozen=True)
class ModelFacts:
    """Every dimension and id the toolkit needs, read from the checkpoint."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    rope_theta: float
    rms_eps: float
    num_codebooks: int
    codebook_vocab: int  # per codebook, codes + BOC + EOC
    boc: int
    eoc: int
    placeholder: int  # audio_token_id in prompts
    codebook_size: int  # codec codes per codebook
    sample_rate: int
    semantic_sample_rate: int
    hop: int
    num_quantizers: int

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop

    @classmethod
    def from_dict(cls, data: dict) -> ModelFacts:
        """Facts recorded in a manifest; raises ValueError when a field is missing, mistyped or inconsistent."""
        import dataclasses

        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        missing = sorted(set(fields) - set(data))
        if missing:
            raise ValueError(f"model facts lack {', '.join(missing)}")
        values = {}
        for name, kind in fields.items():
            v = data[name]
            want = float if kind in ("float", float) else int
            if type(v) is bool or not isinstance(v, (int, float)) or (want is int and not isinstance(v, int)):
                raise ValueError(f"model fact {name} must be a number, got {v!r}")
            values[name] = want(v)
        facts = cls(**values)
        sizes = [facts.hidden, facts.layers, facts.heads, facts.kv_heads, facts.head_dim, facts.num_codebooks,
                 facts.codebook_vocab, facts.max_positions, facts.sample_rate, facts.hop]
        if min(sizes) <= 0:
            raise ValueError("model facts must be positive sizes")
        if (facts.boc, facts.eoc, facts.codebook_size) != (facts.codebook_vocab - 2, facts.codebook_vocab - 1,
                                                           facts.codebook_vocab - 2):
            raise ValueError("model facts: BOC/EOC/codebook size disagree with the codebook vocabulary")
        return facts

    @classmethod
    def from_configs(cls, cfg: dict, ccfg: dict) -> ModelFacts:
        try:
            tc, ac = cfg["text_config"], cfg["audio_encoder_config"]
            rope = tc.get("rope_parameters") or {}
            vocab = int(ac["vocab_size"])
            hop = math.prod(ccfg["acoustic_model_config"]["downsampling_ratios"])
            sr, cb = int(ccfg["sample_rate"]), int(ccfg["codebook_size"])
            nq = int(1000 * ccfg["target_bandwidths"][-1] // (math.ceil(sr / hop) * math.ceil(math.log2(cb))))
            facts = cls(
                hidden=int(tc["hidden_size"]), intermediate=int(tc["intermediate_size"]),
                layers=int(tc["num_hidden_layers"]), heads=int(tc["num_attention_heads"]),
                kv_heads=int(tc["num_key_value_heads"]),
                head_dim=int(tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]),
                vocab_size=int(tc["vocab_size"]), max_positions=int(tc["max_position_embeddings"]),
                # older configs carry rope_theta null in sub-configs; loaders then use Qwen3's 1e6 (spec §1)
                rope_theta=float(rope.get("rope_theta") or tc.get("rope_theta") or 1e6),
                rms_eps=float(tc["rms_norm_eps"]), num_codebooks=int(ac["num_codebooks"]), codebook_vocab=vocab,
                boc=vocab - 2, eoc=vocab - 1, placeholder=int(cfg["audio_token_id"]), codebook_size=cb,
                sample_rate=sr, semantic_sample_rate=int(ccfg["semantic_sample_rate"]), hop=int(hop),
                num_quantizers=nq,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"config.json lacks or mangles a required key: {e}") from None
        if facts.boc != facts.codebook_size:
            raise CheckpointError(f"audio vocabulary {vocab} != codec codebook size {cb} + 2 (BOC, EOC)")
        if facts.num_quantizers != facts.num_codebooks:
            raise CheckpointError(f"codec has {nq} quantizers but the model expects {facts.num_codebooks} codebooks")
        if int(ac.get("out_dim", facts.hidden)) != facts.hidden:
            raise CheckpointError(f"audio_encoder_config.out_dim {ac['out_dim']} != hidden_size {facts.hidden}")
        return facts


def load_facts(folder: Path) -> ModelFacts:
    cfg = load_json(folder / "config.json")
    if cfg.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{folder}/config.json has model_type {cfg.get('model_type')!r}; this toolkit "
                              f"supports {MODEL_TYPE!r} (Higgs Audio v3 TTS)")
    return ModelFacts.from_configs(cfg, codec_config(folder))


def backbone_shapes(f: ModelFacts) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of the text body + fused audio embedding (spec §2.1)."""
    d, hd, q, kv = f.hidden, f.head_dim, f.heads * f.head_dim, f.kv_heads * f.head_dim
    shapes = {TEXT_EMBED: (f.vocab_size, d), AUDIO_EMBED: (f.num_codebooks * f.codebook_vocab, d),
              "body.norm.weight": (d,)}
    for i in range(f.layers):
        p = f"body.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (f.intermediate, d), p + "mlp.up_proj.weight": (f.intermediate, d),
                   p + "mlp.down_proj.weight": (d, f.intermediate)}
    return shapes


def validate(folder: Path) -> ModelFacts:
    """Check files, config and tensors (names, shapes) of a checkpoint folder; one clear error per problem."""
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder} is not a Higgs v3 checkpoint: missing {', '.join(missing)}")
    facts = load_facts(folder)
    header = read_header(folder / WEIGHTS)
    for name, shape in backbone_shapes(facts).items():
        if name not in header:
            raise CheckpointError(f"{WEIGHTS} lacks tensor {name}")
        if tuple(header[name]["shape"]) != shape:
            raise CheckpointError(f"{name} has shape {tuple(header[name]['shape'])} but config.json implies {shape}")
    codec = [n for n in header if n.startswith(CODEC_PREFIX)]
    for q in range(facts.num_quantizers):
        name = f"{CODEC_PREFIX}quantizer.quantizers.{q}.codebook.embed"
        if name not in header:
            raise CheckpointError(f"{WEIGHTS} lacks codec tensor {name} ({len(codec)} codec tensors found)")
        if header[name]["shape"][0] != facts.codebook_size:
            raise CheckpointError(f"{name} has {header[name]['shape'][0]} codes, codec config says "
                                  f"{facts.codebook_size}")
    return facts


# ---------------------------------------------------------------------------------------------------------------
# tensor bytes and Qwen3 extraction


class TensorFile:
    """Raw, zero-copy access to the tensors of one safetensors file (no framework, no full load)."""

    def __init__(self, path: Path):
        self.path = path
        self.header = read_header(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        self.data_start = 8 + n

    def raw(self, name: str) -> bytes:
        b, e = self.header[name]["data_offsets"]
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), e - b, self.data_start + b)


def qwen3_config(cfg: dict) -> dict:
    tc = dict(cfg["text_config"])
    tc["architectures"] = ["Qwen3ForCausalLM"]
    tc["model_type"] = "qwen3"
    tc.setdefault("tie_word_embeddings", True)
    return tc


def files_digest(folder: Path, names: tuple[str, ...] = ("config.json", WEIGHTS)) -> str:
    """A cheap identity of checkpoint files: name, size and mtime (hashing 9 GB each run would take minutes)."""
    h = hashlib.sha256()
    for name in names:
        st = (folder / name).stat()
        h.update(f"{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def is_extracted(folder: Path, out: Path) -> bool:
    """Whether `out` holds a finished extraction (`extract_qwen3`) of the checkpoint in `folder` as it is now."""
    marker = out / "extracted_from.json"
    try:
        return marker.is_file() and load_json(marker).get("digest") == files_digest(folder)
    except (OSError, ValueError, AttributeError):  # a damaged marker: extract again
        return False


def extract_qwen3(folder: Path, out: Path) -> Path:
    """Write a standalone `Qwen3ForCausalLM` folder (config + `model.*` tensors + tokenizer) into `out`.

    Tensors are copied byte for byte, one at a time, so RAM stays flat whatever the model size. Skipped when `out`
    already holds an extraction of the same source files.
    """
    if is_extracted(folder, out):
        log.info("qwen3 body already extracted in %s", out)
        return out
    stamp = files_digest(folder)
    marker = out / "extracted_from.json"
    cfg = load_json(folder / "config.json")
    src = TensorFile(folder / WEIGHTS)
    mapping = {}
    for name in src.header:
        for old, new in QWEN3_NAME_MAP:
            if name.startswith(old):
                mapping[new + name[len(old):]] = name
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    specs = [(new, src.header[old]["dtype"], tuple(src.header[old]["shape"])) for new, old in sorted(mapping.items())]
    write_streaming(out / WEIGHTS, specs, lambda new: src.raw(mapping[new]), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(qwen3_config(cfg), indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    marker.write_text(json.dumps({"source": str(folder), "digest": stamp}) + "\n")
    return out
