"""The corpus command run as a user runs it (a support module, not a test module: `from corpus_runs import ...`):
`corpus(*args)` is `python -m higgs_onnx.corpus ARGS` from the repository, `manifest(out)` the rows it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def corpus(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "higgs_onnx.corpus", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "CI": "1"}, timeout=600, **kw)


def manifest(out: Path) -> list[dict]:
    """The entries of a corpus output's manifest.jsonl, in order."""
    return [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
