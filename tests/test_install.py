"""The package installed for real: fresh venvs (`python -m venv`, then `uv pip install` from a copy of this working
tree, with pip's find-links as the Makefile passes them), one with the base install and one with `[server]`.

The base venv speaks the tiny export (zero-shot, --stream, a clone with --ref-audio and --save-voice, the saved
voice) through the console script's main, with no torch, transformers, onnxruntime_genai, olive or ray imported,
and none of the heavy distributions installed; every command whose extra it lacks prints the one line and exits 2.
The server venv answers POST /v1/audio/speech with a wav.

Measured here (2 vCPU, uv's cache warm, 2026-12): the base venv 245 MB (`du -sb`, without pip, bytecode compiled;
267 MB with the pip and setuptools a plain `python -m venv` adds), installed in 5 to 7 s; base + [server] 328 MB
(bytecode not compiled) in 3 to 9 s; the full .venv of requirements.txt is 3.06 GB, so the base install is 8 % of
it. The test prints its figures; the whole module runs in ~50 s once the session's exports exist.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import soundfile as sf
from servers import served

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
UV = Path(sys.executable).parent / "uv"  # installed by `make venv` (uv==0.13.8)
FULL_VENV_BYTES = 3_058_527_145  # `du -sb .venv` of requirements.txt, measured 2026-12 (the budget's 10 % base)
NEVER = ("torch", "transformers", "onnxruntime_genai", "olive", "ray")  # modules speaking must not import
HEAVY = {"torch", "transformers", "olive-ai", "onnxruntime-genai", "ray", "openvino", "nncf", "playwright", "pytest",
         "matplotlib", "fastapi", "uvicorn", "scipy"}
# speak with the console script's own main, several jobs in one process, then list what got imported
DRIVER = """
import json, sys
from higgs_onnx.entry_points import speak
jobs, never, codes = json.loads(sys.argv[1]), set(json.loads(sys.argv[2])), []
for argv in jobs:
    sys.argv = ["higgs-onnx-speak", *argv]
    codes.append(speak())
print(json.dumps({"codes": codes, "imported": sorted(m for m in sys.modules if m.split(".")[0] in never)}))
"""


def clean_env() -> dict[str, str]:
    """The environment without this venv or the checkout on the path: the installed package is what runs."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def find_links() -> list[str]:
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    if not links:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True,
                           text=True)
        links = r.stdout.split() if r.returncode == 0 else []
    return [a for link in links for a in ("--find-links", link)]


def copy_tree(dest: Path) -> Path:
    """The working tree as it is (tracked and untracked files git does not ignore), so the build sees no stale
    build/ folder and writes nothing into the checkout."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", "pyproject.toml", "*.py",
                            "higgs_onnx"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n")
    for f in filter(None, files):
        if (ROOT / f).is_file() and ("/" not in f or f.startswith("higgs_onnx/")):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


def du(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def make_venv(root: Path, name: str, spec: str, compile_bytecode: bool) -> tuple[Path, float, int]:
    """(venv python, install seconds, venv bytes) for `spec` (the copied tree, optionally with extras)."""
    assert UV.is_file(), f"{UV} is missing: make venv installs uv"
    venv = root / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    t0 = time.perf_counter()
    subprocess.run([str(UV), "pip", "install", "-q", *(["--compile-bytecode"] if compile_bytecode else []),
                    "--python", str(venv / "bin" / "python"), *find_links(), spec], check=True, env=clean_env())
    seconds = time.perf_counter() - t0
    size = du(venv)
    print(f"\n{name}: {spec.split('/')[-1]} installed in {seconds:.1f} s, {size / 1e6:.0f} MB "
          f"({100 * size / FULL_VENV_BYTES:.1f} % of the full .venv)")
    return venv / "bin" / "python", seconds, size


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return copy_tree(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def base(tmp_path_factory, src) -> tuple[Path, float, int]:
    return make_venv(tmp_path_factory.mktemp("venvs"), "base", str(src), compile_bytecode=True)


@pytest.fixture(scope="module")
def server_venv(tmp_path_factory, src) -> Path:
    return make_venv(tmp_path_factory.mktemp("venvs"), "server", f"{src}[server]", compile_bytecode=False)[0]


def installed(python: Path) -> set[str]:
    r = subprocess.run([str(UV), "pip", "list", "--format", "json", "--python", str(python)], capture_output=True,
                       text=True, check=True, env=clean_env())
    return {p["name"].lower().replace("_", "-") for p in json.loads(r.stdout)}


def test_base_install_is_small_and_light(base):
    python, seconds, size = base
    names = installed(python)
    assert "higgs-onnx" in names and {"onnxruntime", "numpy", "tokenizers", "huggingface-hub"} <= names
    assert not names & HEAVY, f"the base install pulled {sorted(names & HEAVY)}"
    assert size < 0.10 * FULL_VENV_BYTES, f"the base venv is {size / 1e6:.0f} MB"


def jobs(model: Path, out: Path) -> list[list[str]]:
    ref = ["--ref-audio", str(DATA / "ref_en_24k.wav"), "--ref-text", (DATA / "ref_en_24k.txt").read_text().strip()]
    m = ["--model-path", str(model)]
    return [[*m, "--text", "Hello from the base install.", "--out", str(out / "zero.wav")],
            [*m, "--text", "Streamed as it is made.", "--stream", "--out", str(out / "stream.wav")],
            [*m, *ref, "--text", "New words.", "--save-voice", str(out / "me.npz"), "--out", str(out / "clone.wav")],
            [*m, "--voice", str(out / "me.npz"), "--text", "Again.", "--out", str(out / "voice.wav")]]


def speak_and_list(python: Path, model: Path, out: Path, cwd: Path, env: dict[str, str]) -> dict:
    out.mkdir()
    r = subprocess.run([str(python), "-c", DRIVER, json.dumps(jobs(model, out)), json.dumps(NEVER)], cwd=cwd,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["codes"] == [0, 0, 0, 0], r.stderr[-3000:]
    for name in ("zero", "stream", "clone", "voice"):
        info = sf.info(out / f"{name}.wav")
        assert info.samplerate == 24000 and info.frames > 2400, name
    assert (out / "me.npz").is_file()
    return result


def test_base_install_speaks_without_torch(base, builds, tmp_path):
    result = speak_and_list(base[0], builds["int4"], tmp_path / "out", tmp_path, clean_env())
    assert result["imported"] == []


def test_speaking_imports_no_heavy_module_where_all_are_installed(builds, tmp_path):
    """The same jobs in this checkout's full venv, where torch, Ray, ... are installed: still none is imported."""
    result = speak_and_list(Path(sys.executable), builds["int4"], tmp_path / "out", ROOT, os.environ.copy())
    assert result["imported"] == []


def run_script(python: Path, script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = python.parent / script
    return subprocess.run([str(exe), *args], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=120)


def test_missing_extras_say_so_in_one_line(base, builds, tmp_path):
    python, model = base[0], str(builds["int4"])
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "Hi."}\n')
    cases = [
        (["higgs-onnx-serve", "--model-path", model], "the server", "server", "fastapi"),
        (["python", "-m", "higgs_onnx.serve", "--model-path", model], "the server", "server", "fastapi"),
        (["higgs-onnx-wyoming", "--model-path", model, "--uri", "tcp://127.0.0.1:0"], "the Wyoming server", "server",
         "wyoming"),
        (["higgs-onnx-corpus", "--model-path", model, "--input", str(rows), "--out", str(tmp_path / "c")],
         "the corpus command", "ray", "ray"),
        (["higgs-onnx-build", "--synthetic", "tiny", "--output", str(tmp_path / "b")], "building an export", "export",
         "torch"),
        (["higgs-onnx-eval", "--model-path", model], "the eval report (its PyTorch reference)", "eval", "torch"),
        (["higgs-onnx-speak", "--model-path", model, "--text", "It costs $5.", "--normalize", "--out",
          str(tmp_path / "n.wav")], "--normalize", "text", "num2words"),
        (["higgs-onnx-speak", "--model-path", model, "--text", "Hi.", "--loudness", "-16", "--out",
          str(tmp_path / "l.wav")], "--loudness", "loudness", "pyloudnorm"),
    ]
    for argv, what, extra, package in cases:
        r = run_script(python, *argv, cwd=tmp_path) if argv[0] != "python" else subprocess.run(
            [str(python), *argv[1:]], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (argv, r.returncode, r.stderr[-2000:])
        assert lines[0].startswith(f"higgs-onnx: {what} needs extra packages: pip install 'higgs-onnx[{extra}]' "
                                   f"(missing: "), lines[0]
        assert package in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "n.wav").exists() and not (tmp_path / "b").exists()


def test_every_help_works_in_the_base_install(base, tmp_path):
    """--help of every console script prints its help (exit 0) where its extra is missing; higgs-onnx-build's names
    the extra its options need (the optimize.py parser imports torch)."""
    for script in ("higgs-onnx-speak", "higgs-onnx-build", "higgs-onnx-eval", "higgs-onnx-serve",
                   "higgs-onnx-wyoming", "higgs-onnx-corpus"):
        r = run_script(base[0], script, "--help", cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.startswith("usage: ") and "Traceback" not in r.stderr, (script,
                                                                                                   r.stderr[-2000:])
    r = run_script(base[0], "higgs-onnx-build", "-h", cwd=tmp_path)
    assert r.returncode == 0 and "higgs-onnx-build --synthetic tiny --device cpu --precision int4" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("Listing every option (higgs-onnx-build --help) needs extra packages: "
                                                "pip install 'higgs-onnx[export]' (missing: torch")


def test_server_extra_serves_speech(server_venv, builds, tmp_path):
    names = installed(server_venv)
    assert {"fastapi", "uvicorn", "av", "wyoming"} <= names and not names & (HEAVY - {"fastapi", "uvicorn"})
    with served(builds["int4"], tmp_path, python=server_venv, cwd=tmp_path, env=clean_env()) as server:
        body = json.dumps({"model": "tts-1", "input": "Hello from the installed server.", "voice": "alloy",
                           "response_format": "wav"}).encode()
        req = urllib.request.Request(f"{server.url}/v1/audio/speech", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("audio/wav")
            audio = resp.read()
        # a request asking for work of an extra this install lacks: refused by name, before any work
        for field, value, extra in (("normalize", "en", "text"), ("ssml", True, "text"),
                                    ("caption_level", "word", "asr"), ("loudness", -16, "loudness")):
            bad = json.dumps({"model": "tts-1", "input": "It costs 5 dollars.", "voice": "alloy",
                              field: value}).encode()
            req = urllib.request.Request(f"{server.url}/v1/audio/speech", data=bad,
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=60)
            err = json.loads(e.value.read())["error"]
            assert e.value.code == 400 and err["param"] == field, err
            assert f"needs extra packages: pip install 'higgs-onnx[{extra}]'" in err["message"], err
    (tmp_path / "speech.wav").write_bytes(audio)
    info = sf.info(tmp_path / "speech.wav")
    assert audio[:4] == b"RIFF" and info.samplerate == 24000 and info.frames > 2400


# -- (a) an export served by the (fake) Hub, (b) a folder in the community layout: in the fresh venvs ---------------
@pytest.fixture(scope="module")
def hub_and_community(builds, tiny_ckpt, tmp_path_factory) -> tuple[dict[str, str], str, Path]:
    """(the environment that points huggingface_hub at a fake Hub on loopback holding the tiny int4 export as
    `org/tts/cpu_int4`, its reference, a community-layout folder with float16 decoder I/O and fused norms)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from community_layout import write_community
    from fakehub import FakeHub

    tmp = tmp_path_factory.mktemp("hubinstall")
    hub = FakeHub(tmp / "served")
    hub.add_folder("org/tts", builds["int4"], "cpu_int4")
    community = write_community(builds["fp32"], tmp / "cuda_fp16", decoder="fp16", ckpt=tiny_ckpt,
                                fused_norm=True, work=tmp / "work")
    env = {**clean_env(), "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf"), "HF_HUB_DISABLE_XET": "1",
           "HIGGS_CACHE": str(tmp / "higgs")}
    yield env, "hf://org/tts/cpu_int4", community
    hub.close()


def test_base_install_speaks_from_the_hub_and_a_community_folder(base, hub_and_community, tmp_path):
    """zero-shot, --stream, a clone, a saved voice: an hf:// reference (fetched once, then offline from the cache)
    and a community-layout folder, in the base venv, with no torch (or other heavy module) imported."""
    env, ref, community = hub_and_community
    for name, model, extra in (("hub", ref, {}), ("offline", ref, {"HF_HUB_OFFLINE": "1"}),
                               ("community", community, {})):
        result = speak_and_list(base[0], model, tmp_path / name, tmp_path, {**env, **extra})
        assert result["imported"] == [], name


def test_server_extra_serves_the_hub_and_a_community_folder(server_venv, hub_and_community, tmp_path):
    """POST /v1/audio/speech: a wav, a streamed pcm body and a clone (Boson's ref_audio), from both."""
    import base64

    env, ref, community = hub_and_community
    clip = base64.b64encode((DATA / "ref_en_24k.wav").read_bytes()).decode()
    for name, model in (("hub", ref), ("community", community)):
        with served(model, tmp_path / name, python=server_venv, cwd=tmp_path, env=env) as server:
            for fields, kind in (({"response_format": "wav"}, "audio/wav"), ({"response_format": "pcm"}, "audio/pcm"),
                                 ({"response_format": "wav", "ref_audio": clip,
                                   "ref_text": (DATA / "ref_en_24k.txt").read_text().strip()}, "audio/wav")):
                body = json.dumps({"model": "tts-1", "input": "Hello from an export I did not build.", **fields})
                req = urllib.request.Request(f"{server.url}/v1/audio/speech", data=body.encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as resp:
                    assert resp.status == 200 and resp.headers["Content-Type"].startswith(kind), (name, fields)
                    assert len(resp.read()) > 4800, (name, kind)
