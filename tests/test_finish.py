"""One finishing chain (`job.finish`): every door's loudness is one call, `finish.level`, so the same take leaves
the command line, a corpus row and the server's driver with the same samples; the word-timing failure rule is tested
with the aligner (tests/test_align.py)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import numpy as np
import pytest

from higgs_onnx.job import finish

ROOT = Path(__file__).resolve().parent.parent
TEXT = "A take for the loudness of every door, said once."
LUFS = -20.0


def test_loudness_normalise_is_called_from_job_finish_only():
    """The one code path: no module but job/finish.py imports or calls `loudness.normalise`."""
    callers = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "higgs_onnx").rglob("*.py"))
               if re.search(r"^\s*from \S*loudness import [^\n]*\bnormalise\b|loudness\.normalise\(", p.read_text(),
                            re.M)]
    assert callers == ["higgs_onnx/job/finish.py"], callers


@pytest.mark.slow
def test_every_door_levels_the_same_take_to_the_same_samples(builds, tmp_path):
    """The same job's take: the command line's file (--loudness, the sync driver) and a corpus row's file are
    byte-identical to `finish.level` on the take; the server's async driver gives the chunks of that take (split
    anywhere, piece cues among them) the same samples; and a job run by the server's driver over its scheduler
    (deterministic) is `finish.level` on its own streamed take, to the bit, with the same record."""
    import inference
    from higgs_onnx import corpus
    from higgs_onnx.audio import write_audio
    from higgs_onnx.generation.stream import AudioChunk
    from higgs_onnx.job.run import Runner, SpeechJob
    from higgs_onnx.longform.captions import Cue
    from higgs_onnx.runtime.model import HiggsTTS
    from higgs_onnx.serve.scheduler import JobScheduler

    model = builds["fp32"]
    tts = HiggsTTS(model, verify=False)
    sr = tts.facts.sample_rate
    take = tts.generate(TEXT, seed=3, max_rows=120)
    want, record = finish.level(take.waveform, sr, LUFS)
    assert record.measured is not None and abs(record.gain_db) > 0.5  # a real gain, not a no-op
    write_audio(tmp_path / "want.wav", want, sr)
    expected = (tmp_path / "want.wav").read_bytes()

    assert inference.main(["--model-path", str(model), "--no-verify", "--text", TEXT, "--seed", "3", "--max-rows",
                           "120", "--retries", "0", "--loudness", str(LUFS), "--out", str(tmp_path / "cli.wav")]) == 0
    assert (tmp_path / "cli.wav").read_bytes() == expected

    (tmp_path / "rows").mkdir()
    worker = corpus.Worker(str(model), str(tmp_path / "rows"), 1, 1, None, "wav", retries=0, loudness=LUFS)
    try:
        entry = worker.finish({"id": "row"}, take, time.perf_counter())
    finally:
        worker.sched.stop()
    assert (tmp_path / "rows" / "row.wav").read_bytes() == expected and entry["loudness"] == record.as_dict()

    cuts = [0, 1234, 5000, take.waveform.size // 2, take.waveform.size]
    spans = list(zip(cuts[:-1], cuts[1:], strict=True))
    items = [Cue(0, None, TEXT), *[AudioChunk(take.waveform[a:b], sr, i, i == len(spans) - 1, 0.0, 0.0, 0)
                                   for i, (a, b) in enumerate(spans)], Cue(0, cuts[-1], TEXT)]
    done, level = finish.leveled(items, sr, LUFS)
    assert done[0] is items[0] and done[-1] is items[-1] and level == record
    np.testing.assert_array_equal(np.concatenate([c.samples for c in done[1:-1]]), want)

    streamed = np.concatenate([c.samples for c in tts.stream(TEXT, seed=3, max_rows=120)])
    want_streamed, streamed_record = finish.level(streamed, sr, LUFS)
    sched = JobScheduler(tts, max_batch=2, max_queue=2)
    sched.start()
    try:
        async def served():
            async def collect(job):
                return [c async for c in job]

            runner = Runner(tts, lambda t, v, o, e, r=None: sched.submit(t, voice=v, options=o, exclusive=e, retry=r),
                            collect, lambda job, chunks: anext(chunks), sr)
            job = SpeechJob.build({"seed": 3, "max_rows": 120, "loudness": LUFS, "deterministic": True}, "http",
                                  tts.tokens.control_tags)
            made = await runner.run(job.options, job.prepare(TEXT), None)
            return made.level, [made.first, *[c async for c in made.rest]]

        level, chunks = asyncio.run(served())
    finally:
        sched.stop()
    np.testing.assert_array_equal(np.concatenate([c.samples for c in chunks]), want_streamed)
    assert level == streamed_record
