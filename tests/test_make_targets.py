"""The make targets the README names, run as a user runs them (the Makefile's own recipes), into a temporary folder.

`make demo` and `make openvino-demo` build -> speak -> report; their exports go to the session's export root, where
the suite's tiny checkpoint and part cache already are (the targets' `optimize.py --synthetic tiny --output OUT`
finds both), so what they add is their own steps: the CLI build, the wavs and eval.py's report through the runtime
they name. `make -o .venv/.installed` keeps make from installing anything (the suite runs inside that install);
`BIN` is this interpreter's folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def make(target: str, out: Path, wavs: Path, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "CI": "1"}
    return subprocess.run(["make", "-C", str(ROOT), "-o", ".venv/.installed", target,
                           f"BIN={Path(sys.executable).parent}", f"OUT={out}", f"WAVS={wavs}", *extra],
                          capture_output=True, text=True, timeout=timeout, env=env)


def check_report(path: Path, route: str) -> str:
    text = path.read_text()
    assert re.search(r"Result: \*\*PASS\*\* \((\d+) of \1 checks passed\)", text), text[:2000]
    assert "**Broke**" not in text and "## Failures" not in text
    assert route in text
    return text


def check_wav(path: Path) -> None:
    audio, rate = sf.read(path)
    assert rate == 24000 and len(audio) > 2400 and np.isfinite(audio).all() and np.abs(audio).max() > 0


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-wavs")


def test_make_demo(builds, out_root, wavs):
    r = make("demo", out_root, wavs)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("demo.wav", "demo_clone.wav", "demo_stream.wav"):
        check_wav(wavs / name)
    check_report(out_root / "cpu_int4_report.md", "Route: the step graph")
    assert (out_root / "cpu_int4_report_plots").is_dir() and any((out_root / "cpu_int4_report_plots").glob("*.png"))


def test_make_openvino_demo(openvino_build, out_root, wavs):
    """Issue 32: the OpenVINO decoder keeps its cache as state, and eval's decoder sections used to feed the cache
    by port names it does not have (`Result: FAIL (10 of 12 checks passed)`)."""
    r = make("openvino-demo", out_root, wavs)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "up to date" in r.stdout  # the session's openvino_int4: the target's build step found it
    check_wav(wavs / "demo_openvino.wav")
    text = check_report(out_root / "openvino_int4_report.md", "the KV cache is OpenVINO state")
    assert "OpenVINO:CPU" in text


def test_make_lint_and_clean(tmp_path):
    """`make lint` passes on the checkout; `make clean` removes the exports, the hand-made checkpoints and the demo
    wavs it is pointed at, and nothing else."""
    r = subprocess.run(["make", "-C", str(ROOT), "-o", ".venv/.installed", "lint",
                        f"BIN={Path(sys.executable).parent}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out, models = tmp_path / "onnx", tmp_path / "models"
    for d in (out / "cpu_int4", models / "tiny"):
        d.mkdir(parents=True)
        (d / "f").write_text("x")
    for name in ("demo.wav", "demo_clone.wav", "keep.wav"):
        (tmp_path / name).write_text("x")
    r = make("clean", out, tmp_path, f"MODELS={models}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.wav"]


def test_the_readme_names_only_targets_that_exist():
    """Every `make X` the README and docs/ name is a target of the Makefile, and each of those runs in the suite:
    demo, openvino-demo, lint, clean here, test and test-fast are what the suite is, venv is their prerequisite,
    coverage runs the suite under coverage."""
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        named |= set(re.findall(r"`make ([a-z][a-z-]*)", doc.read_text()))
    assert named and named <= targets, named - targets
    assert named <= {"demo", "openvino-demo", "lint", "clean", "test", "test-fast", "venv", "coverage"}, named
