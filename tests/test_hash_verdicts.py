"""The export's files hashed once per file identity (higgs_onnx/hash_verdicts.py): a second load hashes nothing; a
changed file is hashed again and refused; a verdict file for other identities, or a corrupt one, is not trusted; a
folder that cannot be written (a read-only mount, the Hub's cache) keeps its verdicts in the user's cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from higgs_onnx import hash_verdicts
from higgs_onnx import manifest as mf
from higgs_onnx.hash_verdicts import VERDICTS
from higgs_onnx.manifest import ManifestError, load_manifest

ROOT = Path(__file__).resolve().parent.parent


def small_export(folder: Path) -> Path:
    """A folder `load_manifest` accepts: each required part one file of a few kB (nothing runs them)."""
    folder.mkdir(parents=True)
    parts = {}
    for i, part in enumerate(mf.REQUIRED_PARTS):
        path = folder / f"{part}.onnx"
        path.write_bytes(bytes(range(256)) * (4 + i))
        parts[part] = {"file": path.name, "precision": "fp32", "inputs": [{"name": "x"}], "outputs": [{"name": "y"}],
                       "files": {path.name: {"size": path.stat().st_size, "sha256": mf.sha256_file(path)}}}
    mf.write_manifest(folder, {"schema_version": 1, "format": "higgs-onnx", "device": "cpu", "precision": "int4",
                               "execution_provider": "CPUExecutionProvider", "tokenizer": "tokenizer.json",
                               "parts": parts, "model": {"hidden": 8}, "tokens": {"control_tags": {}}})
    return folder


@pytest.fixture
def hashes(monkeypatch) -> list[str]:
    """The names of the files hashed (every sha256 computed at load goes through hash_verdicts.sha256_file)."""
    seen: list[str] = []
    real = hash_verdicts.sha256_file
    monkeypatch.setattr(hash_verdicts, "sha256_file", lambda p: seen.append(Path(p).name) or real(p))
    return seen


def flip_byte(path: Path, keep_mtime: bool) -> None:
    """One byte changed in place (same size, same inode); the mtime put back when `keep_mtime`."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_the_second_load_hashes_nothing_and_a_changed_file_is_hashed_and_refused(tmp_path, hashes):
    folder = small_export(tmp_path / "m")
    load_manifest(folder, verify=True)
    assert sorted(hashes) == sorted(f"{p}.onnx" for p in mf.REQUIRED_PARTS)
    kept = json.loads((folder / VERDICTS).read_text())
    assert kept["version"] == 1 and len(kept["files"]) == len(mf.REQUIRED_PARTS)
    hashes.clear()
    load_manifest(folder, verify=True)
    assert hashes == []
    load_manifest(folder, verify=False)  # no verdict is read or written without verify
    target = folder / "audio_heads.onnx"
    for keep_mtime in (False, True):  # the mtime put back still changes the ctime: hashed again
        hashes.clear()
        flip_byte(target, keep_mtime)
        with pytest.raises(ManifestError, match="audio_heads: file audio_heads.onnx does not match its sha256"):
            load_manifest(folder, verify=True)
        assert "audio_heads.onnx" in hashes
        flip_byte(target, keep_mtime)  # back to the content the manifest records
        load_manifest(folder, verify=True)


def test_a_verdict_file_for_other_identities_or_a_corrupt_one_is_not_trusted(tmp_path, hashes):
    folder = small_export(tmp_path / "m")
    load_manifest(folder, verify=True)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)  # copy2: the same sizes and mtimes, the verdict file with them; other inodes
    flip_byte(copy / "text_embed.onnx", keep_mtime=True)
    hashes.clear()
    with pytest.raises(ManifestError, match="text_embed: file text_embed.onnx does not match its sha256"):
        load_manifest(copy, verify=True)
    assert "text_embed.onnx" in hashes
    # a verdict naming this very path but another inode (a file replaced by another of the same size and mtime)
    kept = json.loads((folder / VERDICTS).read_text())
    for entry in kept["files"]:
        entry["ino"] += 1
    (folder / VERDICTS).write_text(json.dumps(kept))
    hashes.clear()
    load_manifest(folder, verify=True)
    assert len(hashes) == len(mf.REQUIRED_PARTS)
    for junk in ("{not json", json.dumps({"version": 1, "files": [{"path": "x"}]}), json.dumps([1, 2])):
        (folder / VERDICTS).write_text(junk)
        hashes.clear()
        load_manifest(folder, verify=True)  # ignored: every file hashed again, the file written anew
        assert len(hashes) == len(mf.REQUIRED_PARTS)
        assert len(json.loads((folder / VERDICTS).read_text())["files"]) == len(mf.REQUIRED_PARTS)


def test_a_verdict_never_refuses_a_sound_file_and_a_huge_verdict_file_is_not_read(tmp_path, hashes, monkeypatch):
    """A well-formed verdict with another sha256 for the file's very identity (a verdict file edited or damaged)
    refused the sound file; now the file is hashed, found sound, and its verdict written right. A verdict file over
    MAX_BYTES is not read (a huge one would be read whole into memory)."""
    folder = small_export(tmp_path / "m")
    load_manifest(folder, verify=True)
    kept = json.loads((folder / VERDICTS).read_text())
    for entry in kept["files"]:
        entry["sha256"] = "0" * 64
    (folder / VERDICTS).write_text(json.dumps(kept))
    hashes.clear()
    load_manifest(folder, verify=True)
    assert len(hashes) == len(mf.REQUIRED_PARTS)
    assert "0" * 64 not in {e["sha256"] for e in json.loads((folder / VERDICTS).read_text())["files"]}
    hashes.clear()
    load_manifest(folder, verify=True)
    assert hashes == []
    monkeypatch.setattr(hash_verdicts, "MAX_BYTES", (folder / VERDICTS).stat().st_size - 1)
    load_manifest(folder, verify=True)
    assert len(hashes) == len(mf.REQUIRED_PARTS)


@pytest.mark.timeout(30)
def test_a_verdict_file_that_is_no_regular_file_is_not_read(tmp_path, hashes):
    """A FIFO in its place blocked the load forever; a link to /dev/zero read until the memory ran out. Both are
    passed over (every file hashed) and replaced by the verdicts written."""
    folder = small_export(tmp_path / "m")
    for make in (os.mkfifo, lambda p: p.symlink_to("/dev/zero")):
        make(folder / VERDICTS)
        hashes.clear()
        load_manifest(folder, verify=True)
        assert len(hashes) == len(mf.REQUIRED_PARTS) and (folder / VERDICTS).is_file()
        (folder / VERDICTS).unlink()


def test_a_hub_download_keeps_its_verdicts_in_the_users_cache(tmp_path, monkeypatch, hashes):
    """A folder of the Hub's cache (snapshot files linking to blobs) is never written into."""
    src = small_export(tmp_path / "src")
    repo = tmp_path / "hub" / "models--o--r"
    snap = repo / "snapshots" / "c0ffee" / "cpu_int4"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, repo / "blobs" / f.name)
        (snap / f.name).symlink_to(repo / "blobs" / f.name)
    monkeypatch.setenv("HIGGS_CACHE", str(tmp_path / "cache"))
    load_manifest(snap, verify=True)
    assert not (snap / VERDICTS).exists() and not (repo / "blobs" / VERDICTS).exists()
    kept, = (tmp_path / "cache" / "verdicts").glob(f"*/{VERDICTS}")
    assert {e["path"] for e in json.loads(kept.read_text())["files"]} == {
        str(repo / "blobs" / f"{p}.onnx") for p in mf.REQUIRED_PARTS}
    hashes.clear()
    load_manifest(snap, verify=True)
    assert hashes == []


def test_a_folder_without_write_permission_keeps_its_verdicts_in_the_users_cache(tmp_path, monkeypatch, hashes):
    """Its mode says read-only: honoured even by root, whom the mode does not stop."""
    folder = small_export(tmp_path / "m")
    monkeypatch.setenv("HIGGS_CACHE", str(tmp_path / "cache"))
    folder.chmod(0o555)
    try:
        load_manifest(folder, verify=True)
        hashes.clear()
        load_manifest(folder, verify=True)
    finally:
        folder.chmod(0o755)
    assert hashes == [] and not (folder / VERDICTS).exists()
    assert len(list((tmp_path / "cache" / "verdicts").glob(f"*/{VERDICTS}"))) == 1


def test_a_read_only_folder_keeps_its_verdicts_in_the_users_cache(tmp_path):
    """A read-only bind mount in a mount namespace of its own (tests run as root, whom chmod does not stop)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here: a read-only mount needs a mount namespace")
    folder = small_export(tmp_path / "m")
    cache = tmp_path / "cache"
    code = ("import sys; from higgs_onnx.manifest import load_manifest; load_manifest(sys.argv[1], verify=True); "
            "load_manifest(sys.argv[1], verify=True); print('loaded')")
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, str(folder), sys.executable, "-c", code, str(folder)],
                       env={**os.environ, "HIGGS_CACHE": str(cache)}, capture_output=True, text=True, cwd=ROOT)
    if r.returncode and "mount" in r.stderr and "loaded" not in r.stdout:
        pytest.skip(f"mount namespaces are not permitted here ({r.stderr.strip()[:120]})")
    assert r.returncode == 0 and r.stdout.strip() == "loaded", r.stderr
    assert not (folder / VERDICTS).exists()
    kept, = (cache / "verdicts").glob(f"*/{VERDICTS}")
    assert len(json.loads(kept.read_text())["files"]) == len(mf.REQUIRED_PARTS)
