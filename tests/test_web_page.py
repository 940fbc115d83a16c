"""The web page in a real browser: headless Chromium (Debian's, driven by Playwright) on a running server (tiny int4
export). Types text, clicks a tag and Speak, waits until streamed audio arrived and the <audio> element holds the
whole utterance, creates a voice through the upload form; no page errors. A screenshot lands in the test's tmp dir
and in tests/output/web_page.png. Also: the built-in default voice cannot be deleted (the button says so), a wrong
API key is named as such (a second server, with a key), and a 64-character voice name does not push a 360-pixel
wide (phone) page sideways. Read-along: a long text read in pieces lists them with the server's cue times, and the
piece highlighted is the one whose [start_s, end_s) holds the <audio> element's time, seeked and while it plays.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
CHROMIUM = Path("/usr/bin/chromium")
OUTPUT = Path(__file__).resolve().parent / "output"


def need_chromium() -> None:
    """CI must have the browser (.ci/run installs it); elsewhere a missing one skips, with the reason."""
    if CHROMIUM.exists():
        return
    if os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing under CI (apt-get install chromium)")
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")


KEY = "page-key-42"


def start_server(model: Path, tmp: Path, *args: str):
    """A server subprocess; yields its URL, stops it after."""
    log = tmp / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "higgs_onnx.serve", "--model-path", str(model),
                             "--port", "0", "--voices", str(tmp / "voices"), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True, env={**os.environ, "CI": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    deadline, found = time.monotonic() + 120, None
    while found is None:
        try:
            found = re.search(r"http://[^/\s]+", lines.get(timeout=0.2))
        except queue.Empty:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the server did not start: {log.read_text()[-2000:]}")
    yield found.group(0)
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def url(builds, tmp_path_factory):
    need_chromium()
    yield from start_server(builds["int4"], tmp_path_factory.mktemp("web"))


@pytest.fixture(scope="module")
def keyed_url(builds, tmp_path_factory):
    need_chromium()
    yield from start_server(builds["int4"], tmp_path_factory.mktemp("web_key"), "--api-key", KEY)


@pytest.fixture(scope="module")
def browser(url):
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM),
                              args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required"])
        yield b
        b.close()


def wait_until(page, js: str, timeout: float = 60.0):
    """Poll a JS expression until truthy (page.wait_for_function evals strings, which the page's CSP forbids)."""
    deadline = time.monotonic() + timeout
    while not (value := page.evaluate(js)):
        assert time.monotonic() < deadline, f"timed out waiting for {js}"
        time.sleep(0.05)
    return value


def test_speak_streams_and_plays(url, browser, tmp_path):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.goto(url)
    page.wait_for_selector("button.tag")  # tags came from /v1/tags
    assert page.locator("button.tag").count() >= 10
    page.fill("#text", "Hello from the browser, streamed while it is spoken.")
    page.focus("#text")
    page.keyboard.press("Control+Home")  # the tag goes where the cursor is: at the start
    page.locator("button.tag[title='<|emotion:elation|>']").click()
    assert page.input_value("#text").startswith("<|emotion:elation|>Hello from the browser")
    page.locator("summary", has_text="Sampling").click()
    page.fill("#max_rows", "400")
    t0 = time.perf_counter()
    page.click("#speak")
    wait_until(page, "(() => { const a = document.getElementById('player'), s = document.getElementById('status');"
               " return s.dataset.state === 'error' || (s.dataset.state === 'done' && isFinite(a.duration) && "
               "a.duration > 0); })()")
    wall = time.perf_counter() - t0
    status = page.locator("#status")
    assert status.get_attribute("data-state") == "done", status.text_content()
    received = int(status.get_attribute("data-bytes"))
    duration = page.evaluate("document.getElementById('player').duration")
    assert received > 0 and abs(duration - received / 2 / 24000) < 0.01, (received, duration)
    assert "first audio after" in status.text_content()
    assert page.locator("#download").is_visible()

    # a voice from the upload form shows up in the picker
    page.locator("details", has_text="New voice").locator("summary").click()
    page.fill("input[name=name]", "page_voice")
    page.set_input_files("input[name=file]", str(DATA / "ref_en_24k.wav"))
    page.click("#voice-form button[type=submit]")
    wait_until(page, "/created|error/.test(document.getElementById('voice-status').textContent)")
    assert "created" in page.locator("#voice-status").text_content()
    assert "page_voice" in page.locator("#voice option").all_text_contents()
    assert page.input_value("#voice") == "page_voice"

    shot = tmp_path / "web_page.png"
    page.screenshot(path=str(shot), full_page=True)
    OUTPUT.mkdir(exist_ok=True)
    shutil.copyfile(shot, OUTPUT / "web_page.png")
    print(f"\nweb page: {received / 2 / 24000:.2f} s of audio streamed in {wall:.2f} s ({status.text_content()}); "
          f"screenshot {OUTPUT / 'web_page.png'}")
    assert not errors, errors
    page.close()


def test_bad_input_shows_the_error(url, browser):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_selector("button.tag")
    page.fill("#text", "<|sfx:cough|>")  # only a tag: the server refuses it with one line
    page.click("#speak")
    wait_until(page, "document.getElementById('status').dataset.state === 'error'")
    assert "only control tags" in page.locator("#status").text_content()
    assert not errors, errors
    page.close()


def test_default_voice_cannot_be_deleted(url, browser):
    page = browser.new_page()
    page.goto(url)
    page.wait_for_selector("button.tag")
    assert page.input_value("#voice") == "default"
    button = page.locator("#voice-delete")
    assert button.is_disabled() and "cannot be deleted" in button.get_attribute("title")
    page.evaluate("document.getElementById('voice-delete').disabled = false")  # even if forced: a clear message
    page.click("#voice-delete")
    status = page.locator("#status")
    assert status.get_attribute("data-state") == "error" and "cannot be deleted" in status.text_content()
    page.close()


def test_wrong_api_key_is_named(keyed_url, browser):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(keyed_url)
    wait_until(page, "!document.getElementById('key-box').hidden")  # no key yet: the page asks for one
    # the box shows first, the status a tick later (it waits on the 401's body): wait for the words, not the box
    wait_until(page, "/needs an API key/.test(document.getElementById('key-status').textContent)")
    page.fill("#api-key", "not-the-key")
    page.click("#key-save")
    wait_until(page, "/refused/.test(document.getElementById('key-status').textContent)")
    text = page.locator("#key-status").text_content()
    assert "incorrect API key" in text and page.locator("#key-box").is_visible(), text
    page.fill("#api-key", KEY)
    page.click("#key-save")
    page.wait_for_selector("button.tag")  # the tags load with the right key
    assert page.locator("#key-box").is_hidden() and page.locator("#key-status").text_content() == ""
    assert not errors, errors
    page.evaluate("localStorage.clear()")
    page.close()


def overflow(page) -> list[str]:
    """Elements whose right edge is past the viewport, and whether the page scrolls sideways."""
    return page.evaluate("""(() => {
      const w = document.documentElement.clientWidth, out = [];
      if (document.documentElement.scrollWidth > w) out.push(`page ${document.documentElement.scrollWidth} > ${w}`);
      for (const el of document.querySelectorAll('main *')) {
        const r = el.getBoundingClientRect();
        if (r.width && r.right > w + 0.5) out.push(`${el.tagName}#${el.id}.${el.className} right ${r.right} > ${w}`);
      }
      return out;
    })()""")


def test_long_voice_name_on_a_phone(url, browser):
    name = "a_very_long_voice_name_without_any_spaces_" + "x" * 22
    assert len(name) == 64
    page = browser.new_page(viewport={"width": 360, "height": 740})
    page.goto(url)
    page.wait_for_selector("button.tag")
    assert overflow(page) == []
    page.locator("details", has_text="New voice").locator("summary").click()
    page.fill("input[name=name]", name)
    page.set_input_files("input[name=file]", str(DATA / "ref_en_24k.wav"))
    page.click("#voice-form button[type=submit]")
    wait_until(page, "/created|error/.test(document.getElementById('voice-status').textContent)")
    assert name in page.locator("#voice-status").text_content()
    assert page.input_value("#voice") == name and page.locator("#voice-delete").is_enabled()
    assert overflow(page) == [], overflow(page)
    OUTPUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUTPUT / "web_page_phone.png"), full_page=True)
    page.on("dialog", lambda d: d.accept())
    page.click("#voice-delete")
    wait_until(page, "/deleted/.test(document.getElementById('status').textContent)")
    assert name in page.locator("#status").text_content() and overflow(page) == [], overflow(page)
    assert page.input_value("#voice") == "default" and page.locator("#voice-delete").is_disabled()
    page.close()


def server_cues(url: str, body: dict) -> list[dict]:
    """The `audio.speech.piece` events of the same request, read here (the page's audio is the same: seeded, alone)."""
    import json

    import httpx2 as httpx

    r = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=120)
    assert r.status_code == 200, r.text[:300]
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    return [e for e in events if e["type"] == "audio.speech.piece"]


def test_read_along_highlights_the_piece_being_played(url, browser):
    from servers import sentences

    text = sentences(90)  # ~4,900 characters: read in pieces
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.goto(url)
    page.wait_for_selector("button.tag")
    assert page.locator("#read-along").is_hidden()
    page.fill("#text", text)
    page.locator("summary", has_text="Sampling").click()
    page.fill("#max_rows", "24")
    page.fill("#seed", "3")
    page.click("#speak")
    wait_until(page, "(() => { const s = document.getElementById('status').dataset.state;"
               " return s === 'error' || s === 'done'; })()", timeout=180)
    assert page.locator("#status").get_attribute("data-state") == "done", page.locator("#status").text_content()
    model = page.evaluate("fetch('/health').then(r => r.json()).then(h => h.model)")
    cues = server_cues(url, {"model": model, "input": text, "voice": "default", "response_format": "pcm",
                             "stream_format": "sse", "max_rows": 24, "seed": 3})
    shown = page.evaluate("[...document.querySelectorAll('#pieces li')].map(li => [li.textContent, "
                          "Number(li.dataset.start), Number(li.dataset.end)])")
    assert len(shown) >= 2 and shown == [[c["text"], c["start_s"], c["end_s"]] for c in cues]
    assert page.locator("#read-along").is_visible()

    current = "document.getElementById('pieces').dataset.current"

    def at(t: float, index: int) -> None:  # seek the <audio> element to t: the piece `index` (-1: none) is lit
        page.evaluate(f"document.getElementById('player').currentTime = {t}")
        wait_until(page, f"{current} === '{index}'", timeout=5)
        lit = page.evaluate("[...document.querySelectorAll('#pieces li.reading')].map(li => Number(li.dataset.index))")
        assert lit == ([] if index < 0 else [index]), (t, index, lit)

    for i, c in enumerate(cues[:4]):
        at(c["start_s"] + 0.005, i)
        at(c["end_s"] - 0.005, i)
        at(c["end_s"] + 0.005, -1)  # the pause after it belongs to no piece
    at(cues[-1]["start_s"] + 0.005, len(cues) - 1)

    # playing across the boundaries between piece 1, its pause and piece 2: each change of the highlight, with the
    # time the element was at, as the page made it
    page.evaluate(f"""(() => {{
      const a = document.getElementById('player'), p = document.getElementById('pieces');
      window.highlights = [];
      new MutationObserver(() => window.highlights.push([p.dataset.current, a.currentTime]))
        .observe(p, {{ attributes: true, attributeFilter: ['data-current'] }});
      a.currentTime = {cues[1]["end_s"] - 0.25};
    }})()""")
    wait_until(page, f"{current} === '1'", timeout=5)
    page.evaluate("document.getElementById('player').play()")
    changes = wait_until(page, "window.highlights.some(h => h[0] === '2') && window.highlights", timeout=30)
    page.evaluate("document.getElementById('player').pause()")
    seen = [(int(i), t) for i, t in changes if int(i) != 1 or t < cues[1]["end_s"]]  # from the seek on
    gap, second = next(h for h in seen if h[0] == -1), next(h for h in seen if h[0] == 2)
    # never early; late by at most the page's 50 ms poll plus a busy machine's delays (0.5 s, pieces last seconds)
    assert cues[1]["end_s"] <= gap[1] < cues[1]["end_s"] + 0.5, (seen, cues[1])
    assert cues[2]["start_s"] <= second[1] < cues[2]["start_s"] + 0.5, (seen, cues[2])
    OUTPUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUTPUT / "web_page_read_along.png"), full_page=True)
    print(f"\nread-along: {len(cues)} pieces; highlight changes while playing {seen}")
    assert not errors, errors
    page.close()


def test_read_along_word_by_word(url, browser):
    """With "read along word by word" the page asks for word timing (`caption_level` "word"): a short text is one
    piece. The tiny model's audio is not speech, so its piece says why it has no word timing. Then the server's own
    events for the real recording in tests/data (job.run.with_words, as the server makes them) and that
    recording in the <audio> element: the word highlighted is the one whose [start_s, end_s) holds the time."""
    import base64
    import concurrent.futures
    import json

    from word_streams import chunks, served_words

    from higgs_onnx.audio import read_audio
    from higgs_onnx.longform.captions import Cue

    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.goto(url)
    page.wait_for_selector("button.tag")
    page.fill("#text", "Hello there, reader.")
    page.locator("summary", has_text="Sampling").click()
    page.fill("#max_rows", "24")
    page.check("#word_timing")
    page.click("#speak")
    wait_until(page, "(() => { const s = document.getElementById('status').dataset.state;"
               " return s === 'error' || s === 'done'; })()", timeout=120)
    assert page.locator("#status").get_attribute("data-state") == "done", page.locator("#status").text_content()
    title = page.evaluate("[...document.querySelectorAll('#pieces li')].map(li => [li.textContent, li.title])")
    assert len(title) == 1 and title[0][0] == "Hello there, reader." and "no word timing: pocketsphinx found no " \
        "alignment" in title[0][1], title

    data, sr = read_audio(DATA / "ref_en_24k.wav")
    text = (DATA / "ref_en_24k.txt").read_text().strip()
    mono = data[:, 0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # Playwright's own loop runs in this thread
        served = pool.submit(served_words, Cue(0, None, text), [*chunks(mono, sr), Cue(0, len(mono), text)], text,
                             sr).result()
    start, end = (c.event("speech-1", sr) for c in served if isinstance(c, Cue))
    words = end["words"]
    assert [w["text"] for w in words] == text.replace(".", "").split()
    wav = (DATA / "ref_en_24k.wav").read_bytes()
    page.evaluate(f"""(() => {{
      resetPieces();
      onPiece({json.dumps(start)});
      onPiece({json.dumps(end)});
      const raw = atob("{base64.b64encode(wav).decode()}"), bytes = new Uint8Array(raw.length);
      for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
      document.getElementById('player').src = URL.createObjectURL(new Blob([bytes], {{ type: "audio/wav" }}));
    }})()""")
    wait_until(page, "document.getElementById('player').readyState >= 1", timeout=10)
    spans = page.evaluate("[...document.querySelectorAll('#pieces li .word')].map(s => s.textContent)")
    assert spans == [w["text"] for w in words]
    word = "document.getElementById('pieces').dataset.word"
    for k in (0, 3, 9, len(words) - 1):
        w = words[k]
        page.evaluate(f"document.getElementById('player').currentTime = {(w['start_s'] + w['end_s']) / 2}")
        wait_until(page, f"{word} === {w['text']!r}", timeout=5)
        lit = page.evaluate("[...document.querySelectorAll('#pieces .reading-word')].map(s => s.textContent)")
        assert lit == [w["text"]], (k, lit)
    gap = next(((a["end_s"], b["start_s"]) for a, b in zip(words, words[1:], strict=False)
                if b["start_s"] - a["end_s"] > 0.1), None)
    assert gap is not None  # the pause between the two sentences: no word is lit there
    page.evaluate(f"document.getElementById('player').currentTime = {sum(gap) / 2}")
    wait_until(page, f"{word} === ''", timeout=5)
    page.screenshot(path=str(OUTPUT / "web_page_words.png"), full_page=True)
    assert not errors, errors
    page.close()
