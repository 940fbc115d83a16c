"""Saved voices carry the languages they are offered for: given at the HTTP upload (`languages`) or the CLI
(`--save-voice ... --voice-languages`), shown by `GET /v1/voices`, and listed by Wyoming's `describe` under those
languages (a voice without them, "default" too, under the server's). A `synthesize` naming only a language gets the
first saved voice saved with it. One `serve --wyoming` server on the tiny fp32 export, driven by the `wyoming`
package's own client as in test_wyoming.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from servers import assert_error, served
from wyoming.audio import AudioChunk, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeVoice

from higgs_onnx.serve.voices import VoiceError, check_languages

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
REF = (DATA / "ref_en_24k.wav").read_bytes()
SERVER_LANGUAGES = ["en", "zh"]  # the Wyoming server's default --languages


# -- the one check of language codes (no model) --------------------------------------------------------------------
def test_check_languages_normalizes_and_refuses_in_one_sentence():
    assert check_languages("de") == ("de",)
    assert check_languages(" en_us, DE ,pt_BR,es-419,yue,") == ("en-US", "de", "pt-BR", "es-419", "yue")
    assert check_languages(["zh", "en"]) == ("zh", "en") and check_languages("") == () and check_languages(()) == ()
    for bad, named in (("english", "'english'"), ("en-USA", "'en-USA'"), ("e", "'e'"), ("de,fr,de", "'de'"),
                       ("en_us,en-US", "'en-US'"), ("de;fr", "'de;fr'"), (",".join(["en"] + [f"a{c}" for c in
                                                                                       "bcdefghijklmnopq"]), "16")):
        with pytest.raises(VoiceError) as e:
            check_languages(bad)
        msg = str(e.value)
        assert named in msg and "\n" not in msg and msg.startswith("languages"), msg
    with pytest.raises(VoiceError):
        check_languages(5)


# -- a real server ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def both(builds, tmp_path_factory):
    """`serve --wyoming`: (the HTTP server, the Wyoming port), sharing one voices folder."""
    with served(builds["fp32"], tmp_path_factory.mktemp("languages"), wyoming=True) as server:
        yield server, server.wyoming_port


def upload(server, name: str, **fields):
    return server.http.post("/v1/voices", data={"name": name, **fields},
                            files={"file": ("ref.wav", REF, "application/octet-stream")})


async def describe(port: int) -> dict[str, list[str]]:
    async with AsyncTcpClient("127.0.0.1", port) as c:
        await c.write_event(Describe().event())
        info = Info.from_event(await asyncio.wait_for(c.read_event(), 60))
    return {v.name: v.languages for v in info.tts[0].voices}


async def synthesize(port: int, voice: SynthesizeVoice | None, text: str = "Hallo.") -> np.ndarray:
    """The audio of a `synthesize` in `voice` (None: none named)."""
    async with AsyncTcpClient("127.0.0.1", port) as c:
        event = Synthesize(text=text, voice=voice).event()
        assert voice is None or event.data["voice"] == voice.to_dict()  # {"language": "de"} alone: no name
        await c.write_event(event)
        got = []
        while True:
            e = await asyncio.wait_for(c.read_event(), 120)
            assert e is not None and not Error.is_type(e.type), e
            got.append(e)
            if AudioStop.is_type(e.type):
                break
    return np.frombuffer(b"".join(e.payload for e in got if AudioChunk.is_type(e.type)), "<i2")


@pytest.mark.slow
def test_a_voice_is_described_under_its_own_languages(both):
    server, port = both
    r = upload(server, "anna", languages="de,de_at")
    assert r.status_code == 201 and r.json()["languages"] == ["de", "de-AT"], r.text
    old = upload(server, "old")  # no languages: the file is what voices were before they had them
    assert old.status_code == 201 and "languages" not in old.json(), old.text
    meta = json.loads(str(np.load(server.voices / "old.npz")["meta"]))
    assert set(meta) == {"ref_text", "model_id"}
    listed = {v["id"]: v for v in server.http.get("/v1/voices").json()["data"]}
    assert listed["anna"]["languages"] == ["de", "de-AT"] and "languages" not in listed["old"]
    assert "languages" not in listed["default"]

    voices = asyncio.run(describe(port))
    assert voices == {"default": SERVER_LANGUAGES, "anna": ["de", "de-AT"], "old": SERVER_LANGUAGES}
    assert "zh" not in voices["anna"] and "de" in {x for v in voices.values() for x in v}


@pytest.mark.slow
def test_bad_languages_are_refused_at_the_upload(both):
    server, _ = both
    for bad, named in (("deutsch", "deutsch"), ("en,en", "'en'"), ("en-GB-oxendict", "en-GB-oxendict")):
        err = assert_error(upload(server, "badlang", languages=bad), 400, "languages", "invalid_value")
        assert named in err["message"] and "languages" in err["message"], err
    assert "badlang" not in {v["id"] for v in server.http.get("/v1/voices").json()["data"]}


@pytest.mark.slow
def test_a_language_alone_picks_the_voice_saved_with_it(both):
    server, port = both
    if upload(server, "anna", languages="de,de_at").status_code not in (201, 409):
        pytest.fail("anna could not be saved")

    async def run():
        out = {lang: await synthesize(port, SynthesizeVoice(language=lang)) for lang in ("de", "de-DE", "fr")}
        return {**out, "anna": await synthesize(port, SynthesizeVoice(name="anna")),
                "default": await synthesize(port, None)}

    out = asyncio.run(run())
    assert len(out["anna"]) > 0 and np.array_equal(out["de"], out["anna"]) and np.array_equal(out["de-DE"], out["anna"])
    assert np.array_equal(out["fr"], out["default"]) and not np.array_equal(out["default"], out["anna"])


@pytest.mark.slow
def test_the_cli_saves_a_voice_with_its_languages(both, builds, tmp_path):
    server, port = both
    base = [sys.executable, "inference.py", "--model-path", str(builds["fp32"]), "--text", "Hallo.",
            "--out", str(tmp_path / "a.wav"), "--ref-audio", str(DATA / "ref_en_24k.wav")]
    for extra, want in ((["--voice-languages", "de"], "--voice-languages is for --save-voice"),
                        (["--save-voice", str(tmp_path / "v.npz"), "--voice-languages", "de,klingon"], "'klingon'")):
        r = subprocess.run(base + extra, cwd=ROOT, capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], r.stderr
    r = subprocess.run(base + ["--max-rows", "16", "--save-voice", str(tmp_path / "v.npz"), "--voice-languages",
                               "de_CH"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    shutil.copy(tmp_path / "v.npz", server.voices / "cli_voice.npz")  # the server reads the folder when asked
    assert asyncio.run(describe(port))["cli_voice"] == ["de-CH"]
    assert {v["id"]: v for v in server.http.get("/v1/voices").json()["data"]}["cli_voice"]["languages"] == ["de-CH"]


@pytest.mark.slow
def test_describe_reads_only_the_meta_of_a_voice(both):
    """Listing a voice reads its small meta alone: a voice whose KV state is damaged is still listed with its
    languages (np.load of an .npz is lazy)."""
    from higgs_onnx.runtime.voice import read_voice_meta

    server, _ = both
    if upload(server, "anna", languages="de,de_at").status_code not in (201, 409):
        pytest.fail("anna could not be saved")
    src, damaged = server.voices / "anna.npz", server.voices / "damaged.npz"
    meta = read_voice_meta(src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(damaged, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            zout.writestr(item, data if item.filename == "meta.npy" else b"garbage")
    assert read_voice_meta(damaged) == meta and meta["languages"] == ["de", "de-AT"]
    listed = {v["id"]: v for v in server.http.get("/v1/voices").json()["data"]}
    assert listed["damaged"]["languages"] == ["de", "de-AT"]
    assert "damaged" in asyncio.run(describe(both[1]))
    assert server.http.delete("/v1/voices/damaged").status_code == 200
