"""Streaming through the engine: same codes as one-shot, audio within tolerance, early first chunk, per-request
state (interleaved and threaded requests), early close frees the cache, the CLI's --stream outputs, no torch."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from higgs_onnx.generation.codec_stream import StreamOptions
from higgs_onnx.generation.options import GenerationOptions
from higgs_onnx.parity import snr_db
from higgs_onnx.runtime.decoder import BoundCache

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
REF = DATA / "ref_en_24k.wav"
REF_TEXT = (DATA / "ref_en_24k.txt").read_text().strip()
TEXT = "Streaming speech arrives while the model is still talking, one chunk after another."
# concatenated chunks vs the one-shot waveform, relative to its peak. The stateful codec sums the same terms in
# another order: on the tiny random codec fp32 itself is only good to 4e-5..1.2e-4 of the peak (vs fp64), and the
# stream stays within 2e-5..7.4e-5 of the one-shot graph (measured); the real-geometry codec gives 8e-5 / 84 dB SNR.
AUDIO_TOLERANCE = 2e-4
MIN_SNR_DB = 60.0


def cli(*args, **kw):
    return subprocess.run([sys.executable, str(ROOT / "inference.py"), *map(str, args)], capture_output=True,
                          cwd=ROOT, env={**os.environ, "CI": "1"}, timeout=600, **kw)


def collect(chunks):
    chunks = list(chunks)
    return chunks, np.concatenate([c.samples for c in chunks])


@pytest.mark.parametrize("clone", [False, True], ids=["zero-shot", "clone"])
@pytest.mark.parametrize("options", [GenerationOptions(temperature=0), GenerationOptions(seed=7)],
                         ids=["greedy", "sampled"])
def test_stream_equals_one_shot(tts4, options, clone):
    kw = {"ref_audio": REF, "ref_text": REF_TEXT} if clone else {}
    want = tts4.generate(TEXT, options=options, **kw)
    chunks, audio = collect(tts4.stream(TEXT, options=options, **kw))
    last = chunks[-1]
    np.testing.assert_array_equal(last.rows, want.rows)
    np.testing.assert_array_equal(last.codes, want.codes)
    assert audio.shape == want.waveform.shape
    assert np.abs(audio - want.waveform).max() <= AUDIO_TOLERANCE * max(np.abs(want.waveform).max(), 1e-3)
    assert snr_db(want.waveform, audio) >= MIN_SNR_DB
    assert [c.index for c in chunks] == list(range(len(chunks))) and last.is_last
    assert not any(c.is_last for c in chunks[:-1]) and all(c.stats is None for c in chunks[:-1])
    s = last.stats
    assert s.chunks == len(chunks) and s.rows == len(want.rows) and s.stop_reason == want.stop_reason
    assert s.audio_s == pytest.approx(want.seconds) and s.first_audio_s <= s.wall_s


def test_first_chunk_comes_before_generation_ends(tts4):
    """Structural, not timed: the rows generated when each chunk is handed out are counted (an `on_row` spy)."""
    o = StreamOptions(first_frames=4, chunk_frames=10)
    rows_seen: list[int] = []
    chunks, rows_at = [], []
    for chunk in tts4.stream(TEXT, temperature=0, stream_options=o, on_row=rows_seen.append):
        chunks.append(chunk)
        rows_at.append(len(rows_seen))
    assert len(chunks) >= 3
    first, last = chunks[0], chunks[-1]
    assert first.samples.size == o.first_frames * tts4.facts.hop  # a small first chunk
    # the codec works off the decoder loop, so by the time a chunk arrives the decoder may be further on: a chunk
    # reports the rows its frames were taken at, never more than were generated when it arrived
    done = [c.rows_done for c in chunks]
    assert all(d <= at for d, at in zip(done, rows_at, strict=True)) and done == sorted(done)
    # the first chunk comes as soon as its frames are final: frame t needs rows t..t+N-1, and the codec waits for
    # `lag` (stateful graph) or `holdback` (windows) frames after it, not for the end of the utterance
    codec = tts4.codec_stream(o)
    wait = codec.lag if tts4.has_stateful_codec else o.holdback
    assert done[0] == o.first_frames + wait + tts4.facts.num_codebooks - 1, (done[0], wait)
    assert rows_at[0] < last.rows_done / 2 and rows_at[-1] == last.rows_done == len(last.rows)
    assert rows_at == sorted(rows_at)
    starts = np.cumsum([0] + [c.samples.size for c in chunks[:-1]]) / tts4.facts.sample_rate
    np.testing.assert_allclose([c.start_s for c in chunks], starts)


def test_interleaved_requests_keep_their_own_state(tts):
    a_opts, b_opts = GenerationOptions(seed=1), GenerationOptions(seed=2)
    alone_a = tts.generate(TEXT, options=a_opts)
    alone_b = tts.generate("A second request with other words and another seed.", options=b_opts,
                             ref_audio=REF, ref_text=REF_TEXT)
    sa = tts.stream(TEXT, options=a_opts, stream_options=StreamOptions(first_frames=1, chunk_frames=1))
    sb = tts.stream("A second request with other words and another seed.", options=b_opts, ref_audio=REF,
                      ref_text=REF_TEXT, stream_options=StreamOptions(first_frames=1, chunk_frames=1))
    got, live = {"a": [], "b": []}, {"a": sa, "b": sb}
    while live:  # one chunk (= one frame) of each in turn: their rows interleave row by row
        for k in list(live):
            try:
                got[k].append(next(live[k]))
            except StopIteration:
                del live[k]
    np.testing.assert_array_equal(got["a"][-1].rows, alone_a.rows)
    np.testing.assert_array_equal(got["b"][-1].rows, alone_b.rows)


def test_threads_share_one_model_safely(tts):
    texts = [f"Thread number {i} says something different from the others." for i in range(4)]
    alone = [tts.generate(t, seed=i).rows for i, t in enumerate(texts)]
    out, errors = [None] * 4, []

    def work(i):
        try:
            out[i] = tts.generate(texts[i], seed=i).rows
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for a, b in zip(alone, out, strict=True):
        np.testing.assert_array_equal(a, b)


def live_caches() -> int:
    gc.collect()
    return sum(type(o) is BoundCache for o in gc.get_objects())


def test_abandoned_streams_free_their_state(tts4):
    def abandon(n, check=False):
        for _ in range(n):
            s = tts4.stream(TEXT, seed=3, stream_options=StreamOptions(first_frames=2))
            next(s)  # generation has started: a cache is held
            if check:
                assert live_caches() == 1
            s.close()

    abandon(10, check=True)  # also warms up: sessions, allocator pools
    base = live_caches()
    rss0 = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    abandon(100)
    rss1 = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert live_caches() == base == 0
    assert rss1 - rss0 < 20 * 2**20, f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over 100 abandoned streams"


def test_bad_stream_options_are_refused_before_any_work(tts4):
    with pytest.raises(ValueError, match="chunk_frames"):
        tts4.stream(TEXT, stream_options=StreamOptions(chunk_frames=0))
    with pytest.raises(ValueError, match="max_rows"):
        tts4.stream(TEXT, max_rows=0)  # raises at the call, not at the first chunk


def test_cli_stream_to_stdout_and_to_a_file(builds, tmp_path):
    m = builds["int4"]
    once = tmp_path / "once.wav"
    r = cli("--model-path", m, "--text", TEXT, "--seed", "5", "--out", once)
    assert r.returncode == 0, r.stderr
    want, sr = sf.read(once, dtype="int16")
    r = cli("--model-path", m, "--text", TEXT, "--seed", "5", "--stream", "--out", "-", "--first-frames", "3")
    assert r.returncode == 0, r.stderr
    pcm = np.frombuffer(r.stdout, "<i2")
    assert pcm.shape == want.shape and np.abs(pcm.astype(int) - want).max() <= 1  # one LSB of rounding
    assert b"first audio after" in r.stderr  # progress and summary on stderr, audio alone on stdout
    grown = tmp_path / "grown.wav"
    r = cli("--model-path", m, "--text", TEXT, "--seed", "5", "--stream", "--out", grown)
    assert r.returncode == 0, r.stderr
    got, sr2 = sf.read(grown, dtype="int16")
    assert sr2 == sr and np.abs(got.astype(int) - want).max() <= 1
    assert not grown.with_name("grown.wav.partial").exists()


def test_cli_stream_with_voice_and_text_file(builds, tmp_path):
    m = builds["int4"]
    (tmp_path / "lines.txt").write_text("First streamed line.\nSecond streamed line.\n")
    r = cli("--model-path", m, "--text-file", tmp_path / "lines.txt", "--out-dir", tmp_path / "out",
            "--ref-audio", REF, "--ref-text", REF_TEXT, "--stream", "--save-voice", tmp_path / "v.npz")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0001.wav", "0002.wav"]
    r2 = cli("--model-path", m, "--text", "First streamed line.", "--voice", tmp_path / "v.npz", "--stream",
             "--out", tmp_path / "again.wav")
    assert r2.returncode == 0, r2.stderr
    a, _ = sf.read(tmp_path / "out" / "0001.wav", dtype="int16")
    b, _ = sf.read(tmp_path / "again.wav", dtype="int16")
    assert a.shape == b.shape and np.abs(a.astype(int) - b).max() <= 1


def test_ctrl_c_during_stream(builds, tmp_path):
    """SIGINT while the file grows: exit 130, the partial file is kept under its partial name, no final file."""
    out = tmp_path / "cut.wav"
    text = " ".join(["A long paragraph that keeps the tiny model talking for a while."] * 12)
    # --max-rows: the prompt (~350 positions) plus the rows must fit the 4096 context, or the run is refused
    proc = subprocess.Popen([sys.executable, str(ROOT / "inference.py"), "--model-path", str(builds["int4"]),
                             "--text", text, "--stream", "--out", str(out), "--max-rows", "3000",
                             "--first-frames", "1", "--chunk-frames", "1"],
                            cwd=ROOT, env={**os.environ, "CI": "1"}, stderr=subprocess.PIPE)
    partial = out.with_name("cut.wav.partial")
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.stat().st_size > 1000) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    if proc.poll() is not None:  # a refusal (exit 2) is not "too short": say which
        err = proc.communicate()[1].decode(errors="replace")
        pytest.fail(f"inference.py ended (exit {proc.returncode}) before the interrupt: {err[-1000:]}")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert not out.exists() and partial.exists()
    assert b"interrupted" in err and b"Traceback" not in err


def test_stream_path_imports_no_torch(builds):
    code = ("import sys, numpy as np; from higgs_onnx.runtime.model import HiggsTTS; "
            f"t = HiggsTTS({str(builds['int4'])!r}, verify=False); "
            f"a = np.concatenate([c.samples for c in t.stream('No torch here.', ref_audio={str(REF)!r})]); "
            "assert a.size > 0; print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "CI": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
