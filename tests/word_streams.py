"""Audio as the server's streams carry it, for the word-timing tests (a support module, not a test module:
`from word_streams import ...`): `chunks` cuts samples into `AudioChunk`s, `served_words` runs a stream of chunks
and piece cues through `job.finish.with_words` (what a stream with `"caption_level": "word"` carries) as a list."""

from __future__ import annotations

import asyncio

import numpy as np


def chunks(x: np.ndarray, sr: int, size: int = 4800) -> list:
    """`x` (mono samples at `sr`) as the AudioChunks of one request, `size` samples each, the last one marked."""
    from higgs_onnx.generation.stream import AudioChunk

    n = -(-len(x) // size)
    return [AudioChunk(x[i * size:(i + 1) * size], sr, i, i == n - 1, i * size / sr, 0.0, 0) for i in range(n)]


def served_words(first, rest: list, text: str, sr: int) -> list:
    """What the server's stream carries with `"caption_level": "word"` (job.finish.with_words), as a list."""
    from higgs_onnx.job.finish import with_words

    async def run():
        async def items():
            for item in rest:
                yield item
        head, tail = await with_words(first, items(), text, sr)
        return [head, *[item async for item in tail]]

    return asyncio.run(run())
