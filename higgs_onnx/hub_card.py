"""The model card `hub.push` (optimize.py --push-to-hub) writes as the repo's README.md, regenerated at every push
from the manifests of every export the repo holds at that revision (a card never describes a folder that is gone).

The card: YAML front matter (library_name, pipeline_tag, base_model from the manifest's source, the checkpoint's
licence where its folder records one, tags) and, per export, the command that runs it, its parts and sizes, the
build's gate figures (the int8 KV cache's, the int8 route's) and the crossover with the CPU it was measured on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .checkpoint import DEFAULT_REPO
from .manifest import crossover_words

MB = 1 << 20


def licence_of(manifest: dict) -> str:
    """The checkpoint's licence: `license:` in its README.md front matter or its config.json, where the checkpoint
    folder the manifest records is still here; `other` when it is synthetic or not known."""
    source = manifest.get("source") or {}
    path = Path(source["path"]) if isinstance(source.get("path"), str) else None
    if path is not None and (path / "README.md").is_file():
        m = re.search(r"\A---\s*\n(.*?)\n---", (path / "README.md").read_text(errors="replace"), re.S)
        if m and (lic := re.search(r"^license:\s*['\"]?([\w.+-]+)", m[1], re.M)):
            return lic[1]
    if path is not None and (path / "config.json").is_file():
        try:
            lic = json.loads((path / "config.json").read_text()).get("license")
        except (OSError, ValueError):
            lic = None
        if isinstance(lic, str) and re.fullmatch(r"[\w.+-]+", lic):
            return lic
    return "other"


def synthetic_of(manifest: dict) -> str | None:
    """The synthetic preset the export was built from (the manifest's source, or the checkpoint folder's
    synthetic.json where it is still here), None for a real checkpoint."""
    source = manifest.get("source") or {}
    if source.get("synthetic"):
        return str(source["synthetic"])
    marker = Path(source["path"]) / "synthetic.json" if isinstance(source.get("path"), str) else None
    if marker is not None and marker.is_file():
        try:
            return str(json.loads(marker.read_text()).get("preset") or "synthetic")
        except (OSError, ValueError):
            return "synthetic"
    return None


def card(repo_id: str, manifests: dict[str, dict], licence: str) -> str:
    """The model card for the exports `manifests` ({folder: manifest}) of `repo_id`."""
    sources = {m.get("source", {}).get("repo_id") or DEFAULT_REPO for m in manifests.values()}
    base = sorted(sources)[0]
    synthetic = sorted({s for m in manifests.values() if (s := synthetic_of(m))})
    tags = ["onnx", "text-to-speech", "higgs-audio", "higgs-onnx", "onnxruntime",
            *sorted({m.get("device", "") for m in manifests.values()} - {""}),
            *sorted({m.get("precision", "") for m in manifests.values()} - {""})]
    front = ["---", "library_name: onnxruntime", "pipeline_tag: text-to-speech", f"base_model: {base}",
             f"license: {licence}", "tags:", *[f"- {t}" for t in tags], "---", ""]
    body = [f"# {repo_id.split('/')[1]}", "",
            f"ONNX exports of [{base}](https://huggingface.co/{base}) (Higgs Audio v3 TTS: a Qwen3 body, 8-codebook "
            "audio heads and a 24 kHz codec) made by higgs-onnx's `optimize.py`, run with ONNX Runtime alone.", ""]
    if synthetic:
        body += [f"**Synthetic weights** ({', '.join(synthetic)}): random, made for tests, not for speech.", ""]
    if licence == "other":
        body += [f"Licence: the checkpoint's, see [{base}](https://huggingface.co/{base}).", ""]
    body += ["| folder | device | precision | execution provider | size |", "|---|---|---|---|---|"]
    for name, m in sorted(manifests.items()):
        body.append(f"| [{name}](#{name}) | {m.get('device')} | {m.get('precision')} | "
                    f"{m.get('execution_provider')} | {_mb(total_bytes(m))} |")
    body.append("")
    for name, m in sorted(manifests.items()):
        body += section(repo_id, name, m)
    return "\n".join(front + body)


def total_bytes(m: dict) -> int:
    return sum(f.get("size", 0) for p in m.get("parts", {}).values() for f in p.get("files", {}).values())


def _mb(n: int) -> str:
    return f"{n / MB:.1f} MB"


def section(repo_id: str, name: str, m: dict) -> list[str]:
    """One export's section: the command, the parts, the gates, the crossover and its CPU."""
    out = [f"## {name}", "", "```bash",
           f'python inference.py --model-path hf://{repo_id}/{name} --text "Hello there." --out hello.wav',
           "```", "", "| part | precision | files | size |", "|---|---|---|---|"]
    for part, p in m.get("parts", {}).items():
        files = p.get("files", {})
        out.append(f"| {part} | {p.get('precision')} | {', '.join(files)} | "
                   f"{_mb(sum(f.get('size', 0) for f in files.values()))} |")
    out.append("")
    decoder = m.get("decoder", {})
    out += gate_lines(decoder) + [""]
    src = m.get("source", {})
    origin = f"synthetic {synthetic_of(m)}" if synthetic_of(m) else \
        f"{src.get('repo_id') or 'a local checkpoint'}" + (f"@{src['revision']}" if src.get("revision") else "")
    tools = ", ".join(f"{k} {v}" for k, v in (m.get("tools") or {}).items()
                      if k in ("onnxruntime", "onnxruntime-genai"))
    out += [f"Built {m.get('created', '?')} from {origin}; decoder attention {decoder.get('attention')}; {tools}.", ""]
    return out


def gate_lines(decoder: dict) -> list[str]:
    """The build's gate figures as card lines: the int8 KV cache's and the int8 route's, with its crossover."""
    out = []
    kv = decoder.get("kv_cache") or {}
    if kv.get("gates"):
        g, t = kv["gates"], kv.get("thresholds", {})
        figures = ", ".join(f"{k.replace('_', ' ')} {v:.5f}" + (f" (gate >= {t[k]:.5f})" if k in t else "")
                            for k, v in g.items())
        out.append(f"- KV cache {kv.get('dtype')} ({kv.get('mode')}): {figures}")
    elif kv:
        out.append(f"- KV cache {kv.get('dtype', 'fp32')}")
    route = decoder.get("route") or {}
    if route:
        worst = (route.get("gate") or {}).get("worst", {})
        w = ", ".join(f"{k}: top-1 {v.get('top1', 0):.3f}, logit distance {v.get('logit_distance', 0):.2e}"
                      for k, v in worst.items())
        out.append(f"- int8 route ({route.get('kind')}) against fp32, worst prompt: {w}")
        flags = " ".join((route.get("cpu") or {}).get("flags", [])) or "(none listed)"
        out.append(f"- route crossover: {crossover_words(route)}, CPU flags {flags} (`$HIGGS_ROUTE` or `route=` "
                   "overrides it on another CPU)")
    return out or ["- no gate figures recorded (an fp32 KV cache and no int8 route)"]
