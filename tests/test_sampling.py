import numpy as np
import pytest

from higgs_onnx.generation.sampling import GREEDY, SamplingOptions, filter_logits, sample_codes


def logits(seed=0, n=8, v=1026):
    return np.random.default_rng(seed).standard_normal((n, v)).astype(np.float32) * 3


def test_greedy_is_argmax_and_ignores_rng():
    x = logits()
    a = sample_codes(x, np.random.default_rng(1), GREEDY)
    b = sample_codes(x, np.random.default_rng(2), SamplingOptions(temperature=1e-6))
    np.testing.assert_array_equal(a, x.argmax(-1))
    np.testing.assert_array_equal(b, x.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_argmax():
    x = logits(3)
    for opts in (SamplingOptions(temperature=1.0, top_k=1, top_p=1.0),
                 SamplingOptions(temperature=1.0, top_k=0, top_p=1e-9)):
        for seed in range(5):
            np.testing.assert_array_equal(sample_codes(x, np.random.default_rng(seed), opts), x.argmax(-1))


def test_top_k_keeps_exactly_k():
    x = logits(4)
    kept = np.isfinite(filter_logits(x, SamplingOptions(temperature=0.7, top_k=30, top_p=1.0))).sum(-1)
    np.testing.assert_array_equal(kept, 30)
    draws = np.stack([sample_codes(x, np.random.default_rng(s), SamplingOptions(1.0, 3, 1.0)) for s in range(200)])
    top3 = np.argsort(-x, -1)[:, :3]
    assert all(set(draws[:, c]) <= set(top3[c]) for c in range(8))
    assert all(len(set(draws[:, c])) >= 2 for c in range(8))  # really sampled


def test_top_p_keeps_the_crossing_token():
    # probabilities 0.5, 0.3, 0.2: p=0.6 keeps the first two (the second crosses 0.6), p=0.5 keeps one
    x = np.log(np.array([[0.5, 0.3, 0.2]], np.float32))
    assert np.isfinite(filter_logits(x, SamplingOptions(1.0, 0, 0.6))).sum() == 2
    assert np.isfinite(filter_logits(x, SamplingOptions(1.0, 0, 0.5))).sum() == 1
    assert np.isfinite(filter_logits(x, SamplingOptions(1.0, 0, 1.0))).sum() == 3


def test_sampling_follows_the_distribution():
    x = np.log(np.array([[0.7, 0.2, 0.1]], np.float32))
    rng = np.random.default_rng(0)
    draws = np.array([sample_codes(x, rng, SamplingOptions(1.0, 0, 1.0))[0] for _ in range(4000)])
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, [0.7, 0.2, 0.1], atol=0.03)


def test_same_seed_same_codes():
    x, opts = logits(5), SamplingOptions()
    a = [sample_codes(x, r, opts) for r in [np.random.default_rng(7)] * 3]
    b = [sample_codes(x, r, opts) for r in [np.random.default_rng(7)] * 3]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs, msg", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
])
def test_invalid_options_raise(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingOptions(**kwargs)
