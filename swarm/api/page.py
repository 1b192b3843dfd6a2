"""The chat page: one self-contained HTML document talking to this server's own /v1 routes.

No CDN, no external asset: the style and the script are inline, and the page's security policy
lets it reach nothing but this origin. Replies stream in over the same SSE the API serves.
"""

from __future__ import annotations

PAGE_HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>swarm chat</title>
<style>
:root { color-scheme: light dark; --bg: #fafafa; --fg: #1d1d1f; --muted: #6b6b70;
  --me: #dbeafe; --it: #ececf0; --line: #d4d4d8; --accent: #2563eb; }
@media (prefers-color-scheme: dark) { :root { --bg: #17171a; --fg: #ececf0; --muted: #9b9ba3;
  --me: #1e3a5f; --it: #26262b; --line: #3a3a40; --accent: #60a5fa; } }
* { box-sizing: border-box; }
html, body { height: 100%; margin: 0; }
body { display: flex; flex-direction: column; background: var(--bg); color: var(--fg);
  font: 16px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; }
header { display: flex; flex-wrap: wrap; gap: .5rem; align-items: center; padding: .6rem .8rem;
  border-bottom: 1px solid var(--line); }
header h1 { font-size: 1.05rem; margin: 0 auto 0 0; }
select, input, textarea, button { font: inherit; color: inherit; background: var(--bg);
  border: 1px solid var(--line); border-radius: .5rem; padding: .4rem .6rem; }
#log { flex: 1; overflow-y: auto; padding: .8rem; display: flex; flex-direction: column;
  gap: .6rem; }
.msg { max-width: min(46rem, 92%); padding: .55rem .8rem; border-radius: .8rem;
  white-space: pre-wrap; overflow-wrap: anywhere; }
.user { align-self: flex-end; background: var(--me); }
.assistant { align-self: flex-start; background: var(--it); }
.error { align-self: center; color: #b91c1c; font-size: .9rem; }
.meta { display: block; color: var(--muted); font-size: .75rem; margin-top: .25rem; }
form { display: flex; gap: .5rem; padding: .6rem .8rem; border-top: 1px solid var(--line); }
#prompt { flex: 1; resize: none; min-height: 2.6rem; max-height: 40vh; }
button { background: var(--accent); color: #fff; border: 0; padding: .4rem 1rem; }
button[disabled] { opacity: .5; }
details { font-size: .85rem; color: var(--muted); }
details input { width: 9rem; }
</style>
</head>
<body>
<header>
  <h1>swarm chat</h1>
  <select id="model" aria-label="model"><option value="">loading models…</option></select>
  <details><summary>settings</summary>
    <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1"
      value="0.7"></label>
    <label>max tokens <input id="max-tokens" type="number" min="1" value="256"></label>
    <label>API key <input id="key" type="password" autocomplete="off"></label>
  </details>
</header>
<main id="log" aria-live="polite"></main>
<form id="form">
  <textarea id="prompt" rows="1" placeholder="Message the swarm…" aria-label="message"></textarea>
  <button id="send" type="submit">Send</button>
</form>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const turns = [];
let running = null;  // the AbortController of the reply streaming in

function headers() {
  const h = {"content-type": "application/json"};
  const key = $("key").value || localStorage.getItem("swarm-api-key") || "";
  if (key) h.authorization = "Bearer " + key;
  return h;
}

function add(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  div.textContent = text;
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

async function loadModels() {
  const sel = $("model");
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    sel.textContent = "";
    for (const m of body.data) sel.add(new Option(m.id, m.id));
    if (!body.data.length) sel.add(new Option("no model has a full route now", ""));
  } catch (e) {
    sel.textContent = "";
    sel.add(new Option("models unavailable: " + e.message, ""));
  }
  // a swarm without a route now may have one in a moment (a node rejoining): look again
  clearTimeout(loadModels.again);
  if (!sel.value) loadModels.again = setTimeout(loadModels, 3000);
}

async function send(text) {
  turns.push({role: "user", content: text});
  add("user", text);
  const out = add("assistant", "");
  out.dataset.state = "streaming";
  running = new AbortController();
  $("send").textContent = "Stop";
  let reply = "";
  const body = {model: $("model").value, messages: turns, stream: true,
    stream_options: {include_usage: true},
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value)};
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
      body: JSON.stringify(body), signal: running.signal});
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      throw new Error(e.error ? e.error.message : r.status + " " + r.statusText);
    }
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "", meta = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += value;
      let cut;
      while ((cut = buf.indexOf("\\n\\n")) >= 0) {
        const line = buf.slice(0, cut).trim();
        buf = buf.slice(cut + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const c of chunk.choices) {
          if (c.delta && c.delta.content) reply += c.delta.content;
          if (c.finish_reason) meta = c.finish_reason === "length" ? "cut at max tokens" : "";
        }
        if (chunk.usage) meta = (meta ? meta + " · " : "") +
          chunk.usage.completion_tokens + " tokens";
        out.textContent = reply;
        $("log").scrollTop = $("log").scrollHeight;
      }
    }
    turns.push({role: "assistant", content: reply});
    if (meta) {
      const m = document.createElement("span");
      m.className = "meta";
      m.textContent = meta;
      out.appendChild(m);
    }
    out.dataset.state = "done";
  } catch (e) {
    out.dataset.state = "failed";
    if (e.name !== "AbortError") add("error", e.message);
    if (!reply) { out.remove(); turns.pop(); }
    else turns.push({role: "assistant", content: reply});
  } finally {
    running = null;
    $("send").textContent = "Send";
  }
}

$("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  if (running) { running.abort(); return; }
  const text = $("prompt").value.trim();
  if (!text) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
});
$("key").addEventListener("change", () => {
  localStorage.setItem("swarm-api-key", $("key").value);
  loadModels();
});
loadModels();
</script>
</body>
</html>
"""


def render_page() -> str:
    return PAGE
