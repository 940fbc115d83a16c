"""The tiny synthetic checkpoint has the real layout (spec §1, §2, §3, §7)."""

import json

import numpy as np
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from higgs_onnx.checkpoint import AUDIO_EMBED, CODEC_PREFIX, TEXT_EMBED, backbone_shapes, load_facts, validate
from higgs_onnx.synthetic import FILE_ONLY, build

TOP_KEYS = {"architectures", "model_type", "_hidden_size", "_vocab_size", "audio_token_id", "ignore_index",
            "audio_encoder_config", "text_config", "tie_word_embeddings", "dtype", "transformers_version",
            "mel_per_sample"}
TEXT_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "max_position_embeddings", "rope_parameters", "rms_norm_eps", "hidden_act",
             "bos_token_id", "eos_token_id", "tie_word_embeddings", "dtype", "model_type", "architectures"}
AUDIO_KEYS = {"model_type", "encoder_type", "num_codebooks", "vocab_size", "out_dim", "tie_word_embeddings",
              "use_delay_pattern"}


def test_files_and_config(tiny_ckpt):
    names = {p.name for p in tiny_ckpt.iterdir()}
    assert {"config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", "higgs_audio_v2_tokenizer_config.json"} <= names
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert TOP_KEYS <= cfg.keys() and TEXT_KEYS <= cfg["text_config"].keys()
    assert AUDIO_KEYS <= cfg["audio_encoder_config"].keys()
    assert cfg["model_type"] == "higgs_multimodal_qwen3" and cfg["audio_token_id"] == -100
    assert cfg["architectures"] == ["HiggsMultimodalQwen3ForConditionalGeneration"]
    assert cfg["text_config"]["rope_parameters"] == {"rope_theta": 1000000, "rope_type": "default"}
    assert cfg["audio_encoder_config"]["out_dim"] == cfg["text_config"]["hidden_size"] == cfg["_hidden_size"]
    assert json.loads((tiny_ckpt / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"


def test_tensors_match_config(tiny_ckpt):
    facts = validate(tiny_ckpt)
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    ccfg = json.loads((tiny_ckpt / "higgs_audio_v2_tokenizer_config.json").read_text())
    with safe_open(tiny_ckpt / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
        for name, shape in backbone_shapes(facts).items():
            assert tuple(f.get_slice(name).get_shape()) == shape, name
        assert f.get_slice(AUDIO_EMBED).get_shape() == [8 * 1026, facts.hidden]
        for head, src in FILE_ONLY.items():  # the two tied copies are equal to their embeddings
            assert (f.get_tensor(head) == f.get_tensor(src)).all()
        for q in range(8):
            embed = f.get_tensor(f"{CODEC_PREFIX}quantizer.quantizers.{q}.codebook.embed").float()
            assert embed.shape == (1024, ccfg["codebook_dim"]) and embed.abs().min() > 0  # codebooks not zero
    assert dtypes == {"BF16"}
    n_layers, n_hubert = cfg["text_config"]["num_hidden_layers"], ccfg["semantic_model_config"]["num_hidden_layers"]
    codec = [k for k in keys if k.startswith(CODEC_PREFIX)]
    assert len(codec) == 110 + 110 + 64 + 13 + 14 + 6 + (18 + 16 * n_hubert) + 1  # spec §2.2 formula
    assert CODEC_PREFIX + "semantic_model.masked_spec_embed" in keys
    assert len(keys) == 11 * n_layers + 3 + len(codec) + 2 == 395


def test_index_omits_the_tied_heads(tiny_ckpt):
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    with safe_open(tiny_ckpt / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        total = sum(f.get_tensor(k).numel() * 2 for k in index["weight_map"])  # bf16: 2 bytes each
    assert set(index["weight_map"]) == keys - set(FILE_ONLY) and len(index["weight_map"]) == 393
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert index["metadata"]["total_size"] == total


def test_every_added_token_is_one_id(tiny_ckpt):
    tok = Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json"))
    added = tok.get_added_tokens_decoder()
    assert len(added) == 84
    contents = [added[i].content for i in sorted(added)]
    assert contents[0] == "<|endoftext|>" and contents[24] == "<|tts|>" and contents[-1] == "<|prosody:expressive_low|>"
    for i, t in added.items():
        assert tok.encode(t.content, add_special_tokens=False).ids == [i]
    assert max(added) < json.loads((tiny_ckpt / "config.json").read_text())["text_config"]["vocab_size"]


def test_same_seed_same_bytes_other_seed_differs(tiny_ckpt, tmp_path):
    again = build("tiny", tmp_path / "again", seed=0, progress=False)
    other = build("tiny", tmp_path / "other", seed=1, progress=False)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert (again / name).read_bytes() == (tiny_ckpt / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny_ckpt / "model.safetensors").read_bytes()


def test_facts_are_read_from_the_files(tiny_ckpt):
    f = load_facts(tiny_ckpt)
    assert (f.hidden, f.layers, f.heads, f.kv_heads, f.head_dim) == (64, 2, 4, 2, 16)
    assert (f.num_codebooks, f.codebook_vocab, f.boc, f.eoc, f.codebook_size) == (8, 1026, 1024, 1025, 1024)
    assert (f.sample_rate, f.hop, f.frame_rate, f.num_quantizers) == (24000, 960, 25.0, 8)


@pytest.mark.parametrize("table", [TEXT_EMBED, AUDIO_EMBED])
def test_embeddings_are_not_degenerate(tiny_ckpt, table):
    with safe_open(tiny_ckpt / "model.safetensors", "pt") as f:
        w = f.get_tensor(table).float().numpy()
    assert np.isfinite(w).all() and w.std() > 0.1


def test_4b_preset_has_the_real_geometry_and_byte_count():
    """Without writing 9 GB: the 4b preset's names/shapes give the real index (927 entries, 8,489,763,794 bytes)."""
    from higgs_onnx.synthetic import PRESETS, Plant, Weights, codec_config, model_config
    from higgs_onnx.tokenizer_files import real_tokenizer_json

    tok = json.loads(real_tokenizer_json())
    preset = PRESETS["4b"]
    w = Weights(model_config(preset, tok), codec_config(preset), 0, Plant(), tok)
    indexed = {n: s for n, s in w.shapes.items() if n not in FILE_ONLY}
    assert len(indexed) == 927 and len(w.shapes) == 929
    assert sum(int(np.prod(s)) for s in indexed.values()) * 2 == 8_489_763_794  # spec §2 (PEG manifest)
    assert sum(int(np.prod(s)) for n, s in indexed.items() if n.startswith(CODEC_PREFIX)) == 201_401_321
