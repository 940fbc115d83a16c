"""Exports in the community's Higgs ONNX layout run as they are (higgs_onnx/foreign.py): folders written from the
tiny checkpoint by tests/community_layout.py, with our fp32 ModelBuilder decoder, and with float16 decoder I/O
(a ModelBuilder cuda build, its Q/K norm apart or fused into the attention node)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
from community_layout import with_standalone_dir, write_community

from higgs_onnx.exports import load_export
from higgs_onnx.foreign import LACKS, is_foreign
from higgs_onnx.manifest import ManifestError
from higgs_onnx.runtime.model import HiggsTTS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
PROMPTS = ("Hello there, how are you today?", "<|emotion:elation|>The quick brown fox jumps over the lazy dog.",
           "Speech synthesis turns written words into sound.")


@pytest.fixture(scope="module")
def community(builds, tiny_ckpt, tmp_path_factory) -> dict[str, Path]:
    """{"fp32", "fp16", "fused"}: read-only folders in the community layout (as a download in the Hub cache is)."""
    root = tmp_path_factory.mktemp("community")
    out = {"fp32": write_community(builds["fp32"], root / "cpu_fp32"),
           "fp16": write_community(builds["fp32"], root / "cuda_fp16", decoder="fp16", ckpt=tiny_ckpt,
                                   work=root / "work16"),
           "fused": write_community(builds["fp32"], root / "cuda_fp16_fused", decoder="fp16", ckpt=tiny_ckpt,
                                    fused_norm=True, work=root / "work16f")}
    for folder in out.values():
        _read_only(folder)
    return out


def _read_only(folder: Path) -> None:
    for p in [*folder.rglob("*"), folder]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in [*dst.rglob("*"), dst]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    return dst


def test_fp32_greedy_codes_equal_our_export(community, tts):
    theirs = HiggsTTS(community["fp32"])
    assert theirs.backend.decoder_part == "llm_decoder" and not theirs.parts.has_stateful_codec
    for text in PROMPTS:
        ours = tts.generate(text, temperature=0, seed=1)
        got = theirs.generate(text, temperature=0, seed=1)
        assert got.codes.shape == ours.codes.shape and got.codes.shape[0] > 20
        np.testing.assert_array_equal(got.codes, ours.codes)
    assert theirs.facts.hop == tts.facts.hop and theirs.tokens == tts.tokens


@pytest.mark.parametrize("kind", ["fp16", "fused"])
def test_fp16_decoder_io_runs_to_the_end(community, kind):
    tts = HiggsTTS(community[kind])
    assert tts.provider == "cpu" and tts.parts.part("llm_decoder").input_types["inputs_embeds"] == np.float16
    speech = tts.generate("Hello there from a float16 decoder.", seed=2)
    assert speech.stats.stop_reason == "eoc" and speech.waveform.size == speech.stats.frames * tts.facts.hop
    assert np.isfinite(speech.waveform).all() and np.abs(speech.waveform).max() > 0
    ref = str(DATA / "ref_en_24k.wav")
    clone = tts.generate("New words in a cloned voice.", ref_audio=ref, ref_text=(DATA / "ref_en_24k.txt").read_text(),
                         seed=3)
    assert clone.stats.reference_rows > 100 and clone.waveform.size > 0
    chunks = list(tts.stream("Streamed while it is made.", seed=4))
    assert len(chunks) >= 1 and sum(len(c.samples) for c in chunks) > 0


def test_fp16_greedy_close_to_fp32(community, tts):
    """The float16 decoder of the same checkpoint picks (nearly) the same greedy codes as our fp32 export."""
    got = HiggsTTS(community["fp16"]).generate(PROMPTS[0], temperature=0, seed=1).codes
    want = tts.generate(PROMPTS[0], temperature=0, seed=1).codes
    n = min(len(got), len(want))
    assert n > 20 and (got[:n] == want[:n]).mean() > 0.9


def test_folder_never_written_and_manifest_cached(community, user_cache, caplog):
    folder = community["fp32"]
    before = _tree(folder)
    HiggsTTS(folder).generate("Nothing is written beside the parts.", seed=5)
    kept = list((user_cache / "adopted").glob("*/manifest.json"))
    assert kept and _tree(folder) == before
    mtimes = {p: p.stat().st_mtime_ns for p in kept}
    with caplog.at_level(logging.INFO, logger="higgs_onnx.foreign"):
        load_export(folder, verify=True)
    assert not [r for r in caplog.records if "derived" in r.getMessage()]  # read back, not derived again
    assert {p: p.stat().st_mtime_ns for p in kept} == mtimes


def test_lacks_said_once_in_one_line(community, tmp_path, caplog):
    folder = _copy(community["fp32"], tmp_path / "once")
    with caplog.at_level(logging.WARNING):
        HiggsTTS(folder)
        HiggsTTS(folder)
    lines = [r.getMessage() for r in caplog.records if "community-layout" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and all(lack in lines[0] for lack in LACKS)


def test_parts_found_by_file_name_and_standalone_dir(community, tts, tmp_path):
    bare = _copy(community["fp32"], tmp_path / "bare")  # a manifest that lists no part: each found by file name
    (bare / "manifest.json").write_text(json.dumps({"device": "cpu", "sub_models": {}}))
    assert is_foreign(bare) and load_export(bare, verify=False).data["layout"] == "community"
    (bare / "manifest.json").unlink()  # no manifest at all: an unfinished export, not adopted
    with pytest.raises(ManifestError, match="has no manifest.json"):
        load_export(bare)
    older = with_standalone_dir(_copy(community["fp32"], tmp_path / "older"))
    got = HiggsTTS(older).generate(PROMPTS[0], temperature=0, seed=1).codes
    np.testing.assert_array_equal(got, tts.generate(PROMPTS[0], temperature=0, seed=1).codes)


def _edit(path: Path, change) -> None:
    model = onnx.load(str(path), load_external_data=False)
    change(model.graph)
    onnx.save(model, str(path))


def test_unmappable_folders_name_the_part_and_io(community, tmp_path):
    def extra_output(g):
        g.output.append(onnx.helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, None))
        g.node.append(onnx.helper.make_node("Identity", [g.output[0].name], ["scores"]))

    def renamed(g):
        g.output[0].name = "probabilities"
        g.output.append(onnx.helper.make_tensor_value_info("other", onnx.TensorProto.FLOAT, None))
        g.node[-1].output[0] = "probabilities"
        g.node.append(onnx.helper.make_node("Identity", ["probabilities"], ["other"]))

    def position_ids(g):
        g.input.append(onnx.helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, ["b", "s"]))

    cases = [("audio_heads.onnx", extra_output, "audio_heads: the graph's outputs ['scores']"),
             ("audio_heads.onnx", renamed, "audio_heads: cannot match output 'logits'"),
             ("llm_decoder.onnx", position_ids, "llm_decoder: the graph's inputs ['position_ids']")]
    for i, (name, change, said) in enumerate(cases):
        folder = _copy(community["fp32"], tmp_path / f"bad{i}")
        _edit(folder / name, change)
        with pytest.raises(ManifestError, match=said.replace("[", r"\[").replace("]", r"\]")):
            load_export(folder, verify=False)
    folder = _copy(community["fp32"], tmp_path / "missing")
    (folder / "audio_heads.onnx").unlink()
    with pytest.raises(ManifestError, match="has no audio_heads part"):
        load_export(folder)


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "CI": "1"})


def test_cli_speaks_streams_clones_and_eval_passes(community, tiny_ckpt, tmp_path):
    folder = community["fused"]
    ref = ["--ref-audio", str(DATA / "ref_en_24k.wav"), "--ref-text", (DATA / "ref_en_24k.txt").read_text()]
    for name, extra in (("plain", []), ("stream", ["--stream"]), ("clone", ref)):
        r = _run("inference.py", "--model-path", str(folder), "--text", "The community layout speaks.",
                 "--out", str(tmp_path / f"{name}.wav"), *extra)
        assert r.returncode == 0, r.stderr
        assert (tmp_path / f"{name}.wav").stat().st_size > 10_000 and "Traceback" not in r.stderr
    # the full report against the reference at fp32 (the runtime-only report on such a folder: test_eval_runtime.py)
    r = _run("eval.py", "--model-path", str(community["fp32"]), "--checkpoint", str(tiny_ckpt), "--no-plots",
             "--json", str(tmp_path / "fp32.json"))
    report = json.loads((tmp_path / "fp32.json").read_text())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert report["sections"]["greedy"] and all(c["ok"] for c in report["checks"])
    assert {c["section"] for c in report["checks"]} >= {"parts", "decoder_steps", "greedy", "teacher_forced"}
    r = _run("eval.py", "--model-path", str(community["fp16"]), "--runtime-only", "--json", str(tmp_path / "16.json"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert all(c["ok"] for c in json.loads((tmp_path / "16.json").read_text())["checks"])


def test_server_batches_requests_on_a_community_folder(community, tmp_path):
    from servers import served

    with served(community["fp16"], tmp_path, "--max-batch", "2") as server:
        client = server.client()

        def speak(i: int) -> bytes:
            return client.audio.speech.create(model="tts-1", voice="default", input=f"Request number {i} here.",
                                              response_format="wav").content

        with ThreadPoolExecutor(3) as pool:
            bodies = list(pool.map(speak, range(3)))
        assert all(b[:4] == b"RIFF" and len(b) > 10_000 for b in bodies)
    assert "community-layout export" in server.log.read_text()


def test_saved_voices_default_outside_the_folder(community, user_cache):
    from argparse import Namespace

    from higgs_onnx.hub import cli_model_path

    args = Namespace(model_path=str(community["fp32"]), voices=None)
    cli_model_path(args, voices=True)
    assert args.voices.is_relative_to(user_cache / "voices") and args.voices.is_dir()
    ours = Namespace(model_path=str(community["fp32"].parent), voices=None)  # a writable folder keeps MODEL_PATH/voices
    cli_model_path(ours, voices=True)
    assert ours.voices is None


def _swap(folder: Path, a: str, b: str) -> None:
    for ext in ("", ".data"):
        (folder / f"{a}.onnx{ext}").rename(folder / f"tmp{ext}")
        (folder / f"{b}.onnx{ext}").rename(folder / f"{a}.onnx{ext}")
        (folder / f"tmp{ext}").rename(folder / f"{b}.onnx{ext}")
    for name in (a, b):  # each graph names its own weights file: point it at the file it now sits beside
        _edit(folder / f"{name}.onnx", lambda g, name=name: [d.__setattr__("value", f"{name}.onnx.data")
                                                             for t in g.initializer for d in t.external_data
                                                             if d.key == "location"])


def _genai(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "genai_config.json").read_text())
    cfg["model"]["decoder"].update(changes)
    (folder / "genai_config.json").write_text(json.dumps(cfg))


def _manifest(folder: Path, **changes) -> None:
    data = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**data, **changes}))


HOSTILE = [  # (what is done to a copy of the fp32 folder, what the one line says)
    (lambda d: _swap(d, "text_embed", "audio_embed"), "text_embed: text_embed.onnx does not run as the text_embed"),
    (lambda d: _swap(d, "audio_tokenizer", "audio_encoder"), "does not run as the audio_tokenizer part"),
    (lambda d: _edit(d / "audio_heads.onnx", lambda g: g.output[0].type.tensor_type.shape.dim[-1].__setattr__(
        "dim_value", 100)), "audio_heads: its output's shape is [1, 2, 8, 1026] where"),
    (lambda d: _genai(d, num_attention_heads=7), "llm_decoder: genai_config.json says heads 7"),
    (lambda d: _genai(d, hidden_size=12), "llm_decoder: genai_config.json says hidden 12"),
    (lambda d: _genai(d, head_size="16"), "head_size must be a positive integer"),
    (lambda d: (d / "audio_heads.onnx.data").unlink(), "weights file audio_heads.onnx.data is missing"),
    (lambda d: (d / "tokenizer.json").unlink(), "has no tokenizer.json"),
    (lambda d: _manifest(d, device=["cpu"]), "device must be a string"),
    (lambda d: _manifest(d, device="tpu", execution_provider="TPUExecutionProvider"), "is not one this runtime"),
]


@pytest.mark.parametrize("case", range(len(HOSTILE)))
def test_hostile_folders_refused_in_one_line_before_work(community, tmp_path, case):
    change, says = HOSTILE[case]
    folder = _copy(community["fp32"], tmp_path / "hostile")
    change(folder)
    r = _run("inference.py", "--model-path", str(folder), "--text", "Hello there.", "--out", str(tmp_path / "x.wav"))
    lines = [x for x in r.stderr.splitlines() if "community-layout export:" not in x]
    assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "x.wav").exists()


def test_unrelated_files_do_not_derive_the_manifest_again(community, tmp_path, user_cache):
    folder = _copy(community["fp32"], tmp_path / "notes")
    load_export(folder, verify=False)
    before = set((user_cache / "adopted").iterdir())
    (folder / "notes.txt").write_text("mine")
    (folder / "voices").mkdir()
    load_export(folder, verify=False)
    assert set((user_cache / "adopted").iterdir()) == before


def _as_hub_download(src: Path, cache: Path) -> Path:
    """`src` laid out as huggingface_hub keeps a download: blobs named by their sha256, the snapshot's links."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--org--tts"
    snap = repo / "snapshots" / commit / src.name
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for p in src.iterdir():
        sha = hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copyfile(p, repo / "blobs" / sha)
        (snap / p.name).symlink_to(os.path.relpath(repo / "blobs" / sha, snap))
    return snap


@pytest.mark.parametrize("layout", ["ours", "community"])
def test_a_corrupt_download_says_delete_and_fetch_again(community, builds, tmp_path, layout):
    snap = _as_hub_download(builds["fp32"] if layout == "ours" else community["fp32"], tmp_path / "hub")
    load_export(snap)  # the download as fetched loads
    blob = (snap / "audio_heads.onnx.data").resolve()
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF  # same size, other bytes: what a bad transfer leaves
    blob.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=f"is a corrupt download .*delete {blob}"):
        load_export(snap)
