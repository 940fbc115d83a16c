"""eval.py's paths: the report targets are checked before anything is loaded, and the reference checkpoint is found
from any folder (absolute in new manifests; older relative ones looked up from the cwd and the export folder)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from higgs_onnx.evaluation.runner import checkpoint_candidates, manifest_checkpoint
from higgs_onnx.manifest import MANIFEST, Manifest, rewrite_manifest

ROOT = Path(__file__).resolve().parent.parent
eval_script = importlib.import_module("eval")  # the top-level eval.py


def targets(tmp_path: Path) -> list[tuple[list[str], str]]:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir.md").mkdir()
    (tmp_path / "r_plots").write_text("a file where the plots folder goes")
    return [
        (["--plots", str(tmp_path / "file")], f"--plots {tmp_path / 'file'} is a file, not a folder"),
        (["--plots", str(tmp_path / "missing" / "figs")], f"folder {tmp_path / 'missing'} does not exist"),
        (["--plots", str(tmp_path / "file" / "figs")], "is a file, not a folder"),
        (["--markdown", str(tmp_path / "dir.md")], "is a folder, not a file"),
        (["--markdown", str(tmp_path / "missing" / "r.md")], f"folder {tmp_path / 'missing'} does not exist"),
        (["--markdown", str(tmp_path / "r.md")], "r_plots is a file, not a folder"),  # its default plots folder
        (["--json", str(tmp_path / "missing" / "r.json")], f"folder {tmp_path / 'missing'} does not exist"),
        (["--json", str(tmp_path / "dir.md")], "is a folder, not a file"),
    ]


def test_report_targets_are_checked_before_anything_is_loaded(tmp_path, capsys):
    """The model folder does not even exist: each bad target is the error, so it was checked first."""
    model = tmp_path / "no-such-export"
    for args, message in targets(tmp_path):
        assert eval_script.main(["--model-path", str(model), *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, (args, err)
        assert "no-such-export" not in err
    assert not (tmp_path / "missing").exists()
    # good targets: then the model folder is the error, and nothing was written or made
    assert eval_script.main(["--model-path", str(model), "--json", str(tmp_path / "r.json"), "--markdown",
                             str(tmp_path / "ok.md")]) == 2
    assert "no-such-export does not exist" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "ok_plots").exists()


def test_checkpoint_candidates(tmp_path):
    export = tmp_path / "proj" / "onnx" / "cpu_int4"
    assert checkpoint_candidates("/abs/ckpt", export) == [Path("/abs/ckpt")]
    assert checkpoint_candidates("ckpt", export, cwd=tmp_path / "else") == [
        tmp_path / "else" / "ckpt", export / "ckpt", export.parent / "ckpt", tmp_path / "proj" / "ckpt"]
    assert checkpoint_candidates("../ckpt", export, cwd=export)[0] == export.parent / "ckpt"


def fake_manifest(export: Path, source: dict) -> Manifest:
    return Manifest(folder=export, data={"source": source})


def test_an_old_relative_checkpoint_path_is_found_from_another_folder(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    (proj / "ckpt").mkdir(parents=True)
    (proj / "ckpt" / "config.json").write_text("{}")
    export = proj / "onnx" / "cpu_int4"
    export.mkdir(parents=True)
    (tmp_path / "else" / "ckpt").mkdir(parents=True)  # a folder of that name, but not a checkpoint: skipped
    monkeypatch.chdir(tmp_path / "else")
    assert manifest_checkpoint(fake_manifest(export, {"path": "ckpt", "repo_id": None})) == str(proj / "ckpt")
    monkeypatch.chdir(proj)  # where the build ran: the cwd comes first
    assert manifest_checkpoint(fake_manifest(Path("onnx/cpu_int4"), {"path": "ckpt"})) == str(proj / "ckpt")
    monkeypatch.chdir(tmp_path)
    gone = fake_manifest(export, {"path": "elsewhere/ckpt", "repo_id": "bosonai/higgs-tts-3-4b"})
    assert manifest_checkpoint(gone) == "bosonai/higgs-tts-3-4b"  # not on disk: the Hub repo it came from
    with pytest.raises(FileNotFoundError, match="is not found .*elsewhere.* pass it with --checkpoint DIR"):
        manifest_checkpoint(fake_manifest(export, {"path": "elsewhere/ckpt", "repo_id": None}))
    with pytest.raises(FileNotFoundError, match="pass it with --checkpoint"):
        manifest_checkpoint(fake_manifest(export, {"path": str(tmp_path / "gone"), "repo_id": None}))


@pytest.mark.slow
def test_eval_runs_from_another_folder_with_an_old_relative_checkpoint_path(builds, tiny_ckpt, tmp_path):
    """An export whose manifest (written before paths were absolute) says `ckpt`, relative to the project folder
    the build ran in; eval.py is started from a third folder, with relative report paths."""
    proj = tmp_path / "proj"
    shutil.copytree(tiny_ckpt, proj / "ckpt")
    export = shutil.copytree(builds["fp32"], proj / "onnx" / "cpu_fp32")
    data = json.loads((export / MANIFEST).read_text())
    data["source"].update(path="ckpt", repo_id=None)
    rewrite_manifest(export, data)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "eval.py"), "--model-path", str(export), "--runs", "0",
                        "--json", "r.json", "--no-plots"], capture_output=True, text=True, cwd=elsewhere,
                       env={**os.environ, "CI": "1"}, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    rep = json.loads((elsewhere / "r.json").read_text())
    assert rep["meta"]["checkpoint"] == str(proj / "ckpt") and rep["passed"]
