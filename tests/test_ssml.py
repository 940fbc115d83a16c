"""The SSML subset (higgs_onnx/text/ssml.py): each element read as text and the model's tags, hostile XML refused
(no DTD, no entity, no external reference is read), any other element or attribute refused by name, and the `ssml`
field at every door that honours text fields: HTTP and the command line (their dry runs show what it became), the
corpus (a bad document is a row error before any work); the WebSocket, Wyoming and the Python API refuse it
(tests/test_doors.py asks them)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from servers import served

from higgs_onnx.text.ssml import SsmlError, to_text

ROOT = Path(__file__).resolve().parents[1]
TAGS = {t["content"] for t in json.loads(gzip.open(ROOT / "higgs_onnx" / "assets" / "qwen3_higgs_tokenizer.json.gz")
                                         .read())["added_tokens"]
        if re.fullmatch(r"<\|[a-z_]+:[a-z_]+\|>", t["content"])}
DOC = ('<speak>Call <say-as interpret-as="telephone">555-1423</say-as> <break time="1s"/> '
       '<prosody rate="slow">or write to <sub alias="the World Wide Web Consortium">W3C</sub></prosody>.</speak>')
READ = ("Call five five five, one four two three <|prosody:long_pause|> <|prosody:speed_slow|>or write to the World "
        "Wide Web Consortium.")


@pytest.mark.parametrize("doc, read", [
    (DOC, READ),
    ('<speak>A<break time="300ms"/>B<break strength="none"/>C<break/>D</speak>',
     "A<|prosody:pause|>BC<|prosody:pause|>D"),
    ('<speak><prosody rate="x-fast" pitch="high">Quick!</prosody> <prosody rate="50%">Slow.</prosody></speak>',
     "<|prosody:speed_very_fast|><|prosody:pitch_high|>Quick! <|prosody:speed_very_slow|>Slow."),
    ('<speak><say-as interpret-as="characters">R2D2</say-as>, <say-as interpret-as="cardinal">1,204</say-as>, the '
     '<say-as interpret-as="ordinal">21st</say-as> on <say-as interpret-as="date" format="dmy">25/12/2024</say-as>'
     '</speak>', "R two D two, one thousand two hundred and four, the twenty-first on December twenty-fifth, twenty "
                 "twenty-four"),
    ('<speak>It is <emphasis level="strong">very</emphasis> <emphasis level="reduced">quiet</emphasis>.</speak>',
     "It is <|prosody:expressive_high|>very <|prosody:expressive_low|>quiet."),
    ('<speak xmlns="http://www.w3.org/2001/10/synthesis" version="1.1" xml:lang="en-US">Namespaced &amp; fine.'
     '</speak>', "Namespaced & fine."),
    ("A fragment <break/> without speak.", "A fragment <|prosody:pause|> without speak."),
])
def test_each_element_becomes_text_and_tags(doc, read):
    assert to_text(doc, TAGS) == read


BILLION_LAUGHS = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;">'
                  '<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;">]><speak>&lol3;</speak>')
XXE = '<?xml version="1.0"?><!DOCTYPE s [<!ENTITY x SYSTEM "file:///etc/passwd">]><speak>&x;</speak>'


@pytest.mark.parametrize("doc, message", [
    (BILLION_LAUGHS, "refused: DTDForbidden"),
    (XXE, "refused: DTDForbidden"),
    ("<speak>unclosed", "not well-formed XML"),
    ("<speak>&nbsp;</speak>", "not well-formed XML"),  # an undefined entity is never looked up
    ('<speak><audio src="http://example.com/x.wav"/></speak>', "SSML element <audio> is not supported"),
    ('<speak><voice name="x">Hi</voice></speak>', "SSML element <voice> is not supported"),
    ('<speak><prosody volume="loud">Hi</prosody></speak>', 'SSML attribute volume="..." of <prosody>'),
    ('<speak><break time="20s"/></speak>', "longer than 10 s"),
    ('<speak><break time="soon"/></speak>', 'time="soon" is not a duration'),
    ('<speak><say-as interpret-as="cardinal">many</say-as></speak>', "'many' is not a number"),
    ('<speak><say-as interpret-as="date" format="mdy">13/45/2024</say-as></speak>', "not a day of the calendar"),
    ('<speak><say-as interpret-as="expletive">x</say-as></speak>', 'interpret-as="expletive"> is not supported'),
    ('<speak><sub>W3C</sub></speak>', "<sub> needs an alias"),
    ('<speak><prosody rate="900%">Hi</prosody></speak>', "25% to 400%"),
    ("<speak><speak>Hi</speak></speak>", "<speak> may only be the root"),
    ("<?xml version=\"1.0\"?><other>Hi</other>", "root must be <speak>"),
    ("<other>Hi</other>", "SSML element <other> is not supported"),
    ("<speak>" + "<emphasis>" * 40 + "x" + "</emphasis>" * 40 + "</speak>", "nested deeper than 32"),
    ("<speak>" + "a" * 100_001 + "</speak>", "the limit is 100,000"),
    # a DTD with no XML declaration (the usual XXE form) is a DTD, not text that is not well-formed
    (XXE.removeprefix('<?xml version="1.0"?>'), "refused: DTDForbidden"),
    ("<!DOCTYPE speak><speak>Hi</speak>", "refused: DTDForbidden"),
    # a processing instruction is never dropped silently
    ("<speak>Hi <?php echo 1; ?> there</speak>", "processing instruction <?php ...?> is not read"),
    ('<?xml version="1.0"?><?xml-stylesheet href="s.xsl"?><speak>Hi</speak>', "<?xml-stylesheet ...?> is not read"),
    ("Hi <?tts fast?> there", "<?tts ...?> is not read"),
    # namespaces honoured: a foreign foo:rate is not SSML's rate, a foreign element is not SSML's
    ('<speak xmlns:foo="urn:x"><prosody foo:rate="x-fast">Hi</prosody></speak>',
     'attribute rate="..." of <prosody> is in the namespace urn:x'),
    ('<speak xmlns:foo="urn:x">Hi <foo:break time="1s"/></speak>', "element <break> is in the namespace urn:x"),
    ('<speak><say-as>12</say-as></speak>', "<say-as> needs an interpret-as attribute (characters, spell-out"),
])
def test_hostile_and_unsupported_documents_are_refused_by_name(doc, message):
    with pytest.raises(SsmlError, match=re.escape(message)):
        to_text(doc, TAGS)


def test_ssml_namespace_and_xml_attributes_are_read():
    doc = ('<speak xmlns="http://www.w3.org/2001/10/synthesis" xmlns:s="http://www.w3.org/2001/10/synthesis" '
           'xml:lang="en" xml:base="http://example.com/"><prosody s:rate="x-fast">Go</prosody>.</speak>')
    assert to_text(doc, TAGS) == "<|prosody:speed_very_fast|>Go."


def test_the_corpus_refuses_a_bad_document_before_any_work(tmp_path):
    from higgs_onnx.corpus import read_rows

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "text": DOC, "ssml": True}) + "\n"
                    + json.dumps({"id": "b", "text": BILLION_LAUGHS, "ssml": True}) + "\n"
                    + json.dumps({"id": "c", "text": "<speak>x</speak>", "ssml": "yes"}) + "\n")
    a, b, c = read_rows(rows)
    assert a.error is None and a.text_options == {"ssml": True}
    assert b.error.startswith("text: the SSML document is refused: DTDForbidden")
    assert c.error == "ssml must be true or false, got 'yes'"


@pytest.mark.slow
def test_http_and_the_command_line_show_what_the_document_became(builds, tmp_path):
    with served(builds["fp32"], tmp_path) as s:
        body = {"model": "tts-1", "input": DOC, "ssml": True}
        dry = s.http.post("/v1/audio/speech", json={**body, "dry_run": True})
        assert dry.status_code == 200 and dry.json()["read"] == READ and dry.json()["steps"][0]["step"] == "ssml"
        wav = s.http.post("/v1/audio/speech", json={**body, "response_format": "wav", "max_rows": 60})
        assert wav.status_code == 200 and wav.content[:4] == b"RIFF"
        bad = s.http.post("/v1/audio/speech", json={**body, "input": BILLION_LAUGHS})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
        assert "DTDForbidden" in bad.json()["error"]["message"]
        assert s.http.post("/v1/audio/speech", json={**body, "ssml": "yes"}).json()["error"]["param"] == "ssml"
    p = subprocess.run([sys.executable, "inference.py", "--model-path", str(builds["fp32"]), "--text", DOC, "--ssml",
                        "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and READ in p.stdout, p.stdout + p.stderr
    p = subprocess.run([sys.executable, "inference.py", "--model-path", str(builds["fp32"]), "--text",
                        '<speak><audio src="x"/></speak>', "--ssml", "--dry-run"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error:") and "<audio>" in p.stderr
    p = subprocess.run([sys.executable, "-m", "higgs_onnx.serve", "--model-path", str(builds["fp32"]), "--ssml"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--ssml is per request" in p.stderr


AUDIO_ALIAS = '<sub alias="&lt;|audio|&gt;">W3C</sub>'
REFUSED = ((f"<speak>{AUDIO_ALIAS}</speak>", "the special token <|audio|>"),
           (f"Hi {AUDIO_ALIAS} there", "the special token <|audio|>"),
           ("<speak>Hi <?tts fast?></speak>", "processing instruction <?tts ...?>"),
           ("<speak><say-as>12</say-as></speak>", "needs an interpret-as attribute"))


@pytest.mark.slow
def test_what_a_document_reads_as_is_refused_before_any_work(builds, tmp_path):
    """A document that reads as a special token (an alias of `<|audio|>`: not "nothing to speak"), a processing
    instruction, a say-as without its kind: HTTP's 400 names it (the dry run too); a corpus row is a row error on the
    driver in the server's words, before Ray starts (no row to make, exit 1). `--ssml` as a server default: its help
    says it is refused, as its error does."""
    with served(builds["fp32"], tmp_path / "server") as s:
        for doc, words in REFUSED:
            for dry_run in (True, False):
                bad = s.http.post("/v1/audio/speech", json={"model": "tts-1", "input": doc, "ssml": True,
                                                            "dry_run": dry_run})
                err = bad.json()["error"]
                assert bad.status_code == 400 and err["param"] == "input" and words in err["message"], (doc, err)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "text": doc, "ssml": True}) + "\n"
                            for i, (doc, _) in enumerate(REFUSED)))
    p = subprocess.run([sys.executable, "-m", "higgs_onnx.corpus", "--model-path", str(builds["fp32"]), "--input",
                        str(rows), "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and f"0 to make, {len(REFUSED)} bad" in p.stderr, p.stderr
    errors = [json.loads(line)["error"] for line in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    assert errors[0].startswith("text contains the special token <|audio|>, which only the toolkit may place")
    assert all(words in e for e, (_, words) in zip(errors, REFUSED, strict=True)), errors
    for door, words in (("higgs_onnx.serve", "--ssml is per request"), ("higgs_onnx.wyoming", "--ssml does not apply")):
        helped = subprocess.run([sys.executable, "-m", door, "--help"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60).stdout
        assert f"refused: {words}" in " ".join(helped.split()), helped  # what its error says (tested above)
