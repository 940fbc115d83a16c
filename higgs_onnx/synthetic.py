"""Synthetic Higgs v3 checkpoints with the exact file layout of `bosonai/higgs-tts-3-4b` and random weights.

    python -m higgs_onnx.synthetic --preset tiny --out models/tiny [--seed 0]
    python -m higgs_onnx.synthetic --preset 4b --out models/4b      # real geometry, ~9 GB, written tensor by tensor

Every file, config key, tensor name and dtype (bf16) is the real one (spec §1, §2, §7); only widths and depths
shrink in `tiny`. Weights are random but planted so the model behaves like one (spec §7.1): greedy decoding gives
varied codes and emits EOC on codebook 0 by itself once the audio rows outnumber the prompt by `eoc_ratio`.

How the stop signal is planted (channels of the hidden state, see `Plant`):
- FLAG: +text_flag on every text-embedding row (rows of fixed norm), 0 on the fused audio rows.
- Layer 0, query head 0 has zero query weights, so it attends uniformly over the causal context; its value
  dimension 0 reads FLAG and o_proj writes it (times `avg_gain`) into channel AVG: AVG = running mean of FLAG,
  i.e. proportional to the fraction of text positions in the context.
- The codebook-0 EOC row of the fused matrix (tied head) reads AVG with a negative weight and CONST (a constant
  channel) with an offset, so its logit rises as audio rows accumulate and wins past the chosen ratio.
- BOC/EOC rows of codebooks 1-7 (and BOC of codebook 0) carry less CONST, so they never win outside the ramp.
- No other weight writes FLAG/CONST/AVG; the final norm amplifies CONST and AVG so the stop signal stands above
  the logit noise; down_proj is scaled up so the position-wise MLP, not the tied embedding nor the (smooth)
  attention average, decides the next row (otherwise every codebook locks onto its previous code).
Same seed -> byte-identical files (each tensor has its own RNG stream keyed by seed and name).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .checkpoint import AUDIO_EMBED, CODEC_CONFIG_FILE, CODEC_PREFIX, TEXT_EMBED, ModelFacts, backbone_shapes
from .st_stream import tensor_nbytes, write_streaming
from .tokenizer_files import ASSETS, write_tokenizer_files

log = logging.getLogger(__name__)

TEXT_HEAD = "tied.head.text_head.weight"  # file-only duplicate of TEXT_EMBED
AUDIO_HEAD = "tied.head.modality_heads.0.weight"  # file-only duplicate of AUDIO_EMBED
FILE_ONLY = {TEXT_HEAD: TEXT_EMBED, AUDIO_HEAD: AUDIO_EMBED}

FLAG, CONST, AVG = 0, 1, 2  # planted hidden channels


@dataclass(frozen=True)
class Preset:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_positions: int
    base_vocab: int | None  # None: the real vocabulary (151,643 ranks + 84 added tokens)
    vocab_size: int
    codec: dict  # overrides of the real codec config (spec §6, §7)


PRESETS = {
    "tiny": Preset(
        hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, max_positions=4096,
        base_vocab=1024, vocab_size=1152,  # 1024 BPE ranks + 84 added tokens, padded to a multiple of 64
        codec={
            "acoustic_model_config": {"encoder_hidden_size": 4, "hidden_size": 16, "decoder_hidden_size": 64},
            "semantic_model_config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                      "intermediate_size": 64, "conv_dim": [32] * 7},
            "codebook_dim": 8,
        },
    ),
    "4b": Preset(
        hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, head_dim=128, max_positions=32768,
        base_vocab=None, vocab_size=151936, codec={},
    ),
}


@dataclass(frozen=True)
class Plant:
    """Magnitudes of the planted stop signal (see module docstring); tuned on the tiny preset."""

    eoc_ratio: float = 6.0  # EOC wins once generated+reference rows reach about this many times the text tokens
    text_flag: float = 2.0
    const: float = 2.0
    avg_gain: float = 4.0
    eoc_gain: float = 20.0  # how sharply the EOC logit follows AVG (at d=64; scaled by sqrt(d/64))
    special_penalty: float = 1.0  # fraction of CONST removed from BOC/EOC rows of codebooks 1-7 (and BOC of 0)
    mlp_scale: float = 10.0  # down_proj scale-up: the position-wise MLP, not the tied embedding, picks the next row
    final_gain: float = 30.0  # body.norm weight of CONST and AVG: lifts the stop signal above the logit noise


# ---------------------------------------------------------------------------------------------------------------
# config files


def real_codec_config() -> dict:
    return json.loads((ASSETS / CODEC_CONFIG_FILE).read_text())


def codec_config(preset: Preset) -> dict:
    cfg = real_codec_config()
    for key, value in preset.codec.items():
        if isinstance(value, dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def model_config(preset: Preset, tokenizer: dict) -> dict:
    eot = next(a["id"] for a in tokenizer["added_tokens"] if a["content"] == "<|endoftext|>")
    text_config = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eot,
        "dtype": "bfloat16",
        "eos_token_id": eot,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "hidden_size": preset.hidden,
        "initializer_range": 0.02,
        "intermediate_size": preset.intermediate,
        "max_position_embeddings": preset.max_positions,
        "max_window_layers": preset.layers,
        "model_type": "qwen3",
        "num_attention_heads": preset.heads,
        "num_hidden_layers": preset.layers,
        "num_key_value_heads": preset.kv_heads,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": preset.vocab_size,
    }
    audio_encoder_config = {
        "encoder_type": "discrete",
        "max_chunk_size": 50,
        "mel_per_sample": 8,
        "model_type": "higgs_audio_encoder",
        "num_codebooks": 8,
        "out_dim": preset.hidden,
        "qwen3_aut_config": None,
        "tie_word_embeddings": True,
        "use_delay_pattern": True,
        "vocab_size": 1026,
        "whisper_config": None,
    }
    return {
        "_hidden_size": preset.hidden,
        "_vocab_size": preset.vocab_size,
        "architectures": ["HiggsMultimodalQwen3ForConditionalGeneration"],
        "audio_encoder_config": audio_encoder_config,
        "audio_token_id": -100,
        "dtype": "bfloat16",
        "ignore_index": -100,
        "mel_per_sample": 8,
        "model_type": "higgs_multimodal_qwen3",
        "text_config": text_config,
        "tie_word_embeddings": True,
        "transformers_version": "5.5.0",
    }


# ---------------------------------------------------------------------------------------------------------------
# tensor names and shapes


def codec_specs(codec_cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Names/shapes of transformers' HiggsAudioV2TokenizerModel state dict (built on the meta device) + extras."""
    import torch
    from transformers import HiggsAudioV2TokenizerConfig

    from .reference.torchaudio_shim import load_codec_class

    cls = load_codec_class()
    kwargs = {k: v for k, v in codec_cfg.items() if k not in ("model_type", "architectures", "dtype",
                                                               "transformers_version")}
    with torch.device("meta"):
        model = cls(HiggsAudioV2TokenizerConfig(**kwargs))
    specs = [(CODEC_PREFIX + k, tuple(v.shape)) for k, v in model.state_dict().items()]
    hubert = codec_cfg["semantic_model_config"]["hidden_size"]
    specs.append((CODEC_PREFIX + "semantic_model.masked_spec_embed", (hubert,)))  # in the real file, unused
    return specs


# ---------------------------------------------------------------------------------------------------------------
# values


def _rng(seed: int, name: str, chunk: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), chunk])


def _codec_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random codec weights with sane activation scales (fan-in scaled convs, unit norms, non-zero codebooks)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "alpha":  # Snake
        return rng.uniform(0.5, 1.5, shape)
    if "layer_norm" in name:
        return np.ones(shape) if leaf == "weight" else np.zeros(shape)
    if leaf in ("inited", "cluster_size"):
        return np.ones(shape)
    if leaf in ("embed", "embed_avg", "masked_spec_embed"):
        return rng.standard_normal(shape)
    if leaf == "bias":
        return rng.standard_normal(shape) * 0.01
    if leaf == "original0":  # weight-norm magnitude of HuBERT's positional conv
        return np.full(shape, 0.5)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    if "conv_t1" in name:  # ConvTranspose1d weights are [C_in, C_out, k]
        fan_in = shape[0] * shape[2] // 2
    std = 1.0 / math.sqrt(max(fan_in, 1))
    if name.endswith("acoustic_decoder.conv2.weight"):
        std *= 5e-4  # keep the synthetic waveform well inside [-1, 1]
    return rng.standard_normal(shape) * std


class Weights:
    """Produces the bf16 bytes of each tensor, deterministically, one tensor (or row block) at a time."""

    ROW_BLOCK = 8192  # rows generated at once for the big embedding matrices (bounds RAM for the 4b preset)

    def __init__(self, cfg: dict, codec_cfg: dict, seed: int, plant: Plant, tokenizer: dict):
        self.cfg, self.codec_cfg, self.seed, self.plant = cfg, codec_cfg, seed, plant
        f = ModelFacts.from_configs(cfg, codec_cfg)
        self.d, self.hd, self.nq, self.cv = f.hidden, f.head_dim, f.num_codebooks, f.codebook_vocab
        self.boc, self.eoc = f.boc, f.eoc
        self.n_tokens = max(a["id"] for a in tokenizer["added_tokens"]) + 1
        self.shapes = backbone_shapes(f) | dict(codec_specs(codec_cfg))
        for head, src in FILE_ONLY.items():
            self.shapes[head] = self.shapes[src]

    def chunks(self, name: str) -> Iterator[bytes]:
        src = FILE_ONLY.get(name, name)
        shape = self.shapes[src]
        if src in (TEXT_EMBED, AUDIO_EMBED):
            for start in range(0, shape[0], self.ROW_BLOCK):
                rows = np.arange(start, min(start + self.ROW_BLOCK, shape[0]))
                yield self._embedding(src, rows, _rng(self.seed, src, start)).astype(ml_dtypes.bfloat16).tobytes()
            return
        rng = _rng(self.seed, src)
        if src.startswith(CODEC_PREFIX):
            values = _codec_values(src, shape, rng)
        else:
            values = self._backbone(src, shape, rng)
        yield np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).tobytes()

    def _embedding(self, name: str, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        p = self.plant
        if name == TEXT_EMBED:
            e = rng.standard_normal((len(rows), self.d), np.float32)
            e[:, :3] = 0.0
            # a fixed norm for every row makes the normalised FLAG of a text position one known constant
            e *= math.sqrt(self.d - 3) / np.linalg.norm(e, axis=1, keepdims=True)
            e[:, FLAG], e[:, CONST] = p.text_flag, p.const
            e[rows >= self.n_tokens] = 0.0  # padding rows beyond the tokenizer are never used
            return e
        # fused audio matrix: a frame embeds as the sum of N rows, so each row carries 1/N of CONST; FLAG is 0
        e = rng.standard_normal((len(rows), self.d), np.float32) / math.sqrt(self.nq)
        code = rows % self.cv
        e[:, FLAG], e[:, CONST], e[:, AVG] = 0.0, p.const / self.nq, 0.0
        special = (code >= self.boc) & ~((rows // self.cv == 0) & (code == self.eoc))
        e[special, CONST] *= 1.0 - p.special_penalty
        eoc0 = rows == self.eoc  # codebook 0's EOC row
        if eoc0.any():
            # After n_t text and n_a audio positions AVG = avg_gain * p * n_t / (n_t + n_a), p being the
            # normalised FLAG of a text row. logit(EOC) - logit(other) ~ gain * (threshold - AVG): it turns
            # positive once n_a / n_t passes eoc_ratio. The gain grows with sqrt(d) like the logit noise does.
            text_v = math.sqrt(self.d) * p.text_flag / math.sqrt(self.d - 3 + p.text_flag**2 + p.const**2)
            threshold = p.avg_gain * text_v / (1 + p.eoc_ratio)
            gain = p.eoc_gain * math.sqrt(self.d / 64)
            e[eoc0, AVG] = -gain
            e[eoc0, CONST] = p.const / self.nq + gain * threshold / p.const
        return e

    def _backbone(self, name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        p, d, hd = self.plant, self.d, self.hd
        if name.endswith("norm.weight"):
            w = 1.0 + 0.05 * rng.standard_normal(shape)
            if len(shape) == 1 and shape[0] == d:
                w[[FLAG, CONST, AVG]] = 1.0
            if name == "body.norm.weight":
                w[[CONST, AVG]] = p.final_gain  # after the final norm only: layer inputs keep their scale
            return w
        w = rng.standard_normal(shape) / math.sqrt(shape[1])
        layer = int(name.split(".")[2])
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            if name.endswith("down_proj.weight"):
                w *= p.mlp_scale
            w[[FLAG, CONST, AVG], :] = 0.0  # nothing writes the planted channels ...
            if layer == 0 and name.endswith("o_proj.weight"):
                w[:, 0] = 0.0  # ... except head 0 / dim 0 of layer 0 (the running mean of FLAG) into AVG
                w[AVG, 0] = p.avg_gain
        elif layer == 0 and name.endswith("q_proj.weight"):
            w[:hd] = 0.0  # query head 0 attends uniformly over the causal context
        elif layer == 0 and name.endswith("v_proj.weight"):
            w[0] = 0.0  # value dim 0 of kv head 0 reads FLAG only
            w[0, FLAG] = 1.0
        return w


# ---------------------------------------------------------------------------------------------------------------
# writer


def build(preset: str | Preset, out: Path, seed: int = 0, plant: Plant | None = None, progress: bool = True) -> Path:
    """Write a synthetic checkpoint folder; returns `out`. `preset`: a name of `PRESETS` or a custom `Preset`."""
    from tqdm import tqdm

    preset_name = preset if isinstance(preset, str) else "custom"
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    plant = plant or Plant()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer_files(out, preset.base_vocab)
    cfg = model_config(preset, tokenizer)
    ccfg = codec_config(preset)
    weights = Weights(cfg, ccfg, seed, plant, tokenizer)

    names = sorted(weights.shapes)  # safetensors' own writer orders equal-dtype tensors by name
    specs = [(n, "BF16", weights.shapes[n]) for n in names]
    total = sum(tensor_nbytes("BF16", s) for _, _, s in specs)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"{preset_name} weights", disable=not progress)
    write_streaming(out / "model.safetensors", specs, weights.chunks,
                    metadata={"format": "pt"}, progress=bar.update)
    bar.close()

    indexed = [n for n in names if n not in FILE_ONLY]  # the real index omits the two tied head copies
    index = {"metadata": {"total_size": sum(tensor_nbytes("BF16", weights.shapes[n]) for n in indexed)},
             "weight_map": {n: "model.safetensors" for n in indexed}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / CODEC_CONFIG_FILE).write_text(json.dumps(ccfg, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")  # last: marks the folder complete
    meta = {"preset": preset_name, "seed": seed, "plant": asdict(plant)}
    if preset_name == "custom":
        meta["dims"] = asdict(preset)
    (out / "synthetic.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eoc-ratio", type=float, default=Plant.eoc_ratio,
                    help="audio rows per text token at which EOC wins (default %(default)s)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    build(args.preset, args.out, args.seed, Plant(eoc_ratio=args.eoc_ratio))
    size = (args.out / "model.safetensors").stat().st_size
    print(f"wrote {args.preset} checkpoint to {args.out} ({size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
