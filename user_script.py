"""Olive hooks, one line each: `get_<part>_model(model_path)`, `get_<part>_io_config(model)`,
`get_<part>_dummy_inputs(model)`; the logic lives in `higgs_onnx.parts.<part>`. Nothing here touches the network.
"""

from higgs_onnx.parts import (
    audio_embed,
    audio_encoder,
    audio_heads,
    audio_tokenizer,
    audio_tokenizer_stream,
    text_embed,
)


def get_text_embed_model(model_path):
    return text_embed.load(model_path)


def get_text_embed_io_config(model):
    return text_embed.io_config(model.model_path)


def get_text_embed_dummy_inputs(model):
    return text_embed.dummy_inputs(model.model_path)


def get_audio_embed_model(model_path):
    return audio_embed.load(model_path)


def get_audio_embed_io_config(model):
    return audio_embed.io_config(model.model_path)


def get_audio_embed_dummy_inputs(model):
    return audio_embed.dummy_inputs(model.model_path)


def get_audio_heads_model(model_path):
    return audio_heads.load(model_path)


def get_audio_heads_io_config(model):
    return audio_heads.io_config(model.model_path)


def get_audio_heads_dummy_inputs(model):
    return audio_heads.dummy_inputs(model.model_path)


def get_audio_encoder_model(model_path):
    return audio_encoder.load(model_path)


def get_audio_encoder_io_config(model):
    return audio_encoder.io_config(model.model_path)


def get_audio_encoder_dummy_inputs(model):
    return audio_encoder.dummy_inputs(model.model_path)


def get_audio_tokenizer_model(model_path):
    return audio_tokenizer.load(model_path)


def get_audio_tokenizer_io_config(model):
    return audio_tokenizer.io_config(model.model_path)


def get_audio_tokenizer_dummy_inputs(model):
    return audio_tokenizer.dummy_inputs(model.model_path)


def get_audio_tokenizer_stream_model(model_path):
    return audio_tokenizer_stream.load(model_path)


def get_audio_tokenizer_stream_io_config(model):
    return audio_tokenizer_stream.io_config(model.model_path)


def get_audio_tokenizer_stream_dummy_inputs(model):
    return audio_tokenizer_stream.dummy_inputs(model.model_path)
