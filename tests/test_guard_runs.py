"""The guard in the runtime: the engine stops a loop online, the scheduler draws a degenerate take again with a new
seed and a cooler temperature (never a greedy one, never one cut by the caller's row limit), and the command
`python -m higgs_onnx.judge` judges a saved take with exit codes 0 / 1 / 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from higgs_onnx.generation.engine import Request, StopRules
from higgs_onnx.generation.options import GenerationOptions
from higgs_onnx.guard import GuardOptions, RetryPolicy, RowWatch
from higgs_onnx.job.run import best_of

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "tests" / "data" / "ref_en_24k.wav"
TEXT = "Hello there, a line for the guard."


def test_the_engine_stops_a_loop_as_it_happens():
    """Logits that always pick the same codes: past the delay ramp every row is the same, and the request stops
    `loop_rows` rows later with stop reason "loop", far before its row limit."""
    n, v = 8, 1026
    rules = StopRules(num_codebooks=n, boc=1024, eoc=1025)
    watch = RowWatch(GuardOptions(), 10_000, n, 25.0)
    req = Request([1, 2, 3], rules, GenerationOptions(temperature=0, max_rows=2000), placeholder=0, watch=watch)
    logits = np.zeros((n, v), np.float32)
    logits[:, 7] = 10.0
    while not req.done:
        req.accept(logits)
    # row N-1 is the first without BOC fill; the 32 rows after it repeat it
    assert req.stop_reason == "loop" and req.n == n + 32
    off = Request([1, 2, 3], rules, GenerationOptions(temperature=0, max_rows=200, guard=False), placeholder=0)
    while not off.done:
        off.accept(logits)
    assert off.stop_reason == "max_rows" and off.n == 200  # the guard off: the old behaviour


@pytest.mark.slow
def test_a_degenerate_take_is_drawn_again_cooler_with_a_new_seed(builds):
    from higgs_onnx.runtime.model import HiggsTTS

    strict = GuardOptions(overlong_factor=1.01, slack_s=0.0)  # every synthetic take runs ~2 x past this
    tts = HiggsTTS(builds["int4"], guard=strict)
    s = tts.generate(TEXT, seed=4, temperature=0.8, retries=2)
    assert [t["verdict"] for t in s.takes] == ["overlong"] * 3 and s.stop_reason == "overlong"
    assert [t["seed"] for t in s.takes] == [4, 4 + RetryPolicy.seed_step, 4 + 2 * RetryPolicy.seed_step]
    assert [t["temperature"] for t in s.takes] == pytest.approx([0.8, 0.65, 0.5])
    limit = s.verdict.figures["overlong_above"]
    assert all(t["rows"] == limit + 1 for t in s.takes)  # each stopped online, one row past the bound
    assert len(tts.generate(TEXT, seed=4, retries=0).takes) == 1
    assert len(tts.generate(TEXT, temperature=0, retries=2).takes) == 1  # greedy: the same draw, not retried
    clone = tts.generate(TEXT, ref_audio=REF, seed=1, retries=1)  # the voice's prefix serves every take
    assert len(clone.takes) == 2 and len(tts.voices) == 1
    # a take cut by the caller's row limit is not the model's fault: drawn again, it would be cut the same way
    cut = HiggsTTS(builds["int4"]).generate(TEXT, seed=1, max_rows=20, retries=2)
    assert [t["verdict"] for t in cut.takes] == ["max_rows"]


@pytest.mark.slow
def test_a_clean_take_is_judged_good_and_kept(builds):
    from higgs_onnx.runtime.model import HiggsTTS

    s = HiggsTTS(builds["int4"]).generate(TEXT, seed=2, retries=2)
    assert s.verdict.good and s.stop_reason == "eoc" and len(s.takes) == 1 and s.takes[0]["verdict"] == "good"


def _guard(*args):
    return subprocess.run([sys.executable, "-m", "higgs_onnx.judge", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_the_guard_command_judges_a_saved_take(builds, tmp_path):
    codes = tmp_path / "take.npy"
    r = subprocess.run([sys.executable, "inference.py", "--model-path", builds["int4"], "--text", TEXT, "--out",
                        tmp_path / "take.wav", "--save-codes", codes, "--seed", "2"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    r = _guard(codes, "--text", TEXT, "--model-path", builds["int4"], "--audio")
    assert r.returncode == 0 and r.stdout.startswith("good: a clean stop") and "longest_silence_s" in r.stdout
    rows = np.load(codes)
    loop = np.concatenate([rows[:20], np.tile(rows[20:21], (60, 1))])
    np.save(tmp_path / "loop.npy", loop)
    r = _guard(tmp_path / "loop.npy", "--text", TEXT, "--model-path", builds["int4"], "--json")
    assert r.returncode == 1 and '"name": "loop"' in r.stdout
    for args, message in ((["missing.npy", "--text", TEXT], "does not exist"),
                          (["/dev/zero", "--text", TEXT], "is not a regular file (a device or a pipe)"),
                          ([codes, "--text", "  "], "--text is empty"),
                          ([tmp_path / "take.wav", "--text", TEXT], "not a NumPy .npy array")):
        r = _guard(*args, "--model-path", builds["int4"])
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    np.save(tmp_path / "flat.npy", rows[:, :3])
    r = _guard(tmp_path / "flat.npy", "--text", TEXT, "--model-path", builds["int4"])
    assert r.returncode == 2 and "expected integer code rows of shape" in r.stderr
    r = _guard(codes, "--model-path", builds["int4"])
    assert r.returncode == 2 and "--text" in r.stderr


@pytest.mark.slow
def test_best_of_takes_in_one_batch(builds, tmp_path):
    """Four takes as rows of one batch from one shared prefill: each take is the draw its seed gives alone, every
    take is judged and scored, exactly one is kept, and --save-takes writes them all."""
    import json

    from higgs_onnx.guard import TAKE_SEED_STEP
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(builds["fp32"])
    be, calls = tts.backend, []
    real = be.prefill

    def counted(cache, embeds):
        calls.append(len(embeds))
        return real(cache, embeds)

    be.prefill = counted
    s = best_of(tts, TEXT, 4, seed=3, save_takes=tmp_path / "takes")
    del be.prefill
    prompt = s.stats.prompt_tokens
    assert calls == [prompt]  # the prompt once: every take starts from its state and last hidden state
    assert [t["take"] for t in s.takes] == [1, 2, 3, 4] and sum(t["kept"] for t in s.takes) == 1
    assert [t["seed"] for t in s.takes] == [3 + i * TAKE_SEED_STEP for i in range(4)]
    kept = next(t for t in s.takes if t["kept"])
    assert kept["score"] == max(t["score"] for t in s.takes) and len(s.rows) == kept["rows"]
    alone = tts.generate(TEXT, seed=3 + 2 * TAKE_SEED_STEP)
    assert len(alone.rows) == s.takes[2]["rows"]  # the draw its seed gives alone
    files = sorted(p.name for p in (tmp_path / "takes").iterdir())
    assert files == ["take-1.wav", "take-2.wav", "take-3.wav", "take-4.wav", "takes.json"]
    assert json.loads((tmp_path / "takes" / "takes.json").read_text()) == s.takes
    clone = best_of(tts, TEXT, 2, ref_audio=REF, seed=1)  # the voice's prefix under every take
    assert len(clone.takes) == 2 and len(tts.voices) == 1
    for bad, match in (({"takes": 0}, "takes must be from 1 to 16"),
                       ({"takes": 17}, "from 1 to 16"), ({"takes": 2, "temperature": 0}, "needs sampling"),
                       ({"takes": 2, "save_takes": builds["fp32"] / "manifest.json"}, "is a file, not a folder")):
        kw = dict(bad)
        with pytest.raises(ValueError, match=match):
            best_of(tts, TEXT, kw.pop("takes"), **kw)


@pytest.mark.slow
def test_the_command_line_keeps_the_best_take(builds, tmp_path):
    r = subprocess.run([sys.executable, "inference.py", "--model-path", builds["int4"], "--text", TEXT, "--takes", "3",
                        "--out", tmp_path / "best.wav", "--save-takes", tmp_path / "all"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if ": take " in x]
    assert len(lines) == 3 and sum(x.endswith(", kept") for x in lines) == 1
    assert (tmp_path / "best.wav").is_file() and len(list((tmp_path / "all").glob("take-*.wav"))) == 3


@pytest.mark.slow
def test_a_stream_the_guard_stops_ends_at_once_and_says_why(builds):
    """Audio is out before a take can be judged, so a stream is not retried: when the online guard fires, the
    stream ends there, and its last chunk's stats name the verdict (the server's done event carries it too)."""
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(builds["int4"], guard=GuardOptions(overlong_factor=1.01, slack_s=0.0))
    chunks = list(tts.stream(TEXT, seed=4))
    last = chunks[-1]
    assert last.is_last and last.stats.stop_reason == "overlong"
    whole = tts.generate(TEXT, seed=4)  # the same rows, stopped at the same row
    assert whole.stop_reason == "overlong"
    np.testing.assert_array_equal(last.rows, whole.rows)
    assert abs(sum(c.samples.size for c in chunks) - whole.waveform.size) <= tts.facts.hop
