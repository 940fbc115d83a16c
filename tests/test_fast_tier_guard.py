"""The fast-tier guard in conftest.py: a test that needs the `builds` export without being marked slow fails (not
skips) with a clear message, before the export starts; `--co` refuses the listing. Run on a copy of the conftest in a
scratch folder, so the real suite is not involved."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parent / "conftest.py"
ROOT = CONFTEST.parent.parent
PROBE = '''
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):  # what `builds` sets up first: leaves a mark if the export was started
    (Path(__file__).parent / "EXPORT_STARTED").touch()
    raise RuntimeError("the export must not start")


@pytest.fixture
def tts(builds):  # the export requested through another fixture
    return builds


def test_direct(builds):
    pass


def test_through_a_fixture(tts):
    pass


@pytest.mark.slow
def test_marked(builds):
    pass


def test_no_export():
    pass
'''


def run_probe(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: builds ONNX exports\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
                           "--rootdir", str(tmp_path), str(tmp_path), *args], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "CI": "1", "PYTHONPATH": str(ROOT)}, timeout=300)


def test_unmarked_tests_needing_the_export_fail(tmp_path):
    r = run_probe(tmp_path, "-m", "not slow")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    for name in ("test_direct", "test_through_a_fixture"):
        assert f"ERROR test_probe.py::{name} - Failed: test_probe.py::{name} needs the `builds` fixture" in out, out
    assert "mark it @pytest.mark.slow" in out and "PASSED test_probe.py::test_no_export" in out
    assert "test_marked" not in out and "skipped" not in out  # deselected by -m; nothing turned into a skip
    assert not (tmp_path / "EXPORT_STARTED").exists()  # failed before the export began


def test_collect_only_refuses_the_listing(tmp_path):
    r = run_probe(tmp_path, "-m", "not slow", "--co")
    assert r.returncode == 4, r.stdout + r.stderr  # a usage error
    assert "test_probe.py::test_through_a_fixture needs the `builds` fixture" in r.stderr
    assert "test_marked" not in r.stderr and not (tmp_path / "EXPORT_STARTED").exists()
