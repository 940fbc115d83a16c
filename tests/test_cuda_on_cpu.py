"""A cuda export on the CPU provider: the fused q/k norms split out of GroupQueryAttention (runtime/cpu_graph.py),
checked against the fused op's semantics and against the cpu fp32 export of the same checkpoint; the rewrite cached
in the user's cache, the original folder untouched; the whole pipeline speaks; the default provider's one warning."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from higgs_onnx.runtime import cpu_graph, cpu_graph_check
from higgs_onnx.runtime.cpu_graph import cpu_ready, is_fused, link_data
from higgs_onnx.runtime.cpu_graph_check import self_check

DATA = Path(__file__).resolve().parent / "data"
REF_DE = DATA / "ref_de_22k_stereo.wav"
CPU = "CPUExecutionProvider"
# hidden-state cosine of the rewritten cuda decoder on the CPU vs the cpu fp32 export (toolchain §2.5: fp16 keeps
# ~0.9999, int4 on random weights > 0.98)
COSINE = {"fp16": 0.999, "int4": 0.98}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HIGGS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / cpu_graph.CACHE_KIND


def fused_node(packed: bool, interleaved: int = 0, softcap: float = 0.0) -> onnx.NodeProto:
    """A fused GroupQueryAttention node of 4 query and 2 KV heads (its inputs named as `_mini_graph` expects)."""
    qkv = ["qkv", "", ""] if packed else ["query", "key", "value"]
    ins = qkv + ["past_key", "past_value", "seqlens_k", "total", "cos", "sin", "", "", "", "", "", "q_w", "k_w"]
    return helper.make_node("GroupQueryAttention", ins, ["out", "present_key", "present_value"], "gqa",
                            domain="com.microsoft", num_heads=4, kv_num_heads=2, do_rotary=1, scale=0.25,
                            rotary_interleaved=interleaved, softcap=softcap, qk_norm_epsilon=1e-6)


def norm_graph(dtype, head_dim: int = 16) -> onnx.GraphProto:
    """A graph that holds only the norm weights the check reads (their type and size)."""
    w = np.ones(head_dim, dtype)
    return helper.make_graph([], "g", [], [], [numpy_helper.from_array(w, "q_w"), numpy_helper.from_array(w, "k_w")])


@pytest.mark.parametrize("packed", [False, True], ids=["q-k-v", "packed-qkv"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("interleaved, softcap", [(0, 0.0), (1, 5.0)], ids=["plain", "interleaved-softcap"])
def test_the_split_norm_computes_what_the_fused_op_does(packed, dtype, interleaved, softcap):
    err = self_check(norm_graph(dtype), fused_node(packed, interleaved, softcap), cpu_graph.unfuse)
    assert err <= cpu_graph_check.TOLERANCE[np.dtype(dtype)]


def test_the_check_fails_a_rewrite_that_drops_the_norm():
    def drop_norm(model, fused):  # the norm inputs removed, nothing put in their place
        for i in fused:
            del model.graph.node[i].input[cpu_graph.Q_NORM:]

    with pytest.raises(RuntimeError, match="does not match the op's semantics"):
        self_check(norm_graph(np.float16), fused_node(False), drop_norm)


def save_graph(folder: Path, node: onnx.NodeProto, dtype=np.float16, extra: list | None = None) -> Path:
    """`node` as a model in `folder` (model.onnx + its weights in model.onnx.data): inputs qkv/query/key/value and
    an empty past, the norm weights and caches as external initializers."""
    inputs, model = cpu_graph_check._mini_graph(node, cpu_graph.attrs_of(node), np.dtype(dtype), 16)
    model.graph.node.extend(extra or [])
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx", save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    np.savez(folder / "feeds.npz", **{k: v for k, v in inputs.items() if v is not None})
    return folder / "model.onnx"


def tree_state(folder: Path) -> dict:
    """Each file's sha256 and the folder's own mtime (a file made, renamed or removed there changes it)."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}
    return {"files": files, "mtime": folder.stat().st_mtime_ns}


def readonly(folder: Path, on: bool) -> None:
    for p in [*folder.iterdir(), folder]:
        mode = p.stat().st_mode
        p.chmod(mode & ~0o222 if on else mode | stat.S_IWUSR)


def test_a_fused_graph_is_rewritten_once_into_the_cache(tmp_path, cache):
    src = save_graph(tmp_path / "folder", fused_node(False))
    before = tree_state(src.parent)
    readonly(src.parent, True)
    try:
        out = cpu_ready(src)
        files = {p: p.stat().st_mtime_ns for p in out.parent.iterdir()}
        assert cpu_ready(src) == out and {p: p.stat().st_mtime_ns for p in out.parent.iterdir()} == files
    finally:
        readonly(src.parent, False)
    assert tree_state(src.parent) == before
    assert out.parent.parent == cache and sorted(p.name for p in out.parent.iterdir()) == [
        cpu_graph.STAMP, "model.onnx", "model.onnx.data"]
    assert os.path.samefile(out.parent / "model.onnx.data", src.parent / "model.onnx.data")  # linked, not copied
    rewritten = onnx.load(out, load_external_data=False)
    assert not any(is_fused(n) for n in rewritten.graph.node)
    assert [n.op_type for n in rewritten.graph.node].count("SimplifiedLayerNormalization") == 2
    feeds = dict(np.load(src.parent / "feeds.npz"))
    fused = ort.InferenceSession(str(src), providers=[CPU])
    with pytest.raises(Exception, match="q_norm_weight / k_norm_weight inputs are not supported"):
        fused.run(None, {i.name: feeds[i.name] for i in fused.get_inputs()})  # what the rewrite is for
    sess = ort.InferenceSession(str(out), providers=[CPU])
    got = sess.run(["out"], {i.name: feeds[i.name] for i in sess.get_inputs()})[0]
    want = cpu_graph_check.reference(feeds, cpu_graph.attrs_of(fused_node(False)), 16)["out"]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2


def test_a_changed_data_file_gets_a_new_rewrite(tmp_path, cache):
    src = save_graph(tmp_path / "folder", fused_node(True))
    first = cpu_ready(src)
    data = src.parent / "model.onnx.data"
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
    assert cpu_ready(src) != first


def entry_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_damaged_entry_is_rebuilt_with_one_warning(tmp_path, cache, caplog):
    """A truncated cached graph, a data link replaced by a short file, a copy made by someone else, a lost stamp:
    each is found by the entry's stamp and rebuilt (one warning line), and the rebuilt graph runs."""
    src = save_graph(tmp_path / "folder", fused_node(False))
    out = cpu_ready(src)
    sound, data = out.read_bytes(), out.parent / "model.onnx.data"
    feeds = dict(np.load(src.parent / "feeds.npz"))

    def damage_and_rerun(damage, says: str) -> None:
        damage()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=cpu_graph.__name__):
            assert cpu_ready(src) == out
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "is damaged" in said[0] and says in said[0] and "rebuilding it" in said[0], said
        assert "\n" not in said[0] and out.read_bytes() == sound and os.path.samefile(data, src.parent / data.name)
        assert entry_files(out.parent) == [cpu_graph.STAMP, "model.onnx", "model.onnx.data"]
        sess = ort.InferenceSession(str(out), providers=[CPU])
        assert np.isfinite(sess.run(["out"], {i.name: feeds[i.name] for i in sess.get_inputs()})[0]).all()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=cpu_graph.__name__):
            assert cpu_ready(src) == out and not caplog.records  # sound again: reused silently

    def truncate():
        with open(out, "r+b") as f:
            f.truncate(100)

    def short_data():
        data.unlink()
        data.write_bytes(b"\0" * 100)

    def same_size_copy():
        data.unlink()
        data.write_bytes((src.parent / "model.onnx.data").read_bytes())

    damage_and_rerun(truncate, "model.onnx is 100 bytes and does not match its sha256")
    damage_and_rerun(short_data, "model.onnx.data is 100 bytes")
    damage_and_rerun(same_size_copy, "model.onnx.data is no longer a link to")
    damage_and_rerun(lambda: (out.parent / cpu_graph.STAMP).unlink(), "no stamp")
    damage_and_rerun(lambda: (out.parent / cpu_graph.STAMP).write_text("{"), "unreadable")


def test_relinking_the_same_file_leaves_no_temp_file(tmp_path, cache):
    """The cached graph removed and rebuilt: its data file is already the original's hard link, so nothing is
    renamed onto it (a rename of one link of a file onto another does nothing and would leave the temp name)."""
    src = save_graph(tmp_path / "folder", fused_node(True))
    out = cpu_ready(src)
    for _ in range(2):
        out.unlink()
        assert cpu_ready(src) == out
        assert entry_files(out.parent) == [cpu_graph.STAMP, "model.onnx", "model.onnx.data"]
    data = out.parent / "model.onnx.data"
    assert link_data(src.parent / "model.onnx.data", data) == "hard"  # called directly as well
    assert os.path.samefile(data, src.parent / "model.onnx.data")
    assert entry_files(out.parent) == [cpu_graph.STAMP, "model.onnx", "model.onnx.data"]


def test_an_unwritable_cache_is_one_line(tmp_path, monkeypatch):
    """$HIGGS_CACHE naming a file, or a folder that cannot be made: CacheError (a ValueError), one line naming the
    cache, $HIGGS_CACHE and the fix; nothing written beside the original."""
    from higgs_onnx.user_cache import CacheError

    src = save_graph(tmp_path / "folder", fused_node(False))
    before = tree_state(src.parent)
    (tmp_path / "file").write_text("x")
    for root, says in ((tmp_path / "file", f"{tmp_path / 'file'} is not a folder"),
                       (Path("/proc/higgs-cache"), "no such file or directory: /proc/higgs-cache")):
        monkeypatch.setenv("HIGGS_CACHE", str(root))
        with pytest.raises(CacheError) as e:
            cpu_ready(src)
        assert str(e.value) == (f"higgs-onnx's cache {root} ($HIGGS_CACHE) cannot be written: {says}; set "
                                f"$HIGGS_CACHE to a folder you can write (e.g. HIGGS_CACHE=/tmp/higgs-cache)")
    assert tree_state(src.parent) == before


def test_weights_are_hard_linked_or_copied_never_symlinked(tmp_path):
    """ONNX Runtime reads a rewrite's weights through a hard link or a copy alike, and refuses a symlink out of the
    graph's folder (why `link_data` never makes one)."""
    src = save_graph(tmp_path / "folder", fused_node(False))
    feeds = dict(np.load(src.parent / "feeds.npz"))
    model = onnx.load(src, load_external_data=False)
    cpu_graph.unfuse(model, [0])
    runs = {}
    for mode in ("hard", "copy", "symlink"):
        folder = tmp_path / mode
        folder.mkdir()
        (folder / "model.onnx").write_bytes(model.SerializeToString())
        if mode == "symlink":
            (folder / "model.onnx.data").symlink_to(src.parent / "model.onnx.data")
            with pytest.raises(Exception, match="External data path escapes model directory"):
                ort.InferenceSession(str(folder / "model.onnx"), providers=[CPU])
            continue
        assert link_data(src.parent / "model.onnx.data", folder / "model.onnx.data", (mode,)) == mode
        assert os.path.samefile(folder / "model.onnx.data", src.parent / "model.onnx.data") == (mode == "hard")
        sess = ort.InferenceSession(str(folder / "model.onnx"), providers=[CPU])
        runs[mode] = sess.run(["out"], {i.name: feeds[i.name] for i in sess.get_inputs()})[0]
    np.testing.assert_array_equal(runs["copy"], runs["hard"])


def test_an_unfused_graph_is_returned_as_it_is(tmp_path, cache):
    node = fused_node(False)
    del node.input[cpu_graph.Q_NORM:]
    src = save_graph(tmp_path / "folder", node)
    assert cpu_ready(src) == src
    assert not cache.exists() or not any(cache.iterdir())


def test_an_op_without_a_cpu_kernel_is_refused_in_one_line(tmp_path, cache):
    fake = helper.make_node("FakeAttention", ["out"], ["faked"], "my_fake_node", domain="com.microsoft")
    src = save_graph(tmp_path / "folder", fused_node(False), extra=[fake])
    with pytest.raises(ValueError, match=r"node my_fake_node \(com.microsoft.FakeAttention\) has no CPU kernel") as e:
        cpu_ready(src)
    assert "\n" not in str(e.value) and "--provider cpu" in str(e.value)


# -- the tiny cuda exports on the CPU provider ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def user_cache(tmp_path_factory):
    """The module's user cache ($HIGGS_CACHE): where the rewrites of the cuda exports' graphs go."""
    path, old = tmp_path_factory.mktemp("higgs-cache"), os.environ.get("HIGGS_CACHE")
    os.environ["HIGGS_CACHE"] = str(path)
    yield path / cpu_graph.CACHE_KIND
    if old is None:
        os.environ.pop("HIGGS_CACHE")
    else:
        os.environ["HIGGS_CACHE"] = old


@pytest.fixture(scope="module")
def cuda_builds(tiny_ckpt, out_root, user_cache) -> dict[str, Path]:
    """The tiny checkpoint exported for cuda at int4 and fp16 (ModelBuilder `-e cuda`: fused q/k norms, float16
    activations and KV cache), beside the suite's cpu exports (one part cache)."""
    from higgs_onnx.export import Exporter, ExportOptions

    return {p: Exporter(str(tiny_ckpt), out_root, ExportOptions("cuda", p)).run() for p in ("int4", "fp16")}


def decoder_run(path: Path, embeds: np.ndarray, prefill: int) -> list[np.ndarray]:
    """hidden_states (float32) of a prefill of `prefill` rows, then one call per remaining row, on the CPU EP."""
    sess = ort.InferenceSession(str(path), providers=[CPU])
    types = {i.name: {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}.get(i.type)
             for i in sess.get_inputs()}
    head_dim = embeds.shape[-1] // 4  # the tiny model: 4 heads of 16
    kv = {n: np.zeros((1, 2, 0, head_dim), t) for n, t in types.items() if n.startswith("past_key_values")}
    names, out, start = [o.name for o in sess.get_outputs()], [], 0
    for end in [prefill, *range(prefill + 1, embeds.shape[1] + 1)]:
        feeds = {"inputs_embeds": embeds[:, start:end].astype(types["inputs_embeds"]),
                 "attention_mask": np.ones((1, end), np.int64), **kv}
        res = dict(zip(names, sess.run(None, feeds), strict=True))
        kv = {n: res[n.replace("past_key_values", "present")] for n in kv}
        out.append(res["hidden_states"].astype(np.float32))
        start = end
    return out


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int4", "fp16"])
def test_the_rewritten_cuda_decoder_matches_the_cpu_fp32_export(cuda_builds, builds, precision):
    from higgs_onnx.runtime.parts import ModelParts

    original = cuda_builds[precision] / "llm_decoder.onnx"
    rewritten = cpu_ready(original)
    assert rewritten != original and any(is_fused(n) for n in onnx.load(original, load_external_data=False).graph.node)
    ids = np.random.default_rng(3).integers(0, 1024, (1, 16))
    embeds = ModelParts(builds["fp32"], verify=False).part("text_embed")(input_ids=ids)["embeddings"]
    want = decoder_run(builds["fp32"] / "llm_decoder.onnx", embeds, prefill=12)
    got = decoder_run(rewritten, embeds, prefill=12)
    assert [g.shape for g in got] == [w.shape for w in want] == [(1, 12, 64)] + [(1, 1, 64)] * 4
    cos = [float((g * w).sum() / np.linalg.norm(g) / np.linalg.norm(w)) for g, w in zip(got, want, strict=True)]
    assert min(cos) >= COSINE[precision], cos


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int4", "fp16"])
def test_a_cuda_folder_speaks_on_the_cpu_provider(cuda_builds, user_cache, precision):
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(cuda_builds[precision], provider="cpu", verify=False)
    text = "Hello there, how are you today?"
    speech = tts.generate(text, seed=1)
    assert speech.stop_reason == "eoc" and len(speech.rows) > 20
    assert speech.waveform.dtype == np.float32 and np.isfinite(speech.waveform).all()
    assert len(speech.waveform) == 960 * (len(speech.rows) - 7) and np.abs(speech.waveform).max() > 1e-3
    clone = tts.generate("A new sentence in the same voice.", ref_audio=REF_DE, seed=1)
    assert clone.stop_reason == "eoc" and np.isfinite(clone.waveform).all() and len(clone.waveform) > 0
    chunks = list(tts.stream(text, seed=1))
    assert len(chunks) > 1 and chunks[-1].is_last
    np.testing.assert_array_equal(chunks[-1].rows, speech.rows)  # the same rows, the stateful codec's audio:
    audio = np.concatenate([c.samples for c in chunks])  # within test_streaming's bound of the one-shot codec
    assert audio.shape == speech.waveform.shape
    assert np.abs(audio - speech.waveform).max() <= 2e-4 * np.abs(speech.waveform).max()
    ran = tts.ran_on()
    assert set(ran.values()) == {CPU} and {"audio_encoder", "text_embed", "audio_tokenizer"} <= set(ran)
    decoder = tts.part(tts.backend.decoder_part)
    assert decoder.path.parent.parent == user_cache  # the rewrite, not the folder's fused graph


@pytest.mark.slow
def test_no_provider_and_no_cuda_ep_runs_on_the_cpu_with_one_warning(cuda_builds, monkeypatch, caplog):
    from higgs_onnx.runtime.parts import ModelParts

    monkeypatch.setattr(ort, "get_available_providers", lambda: [CPU])
    with caplog.at_level(logging.WARNING):
        parts = ModelParts(cuda_builds["int4"], verify=False)
        for name in parts.manifest.parts:
            parts.part(name)
    # ours only: a library's background thread (Olive's telemetry exporter, in-process from the builds) once logged
    # an ERROR about a host it could not resolve while this test counted
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("higgs_onnx")]
    assert parts.provider == "cpu" and len(said) == 1, said
    assert "is a cuda export" in said[0] and "float16 activations and KV cache" in said[0]
    assert "optimize.py --device cpu --precision int4" in said[0] and "\n" not in said[0]
    assert f"{cpu_graph.SLOWER['int4']} slower per decode step than a cpu int4 export" in said[0]
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", CPU])
    caplog.clear()
    assert ModelParts(cuda_builds["int4"], verify=False).provider == "cuda"
    assert not [r for r in caplog.records if r.name.startswith("higgs_onnx")]


@pytest.mark.slow
def test_the_rewrite_is_cached_and_the_folder_left_untouched(cuda_builds, user_cache):
    from higgs_onnx.runtime.parts import ModelParts

    folder = cuda_builds["fp16"]
    before = tree_state(folder)

    def open_all() -> dict[str, int]:
        parts = ModelParts(folder, provider="cpu")  # hashes every file (verify)
        for name in parts.manifest.parts:
            parts.part(name)
        return {str(p): p.stat().st_mtime_ns for p in user_cache.rglob("*")}

    readonly(folder, True)  # binds a user; root writes anyway, so the hashes and the folder's mtime are compared too
    try:
        first = open_all()
        assert open_all() == first  # nothing rewritten, nothing added
    finally:
        readonly(folder, False)
    assert tree_state(folder) == before
    graphs = {Path(p).name for p in first if p.endswith(".onnx")}
    assert graphs == {"llm_decoder.onnx", "llm_step.onnx"}  # the parts with GroupQueryAttention; the rest as built


@pytest.mark.slow
def test_provider_cuda_without_its_ep_is_one_line_exit_2(cuda_builds, tmp_path):
    """inference.py --provider cuda where onnxruntime has no CUDA EP: the ProviderError's line, exit 2 (an
    environment error: no "rerun with --log-level DEBUG" tail), no output."""
    import subprocess
    import sys

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA EP: --provider cuda runs")
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "inference.py"), "--model-path",
                        str(cuda_builds["int4"]), "--provider", "cuda", "--text", "Hi.", "--out",
                        str(tmp_path / "o.wav"), "--no-verify"], capture_output=True, text=True, timeout=300)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
    assert lines[0].startswith("error: ") and ": execution provider CUDAExecutionProvider is not available" in lines[0]
    assert "install onnxruntime-gpu" in lines[0] and "--log-level DEBUG" not in lines[0]
    assert not (tmp_path / "o.wav").exists()
