import pytest
from tokenizers import Tokenizer

from higgs_onnx.generation.prompt import PromptTokens, build_prompt

FIXTURE = [151667, 151672, 13936, 311, 67201, 55336, 398, 13, 151670]  # official "Welcome to SpeakSwiftly."


def test_real_vocabulary_reproduces_the_official_fixture(real_tokenizer):
    ids = PromptTokens.from_tokenizer(real_tokenizer, -100)
    assert build_prompt(real_tokenizer, ids, "Welcome to SpeakSwiftly.") == FIXTURE
    assert ids.control_tags["<|prosody:pause|>"] == 151722
    assert ids.control_tags["<|emotion:elation|>"] == 151681


def test_clone_layouts(real_tokenizer):
    ids = PromptTokens.from_tokenizer(real_tokenizer, -100)
    body = real_tokenizer.encode("Hi.", add_special_tokens=False).ids
    ref = real_tokenizer.encode("Before.", add_special_tokens=False).ids
    assert build_prompt(real_tokenizer, ids, "Hi.", ref_rows=3) == [
        ids.tts, ids.ref_audio, -100, -100, -100, ids.text, *body, ids.audio]
    assert build_prompt(real_tokenizer, ids, "Hi.", ref_rows=2, ref_text="Before.") == [
        ids.tts, ids.ref_text, *ref, ids.ref_audio, -100, -100, ids.text, *body, ids.audio]
    with pytest.raises(ValueError, match="reference audio"):
        build_prompt(real_tokenizer, ids, "Hi.", ref_text="Before.")


def test_control_tags_are_single_ids_inside_text(real_tokenizer):
    ids = PromptTokens.from_tokenizer(real_tokenizer, -100)
    p = build_prompt(real_tokenizer, ids, "<|emotion:elation|>Welcome aboard. Hello <|prosody:pause|> and")
    assert p[2] == 151681 and 151722 in p
    assert len(ids.control_tags) == 21 + 3 + 9 + 10  # emotions, styles, sfx, prosody


def test_unknown_tags_are_reported(real_tokenizer):
    ids = PromptTokens.from_tokenizer(real_tokenizer, -100)
    assert ids.unknown_tags("<|emotion:elation|>Hi <|emotion:glee|> there", real_tokenizer) == ["<|emotion:glee|>"]


def test_tiny_tokenizer_looks_ids_up_by_string(tiny_ckpt, real_tokenizer):
    tiny = Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json"))
    t, r = PromptTokens.from_tokenizer(tiny, -100), PromptTokens.from_tokenizer(real_tokenizer, -100)
    assert t.tts != r.tts and t.audio != r.audio  # different ids ...
    assert t.control_tags.keys() == r.control_tags.keys()  # ... same tags, same order
    assert sorted(t.control_tags, key=t.control_tags.get) == sorted(r.control_tags, key=r.control_tags.get)
    p = build_prompt(tiny, t, "<|sfx:cough|>Ahem, hello.")
    assert p[0] == t.tts and p[2] == t.control_tags["<|sfx:cough|>"] and p[-1] == t.audio


def test_not_a_higgs_tokenizer():
    from tokenizers import models
    with pytest.raises(ValueError, match="Higgs special tokens"):
        PromptTokens.from_tokenizer(Tokenizer(models.BPE()), -100)
