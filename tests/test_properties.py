"""Property-based: random text, sampling options and mutated manifests give audio or a clear error, never a
crash, hang or NaN waveform."""

import json
import math
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from higgs_onnx.manifest import load_manifest
from higgs_onnx.runtime.model import HiggsTTS

pytestmark = pytest.mark.slow
CLEAR = (ValueError, FileNotFoundError)  # ManifestError, AudioError, CheckpointError are ValueErrors
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tts(builds):
    return HiggsTTS(builds["int4"])


def check_speech(speech):
    assert np.isfinite(speech.waveform).all()
    assert speech.waveform.size == 960 * max(len(speech.rows) - 7, 0)


@FAST
@given(text=st.text(max_size=60))
def test_random_unicode_text(tts, text):
    try:
        check_speech(tts.generate(text, max_rows=24, temperature=0))
    except CLEAR:
        pass


@FAST
@given(temperature=st.floats(allow_nan=True, allow_infinity=True, width=32),
       top_k=st.integers(-5, 3000), top_p=st.floats(-0.5, 1.5) | st.just(float("nan")),
       seed=st.integers(0, 2**32 - 1))
def test_random_sampling_options(tts, temperature, top_k, top_p, seed):
    valid = math.isfinite(temperature) and temperature >= 0 and top_k >= 0 and 0 < top_p <= 1
    try:
        speech = tts.generate("Random options.", temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              max_rows=24)
    except ValueError:
        assert not valid
        return
    assert valid
    check_speech(speech)


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**12) | st.text(max_size=12),
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                       max_leaves=6)


def mutations(manifest: dict):
    paths = []

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                paths.append(path + (k,))
                walk(v, path + (k,))

    walk(manifest, ())
    return st.tuples(st.sampled_from(paths), st.sampled_from(["delete", "replace"]), JSONISH)


@pytest.fixture(scope="module")
def manifest_copy(builds, tmp_path_factory):
    return shutil.copytree(builds["int4"], tmp_path_factory.mktemp("mut") / "m")


@FAST
@given(data=st.data())
def test_mutated_manifests(manifest_copy, builds, data):
    original = json.loads((builds["int4"] / "manifest.json").read_text())
    path, op, value = data.draw(mutations(original))
    mutated = json.loads(json.dumps(original))
    node = mutated
    for key in path[:-1]:
        node = node[key]
    if op == "delete":
        del node[path[-1]]
    else:
        node[path[-1]] = value
    (manifest_copy / "manifest.json").write_text(json.dumps(mutated))
    try:
        tts = HiggsTTS(manifest_copy, verify=False)
        check_speech(tts.generate("Still fine?", max_rows=16, temperature=0))
    except CLEAR:
        pass
    finally:
        (manifest_copy / "manifest.json").write_text(json.dumps(original))
    load_manifest(manifest_copy)  # the restore worked
