"""Incremental codec decoding: chunks pushed in any sizes concatenate to the one-shot waveform."""

from __future__ import annotations

import numpy as np
import pytest

from higgs_onnx.generation.codec_stream import CodecStream, StreamOptions


@pytest.mark.slow  # needs the tiny export
@pytest.mark.parametrize("pieces", [[1] * 70, [3, 17, 1, 30, 19], [70]])
def test_chunks_equal_the_one_shot_waveform(tts4, pieces):
    f = tts4.facts
    raw = np.random.default_rng(1).integers(0, f.codebook_size, (sum(pieces), f.num_codebooks))
    raw[-1, 3] = f.eoc  # a leftover special code: mapped to 0 like the one-shot path does
    want = tts4.decode_rows(raw, delayed=False)
    stream, chunks, at = CodecStream(tts4.decode_audio, f.hop, f.codebook_size), [], 0
    for n in pieces:
        chunks += stream.push(raw[at:at + n])
        at += n
    chunks.append(stream.flush())
    got = np.concatenate(chunks)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-6 * max(1.0, np.abs(want).max())
    sizes = [len(c) // f.hop for c in chunks[:-1]]
    o = StreamOptions()
    assert sizes[0] == o.first_frames and all(s == o.chunk_frames for s in sizes[1:])  # a small first chunk
    assert stream.flush().size == 0


@pytest.mark.slow
def test_first_chunk_waits_only_for_its_right_context(tts4):
    f, o = tts4.facts, StreamOptions(first_frames=4, chunk_frames=10, left_context=24, holdback=12)
    stream = CodecStream(tts4.decode_audio, f.hop, f.codebook_size, o)
    row = np.zeros((1, f.num_codebooks), np.int64)
    counts = [len(stream.push(row)) for _ in range(o.first_frames + o.holdback)]
    assert counts == [0] * (o.first_frames + o.holdback - 1) + [1]


@pytest.mark.parametrize("field, value", [("first_frames", 0), ("chunk_frames", -1), ("holdback", -1)])
def test_bad_options_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        StreamOptions(**{field: value})
