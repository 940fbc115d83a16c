"""`OnnxCodec`: the export's 24 kHz neural codec: reference audio -> codes (encoder), codes -> audio (one-shot
decoder), and incremental decoding for streams (the stateful graph, or overlapping windows; generation.codec_stream).

    codec = OnnxCodec(parts)                         # parts: a runtime.parts.ModelParts
    codes = codec.encode_audio(codec.reference("me.wav"))      # (T, N) int64
    wav = codec.decode_audio(codes.T[None])                    # (hop * T,) float32
    stream = codec.codec_stream(StreamOptions())               # .push(frames) -> [samples], .flush()
"""

from __future__ import annotations

import os

import numpy as np

from ..audio import load_reference, prepare_reference
from ..generation.codec_stream import CodecStream, StatefulCodecStream, StreamOptions
from .parts import STATEFUL_CODEC


class OnnxCodec:
    """The codec parts of one export (`audio_encoder`, `audio_tokenizer`, `audio_tokenizer_stream`)."""

    def __init__(self, parts):
        self.parts, self.facts = parts, parts.facts

    def encode_audio(self, wav: np.ndarray) -> np.ndarray:
        """(L,) float32 mono at the codec rate -> (T, N) int64 codes."""
        return self.parts.part("audio_encoder")(waveform=wav[None])["audio_codes"][0].T.astype(np.int64)

    def decode_audio(self, codes: np.ndarray) -> np.ndarray:
        """(1, N, T) int64 codes in [0, codebook_size) -> (hop*T,) float32."""
        out = self.parts.part("audio_tokenizer")(audio_codes=codes)["waveform"][0, 0]
        return out.astype(np.float32, copy=False)

    def reference(self, ref_audio) -> np.ndarray:
        """A file path, or (waveform, sample_rate) -> mono waveform at the codec rate."""
        if isinstance(ref_audio, (str, os.PathLike)):
            return load_reference(ref_audio, self.facts.sample_rate)
        wav, sr = ref_audio
        return prepare_reference(np.asarray(wav), int(sr), self.facts.sample_rate)

    @property
    def has_stateful_codec(self) -> bool:
        """Whether the export has the stateful streaming codec (folders built before it decode windows)."""
        return self.parts.has_stateful_codec

    def codec_stream(self, options: StreamOptions, decode_audio=None):
        """The incremental codec decoder for one stream (see `generation.codec_stream`): the stateful graph (every frame
        decoded once) unless the export predates it or `options.codec` asks for overlapping windows (decoded with
        `decode_audio`, default this codec's)."""
        f = self.facts
        if options.codec == "stateful" and not self.has_stateful_codec:
            raise ValueError(f"{self.parts.manifest.folder} has no {STATEFUL_CODEC} part (built before it existed); "
                             f"rebuild with optimize.py, or stream with codec='window'")
        if options.codec != "window" and self.has_stateful_codec:
            return StatefulCodecStream(self.parts.part(STATEFUL_CODEC), f.hop, f.codebook_size, options)
        return CodecStream(decode_audio or self.decode_audio, f.hop, f.codebook_size, options)

    def decode_rows(self, rows: np.ndarray, delayed: bool = True, decode_audio=None) -> np.ndarray:
        """Code rows from elsewhere -> waveform; `delayed` rows are reversed first, codes >= codebook size -> 0."""
        from ..generation.delay import codes_for_codec, reverse_delay

        raw = reverse_delay(rows) if delayed else rows
        return (decode_audio or self.decode_audio)(codes_for_codec(raw, self.facts.codebook_size))
