"""What stock applications send (issue: integrations), with their own request shapes: Open WebUI's list calls and its
speech request with OpenAI's voice names, the default voice they map to, AAC, and loudness normalisation in the
server, the command line (one file, one file per line, long-form) and the corpus."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from corpus_runs import corpus, manifest
from servers import DATA, QUICK, TEXT, assert_error, served

from higgs_onnx.loudness import measure

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
RATE = 24000
KEY = "webui-key"


@pytest.fixture(scope="module")
def webui(builds, tmp_path_factory):
    """A server with an API key whose default voice is a saved one (made here, before the server starts)."""
    from higgs_onnx.runtime.model import HiggsTTS

    tmp = tmp_path_factory.mktemp("webui")
    (tmp / "voices").mkdir()
    tts = HiggsTTS(builds["fp32"], verify=False)
    tts.make_voice(DATA / "ref_en_24k.wav", (DATA / "ref_en_24k.txt").read_text().strip()).save(
        tmp / "voices" / "narrator.npz")
    with served(builds["fp32"], tmp, "--default-voice", "narrator", "--api-key", KEY) as s:
        yield s


def test_open_webui_lists_and_speech(webui):
    """Open WebUI's backend (backend/open_webui/routers/audio.py) reads {"models": [{"id"}]} and {"voices": [{"id",
    "name"}]}, then posts {"input", "voice", "model"} with its key and saves the body as .mp3."""
    auth = {"Authorization": f"Bearer {KEY}"}
    models = webui.http.get("/v1/audio/models", headers=auth).json()
    assert {"tts-1", "higgs-tts-3"} <= {m["id"] for m in models.get("models", [])}
    voices = webui.http.get("/v1/audio/voices", headers=auth).json()
    available = {v["id"]: v["name"] for v in voices.get("voices", [])}  # Open WebUI's own line
    assert set(available) == {"default", "narrator"} and voices["default"] == "narrator"
    assert voices["aliases"]["alloy"] == "narrator"
    assert_error(webui.http.get("/v1/audio/voices"), 401)  # the key guards the lists too

    def say(voice) -> bytes:
        body = {"input": TEXT, "model": "tts-1", **({"voice": voice} if voice else {}), "seed": 2, **QUICK}
        r = webui.http.post("/v1/audio/speech", json=body, headers=auth)
        assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg", r.text
        return r.content

    alloy, nothing, narrator, zero_shot = say("alloy"), say(None), say("narrator"), say("default")
    assert alloy == nothing == narrator != zero_shot  # OpenAI's names and no voice: the server's default voice
    wav, sr = sf.read(io.BytesIO(alloy))
    assert sr == RATE and len(wav) > RATE // 4
    assert_error(webui.http.post("/v1/audio/speech", json={"input": TEXT, "model": "tts-1", "voice": "bob"},
                                 headers=auth), 400, "voice")


def test_a_missing_default_voice_stops_the_server_at_start(builds, tmp_path):
    r = subprocess.run([sys.executable, "-m", "higgs_onnx.serve", "--model-path", builds["fp32"], "--voices",
                        tmp_path, "--default-voice", "nobody", "--port", "0"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "--default-voice: unknown voice 'nobody'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_the_server_normalises_loudness_when_asked(webui):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"input": TEXT, "model": "tts-1", "voice": "default", "seed": 4, "response_format": "wav", **QUICK}
    plain = webui.http.post("/v1/audio/speech", json=body, headers=auth)
    for lufs in (-30.0, -20):
        r = webui.http.post("/v1/audio/speech", json={**body, "loudness": lufs}, headers=auth)
        assert r.status_code == 200, r.text
        wav, _ = sf.read(io.BytesIO(r.content), dtype="float32")
        assert abs(measure(wav, RATE) - lufs) < 0.2 and abs(float(r.headers["X-Loudness"]) - lufs) < 0.1
        assert len(r.content) == len(plain.content)  # the same take, one gain
    sse = webui.http.post("/v1/audio/speech", json={**body, "loudness": -25.0, "stream_format": "sse",
                                                    "response_format": "pcm"}, headers=auth)
    done = json.loads([x for x in sse.text.splitlines() if x.startswith("data: ")][-1][6:])
    assert done["loudness"]["target"] == -25.0 and abs(done["loudness"]["reached"] + 25.0) < 0.1
    for bad in (-90, 0, "loud", True):
        assert_error(webui.http.post("/v1/audio/speech", json={**body, "loudness": bad}, headers=auth), 400,
                     "loudness")


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "inference.py", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, **kw)


def test_the_command_line_normalises_every_output(builds, tmp_path):
    model = builds["int4"]
    r = run_cli("--model-path", model, "--text", TEXT, "--out", tmp_path / "one.wav", "--loudness", "-18")
    assert r.returncode == 0 and "-> -18.0 LUFS" in r.stderr, r.stderr
    wav, _ = sf.read(tmp_path / "one.wav")
    assert abs(measure(wav, RATE) + 18) < 0.2
    (tmp_path / "lines.txt").write_text("A first line of speech for the file.\nAnd a second, rather different one.\n")
    r = run_cli("--model-path", model, "--text-file", tmp_path / "lines.txt", "--out-dir", tmp_path / "lines",
                "--loudness", "-23")
    assert r.returncode == 0, r.stderr
    for f in sorted((tmp_path / "lines").glob("*.wav")):
        assert abs(measure(sf.read(f)[0], RATE) + 23) < 0.2, f
    (tmp_path / "long.txt").write_text("A long text in several pieces. " * 12)
    r = run_cli("--model-path", model, "--text-file", tmp_path / "long.txt", "--out", tmp_path / "long.wav",
                "--loudness", "-16")
    assert r.returncode == 0, r.stderr
    assert abs(measure(sf.read(tmp_path / "long.wav")[0], RATE) + 16) < 0.2
    for bad, want in ((["--loudness", "-3"], "from -70 to -5"), (["--loudness", "-16", "--stream"], "whole take"),
                      (["--loudness", "x"], "invalid float")):
        r = run_cli("--model-path", model, "--text", TEXT, "--out", tmp_path / "bad.wav", *bad)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "bad.wav").exists()


def test_the_corpus_normalises_every_file_and_records_it(builds, tmp_path):
    rows = [{"id": f"c{i}", "text": f"Corpus row {i} for the loudness check, a few words long.", "seed": i}
            for i in range(3)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = corpus("--model-path", builds["fp32"], "--input", tmp_path / "rows.jsonl", "--out", tmp_path / "out",
               "--loudness", "-20")
    assert r.returncode == 0, r.stderr
    entries = manifest(tmp_path / "out")
    assert len(entries) == 3
    for e in entries:
        wav, _ = sf.read(tmp_path / "out" / e["file"])
        assert abs(measure(wav, RATE) + 20) < 0.2 and e["loudness"]["target"] == -20.0
        assert np.isclose(e["loudness"]["reached"], -20.0, atol=0.05)
    bad = corpus("--model-path", builds["fp32"], "--input", tmp_path / "rows.jsonl", "--out", tmp_path / "o2",
                 "--loudness", "-1")
    assert bad.returncode == 2 and "from -70 to -5" in bad.stderr and not (tmp_path / "o2").exists()


def test_boson_and_sglang_request_shapes(webui):
    """Code written for Boson's hosted API or sglang-omni works by changing the base URL: the reference in the
    speech request (base64, data URI, sglang's references), stream: true as raw PCM, their field names; what cannot
    be honoured is a 400 naming the field."""
    import base64

    auth = {"Authorization": f"Bearer {KEY}"}
    clip = (DATA / "ref_en_24k.wav").read_bytes()
    b64 = base64.b64encode(clip).decode()
    said = (DATA / "ref_en_24k.txt").read_text().strip()
    base = {"model": "higgs-tts-3", "input": TEXT, "response_format": "pcm", "seed": 5, **QUICK}

    def post(path="/v1/audio/speech", **body):
        return webui.http.post(path, json=body, headers=auth)

    boson = post(**base, ref_audio=b64, ref_text=said, stream=True)
    assert boson.status_code == 200 and boson.headers["X-Sample-Rate"] == "24000", boson.text
    assert post(**base, ref_audio=f"data:audio/wav;base64,{b64}", ref_text=said).content == boson.content
    saved = post(**base, voice="narrator").content  # the same clip and transcript, saved as a voice
    assert saved == boson.content
    sglang = post(**{k: v for k, v in base.items() if k != "max_rows"}, max_new_tokens=QUICK["max_rows"],
                  references=[{"data": b64, "media_type": "audio/wav", "text": said}], repetition_penalty=1.0)
    assert sglang.status_code == 200 and sglang.content == boson.content, sglang.text
    for extra, param in (({"ref_audio": b64, "voice": "narrator"}, "voice"), ({"stream": True, "response_format":
                         "mp3"}, "stream"), ({"ref_audio": "https://example.com/a.wav"}, "ref_audio"),
                         ({"ref_audio": "not base64!"}, "ref_audio"), ({"ref_text": "hello"}, "ref_text"),
                         ({"references": [{"audio_path": "/etc/passwd", "text": "x"}]}, "references"),
                         ({"references": [{"data": b64, "weight": -1}, {"data": b64}]}, "references"),
                         ({"references": [{"vq_codes": [[1, 2]]}]}, "references"),
                         ({"x_vector_only_mode": True}, "x_vector_only_mode"),
                         ({"repetition_penalty": 1.1}, "repetition_penalty"),
                         ({"stage_params": {"a": 1}}, "stage_params"),
                         ({"ref_audio": base64.b64encode(b"RIFF not audio").decode()}, "ref_audio"),
                         ({"speaker": "narrator", "voice": "narrator"}, "speaker")):
        assert_error(post(**{**base, **extra}), 400, param)
    # Boson's voice creation: an id derived from the clip, the same clip gives the same id
    first = post("/v1/audio/voices", ref_audio=b64, ref_text=said, description="the test clip")
    again = post("/v1/audio/voices", ref_audio=f"data:audio/wav;base64,{b64}", ref_text=said)
    assert (first.status_code, again.status_code) == (201, 200), first.text
    vid = first.json()["voice"]
    assert vid.startswith("voice_") and again.json()["voice"] == vid
    assert post(**base, voice=vid).content == boson.content
    listed = webui.http.get("/v1/audio/voices", headers=auth).json()
    assert vid in [v["voice"] for v in listed["data"]] and vid in [v["id"] for v in listed["voices"]]
    assert_error(post("/v1/audio/voices", ref_audio=b64), 400, "ref_text")
    assert webui.http.delete(f"/v1/voices/{vid}", headers=auth).status_code == 200


def test_boson_form_upload_sglang_sse_and_json_voices(webui):
    """Boson's speech request as a multipart form (the reference as a file), sglang-omni's SSE chunks
    (`stream: true` with `stream_format: "sse"`), and Boson's JSON voice creation on POST /v1/voices."""
    import base64

    auth = {"Authorization": f"Bearer {KEY}"}
    clip = (DATA / "ref_en_24k.wav").read_bytes()
    said = (DATA / "ref_en_24k.txt").read_text().strip()
    fields = {"model": "higgs-tts-3", "input": TEXT, "response_format": "pcm", "seed": "5", "max_rows": "120",
              "ref_text": said, "stream": "true"}
    form = webui.http.post("/v1/audio/speech", data=fields, files={"ref_audio": ("ref.wav", clip, "audio/wav")},
                           headers=auth)
    assert form.status_code == 200, form.text
    as_json = webui.http.post("/v1/audio/speech", headers=auth, json={
        **{k: v for k, v in fields.items() if k not in ("seed", "max_rows", "stream")}, "seed": 5, "max_rows": 120,
        "stream": True, "ref_audio": base64.b64encode(clip).decode()})
    assert form.content == as_json.content
    assert_error(webui.http.post("/v1/audio/speech", data={**fields, "seed": "five"},
                                 files={"ref_audio": ("ref.wav", clip, "audio/wav")}, headers=auth), 400, "seed")
    assert_error(webui.http.post("/v1/audio/speech", data=fields, files={"other": ("x.wav", clip, "audio/wav")},
                                 headers=auth), 400, "other")
    sse = webui.http.post("/v1/audio/speech", headers=auth, json={"model": "higgs-tts-3", "input": TEXT, "seed": 5,
                          "max_rows": 120, "response_format": "pcm", "stream": True, "stream_format": "sse"})
    lines = [x[6:] for x in sse.text.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert all(c["object"] == "audio.speech.chunk" for c in chunks) and [c["index"] for c in chunks] == list(
        range(len(chunks)))
    assert all(c["audio"]["sample_rate"] == RATE and c["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["audio"] is None and last["finish_reason"] in ("stop", "length")
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
    made = webui.http.post("/v1/voices", headers=auth, json={"ref_audio": base64.b64encode(clip).decode(),
                                                              "ref_text": said})
    assert made.status_code in (200, 201) and made.json()["voice"].startswith("voice_"), made.text
    assert webui.http.delete(f"/v1/voices/{made.json()['voice']}", headers=auth).status_code == 200
