"""optimize.py on the tiny checkpoint: six verified parts + manifest, skip/force/components, atomicity, copies."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

import optimize as optimize_cli
from higgs_onnx.export import Exporter, ExportOptions
from higgs_onnx.manifest import DIGEST, PART_NAMES, ManifestError, load_manifest, safe_member
from higgs_onnx.parity import check_part

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def optimize(*args, **kw):
    env = {**os.environ, "CI": "1"}
    return subprocess.run([sys.executable, str(ROOT / "optimize.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, **kw)


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_every_part_and_manifest(builds, precision):
    m = load_manifest(builds[precision], verify=True)
    assert m.data["schema_version"] == 1 and m.data["execution_provider"] == "CPUExecutionProvider"
    # the step graph, derived at assembly; an int4 build also its int8 GEMM twin (the route)
    assert set(m.parts) == {*PART_NAMES, "llm_step", *(("llm_route",) if precision == "int4" else ())}
    expected = {"int4": {"llm_decoder": "int4", "text_embed": "fp16", "audio_embed": "fp16", "audio_heads": "fp32",
                         "audio_encoder": "int8", "audio_tokenizer": "fp32", "audio_tokenizer_stream": "fp32",
                         "llm_step": "int4", "llm_route": "int8"},
                "fp32": dict.fromkeys((*PART_NAMES, "llm_step"), "fp32")}[precision]
    assert {p: e["precision"] for p, e in m.parts.items()} == expected
    assert m.parts["audio_heads"]["parity"]["argmax_agreement"] >= 0.99  # voice-critical: above int4 by default
    for part, e in m.parts.items():
        assert e["parity"]["ok"], (part, e["parity"])
        assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in e["files"].values())
        assert e["inputs"] and e["outputs"]
    model = m.model
    assert (model["hidden"], model["num_codebooks"], model["boc"], model["eoc"], model["hop"]) == (64, 8, 1024, 1025,
                                                                                                  960)
    assert m.data["tokens"]["control_tags"]["<|emotion:elation|>"] > 0 and m.data["tools"]["onnxruntime"]
    names = {p.name for p in builds[precision].iterdir()}
    assert {"manifest.json", "genai_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    dec_inputs = {i["name"] for i in m.parts["llm_decoder"]["inputs"]}
    assert {"inputs_embeds", "attention_mask", "past_key_values.0.key"} <= dec_inputs


def test_int4_graph_ops(builds):
    m = load_manifest(builds["int4"], verify=False)
    dec = onnx.load(str(m.part_file("llm_decoder")), load_external_data=False)
    nbits = [n for n in dec.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 5 * 2 and not [n for n in dec.graph.node if n.op_type == "MatMul"]
    block = m.parts["llm_decoder"]["int4_layout"]["block_size"]  # chosen by its gate (test_int4_layout.py)
    assert all({a.name: a.i for a in n.attribute}["block_size"] == block for n in nbits)
    assert "MatMulNBits" not in m.parts["audio_heads"]["ops"] and "MatMul" in m.parts["audio_heads"]["ops"]


def test_audio_parts_at_int4_and_int8_on_request(tiny_ckpt, tmp_path):
    """`--part-precision` still gives the old int4 head, or 8-bit weights."""
    # an fp32 cache: the int8 cache's calibration and gates at assembly are not what this test is about
    opts = ExportOptions("cpu", "int4", part_precision={"audio_heads": "int4", "audio_embed": "int8"},
                         kv_cache="fp32")
    m = load_manifest(Exporter(str(tiny_ckpt), tmp_path, opts).run(), verify=False)
    heads, embed = m.parts["audio_heads"], m.parts["audio_embed"]
    assert heads["precision"] == "int4" and "MatMulNBits" in heads["ops"]
    assert heads["parity"]["ok"] and "min_argmax_agreement" not in heads["parity"]  # int4 is reported, not gated
    assert embed["precision"] == "int8" and "GatherBlockQuantized" in embed["ops"] and embed["parity"]["ok"]
    graph = onnx.load(str(m.part_file("audio_embed")), load_external_data=False).graph
    assert {a.name: a.i for n in graph.node if n.op_type == "GatherBlockQuantized" for a in n.attribute}["bits"] == 8


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_every_part_against_the_reference(builds, reference, precision):
    """Independent of the build's own check: other seeds, run from the finished folder."""
    m = load_manifest(builds[precision], verify=False)
    for part, e in m.parts.items():
        fig = check_part(part, m.part_file(part), reference, e["precision"], seed=11)
        assert fig["ok"], (part, fig)
        if e["precision"] == "fp32" and part != "audio_encoder":
            assert fig["max_abs"] <= 1e-4 * max(1.0, fig["ref_max_abs"])
    dec = check_part("llm_decoder", m.part_file("llm_decoder"), reference, precision, seed=12)
    assert dec["cosine"] > (0.99999 if precision == "fp32" else 0.98)


def test_second_run_skips_and_force_rebuilds(builds, tiny_ckpt, out_root, capsys):
    """A second run of int4 (its int8 cache's policy included) does nothing; --components and --force rebuild, on
    fp32 (the same skip logic without the int8 cache's calibration and gates at every assembly)."""
    manifest = builds["int4"] / "manifest.json"
    before = manifest.stat().st_mtime_ns
    Exporter(str(tiny_ckpt), out_root, ExportOptions("cpu", "int4")).run()
    assert "up to date" in capsys.readouterr().out and manifest.stat().st_mtime_ns == before
    manifest = builds["fp32"] / "manifest.json"
    before = manifest.stat().st_mtime_ns
    Exporter(str(tiny_ckpt), out_root, ExportOptions("cpu", "fp32", components=("audio_heads",))).run()
    out = capsys.readouterr().out
    assert out.count("built and checked:") == 1 and "audio_heads" in out and manifest.stat().st_mtime_ns != before
    Exporter(str(tiny_ckpt), out_root, ExportOptions("cpu", "fp32", force=True)).run()
    out = capsys.readouterr().out
    # every step says what it holds
    assert out.count("built and checked:") == len(PART_NAMES) and out.count("[RSS ") >= 2 * len(PART_NAMES)
    assert "peak RSS" in out
    load_manifest(builds["fp32"], verify=True)


def test_a_part_cache_is_shared_by_other_output_roots(builds, tiny_ckpt, part_cache, tmp_path, capsys):
    """`--part-cache DIR` (here the session's, `$HIGGS_PART_CACHE`): an export under another output root takes every
    finished part from it (nothing is built), and is a complete folder of its own; without the cache (the folder's
    own `.build/parts`) a part is built."""
    code = optimize_cli.main(["--model-dir", str(tiny_ckpt), "--device", "cpu", "--precision", "int4",
                          "--output", str(tmp_path / "a"), "--part-cache", str(part_cache)])
    out = capsys.readouterr().out
    assert code == 0 and "built and checked" not in out and out.count("up to date:") == len(PART_NAMES), out
    assert not (tmp_path / "a" / ".build" / "parts").exists()
    m = load_manifest(tmp_path / "a" / "cpu_int4", verify=True)
    theirs = load_manifest(builds["int4"], verify=False).parts
    assert [m.parts[p]["stamp"] for p in PART_NAMES] == [theirs[p]["stamp"] for p in PART_NAMES]
    opts = ExportOptions("cpu", "fp32", components=("audio_heads",))
    Exporter(str(tiny_ckpt), tmp_path / "b", opts, part_cache=tmp_path / "own").run()
    assert "built and checked" in capsys.readouterr().out and any((tmp_path / "own").glob("audio_heads-*"))


def test_copied_folder_still_loads(builds, tmp_path, reference):
    copy = shutil.copytree(builds["int4"], tmp_path / "elsewhere" / "model")
    shutil.move(str(builds["int4"]), str(tmp_path / "moved_away"))  # nothing may point back to the build
    try:
        m = load_manifest(copy, verify=True)
        for part, e in m.parts.items():
            assert check_part(part, m.part_file(part), reference, e["precision"])["ok"]
    finally:
        shutil.move(str(tmp_path / "moved_away"), str(builds["int4"]))


# The kill points whose behaviour differs: SIGKILL while a part builds (the decoder: ModelBuilder, the extraction
# and the part cache's scratch folder; another part killed mid-build leaves the same kind of scratch folder, so
# "part 3/7" was dropped), Ctrl-C while a part builds (the one-line "interrupted", no traceback), and SIGKILL while
# the folder is assembled (the swap of the whole folder). `--components PART` rebuilds just the part the kill is
# about (the others come from the part cache, as with the --force of the full rebuild this replaced): the killed
# step is reached in seconds instead of after every part before it.
@pytest.mark.parametrize("step, sig, part", [("part 1/7", signal.SIGKILL, "llm_decoder"),
                                             ("part 5/7", signal.SIGINT, "audio_encoder"),
                                             ("[3/4] assembling", signal.SIGKILL, "audio_heads")])
def test_kill_midway_keeps_the_previous_build(builds, tiny_ckpt, out_root, step, sig, part):
    manifest = (builds["fp32"] / "manifest.json").read_text()
    proc = subprocess.Popen([sys.executable, str(ROOT / "optimize.py"), "--model-dir", str(tiny_ckpt), "--device",
                             "cpu", "--precision", "fp32", "--output", str(out_root), "--components", part],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "CI": "1"})
    seen = ""
    for line in proc.stdout:  # kill (or Ctrl-C) it while it works on `step`
        seen += line
        if step in line:
            time.sleep(0.3)
            proc.send_signal(sig)
            break
    seen += proc.communicate(timeout=120)[0]
    assert step in seen and proc.returncode in (-sig, 130, 0), seen[-2000:]  # 0: it finished before the signal
    if sig == signal.SIGINT:
        assert "interrupted" in seen and "Traceback" not in seen
    visible = [p for p in out_root.iterdir() if not p.name.startswith(".") and p.is_dir()]
    assert all((p / "manifest.json").is_file() for p in visible)  # no half-built folder in sight
    load_manifest(builds["fp32"], verify=True)  # the folder is always complete: the old one, or a finished new one
    if "[3/4]" not in step:
        assert (builds["fp32"] / "manifest.json").read_text() == manifest
    done = optimize("--model-dir", str(tiny_ckpt), "--device", "cpu", "--precision", "fp32",
                    "--output", str(out_root), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "up to date" in done.stdout  # parts 1-2 and the rest: finished ones are reused
    load_manifest(builds["fp32"], verify=True)


@pytest.mark.parametrize("device, precision", [("cuda", "fp16"), ("dml", "int4")])
def test_gpu_graphs_build_here(builds, tiny_ckpt, out_root, device, precision):
    folder = Exporter(str(tiny_ckpt), out_root, ExportOptions(device, precision)).run()
    m = load_manifest(folder, verify=True)
    assert m.data["device"] == device
    assert m.data["execution_provider"] == {"cuda": "CUDAExecutionProvider", "dml": "DmlExecutionProvider"}[device]
    assert m.parts["llm_decoder"]["parity"] == {"skipped": f"{device} graph (built, not run here)"}
    assert m.decoder == {"attention": "gqa", "cache": "shared-buffer", "format": "onnx", "kv_cache": {"dtype": "fp32"},
                         "route": {"kind": "none"}}
    assert m.parts["llm_decoder"]["precision"] == precision
    heads = m.parts["audio_heads"]  # voice-critical: fp32 in an int4 build, fp16 in an fp16 one
    assert heads["precision"] == {"int4": "fp32", "fp16": "fp16"}[precision] and heads["parity"]["ok"]


def test_invalid_combination_is_refused_up_front(tmp_path):
    r = optimize("--synthetic", "tiny", "--device", "cpu", "--precision", "fp16", "--output", str(tmp_path))
    assert r.returncode == 2 and "gqa: int4, fp32" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "cpu_fp16").exists()
    r = optimize("--synthetic", "tiny", "--part-precision", "audio_encoder=int4", "--output", str(tmp_path))
    assert r.returncode == 2 and "audio_encoder cannot be built at int4" in r.stderr


def test_streaming_quantizer_equals_the_stock_int4(tiny_ckpt, tmp_path):
    from onnx import numpy_helper

    from higgs_onnx.checkpoint import extract_qwen3
    from higgs_onnx.parts.llm_decoder import FILE
    from higgs_onnx.parts.llm_decoder import build_from_qwen3 as build

    qwen3 = extract_qwen3(tiny_ckpt, tmp_path / "qwen3")
    build(qwen3, tmp_path / "stream", "int4", "cpu", tmp_path / "w1")
    build(qwen3, tmp_path / "stock", "int4", "cpu", tmp_path / "w2", streaming=False)
    a, b = (onnx.load(str(tmp_path / d / FILE)) for d in ("stream", "stock"))
    ia = {t.name: numpy_helper.to_array(t) for t in a.graph.initializer}
    ib = {t.name: numpy_helper.to_array(t) for t in b.graph.initializer}
    assert ia.keys() == ib.keys() and sum(k.endswith("_Q4") for k in ia) == 10
    for k in ia:
        np.testing.assert_array_equal(ia[k], ib[k], err_msg=k)
    assert [(n.op_type, list(n.input), list(n.attribute)) for n in a.graph.node] == \
           [(n.op_type, list(n.input), list(n.attribute)) for n in b.graph.node]


def test_manifest_entries_must_stay_inside_the_folder(tmp_path):
    (tmp_path / "ok.onnx").write_bytes(b"x")
    assert safe_member(tmp_path, "ok.onnx") == tmp_path / "ok.onnx"
    for bad in ("../evil.onnx", "/etc/passwd", "sub/dir.onnx", ".."):
        with pytest.raises(ManifestError, match="plain file name"):
            safe_member(tmp_path, bad)
    outside = tmp_path.parent / "outside.onnx"
    outside.write_bytes(b"x")
    (tmp_path / "link.onnx").symlink_to(outside)
    with pytest.raises(ManifestError, match="outside"):
        safe_member(tmp_path, "link.onnx")


def test_tampered_files_are_caught(builds, tmp_path):
    copy = shutil.copytree(builds["int4"], tmp_path / "m")
    m = json.loads((copy / "manifest.json").read_text())
    target = copy / m["parts"]["audio_heads"]["file"]
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="sha256"):
        load_manifest(copy, verify=True)
    load_manifest(copy, verify=False)  # --no-verify skips hashing (sizes still checked)
    target.write_bytes(bytes(data[:-10]))
    with pytest.raises(ManifestError, match="truncated"):
        load_manifest(copy, verify=False)


def test_an_export_without_the_optional_stream_codec_still_loads_and_streams(builds, tmp_path):
    """Folders built before `audio_tokenizer_stream` existed: the manifest still loads, streaming falls back to
    overlapping windows, and asking for the stateful codec is a clear error."""
    from higgs_onnx.generation.codec_stream import CodecStream, StreamOptions
    from higgs_onnx.runtime.model import HiggsTTS

    old = tmp_path / "old"
    shutil.copytree(builds["int4"], old, symlinks=True)
    mf = old / "manifest.json"
    data = json.loads(mf.read_text())
    for name in data["parts"].pop("audio_tokenizer_stream")["files"]:
        (old / name).unlink()
    data.pop(DIGEST)  # such folders also predate the manifest's own digest
    mf.write_text(json.dumps(data))
    tts = HiggsTTS(old)
    assert not tts.has_stateful_codec and isinstance(tts.codec_stream(StreamOptions()), CodecStream)
    audio = np.concatenate([c.samples for c in tts.stream("Old folders stream too.", temperature=0)])
    want = tts.generate("Old folders stream too.", temperature=0).waveform
    assert audio.shape == want.shape and np.abs(audio - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(ValueError, match="no audio_tokenizer_stream part"):
        tts.stream("x", stream_options=StreamOptions(codec="stateful"))
