"""Word timing by pocketsphinx's forced aligner (`higgs_onnx.align`) on the real recordings in tests/data.

No hand-labelled boundaries exist, so the checks are facts read from the audio itself: its energy envelope (frame RMS
in 10 ms frames; speech is a frame within 30 dB of the loudest) gives the speech onset (0.01 s), the offset (6.49 s)
and the pause between the two sentences (3.05-3.45 s). The aligner put (measured) "The" at 0.00, "dog" ending at
3.01, "Speech" starting at 3.47 and "sound" ending at 6.49: 0-40 ms from those edges.

Tolerance TOL = 80 ms: the envelope's own edges move by up to 40 ms with the threshold (25-40 dB below the peak
gives offsets 6.45-6.51 s, pause starts 3.02-3.05 s: a quiet stop release or fricative tail sits near any
threshold), and the aligner works in 10 ms frames with a silence model of at least 3 frames; 80 ms is about one
short syllable ("the" here lasts 90 ms), so a boundary a whole word off, or a word slid into the pause, fails.
Input in another form (resampled, stereo, int16) must give the same boundaries within 20 ms (two frames).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from word_streams import chunks, served_words

from higgs_onnx.align import (
    ALIGN_LANGUAGES,
    START_LEAD_S,
    AlignUnavailable,
    WordTime,
    align_words,
    can_align,
    pronounce,
    word_cues,
    words_of,
)
from higgs_onnx.audio import read_audio, resample

DATA = Path(__file__).resolve().parent / "data"
TOL = 0.08  # seconds: see the module docstring
SAME = 0.02 + 1e-9  # the same audio in another form (measured: at most 20 ms, two frames)
EN_WORDS = ("The quick brown fox jumps over the lazy dog Speech synthesis turns written words into sound").split()


def _recording(name):
    data, sr = read_audio(DATA / f"{name}.wav")
    return data, sr, (DATA / f"{name}.txt").read_text(encoding="utf-8").strip()


@pytest.fixture(scope="module")
def en():
    data, sr, text = _recording("ref_en_24k")
    mono = data[:, 0]
    return mono, sr, text, align_words(mono, sr, text)


def speech_frames(x: np.ndarray, sr: int, floor_db: float = 30.0) -> np.ndarray:
    """Per 10 ms frame: is it speech (RMS within `floor_db` of the loudest frame)?"""
    hop = sr // 100
    n = len(x) // hop
    rms = np.sqrt((x[: n * hop].reshape(n, hop).astype(np.float64) ** 2).mean(axis=1))
    db = 20 * np.log10(rms + 1e-10)
    return db > db.max() - floor_db


def edges(x: np.ndarray, sr: int) -> tuple[float, float, tuple[float, float]]:
    """(onset, offset, (pause start, pause end)) in seconds: the longest silence inside the speech is the pause."""
    sp = speech_frames(x, sr)
    idx = np.flatnonzero(sp)
    quiet = np.flatnonzero(~sp[idx[0]: idx[-1] + 1]) + idx[0]
    runs = np.split(quiet, np.flatnonzero(np.diff(quiet) > 1) + 1)
    pause = max(runs, key=len)
    return idx[0] * 0.01, (idx[-1] + 1) * 0.01, (pause[0] * 0.01, (pause[-1] + 1) * 0.01)


def test_the_envelope_finds_the_recordings_edges(en):
    x, sr, _, _ = en  # the reference facts themselves, so a changed recording is noticed here first
    onset, offset, (p0, p1) = edges(x, sr)
    assert onset < 0.05 and 6.4 < offset < 6.6 and 3.0 < p0 < 3.1 and 3.4 < p1 < 3.5


def test_every_word_once_in_order_inside_the_audio(en, capsys):
    x, sr, text, words = en
    with capsys.disabled():
        print("\n" + "\n".join(f"  {w.word:10s} {w.start:5.2f} {w.end:5.2f}" for w in words))
    assert [w.word for w in words] == EN_WORDS == words_of(text)
    assert all(isinstance(w, WordTime) and 0 <= w.start < w.end <= len(x) / sr for w in words)
    assert all(a.end <= b.start for a, b in zip(words, words[1:], strict=False))
    assert all(0.04 <= w.end - w.start <= 1.0 for w in words)  # a plausible length for a spoken word ("the": 60 ms)


def test_first_word_starts_at_the_onset_last_ends_at_the_offset(en):
    x, sr, _, words = en
    onset, offset, _ = edges(x, sr)
    assert abs(words[0].start - onset) <= TOL and abs(words[-1].end - offset) <= TOL


def test_the_sentence_pause_falls_between_dog_and_speech(en):
    x, sr, _, words = en
    _, _, (p0, p1) = edges(x, sr)
    dog, speech = words[EN_WORDS.index("dog")], words[EN_WORDS.index("Speech")]
    assert abs(dog.end - p0) <= TOL and abs(speech.start - p1) <= TOL
    assert not any(w.start < p1 - TOL and w.end > p0 + TOL for w in words)  # no word is stretched over the pause


def test_the_words_cover_the_speech(en):
    x, sr, _, words = en
    sp = speech_frames(x, sr)
    inside, onsets = np.zeros_like(sp), np.zeros_like(sp)
    for w in words:
        inside[int(round(w.start * 100)): int(round(w.end * 100))] = True
        onsets[int(round((w.start - START_LEAD_S) * 100)): int(round(w.start * 100))] = True
    # speech nobody claims: at most 3 % beside the transitions into words, which no word holds (a word starts where
    # its first sound does: START_LEAD_S, measured against Piper's word times in test_realspeech.py)
    assert (sp & (inside | onsets)).sum() / sp.sum() >= 0.97
    assert (inside & ~sp).sum() / inside.sum() <= 0.15  # word time that is silence (stop closures): at most 15 %


def test_leading_and_trailing_silence_shift_every_boundary(en):
    x, sr, text, words = en
    rng = np.random.default_rng(7)
    quiet = lambda s: (rng.standard_normal(int(s * sr)) * 1e-3).astype(np.float32)  # noqa: E731 - -60 dBFS hiss
    padded = align_words(np.concatenate([quiet(0.5), x, quiet(0.3)]), sr, text)
    assert [w.word for w in padded] == EN_WORDS
    assert np.allclose([(w.start - 0.5, w.end - 0.5) for w in padded], [(w.start, w.end) for w in words], atol=SAME)


def test_resampled_stereo_and_int16_input_give_the_same_boundaries(en):
    x, sr, text, words = en
    want = np.array([(w.start, w.end) for w in words])
    x44 = resample(x, sr, 44100)
    stereo = np.stack([x44, 0.6 * x44], axis=1)  # (frames, channels), the channels at different levels
    int16 = (np.clip(x, -1, 1) * 32767).astype(np.int16)
    for samples, rate in ((stereo, 44100), (stereo.T.copy(), 44100), (int16, sr), (resample(x, sr, 16000), 16000)):
        got = align_words(samples, rate, text)
        assert [w.word for w in got] == EN_WORDS
        assert np.abs(np.array([(w.start, w.end) for w in got]) - want).max() <= SAME, (samples.shape, rate)


def test_control_tags_are_not_words(en):
    x, sr, text, words = en
    tagged = "<|emotion:elation|> " + text.replace("dog.", "dog. <|sound:laughter|>")
    assert words_of(tagged) == EN_WORDS
    assert align_words(x, sr, tagged) == words


def test_word_cues_are_sample_positions(en):
    x, sr, text, words = en
    cues = word_cues(x, sr, text)
    assert cues == [(round(w.start * sr), round(w.end * sr), w.word) for w in words]
    x48 = resample(x, sr, 48000)
    cues48 = word_cues(x48, 48000, text)
    assert [c[2] for c in cues48] == EN_WORDS and all(e <= len(x48) for _, e, _ in cues48)
    assert abs(cues48[-1][1] / 48000 - cues[-1][1] / sr) <= SAME


def test_a_word_missing_from_the_dictionary_gets_a_rough_pronunciation(en):
    x, sr, text, words = en
    for word in ("Foxxo", "Higgs-ONNX", "schöner", "2024", "U.S", "HTTPX"):
        phones = pronounce(word)
        assert phones and set(phones.split()) <= {
            "AA", "AE", "AH", "AO", "AW", "AY", "B", "CH", "D", "DH", "EH", "ER", "EY", "F", "G", "HH", "IH", "IY",
            "JH", "K", "L", "M", "N", "NG", "OW", "OY", "P", "R", "S", "SH", "T", "TH", "UH", "UW", "V", "W", "Y",
            "Z", "ZH"}, (word, phones)
    assert pronounce("Foxxo") == "F AA K S AA"  # letter to sound: a doubled letter said once
    assert pronounce("HTTPX") == "EY CH T IY T IY P IY EH K S"  # a short all-capitals word: spelled
    assert pronounce("2024") == "T W EH N T IY T W EH N T IY F AO R"  # a year, in pairs
    assert pronounce("schöner") == "S K AA N ER"  # accents folded
    assert pronounce("couldn't've") == "K UH D AH N T AH V"  # a clitic after a word: its sound, not its letters
    got = align_words(x, sr, text.replace("fox", "Foxxo"))  # not in the dictionary, and said "fox"
    assert [w.word for w in got][3] == "Foxxo"
    for i in (2, 3, 4):  # it takes the time "fox" took, and its neighbours keep theirs
        assert abs(got[i].start - words[i].start) <= TOL and abs(got[i].end - words[i].end) <= TOL


def test_german_is_refused_naming_the_language():
    data, sr, text = _recording("ref_de_22k_stereo")
    assert data.shape[1] == 2 and sr == 22050 and ALIGN_LANGUAGES == ("en",)
    for call in (lambda: align_words(data, sr, text, language="de"), lambda: word_cues(data, sr, text, "de-DE")):
        with pytest.raises(AlignUnavailable, match=r"English only .*'de") as e:
            call()
        assert "\n" not in str(e.value)
    assert "English only" in can_align(text, "de") and can_align(text, "en-US") is None


def test_texts_and_audio_that_cannot_be_timed_say_why(en):
    x, sr, text, _ = en
    for bad, why in (("", "no words"), ("<|emotion:calm|> ... !", "no words"), ("你好世界", "not in Latin script"),
                     ("Hello Привет", "no English pronunciation for 'Привет'")):
        assert why in can_align(bad)
        with pytest.raises(AlignUnavailable, match=why):
            align_words(x, sr, bad)
    with pytest.raises(AlignUnavailable, match="empty"):
        align_words(np.zeros(0, np.float32), sr, text)
    with pytest.raises(AlignUnavailable, match="sample rate"):
        align_words(x, 0, text)
    noise = np.random.default_rng(0).normal(0, 0.1, len(x)).astype(np.float32)
    for audio in (x[: sr // 10], noise):  # too short for the text; not speech at all
        with pytest.raises(AlignUnavailable, match="no alignment"):
            align_words(audio, sr, text)


def test_caption_cues_become_word_cues_where_the_aligner_can_time_them():
    """job.finish.file_words on a real recording (the command line's --caption-level word): the English piece becomes
    a cue per word inside its own span, in order; a German piece keeps its piece cue, and the count and the reason
    come back."""
    import soundfile as sf

    from higgs_onnx.job.finish import file_words
    from higgs_onnx.longform.captions import Cue

    en = DATA / "ref_en_24k.wav"
    n = sf.info(str(en)).frames
    text = (DATA / "ref_en_24k.txt").read_text().strip()
    cues, kept, why = file_words(en, [Cue(0, n, text)], "de")
    assert cues == [Cue(0, n, text)] and kept == 1 and why.startswith("word timing is English only")
    got, kept, _ = file_words(en, [Cue(0, n // 3, "悲しい"), Cue(0, n, text, "Ann")], "en")
    assert got[0] == Cue(0, n // 3, "悲しい") and kept == 1  # kept: not Latin script
    words = got[1:]
    assert [c.text for c in words] == text.replace(".", "").split()
    assert all(0 <= a.start < a.end <= b.start <= b.end <= n for a, b in zip(words, words[1:], strict=False))
    assert {c.speaker for c in words} == {"Ann"}


def test_the_servers_piece_cues_carry_the_words_timed_on_their_own_samples(en):
    """serve.pieces.with_words on the real recording: the words of a piece come at stream positions (a piece after a
    pause included), equal to align.word_cues on that piece's samples; one request's stream is one piece of its text;
    a piece the aligner cannot time says why and keeps its cue."""
    from higgs_onnx.longform.captions import Cue

    x, sr, text, _ = en
    own = word_cues(x, sr, text)
    pause = np.zeros(sr // 2, np.float32)
    at = len(x) + pause.size  # piece 1 starts after piece 0 and its pause
    stream = [Cue(0, None, text), *chunks(x, sr), Cue(0, len(x), text), chunks(pause, sr)[0],
              Cue(at, None, "悲しい", index=1), *chunks(x[: sr], sr), Cue(at, at + sr, "悲しい", index=1)]
    got = served_words(stream[0], stream[1:], "the whole input", sr)
    assert [type(g).__name__ for g in got] == [type(s).__name__ for s in stream]  # nothing added or lost
    cues = [g for g in got if isinstance(g, Cue) and g.end is not None]
    assert [(w.start, w.end, w.text) for w in cues[0].words] == own and cues[0].words_reason is None
    assert cues[1].words == () and "not in Latin script" in cues[1].words_reason
    event = cues[0].event("speech-1", sr)
    assert event["type"] == "audio.speech.piece" and event["words"][0] == {
        "text": "The", "start_s": round(own[0][0] / sr, 6), "end_s": round(own[0][1] / sr, 6),
        "start_sample": own[0][0], "end_sample": own[0][1]}
    assert "words" not in Cue(0, 5, "x").as_dict(sr)  # not asked: no words field at all
    assert cues[1].as_dict(sr)["words"] == [] and "words_reason" in cues[1].as_dict(sr)

    one = chunks(x, sr)  # one request: no piece cues of its own
    got = served_words(one[0], one[1:], text, sr)
    assert isinstance(got[0], Cue) and got[0].end is None and got[0].text == text
    assert got[1:-1] == one and got[-1].end == len(x)
    assert [(w.start, w.end, w.text) for w in got[-1].words] == own


def test_the_server_times_words_in_one_lower_priority_process():
    """job.finish.time_words: the server's aligner is one process of its own (job.aligner), niced below the server
    (Linux), that gives what captions.timed gives and imports no main script of the parent's."""
    import asyncio
    import os
    import sys

    from higgs_onnx.job import finish as pieces
    from higgs_onnx.longform.captions import Cue

    asyncio.run(pieces.time_words(Cue(0, 0, "x"), np.zeros(0, np.float32), 24000, "en"))  # starts the process
    pid = pieces.ALIGNER.pid
    assert pid is not None and pid != os.getpid()
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, pid) == mine + min(pieces.ALIGNER_NICE, 19 - mine)
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert cmd[:4] == [sys.executable.encode(), b"-P", b"-m", b"higgs_onnx.job.aligner"], cmd


def test_word_timing_leaves_the_event_loop_free():
    """pocketsphinx holds the GIL through a whole search (0.3 s on 30 s of audio, up to 7 searches a piece): in a
    thread of the server it froze the event loop, and every stream's audio, that long (seen at 0.31-0.54 s). In the
    aligner's own process the loop goes on: no tick of a 10 ms timer comes more than 0.1 s late while 30 s of noise
    is searched in every way and refused."""
    import asyncio
    import time

    from higgs_onnx.job.finish import time_words
    from higgs_onnx.longform.captions import Cue

    noise = (np.random.default_rng(3).standard_normal(24000 * 30) * 0.1).astype(np.float32)

    async def run():
        await time_words(Cue(0, 0, "x"), np.zeros(0, np.float32), 24000, "en")  # the process is up
        task = asyncio.create_task(time_words(Cue(0, noise.size, "words the noise does not say"), noise, 24000,
                                              "en"))
        late, t0 = [], time.perf_counter()
        while not task.done():
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            late.append(time.perf_counter() - before - 0.01)
        return await task, max(late), time.perf_counter() - t0

    got, worst, took = asyncio.run(run())
    assert got.words == () and "no alignment" in got.words_reason and took > 0.5, (got, took)
    assert worst < 0.1, f"the loop stalled {worst:.3f} s while words were timed"


def test_an_aligner_process_that_dies_is_a_piece_without_words_and_a_new_one_follows(en, caplog):
    """The aligner process killed mid-piece: that piece comes back with no words and why (the one failure rule, one
    ERROR line), the next piece is timed by a new process; the server's end ends it."""
    import asyncio
    import logging
    import os
    import signal

    from higgs_onnx.job import finish as pieces
    from higgs_onnx.longform.captions import Cue

    x, sr, text, _ = en
    noise = (np.random.default_rng(4).standard_normal(24000 * 60) * 0.1).astype(np.float32)

    async def run():
        await pieces.time_words(Cue(0, 0, "x"), np.zeros(0, np.float32), 24000, "en")
        old = pieces.ALIGNER.pid
        task = asyncio.create_task(pieces.time_words(Cue(0, noise.size, "never said", index=5), noise, 24000, "en"))
        await asyncio.sleep(0.5)  # being timed
        os.kill(old, signal.SIGKILL)
        dead = await task
        again = await pieces.time_words(Cue(0, len(x), text), x, sr, "en")
        return dead, again, old, pieces.ALIGNER.pid

    with caplog.at_level(logging.ERROR, logger="higgs_onnx.job.finish"):
        dead, again, old, new = asyncio.run(run())
    assert dead.words == () and dead.words_reason == "word timing failed (AlignerEnded)" and dead.index == 5
    assert [r.getMessage() for r in caplog.records] == [
        "word timing of piece 5 failed: the aligner process ended (EOFError, exit code -9)"]
    assert new not in (None, old) and [(w.start, w.end, w.text) for w in again.words] == word_cues(x, sr, text)
    proc = pieces.ALIGNER.proc
    pieces.close_aligner()
    assert proc.returncode is not None and pieces.ALIGNER.pid is None  # ended (its stdin closed, or killed 0.2 s on)


def test_the_servers_end_does_not_wait_for_the_piece_being_timed():
    """close_aligner (the server's lifespan end, on its event loop) returns at once while a long piece is being
    searched: the process is ended and that piece comes back without words."""
    import asyncio
    import time

    from higgs_onnx.job import finish as pieces
    from higgs_onnx.longform.captions import Cue

    noise = (np.random.default_rng(5).standard_normal(24000 * 60) * 0.1).astype(np.float32)

    async def run():
        await pieces.time_words(Cue(0, 0, "x"), np.zeros(0, np.float32), 24000, "en")
        proc = pieces.ALIGNER.proc
        task = asyncio.create_task(pieces.time_words(Cue(0, noise.size, "never said"), noise, 24000, "en"))
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        pieces.close_aligner()
        took = time.perf_counter() - t0
        return await task, took, proc

    got, took, proc = asyncio.run(run())
    assert took < 1.0 and proc.returncode is not None, took
    assert got.words == () and got.words_reason == "word timing failed (AlignerEnded)"


def test_a_terminals_ctrl_c_reaches_the_server_not_its_aligner():
    """Ctrl-C in a terminal signals the whole foreground process group: the aligner, in a group of its own, goes on
    (the server ends it at its own end) instead of dying mid-search with a KeyboardInterrupt traceback in the
    server's log and an ERROR for the piece it held."""
    import os
    import signal
    import subprocess
    import sys

    script = """if True:
        import signal, sys, numpy as np
        signal.signal(signal.SIGINT, lambda *a: None)  # the server's own handler (a handler is not inherited)
        from higgs_onnx.job.aligner import Aligner
        from higgs_onnx.longform.captions import Cue
        a = Aligner(10)
        a.time(Cue(0, 0, "x"), np.zeros(0, np.float32), 24000, "en")
        print(a.pid, flush=True)
        sys.stdin.readline()
        got, _ = a.time(Cue(0, 0, "x"), np.zeros(0, np.float32), 24000, "en")
        print(a.pid, got.words_reason, flush=True)
    """
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=Path(__file__).parents[1])
    try:
        pid = p.stdout.readline().strip()
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = p.communicate("go\n", timeout=60)
    finally:
        p.kill()
    assert pid and out.split(" ", 1)[0] == pid and "nothing to time" in out, (pid, out, err)  # the same process
    assert "KeyboardInterrupt" not in err and p.returncode == 0, err


def test_the_aligner_imports_nothing_from_the_servers_working_directory(en, tmp_path, monkeypatch):
    """A console script's server does not have its working directory on sys.path, and neither has its aligner
    (`-P`): a user's json.py there is neither run nor taken for the standard one."""
    from higgs_onnx.job.aligner import Aligner
    from higgs_onnx.longform.captions import Cue

    x, sr, text, _ = en
    (tmp_path / "json.py").write_text("open(__file__ + '.ran', 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    aligner = Aligner(10)
    try:
        got, failure = aligner.time(Cue(0, len(x), text), x, sr, "en")
    finally:
        aligner.close()
    assert failure is None and [(w.start, w.end, w.text) for w in got.words] == word_cues(x, sr, text)
    assert not (tmp_path / "json.py.ran").exists()


def test_an_aligner_that_cannot_start_is_not_started_again_for_every_piece(tmp_path, monkeypatch, capfd):
    """A child that ends before its ready line (here a broken json module on the PYTHONPATH, which the server had
    imported before) cannot start: each piece is AlignerEnded with why, and only the first one starts a process
    (one traceback in the log, not one per piece)."""
    from higgs_onnx.job.aligner import Aligner, AlignerEnded
    from higgs_onnx.longform.captions import Cue

    (tmp_path / "json.py").write_text("raise ImportError('not the json module')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    aligner = Aligner(10)
    whys = []
    for _ in range(3):
        with pytest.raises(AlignerEnded) as e:
            aligner.time(Cue(0, 0, "x"), np.zeros(0, np.float32), 24000, "en")
        whys.append(str(e.value))
    assert whys == ["the aligner process could not start (exit code 1)"] * 3
    assert capfd.readouterr().err.count("ImportError: not the json module") == 1


def test_an_aligner_killed_before_it_is_ready_is_started_again(tmp_path, monkeypatch):
    """A child killed before its ready line (a signal: the OOM killer, an operator) is that piece's AlignerEnded,
    not the rule for a child that cannot start: the next piece starts a new one."""
    from higgs_onnx.job.aligner import Aligner, AlignerEnded
    from higgs_onnx.longform.captions import Cue

    (tmp_path / "sitecustomize.py").write_text(  # the first child only kills itself at its start
        "import os, signal\nflag = os.path.join(os.path.dirname(__file__), 'once')\n"
        "if not os.path.exists(flag):\n    open(flag, 'w').close()\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    aligner = Aligner(10)
    piece = (Cue(0, 0, "x"), np.zeros(0, np.float32), 24000, "en")
    try:
        with pytest.raises(AlignerEnded, match=r"could not start \(exit code -9\)"):
            aligner.time(*piece)
        got, failure = aligner.time(*piece)
    finally:
        aligner.close()
    assert failure is None and "nothing to time" in got.words_reason and aligner.broken is None


def test_time_words_has_one_failure_rule_and_lets_only_a_cancellation_through(en, caplog):
    """job.finish.time_words, what every door's word timing calls: the recording's words as captions.timed gives
    them; an aligner that raises (here a cue whose text is not text) is logged once, with its traceback, and the cue
    comes back with no words and why; a cancelled timing raises CancelledError, not a cue."""
    import asyncio
    import logging

    from higgs_onnx.job.finish import time_words
    from higgs_onnx.longform.captions import Cue

    x, sr, text, _ = en
    got = asyncio.run(time_words(Cue(0, len(x), text), x, sr, "en"))
    assert [(w.start, w.end, w.text) for w in got.words] == word_cues(x, sr, text) and got.words_reason is None

    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="higgs_onnx.job.finish"):
        bad = asyncio.run(time_words(Cue(0, len(x), None, index=3), x, sr, "en"))
    assert bad.words == () and bad.words_reason == "word timing failed (TypeError)" and bad.index == 3
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "Traceback" in errors[0].getMessage() and "TypeError" in errors[0].getMessage()

    async def cancelled():
        task = asyncio.create_task(time_words(Cue(0, len(x), text), x, sr, "en"))
        await asyncio.sleep(0)  # submitted to the aligner's process
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled())


def test_an_aligner_stopped_mid_piece_is_ended_after_its_limit(en, caplog):
    """A child that stops answering (here SIGSTOP: stopped, or looping) is killed once a piece passes the limit
    (`Aligner.limit_s`, PIECE_LIMIT_S): that piece has no words and why, and the next is timed by a new child."""
    import asyncio
    import logging
    import os
    import signal

    from higgs_onnx.job import finish as pieces
    from higgs_onnx.job.aligner import PIECE_LIMIT_S
    from higgs_onnx.longform.captions import Cue

    x, sr, text, _ = en
    pieces.close_aligner()
    try:
        async def run():
            await pieces.time_words(Cue(0, 0, "x"), np.zeros(0, np.float32), 24000, "en")
            stopped = pieces.ALIGNER.pid
            os.kill(stopped, signal.SIGSTOP)
            pieces.ALIGNER.limit_s = 1.0
            held = await pieces.time_words(Cue(0, len(x), text, index=7), x, sr, "en")
            pieces.ALIGNER.limit_s = PIECE_LIMIT_S
            return stopped, held, await pieces.time_words(Cue(0, len(x), text), x, sr, "en")

        with caplog.at_level(logging.ERROR, logger="higgs_onnx.job.finish"):
            stopped, held, again = asyncio.run(run())
    finally:
        pieces.ALIGNER.limit_s = PIECE_LIMIT_S
    assert held.words == () and held.words_reason == "word timing failed (AlignerEnded)"
    assert [r.getMessage() for r in caplog.records] == [
        "word timing of piece 7 failed: the aligner process took over 1 s on one piece and was ended"]
    assert pieces.ALIGNER.pid not in (None, stopped) and [w.text for w in again.words] == [
        w for _, _, w in word_cues(x, sr, text)]
    assert not os.path.exists(f"/proc/{stopped}") or "Z" in open(f"/proc/{stopped}/stat").read().split()[2]
