// The speech page: streams /v1/audio/speech as raw PCM into Web Audio while it is generated, then keeps the whole
// utterance as a WAV in the <audio> element (replay, seek, download). Plain ES2020, no build step.
"use strict";

const RATE = 24000; // the codec's sample rate: the server's pcm is s16le mono at 24 kHz
const $ = (id) => document.getElementById(id);
const state = { key: localStorage.getItem("higgs-api-key") || "", model: "higgs-tts-3", run: null };

function setStatus(text, kind, bytes) {
  const el = $("status");
  el.textContent = text;
  if (kind) el.dataset.state = kind;
  if (bytes !== undefined) el.dataset.bytes = String(bytes);
}

async function api(path, init = {}) {
  const headers = new Headers(init.headers || {});
  if (state.key) headers.set("Authorization", `Bearer ${state.key}`);
  const res = await fetch(path, { ...init, headers });
  if (res.status === 401) await askForKey(res.clone());
  else if (res.ok && state.key) showKeyStatus("", "idle");
  return res;
}

function showKeyStatus(text, kind) {
  const el = $("key-status");
  el.textContent = text;
  el.dataset.state = kind;
}

async function askForKey(res) {
  // 401: no key, or the wrong one. Say which, keep the box open, and put the cursor in it.
  $("key-box").hidden = false;
  const why = await errorText(res);
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
  // Schedules PCM pieces back to back on one AudioContext as they arrive.
  constructor() {
    try {
      this.ctx = new AudioContext();
    } catch (_) {
      this.ctx = null; // no audio output: the <audio> element still gets the result
    }
    this.next = 0;
    this.sources = [];
  }

  play(int16) {
    if (!this.ctx || !int16.length) return;
    const buf = this.ctx.createBuffer(1, int16.length, RATE);
    const ch = buf.getChannelData(0);
    for (let i = 0; i < int16.length; i++) ch[i] = int16[i] / 32768;
    const src = this.ctx.createBufferSource();
    src.buffer = buf;
    src.connect(this.ctx.destination);
    this.next = Math.max(this.next, this.ctx.currentTime + 0.05);
    src.start(this.next);
    this.next += buf.duration;
    this.sources.push(src);
  }

  stop() {
    for (const s of this.sources) try { s.stop(); } catch (_) { /* not started */ }
    if (this.ctx) this.ctx.close();
  }
}

async function speak() {
  const text = $("text").value;
  if (!text.trim()) return setStatus("type some text first", "error");
  const run = { abort: new AbortController(), player: new Player() };
  state.run = run;
  $("speak").disabled = true;
  $("stop").disabled = false;
  $("download").hidden = true;
  const t0 = performance.now();
  const secs = () => ((performance.now() - t0) / 1000).toFixed(2);
  setStatus("waiting for the first audio…", "waiting", 0);
  const pieces = [];
  let total = 0, first = null, carry = null;
  try {
    const res = await api("/v1/audio/speech", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: state.model, input: text, voice: $("voice").value, response_format: "pcm",
        ...options() }),
      signal: run.abort.signal,
    });
    if (!res.ok) throw new Error(await errorText(res));
    const reader = res.body.getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      let bytes = value;
      if (carry) { // a sample split between two reads
        bytes = new Uint8Array(carry.length + value.length);
        bytes.set(carry); bytes.set(value, carry.length);
        carry = null;
      }
      if (bytes.length % 2) { carry = bytes.slice(-1); bytes = bytes.slice(0, -1); }
      if (!bytes.length) continue;
      const samples = new Int16Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length));
      pieces.push(samples);
      total += bytes.length;
      if (first === null) first = secs();
      run.player.play(samples);
      setStatus(`streaming: first audio after ${first} s, ${(total / 2 / RATE).toFixed(2)} s received`,
        "streaming", total);
    }
    const blob = wavBlob(pieces, total);
    const url = URL.createObjectURL(blob);
    $("player").src = url;
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
    out.textContent = `voice ${v.id} created`;
    await loadVoices(v.id);
    form.reset();
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
