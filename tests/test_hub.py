"""Exports on the Hub (docs/hub.md): `hf://ORG/REPO/FOLDER@REVISION` at every door and `optimize.py --push-to-hub`,
against a fake Hub on loopback (tests/fakehub.py: real HTTP, the endpoints huggingface_hub calls). The commands
run as subprocesses with HF_ENDPOINT pointing at it, HF_HOME in a temporary folder: the network is what is
replaced, nothing else. Uploads go over LFS (HF_HUB_DISABLE_XET=1: the fake Hub speaks no Xet).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fakehub import FakeHub

from higgs_onnx.hub import HubError, HubRef, model_path_arg, parse

REPO = Path(__file__).resolve().parents[1]
TOKEN = "hf_test_write_token"
PARTS = ("text_embed", "audio_encoder", "audio_embed", "llm_decoder", "audio_heads", "audio_tokenizer")


# -- the reference's syntax ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("ref, want", [
    ("hf://org/repo/cpu_int4", HubRef("org/repo", "cpu_int4", None)),
    ("hf://org/repo/cpu_int4@v1.2", HubRef("org/repo", "cpu_int4", "v1.2")),
    ("hf://org/repo/a/b/cuda_fp16/", HubRef("org/repo", "a/b/cuda_fp16", None)),
    ("hf://org/repo", HubRef("org/repo", "", None)),
    ("hf://org/repo@refs/pr/3", HubRef("org/repo", "", "refs/pr/3")),
    ("hf://onnx-community/higgs-audio-v3-tts-4b/cuda_int4@" + "a" * 40,
     HubRef("onnx-community/higgs-audio-v3-tts-4b", "cuda_int4", "a" * 40)),
])
def test_parse(ref, want):
    assert parse(ref) == want
    assert parse(str(want)) == want  # str() writes the one form back


@pytest.mark.parametrize("ref, says", [
    ("hf://org/repo@v1/cpu_int4", "the revision goes at the end: hf://org/repo/cpu_int4@v1"),
    ("hf://org", "expected hf://ORG/REPO/FOLDER@REVISION"),
    ("hf:/org/repo/cpu_int4", "is not a Hub reference"),  # what Path("hf://...") folds it into
    ("hf:org/repo", "is not a Hub reference"),
    ("hf://org//cpu_int4", "expected hf://ORG/REPO"),
    ("hf://org/re po/x", "'re po' is not a valid repo or folder name"),
    ("hf://org/repo/../x", "'..' is not a valid"),
    ("hf://org/repo/x@a@b", "is not a revision"),
    ("hf://org/repo/x@..", "'..' is not a revision"),
    ("hf://org/repo/x@.", "'.' is not a revision"),
    ("hf://org/repo/x@../main", "'../main' is not a revision"),
    ("hf://org/repo/x@refs/pr/..", "is not a revision"),
    ("hf://org/repo.git/x", "hf://org/repo.git/x: not a valid repo id"),
    ("hf://org/" + "r" * 2000 + "/x", "(2011 characters): not a valid repo id"),
])
def test_parse_refuses(ref, says):
    with pytest.raises(HubError, match=re.escape(says)):
        parse(ref)


def test_model_path_arg_keeps_the_double_slash():
    import argparse

    assert model_path_arg("hf://org/repo/cpu_int4") == "hf://org/repo/cpu_int4"
    assert model_path_arg("onnx/cpu_int4") == Path("onnx/cpu_int4")
    with pytest.raises(argparse.ArgumentTypeError, match="an empty path"):
        model_path_arg("")


def test_a_path_that_folded_a_reference_is_told_to_be_a_string():
    from higgs_onnx.hub import local

    with pytest.raises(HubError, match=re.escape("pass the Hub reference as a string: 'hf://org/repo/cpu_int4'")):
        local(Path("hf://org/repo/cpu_int4"))


# -- the fake Hub and the commands ---------------------------------------------------------------------------------
def hub_env(hub: FakeHub, home: Path, token: str | None = TOKEN, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home / "hf"), HIGGS_CACHE=str(home / "higgs"), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", CI="1")
    if token:
        env["HF_TOKEN"] = token
    env.update(extra)
    return env


def command(args: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def one_line(r: subprocess.CompletedProcess) -> str:
    """The command failed with exit 2 and one line on stderr, no traceback; returns it."""
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    return lines[0]


def fake_export(folder: Path, big: int = 4096) -> Path:
    """A folder with an export's file names (not loadable: these tests end before the model loads)."""
    folder.mkdir(parents=True)
    for name in ("manifest.json", "tokenizer.json"):
        (folder / name).write_text("{}")
    for part in PARTS:
        (folder / f"{part}.onnx").write_bytes(b"onnx")
        (folder / f"{part}.onnx.data").write_bytes(bytes(big))
    return folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fakehub")
    hub = FakeHub(tmp / "served", token=TOKEN)
    src = tmp / "src"
    for name in ("cpu_int4", "cuda_fp16"):
        hub.add_folder("org/exports", fake_export(src / name), name)
    broken = src / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{}")
    (broken / "llm_decoder.onnx").write_bytes(b"onnx")
    (broken / "llm_decoder.onnx.data").write_bytes(bytes(1 << 20))
    hub.add_folder("org/exports", broken, "broken")
    hub.add_folder("org/private", src / "cpu_int4", "cpu_int4", private=True)
    hub.add_folder("org/gated", src / "cpu_int4", "cpu_int4", gated=True)
    yield hub
    hub.close()


def speak(ref: str, env: dict, out: Path) -> subprocess.CompletedProcess:
    return command(["inference.py", "--model-path", ref, "--text", "Hello there.", "--out", str(out)], env)


@pytest.mark.parametrize("ref, token, says", [
    ("hf://org/missing/cpu_int4", TOKEN, "no repo org/missing on http://127.0.0.1:"),
    ("hf://org/exports/cpu_int8", TOKEN, "org/exports has no folder cpu_int8; exports there: cpu_int4, cuda_fp16"),
    ("hf://org/exports/cpu_int4@v9", TOKEN, "org/exports has no revision 'v9'"),
    ("hf://org/private/cpu_int4", None, "or it is private and no token with access was sent: set HF_TOKEN"),
    ("hf://org/private/cpu_int4", "hf_wrong", "refused the token (401): set HF_TOKEN to a valid token"),
    ("hf://org/gated/cpu_int4", None, "org/gated is gated: accept its terms"),
    ("hf://org/exports@v1/cpu_int4", TOKEN, "the revision goes at the end"),
])
def test_refused_in_one_line(hub, tmp_path, ref, token, says):
    line = one_line(speak(ref, hub_env(hub, tmp_path, token), tmp_path / "x.wav"))
    assert says in line and line.startswith("error: "), line
    assert not (tmp_path / "x.wav").exists()


def test_not_an_export_is_refused_before_its_big_files(hub, tmp_path):
    before = len(hub.requests)
    line = one_line(speak("hf://org/exports/broken", hub_env(hub, tmp_path), tmp_path / "x.wav"))
    assert "broken is not a higgs-onnx export (no tokenizer.json, text_embed.onnx" in line, line
    assert "exports there: cpu_int4, cuda_fp16" in line
    served = hub.requests[before:]
    fetched = [p for m, p in served if "/resolve/" in p]  # the listing and the (small) manifest: which layout?
    assert served and fetched and all(p.endswith("/broken/manifest.json") for p in fetched), fetched


def test_offline_with_nothing_cached(hub, tmp_path):
    line = one_line(speak("hf://org/exports/cpu_int4", hub_env(hub, tmp_path, HF_HUB_OFFLINE="1"), tmp_path / "x.wav"))
    assert "HF_HUB_OFFLINE=1 and hf://org/exports/cpu_int4 is not in the cache" in line and "run once online" in line


def test_a_token_lets_a_private_export_through(hub, tmp_path):
    """The fetch succeeds (the folder is fetched, the commit named); the fake export then fails to load."""
    r = speak("hf://org/private/cpu_int4", hub_env(hub, tmp_path), tmp_path / "x.wav")
    commit = hub.repos["org/private"].branches["main"]
    assert f"model: hf://org/private/cpu_int4@main at commit {commit[:12]} -> " in r.stderr, r.stderr[-2000:]
    got = tmp_path / "hf" / "hub" / "models--org--private" / "snapshots" / commit / "cpu_int4"
    assert sorted(p.name for p in got.iterdir()) == sorted(p.split("/")[1] for p in hub.files("org/private"))
    assert r.returncode != 0 and "Traceback" not in r.stderr


# -- publishing the tiny export and running it from the Hub at every door --------------------------------------
@pytest.fixture(scope="module")
def published(builds, out_root, tmp_path_factory, route_crossover):
    """The session's tiny int4 export pushed by `optimize.py --push-to-hub` (the build is up to date: the same
    output root and crossover as `builds`) to a fresh fake Hub; (hub, home for HF_HOME/HIGGS_CACHE, push result)."""
    tmp = tmp_path_factory.mktemp("published")
    hub = FakeHub(tmp / "served", token=TOKEN)
    given = ["none" if v is None else str(v) for v in route_crossover]
    r = command(["optimize.py", "--synthetic", "tiny", "--device", "cpu", "--precision", "int4", "--output",
                 str(out_root), "--route-crossover", *given, "--push-to-hub", "org/tts"],
                hub_env(hub, tmp, HIGGS_PART_CACHE=os.environ.get("HIGGS_PART_CACHE", "")))
    yield hub, tmp, r
    hub.close()


def _exported(folder: Path) -> list[str]:
    """The export's files as the Hub gets them: not the dot files a load writes beside it (the hashes' verdicts)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def _same_files(a: Path, b: Path) -> None:
    names = _exported(a)
    assert names == _exported(b)
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.mark.slow
def test_push_uploads_the_export_and_its_card(published, builds):
    hub, _, r = published
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "up to date" in r.stdout and "pushed " in r.stdout and "hf://org/tts/cpu_int4" in r.stdout
    files = hub.files("org/tts")
    local = _exported(builds["int4"])
    assert ".higgs-verified.json" not in {p.rsplit("/", 1)[-1] for p in files}  # local identities stay local
    assert sorted(p for p in files if p != "README.md") == [f"cpu_int4/{n}" for n in local]
    for n in local:
        assert files[f"cpu_int4/{n}"] == (builds["int4"] / n).read_bytes(), n
    assert [p for m, p in hub.requests if m == "PUT" and p.startswith("/_lfs/")]  # the parts went over LFS
    card = files["README.md"].decode()
    for want in ("library_name: onnxruntime", "pipeline_tag: text-to-speech", "base_model: bosonai/higgs-tts-3-4b",
                 "license: other", "- onnx", "**Synthetic weights** (tiny)",
                 "python inference.py --model-path hf://org/tts/cpu_int4 --text",
                 "| llm_decoder | int4 | llm_decoder.onnx, llm_decoder.onnx.data",
                 "- KV cache int8 (PER_CHANNEL): hidden cosine 0.9", "(gate >= 0.9",
                 "- int8 route (int8-gemm) against fp32, worst prompt: int4: top-1",
                 "route crossover: one-row calls from 64 positions, batched steps never; given at build"):
        assert want in card, want


@pytest.mark.slow
def test_speak_from_the_hub_then_offline(published, builds, tmp_path):
    import soundfile as sf

    hub, home, _ = published
    env = hub_env(hub, home)
    commit = hub.repos["org/tts"].branches["main"]
    r = speak("hf://org/tts/cpu_int4", env, tmp_path / "a.wav")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"model: hf://org/tts/cpu_int4@main at commit {commit[:12]} -> " in r.stderr
    snapshot = home / "hf" / "hub" / "models--org--tts" / "snapshots" / commit
    _same_files(snapshot / "cpu_int4", builds["int4"])
    assert sorted(p.name for p in snapshot.iterdir()) == ["cpu_int4"]  # the folder only (not README.md)
    audio, rate = sf.read(tmp_path / "a.wav")
    assert rate == 24000 and len(audio) > 2400
    served = len(hub.requests)
    r = speak("hf://org/tts/cpu_int4", {**env, "HF_HUB_OFFLINE": "1"}, tmp_path / "b.wav")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"at commit {commit[:12]}" in r.stderr and len(hub.requests) == served  # the cache alone
    assert (tmp_path / "b.wav").read_bytes() == (tmp_path / "a.wav").read_bytes()  # the same seed, the same bytes
    line = one_line(speak("hf://org/tts/cpu_int8", env, tmp_path / "c.wav"))
    assert "org/tts has no folder cpu_int8; exports there: cpu_int4" in line


def _started(cmd: list[str], env: dict, ready: str, log: Path, timeout: float = 180) -> tuple[subprocess.Popen, str]:
    import queue
    import threading
    import time

    proc = subprocess.Popen([sys.executable, *cmd], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log.open("w"),
                            text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if ready in line:
            return proc, line
    proc.kill()
    pytest.fail(f"{cmd[:2]} did not start:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_server_and_wyoming_from_the_hub(published, tmp_path):
    import socket

    import httpx2

    hub, home, _ = published
    env = hub_env(hub, home)
    proc, line = _started(["-m", "higgs_onnx.serve", "--model-path", "hf://org/tts/cpu_int4", "--port", "0"], env,
                          "http://", tmp_path / "serve.log")
    try:
        url = re.search(r"http://[^/\s]+", line).group(0)
        r = httpx2.post(f"{url}/v1/audio/speech", json={"model": "higgs-tts-3", "voice": "default",
                                                          "input": "Hello there.", "response_format": "wav"},
                        timeout=300)
        assert r.status_code == 200 and r.content[:4] == b"RIFF", r.text[:500]
        source = httpx2.get(f"{url}/health", timeout=30).json()["source"]  # where the model came from
        assert source == {"repo_id": "org/tts", "folder": "cpu_int4", "revision": "main",
                          "commit": hub.repos["org/tts"].branches["main"]}
    finally:
        proc.terminate()
        proc.wait(60)
    assert "model: hf://org/tts/cpu_int4@main at commit" in (tmp_path / "serve.log").read_text()
    assert (home / "higgs" / "voices" / "org--tts--cpu_int4").is_dir()  # the voices folder: ours, not the download
    commit = hub.repos["org/tts"].branches["main"]
    assert not (home / "hf" / "hub" / "models--org--tts" / "snapshots" / commit / "cpu_int4" / "voices").exists()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, line = _started(["-m", "higgs_onnx.wyoming", "--model-path", "hf://org/tts/cpu_int4", "--uri",
                           f"tcp://127.0.0.1:{port}"], env, "Wyoming server on", tmp_path / "wyoming.log")
    proc.terminate()
    proc.wait(60)
    assert "voices: default" in line


@pytest.mark.slow
def test_corpus_and_eval_take_the_reference(published, tmp_path):
    hub, home, _ = published
    env = hub_env(hub, home)
    r = command(["-m", "higgs_onnx.corpus", "--model-path", "hf://org/tts/cpu_int4", "--input",
                 str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "out")], env)
    assert "model: hf://org/tts/cpu_int4@main at commit" in r.stderr  # resolved on the driver, before Ray
    assert r.returncode == 2 and "none.jsonl" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    line = one_line(command(["eval.py", "--model-path", "hf://org/tts/cuda_fp16"], env))
    assert "org/tts has no folder cuda_fp16; exports there: cpu_int4" in line


def test_origin_read_from_the_hub_cache_path(tmp_path):
    """A process handed the local folder (a Ray replica) still knows the repo, folder and commit it is."""
    from higgs_onnx.hub import origin_of

    commit = "0123456789abcdef0123456789abcdef01234567"
    got = origin_of(tmp_path / "hub" / "models--org--my-repo" / "snapshots" / commit / "a" / "cpu_int4")
    assert (got.repo_id, got.folder, got.commit) == ("org/my-repo", "a/cpu_int4", commit)
    assert origin_of(tmp_path / "cpu_int4") is None
    assert origin_of(tmp_path / "models--org--x" / "snapshots" / "main" / "cpu_int4") is None


# -- a Hub that misbehaves (tests/fakehub.py's BadProxy in front of the fake Hub) ------------------------------------
@pytest.fixture()
def bad(hub):
    from fakehub import BadProxy

    proxy = BadProxy(hub)
    yield proxy
    proxy.close()


def _blobs(home: Path) -> dict[str, bytes]:
    folder = home / "hf" / "hub" / "models--org--exports" / "blobs"
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}


def test_ctrl_c_stops_a_stalled_download_and_the_rerun_finishes(hub, bad, tmp_path):
    import signal
    import time

    bad.mode = "stall"
    env = hub_env(hub, tmp_path, HF_ENDPOINT=bad.url)
    cmd = [sys.executable, "inference.py", "--model-path", "hf://org/exports/cpu_int4", "--text", "Hi.", "--out",
           str(tmp_path / "x.wav")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while bad.seen == 0 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert bad.seen >= 1, "the download never reached a .data file"
    time.sleep(0.5)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - sent < 10, (proc.returncode, err[-2000:])
    assert err.strip().splitlines() == ["interrupted"], err[-2000:]  # no traceback, none of the stall's retries
    bad.mode = "ok"
    r = speak("hf://org/exports/cpu_int4", env, tmp_path / "x.wav")
    assert "model: hf://org/exports/cpu_int4@main at commit" in r.stderr, r.stderr[-2000:]
    assert set(_blobs(tmp_path).values()) == {data for f, data in hub.files("org/exports").items()
                                              if f.startswith("cpu_int4/")}


def test_a_corrupt_download_never_stays_in_the_cache(hub, bad, tmp_path):
    """Bytes flipped on every try: one line, and no corrupt blob left; flipped once: fetched again, silently."""
    bad.mode = "lie"
    env = hub_env(hub, tmp_path, HF_ENDPOINT=bad.url)
    line = one_line(speak("hf://org/exports/cpu_int4", env, tmp_path / "x.wav"))
    assert "the Hub served a corrupt cpu_int4/" in line and ".onnx.data (sha256 " in line, line
    assert "removed from the cache; run again" in line
    import hashlib

    assert all(hashlib.sha256(b).hexdigest() == name or len(name) != 64 for name, b in _blobs(tmp_path).items())
    bad.mode, bad.seen = "lie-once", 0
    r = speak("hf://org/exports/cpu_int4", env, tmp_path / "x.wav")
    assert "model: hf://org/exports/cpu_int4@main at commit" in r.stderr, r.stderr
    assert "served a corrupt" not in r.stderr, r.stderr
    commit = hub.repos["org/exports"].branches["main"]
    got = tmp_path / "hf" / "hub" / "models--org--exports" / "snapshots" / commit / "cpu_int4"
    for f, data in hub.files("org/exports").items():
        if f.startswith("cpu_int4/"):
            assert (got / f.split("/")[1]).read_bytes() == data, f


def test_an_unreachable_hub_falls_back_to_the_cache_in_one_line(hub, bad, tmp_path):
    import time

    env = hub_env(hub, tmp_path)
    r = speak("hf://org/exports/cpu_int4", env, tmp_path / "x.wav")
    assert "model: hf://org/exports/cpu_int4@main" in r.stderr, r.stderr[-2000:]
    served = len(hub.requests)
    t = time.monotonic()
    r = speak("hf://org/exports/cpu_int4", {**env, "HF_ENDPOINT": "http://127.0.0.1:1"}, tmp_path / "x.wav")
    lines = r.stderr.strip().splitlines()
    assert time.monotonic() - t < 15 and len(hub.requests) == served, r.stderr
    assert lines[0].startswith("warning: cannot reach http://127.0.0.1:1 (") and \
        "used hf://org/exports/cpu_int4 from the cache (as HF_HUB_OFFLINE=1 would)" in lines[0], lines
    assert lines[1].startswith("model: hf://org/exports/cpu_int4@main at commit") and len(lines) == 3, lines
    assert "huggingface_hub" not in r.stderr  # its own retries and fallbacks are not printed (nor twice)
    bad.mode = "500"  # down, and this one never fetched: one line
    line = one_line(speak("hf://org/exports/cuda_fp16", {**env, "HF_ENDPOINT": bad.url}, tmp_path / "y.wav"))
    assert "hf://org/exports/cuda_fp16: cannot fetch it from " in line and "500 Internal Server Error" in line, line
    assert "it is not complete in the cache: check the network" in line  # main is cached: cpu_int4's fetch


def test_bench_refuses_a_reference_in_one_line(hub, tmp_path):
    line = one_line(command(["benchmarks/bench.py", "--model-path", "hf://org/exports/nope"], hub_env(hub, tmp_path)))
    assert "org/exports has no folder nope; exports there: cpu_int4, cuda_fp16" in line, line


# -- pushing: refusals before any work, two folders and a branch in one repo -------------------------------------
def ours(folder: Path, device: str, precision: str) -> Path:
    fake_export(folder)
    (folder / "manifest.json").write_text(json.dumps({"schema_version": 1, "device": device, "precision": precision}))
    return folder


def push_cmd(folder: Path, repo: str, env: dict, revision: str | None = None) -> subprocess.CompletedProcess:
    code = f"from higgs_onnx.hub import push; push({str(folder)!r}, {repo!r}, revision={revision!r})"
    return command(["-c", "import sys\nfrom higgs_onnx.hub import HubError\ntry:\n    " + code +
                    "\nexcept HubError as e:\n    print(f'error: {e}', file=sys.stderr); sys.exit(2)"], env)


@pytest.mark.parametrize("args, says", [
    (["--push-to-hub", "org/ok.git"], "--push-to-hub 'org/ok.git' is not a repo id: ORG/REPO"),
    (["--push-to-hub", "org/" + "r" * 300], "is not a repo id: ORG/REPO"),
    (["--push-to-hub", "org/x", "--hub-revision", "my/branch"], "--hub-revision 'my/branch' is not a branch name"),
    (["--push-to-hub", "org/x", "--hub-revision", ".."], "--hub-revision '..' is not a branch name"),
])
def test_push_arguments_refused_before_the_build(hub, tmp_path, args, says):
    line = one_line(command(["optimize.py", "--synthetic", "tiny", "--device", "cpu", "--precision", "int4",
                             "--output", str(tmp_path / "onnx"), *args], hub_env(hub, tmp_path), timeout=120))
    assert says in line, line
    assert not (tmp_path / "onnx").exists()


def test_push_refuses_what_is_not_our_export(hub, tmp_path):
    env = hub_env(hub, tmp_path)
    bad_json = ours(tmp_path / "a" / "cpu_int4", "cpu", "int4")
    (bad_json / "manifest.json").write_text("{not json")
    assert "manifest.json is not a JSON object" in one_line(push_cmd(bad_json, "org/pushed", env))
    community = ours(tmp_path / "b" / "cpu_fp32", "cpu", "fp32")
    (community / "manifest.json").write_text(json.dumps({"device": "cpu", "sub_models": {}}))
    line = one_line(push_cmd(community, "org/pushed", env))
    assert "is not a higgs-onnx export (its manifest.json has no schema_version)" in line, line
    assert "org/pushed" not in hub.repos


def test_push_two_folders_then_a_branch_keeps_every_section(hub, tmp_path):
    env = hub_env(hub, tmp_path)
    int4, fp16 = ours(tmp_path / "cpu_int4", "cpu", "int4"), ours(tmp_path / "cuda_fp16", "cuda", "fp16")
    for folder in (int4, fp16):
        r = push_cmd(folder, "org/two", env)
        assert r.returncode == 0 and f"pushed {folder} -> hf://org/two/{folder.name}" in r.stdout, r.stderr[-2000:]
        assert f"pushing {folder} to hf://org/two/{folder.name}: 14 files" in r.stdout
    r = push_cmd(int4, "org/two", env, revision="dev")
    assert r.returncode == 0 and "-> hf://org/two/cpu_int4@dev" in r.stdout, r.stderr[-2000:]
    for branch in ("main", "dev"):
        files = hub.files("org/two", branch)
        card = files["README.md"].decode()
        assert "## cpu_int4" in card and "## cuda_fp16" in card, (branch, card)
        assert sorted({f.split("/")[0] for f in files}) == ["README.md", "cpu_int4", "cuda_fp16"]


def test_push_to_a_hub_that_fails_says_the_upload_failed(hub, bad, tmp_path):
    bad.mode = "500"
    line = one_line(push_cmd(ours(tmp_path / "cpu_int4", "cpu", "int4"), "org/down", hub_env(hub, tmp_path,
                                                                                               HF_ENDPOINT=bad.url)))
    assert "hf://org/down/cpu_int4: the upload to org/down failed (" in line and "nothing was committed" in line


@pytest.mark.slow
def test_community_folders_with_a_sub_folder_or_other_names_run_from_the_hub(builds, tmp_path):
    """A community-layout folder whose decoder sits in a `standalone_dir`, and one whose manifest names other file
    names: the manifest is fetched first and exactly the files it needs follow (not the stray one)."""
    import onnx
    import soundfile as sf
    from community_layout import with_standalone_dir, write_community

    sub = with_standalone_dir(write_community(builds["fp32"], tmp_path / "src" / "sub"))
    (sub / "notes.bin").write_bytes(bytes(1000))  # not named by the manifest: never fetched
    named = write_community(builds["fp32"], tmp_path / "src" / "named")
    graph = onnx.load(str(named / "text_embed.onnx"), load_external_data=False)
    for t in graph.graph.initializer:
        for d in t.external_data:
            if d.key == "location":
                d.value = "te.onnx.data"
    onnx.save(graph, str(named / "te.onnx"))
    (named / "text_embed.onnx").unlink()
    (named / "text_embed.onnx.data").rename(named / "te.onnx.data")
    theirs = json.loads((named / "manifest.json").read_text())
    theirs["sub_models"]["text_embed"]["filename"] = "te.onnx"
    (named / "manifest.json").write_text(json.dumps(theirs))
    hub = FakeHub(tmp_path / "served", token=TOKEN)
    try:
        hub.add_folder("org/community", sub, "sub")
        hub.add_folder("org/community", named, "named")
        env = hub_env(hub, tmp_path)
        commit = hub.repos["org/community"].branches["main"]
        for folder in ("sub", "named"):
            r = speak(f"hf://org/community/{folder}", env, tmp_path / f"{folder}.wav")
            assert r.returncode == 0, (folder, r.stderr[-3000:])
            audio, rate = sf.read(tmp_path / f"{folder}.wav")
            assert rate == 24000 and len(audio) > 2400
            got = tmp_path / "hf" / "hub" / "models--org--community" / "snapshots" / commit / folder
            want = sorted(p.relative_to(tmp_path / "src" / folder).as_posix()
                          for p in (tmp_path / "src" / folder).rglob("*") if p.is_file() and p.name != "notes.bin")
            assert sorted(p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file()) == want
        assert not hub.gets(("notes.bin",))
    finally:
        hub.close()
