import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from higgs_onnx.generation.delay import apply_delay, codes_for_codec, reverse_delay

BOC, EOC = 1024, 1025


@given(arrays(np.int64, st.tuples(st.integers(0, 40), st.integers(1, 8)), elements=st.integers(0, 1023)))
def test_round_trip(raw):
    delayed = apply_delay(raw, BOC, EOC)
    assert delayed.shape == (raw.shape[0] + raw.shape[1] - 1, raw.shape[1])
    np.testing.assert_array_equal(reverse_delay(delayed), raw)


def test_layout_matches_spec():
    raw = np.arange(1, 7).reshape(2, 3)  # T=2, N=3
    expected = np.array([[1, BOC, BOC], [4, 2, BOC], [EOC, 5, 3], [EOC, EOC, 6]])
    np.testing.assert_array_equal(apply_delay(raw, BOC, EOC), expected)


def test_reverse_of_too_few_rows_is_empty():
    assert reverse_delay(np.zeros((5, 8), np.int64)).shape == (0, 8)


def test_codes_for_codec_maps_specials_to_zero():
    raw = np.array([[5, BOC], [EOC, 7]])
    out = codes_for_codec(raw, 1024)
    assert out.shape == (1, 2, 2) and out.dtype == np.int64
    np.testing.assert_array_equal(out[0], [[5, 0], [0, 7]])
