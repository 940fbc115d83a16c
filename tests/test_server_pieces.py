"""A long speech `input` read in pieces (`serve/pieces.py`): which inputs are split, the stream's joins and the cue of
each piece, with a fake session (no model); then on a real server (tiny fp32 export): the SSE piece events sit at
the sample positions of the PCM actually streamed, the pieces' audio and pauses make up the stream, every format
carries the same audio, and the bad inputs get OpenAI-style 4xx answers."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
from servers import sentences, served

from higgs_onnx.generation.contract import ContractError
from higgs_onnx.generation.engine import GenerationStats
from higgs_onnx.generation.options import GenerationOptions
from higgs_onnx.generation.stream import AudioChunk
from higgs_onnx.longform.captions import Cue
from higgs_onnx.longform.joins import fade_edges
from higgs_onnx.longform.split import Piece, split_text
from higgs_onnx.serve import pieces as pieces_mod
from higgs_onnx.serve.limits import MAX_INPUT_CHARS, MAX_PIECES
from higgs_onnx.serve.pieces import ONE_REQUEST_CHARS, PieceReader, plan_pieces
from higgs_onnx.serve.scheduler import QueueFull

RATE = 24000
FADE = 192  # long-form's 8 ms at 24 kHz


# -- which inputs are read in pieces (a fake model: a text "fits" up to `fits` characters) ------------------------
class FakeTTS:
    def __init__(self, fits: int = 10**9):
        self.fits, self.seen = fits, []

    def request(self, text, voice=None, options=None, slot=None, **_):
        self.seen.append((text, options.max_rows))
        if "<|audio|>" in text:
            raise ContractError("the input holds the special token <|audio|>", "input", "special_token")
        if len(text) > self.fits:
            raise ContractError(f"the text is {len(text)} characters, which needs more rows than fit; split it into "
                                "shorter requests, or read it as one recording with long-form: python inference.py "
                                "--text-file FILE --out OUT.wav", "input", "context_length_exceeded", 413)


def plan(text: str, tts=None, tag=None, max_rows=None):
    return plan_pieces(tts or FakeTTS(), 3072, text, tag, None, GenerationOptions(max_rows=max_rows))


def test_which_inputs_are_read_in_pieces():
    assert plan("Hello there.") is None  # fits one request: one request, as before
    text = sentences(40)  # ~2,200 characters that fit one request: one request
    assert len(text) <= ONE_REQUEST_CHARS and plan(text) is None
    tts = FakeTTS(fits=1000)  # ... and that do not: the pieces of long-form's splitter, each checked
    got = plan(text, tts, tag="<|prosody:speed_fast|>")
    assert got == split_text(text) and len(got) >= 7
    assert [t for t, _ in tts.seen[1:]] == ["<|prosody:speed_fast|>" + p.text for p in got]
    assert all(rows == min(2048, len(t) * 4 + 100) for t, rows in tts.seen[1:])  # long-form's row budget per piece
    one = "word " * 100 + "end."  # does not fit, but is one piece (<= 600 characters): the request's own refusal
    assert plan(one, FakeTTS(fits=400)) is None
    long = sentences(90)  # beyond OpenAI's 4096 characters: pieces even where one request would fit
    assert len(long) > ONE_REQUEST_CHARS and len(plan(long)) == len(split_text(long))
    tts = FakeTTS()
    assert plan(long, tts, max_rows=40) and all(rows == 40 for _, rows in tts.seen)  # max_rows caps each piece


def test_bad_long_inputs_are_refused_naming_the_piece_or_the_limit():
    many = "\n\n".join(["Yes."] * (MAX_PIECES + 1))  # short paragraphs: a piece each
    with pytest.raises(ContractError) as e:
        plan(many, FakeTTS(fits=100))
    assert e.value.code == "too_many_pieces" and e.value.status == 400 and str(MAX_PIECES) in str(e.value)
    bad = sentences(90).replace("Sentence number 50 ", "Sentence <|audio|> 50 ")
    with pytest.raises(ContractError) as e:
        plan(bad)
    assert e.value.code == "special_token" and e.value.param == "input" and "piece " in str(e.value)
    with pytest.raises(ContractError) as e:  # a piece that cannot be a request of its own: 413, never cut
        plan(sentences(90), FakeTTS(fits=50))
    err = e.value
    assert (err.status, err.code, err.param) == (413, "context_length_exceeded", "input"), err
    assert "piece 1 " in str(err) and "long-form" not in str(err) and "transcript" in str(err)


# -- the joins and the cues (a fake session: pieces of known samples) -------------------------------------------
def stats(rows: int, stop: str = "eoc") -> GenerationStats:
    return GenerationStats(prompt_tokens=10, reference_rows=0, rows=rows, frames=rows - 7, audio_s=1.0, voice_s=0.0,
                           prefill_s=0.1, decode_s=0.2, codec_s=0.05, first_row_s=0.1, first_audio_s=0.2, wall_s=1.0,
                           chunks=2, stop_reason=stop)


class FakeSession:
    """Speaks piece i as `sizes[i]` random samples in chunks of 5,000; the context holds `hold` pieces."""

    def __init__(self, sizes, voice=None, hold: int = 3, full: set[int] = frozenset()):
        self.sizes, self.voice, self.hold, self.full = sizes, voice, hold, set(full)
        self.spoken, self.audio, self.job, self.released, self.closed = [], [], None, 0, 0
        self.in_context = 0

    def would_continue(self, text: str) -> bool:
        return self.in_context < self.hold

    async def speak(self, text: str):
        i = len(self.spoken)
        if i in self.full:  # the queue is full once for this piece
            self.full.discard(i)
            raise QueueFull("16 requests in flight")
        self.spoken.append((text, self.voice))
        self.last_continued = self.in_context > 0  # its prompt (10) starts with the 4 positions kept before it
        self.in_context += 1
        self.job = SimpleNamespace(id=100 + i, request=SimpleNamespace(prompt=[0] * 10,
                                                                       cached=4 if self.last_continued else 0))
        wav = np.random.default_rng(i).uniform(-0.5, 0.5, self.sizes[i]).astype(np.float32)
        self.audio.append(wav)
        parts = [wav[a:a + 5000] for a in range(0, wav.size, 5000)]
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            yield AudioChunk(part, RATE, k, last, 0.0, 0.0, 0, stats(50 + i, "max_rows" if i == 2 else "eoc")
                             if last else None, codes=np.full((4, 8), i) if last else None)

    def release(self) -> None:
        self.released += 1
        self.in_context = 0

    def close(self) -> None:
        self.closed += 1


def read(reader: PieceReader) -> list:
    async def run():
        return [item async for item in reader]

    return asyncio.run(run())


PIECES = [Piece("One.", False), Piece("Two.", True), Piece("Three.", False), Piece("Four.", False)]


def test_the_stream_is_the_pieces_and_pauses_and_the_cues_say_where():
    session = FakeSession([12_000, 100, 30_000, 7_001])  # piece 1 is shorter than its two fades
    items = read(PieceReader(session, PIECES, RATE, tag="<|prosody:speed_fast|>"))
    assert [t for t, _ in session.spoken] == ["<|prosody:speed_fast|>" + p.text for p in PIECES]
    pos, audio, cues = 0, [], []
    for item in items:
        if isinstance(item, Cue):
            assert item.start == (pos if item.end is None else item.start) and item.end in (None, pos), item
            cues.append(item)
        else:
            assert item.start_s == pos / RATE
            audio.append(item.samples)
            pos += item.samples.size
    stream = np.concatenate(audio)
    starts, ends = [c for c in cues if c.end is None], [c for c in cues if c.end is not None]
    assert [c.index for c in starts] == [c.index for c in ends] == [0, 1, 2, 3]
    assert [c.text for c in ends] == [p.text for p in PIECES]  # the text as written, without the speed tag
    pauses = [int(0.3 * RATE), int(0.7 * RATE), int(0.3 * RATE)]  # 0.7 s after a paragraph, none after the last
    for i, c in enumerate(ends):
        assert starts[i].start == c.start and c.end - c.start == session.sizes[i]
        assert np.array_equal(stream[c.start:c.end], fade_edges(session.audio[i].copy(), FADE))  # long-form's fades
        if i < 3:
            assert ends[i + 1].start - c.end == pauses[i] and not stream[c.end:ends[i + 1].start].any()
    assert ends[-1].end == stream.size  # the stream ends with the last piece
    last = [x for x in items if not isinstance(x, Cue)][-1]
    assert last.is_last and sum(not isinstance(x, Cue) and x.is_last for x in items) == 1
    s = last.stats
    assert s.rows == 50 + 51 + 52 + 53 and s.stop_reason == "max_rows"
    assert s.prompt_tokens == 10 + 3 * 6  # a continued piece's new prompt positions only
    assert s.audio_s == stream.size / RATE and s.first_audio_s == 0.2
    event = ends[1].event("speech-7", RATE)
    assert event == {"type": "audio.speech.piece", "object": "audio.speech.piece", "id": "speech-7", "index": 1,
                     "text": "Two.", "start_s": round(ends[1].start / RATE, 6),
                     "end_s": round(ends[1].end / RATE, 6), "start_sample": ends[1].start,
                     "end_sample": ends[1].end}
    start = starts[0].event("x", RATE)
    assert start["type"] == "audio.speech.piece.start" and start["end_s"] is None
    assert session.closed == 1  # the kept cache is given back at the end


def test_a_zero_shot_restart_speaks_in_the_first_piece_voice(monkeypatch):
    made = []

    async def clone(codes, text):
        made.append((codes[0, 0], text))
        return "voice-of-piece-1"

    monkeypatch.setattr(pieces_mod, "QUEUE_POLL_S", 0.0)
    pieces = [Piece(f"Piece {i}.", False) for i in range(6)]
    session = FakeSession([6000] * 6, hold=2, full={4})  # the queue is full when piece 5 is submitted
    read(PieceReader(session, pieces, RATE, clone=clone))
    assert made == [(0, "Piece 0.")]  # made once, from the first piece's codes and text
    assert [v for _, v in session.spoken] == [None, None, "voice-of-piece-1", "voice-of-piece-1",
                                              "voice-of-piece-1", "voice-of-piece-1"]
    with pytest.raises(QueueFull):  # the first piece is the request itself: a full queue is its 429 at once
        read(PieceReader(FakeSession([6000] * 2, full={0}), pieces[:2], RATE))


def test_a_cancelled_reader_stops_between_pieces():
    session = FakeSession([6000] * 4)
    reader = PieceReader(session, PIECES, RATE)

    async def run():
        got = []
        async for item in reader:
            got.append(item)
            if isinstance(item, Cue) and item.end is None:
                reader.cancel()
        return got

    got = asyncio.run(run())
    assert len(session.spoken) == 1 and not any(isinstance(c, Cue) and c.end is not None for c in got)


# -- on a real server ------------------------------------------------------------------------------------------------
LONG_TEXT = sentences(90)  # ~4,900 characters in 15 paragraphs: beyond one request, read in pieces
ROWS = 24  # rows per piece: 17 frames, 0.68 s
BODY = {"model": "higgs-tts-3", "input": LONG_TEXT, "max_rows": ROWS, "seed": 3}


@pytest.fixture(scope="module")
def server(builds, tmp_path_factory):
    with served(builds["fp32"], tmp_path_factory.mktemp("pieces"), "--log-level", "INFO") as s:  # INFO: restarts
        yield s


def sse_events(r) -> list[dict]:
    out = []
    for block in r.text.split("\n\n"):
        data = "".join(line[5:].strip() for line in block.splitlines() if line.startswith("data:"))
        if data:
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2")


@pytest.mark.slow
def test_sse_piece_events_sit_at_the_streamed_samples(server):
    r = server.http.post("/v1/audio/speech", json={**BODY, "response_format": "pcm", "stream_format": "sse"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text[:300]
    expected = split_text(LONG_TEXT)
    assert int(r.headers["x-pieces"]) == len(expected) >= 10
    sent, audio, starts, ends, done = 0, [], [], [], None
    for ev in sse_events(r):
        if ev["type"] == "speech.audio.delta":
            audio.append(base64.b64decode(ev["audio"]))
            sent += len(audio[-1]) // 2
        elif ev["type"] == "audio.speech.piece.start":
            assert ev["start_sample"] == sent and ev["end_s"] is None and ev["end_sample"] is None, ev
            starts.append(ev)
        elif ev["type"] == "audio.speech.piece":
            assert ev["end_sample"] == sent and ev["start_sample"] == starts[-1]["start_sample"], ev
            ends.append(ev)
        else:
            assert ev["type"] == "speech.audio.done", ev
            done = ev
    stream = pcm(b"".join(audio))
    assert [e["index"] for e in ends] == list(range(len(expected))) and [e["text"] for e in ends] == \
        [p.text for p in expected]
    for e in ends:  # seconds are the sample positions
        assert round(e["start_s"] * RATE) == e["start_sample"] and round(e["end_s"] * RATE) == e["end_sample"]
    # the pieces' audio and the pauses between them (0.3 s, 0.7 s after a paragraph) are the whole stream
    parts = []
    for i, e in enumerate(ends):
        piece = stream[e["start_sample"]:e["end_sample"]]
        assert piece.size > 0 and np.abs(piece).max() > 0
        parts.append(piece)
        if i + 1 < len(ends):
            gap = stream[e["end_sample"]:ends[i + 1]["start_sample"]]
            assert gap.size == int((0.7 if expected[i].paragraph_end else 0.3) * RATE) and not gap.any()
            parts.append(gap)
    assert ends[0]["start_sample"] == 0 and ends[-1]["end_sample"] == stream.size
    assert np.array_equal(np.concatenate(parts), stream)
    assert done["pieces"] == [{k: v for k, v in e.items() if k not in ("type", "object", "id")} for e in ends]
    assert done["stats"]["audio_s"] == pytest.approx(stream.size / RATE)
    assert done["usage"]["output_tokens"] == done["stats"]["rows"] <= ROWS * len(expected)

    # the same request in the other shapes carries the same audio: raw pcm, Boson's / sglang-omni's stream: true,
    # sglang-omni's SSE (its chunk events, and the same piece events), a wav file
    raw = server.http.post("/v1/audio/speech", json={**BODY, "response_format": "pcm"})
    assert raw.status_code == 200 and np.array_equal(pcm(raw.content), stream)
    boson = server.http.post("/v1/audio/speech", json={**BODY, "response_format": "pcm", "stream": True})
    assert np.array_equal(pcm(boson.content), stream)
    sg = server.http.post("/v1/audio/speech", json={**BODY, "response_format": "pcm", "stream": True,
                                                     "stream_format": "sse"})
    events = sse_events(sg)
    assert events[-1] == "[DONE]"
    chunks = [base64.b64decode(ev["audio"]["data"]) for ev in events[:-1]
              if ev.get("object") == "audio.speech.chunk" and ev["audio"] is not None]
    assert np.array_equal(pcm(b"".join(chunks)), stream)
    assert [ev for ev in events[:-1] if ev.get("object") == "audio.speech.piece"] == \
        [{**e, "id": events[0]["id"]} for e in ends]
    wav, sr = sf.read(io.BytesIO(server.http.post("/v1/audio/speech", json={**BODY, "response_format": "wav"})
                                 .content), dtype="int16")
    assert sr == RATE and np.array_equal(wav, stream)
    mp3 = server.http.post("/v1/audio/speech", json={**BODY, "response_format": "mp3"})
    assert mp3.status_code == 200 and mp3.headers["x-pieces"] == r.headers["x-pieces"]
    assert abs(sf.info(io.BytesIO(mp3.content)).duration - stream.size / RATE) < 0.2
    server.settle()
    assert server.stats()["kept"] == 0  # the last piece's kept cache was given back


@pytest.mark.slow
def test_word_cues_ride_on_the_piece_events(server):
    """`"caption_level": "word"`: the same audio and piece events, each finished piece's with its words (the tiny
    model's audio is not speech, so each says why it has none: the words on real speech are test_align's); a short
    input is one piece, its cue before its first audio and after its last; without SSE it is refused by name."""
    plain = sse_events(server.http.post("/v1/audio/speech", json={**BODY, "response_format": "pcm",
                                                                   "stream_format": "sse"}))
    worded = sse_events(server.http.post("/v1/audio/speech", json={**BODY, "response_format": "pcm",
                                                                    "stream_format": "sse", "caption_level": "word"}))
    bare = [{k: v for k, v in e.items() if k not in ("words", "words_reason", "stats", "pieces", "id")} for e in worded]
    assert bare == [{k: v for k, v in e.items() if k not in ("stats", "pieces", "id")} for e in plain]  # nothing else
    ends = [e for e in worded if e["type"] == "audio.speech.piece"]
    assert len(ends) >= 10 and all(e["words"] == [] and "no alignment" in e["words_reason"] for e in ends), ends[0]
    assert worded[-1]["pieces"] == [{k: v for k, v in e.items() if k not in ("type", "object", "id")} for e in ends]

    short = sse_events(server.http.post("/v1/audio/speech", json={
        "model": "higgs-tts-3", "input": "Hello there.", "max_rows": ROWS, "response_format": "pcm",
        "stream_format": "sse", "caption_level": "word"}))
    kinds = [e["type"] for e in short]
    assert kinds[0] == "audio.speech.piece.start" and kinds[-2:] == ["audio.speech.piece", "speech.audio.done"]
    sent = sum(len(base64.b64decode(e["audio"])) // 2 for e in short if e["type"] == "speech.audio.delta")
    assert short[-2]["text"] == "Hello there." and (short[-2]["start_sample"], short[-2]["end_sample"]) == (0, sent)
    # the words' language is a field: another language's pieces say why they have no words
    german = sse_events(server.http.post("/v1/audio/speech", json={
        "model": "higgs-tts-3", "input": "Guten Tag.", "max_rows": ROWS, "response_format": "pcm",
        "stream_format": "sse", "caption_level": "word", "caption_language": "de-DE"}))
    assert german[-2]["words"] == [] and "English" in german[-2]["words_reason"], german[-2]
    bad = server.http.post("/v1/audio/speech", json={**BODY, "stream_format": "sse", "caption_level": "word",
                                                     "caption_language": "klingon!"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "caption_language", bad.text
    for body in ({}, {"stream": True}):  # raw audio has no place for cues
        r = server.http.post("/v1/audio/speech", json={**BODY, "response_format": "pcm", "caption_level": "word",
                                                       **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "caption_level", r.text
        assert 'needs stream_format "sse"' in r.json()["error"]["message"]


@pytest.mark.slow
def test_short_inputs_are_one_request_and_bad_long_ones_are_refused(server):
    short = server.http.post("/v1/audio/speech", json={"model": "higgs-tts-3", "input": "Hello there.",
                                                        "response_format": "pcm", "stream_format": "sse",
                                                        "max_rows": ROWS})
    assert short.status_code == 200 and "x-pieces" not in short.headers
    assert [ev["type"] for ev in sse_events(short)][-1] == "speech.audio.done"
    assert not any("piece" in ev["type"] for ev in sse_events(short)) and "pieces" not in sse_events(short)[-1]
    bad = [({"input": "word " * (MAX_INPUT_CHARS // 5) + "end."}, "input", "string_above_max_length",
            str(MAX_INPUT_CHARS)),
           ({"input": "\n\n".join(["Yes."] * (MAX_PIECES + 1)), "max_rows": None}, "input", "too_many_pieces",
            str(MAX_PIECES)),
           ({"takes": 2, "temperature": 0.8}, "takes", "unsupported_parameter", "pieces"),
           ({"retries": 1}, "retries", "unsupported_parameter", "pieces"),
           ({"deterministic": True}, "deterministic", "unsupported_parameter", "pieces")]
    tagged = LONG_TEXT.replace("number 50", "<|audio|> 50")
    at = next(i for i, p in enumerate(split_text(tagged)) if "<|audio|>" in p.text)
    bad.append(({"input": tagged}, "input", "special_token", f"piece {at + 1} "))
    before = server.stats()["submitted"]
    for fields, param, code, words in bad:
        body = {**BODY, "response_format": "pcm", "stream_format": "sse", **fields}
        r = server.http.post("/v1/audio/speech", json={k: v for k, v in body.items() if v is not None})
        assert r.status_code == 400, (fields.keys(), r.text[:300])
        err = r.json()["error"]
        assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
        assert words in err["message"] and "\n" not in err["message"], err
    assert server.stats()["submitted"] == before  # refused before any work


@pytest.mark.slow
def test_an_input_that_does_not_fit_one_request_is_split(server):
    """2,000 characters (under OpenAI's 4096) whose speech needs more rows than one request may make: today a 413,
    now read in pieces. Read until the first piece starts, then left: the rest is cancelled."""
    text = sentences(40)
    body = {"model": "higgs-tts-3", "input": text, "response_format": "pcm", "stream_format": "sse"}
    assert len(body["input"]) <= ONE_REQUEST_CHARS
    with server.http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200 and int(r.headers["x-pieces"]) == len(split_text(body["input"])) > 1
        for line in r.iter_lines():
            if line.startswith("data:") and json.loads(line[5:])["type"] == "audio.speech.piece.start":
                break
    stats = server.wait(lambda s: s["in_flight"] == 0 and s["kept"] == 0, "the pieces cancelled")
    assert stats["cancelled"] >= 1


@pytest.mark.slow
def test_a_full_context_starts_again_in_the_first_piece_voice(server):
    """Zero-shot, 400 rows a piece: the 3,072-position slot holds ~5 pieces and their text, then the session starts
    again, from a voice made of the first piece (once; the voice cache holds it), and the cues still add up."""
    voices = server.health()["voice_cache"]["voices"]
    r = server.http.post("/v1/audio/speech", json={**BODY, "input": sentences(80), "max_rows": 400,
                                                    "response_format": "pcm", "stream_format": "sse"})
    assert r.status_code == 200, r.text[:300]
    events = sse_events(r)
    ends = [e for e in events if e["type"] == "audio.speech.piece"]
    sent = sum(len(base64.b64decode(e["audio"])) // 2 for e in events if e["type"] == "speech.audio.delta")
    assert len(ends) == int(r.headers["x-pieces"]) and ends[-1]["end_sample"] == sent
    assert "the context is full at piece" in server.log.read_text()
    assert server.health()["voice_cache"]["voices"] == voices + 1
    server.released()
