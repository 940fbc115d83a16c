"""The int8 GEMM route (`parts/llm_route.py`, `runtime/route.py`): what the default cpu int4 build writes and
records, the graph (int8 GEMMs in place of every MatMulNBits, the step graph's cache), the runtime's choice by
row count over the same KV buffers, deterministic jobs, the build's refusals, and a damaged route refused by its
gate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from higgs_onnx.parity import cosine
from higgs_onnx.parts import llm_route
from higgs_onnx.runtime import route as routes
from higgs_onnx.runtime.route import RoutePolicy

TEXT = "The route speaks the same words."
DATA = Path(__file__).resolve().parent / "data"


# -- the policy (no export) ---------------------------------------------------------------------------------------
def test_the_policy_sends_a_call_by_its_row_count():
    p = RoutePolicy(prefill=8, batch=4)
    assert [p.use(n, False) for n in (1, 7, 8, 300)] == [False, False, True, True]
    assert [p.use(n, True) for n in (1, 3, 4, 16)] == [False, False, True, True]
    assert not routes.NEVER.active and not routes.NEVER.use(10_000, False)
    assert routes.MULTI_ROW.use(2, True) and not routes.MULTI_ROW.use(1, True)


def test_the_crossover_is_where_the_route_wins_from_there_on():
    assert llm_route.crossover({2: (1.0, 1.2), 4: (1.0, 0.9), 8: (2.0, 1.5)}) == 4
    assert llm_route.crossover({2: (1.0, 0.9), 4: (1.0, 1.1), 8: (2.0, 1.5)}) == 8  # a loss at 4: from 8 on
    assert llm_route.crossover({2: (1.0, 1.2), 4: (1.0, 1.5)}) is None



def test_the_crossover_is_worded_once_given_or_measured():
    """`manifest.crossover_words` says an export's crossover for the build's line, eval's report, the model card and
    benchmarks/routes.py: a size never taken is "never" (not "from never positions"), and a crossover given on the
    command line says so (not "measured here")."""
    from higgs_onnx.hub_card import gate_lines
    from higgs_onnx.manifest import crossover_words

    given = {"kind": "int8-gemm", "crossover": {"prefill": 64, "batch": None}, "crossover_given": True,
             "cpu": {"model": "Xeon", "flags": ["avx512_vnni"]}}
    assert crossover_words(given) == ("one-row calls from 64 positions, batched steps never; given at build "
                                      "(--route-crossover), not measured; built on Xeon; s8: 8-bit weights, for "
                                      "CPUs with an int8 dot product (VNNI or AMX)")  # no form: built before s7
    measured = {"crossover": {"prefill": None, "batch": 4}, "cpu": {"model": "EPYC"}, "form": "s7"}
    assert crossover_words(measured) == ("one-row calls never (int4 won at every size timed), batched steps "
                                         "from 4 rows; measured on EPYC; s7: 7-bit weights, exact on every x86 int8 "
                                         "kernel (AVX2, VNNI, AMX)")
    card = "\n".join(gate_lines({"route": given}))
    assert f"- route crossover: {crossover_words(given)}, CPU flags avx512_vnni" in card
    root = Path(__file__).resolve().parents[1]
    sources = [*root.glob("*.py"), *root.glob("higgs_onnx/**/*.py"), *root.glob("benchmarks/*.py"),
               *root.glob("scripts/*.py")]
    wording = re.compile(r"one-row calls (from )?\{")  # an f-string that words a crossover
    sites = sorted(str(p.relative_to(root)) for p in sources if wording.search(p.read_text(encoding="utf-8")))
    assert sites == ["higgs_onnx/manifest.py"], sites

AVX2 = frozenset({"avx2", "fma", "sse4_2"})  # most laptops and desktops: no int8 dot product
VNNI = AVX2 | {"avx512f", "avx512_vnni"}


def test_the_policy_reads_the_manifest_and_the_cpu(caplog):
    """`auto` takes the route where its gate held and this CPU's u8s8 GEMM multiplies its weight form exactly: s7
    on any x86 CPU with AVX2, s8 (and an entry built before the form was recorded) only with VNNI or AMX; elsewhere
    one line naming the form, the flags it needs and how to rebuild. Flags given, not this machine's."""
    s7 = {"kind": "int8-gemm", "crossover": {"prefill": 16, "batch": None}, "form": "s7"}
    s8 = {**s7, "form": "s8"}
    old = {k: v for k, v in s7.items() if k != "form"}
    on = RoutePolicy(prefill=16, batch=None)
    for entry, flags, want in ((s7, AVX2, on), (s7, VNNI, on), (s8, VNNI, on), (s8, AVX2 | {"avx_vnni"}, on),
                               (s8, AVX2 | {"amx_int8"}, on), (old, VNNI, on), (s7, frozenset(), on),
                               (s8, frozenset(), on)):  # no flags to read (not Linux): the build's gate stands
        assert routes.policy(entry, flags=flags) == want, (entry.get("form"), sorted(flags))
    assert routes.policy(s7, "off", VNNI) == routes.NEVER and routes.policy(s8, "on", AVX2) == routes.MULTI_ROW
    assert routes.policy({"kind": "none"}, flags=VNNI) == routes.NEVER and routes.policy(None) == routes.NEVER
    for entry, flags, words in ((s8, AVX2, "its s8 weights need avx512_vnni or avx_vnni or amx_int8"),
                                (old, AVX2, "its s8 weights need avx512_vnni"),
                                (s7, frozenset({"sse4_2", "fma"}), "its s7 weights need avx2")):
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert routes.policy(entry, flags=flags) == routes.NEVER
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and lines[0].startswith("int8 route off: " + words), lines
        assert ("--route-form s7" in lines[0]) == (entry is not s7)
    with pytest.raises(ValueError, match="route must be one of auto, off, on"):
        routes.policy(s7, "fast")


def test_the_route_form_is_checked_at_build_and_at_load(tmp_path):
    from higgs_onnx.export import ExportOptions
    from higgs_onnx.manifest import ManifestError, check_route

    assert ExportOptions("cpu", "int4").route_form == "s7"  # the default: one export that runs on every x86 CPU
    with pytest.raises(ValueError, match="--route-form must be one of s7, s8, got 's6'"):
        ExportOptions("cpu", "int4", route_form="s6")
    for no_route in ({"precision": "fp32"}, {"precision": "int4", "prefill_route": "none"}):  # said, never ignored
        with pytest.raises(ValueError, match="--route-form sets the int8 route.s weights, but this build makes no"):
            ExportOptions("cpu", route_form="s8", **no_route)
    entry = {"kind": "int8-gemm", "crossover": {"prefill": 16, "batch": None}}
    check_route(entry, tmp_path / "manifest.json")  # built before the form: s8
    check_route({**entry, "form": "s7"}, tmp_path / "manifest.json")
    with pytest.raises(ManifestError, match=r"'decoder.route.form' must be one of s7, s8 \(the int8 weights' "
                                            r"range\), got 's9'"):
        check_route({**entry, "form": "s9"}, tmp_path / "manifest.json")


def test_a_build_that_cannot_have_the_route_refuses_it_by_name():
    from higgs_onnx.export import ExportOptions

    assert ExportOptions("cpu", "int4").route and not ExportOptions("cpu", "int4", prefill_route="none").route
    assert not ExportOptions("cpu", "fp32").route and not ExportOptions("cuda", "int4").route
    for kwargs in ({"device": "cpu", "precision": "fp32"}, {"device": "cpu", "precision": "int4",
                                                            "attention": "portable"},
                   {"device": "cuda", "precision": "int4"}):
        with pytest.raises(ValueError, match="the int8 prefill route runs beside an int4 GroupQueryAttention"):
            ExportOptions(**kwargs, prefill_route="int8")
    with pytest.raises(ValueError, match="--prefill-route must be one of int8, none, got 'int4'"):
        ExportOptions("cpu", "int4", prefill_route="int4")


def test_the_columns_quantize_symmetric_per_output_column():
    from higgs_onnx.quantize import quantize_columns

    w = np.random.default_rng(0).standard_normal((64, 5)).astype(np.float32) * np.array([1, 10, 0.1, 3, 0],
                                                                                        np.float32)
    for bits, top in ((8, 127), (7, 63)):
        q, s = quantize_columns(w, bits)
        assert q.dtype == np.int8 and s.shape == (5,) and np.abs(q).max() == top
        np.testing.assert_allclose(np.abs(q[:, :4]).max(axis=0), top)
        err = np.abs(q.astype(np.float32) * s - w).max(axis=0)[:4]
        assert (err <= s[:4] / 2 * (1 + 1e-5)).all() and (err > s[:4] / 4).all()  # round to nearest: half a step
        assert not q[:, 4].any()  # an all-zero column stays zero
    with pytest.raises(ValueError, match="7 or 8 bits"):
        quantize_columns(w, 4)


# -- the default build --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_default_int4_build_writes_a_gated_timed_route(builds):
    from higgs_onnx.manifest import load_manifest

    folder = builds["int4"]
    m = load_manifest(folder, verify=True)
    r = m.decoder["route"]
    assert r["kind"] == "int8-gemm" and r["part"] == "llm_route" and r["policy"] == llm_route.POLICY
    assert r["form"] == "s7"  # the default: exact on every x86 CPU
    worst = r["gate"]["worst"]
    assert not r["gate"]["failed"]
    for k in ("hidden_distance", "logit_distance"):
        assert 0 < worst["int8"][k] <= worst["int4"][k]  # no further from fp32 than int4
    assert [p["prompt"] for p in r["gate"]["prompts"]] == ["zero-shot 1", "zero-shot 2", "clone prefix"]
    assert r["crossover"] == {"prefill": 64, "batch": None} and r["crossover_given"]  # conftest's, not measured
    assert r["cpu"]["model"] and isinstance(r["cpu"]["flags"], list)
    assert set(m.parts["llm_decoder"]["files"]) >= {"llm_decoder_int8.onnx", "llm_decoder_int8.onnx.data"}
    assert m.parts["llm_route"]["files"].keys() == {"llm_route.onnx"}  # its weights are the decoder's files
    # the graph: every projection on the int8 GEMM, the int4 weights not referenced, the step graph's cache I/O
    g = onnx.load(str(folder / "llm_route.onnx"), load_external_data=False).graph
    step = onnx.load(str(folder / "llm_step.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in g.node]
    layers = m.model["layers"]
    assert "MatMulNBits" not in ops and ops.count("MatMulIntegerToFloat") == 5 * layers  # qkv, o, gate, up, down
    assert ops.count("QuantizeLinear") == 4 * layers  # gate and up share their input's quantization
    assert not {"MatMulInteger", "Round"} & set(ops)  # the scales inside the GEMM's kernel, the rounding in Quantize
    assert not any(t.name.endswith(("_Q4", "_scales")) and not t.name.endswith("_Q8_scales") for t in g.initializer)
    io = {(v.name, v.type.tensor_type.elem_type) for v in [*g.input, *g.output]}
    assert io == {(v.name, v.type.tensor_type.elem_type) for v in [*step.input, *step.output]}
    locations = {e.value for t in g.initializer for e in t.external_data if e.key == "location"}
    assert {"llm_decoder.onnx.data", "llm_decoder_int8.onnx.data"} <= locations <= {
        "llm_decoder.onnx.data", "llm_decoder_int8.onnx.data", "audio_embed.onnx.data", "audio_heads.onnx.data"}


def avx2_u8s8(a: np.ndarray, w: np.ndarray, zero_point: int) -> np.ndarray:
    """MLAS's u8s8 GEMM on a CPU without an int8 dot product, in NumPy: vpmaddubsw multiplies u8 `a` (M, K) by s8
    `w` (K, N) and adds each pair of adjacent k in 16 bits, saturating; vpmaddwd adds the pairs into int32; the
    zero point comes off afterwards (sum a*w - zp * the column sums of w)."""
    a, w = a.astype(np.int64), w.astype(np.int64)
    if a.shape[1] % 2:
        a, w = np.pad(a, ((0, 0), (0, 1))), np.pad(w, ((0, 1), (0, 0)))
    pairs = np.clip(a[:, 0::2, None] * w[None, 0::2] + a[:, 1::2, None] * w[None, 1::2], -32768, 32767)
    return pairs.sum(axis=1) - zero_point * w.sum(axis=0)


def route_gemms(folder: Path, tmp: Path, embeds: np.ndarray) -> list[tuple]:
    """(name, u8 rows (M, K), int8 weights (K, N), zero point) of every integer GEMM of the route in `folder`
    (MatMulInteger, or MatMulIntegerToFloat: inputs A, B, ... and A's zero point), from one prefill of `embeds`
    (the graph with the u8 tensors as outputs, in `tmp` beside hard links of the weights' files)."""
    from onnx import helper, numpy_helper

    from higgs_onnx.manifest import link_or_copy
    from higgs_onnx.parts.llm_decoder import INT8_WEIGHTS
    from higgs_onnx.parts.llm_step import CODES, EMBEDS
    from higgs_onnx.runtime.decoder import SimpleDecoder
    from higgs_onnx.runtime.model import HiggsTTS
    from higgs_onnx.runtime.session import create_session

    zero_point_input = {"MatMulInteger": 2, "MatMulIntegerToFloat": 4}
    model = onnx.load(str(folder / "llm_route.onnx"), load_external_data=False)
    consts = {t.name: t for t in model.graph.initializer}
    gemms = [n for n in model.graph.node if n.op_type in zero_point_input]
    model.graph.output.extend(helper.make_tensor_value_info(u8, onnx.TensorProto.UINT8, None)
                              for u8 in dict.fromkeys(n.input[0] for n in gemms))
    onnx.save(model, str(tmp / "probe.onnx"))
    for data in folder.glob("*.data"):
        link_or_copy(data, tmp / data.name)
    index = onnx.load(str(folder / INT8_WEIGHTS), load_external_data=False)
    weights = {}
    for t in index.graph.initializer:  # the int8 weights, from the external data the index points at
        info = {e.key: e.value for e in t.external_data}
        if t.data_type == onnx.TensorProto.INT8:
            weights[t.name] = np.fromfile(folder / info["location"], np.int8, int(np.prod(t.dims)),
                                          offset=int(info["offset"])).reshape(tuple(t.dims))
    tts = HiggsTTS(folder, verify=False, route="off")
    f = tts.facts
    past = SimpleDecoder(tts.part("llm_decoder"), f).new_cache(len(embeds) + 1).arrays
    session = create_session(tmp / "probe.onnx", "cpu", name="probe")
    names = [o.name for o in session.get_outputs()]
    outs = dict(zip(names, session.run(None, {EMBEDS: embeds[None], CODES: np.zeros((1, 0, f.num_codebooks), np.int64),
                                              "attention_mask": np.ones((1, len(embeds)), np.int64), **past}),
                    strict=True))
    return [(n.name, outs[n.input[0]].reshape(len(embeds), -1), weights[n.input[1]],
             int(numpy_helper.to_array(consts[n.input[zero_point_input[n.op_type]]]))) for n in gemms]


def ort_matmul_integer(tmp: Path, a: np.ndarray, w: np.ndarray, zero_point: int) -> np.ndarray:
    """ONNX Runtime's MatMulInteger (MLAS's u8s8 GEMM, this CPU's kernel) of u8 `a` (M, K) and s8 `w` (K, N)."""
    from onnx import helper, numpy_helper

    from higgs_onnx.runtime.session import create_session

    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "w", "zp"], ["y"])], "gemm",
                              [helper.make_tensor_value_info("a", onnx.TensorProto.UINT8, [None, a.shape[1]])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.INT32, [None, w.shape[1]])],
                              initializer=[numpy_helper.from_array(np.ascontiguousarray(w), "w"),
                                           numpy_helper.from_array(np.array(zero_point, np.uint8), "zp")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10),
              str(tmp / "gemm.onnx"))
    return create_session(tmp / "gemm.onnx", "cpu", name="gemm").run(None, {"a": a})[0]


@pytest.mark.slow
def test_s7_weights_are_exact_on_every_x86_kernel_where_s8_saturates_without_vnni(builds, tts4, tmp_path):
    """The default route's 7-bit weights: ONNX Runtime's int32 products on a real prefill equal an exact int64
    matmul, and so does MLAS's AVX2 kernel (`avx2_u8s8`: 255 x 63 x 2 = 32130 fits its 16-bit pair sums). The same
    weight columns at 8 bits (255 x 127 x 2 saturates) differ on that kernel in some cells. No AVX2-only machine
    runs here: the emulation is the test of the argument (docs/building.md)."""
    from higgs_onnx.generation.engine import prompt_embeddings
    from higgs_onnx.generation.prompt import build_prompt
    from higgs_onnx.quantize import quantize_columns

    embeds = prompt_embeddings(tts4.backend, build_prompt(tts4.tokenizer, tts4.tokens, TEXT), tts4.facts.placeholder,
                               None)
    gemms = route_gemms(builds["int4"], tmp_path, embeds)
    assert len(gemms) == 5 * tts4.facts.layers
    differ = 0
    for name, a, w7, zp in gemms:
        assert zp == 128 and np.abs(w7).max() == 63 and a.dtype == np.uint8, name
        exact = (a.astype(np.int64) - zp) @ w7.astype(np.int64)
        got = ort_matmul_integer(tmp_path, a, w7, zp)  # ONNX Runtime, this CPU's kernel
        np.testing.assert_array_equal(got, exact, err_msg=name)
        np.testing.assert_array_equal(avx2_u8s8(a, w7, zp), exact, err_msg=name)  # the AVX2 kernel
        w8 = quantize_columns(w7.astype(np.float32), 8)[0]  # the same columns in the s8 form
        differ += int((avx2_u8s8(a, w8, zp) != (a.astype(np.int64) - zp) @ w8.astype(np.int64)).sum())
    assert differ > 0  # real activations reach the saturation with 8-bit weights


@pytest.mark.slow
def test_the_route_writes_the_same_cache_and_each_call_goes_by_its_rows(builds):
    """One request's cache prefilled on the route and continued on int4 (and the other way round): the same
    buffers, the rows close to the int4-only run; a pool's batched step on the route writes every row in place."""
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(builds["int4"], verify=False, route="on")
    dec = tts.backend.decoder
    assert tts.backend.route_part == "llm_route" and "llm_route" in tts.preload()
    f = tts.facts
    embeds = (np.random.default_rng(1).standard_normal((12, f.hidden)) * 0.05).astype(np.float32)
    states = {}
    for policy in (routes.NEVER, routes.ALWAYS):
        dec.policy = policy
        cache = dec.new_cache(16)
        dec.run(cache, embeds)
        states[policy.active] = dec.snapshot(cache)
    for name, a in states[False].items():
        b = states[True][name]
        assert a.shape == b.shape == (1, f.kv_heads, 12, f.head_dim)
        assert cosine(a, b) > 0.9 and not np.array_equal(a, b)  # int8 cache values of two routes
    dec.policy = RoutePolicy(prefill=8, batch=2)
    dec.calls = {False: 0, True: 0}
    cache = dec.new_cache(20)
    dec.run(cache, embeds[:7])  # 7 positions: int4
    dec.run(cache, embeds[7:])  # 5 positions: int4
    cache2 = dec.new_cache(20)
    dec.run(cache2, embeds[:8])  # 8: the route
    assert dec.calls == {False: 2, True: 1}
    pool = dec.pool(3, 24)
    slots = [pool.acquire(24) for _ in range(3)]
    for s in slots:
        pool.run_one(s, embeds)  # 12 positions each: the route
    codes = np.random.default_rng(2).integers(0, f.codebook_size, (3, f.num_codebooks))
    before = {n: a.copy() for n, a in pool.arrays.items()}
    hidden, logits = pool.step_batch(slots, codes)  # 3 rows: the route
    assert dec.calls == {False: 2, True: 5}
    assert hidden.shape == (3, f.hidden) and logits.shape == (3, f.num_codebooks, f.codebook_vocab)
    for n, a in pool.arrays.items():  # position 12 of every row written, in place, by the route's session
        assert not np.array_equal(a[:, :, 12], before[n][:, :, 12])
    assert pool.lengths == [13, 13, 13]
    pool.step_batch(slots[:1], codes[:1])  # one row: int4
    assert dec.calls[False] == 3


@pytest.mark.slow
def test_the_routes_session_is_made_by_the_first_call_that_takes_it(builds):
    """The route's weights are held only once a call takes it: calls that stay on int4 never load them."""
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(builds["int4"], verify=False, route="on")
    dec = tts.backend.decoder
    assert tts.backend.route_part == "llm_route" and "llm_route" not in tts.parts.loaded()
    embeds = (np.random.default_rng(3).standard_normal((6, tts.facts.hidden)) * 0.05).astype(np.float32)
    cache = dec.new_cache(8)
    dec.run(cache, embeds[:1])  # one position: int4 under "on"
    assert dec.calls == {False: 1, True: 0} and "llm_route" not in tts.parts.loaded()
    dec.run(cache, embeds[1:])  # five: the route, made now
    assert dec.calls == {False: 1, True: 1} and "llm_route" in tts.parts.loaded()


@pytest.mark.slow
def test_every_mode_speaks_and_a_deterministic_job_is_the_same_bytes_as_alone(builds):
    """`route="off"` never loads the route; "on" puts a clone's prefill and batched steps on it. A job run
    exclusively on a busy scheduler makes the calls it made alone (their shapes decide the route): same rows."""
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.runtime.model import HiggsTTS

    off = HiggsTTS(builds["int4"], verify=False, route="off")
    assert off.backend.route_part is None and "llm_route" not in off.preload()
    with pytest.raises(ValueError, match="route must be one of auto, off, on"):
        HiggsTTS(builds["int4"], verify=False, route=True)
    tts = HiggsTTS(builds["int4"], verify=False, route="on")
    opts = GenerationOptions(seed=5, max_rows=40)
    alone = tts.generate(TEXT, options=opts)
    assert len(alone.rows) > 8
    dec = tts.backend.decoder
    dec.calls = {False: 0, True: 0}
    positions = tts.slot_positions
    with tts.scheduler(3, positions) as sched:
        others = [sched.submit(tts.request(f"Another line, number {i}.", options=GenerationOptions(
            seed=i, max_rows=30), slot=positions), audio="speech") for i in range(2)]
        mine = sched.submit(tts.request(TEXT, options=opts, slot=positions), audio="speech", exclusive=True)
        sched.run_until_idle()
        speech = mine.wait()
        for h in others:
            h.wait()
    np.testing.assert_array_equal(speech.rows, alone.rows)
    assert dec.calls[True] >= 3  # the prefills, and the others' batched steps, ran on the route


@pytest.mark.slow
def test_both_routes_are_timed_for_the_crossover(builds):
    """What a build without --route-crossover records: both routes timed along the ladders, the crossover the
    smallest size from which the route wins at every larger size measured (or none)."""
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(builds["int4"], verify=False, route="on")
    out = llm_route.measure(tts.backend.decoder, repeats=1)
    for kind, ladder in (("prefill", llm_route.PREFILL_LADDER), ("batch", llm_route.BATCH_LADDER)):
        ms = {int(k): v for k, v in out[kind]["ms"].items()}
        assert ms and set(ms) <= set(ladder) and all(len(v) == 2 and min(v) > 0 for v in ms.values())
        assert out[kind]["crossover"] == llm_route.crossover({k: tuple(v) for k, v in ms.items()})
    assert tts.backend.decoder.policy == routes.MULTI_ROW  # the timing forced each route, then put it back
    # int4, timed first, covers both ladders whatever the clock says: a busy machine (here every reading of the clock
    # 100 s later than the last) once cut the climb at 4 positions, where the route never wins ("never")
    clock = iter(range(0, 10**9, 100))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_route.time, "perf_counter", lambda: float(next(clock)))
        alone = llm_route.time_ladders(tts.backend.decoder, False, repeats=1)
    assert {k: sorted(v) for k, v in alone.items()} == {"prefill": list(llm_route.PREFILL_LADDER),
                                                        "batch": list(llm_route.BATCH_LADDER)}
    # the build times int4 once more after the route, keeping the better of the two phases: a phase slowed by other
    # work (here: 1000 s) gives way to the new timing, a faster one (here: 0 s) stays
    again = llm_route.time_again(tts.backend.decoder, False, {"prefill": {4: 1000.0, 8: 0.0}, "batch": {2: 1000.0}},
                                 repeats=1)
    assert 0 < again["prefill"][4] < 1000 and again["prefill"][8] == 0.0 and 0 < again["batch"][2] < 1000


@pytest.mark.slow
def test_the_profile_splits_the_prefill_and_the_batched_steps(builds):
    """`bench.py --routes`'s profile (benchmarks/routes.py): every kernel of a run in one part of the split, the
    activations' quantization only on the route, one GEMM per projection (and the heads'), the kernels' best no
    longer than the best wall, and the route's GEMMs alone timed on the route's own weight shapes."""
    import sys

    sys.path.insert(0, str(DATA.parent.parent / "benchmarks"))
    try:
        import routes as bench_routes
    finally:
        sys.path.remove(str(DATA.parent.parent / "benchmarks"))
    folder = builds["int4"]
    layers = json.loads((folder / "manifest.json").read_text())["model"]["layers"]
    p = bench_routes.profile(folder, threads=1, repeats=2, positions=24, batches=(2, 4))
    calls = [("route", p["prefill"]), *[(label, x) for label, r in p["batch"].items() for x in r.values()]]
    assert [label for label, _ in calls] == ["route", "route", "route", "int4", "int4"]
    for label, x in calls:
        s = x["split"]
        assert s["gemms"] == 5 * layers + 1  # qkv, o, gate, up, down; the audio heads' MatMul
        assert s["GEMMs"] > 0 and s["attention"] > 0 and s["other kernels"] > 0
        assert (s["quantization"] > 0) == (label == "route")
        assert sum(s[k] for k in bench_routes.SPLIT) <= x["wall_ms"]
    _, _, shapes = bench_routes.gemm_alone(folder / llm_route.FILE, 24, np.random.default_rng(0))
    assert sum(shapes.values()) == 5 * layers
    assert p["prefill"]["gemm_alone_ms"] > 0 and p["prefill"]["over_gemms"] == pytest.approx(
        p["prefill"]["wall_ms"] / p["prefill"]["gemm_alone_ms"])


def test_a_given_crossover_is_checked_and_needs_a_route():
    from higgs_onnx.export import ExportOptions

    assert ExportOptions("cpu", "int4", route_crossover=(8, None)).route_crossover == (8, None)
    with pytest.raises(ValueError, match="two sizes >= 1"):
        ExportOptions("cpu", "int4", route_crossover=(0, 4))
    with pytest.raises(ValueError, match="makes no route"):
        ExportOptions("cpu", "int4", prefill_route="none", route_crossover=(8, 4))
    import optimize

    assert optimize.parse_crossover(["64", "None"]) == (64, None)
    for bad in ("\u00b2", "-1", "4.0"):  # '²' was int()'s "invalid literal" line
        with pytest.raises(ValueError, match=rf"--route-crossover takes two sizes >= 1 \(or none\), got '{bad}'"):
            optimize.parse_crossover([bad, "4"])


# -- the gate refuses a damaged route -----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_damaged_route_is_refused_and_not_written(builds, part_cache, tiny_ckpt, tmp_path, monkeypatch, capsys):
    import shutil

    from higgs_onnx import quantize
    from higgs_onnx.export import PART_CACHE_ENV, Exporter, ExportOptions
    from higgs_onnx.manifest import load_manifest

    real = quantize.quantize_columns

    def damaged(w, bits=8):  # every column's scale off by up to +-40 %: a wrong route, not a rounding
        q, s = real(w, bits)
        return q, s * np.random.default_rng(q.shape[1]).uniform(0.6, 1.4, s.shape).astype(np.float32)

    monkeypatch.setattr(quantize, "quantize_columns", damaged)
    # the decoder (its files hold the route's weights) is built again, with the damage, in a part cache of the test's
    # own; the parts without a route, the session's (`builds` made them), are copied into it
    keep = [p for p in part_cache.iterdir() if not p.name.startswith("llm_decoder-") and not p.name.endswith(".tmp")]
    for folder in keep:
        shutil.copytree(folder, tmp_path / "parts" / folder.name)
    monkeypatch.setenv(PART_CACHE_ENV, str(tmp_path / "parts"))
    root = tmp_path / "out"
    folder = Exporter(str(tiny_ckpt), root, ExportOptions("cpu", "int4")).run()
    m = load_manifest(folder, verify=True)
    r = m.decoder["route"]
    assert r["kind"] == "none" and r["refused"]["gate"]["failed"]
    assert r["refused"]["gate"]["worst"]["int8"]["hidden_distance"] > r["refused"]["gate"]["worst"]["int4"][
        "hidden_distance"]
    out = capsys.readouterr().out
    assert "int8 route refused, not written: hidden_distance" in out and "(int4 " in out
    assert "llm_route" not in m.parts and not (folder / "llm_route.onnx").exists()
    assert not (folder / "llm_decoder_int8.onnx.data").exists()
    assert set(m.parts["llm_decoder"]["files"]) == {"llm_decoder.onnx", "llm_decoder.onnx.data"}
    from higgs_onnx.runtime.model import HiggsTTS

    assert HiggsTTS(folder, verify=False).backend.route_part is None  # runs on int4 alone
    # asked for by name, the same damage fails the build and leaves the folder as it was
    before = json.loads((folder / "manifest.json").read_text())
    with pytest.raises(RuntimeError, match="int8 route fails its gate against fp32: hidden_distance.*"
                                           "--prefill-route none"):
        Exporter(str(tiny_ckpt), root, ExportOptions("cpu", "int4", prefill_route="int8")).run()
    assert json.loads((folder / "manifest.json").read_text()) == before
    # and without a route the same folder is up to date again (the refusal stands for the same policy)
    Exporter(str(tiny_ckpt), root, ExportOptions("cpu", "int4")).run()
    assert "is up to date: nothing to do" in capsys.readouterr().out


@pytest.mark.slow
def test_prefill_route_none_builds_the_int4_graph_alone(tiny_ckpt, tmp_path):
    from higgs_onnx.export import Exporter, ExportOptions
    from higgs_onnx.manifest import load_manifest

    folder = Exporter(str(tiny_ckpt), tmp_path / "none", ExportOptions("cpu", "int4", prefill_route="none")).run()
    m = load_manifest(folder, verify=True)
    assert m.decoder["route"] == {"kind": "none"} and "llm_route" not in m.parts
    assert not list(folder.glob("llm_decoder_int8*")) and not (folder / "llm_route.onnx").exists()


def test_the_default_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(routes.ENV, raising=False)
    assert routes.check_mode(None) == "auto"
    monkeypatch.setenv(routes.ENV, "off")
    assert routes.check_mode(None) == "off" and routes.check_mode("on") == "on"
    monkeypatch.setenv(routes.ENV, "sometimes")
    with pytest.raises(ValueError, match=r"\$HIGGS_ROUTE must be one of auto, off, on, got 'sometimes'"):
        routes.check_mode(None)


@pytest.mark.slow
@pytest.mark.parametrize("door", [["-m", "higgs_onnx.corpus", "--input", "ROWS", "--out", "OUT"],
                                  ["-m", "higgs_onnx.serve", "--ray", "--port", "0"],
                                  ["-m", "higgs_onnx.serve", "--port", "0"]])
def test_a_bad_route_mode_is_refused_before_ray_starts(builds, tmp_path, door):
    """`HIGGS_ROUTE=bogus`: one line and exit 2 from the door itself (runtime.route.check_mode, the one check),
    before Ray starts a worker or a replica (which used to fail later, as a worker's RuntimeError)."""
    import os
    import subprocess
    import sys

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "a", "text": "Hello."}\n')
    args = [str(rows) if a == "ROWS" else str(tmp_path / "out") if a == "OUT" else a for a in door]
    p = subprocess.run([sys.executable, *args, "--model-path", str(builds["int4"])], capture_output=True, text=True,
                       timeout=120, env={**os.environ, routes.ENV: "bogus"}, cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == ["error: $HIGGS_ROUTE must be one of auto, off, on, got 'bogus'"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_new_cached_and_saved_voice_speak_the_same_rows_on_the_route(builds, tmp_path):
    """The voice's prefix is prefilled once (on the route: a long call) and its state reused: a new voice, the
    cached one and one saved and loaded make the same calls after the prefix, so the same rows."""
    from higgs_onnx.runtime.model import HiggsTTS
    from higgs_onnx.runtime.voice import Voice

    ref, text = DATA / "ref_en_24k.wav", (DATA / "ref_en_24k.txt").read_text().strip()
    tts = HiggsTTS(builds["int4"], verify=False, route="on")
    first = tts.generate(TEXT, ref_audio=ref, ref_text=text, seed=4, max_rows=40)
    assert tts.backend.decoder.calls[True] >= 2  # the voice's prefix and the line's prefill
    again = tts.generate(TEXT, ref_audio=ref, ref_text=text, seed=4, max_rows=40)
    saved = tts.make_voice(ref, text).save(tmp_path / "v.npz")
    fresh = HiggsTTS(builds["int4"], verify=False, route="on")
    loaded = fresh.generate(TEXT, voice=Voice.load(saved, fresh.model_id), seed=4, max_rows=40)
    np.testing.assert_array_equal(first.rows, again.rows)
    np.testing.assert_array_equal(first.rows, loaded.rows)


@pytest.mark.slow
def test_asking_for_the_route_on_an_export_without_it_says_so(builds, caplog):
    from higgs_onnx.runtime.model import HiggsTTS

    with caplog.at_level("WARNING"):
        tts = HiggsTTS(builds["fp32"], verify=False, route="on")
        assert tts.backend.route_part is None
    assert "route 'on': no int8 route next to the step graph here" in caplog.text


@pytest.mark.slow
def test_the_route_stays_unloaded_where_memory_is_short(builds, monkeypatch, caplog):
    """A laptop with little free memory: the route's int8 weights (+1 byte a weight) are not loaded, one warning,
    every call on int4."""
    import psutil

    from higgs_onnx.runtime.backend import route_bytes
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(builds["int4"], verify=False, route="on")
    need = route_bytes(tts.manifest)
    assert need > 0
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=int(need * 1.2)))
    with caplog.at_level("WARNING"):
        assert tts.backend.route_part is None
    assert "int8 route off: it needs" in caplog.text
