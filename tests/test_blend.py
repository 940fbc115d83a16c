"""Voice blending (docs/voices.md): the mixing function, the blend spec, and a blend of saved voices run as rows of
one batch on the tiny fp32 export: (1, 0) is voice a's codes to the bit, (0.5, 0.5) neither voice's, the rows never
diverge, a plain request beside a blend keeps its codes; the CLI and the server, good and bad inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import inference
from higgs_onnx.generation.blend import (
    MAX_VOICES,
    Blend,
    BlendRequest,
    mix_logits,
    normalise_weights,
    parse_members,
    parse_spec,
    sample_blend,
)
from higgs_onnx.generation.options import GenerationOptions
from higgs_onnx.generation.sampling import GREEDY, SamplingOptions, sample_codes, softmax
from higgs_onnx.job.run import best_of

DATA = Path(__file__).resolve().parent / "data"
TEXT = "Hello there, this is a blend of two voices."
SAMPLED = GenerationOptions(seed=3, max_rows=150)


# -- the mixing function (no export) ----------------------------------------------------------------------------
def logits_of(seed: int, shape=(2, 8, 64)) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 3).astype(np.float32)


@pytest.mark.parametrize("opts", [SamplingOptions(), SamplingOptions(0.7, 5, 1.0), GREEDY], ids=str)
@pytest.mark.parametrize("weights", [(1.0, 0.0), (0.0, 1.0), (0.0, 1.0, 0.0)])
def test_one_nonzero_weight_is_that_voices_draw(opts, weights):
    lg = logits_of(1, (len(weights), 8, 64))
    only = int(np.flatnonzero(weights)[0])
    r1, r2 = np.random.default_rng(7), np.random.default_rng(7)
    assert np.array_equal(sample_blend(lg, weights, r1, opts), sample_codes(lg[only], r2, opts))
    assert r1.random() == r2.random()  # the same RNG use: the next draws agree too


def test_mixture_is_the_log_of_the_weighted_probabilities():
    lg, t = logits_of(2), 0.8
    x = mix_logits(lg, np.array([0.7, 0.3]), t)
    want = 0.7 * softmax(lg[0].astype(np.float64) / t) + 0.3 * softmax(lg[1].astype(np.float64) / t)
    assert np.allclose(softmax(x), want, atol=1e-9) and np.allclose(np.exp(x).sum(-1), 1.0)
    same = np.stack([lg[0], lg[0]])  # one voice twice: its own distribution
    assert np.allclose(softmax(mix_logits(same, np.array([0.5, 0.5]), t)), softmax(lg[0].astype(np.float64) / t))
    prod = mix_logits(lg, np.array([0.7, 0.3]), t, "product")
    assert np.allclose(prod, (0.7 * lg[0] + 0.3 * lg[1]).astype(np.float64) / t, atol=1e-5)


def test_greedy_blend_takes_the_argmax_of_the_mixed_probabilities():
    """Voice a favours code 0, voice b code 2, both give code 1 40 %: alone each picks its own, the equal mixture
    (0.3, 0.4, 0.3) picks 1; weighted 0.8/0.2 towards a it picks 0."""
    p = np.array([[[0.6, 0.4, 1e-6]], [[1e-6, 0.4, 0.6]]])
    lg = np.log(p).astype(np.float32)  # (2 voices, 1 codebook, 3 codes)
    rng = np.random.default_rng(0)
    assert [sample_codes(lg[i], rng, GREEDY)[0] for i in (0, 1)] == [0, 2]
    assert sample_blend(lg, (0.5, 0.5), rng, GREEDY)[0] == 1
    assert sample_blend(lg, (0.5, 0.5), rng, GREEDY, "product")[0] == 1
    assert sample_blend(lg, (0.8, 0.2), rng, GREEDY)[0] == 0


def test_top_k_filters_the_blend_not_each_voice():
    """top-k / top-p act on the mixed distribution: top_k=1 is its argmax whatever the draw; top_k=2 never leaves
    the mixture's two most likely codes."""
    lg = logits_of(3, (2, 4, 64))
    w = np.array([0.6, 0.4])
    mixed = mix_logits(lg, w, 0.8)
    for seed in range(20):
        one = sample_blend(lg, w, np.random.default_rng(seed), SamplingOptions(0.8, 1, 1.0))
        assert np.array_equal(one, mixed.argmax(-1))
        two = sample_blend(lg, w, np.random.default_rng(seed), SamplingOptions(0.8, 2, 1.0))
        top2 = np.argsort(-mixed, axis=-1)[:, :2]
        assert all(c in t for c, t in zip(two, top2, strict=True))


def test_equal_weights_draw_from_both_voices():
    """Two voices that each put all their mass on a different code: an equal blend draws both, about half each."""
    lg = np.full((2, 1, 8), -30.0, np.float32)
    lg[0, 0, 1] = lg[1, 0, 6] = 30.0
    rng = np.random.default_rng(5)
    draws = [int(sample_blend(lg, (0.5, 0.5), rng, SamplingOptions(1.0, 0, 1.0))[0]) for _ in range(400)]
    assert set(draws) == {1, 6} and 150 < draws.count(1) < 250


# -- weights and specs --------------------------------------------------------------------------------------------
def test_weights_are_normalised_and_checked():
    assert normalise_weights([0.7, 0.3]) == pytest.approx((0.7, 0.3))
    assert normalise_weights([2, 2]) == (0.5, 0.5) and normalise_weights([None, None]) == (0.5, 0.5)
    assert normalise_weights([3, 0]) == (1.0, 0.0)
    for bad, message in (([-1, 2], ">= 0"), ([0, 0], "every weight is 0"), ([float("nan"), 1], "finite"),
                         ([float("inf"), 1], "finite"), ([0.5, None], "to every voice or to none"),
                         (["0.5", 1], "numbers"), ([True, 1], "numbers")):
        with pytest.raises(ValueError, match=message):
            normalise_weights(bad)


def test_spec_parsing():
    assert parse_spec("voices/alice.npz:0.7,voices/bob.npz:0.3") == [("voices/alice.npz", 0.7),
                                                                   ("voices/bob.npz", 0.3)]
    assert parse_spec(" a , b ") == [("a", None), ("b", None)]
    assert parse_spec("a:1e-1,b:2") == [("a", 0.1), ("b", 2.0)]
    assert parse_spec(r"C:\v\a.npz,b") == [(r"C:\v\a.npz", None), ("b", None)]  # a drive letter is no weight
    for bad, message in (("a:x,b:1", "must be a number"), ("a:-1,b:1", ">= 0"), ("a:nan,b:1", "finite"),
                         ("a,,b", "empty voice"), ("a:,b", "must be a number"), (":0.5,b", "no voice"),
                         ("a,a", "named twice"), ("", "empty"),
                         (",".join(f"v{i}" for i in range(MAX_VOICES + 1)), f"at most {MAX_VOICES}")):
        with pytest.raises(ValueError, match=message):
            parse_spec(bad)


def test_server_list_form():
    assert parse_members([{"voice": "alice", "weight": 0.7}, {"id": "bob", "weight": 3}]) == [("alice", 0.7),
                                                                                            ("bob", 3.0)]
    assert parse_members("alice,bob") == [("alice", None), ("bob", None)]
    for bad, message in (([], "non-empty list"), (["alice"], "must be an object"), ([{"weight": 1}], "one voice"),
                         ([{"voice": "a", "id": "b"}], "one voice"), ([{"voice": "a", "weight": "0.5"}], "a number"),
                         ([{"voice": "a", "weight": True}], "a number"), ([{"voice": "a", "w": 1}], "unknown field"),
                         ([{"voice": "a", "weight": -2}], ">= 0"), (5, "non-empty list")):
        with pytest.raises(ValueError, match=message):
            parse_members(bad)


def test_blend_checks_its_voices_and_mode():
    assert Blend.make(["a", "b"], [3, 1]).weights == (0.75, 0.25)
    assert Blend.make(["a", "b"], names=["x", "y"]).describe() == "x 0.50, y 0.50"
    with pytest.raises(ValueError, match="at least 2 voices"):
        Blend.make(["a"])
    with pytest.raises(ValueError, match="mixture, product"):
        Blend.make(["a", "b"], mode="average")
    with pytest.raises(ValueError, match="as many weights"):
        Blend.make(["a", "b"], [1, 2, 3])


# -- the CLI's refusals, before any model loads (no export: the model path is never opened) ---------------------
@pytest.fixture
def voice_files(tmp_path):
    for name in ("alice", "bob"):
        (tmp_path / f"{name}.npz").write_bytes(b"")  # only their existence is checked before the model loads
    return tmp_path


@pytest.mark.parametrize("args, message", [
    (["--voice", "{d}/alice.npz:0.7,{d}/bob.npz:x"], "the weight of '{d}/bob.npz' must be a number"),
    (["--voice", "{d}/alice.npz:-1,{d}/bob.npz:1"], "must be a finite number >= 0"),
    (["--voice", "{d}/alice.npz:0,{d}/bob.npz:0"], "every weight is 0"),
    (["--voice", "{d}/alice.npz:0.5,{d}/bob.npz"], "give a weight to every voice or to none"),
    (["--voice", "{d}/alice.npz,{d}/carol.npz"], "voice file {d}/carol.npz does not exist"),
    (["--voice", "alice,carol"], "voice file alice does not exist (a saved voice's file, or a name in --voices"),
    (["--voice", "alice,carol", "--voices", "{d}"], "voice file {d}/carol.npz does not exist"),
    (["--voice", "alice,bob", "--voices", "{d}/alice.npz"], "is not a folder of saved voices"),
    (["--voice", "{d}/alice.npz,{d}/alice.npz"], "named twice"),
    (["--voice", "{d}/alice.npz", "--blend-mode", "product"], "--blend-mode is for a blend"),
    (["--blend-mode", "product"], "--blend-mode is for a blend of voices"),
    (["--voices", "{d}"], "--voices is for --voice (or --voices-map with --script)"),
    (["--voice", "alice,bob", "--voices", "{d}", "--takes", "2"], "--takes > 1 is not supported with a blend"),
])
def test_cli_blend_refusals(capsys, voice_files, args, message):
    d = str(voice_files)
    argv = ["--model-path", str(voice_files / "no-model"), "--text", "Hi.", "--out", str(voice_files / "o.wav")]
    assert inference.main(argv + [a.format(d=d) for a in args]) == 2
    err = capsys.readouterr().err
    assert message.format(d=d) in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_cli_refuses_a_blend_for_long_form(capsys, voice_files):
    (voice_files / "chapter.txt").write_text("One paragraph.\n\nAnother one.\n")
    code = inference.main(["--model-path", str(voice_files), "--text-file", str(voice_files / "chapter.txt"),
                           "--out", str(voice_files / "c.wav"), "--voice", "alice,bob", "--voices", str(voice_files)])
    err = capsys.readouterr().err
    assert code == 2 and "is not supported for long-form" in err and err.count("\n") == 1, err


# -- on the tiny fp32 export ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def voices(tts):
    a = tts.make_voice(DATA / "ref_en_24k.wav", (DATA / "ref_en_24k.txt").read_text().strip())
    b = tts.make_voice(DATA / "ref_de_22k_stereo.wav", (DATA / "ref_de_22k_stereo.txt").read_text().strip())
    return a, b


def rows_of(tts, voice, options=SAMPLED, text=TEXT):
    return tts.run(tts.request(text, voice=voice, options=options), None)


@pytest.mark.slow
@pytest.mark.parametrize("options", [SAMPLED, GenerationOptions(temperature=0, max_rows=150)],
                         ids=["sampled", "greedy"])
def test_one_voice_weighted_alone_is_that_voice(tts, voices, options):
    a, b = voices
    alone_a, alone_b = rows_of(tts, a, options), rows_of(tts, b, options)
    for weights, alone in (((1, 0), alone_a), ((0, 1), alone_b)):
        blend = rows_of(tts, Blend.make([a, b], weights), options)
        assert isinstance(blend, BlendRequest) and blend.width == 2
        assert np.array_equal(blend.generated, alone.generated), weights  # to the bit, on fp32
        assert blend.stop_reason == alone.stop_reason


@pytest.mark.slow
def test_an_even_blend_is_neither_voice_and_its_rows_never_diverge(tts, voices):
    a, b = voices
    alone = [rows_of(tts, v).generated for v in (a, b)]
    for mode in ("mixture", "product"):
        req = tts.request(TEXT, voice=Blend.make([a, b], mode=mode), options=SAMPLED)
        seen = []

        def lockstep(reqs, req=req, seen=seen):
            members = req.members
            assert len({m.n for m in members}) == 1 and len({m.stop_reason for m in members}) == 1
            assert all(np.array_equal(m.generated, req.generated) for m in members)
            seen.append(req.n)

        with tts.scheduler(2, 1024) as sched:
            sched.on_step = lockstep
            h = sched.submit(req)
            done = h.wait()
        assert seen == list(range(1, done.n + 1)) and h.widest == 2  # every step checked, both rows in each
        for other in alone:
            n = min(len(other), done.n)
            assert not np.array_equal(done.generated[:n], other[:n]), mode
        assert all(m.cache is None for m in done.members)  # every member's slot came back


@pytest.mark.slow
def test_a_plain_request_beside_a_blend_keeps_its_codes(tts, voices):
    a, b = voices
    plain_opts = dataclasses.replace(SAMPLED, seed=11)
    plain_alone = rows_of(tts, None, plain_opts, "A plain request in the same batch.").generated
    blend_alone = rows_of(tts, Blend.make([a, b], [0.6, 0.4])).generated
    with tts.scheduler(3, 1024) as sched:
        hp = sched.submit(tts.request("A plain request in the same batch.", options=plain_opts, slot=1024))
        hb = sched.submit(tts.request(TEXT, voice=Blend.make([a, b], [0.6, 0.4]), options=SAMPLED, slot=1024))
        plain, blend = hp.wait(), hb.wait()
        assert sched.pool.in_use == 0 and sched.stats()["rows"] >= 3 * min(plain.n, blend.n)
    assert max(hp.widest, hb.widest) == 3  # one decoder call held the plain row and both blend rows
    assert np.array_equal(plain.generated, plain_alone)
    assert np.array_equal(blend.generated, blend_alone)


@pytest.mark.slow
def test_a_blend_waits_for_a_slot_per_voice(tts, voices):
    a, b = voices
    with tts.scheduler(2, 1024) as sched:
        with pytest.raises(ValueError, match="needs 3 batch slots, but this scheduler has 2"):
            sched.submit(tts.request(TEXT, voice=Blend.make([a, b, None]), options=SAMPLED, slot=1024))
        hp = sched.submit(tts.request("Short.", options=SAMPLED, slot=1024))
        hb = sched.submit(tts.request(TEXT, voice=Blend.make([a, b]), options=SAMPLED, slot=1024))
        sched.step()  # the plain request took a slot: one left, the blend needs two
        assert hp.state == "running" and hb.state == "waiting"
        hp.wait()
        hb.wait()
        assert hb.widest == 2 and sched.pool.in_use == 0
    with pytest.raises(ValueError, match="cannot keep or continue"):
        with tts.scheduler(2, 1024) as sched:
            sched.submit(tts.request(TEXT, voice=Blend.make([a, b]), options=SAMPLED, slot=1024), keep=True)


@pytest.mark.slow
def test_a_blend_streams_retries_and_refuses_what_it_cannot_do(tts, voices):
    a, b = voices
    blend = Blend.make([a, b], [0.5, 0.5])
    speech = tts.generate(TEXT, voice=blend, options=SAMPLED, retries=1)
    chunks = list(tts.stream(TEXT, voice=blend, options=SAMPLED))
    assert np.array_equal(chunks[-1].rows, speech.rows)  # streamed or whole: the same rows
    assert np.allclose(np.concatenate([c.samples for c in chunks]), speech.waveform, atol=1e-4)
    req = tts.request(TEXT, voice=blend, options=SAMPLED)
    again = req.redraw(dataclasses.replace(SAMPLED, seed=99))  # a retried take: every voice drawn again
    assert isinstance(again, BlendRequest) and again.width == 2 and again.weights == req.weights
    assert again.options.seed == 99 and again.watch is not None and again.followers[0].watch is None
    with pytest.raises(ValueError, match="takes > 1 is not supported with a blend of voices"):
        best_of(tts, TEXT, 2, voice=blend, options=SAMPLED)
    with pytest.raises(ValueError, match="cannot continue earlier speech"):
        tts.request(TEXT, voice=blend, options=SAMPLED, history=[("Before.", a.rows[:10])])


@pytest.mark.slow
def test_cli_blend_of_saved_voices(tmp_path, capsys, builds, tts, voices):
    for name, v in zip(("alice", "bob"), voices, strict=True):
        v.save(tmp_path / f"{name}.npz")
    base = ["--model-path", str(builds["fp32"]), "--no-verify", "--text", TEXT, "--seed", "3", "--max-rows", "150",
            "--retries", "0"]

    def codes(name: str, *voice: str) -> np.ndarray:
        assert inference.main([*base, *voice, "--out", str(tmp_path / f"{name}.wav"),
                               "--save-codes", str(tmp_path / f"{name}.npy")]) == 0
        return np.load(tmp_path / f"{name}.npy")

    alice = codes("alice", "--voice", str(tmp_path / "alice.npz"))
    assert np.array_equal(codes("a10", "--voice", "alice:1,bob:0", "--voices", str(tmp_path)), alice)
    out = capsys.readouterr().out
    assert "voice: a blend of alice 1.00, bob 0.00 (mixture; one batch row per voice)" in out, out
    even = codes("even", "--voice", f"{tmp_path}/alice.npz,{tmp_path}/bob.npz")
    assert not np.array_equal(even[:len(alice)], alice[:len(even)])
    (tmp_path / "lines.txt").write_text("First line.\nSecond line.\n")  # --out-dir: the lines batched, 2 rows each
    assert inference.main([*base[:3], "--text-file", str(tmp_path / "lines.txt"), "--out-dir", str(tmp_path / "d"),
                           "--voice", "alice:0.7,bob:0.3", "--voices", str(tmp_path), "--lanes", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["0001.wav", "0002.wav"]


# -- the server ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(builds, tmp_path_factory, voices):
    from servers import served

    tmp = tmp_path_factory.mktemp("blend-server")
    (tmp / "voices").mkdir()
    for name, v in zip(("alice", "bob"), voices, strict=True):
        v.save(tmp / "voices" / f"{name}.npz")
    with served(builds["fp32"], tmp) as s:
        yield s


@pytest.mark.slow
def test_server_blends(server):
    import asyncio
    import base64

    from servers import assert_error
    from ws_clients import events, session

    base = {"model": "higgs-tts-3", "input": TEXT, "response_format": "pcm", "seed": 3, "max_rows": 150,
            "deterministic": True}

    def say(**body):
        r = server.http.post("/v1/audio/speech", json={**base, **body})
        assert r.status_code == 200, r.text
        return r.content

    alice = say(voice="alice")
    assert say(voice="alice:1,bob:0") == alice  # to the bit, through the server too
    even = say(voice="alice:0.5,bob:0.5")
    assert even != alice and even != say(voice="bob")
    assert say(voice=[{"voice": "alice", "weight": 0.5}, {"voice": "bob", "weight": 0.5}]) == even
    assert say(voice="alice,bob") == even  # no weights: equal
    product = say(voice="alice,bob", blend_mode="product")
    assert product != even
    client = server.client()  # the official client passes the string as it is
    made = client.audio.speech.create(model="higgs-tts-3", voice="alice:0.5,bob:0.5", input=TEXT,
                                      response_format="pcm", extra_body={"seed": 3, "max_rows": 150,
                                                                         "deterministic": True})
    assert made.content == even
    clip = {"data": base64.b64encode((DATA / "ref_en_24k.wav").read_bytes()).decode(),
            "text": (DATA / "ref_en_24k.txt").read_text().strip()}
    other = {"data": base64.b64encode((DATA / "ref_de_22k_stereo.wav").read_bytes()).decode(),
             "text": (DATA / "ref_de_22k_stereo.txt").read_text().strip()}
    assert say(references=[{**clip, "weight": 1}, {**other, "weight": 0}]) == alice  # the same clips inline
    assert say(references=[clip, other]) == even
    post = lambda **body: server.http.post("/v1/audio/speech", json={**base, **body})  # noqa: E731
    for body, param, code in (({"voice": "alice:-1,bob:1"}, "voice", "invalid_value"),
                              ({"voice": "alice:0,bob:0"}, "voice", "invalid_value"),
                              ({"voice": "alice:x,bob:1"}, "voice", "invalid_value"),
                              ({"voice": "alice:0.5,bob"}, "voice", "invalid_value"),
                              ({"voice": [{"voice": "alice", "weight": "0.5"}]}, "voice", "invalid_value"),
                              ({"voice": []}, "voice", "invalid_value"),
                              ({"voice": "alice,nobody"}, "voice", "voice_not_found"),
                              ({"voice": "alice,bob,default,alloy,x1"}, "voice", "voice_not_found"),
                              ({"voice": "alice,bob", "blend_mode": "average"}, "blend_mode", "invalid_value"),
                              ({"voice": "alice", "blend_mode": "product"}, "blend_mode", "invalid_value"),
                              ({"references": [{**clip, "weight": -1}, other]}, "references", "invalid_value"),
                              ({"references": [{**clip, "weight": "1"}, other]}, "references", "invalid_value"),
                              ({"references": [{**clip, "weight": 1}, other]}, "references", "invalid_value")):
        assert_error(post(**body), 400, param, code)
    r = post(voice="alice,bob", retries=1, deterministic=False)  # each take a blended job; judged whole, then sent
    assert r.status_code == 200 and len(r.content) > 0 and "X-Takes" in r.headers, r.text
    assert_error(post(voice="alice,bob", takes=2), 400, "takes", "unsupported_parameter")  # one rule, every door
    got = asyncio.run(session(server, {"voice": "alice:0.5,bob:0.5", "response_format": "pcm"}, []))
    assert [(e["code"], e["param"]) for e in events(got, "error")] == [("unsupported_parameter", "voice")], got
    wide = post(voice=",".join(["alice", "bob", "default", "alloy", "echo"]))  # 5 rows, --max-batch 4
    err = assert_error(wide, 400, "voice")
    assert "needs 5 batch slots" in err["message"] and "--max-batch" in err["message"]
    assert server.settle()["slots_in_use"] == 0
