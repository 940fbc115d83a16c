"""The user's cache (higgs_onnx/user_cache.py) when it cannot be written: $HIGGS_CACHE naming a file, a folder that
cannot be made, a read-only filesystem (a read-only bind mount in a mount namespace of its own). Each is one line
naming the cache, $HIGGS_CACHE and the fix; inference.py prints it and exits 2. Tests run as root, whom chmod does
not stop, so only real errors are used: a path under a file, a folder /proc cannot hold, a read-only mount."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from higgs_onnx.user_cache import CacheError, cache_dir, cache_writes

ROOT = Path(__file__).resolve().parents[1]
FIX = "set $HIGGS_CACHE to a folder you can write (e.g. HIGGS_CACHE=/tmp/higgs-cache)"


def line(root: Path, reason: str, env: bool = True) -> str:
    where = "$HIGGS_CACHE" if env else "the default; $HIGGS_CACHE moves it"
    return f"higgs-onnx's cache {root} ({where}) cannot be written: {reason}; {FIX}"


def test_a_cache_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("HIGGS_CACHE", str(tmp_path / "file"))
    with pytest.raises(CacheError) as e:
        cache_dir("adopted", "k")
    assert str(e.value) == line(tmp_path / "file", f"{tmp_path / 'file'} is not a folder")
    assert isinstance(e.value, ValueError) and (tmp_path / "file").read_text() == "x"
    monkeypatch.setenv("HIGGS_CACHE", "/proc/higgs-cache")
    with pytest.raises(CacheError) as e:
        cache_dir("voices", "k")
    assert str(e.value) == line(Path("/proc/higgs-cache"), "no such file or directory: /proc/higgs-cache")
    monkeypatch.delenv("HIGGS_CACHE")  # the default place, under $XDG_CACHE_HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "sub"))
    with pytest.raises(CacheError) as e:
        cache_dir("cpu-graphs", "k")
    assert str(e.value) == line(tmp_path / "file" / "sub" / "higgs-onnx",
                                f"not a directory: {tmp_path / 'file' / 'sub' / 'higgs-onnx' / 'cpu-graphs' / 'k'}",
                                env=False)


def test_a_writable_cache_is_made_and_writes_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("HIGGS_CACHE", str(tmp_path / "c"))
    assert cache_dir("adopted", "k", make=False) == tmp_path / "c" / "adopted" / "k"
    assert not (tmp_path / "c").exists()  # make=False: only the path
    folder = cache_dir("adopted", "k")
    assert folder.is_dir() and cache_dir("adopted", "k") == folder
    with cache_writes(folder):
        (folder / "x").write_text("y")
    with pytest.raises(CacheError, match=r"cannot be written: no such file or directory: .*/nope/x; set"):
        with cache_writes(folder):
            (folder / "nope" / "x").write_text("y")
    with pytest.raises(ValueError, match="not a plain name"):
        cache_dir("adopted", "..")


def unshare_ro(folder: Path, command: list[str], env: dict) -> subprocess.CompletedProcess:
    """`command` run with `folder` bind-mounted read-only in a mount namespace of its own (nothing else sees it)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here: a read-only mount needs a mount namespace")
    probe = subprocess.run(["unshare", "-m", "mount", "--bind", "-o", "ro", str(folder), str(folder)],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"mount namespaces are not permitted here ({probe.stderr.strip()})")
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, str(folder), *command], env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_read_only_filesystem_is_one_line(tmp_path):
    """A folder to make on a read-only mount (mkdir's EROFS) and one that is there but cannot be written."""
    (tmp_path / "ro" / "adopted" / "there").mkdir(parents=True)
    code = ("from higgs_onnx.user_cache import cache_dir\nfor key in ('new', 'there'):\n    try:\n"
            "        cache_dir('adopted', key)\n    except ValueError as e:\n        print(e)\n")
    r = unshare_ro(tmp_path / "ro", [sys.executable, "-c", code], {**os.environ, "HIGGS_CACHE": str(tmp_path / "ro")})
    assert r.returncode == 0, r.stderr
    ro = tmp_path / "ro"
    assert r.stdout.splitlines() == [line(ro, f"read-only file system: {ro / 'adopted' / 'new'}"),
                                     line(ro, f"read-only file system: {ro / 'adopted' / 'there'}")]


# -- inference.py ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def community(builds, tmp_path_factory) -> Path:
    from community_layout import write_community

    return write_community(builds["fp32"], tmp_path_factory.mktemp("community") / "folder")


def speak(model: Path, out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "inference.py"), "--model-path", str(model), "--text", "Hi.", "--out",
            str(out), "--no-verify"]


@pytest.mark.slow
def test_inference_on_a_community_folder_names_the_cache_and_exits_2(community, tmp_path):
    (tmp_path / "file").write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    cases = [(tmp_path / "file", f"{tmp_path / 'file'} is not a folder"),
             (Path("/proc/higgs-cache"), "no such file or directory: /proc/higgs-cache"),
             (ro, f"read-only file system: {ro / 'adopted'}")]
    for cache, reason in cases:
        env = {**os.environ, "HIGGS_CACHE": str(cache)}
        argv = speak(community, tmp_path / "out.wav")
        r = unshare_ro(ro, argv, env) if cache == ro else subprocess.run(argv, env=env, capture_output=True,
                                                                           text=True, timeout=300)
        assert r.returncode == 2 and r.stderr.splitlines() == [f"error: {line(cache, reason)}"], (cache, r.stderr)
        assert not (tmp_path / "out.wav").exists()
    r = subprocess.run(speak(community, tmp_path / "out.wav"), env={**os.environ, "HIGGS_CACHE": str(ro)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and (tmp_path / "out.wav").stat().st_size > 1000, r.stderr  # the same, writable
    assert len(list((ro / "adopted").iterdir())) == 1
