"""Exports for other decoder graphs and runtimes, end to end on the tiny checkpoint: the portable decoder on the
CPU EP and the OpenVINO runtime (openvino_<precision>), against the default cpu exports."""

from __future__ import annotations

import numpy as np
import pytest

from higgs_onnx.export import Exporter, ExportOptions
from higgs_onnx.manifest import load_manifest

pytestmark = pytest.mark.slow
TEXT = "Hello there, from another device."


@pytest.fixture(scope="module")
def exports(builds, openvino_build, tiny_ckpt, out_root):
    made = {}
    for device, precision, attention in (("cpu", "fp32", "portable"), ("cpu", "int4", "portable"),
                                         ("cpu", "fp16", "portable"), ("openvino", "fp32", None)):
        opts = ExportOptions(device, precision, attention=attention)
        made[opts.name] = Exporter(str(tiny_ckpt), out_root, opts).run()
    return {**made, "cpu_fp32": builds["fp32"], "cpu_int4": builds["int4"], "openvino_int4": openvino_build}


def _greedy(folder, provider=None, text=TEXT):
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(folder, provider=provider, verify=False)
    return tts, tts.generate(text, temperature=0, max_rows=40)


def test_manifests_name_the_decoder_graph_and_cache_layout(exports):
    want = {"cpu_fp32": ("gqa", "shared-buffer", "onnx"), "cpu_fp32_portable": ("portable", "concat", "onnx"),
            "openvino_int4": ("portable", "concat", "openvino-ir")}
    for name, (attention, cache, fmt) in want.items():
        m = load_manifest(exports[name], verify=True)
        assert m.decoder == {"attention": attention, "cache": cache, "format": fmt, "kv_cache": {"dtype": "fp32"},
                             "route": {"kind": "none"}}
        assert m.parts["llm_decoder"]["parity"]["ok"], name
    fp16 = load_manifest(exports["cpu_fp16_portable"], verify=False)
    assert fp16.parts["llm_decoder"]["parity"]["ok"] and fp16.parts["llm_decoder"]["inputs"][0]["dtype"] == "float16"
    ops = load_manifest(exports["cpu_int4_portable"], verify=False).parts["llm_decoder"]["ops"]
    assert "GroupQueryAttention" not in ops and "MatMulNBits" in ops
    ir = load_manifest(exports["openvino_int4"], verify=False).parts["llm_decoder"]
    assert ir["file"] == "llm_decoder.xml" and ir["parity"]["ok"]


def test_portable_decoder_speaks_the_gqa_decoders_codes(exports):
    """fp32 greedy: the portable graph (concat cache, ConcatDecoder on the CPU EP) gives the GQA graph's codes."""
    from higgs_onnx.runtime.decoder import ConcatDecoder

    tts, portable = _greedy(exports["cpu_fp32_portable"])
    assert isinstance(tts.backend.decoder, ConcatDecoder)
    _, gqa = _greedy(exports["cpu_fp32"])
    np.testing.assert_array_equal(portable.rows, gqa.rows)
    tts16, half = _greedy(exports["cpu_fp16_portable"])  # fp16 embeddings and cache in, as the graph declares
    assert tts16.backend.decoder.embed_dtype == np.float16 and half.waveform.size > 0
    assert (half.rows[:10] == gqa.rows[:10]).mean() > 0.9


@pytest.mark.parametrize("name", ["cpu_fp32_portable", "openvino_fp32"])
def test_decoders_without_a_batched_cache_serve_batches_row_by_row(exports, name):
    """The server's slot pool over a concat cache (ORT) or host arrays (OpenVINO): each request of a batch gets the
    codes it gets alone, and every slot comes back."""
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.generation.scheduler import PrefillPolicy

    texts = [TEXT, "A second, longer request that keeps going for a little while.", "Third."]
    options = GenerationOptions(temperature=0, max_rows=40)
    tts, _ = _greedy(exports[name])
    alone = [tts.generate(t, options=options).rows for t in texts]
    sched = tts.scheduler(2, 256, PrefillPolicy(chunk=256))  # two slots, three requests; prompts prefill whole
    handles = [sched.submit(tts.request(t, options=options, slot=256)) for t in texts]
    sched.run_until_idle()
    got = [h.wait().generated for h in handles]
    assert sched.pool.in_use == 0 and max(h.widest for h in handles) == 2
    sched.close()
    for want, rows in zip(alone, got, strict=True):
        np.testing.assert_array_equal(rows, want)


def test_openvino_runs_every_part_and_matches_the_cpu_codes(exports):
    tts, ov = _greedy(exports["openvino_fp32"])
    assert tts.provider == "openvino"
    assert set(tts.ran_on().values()) == {"OpenVINO:CPU"} and len(tts.ran_on()) >= 4
    _, cpu = _greedy(exports["cpu_fp32"])
    np.testing.assert_array_equal(ov.rows, cpu.rows)
    _, ov4 = _greedy(exports["openvino_int4"])
    _, cpu4 = _greedy(exports["cpu_int4_portable"])
    assert ov4.rows.shape[1] == cpu4.rows.shape[1] and ov4.waveform.size > 0


def test_the_openvino_runtime_also_runs_a_cpu_export(exports):
    tts, speech = _greedy(exports["cpu_fp32"], provider="openvino")
    _, cpu = _greedy(exports["cpu_fp32"])
    assert set(tts.ran_on().values()) == {"OpenVINO:CPU"}
    np.testing.assert_array_equal(speech.rows, cpu.rows)


def test_an_openvino_export_refuses_the_cpu_ep(exports):
    from higgs_onnx.runtime.model import HiggsTTS

    with pytest.raises(ValueError, match=r"built for OpenVINO CPU \(device openvino\); run it with --provider "
                                         r"openvino"):
        HiggsTTS(exports["openvino_int4"], provider="cpu", verify=False)


def test_openvino_holds_the_kv_cache_as_the_compiled_models_state(exports):
    """The stateful decoder (OpenVINO's MakeStateful: the cache never crosses to the host) gives the codes of the
    plain path that feeds the cache through NumPy every step: greedy, sampled, cloned (a voice's saved prefix
    written into the state) and after a truncation (a retried turn)."""
    from higgs_onnx.runtime.decoder import SimpleDecoder, StatefulDecoder
    from higgs_onnx.runtime.model import HiggsTTS

    ref = "tests/data/ref_en_24k.wav"
    for name in ("openvino_fp32", "openvino_int4"):
        state, host = HiggsTTS(exports[name]), HiggsTTS(exports[name], kv_cache="host")
        assert isinstance(state.backend.decoder, StatefulDecoder) and state.kv_memory == "state"
        assert isinstance(host.backend.decoder, SimpleDecoder) and host.kv_memory == "host"
        assert "llm_decoder (stateful)" in state.ran_on() and "llm_decoder" not in state.ran_on()
        for kw in ({"temperature": 0}, {"seed": 3}):
            np.testing.assert_array_equal(state.generate(TEXT, max_rows=40, **kw).rows,
                                          host.generate(TEXT, max_rows=40, **kw).rows)
        np.testing.assert_array_equal(state.generate("Cloned.", ref_audio=ref, seed=2, max_rows=30).rows,
                                      host.generate("Cloned.", ref_audio=ref, seed=2, max_rows=30).rows)
    dec, f = state.backend.decoder, state.facts
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((n, f.hidden)).astype(np.float32) * 0.1 for n in (6, 1))
    cache = dec.new_cache(16)
    dec.run(cache, x)
    first = dec.run(cache, y)
    dec.run(cache, y)
    cache.truncate(6)
    assert cache.length == 6 and dec.snapshot(cache)["past_key_values.0.key"].shape[2] == 6
    np.testing.assert_array_equal(dec.run(cache, y), first)
    with pytest.raises(ValueError, match="exceeds the cache of 16"):
        dec.run(cache, np.zeros((10, f.hidden), np.float32))


def test_openvino_runs_a_cpu_exports_step_graph_with_its_cache_as_state(exports):
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(exports["cpu_fp32"], provider="openvino")
    assert tts.backend.fused and tts.backend.decoder_part == "llm_step" and tts.kv_memory == "state"
    _, cpu = _greedy(exports["cpu_fp32"])
    np.testing.assert_array_equal(tts.generate(TEXT, temperature=0, max_rows=40).rows, cpu.rows)


def test_openvino_refuses_an_int8_kv_cache_export(exports):
    """OpenVINO's GroupQueryAttention ignores the quantized-cache attributes (16 % of the greedy codes agreed,
    measured): refused at load with what to do instead, never run wrong."""
    from higgs_onnx.runtime.model import HiggsTTS

    assert load_manifest(exports["cpu_int4"], verify=False).kv_cache == "int8"
    with pytest.raises(ValueError, match=r"int8 KV cache .* OpenVINO runtime does not compute right; run it with "
                                         r"--provider cpu"):
        HiggsTTS(exports["cpu_int4"], provider="openvino", verify=False)
