"""The one atomic write (`outputs.atomic` / `write_atomic`) that every writer of the package goes through: whole or
not at all, no temp file left behind either way, the umask's mode for a new file and an overwritten file's own."""

from __future__ import annotations

import os
import stat

import pytest

from higgs_onnx.outputs import atomic, write_atomic


def test_a_write_is_whole_or_not_at_all(tmp_path):
    target = tmp_path / "a.json"
    write_atomic(target, "first\n")
    with pytest.raises(RuntimeError), atomic(target) as tmp:
        tmp.write_text("half of the second")
        raise RuntimeError("killed mid-way")
    assert target.read_text() == "first\n" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    with atomic(target, ".json") as tmp:
        assert tmp.name.startswith(".a.json.") and tmp.name.endswith(".partial.json") and tmp.parent == tmp_path
        tmp.write_bytes(b"second")
    assert target.read_bytes() == b"second" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_modes_follow_the_umask_and_an_overwritten_file(tmp_path):
    old = os.umask(0o027)
    try:
        new = write_atomic(tmp_path / "new.txt", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(new.stat().st_mode) == 0o640  # mkstemp's 0600 is not what a user gets
    kept = tmp_path / "kept.txt"
    kept.write_text("old")
    kept.chmod(0o604)
    write_atomic(kept, "new")
    assert kept.read_text() == "new" and stat.S_IMODE(kept.stat().st_mode) == 0o604


def test_a_missing_folder_is_an_error_before_anything_is_written(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "no" / "a.txt", "x")
    assert not (tmp_path / "no").exists()
