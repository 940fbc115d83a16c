// The speech page: streams /v1/audio/speech as server-sent events (base64 PCM deltas) into Web Audio while it is
// generated, then keeps the whole utterance as a WAV in the <audio> element (replay, seek, download). A long text is
// read in pieces: the server's piece events (start_s / end_s, the times of the samples sent) list the pieces, and
// the one being played, by the Web Audio stream or by the <audio> element, is highlighted (read-along); with word
// timing ("caption_level": "word") each finished piece's event carries its words, and the word being played is
// highlighted too. Plain ES2020, no build step.
"use strict";

const RATE = 24000; // the codec's sample rate: the server's pcm is s16le mono at 24 kHz
const $ = (id) => document.getElementById(id);
// live: the Player of the last utterance until the <audio> element is played or seeked (then that is what plays)
const state = { key: localStorage.getItem("higgs-api-key") || "", model: "higgs-tts-3", run: null, live: null };
// cues[i] = {start, end (null while it is made), el, words: [{start, end, el}]}; word: the highlighted word's el
const readAlong = { cues: [], current: -1, word: null };

function setStatus(text, kind, bytes) {
  const el = $("status");
  el.textContent = text;
  if (kind) el.dataset.state = kind;
  if (bytes !== undefined) el.dataset.bytes = String(bytes);
}

async function api(path, init = {}) {
  const headers = new Headers(init.headers || {});
  const key = state.key; // a late answer to a key since replaced says nothing about the current one
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const res = await fetch(path, { ...init, headers });
  if (key !== state.key) return res;
  if (res.status === 401) await askForKey(res.clone(), key);
  else if (res.ok && key) showKeyStatus("", "idle");
  return res;
}

function showKeyStatus(text, kind) {
  const el = $("key-status");
  el.textContent = text;
  el.dataset.state = kind;
}

async function askForKey(res, key) {
  // 401: no key, or the wrong one. Say which, keep the box open, and put the cursor in it.
  $("key-box").hidden = false;
  const why = await errorText(res);
  if (key !== state.key) return; // a new key was entered meanwhile
  showKeyStatus(state.key ? `the API key was refused (${why}); enter the right key` :
    "this server needs an API key: enter it and press Use key", "error");
  $("api-key").focus();
}

async function errorText(res) {
  try {
    const body = await res.json();
    return (body.error && body.error.message) || `HTTP ${res.status}`;
  } catch (_) {
    return `HTTP ${res.status} ${res.statusText}`;
  }
}

async function loadInfo() {
  try {
    const res = await fetch("/health");
    const h = await res.json();
    state.model = h.model;
    $("model").textContent = `model ${h.model} · ${h.sample_rate} Hz · batch ${h.scheduler.max_batch}`;
  } catch (e) {
    $("model").textContent = `server not reachable: ${e.message}`;
  }
  await Promise.all([loadTags(), loadVoices()]);
}

async function loadTags() {
  const res = await api("/v1/tags");
  if (!res.ok) return;
  const box = $("tags");
  box.replaceChildren();
  const groups = {};
  for (const t of (await res.json()).data) (groups[t.category] ||= []).push(t);
  for (const [category, tags] of Object.entries(groups)) {
    const group = document.createElement("div");
    const title = document.createElement("span");
    title.className = "tag-group";
    title.textContent = category;
    group.append(title);
    for (const t of tags) {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "tag";
      b.textContent = t.name.replaceAll("_", " ");
      b.title = t.id;
      b.addEventListener("click", () => insertTag(t.id));
      group.append(b);
    }
    box.append(group);
  }
}

function insertTag(tag) {
  const ta = $("text");
  const [a, b] = [ta.selectionStart ?? ta.value.length, ta.selectionEnd ?? ta.value.length];
  ta.value = ta.value.slice(0, a) + tag + ta.value.slice(b);
  ta.focus();
  ta.selectionStart = ta.selectionEnd = a + tag.length;
}

async function loadVoices(select) {
  const res = await api("/v1/voices");
  if (!res.ok) return;
  const sel = $("voice");
  const keep = select || sel.value;
  sel.replaceChildren();
  for (const v of (await res.json()).data) {
    const o = document.createElement("option");
    o.value = v.id;
    o.textContent = v.id === "default" ? "default (no reference)" : v.id;
    sel.append(o);
  }
  if ([...sel.options].some((o) => o.value === keep)) sel.value = keep;
  voiceChanged();
}

function voiceChanged() {
  // the built-in default voice cannot be deleted: the button says so instead of doing nothing
  const builtIn = $("voice").value === "default";
  const b = $("voice-delete");
  b.disabled = builtIn;
  b.title = builtIn ? "the default voice is built in and cannot be deleted" : "delete the selected voice";
}

function options() {
  const out = {};
  for (const [id, parse] of [["speed", parseFloat], ["temperature", parseFloat], ["top_k", parseInt],
    ["top_p", parseFloat], ["seed", parseInt], ["max_rows", parseInt]]) {
    const v = $(id).value.trim();
    if (v !== "") out[id] = parse(v);
  }
  if ($("word_timing").checked) out.caption_level = "word";
  return out;
}

function wavBlob(pieces, total) {
  const header = new DataView(new ArrayBuffer(44));
  const put = (o, s) => [...s].forEach((c, i) => header.setUint8(o + i, c.charCodeAt(0)));
  put(0, "RIFF"); header.setUint32(4, 36 + total, true); put(8, "WAVEfmt ");
  header.setUint32(16, 16, true); header.setUint16(20, 1, true); header.setUint16(22, 1, true);
  header.setUint32(24, RATE, true); header.setUint32(28, RATE * 2, true);
  header.setUint16(32, 2, true); header.setUint16(34, 16, true);
  put(36, "data"); header.setUint32(40, total, true);
  return new Blob([header, ...pieces], { type: "audio/wav" });
}

class Player {
  // Schedules PCM pieces back to back on one AudioContext as they arrive; `segments` maps its clock to the stream.
  constructor() {
    try {
      this.ctx = new AudioContext();
    } catch (_) {
      this.ctx = null; // no audio output: the <audio> element still gets the result
    }
    this.next = 0;
    this.sources = [];
    this.segments = []; // {at: context time it starts, offset: stream seconds before it, duration}
    this.received = 0; // stream seconds scheduled
    this.stopped = false;
  }

  position() {
    // stream seconds played: a gap (audio arriving slower than it plays) holds at the end of what was played
    if (!this.ctx) return Infinity;
    const t = this.ctx.currentTime;
    let pos = 0;
    for (const s of this.segments) {
      if (t < s.at) break;
      pos = s.offset + Math.min(t - s.at, s.duration);
    }
    return pos;
  }

  play(int16) {
    if (!this.ctx || this.stopped || !int16.length) return;
    const buf = this.ctx.createBuffer(1, int16.length, RATE);
    const ch = buf.getChannelData(0);
    for (let i = 0; i < int16.length; i++) ch[i] = int16[i] / 32768;
    const src = this.ctx.createBufferSource();
    src.buffer = buf;
    src.connect(this.ctx.destination);
    this.next = Math.max(this.next, this.ctx.currentTime + 0.05);
    src.start(this.next);
    this.segments.push({ at: this.next, offset: this.received, duration: buf.duration });
    this.received += buf.duration;
    this.next += buf.duration;
    this.sources.push(src);
  }

  stop() {
    if (this.stopped) return;
    this.stopped = true;
    for (const s of this.sources) try { s.stop(); } catch (_) { /* not started */ }
    if (this.ctx) this.ctx.close();
  }
}

function resetPieces() {
  readAlong.cues = [];
  readAlong.current = -1;
  readAlong.word = null;
  $("pieces").replaceChildren();
  $("pieces").dataset.current = "-1";
  $("read-along").hidden = true;
}

function onPiece(ev) {
  // audio.speech.piece.start: the piece's first samples were sent (end_s null); audio.speech.piece: its last
  let cue = readAlong.cues[ev.index];
  if (!cue) {
    const li = document.createElement("li");
    li.className = "piece";
    li.textContent = ev.text;
    li.dataset.index = String(ev.index);
    li.dataset.start = String(ev.start_s);
    li.addEventListener("click", () => playFrom(ev.index));
    $("pieces").append(li);
    $("read-along").hidden = false;
    cue = readAlong.cues[ev.index] = { start: ev.start_s, end: null, el: li };
  }
  if (ev.end_s !== null) {
    cue.end = ev.end_s;
    cue.el.dataset.end = String(ev.end_s);
    if (ev.words && ev.words.length) setWords(cue, ev.words);
    else if (ev.words_reason) cue.el.title = `no word timing: ${ev.words_reason}`;
  }
}

function setWords(cue, words) {
  // the piece's text becomes its timed words, a span each (the stream's times, like the pieces')
  cue.words = words.map((w) => {
    const span = document.createElement("span");
    span.className = "word";
    span.textContent = w.text;
    span.dataset.start = String(w.start_s);
    span.dataset.end = String(w.end_s);
    return { start: w.start_s, end: w.end_s, el: span };
  });
  const parts = [];
  cue.words.forEach((w, k) => parts.push(...(k ? [" ", w.el] : [w.el])));
  cue.el.replaceChildren(...parts);
}

function highlightWord(t) {
  // the word of the piece being played whose [start, end) holds `t`; none between words
  const cue = readAlong.cues[readAlong.current];
  const w = cue && cue.words ? cue.words.find((x) => t >= x.start && t < x.end) : null;
  const el = w ? w.el : null;
  if (el === readAlong.word) return;
  if (readAlong.word) readAlong.word.classList.remove("reading-word");
  if (el) el.classList.add("reading-word");
  readAlong.word = el;
  $("pieces").dataset.word = el ? el.textContent : "";
}

function playbackTime() {
  return state.live ? state.live.position() : $("player").currentTime;
}

function highlight() {
  // the piece whose samples [start, end) hold the time being played; none in the pauses between pieces
  const t = playbackTime();
  const i = readAlong.cues.findIndex((c) => c && t >= c.start && (c.end === null || t < c.end));
  if (i === readAlong.current) return highlightWord(t);
  const before = readAlong.cues[readAlong.current];
  if (before) {
    before.el.classList.remove("reading");
    before.el.removeAttribute("aria-current");
  }
  if (i >= 0) {
    const li = readAlong.cues[i].el, box = $("pieces");
    li.classList.add("reading");
    li.setAttribute("aria-current", "true");
    if (li.offsetTop < box.scrollTop || li.offsetTop + li.offsetHeight > box.scrollTop + box.clientHeight) {
      box.scrollTop = li.offsetTop; // the list scrolls to the piece (the page itself stays where it is)
    }
  }
  readAlong.current = i;
  $("pieces").dataset.current = String(i);
  highlightWord(t);
}

function takeOver() {
  // the <audio> element is played or seeked: it is what plays from now on, the live stream stops
  if (state.live) state.live.stop();
  state.live = null;
}

function playFrom(index) {
  const a = $("player"), cue = readAlong.cues[index];
  if (!cue || !a.src) return;
  a.currentTime = cue.start;
  a.play().catch(() => { /* no audio output: the time is still set */ });
}

function sseEvents(onEvent) {
  // a parser for a text/event-stream body read in arbitrary pieces: each complete event's data, parsed
  const decoder = new TextDecoder();
  let buf = "";
  return (bytes, last) => {
    buf += decoder.decode(bytes, { stream: !last });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("");
      if (data) onEvent(JSON.parse(data));
    }
  };
}

function base64Samples(text) {
  const raw = atob(text);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return new Int16Array(bytes.buffer, 0, bytes.length >> 1);
}

async function speak() {
  const text = $("text").value;
  if (!text.trim()) return setStatus("type some text first", "error");
  takeOver(); // a new utterance: the last one's stream stops, and so does its recording
  const a = $("player");
  a.pause();
  a.removeAttribute("src");
  a.load();
  resetPieces();
  const run = { abort: new AbortController(), player: new Player() };
  state.run = run;
  if (run.player.ctx) state.live = run.player; // the read-along follows the stream while it plays
  $("speak").disabled = true;
  $("stop").disabled = false;
  $("download").hidden = true;
  const t0 = performance.now();
  const secs = () => ((performance.now() - t0) / 1000).toFixed(2);
  setStatus("waiting for the first audio…", "waiting", 0);
  const chunks = [];
  let total = 0, first = null;
  const onEvent = (ev) => {
    if (ev.type === "speech.audio.delta") {
      const samples = base64Samples(ev.audio);
      if (!samples.length) return;
      chunks.push(samples);
      total += samples.length * 2;
      if (first === null) first = secs();
      run.player.play(samples);
      setStatus(`streaming: first audio after ${first} s, ${(total / 2 / RATE).toFixed(2)} s received`,
        "streaming", total);
    } else if (ev.type === "audio.speech.piece.start" || ev.type === "audio.speech.piece") {
      onPiece(ev);
    } else if (ev.type === "error") {
      throw new Error(ev.error.message);
    }
  };
  try {
    const res = await api("/v1/audio/speech", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: state.model, input: text, voice: $("voice").value, response_format: "pcm",
        stream_format: "sse", ...options() }),
      signal: run.abort.signal,
    });
    if (!res.ok) throw new Error(await errorText(res));
    const reader = res.body.getReader(), feed = sseEvents(onEvent);
    for (;;) {
      const { done, value } = await reader.read();
      feed(value || new Uint8Array(0), done);
      if (done) break;
    }
    const blob = wavBlob(chunks, total);
    const url = URL.createObjectURL(blob);
    a.src = url;
    $("download").href = url;
    $("download").hidden = false;
    setStatus(`done: ${(total / 2 / RATE).toFixed(2)} s of audio in ${secs()} s (first audio after ${first} s)`,
      "done", total);
  } catch (e) {
    if (e.name === "AbortError") setStatus(`stopped after ${secs()} s`, "stopped", total);
    else setStatus(`error: ${e.message}`, "error", total);
  } finally {
    $("speak").disabled = false;
    $("stop").disabled = true;
    state.run = null;
  }
}

function stop() {
  if (!state.run) return;
  state.run.abort.abort();
  state.run.player.stop();
}

async function createVoice(ev) {
  ev.preventDefault();
  const form = ev.target;
  const out = $("voice-status");
  out.textContent = "encoding the reference…";
  try {
    const res = await api("/v1/voices", { method: "POST", body: new FormData(form) });
    if (!res.ok) throw new Error(await errorText(res));
    const v = await res.json();
    await loadVoices(v.id); // the list first: the status is the last thing to change
    form.reset();
    out.textContent = `voice ${v.id} created`;
  } catch (e) {
    out.textContent = `error: ${e.message}`;
  }
}

async function deleteVoice() {
  const name = $("voice").value;
  if (name === "default") {
    setStatus("the default voice is built in (no reference) and cannot be deleted", "error");
    return;
  }
  if (!confirm(`Delete the voice ${name}?`)) return;
  const res = await api(`/v1/voices/${encodeURIComponent(name)}`, { method: "DELETE" });
  const message = res.ok ? `voice ${name} deleted` : `error: ${await errorText(res)}`;
  await loadVoices(res.ok ? "default" : name); // the list first: the status is the last thing to change
  setStatus(message, res.ok ? "idle" : "error");
}

window.addEventListener("DOMContentLoaded", () => {
  $("speak").addEventListener("click", speak);
  $("stop").addEventListener("click", stop);
  $("voice-form").addEventListener("submit", createVoice);
  $("voice-delete").addEventListener("click", deleteVoice);
  $("voice").addEventListener("change", voiceChanged);
  voiceChanged();
  $("player").addEventListener("play", takeOver);
  $("player").addEventListener("seeking", takeOver);
  setInterval(highlight, 50); // read-along: the piece being played
  $("key-save").addEventListener("click", () => {
    state.key = $("api-key").value.trim();
    localStorage.setItem("higgs-api-key", state.key);
    $("key-box").hidden = true;
    loadInfo();
  });
  $("text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) speak();
  });
  loadInfo();
});
