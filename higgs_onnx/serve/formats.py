"""Audio encoders for the speech server: float32 chunks in, bytes of the response body out, as the audio is made.

Each `Encoder` takes `push(samples) -> bytes` per generated chunk and `finish() -> bytes` at the end. What streams:

- `pcm`: raw 16-bit little-endian mono PCM, every chunk at once.
- `wav`: a 44-byte header whose RIFF and data sizes are 0xFFFFFFFF ("until the end of the stream", which players
  and libsndfile accept), then PCM as `pcm`.
- `mp3`: libsndfile's LAME encoder (64 kbit/s CBR) writing into a `_Tap` that is drained after each chunk. LAME
  buffers about one frame (24 ms), so a chunk's bytes lag its samples slightly; the rest comes at `finish`. At
  close LAME seeks back to fill in its Xing/Info tag frame, which was already sent as a zero placeholder; that
  placeholder is dropped instead, so the stream is plain CBR frames (decoders derive the length from the size;
  without the tag the ~50 ms encoder delay is not trimmed).
- `opus`: Ogg Opus from libsndfile, drained after each chunk (Ogg pages never seek back).
- `aac`: AAC-LC in ADTS frames (64 kbit/s) from FFmpeg's native encoder, which PyAV's wheel carries. ADTS is a
  plain frame stream (no header to fill in later), drained after each chunk; the encoder holds about two frames
  (1024 samples each) until `finish` flushes them. Decoders play 1024 samples of encoder priming first, as for any AAC.
- `flac`: encoded chunk by chunk but sent whole at `finish`: libsndfile seeks back at close to write the sample
  count and MD5 into STREAMINFO, and a FLAC without the count is unreadable for libsndfile itself (it reports an
  unbounded length), so nothing is sent before the end.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..audio import pcm16

MP3_LEVEL = 0.62  # libsndfile compression level -> 64 kbit/s CBR at 24 kHz (MPEG-2 layer III: 8..160 kbit/s)


@dataclass(frozen=True)
class Format:
    media_type: str
    streams: bool  # bytes go out while the audio is made (False: all at the end)


FORMATS = {
    "mp3": Format("audio/mpeg", True),
    "opus": Format("audio/ogg", True),
    "wav": Format("audio/wav", True),
    "aac": Format("audio/aac", True),
    "flac": Format("audio/flac", False),
    "pcm": Format("audio/pcm", True),
}


class Encoder(Protocol):
    def push(self, samples: np.ndarray) -> bytes: ...
    def finish(self) -> bytes: ...


def wav_header(sample_rate: int) -> bytes:
    """A PCM16 mono WAV header for a stream of unknown length (sizes 0xFFFFFFFF)."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, 2 * sample_rate, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


class PcmEncoder:
    def __init__(self, header: bytes = b""):
        self.header = header

    def push(self, samples: np.ndarray) -> bytes:
        out, self.header = self.header + pcm16(samples), b""
        return out

    def finish(self) -> bytes:
        out, self.header = self.header, b""
        return out


class _Tap(io.RawIOBase):
    """A seekable in-memory file for libsndfile that hands out what was appended since the last `drain`.

    Writes at a position already drained (libsndfile filling in a header at close) cannot reach the client any
    more; `rewrote` records their spans so the encoder can tell what it sent is stale."""

    def __init__(self) -> None:
        self.buf, self.pos, self.sent = bytearray(), 0, 0
        self.rewrote: list[tuple[int, int]] = []

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = bytes(b)
        if self.pos < self.sent:
            self.rewrote.append((self.pos, self.pos + len(b)))
        end = self.pos + len(b)
        if end > len(self.buf):
            self.buf.extend(bytes(end - len(self.buf)))
        self.buf[self.pos:end] = b
        self.pos = end
        return len(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else len(self.buf) + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        data = self.buf[self.pos:self.pos + len(b)]
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def drain(self) -> bytes:
        out = bytes(self.buf[self.sent:])
        self.sent = len(self.buf)
        return out


def _mp3_frame_len(head: bytes) -> int | None:
    """Bytes in the MPEG audio layer III frame starting at `head` (None: not a frame header)."""
    if len(head) < 4 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return None
    version, layer, rate_i, sr_i = (head[1] >> 3) & 3, (head[1] >> 1) & 3, head[2] >> 4, (head[2] >> 2) & 3
    if layer != 1 or version == 1 or rate_i in (0, 15) or sr_i == 3:
        return None
    mpeg1 = version == 3
    rates = ((32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320) if mpeg1 else
             (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160))
    sample_rate = (44100, 48000, 32000)[sr_i] >> (0 if mpeg1 else 1 if version == 2 else 2)
    return (144 if mpeg1 else 72) * rates[rate_i - 1] * 1000 // sample_rate + ((head[2] >> 1) & 1)


class SoundFileEncoder:
    """libsndfile writing into a `_Tap`: `push` returns what the encoder has written so far (nothing when the
    format does not stream), `finish` the rest (or the whole file)."""

    def __init__(self, sample_rate: int, format: str, subtype: str, streams: bool, **kw):
        import soundfile as sf

        self.tap, self.streams = _Tap(), streams
        self.file = sf.SoundFile(self.tap, "w", samplerate=sample_rate, channels=1, format=format, subtype=subtype,
                                 **kw)
        self.mp3 = format == "MP3"
        self.head = b""  # mp3: the first frame, held until it is known whether it is LAME's tag placeholder
        self.head_done = not self.mp3
        self.dropped = 0  # mp3: bytes of the tag placeholder left out of the stream

    def push(self, samples: np.ndarray) -> bytes:
        if samples.size:
            self.file.write(np.clip(samples, -1.0, 1.0).astype(np.float32, copy=False))
        return self._out(self.tap.drain()) if self.streams else b""

    def finish(self) -> bytes:
        self.file.close()
        if not self.streams:
            return bytes(self.tap.buf)
        tail = self._out(self.tap.drain())
        stale = [span for span in self.tap.rewrote if not (self.mp3 and span[1] <= self.dropped)]
        if stale:  # a format that seeks back must not be marked as streaming
            raise RuntimeError(f"the encoder rewrote bytes already sent at {stale}")
        return tail + (self.head if not self.head_done else b"")

    def _out(self, data: bytes) -> bytes:
        if self.head_done:
            return data
        self.head += data
        size = _mp3_frame_len(self.head[:4])
        if size is None:
            if len(self.head) < 4:
                return b""
            self.head_done = True
            return self.head
        if len(self.head) < size:
            return b""
        frame, rest = self.head[:size], self.head[size:]
        self.head, self.head_done = b"", True
        if not any(frame[4:]):  # LAME's Xing/Info placeholder: all zero after the header, rewritten at close
            self.dropped = size
            return rest
        return frame + rest


class _Sink(io.RawIOBase):
    """A write-only in-memory file for PyAV's muxer: what it wrote since the last `drain`."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.buf += b
        return len(b)

    def drain(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


class AacEncoder:
    """AAC-LC in ADTS through PyAV (FFmpeg's encoder), drained after each chunk."""

    BIT_RATE = 64000

    def __init__(self, sample_rate: int):
        import av

        self.sink, self.rate, self.pts = _Sink(), sample_rate, 0
        self.out = av.open(self.sink, mode="w", format="adts")
        self.stream = self.out.add_stream("aac", rate=sample_rate)
        self.stream.layout, self.stream.bit_rate = "mono", self.BIT_RATE

    def _mux(self, frame) -> bytes:
        for packet in self.stream.encode(frame):
            self.out.mux(packet)
        return self.sink.drain()

    def push(self, samples: np.ndarray) -> bytes:
        import av

        if not samples.size:
            return b""
        x = np.ascontiguousarray(np.clip(samples, -1.0, 1.0), np.float32)[None, :]
        frame = av.AudioFrame.from_ndarray(x, format="flt", layout="mono")
        frame.sample_rate, frame.pts = self.rate, self.pts
        self.pts += x.shape[1]
        return self._mux(frame)

    def finish(self) -> bytes:
        out = self._mux(None)
        self.out.close()
        return out + self.sink.drain()


def encoder(fmt: str, sample_rate: int) -> Encoder:
    """A fresh encoder for one response in `fmt` (a key of FORMATS)."""
    if fmt == "pcm":
        return PcmEncoder()
    if fmt == "wav":
        return PcmEncoder(wav_header(sample_rate))
    if fmt == "mp3":
        return SoundFileEncoder(sample_rate, "MP3", "MPEG_LAYER_III", True, bitrate_mode="CONSTANT",
                                compression_level=MP3_LEVEL)
    if fmt == "opus":
        return SoundFileEncoder(sample_rate, "OGG", "OPUS", True)
    if fmt == "flac":
        return SoundFileEncoder(sample_rate, "FLAC", "PCM_16", False)
    if fmt == "aac":
        return AacEncoder(sample_rate)
    raise ValueError(f"unsupported response_format {fmt!r}; use one of {', '.join(FORMATS)}")
