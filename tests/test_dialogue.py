"""Dialogue scripts (`longform/script.py`, `longform/dialogue.py`), captions (`longform/captions.py`) and the
server's `/v1/audio/dialogue`: the script formats and their faults, each speaker continuing its own context, the
turns in script order with their pauses, cues at the samples written (to the sample), caption files the `srt` and
`webvtt` libraries parse, resume, the CLI's bad scripts refused before the model loads, and the endpoint over
real HTTP (tiny exports)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import srt
import webvtt
from servers import served

from higgs_onnx.longform import captions
from higgs_onnx.longform.dialogue import Dialogue
from higgs_onnx.longform.render import LongForm, LongFormOptions
from higgs_onnx.longform.script import ScriptError, Turn, check_cast, parse_script, parse_voice_map, turns_from_json
from higgs_onnx.serve.limits import MAX_INPUT_CHARS

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
SR = 24000

SCRIPT = """# episode 1
Alice: Hello and welcome to the show. Today we talk about trains.
Bob: Thanks, Alice. I love trains!
[Bob laughs]
Alice: Tell us why.
It is a long story, I know.

And a second paragraph of the same turn.
Bob: <|emotion:elation|>Because they are fast. And they are quiet [mostly].
"""


# -- the script formats ---------------------------------------------------------------------------------------------
def test_plain_script_turns_lines_paragraphs_stage_directions_and_tags():
    turns = parse_script(SCRIPT)
    assert [(t.speaker, t.line) for t in turns] == [("Alice", 2), ("Bob", 3), ("Alice", 5), ("Bob", 9)]
    assert turns[0].text == "Hello and welcome to the show. Today we talk about trains."
    assert turns[1].text == "Thanks, Alice. I love trains!"  # the stage direction line is skipped
    assert turns[2].text == "Tell us why. It is a long story, I know.\n\nAnd a second paragraph of the same turn."
    assert turns[3].text == "<|emotion:elation|>Because they are fast. And they are quiet."  # tag kept, [..] gone
    # times and URLs never start a turn; names may hold spaces, dots and apostrophes
    t = parse_script("Dr. O'Neil: We meet at 10:30 at http://example.com/x.\nMary Ann: Fine.\n")
    assert [(x.speaker, x.text) for x in t] == [("Dr. O'Neil", "We meet at 10:30 at http://example.com/x."),
                                                ("Mary Ann", "Fine.")]


def test_jsonl_script_and_json_turns():
    text = '\ufeff{"speaker": "Alice", "text": "Hi [waves] there."}\n\n{"speaker": "Bob", "text": "Hey."}\n'
    assert [(t.speaker, t.text, t.line) for t in parse_script(text)] == [("Alice", "Hi there.", 1),
                                                                           ("Bob", "Hey.", 3)]
    turns = turns_from_json([{"speaker": "A", "text": "x"}, {"speaker": "B", "text": "y"}])
    assert [(t.speaker, t.line) for t in turns] == [("A", 0), ("B", 1)]


@pytest.mark.parametrize("text, message", [
    ("Hello there.\nAlice: Hi.", "line 1: text before the first speaker"),
    ("Alice: Hi.\nBob:\nAlice: Again.", "line 2: the turn of Bob is empty"),
    ("Alice: Hi.\nBob: [coughs]\n", "line 2: the turn of Bob is empty (only stage directions)"),
    ('{"speaker": "A", "text": "x"}\n{"speaker": "B", "text": }', "line 2: malformed JSON"),
    ('{"speaker": "A", "text": "x", "voice": "v"}', "unknown field voice"),
    ('{"speaker": 3, "text": "x"}', '"speaker" must be a name'),
    ('{"speaker": "A", "text": ["x"]}', '"text" must be a string, got list'),
    ("# only a comment\n\n", "has no turns"),
])
def test_bad_scripts_name_the_line(text, message):
    with pytest.raises(ScriptError, match=None) as e:
        parse_script(text, "show.txt")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_voice_map_and_cast():
    assert parse_voice_map("alice=voices/a.npz, bob=default") == {"alice": "voices/a.npz", "bob": "default"}
    for spec, message in [("alice", "is not NAME=VOICE"), ("alice=a.npz,alice=b.npz", "alice is given twice"),
                          ("=a.npz", "is not NAME=VOICE"), ("", "is empty")]:
        with pytest.raises(ScriptError) as e:
            parse_voice_map(spec)
        assert message in str(e.value), str(e.value)
    turns = [Turn("Alice", "Hi.", 1), Turn("Bob", "Hey.", 2)]
    with pytest.raises(ScriptError, match="line 2: speaker 'Bob' has no voice in --voices-map"):
        check_cast(turns, {"Alice": None})
    with pytest.raises(ScriptError, match="has one speaker .Alice.: a dialogue needs two or more"):
        check_cast(turns[:1], {"Alice": None})


# -- rendering (tiny fp32) ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def voice(tts):
    return tts.make_voice(DATA / "ref_en_24k.wav", (DATA / "ref_en_24k.txt").read_text().strip())


@pytest.mark.slow
def test_each_speaker_continues_its_own_context_and_turns_come_in_script_order(tts, voice, tmp_path):
    turns = parse_script(SCRIPT)
    job = Dialogue(tts, turns, tmp_path / "show.wav", {"Alice": voice, "Bob": None})
    assert job.cast == ["Alice", "Bob"] and len(job.lanes) == 2
    alice, bob = job.lanes
    assert all(job._speaker(i) == "Alice" for i in alice) and all(job._speaker(i) == "Bob" for i in bob)
    pieces = list(job.run())
    job.close()
    assert [p.speaker for p in pieces] == [job._speaker(i) for i in range(len(job.pieces))]
    assert [p.index for p in pieces] == list(range(len(job.pieces)))
    done = {p.index: {"gen": np.zeros((p.rows, 8)), "rows": p.rows} for p in pieces}  # the row counts matter
    # Alice's second turn hears her voice and her first turn only; Bob's second hears his own first (zero-shot:
    # his first turn had no voice, so his lane carries on from it without one)
    with_voice, history, cont = job._context(alice[1], done)
    assert with_voice and history == [alice[0]] and cont
    with_voice, history, cont = job._context(bob[1], done)
    assert not with_voice and history == [bob[0]] and cont
    # samples: each piece starts where the ones before it (and their pauses) end; a turn change pauses 0.4 s
    at = 0
    for p in pieces:
        assert p.start_sample == at
        at += p.waveform.size
        pause = p.waveform.size - p.speech_samples
        if p.index < len(pieces) - 1:
            nxt = pieces[p.index + 1]
            turn_change = job._turn_of[p.index] != job._turn_of[nxt.index]
            want = LongFormOptions().turn_pause_s if turn_change else (
                LongFormOptions().paragraph_pause_s if job.pieces[p.index].paragraph_end else LongFormOptions().pause_s)
            assert pause == int(want * SR) and not p.waveform[p.speech_samples:].any()
        else:
            assert pause == 0


@pytest.mark.slow
def test_captions_match_the_file_to_the_sample_and_parse(tts, voice, tmp_path):
    turns = parse_script(SCRIPT)
    out = tmp_path / "show.wav"
    got = []
    job = Dialogue(tts, turns, out, {"Alice": voice, "Bob": None}, lf=LongFormOptions(target_chars=40))
    job.write(got.append)
    wav, sr = sf.read(out, dtype="float32")
    cues = [captions.cue_of(p) for p in got]
    assert len(cues) == len(job.pieces) > len(turns)  # long turns cut near 40 characters: several cues each
    for p, c in zip(got, cues, strict=True):
        assert c.start == p.start_sample and c.end == p.start_sample + p.speech_samples
        # the cue spans exactly the piece's samples in the file (PCM16: within one step), the pause outside it
        assert np.abs(wav[c.start:c.end] - p.waveform[:p.speech_samples]).max() <= 1.01 / 32768
        assert np.abs(wav[c.start:c.start + 2000] - p.waveform[1:2001]).max() > 1e-3  # one sample off is not it
        assert not wav[c.end:c.end + (p.waveform.size - p.speech_samples)].any()
    assert wav.size == cues[-1].end
    captions.write(tmp_path / "show.srt", cues, sr)
    captions.write(tmp_path / "show.vtt", cues, sr)
    subs = list(srt.parse((tmp_path / "show.srt").read_text(encoding="utf-8")))
    assert len(subs) == len(cues)
    for s, c in zip(subs, cues, strict=True):
        assert round(s.start.total_seconds() * 1000) == round(c.start * 1000 / sr)
        assert round(s.end.total_seconds() * 1000) == round(c.end * 1000 / sr)
        assert s.content == f"{c.speaker}: {c.text}" and "<|" not in s.content
    vtt = webvtt.read(str(tmp_path / "show.vtt"))
    assert len(vtt.captions) == len(cues)
    for v, c in zip(vtt.captions, cues, strict=True):
        assert v.start == captions._vtt_time(c.start, sr) and v.end == captions._vtt_time(c.end, sr)
        h, m, sec = v.start.split(":")
        assert round((int(h) * 3600 + int(m) * 60 + float(sec)) * 1000) == round(c.start * 1000 / sr)
        assert v.voice == c.speaker and v.text == c.text


@pytest.mark.slow
def test_long_form_captions_have_no_speaker(tts, tmp_path):
    text = "One short sentence. Another one follows it.\n\nA new paragraph ends the text."
    got = []
    LongForm(tts, text, tmp_path / "lf.wav", lf=LongFormOptions(target_chars=20)).write(got.append)
    cues = [captions.cue_of(p) for p in got]
    assert [c.speaker for c in cues] == [None] * len(cues) and len(cues) == 3
    assert "-->" in captions.render(cues, SR, ".srt") and ": " not in captions.render(cues, SR, ".srt").split("\n")[2]


@pytest.mark.slow
def test_a_blend_is_refused_by_long_form_and_dialogue(tts, voice, tmp_path):
    from higgs_onnx.generation.blend import Blend

    blend = Blend.make([voice, voice], [0.5, 0.5], "mixture", ["a", "b"])
    with pytest.raises(ValueError, match="a blend of voices is not supported for long-form"):
        LongForm(tts, "One sentence. Two sentences.", tmp_path / "lf.wav", blend)
    with pytest.raises(ScriptError, match="Alice's voice is a blend of voices"):
        Dialogue(tts, parse_script(SCRIPT), tmp_path / "d.wav", {"Alice": blend, "Bob": None})
    assert not (tmp_path / "lf.wav.work").exists() and not (tmp_path / "d.wav.work").exists()


@pytest.mark.slow
def test_a_stopped_dialogue_resumes_from_its_work_folder(tts, voice, tmp_path):
    turns = parse_script(SCRIPT)
    out = tmp_path / "show.wav"
    job = Dialogue(tts, turns, out, {"Alice": voice, "Bob": None})
    it = job.run()
    first = [next(it), next(it)]  # two pieces made and saved, then the job stops (closing it)
    it.close()
    job.close()
    assert not out.exists() and len(list(job.work.glob("piece-*.npz"))) >= 2
    with pytest.raises(FileExistsError, match="--resume"):
        Dialogue(tts, turns, out, {"Alice": voice, "Bob": None})
    with pytest.raises(ValueError, match="another text, voice or settings"):
        Dialogue(tts, turns, out, {"Alice": None, "Bob": None}, resume=True)  # another cast: refused
    resumed = []
    Dialogue(tts, turns, out, {"Alice": voice, "Bob": None}, resume=True).write(resumed.append)
    assert [p.index for p in resumed] == list(range(len(resumed))) and resumed[0].resumed and resumed[1].resumed
    assert all(np.array_equal(a.waveform, b.waveform) for a, b in zip(first, resumed, strict=False))
    assert out.is_file() and not job.work.exists()


# -- the CLI --------------------------------------------------------------------------------------------------------
def cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "inference.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "CI": "1"}, timeout=600)


@pytest.mark.slow
def test_cli_dialogue_with_captions(builds, tmp_path):
    script = tmp_path / "show.txt"
    script.write_text(SCRIPT)
    saved = tmp_path / "alice.npz"
    r = cli("--model-path", builds["int4"], "--ref-audio", DATA / "ref_en_24k.wav", "--text", "Hi.", "--out",
            tmp_path / "hi.wav", "--save-voice", saved, "--max-rows", 60)
    assert r.returncode == 0, r.stderr
    out, vtt = tmp_path / "show.wav", tmp_path / "show.vtt"
    r = cli("--model-path", builds["int4"], "--script", script, "--voices-map", f"Alice={saved},Bob=default",
            "--out", out, "--captions", vtt)
    assert r.returncode == 0, r.stderr
    assert "for 2 speakers (Alice, Bob)" in r.stderr and "(Alice)" in r.stderr and "(Bob)" in r.stderr
    cues = webvtt.read(str(vtt)).captions
    assert [c.voice for c in cues[:2]] == ["Alice", "Bob"] and cues[-1].end_in_seconds <= sf.info(out).duration + 1
    assert f"{vtt}: {len(cues)} cues" in r.stderr
    # word level: each piece forced-aligned on its own samples (the tiny model's audio is no speech, so a piece the
    # aligner cannot time keeps its cue, and the run says so); never fewer cues, never past the audio
    words = tmp_path / "words.srt"
    r = cli("--model-path", builds["int4"], "--script", script, "--voices-map", f"Alice={saved},Bob=default",
            "--out", out, "--captions", words, "--caption-level", "word")
    assert r.returncode == 0, r.stderr
    got = list(srt.parse(words.read_text()))
    kept = re.search(r"--caption-level word: (\d+) of (\d+) pieces keep a piece-level cue", r.stderr)
    assert len(got) >= len(cues) and (kept is not None or len(got) > len(cues)), r.stderr
    assert got[-1].end.total_seconds() <= sf.info(out).duration + 1e-3


@pytest.mark.slow
def test_cli_bad_dialogues_are_one_line_before_the_model_loads(builds, tmp_path):
    script = tmp_path / "show.txt"
    script.write_text(SCRIPT)
    one = tmp_path / "one.txt"
    one.write_text("Alice: Just me.\nAlice: Still me.\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("Alice: Hi.\nBob:\n")
    model = builds["int4"]
    cases = [
        (("--script", script, "--voices-map", "Alice=default", "--out", tmp_path / "a.wav"),
         "line 3: speaker 'Bob' has no voice in --voices-map"),
        (("--script", script, "--voices-map", "Alice=default,Bob=nobody.npz", "--out", tmp_path / "a.wav"),
         "Bob=nobody.npz: voice file nobody.npz does not exist"),
        (("--script", script, "--voices-map", "Alice=a.npz:0.5,Bob=default", "--out", tmp_path / "a.wav"),
         "a blend of voices is not for a dialogue"),
        (("--script", one, "--voices-map", "Alice=default", "--out", tmp_path / "a.wav"), "has one speaker"),
        (("--script", empty, "--voices-map", "Alice=default,Bob=default", "--out", tmp_path / "a.wav"),
         "line 2: the turn of Bob is empty"),
        (("--script", script, "--out", tmp_path / "a.wav"), "--script needs --voices-map"),
        (("--text", "Hi.", "--voices-map", "Alice=default", "--out", tmp_path / "a.wav"),
         "--voices-map is for --script"),
        (("--text", "Hi.", "--captions", tmp_path / "a.srt", "--out", tmp_path / "a.wav"),
         "--captions is for one"),
        (("--script", script, "--voices-map", "Alice=default,Bob=default", "--out", tmp_path / "a.wav",
          "--caption-level", "word"), "--caption-level word needs --captions FILE"),
        (("--script", script, "--voices-map", "Alice=default,Bob=default", "--out", tmp_path / "a.wav",
          "--captions", tmp_path / "a.txt"), "captions are .srt (SubRip) or .vtt (WebVTT)"),
        (("--script", script, "--voices-map", "Alice=default,Bob=default", "--out", tmp_path / "a.wav",
          "--captions", tmp_path / "nofolder" / "a.srt"), "does not exist"),
        (("--script", script, "--voices-map", "Alice=default,Bob=default", "--out", tmp_path / "a.wav",
          "--lanes", 2), "--lanes is not for --script"),
        (("--script", tmp_path / "missing.txt", "--voices-map", "Alice=default", "--out", tmp_path / "a.wav"),
         "--script " + str(tmp_path / "missing.txt") + " does not exist"),
    ]
    for args, message in cases:
        t0 = time.perf_counter()
        r = cli("--model-path", model, *args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert time.perf_counter() - t0 < 30
    assert not (tmp_path / "a.wav").exists() and not (tmp_path / "a.wav.work").exists()


# -- the server -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(builds, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dialogue-server")
    with served(builds["fp32"], tmp, http_timeout=300) as s:
        yield s


BODY = {"model": "higgs-tts-3", "turns": [{"speaker": "Alice", "text": "Hello Bob. How are you today?"},
                                          {"speaker": "Bob", "text": "Fine, thanks."},
                                          {"speaker": "Alice", "text": "Good to hear it."}],
        "voices": {"Alice": "default", "Bob": "default"}, "max_rows": 200, "seed": 4}


@pytest.mark.slow
def test_server_dialogue_audio_and_sse_cues(server):
    r = server.http.post("/v1/audio/dialogue", json={**BODY, "response_format": "wav"})
    assert r.status_code == 200, r.text
    assert r.headers["x-pieces"] == "3" and r.headers["x-speakers"] == "2"
    wav, sr = sf.read(io.BytesIO(r.content), dtype="int16")
    assert sr == SR and wav.size > SR
    r = server.http.post("/v1/audio/dialogue", json={**BODY, "response_format": "pcm", "stream_format": "sse"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    import base64

    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    stream = np.frombuffer(pcm, np.int16)
    cues = [e for e in events if e["type"] == "audio.speech.piece"]
    assert [(c["index"], c["speaker"]) for c in cues] == [(0, "Alice"), (1, "Bob"), (2, "Alice")]
    assert cues[0]["start_sample"] == 0 and cues[-1]["end_sample"] == stream.size
    for a, b in zip(cues, cues[1:], strict=False):  # a turn change: 0.4 s of silence between the cues
        assert b["start_sample"] - a["end_sample"] == int(0.4 * SR)
        assert not stream[a["end_sample"]:b["start_sample"]].any()
    assert np.array_equal(stream, wav)  # the same seed: the same dialogue, whatever the format
    done = events[-1]
    assert done["type"] == "speech.audio.done" and [p["speaker"] for p in done["pieces"]] == ["Alice", "Bob", "Alice"]


@pytest.mark.slow
@pytest.mark.parametrize("change, status, param, message", [
    ({"voices": {"Alice": "default"}}, 400, "voices", "turns[1]: speaker 'Bob' has no voice in voices"),
    ({"turns": [{"speaker": "Alice", "text": "[x]"}, {"speaker": "Bob", "text": "y"}]}, 400, "turns",
     "the turn of Alice is empty (only stage directions)"),
    ({"turns": [{"speaker": "Alice", "text": "Hi."}]}, 400, "turns", "a dialogue needs two or more"),
    ({"extra": 1}, 400, "extra", "Extra inputs are not permitted"),
    ({"voices": {"Alice": "nobody", "Bob": "default"}}, 400, "voices", "unknown voice 'nobody'"),
    ({"voices": {"Alice": "a:0.5,b:0.5", "Bob": "default"}}, 400, "voices", "is a blend"),
    ({"turns": "hi"}, 400, "turns", "valid list"),
    ({"turns": [{"speaker": "Alice", "text": "word " * (MAX_INPUT_CHARS // 5 + 2)}, {"speaker": "Bob", "text": "y"}]},
     400, "turns",
     "the limit is"),
    ({"response_format": "midi"}, 400, "response_format", "not supported"),
    ({"turns": [{"speaker": "Alice", "text": "Hi <|audio|> there."}, {"speaker": "Bob", "text": "y"}]}, 400, None,
     "<|audio|>"),
])
def test_server_dialogue_bad_requests(server, change, status, param, message):
    r = server.http.post("/v1/audio/dialogue", json={**BODY, **change})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"], err
    if param is not None:
        assert err["param"] == param, err
