"""The generation state machine driven by a scripted fake backend (no model)."""

import dataclasses

import numpy as np
import pytest

from higgs_onnx.generation.delay import apply_delay
from higgs_onnx.generation.engine import StopRules, generate, prompt_embeddings
from higgs_onnx.generation.options import GREEDY_OPTIONS

N, V, D = 8, 1026, 4
BOC, EOC = 1024, 1025
RULES = StopRules(num_codebooks=N, boc=BOC, eoc=EOC)
PLACEHOLDER = -100


class Scripted:
    """Emits, at step s, the logits whose argmax is `script(s)`; records what the loop feeds it."""

    def __init__(self, script):
        self.script, self.step, self.fed, self.prefilled = script, 0, [], None

    def embed_text(self, ids):
        return np.repeat(ids[:, None].astype(np.float32), D, axis=1)

    def embed_audio(self, rows):
        return np.repeat(rows[:, :1].astype(np.float32), D, axis=1) + 0.5

    def new_cache(self, max_len, state=None):
        return {"max_len": max_len}

    def prefill(self, cache, embeds):
        self.prefilled = embeds
        return np.zeros(D, np.float32)

    def decode(self, cache, embed):
        self.fed.append(embed)
        self.step += 1
        return np.zeros(D, np.float32)

    def audio_logits(self, hidden):
        x = np.zeros((len(hidden), N, V), np.float32)
        x[:, np.arange(N), self.script(self.step)] = 1.0
        return x


def run(script, max_rows=100):
    backend = Scripted(script)
    options = dataclasses.replace(GREEDY_OPTIONS, max_rows=max_rows)
    return generate(backend, [1, 2, 3], RULES, options, PLACEHOLDER), backend


def normal(step):
    return np.full(N, step % 1000)


def eoc_at(k):
    return lambda s: np.where(np.arange(N) == 0, EOC, 7) if s >= k else normal(s)


def test_ramp_in_forces_boc():
    res, _ = run(normal, max_rows=12)
    for s in range(N):
        assert (res.rows[s, s + 1:] == BOC).all() and (res.rows[s, :s + 1] != BOC).all()
    assert (res.rows[N:] != BOC).all()


def test_eoc_at_the_earliest_row():
    # EOC is only looked at after the ramp-in (step >= N); the EOC row and N-2 more rows are kept
    res, _ = run(eoc_at(0))
    assert res.stop_reason == "eoc"
    assert len(res.rows) == N + 1 + (N - 2)
    assert res.codes.shape == (N + (N - 2) + 1 - (N - 1), N)  # T frames = rows - (N - 1)
    assert res.rows[N, 0] == EOC


def test_eoc_later_gives_that_many_frames():
    res, _ = run(eoc_at(40))
    assert res.stop_reason == "eoc" and len(res.rows) == 40 + N - 1 and len(res.codes) == 40


def test_eoc_on_other_codebooks_is_not_a_stop():
    res, _ = run(lambda s: np.where(np.arange(N) == 3, EOC, 5), max_rows=50)
    assert res.stop_reason == "max_rows" and len(res.rows) == 50


def test_no_eoc_stops_at_max_rows():
    res, backend = run(normal, max_rows=30)
    assert res.stop_reason == "max_rows" and len(res.rows) == 30
    assert len(backend.fed) == 29  # no decode after the last row


def test_fed_rows_are_the_sampled_rows():
    res, backend = run(normal, max_rows=20)
    fed = np.array([f[0, 0] for f in backend.fed]) - 0.5
    np.testing.assert_array_equal(fed, res.rows[:-1, 0])


def test_reference_rows_fill_placeholders():
    ref = apply_delay(np.full((3, N), 9), BOC, EOC)
    prompt = [1, 2, *[PLACEHOLDER] * len(ref), 4]
    emb = prompt_embeddings(Scripted(normal), prompt, PLACEHOLDER, ref)
    assert emb.shape == (len(prompt), D)
    np.testing.assert_array_equal(emb[2:2 + len(ref), 0], ref[:, 0] + 0.5)
    np.testing.assert_array_equal(emb[[0, 1, -1], 0], [1, 2, 4])
    with pytest.raises(ValueError, match="placeholders"):
        prompt_embeddings(Scripted(normal), prompt, PLACEHOLDER, ref[:-1])


def test_teacher_forcing_feeds_given_rows():
    teacher = np.full((12, N), 33)
    backend = Scripted(normal)
    res = generate(backend, [1], RULES, dataclasses.replace(GREEDY_OPTIONS, max_rows=100), PLACEHOLDER,
                   teacher_rows=teacher, keep_logits=True)
    assert res.stop_reason == "teacher" and len(res.rows) == 12 and len(res.logits) == 12
    assert all(f[0, 0] == 33.5 for f in backend.fed)


def test_ignore_eoc_runs_to_max_rows():
    backend = Scripted(eoc_at(10))
    options = dataclasses.replace(GREEDY_OPTIONS, max_rows=40, ignore_eoc=True)
    res = generate(backend, [1], RULES, options, PLACEHOLDER)
    assert res.stop_reason == "max_rows" and len(res.rows) == 40 and res.rows[20, 0] == EOC


def test_options_are_validated_once():
    from higgs_onnx.generation.options import GenerationOptions

    for bad, match in (({"max_rows": 0}, "max_rows"), ({"seed": -1}, "seed"), ({"top_k": 1.5}, "top_k"),
                       ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p")):
        with pytest.raises(ValueError, match=match):
            GenerationOptions(**bad)
    base = GenerationOptions(seed=3)
    assert GenerationOptions.make(base, temperature=None, max_rows=9) == dataclasses.replace(base, max_rows=9)
    with pytest.raises(TypeError, match="unknown generation option"):
        GenerationOptions.make(base, temprature=1.0)
