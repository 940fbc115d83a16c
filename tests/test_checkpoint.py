"""Checkpoint access: resolve (local / Hub), validation errors, streamed Qwen3 extraction."""

import json
import shutil

import pytest
import torch

from higgs_onnx import checkpoint as ck
from higgs_onnx.st_stream import write_streaming


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    return shutil.copytree(tiny_ckpt, tmp_path / "copy")


def edit_config(folder, fn):
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_valid_checkpoint(tiny_ckpt):
    assert ck.validate(tiny_ckpt).hidden == 64


@pytest.mark.parametrize("mutate, message", [
    (lambda d: (d / "tokenizer.json").unlink(), "missing tokenizer.json"),
    (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda d: edit_config(d, lambda c: c.update(model_type="llama")), "model_type 'llama'"),
    (lambda d: edit_config(d, lambda c: c["text_config"].update(intermediate_size=96)), "config.json implies"),
    (lambda d: edit_config(d, lambda c: c["text_config"].pop("num_hidden_layers")), "num_hidden_layers"),
    (lambda d: edit_config(d, lambda c: c["audio_encoder_config"].update(vocab_size=1030)), "codebook size"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), "corrupt safetensors header"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100_000]),
     "past the end"),
])
def test_invalid_checkpoints_fail_with_one_clear_error(ckpt_copy, mutate, message):
    mutate(ckpt_copy)
    with pytest.raises(ValueError, match=message):
        ck.validate(ckpt_copy)


def test_missing_tensor_is_named(ckpt_copy):
    src = ck.TensorFile(ckpt_copy / ck.WEIGHTS)
    drop = "body.layers.1.mlp.up_proj.weight"
    specs = [(n, i["dtype"], tuple(i["shape"])) for n, i in sorted(src.header.items()) if n != drop]
    data = {n: src.raw(n) for n, _, _ in specs}
    write_streaming(ckpt_copy / ck.WEIGHTS, specs, data.__getitem__)
    with pytest.raises(ck.CheckpointError, match=f"lacks tensor {drop}"):
        ck.validate(ckpt_copy)


def test_resolve_local_and_missing(tiny_ckpt, tmp_path):
    assert ck.resolve(tiny_ckpt) == tiny_ckpt
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ck.resolve(tmp_path / "nope")
    with pytest.raises(ck.CheckpointError, match="is a file"):
        ck.resolve(tiny_ckpt / "config.json")


def test_resolve_repo_id_downloads_only_needed_files(tiny_ckpt, tmp_path, monkeypatch):
    calls = {}

    def fake_snapshot_download(**kwargs):  # the Hub's network is out of reach: a local folder stands in
        calls.update(kwargs)
        return str(shutil.copytree(tiny_ckpt, tmp_path / "hub"))

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    path = ck.resolve(ck.DEFAULT_REPO, revision="abc123", token="hf_secret")
    assert ck.validate(path).layers == 2
    assert calls["repo_id"] == "bosonai/higgs-tts-3-4b" and calls["revision"] == "abc123"
    assert calls["token"] == "hf_secret"
    assert set(ck.REQUIRED_FILES) <= set(calls["allow_patterns"]) and "*.safetensors" not in calls["allow_patterns"]


def test_codec_config_falls_back_to_the_bundled_copy(ckpt_copy):
    (ckpt_copy / ck.CODEC_CONFIG_FILE).unlink()
    assert ck.codec_config(ckpt_copy)["semantic_model_config"]["hidden_size"] == 768  # the real codec


def test_extract_qwen3_loads_in_transformers(tiny_ckpt, reference, tmp_path):
    from transformers import Qwen3ForCausalLM

    out = ck.extract_qwen3(tiny_ckpt, tmp_path / "qwen3")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    header = ck.read_header(out / ck.WEIGHTS)
    assert all(n.startswith("model.") for n in header) and len(header) == 11 * 2 + 2
    model = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        a = model.model(inputs_embeds=x).last_hidden_state
        b = reference.body(inputs_embeds=x).last_hidden_state
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    mtime = (out / ck.WEIGHTS).stat().st_mtime_ns
    ck.extract_qwen3(tiny_ckpt, out)  # unchanged source: skipped
    assert (out / ck.WEIGHTS).stat().st_mtime_ns == mtime


def test_the_disk_check_counts_a_body_already_extracted(tiny_ckpt, tmp_path):
    """The decoder build's free-space estimate leaves out the extracted body when a current extraction is there
    (the 4b refused to rebuild with 28 GB free beside its own 7.6 GB extraction), and counts it again when the
    checkpoint changed since or the marker is damaged."""
    from higgs_onnx.parts.llm_decoder import disk_needed

    size = (tiny_ckpt / ck.WEIGHTS).stat().st_size
    body = tmp_path / "qwen3"
    assert disk_needed(tiny_ckpt, body) == disk_needed(tiny_ckpt) == 4 * size  # nothing extracted yet
    ck.extract_qwen3(tiny_ckpt, body)
    assert ck.is_extracted(tiny_ckpt, body) and disk_needed(tiny_ckpt, body) == 3 * size
    (body / "extracted_from.json").write_text("{not json")
    assert not ck.is_extracted(tiny_ckpt, body) and disk_needed(tiny_ckpt, body) == 4 * size
    (body / "extracted_from.json").write_text('["a list"]')
    assert not ck.is_extracted(tiny_ckpt, body)
