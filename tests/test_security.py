"""Nothing untrusted is executed: no pickle, no torch.load, no remote code, the HF token stays a secret."""

import json
import logging
import re
from pathlib import Path

from higgs_onnx.checkpoint import load_facts
from higgs_onnx.export import Exporter, ExportOptions

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [*ROOT.glob("*.py"), *(ROOT / "higgs_onnx").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
FORBIDDEN = [r"torch\.load\(", r"trust_remote_code\s*=\s*True", r"allow_pickle\s*=\s*True", r"import pickle",
             r"pickle\.loads?\(", r"(?<![.\w])eval\(", r"(?<![.\w])exec\("]


def test_no_unsafe_loading_in_the_code():
    assert len(SOURCES) > 20
    for path in SOURCES:
        text = path.read_text()
        for pattern in FORBIDDEN:
            assert not re.search(pattern, text), f"{path.name}: {pattern}"
    # every np.load says allow_pickle=False (NumPy's default, but written out where untrusted files are read)
    loads = {p.name: (p.read_text().count("np.load("), p.read_text().count("allow_pickle=False")) for p in SOURCES}
    assert loads["delay.py"][0] >= 1  # the code-row reader of --codes / --teacher-codes
    assert all(n <= safe for n, safe in loads.values()), {k: v for k, v in loads.items() if v[0] > v[1]}


def test_hf_token_never_reaches_the_manifest_or_the_log(tiny_ckpt, tmp_path, caplog):
    secret = "hf_TopSecretToken123"
    exporter = Exporter("bosonai/higgs-tts-3-4b", tmp_path, ExportOptions(), revision="main", token=secret)
    with caplog.at_level(logging.DEBUG):
        manifest = exporter.manifest(tiny_ckpt, load_facts(tiny_ckpt), parts={})
    text = json.dumps(manifest)
    assert manifest["source"]["repo_id"] == "bosonai/higgs-tts-3-4b" and manifest["source"]["revision"] == "main"
    assert secret not in text and secret not in caplog.text
