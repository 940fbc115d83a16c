"""The manifest's own digest: a manifest edited by hand or damaged is refused at load, with the command that rebuilds
the folder; older manifests (no digest) still load; `rewrite_manifest` is how a deliberate edit is written."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from higgs_onnx import manifest as mf
from higgs_onnx.manifest import DIGEST, MANIFEST, ManifestError, load_manifest, manifest_digest, rewrite_manifest

ROOT = Path(__file__).resolve().parent.parent


def fake_export(folder: Path) -> Path:
    """A folder `load_manifest` accepts: one small file per required part (no real graphs: nothing runs them)."""
    folder.mkdir()
    parts = {}
    for part in mf.REQUIRED_PARTS:
        name = f"{part}.onnx"
        (folder / name).write_bytes(part.encode() * 3)
        meta = {"size": (folder / name).stat().st_size, "sha256": mf.sha256_file(folder / name)}
        parts[part] = {"file": name, "precision": "fp32", "inputs": [{"name": "x"}], "outputs": [{"name": "y"}],
                       "files": {name: meta}}
    data = {"schema_version": 1, "format": "higgs-onnx", "device": "cpu", "precision": "int4",
            "execution_provider": "CPUExecutionProvider", "tokenizer": "tokenizer.json", "parts": parts,
            "model": {"hidden": 64, "ratio": 0.1}, "tokens": {"control_tags": {"<|emotion:elation|>": 7}},
            "source": {"path": "/somewhere/ckpt", "note": "caf\u00e9"}}
    mf.write_manifest(folder, data)
    return folder


def edit(folder: Path, fn) -> None:
    """Change the manifest the way a person with an editor would: the digest stays as it was."""
    data = json.loads((folder / MANIFEST).read_text())
    fn(data)
    (folder / MANIFEST).write_text(json.dumps(data, indent=4))


def test_written_with_a_digest_that_load_checks(tmp_path):
    folder = fake_export(tmp_path / "m")
    data = json.loads((folder / MANIFEST).read_text())
    assert data[DIGEST] == manifest_digest(data) and len(data[DIGEST]) == 64
    assert load_manifest(folder).data == data
    # the digest is of the content, not of the layout: other indentation and key order load
    (folder / MANIFEST).write_text(json.dumps(dict(reversed(list(data.items()))), separators=(",", ":")))
    load_manifest(folder, verify=True)


@pytest.mark.parametrize("change", [
    lambda d: d.update(precision="fp32"),
    lambda d: d["parts"]["audio_heads"].update(precision="int4"),
    lambda d: d["model"].update(ratio=0.2),
    lambda d: d["parts"]["audio_heads"]["files"]["audio_heads.onnx"].update(sha256="0" * 64),
    lambda d: d.update(extra=True),
    lambda d: d.update({DIGEST: "not a digest"}),
    lambda d: d.update(model={"hidden": float("nan")}),
], ids=["precision", "part precision", "model fact", "file hash", "new key", "digest itself", "nan"])
@pytest.mark.parametrize("verify", [True, False])
def test_a_hand_edited_manifest_is_refused_even_without_verify(tmp_path, change, verify):
    folder = fake_export(tmp_path / "m")
    edit(folder, change)
    with pytest.raises(ManifestError) as e:
        load_manifest(folder, verify=verify)
    message = str(e.value)
    assert "was changed after it was written (edited by hand or damaged" in message and "\n" not in message
    assert "rebuild the folder: python optimize.py --device cpu --precision " in message and "--force" in message


def test_a_manifest_without_a_digest_still_loads(tmp_path, caplog):
    folder = fake_export(tmp_path / "m")
    edit(folder, lambda d: d.pop(DIGEST))
    with caplog.at_level(logging.DEBUG, logger="higgs_onnx.manifest"):
        m = load_manifest(folder)
    assert DIGEST not in m.data and "written before manifests carried one" in caplog.text


def test_rewrite_manifest_is_a_deliberate_edit(tmp_path):
    folder = fake_export(tmp_path / "m")
    data = json.loads((folder / MANIFEST).read_text())
    data["precision"] = "fp32"
    rewrite_manifest(folder, data)  # the old digest in `data` is replaced
    assert load_manifest(folder).data["precision"] == "fp32"
    data["parts"] = {}  # no schema check there: tests write broken manifests on purpose, to hit the other checks
    rewrite_manifest(folder, data)
    with pytest.raises(ManifestError, match="'parts' must list"):
        load_manifest(folder)
    assert not list(folder.glob("*.partial"))


def test_the_schema_version_is_read_before_the_digest(tmp_path):
    """A newer toolkit's manifest may digest differently: it says "update", not "damaged"."""
    folder = fake_export(tmp_path / "m")
    edit(folder, lambda d: d.update(schema_version=99))
    with pytest.raises(ManifestError, match="newer than this toolkit"):
        load_manifest(folder)


# -- on real exports --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_exports_carry_a_digest_and_an_absolute_checkpoint_path(builds):
    for folder in builds.values():
        data = load_manifest(folder, verify=False).data
        assert data[DIGEST] == manifest_digest(data)
        assert Path(data["source"]["path"]).is_absolute() and Path(data["source"]["path"]).is_dir()


@pytest.mark.slow
def test_the_source_path_is_absolute_whatever_the_cwd(tiny_ckpt, tmp_path, monkeypatch):
    from higgs_onnx.checkpoint import load_facts
    from higgs_onnx.export import Exporter, ExportOptions

    work = shutil.copytree(tiny_ckpt, tmp_path / "here" / "ckpt")
    monkeypatch.chdir(tmp_path / "here")
    exporter = Exporter("ckpt", tmp_path / "onnx", ExportOptions())
    manifest = exporter.manifest(Path("ckpt"), load_facts(work), parts={})
    assert manifest["source"]["path"] == str(work)


@pytest.mark.slow
def test_inference_refuses_an_edited_manifest_and_optimize_reassembles_it(builds, tiny_ckpt, out_root, tmp_path,
                                                                           route_crossover):
    from higgs_onnx.export import Exporter, ExportOptions
    from higgs_onnx.runtime.model import HiggsTTS

    copy = shutil.copytree(builds["int4"], tmp_path / "m")
    edit(copy, lambda d: d["model"].update(max_positions=8))
    r = subprocess.run([sys.executable, str(ROOT / "inference.py"), "--model-path", str(copy), "--text", "Hi.",
                        "--out", str(tmp_path / "o.wav"), "--no-verify"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "CI": "1"}, timeout=300)
    assert r.returncode == 2 and "was changed after it was written" in r.stderr and "--force" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "o.wav").exists()
    # the build's own folder damaged the same way: a plain rerun of optimize.py writes it again (parts are cached)
    path = builds["int4"] / MANIFEST
    good = path.read_text()
    try:
        edit(builds["int4"], lambda d: d["model"].update(max_positions=8))
        # with the crossover the session's build was given: a measured one would be written into the export every
        # other test of this worker uses (tests/test_route.py checks it is the given one)
        Exporter(str(tiny_ckpt), out_root, ExportOptions("cpu", "int4", route_crossover=route_crossover)).run()
        assert load_manifest(builds["int4"], verify=True).data["model"]["max_positions"] != 8
        HiggsTTS(builds["int4"], verify=False)
    finally:
        if load_manifest_fails(builds["int4"]):
            path.write_text(good)


def load_manifest_fails(folder: Path) -> bool:
    try:
        load_manifest(folder, verify=False)
    except ManifestError:
        return True
    return False
