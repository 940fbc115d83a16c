"""Incremental codec decoding: audio for the code frames made so far, while generation goes on.

The codec decoder is not causal: a frame's samples depend on frames before and after it. `CodecStream` therefore
decodes overlapping windows: each window starts `left_context` frames before the first frame it emits and ends
`holdback` frames after the last one, and a frame is emitted only once that right context exists (at the end of
the utterance, `flush` emits the rest with whatever follows). Measured on the 4b preset's fp32 `audio_tokenizer`
(a window of frames vs one decode of 160 random frames, max abs error relative to the peak): left 16 / right 10
frames give 5.6e-5, left 24 / right 12 give 0.0 (bit-identical), right 8 gives 8e-2 whatever the left context.
With the defaults (that pair), 150 random frames pushed one at a time concatenate to the one-shot waveform within
6.5e-5 of its peak on the 4b preset (<= 1e-6 on tiny, tested), for 1.8 x the one-shot decode's compute (the
overlap is decoded twice). `HiggsTTS.stream` uses it for exports that predate the stateful part, or on request
(`StreamOptions(codec="window")`).

`StatefulCodecStream` has the same API on the stateful `audio_tokenizer_stream` part (see its docstring): the graph
keeps each layer's last inputs as state, so every frame is decoded once (one one-shot decode's compute, plus
ceil(delay / hop) dummy frames at the end) and the result equals the one-shot waveform up to float noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .delay import codes_for_codec

CODEC_MODES = ("auto", "stateful", "window")
END_UNKNOWN = 2**62  # `end` of the stateful graph while the utterance's frame count is not known yet


@dataclass(frozen=True)
class StreamOptions:
    first_frames: int = 8  # the first chunk: 0.32 s at 25 frames/s, so the first audio comes early
    chunk_frames: int = 25  # every later chunk: 1 s
    left_context: int = 24  # frames decoded again before a window (exact at 24, see the module docstring)
    holdback: int = 12  # frames after a window that must exist before it is emitted (exact at 12)
    # "auto": the stateful graph when the export has one, else windows; "stateful" / "window": that one
    codec: str = "auto"

    def __post_init__(self) -> None:
        if self.codec not in CODEC_MODES:
            raise ValueError(f"codec must be one of {', '.join(CODEC_MODES)}, got {self.codec!r}")
        for name in ("first_frames", "chunk_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("left_context", "holdback"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


class CodecStream:
    """Push raw code frames (T, N) as they are made; get back the samples that are final.

    `decode` maps (1, N, T) codes in [0, codebook_size) to (hop * T,) float32 samples (`HiggsTTS.decode_audio`).
    """

    def __init__(self, decode: Callable[[np.ndarray], np.ndarray], hop: int, codebook_size: int,
                 options: StreamOptions | None = None):
        self.decode, self.hop, self.codebook_size = decode, hop, codebook_size
        self.options = options or StreamOptions()
        self.frames: list[np.ndarray] = []  # (N,) raw codes, one per frame
        self.emitted = 0  # frames whose samples have been returned

    def push(self, frames: np.ndarray) -> list[np.ndarray]:
        """Add (T, N) raw frames; returns the chunks (each (hop * frames,) float32) that became final, maybe none."""
        self.frames.extend(np.asarray(frames, np.int64).reshape(-1, np.shape(frames)[-1]))
        o, out = self.options, []
        while True:
            size = o.first_frames if self.emitted == 0 else o.chunk_frames
            if len(self.frames) - o.holdback - self.emitted < size:
                return out
            out.append(self._window(self.emitted + size, self.emitted + size + o.holdback))

    def flush(self) -> np.ndarray:
        """The samples of every frame not returned yet (the utterance has ended: no more right context)."""
        if self.emitted >= len(self.frames):
            return np.zeros(0, np.float32)
        return self._window(len(self.frames), len(self.frames))

    def _window(self, stop: int, end: int) -> np.ndarray:
        """Decode frames [start, end) and return the samples of frames [emitted, stop)."""
        start = max(0, self.emitted - self.options.left_context)
        codes = codes_for_codec(np.stack(self.frames[start:end]), self.codebook_size)  # (1, N, end - start)
        wav = self.decode(codes)
        chunk = wav[(self.emitted - start) * self.hop:(stop - start) * self.hop]
        self.emitted = stop
        return chunk


class StatefulCodecStream:
    """`CodecStream`'s API on the stateful `audio_tokenizer_stream` part: every frame is decoded exactly once.

    `part` (a `runtime.session.Part`) takes the new frames plus per-layer states and returns their samples delayed
    by `delay` (the graph's `delay_samples` metadata, 9458 samples = 9.85 frames for the real codec), so the audio
    of frames [0, k) is final once k + `lag` frames (`lag` = ceil(delay / hop)) have been decoded. Chunks are the
    samples of exactly `first_frames`, then `chunk_frames` frames (like `CodecStream`'s), each returned as soon as
    it is final: the first graph call decodes first_frames + lag frames (18 with the defaults, vs first_frames +
    holdback = 20 frames awaited by `CodecStream`), every later one chunk_frames; the < hop samples decoded past a
    chunk wait in a small buffer.
    `left_context` and `holdback` do not apply (no window is decoded twice). `flush` decodes the pending frames plus
    `lag` dummy frames past the end (masked inside the graph), so the chunks concatenate to the one-shot waveform,
    hop * T samples, up to float noise.
    """

    def __init__(self, part, hop: int, codebook_size: int, options: StreamOptions | None = None):
        self.part, self.hop, self.codebook_size = part, hop, codebook_size
        self.options = options or StreamOptions()
        meta = part.session.get_modelmeta().custom_metadata_map
        if int(meta.get("hop", hop)) != hop:
            raise ValueError(f"{part.name}: graph hop {meta['hop']} != {hop}")
        self.delay = int(meta["delay_samples"])
        self.lag = -(-self.delay // hop)  # frames decoded after the last frame whose samples are final
        self.states = {i.name: np.zeros((1, *i.shape[1:]), np.float32) for i in part.session.get_inputs()
                       if i.name.startswith("state_in.")}
        self.frames: list[np.ndarray] = []  # (N,) raw codes, one per frame
        self.emitted = 0  # frames whose samples have been returned
        self.decoded = 0  # frames run through the graph (flush's dummy frames included)
        self.flushed = False
        self._drop = self.delay  # leading samples still to discard (they precede the waveform)
        self._pending = np.zeros(0, np.float32)  # decoded samples from frame `emitted` on, not returned yet

    def push(self, frames: np.ndarray) -> list[np.ndarray]:
        """Add (T, N) raw frames; returns the chunks (each (hop * frames,) float32) that became final, maybe none."""
        if self.flushed:
            raise RuntimeError("the stream was flushed: start a new StatefulCodecStream for the next utterance")
        self.frames.extend(np.asarray(frames, np.int64).reshape(-1, np.shape(frames)[-1]))
        o, out = self.options, []
        while True:
            size = o.first_frames if self.emitted == 0 else o.chunk_frames
            if len(self.frames) < self.emitted + size + self.lag:
                return out
            self._decode(self.frames[self.decoded:self.emitted + size + self.lag], end=END_UNKNOWN)
            out.append(self._take(size))

    def flush(self) -> np.ndarray:
        """The samples of every frame not returned yet (the utterance has ended); later calls return nothing."""
        total = len(self.frames)
        if self.emitted >= total:
            return np.zeros(0, np.float32)
        self._decode(self.frames[self.decoded:] + [np.zeros_like(self.frames[0])] * self.lag, end=total)
        self.flushed = True
        return self._take(total - self.emitted)

    def _decode(self, frames: list[np.ndarray], end: int) -> None:
        """Run `frames` through the graph (states in, states out) and keep their samples past the delay."""
        codes = codes_for_codec(np.stack(frames), self.codebook_size)
        out = self.part(audio_codes=codes, start=np.array([self.decoded]), end=np.array([end]), **self.states)
        self.states = {k: out[k.replace("state_in.", "state_out.")] for k in self.states}
        self.decoded += len(frames)
        wav = out["waveform"][0, 0].astype(np.float32, copy=False)
        drop, self._drop = min(self._drop, wav.size), self._drop - min(self._drop, wav.size)
        self._pending = np.concatenate([self._pending, wav[drop:]])

    def _take(self, frames: int) -> np.ndarray:
        """Return the samples of the next `frames` frames (decoded already)."""
        chunk, self._pending = np.split(self._pending, [frames * self.hop])
        self.emitted += frames
        return chunk
