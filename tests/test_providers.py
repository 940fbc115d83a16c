"""The provider registry drives every EP-specific choice; device-resident KV buffers; fallback is an error."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from higgs_onnx import providers
from higgs_onnx.export import ExportOptions
from higgs_onnx.runtime.session import ProviderError, check_assignment, create_session

ROOT = Path(__file__).resolve().parent.parent
# an EP name, or a comparison with a device name, anywhere but the registry is a table that escaped it
EP_LITERAL = re.compile(r"""["'](CPU|CUDA|Dml|OpenVINO)ExecutionProvider["']""")
DEVICE_COMPARE = re.compile(r"""(==|!=|\bin)\s*\(?["'](cpu|cuda|dml|openvino)["']""")


def _sources() -> list[Path]:
    files = [*ROOT.glob("*.py"), *(ROOT / "higgs_onnx").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"),
             *(ROOT / "scripts").rglob("*.py")]
    return [f for f in files if f.name != "providers.py"]


def test_no_ep_name_or_device_comparison_outside_the_registry():
    found = []
    for f in _sources():
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if EP_LITERAL.search(line) or DEVICE_COMPARE.search(line):
                found.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "EP-specific choices outside higgs_onnx/providers.py:\n" + "\n".join(found)


def test_the_registry_is_consistent():
    from onnxruntime_genai.models.builder import create_model  # noqa: F401 - ModelBuilder is importable

    assert providers.BUILD_PROVIDER.status == providers.VERIFIED
    for p in providers.PROVIDERS.values():
        assert p.runtime in ("onnxruntime", "openvino")
        assert (p.ort_name is None) == (p.runtime == "openvino") == (p.ov_device is not None)
        assert set(p.attentions) <= set(providers.ATTENTIONS) and p.attentions
        assert all(set(ps) <= {"int4", "fp16", "fp32"} and ps for ps in p.precisions.values())
        assert p.name in p.runs  # every provider runs its own exports
    ort_names = [p.ort_name for p in providers.PROVIDERS.values() if p.ort_name]
    assert len(set(ort_names)) == len(ort_names)
    assert providers.runners("cpu") == ("cpu", "openvino")
    assert {row[3] for row in providers.matrix()} == {providers.VERIFIED, providers.BUILT_ONLY}


@pytest.mark.parametrize("device, precision, attention, message", [
    ("dml", "fp32", None, "valid precisions on dml"),
    ("cpu", "fp16", None, "cannot work with the gqa decoder"),
    ("dml", "fp16", "portable", "cannot work with the portable decoder"),
    ("openvino", "int4", "gqa", "does not build for --device openvino"),
    ("cpu", "int4", "flash", "unknown attention"),
    ("tpu", "int4", None, "unknown device/provider 'tpu'"),
])
def test_export_options_are_checked_against_the_registry(device, precision, attention, message):
    with pytest.raises(ValueError, match=message):
        ExportOptions(device=device, precision=precision, attention=attention)


def test_export_names_and_accuracy_come_from_the_registry():
    assert ExportOptions("cpu", "int4").name == "cpu_int4" and ExportOptions("cpu", "int4").accuracy == 4
    assert ExportOptions("cpu", "int4", attention="portable").name == "cpu_int4_portable"
    assert ExportOptions("openvino", "fp16").name == "openvino_fp16"
    assert ExportOptions("openvino", "fp16").decoder_attention == "portable"
    assert ExportOptions("cuda", "fp16").accuracy == 0


@pytest.mark.slow
def test_a_missing_provider_is_an_error_naming_part_and_package(builds):
    with pytest.raises(ProviderError, match=r"audio_heads: execution provider CUDAExecutionProvider is not "
                                            r"available.*install onnxruntime-gpu"):
        create_session(builds["fp32"] / "audio_heads.onnx", "cuda", name="audio_heads")


@pytest.mark.slow
def test_a_node_left_on_the_cpu_is_a_fallback_error(builds):
    """The assignment of a real session, checked as if another EP had been asked for: every MatMul the session put
    on the CPU EP is a fallback, named with its part; shape arithmetic alone is not."""
    sess = create_session(builds["fp32"] / "audio_heads.onnx", "cpu")
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    sess = ort.InferenceSession(str(builds["fp32"] / "audio_heads.onnx"), so, providers=sess.get_providers())
    info = sess.get_provider_graph_assignment_info()
    with pytest.raises(ProviderError, match=r"audio_heads: CUDAExecutionProvider does not run MatMul"):
        check_assignment("audio_heads", info, "CUDAExecutionProvider")
    check_assignment("audio_heads", info, "CPUExecutionProvider")  # the CPU EP itself never falls back

    class Shape:  # a subgraph of shape arithmetic only, as a GPU EP leaves on the host
        ep_name = "CPUExecutionProvider"

        def get_nodes(self):
            return [n for sg in info for n in sg.get_nodes() if n.op_type in providers.SHAPE_OPS]

    check_assignment("audio_heads", [Shape()], "CUDAExecutionProvider")


def _trace(decoder, facts, embeds: np.ndarray, state=None, prefill: int = 5) -> tuple[np.ndarray, dict]:
    cache = decoder.new_cache(64, state)
    out = [decoder.run(cache, embeds[:prefill])]
    out += [decoder.run(cache, embeds[i:i + 1]) for i in range(prefill, len(embeds))]
    return np.concatenate(out), decoder.snapshot(cache)


@pytest.mark.slow
def test_device_resident_buffers_give_the_host_numbers(tts):
    """The cuda/dml code path (ORT-allocated OrtValues, prefixes written through the Identity copy, slot views bound
    by address) run on CPU memory: bit-identical to the NumPy-backed buffers, with and without a saved prefix."""
    from higgs_onnx.runtime.decoder import BoundDecoder

    part, f = tts.part("llm_decoder"), tts.facts
    host, device = BoundDecoder(part, f), BoundDecoder(part, f, device_resident=True)
    assert host.host and not device.host
    embeds = np.random.default_rng(0).standard_normal((9, f.hidden)).astype(np.float32)
    want, snap = _trace(host, f, embeds)
    got, snap_d = _trace(device, f, embeds)
    np.testing.assert_array_equal(got, want)
    assert all(np.array_equal(snap[n], snap_d[n]) for n in snap)
    more = np.random.default_rng(1).standard_normal((4, f.hidden)).astype(np.float32)
    want2, _ = _trace(host, f, more, state=snap, prefill=2)
    got2, _ = _trace(device, f, more, state=snap, prefill=2)
    np.testing.assert_array_equal(got2, want2)

    # a pool of 3 slots: one batched step of slots 0 and 2 (slot 2 holding the prefix) equals each alone
    pool_h, pool_d = host.pool(3, 64), device.pool(3, 64)
    assert pool_d.arrays is None
    rows = []
    for pool in (pool_h, pool_d):
        a, _, c = pool.acquire(32), pool.acquire(32), pool.acquire(32, snap)
        pool.run_one(a, embeds[:5])
        pool.run_one(c, more[:1])
        rows.append(pool.run_batch([a, c], more[1:3]))
    np.testing.assert_array_equal(rows[1], rows[0])


@pytest.mark.slow
def test_a_device_without_offset_binding_refuses_a_multi_slot_pool(tts):
    from higgs_onnx.runtime.decoder import BoundDecoder

    dec = BoundDecoder(tts.part("llm_decoder"), tts.facts, offset_binding=False, device_resident=True)
    with pytest.raises(ValueError, match="bound at an offset.*--max-batch 1"):
        dec.pool(2, 16)
    assert dec.pool(1, 16).slots == 1


def test_decoder_spinning_follows_higgs_ort_spin(monkeypatch):
    """The decoder's intra-op threads spin unless $HIGGS_ORT_SPIN=0 (a machine whose cores several processes share:
    the suite's two workers); the other parts never spin."""
    from higgs_onnx.runtime.session import SPIN_ENV, session_options

    key = "session.intra_op.allow_spinning"
    monkeypatch.setenv(SPIN_ENV, "1")
    assert session_options(spin=True).get_session_config_entry(key) == "1"
    assert session_options(spin=False).get_session_config_entry(key) == "0"
    monkeypatch.setenv(SPIN_ENV, "0")
    assert session_options(spin=True).get_session_config_entry(key) == "0"
    monkeypatch.delenv(SPIN_ENV)
    assert session_options(spin=True).get_session_config_entry(key) == "1"
