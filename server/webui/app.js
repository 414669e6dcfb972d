// maxjax playground and dashboard: plain JS, no build step, no network beyond this server.
"use strict";
const $ = (sel) => document.querySelector(sel);
const KEY = "maxjax.apiKey", CONVS = "maxjax.conversations";
const state = { model: null, caps: {}, busy: null, convs: [], current: null, stream: null,
                last: null, history: [] };

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

// ---- API ------------------------------------------------------------------------------------
async function api(path, options = {}) {
  const headers = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY);
  if (key) headers.Authorization = "Bearer " + key;
  const resp = await fetch(path, { ...options, headers });
  if (resp.ok) return resp;
  let message = resp.statusText;
  try { message = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
  if (resp.status === 401) askKey();
  throw new ApiError(resp.status, message);
}

async function* sseData(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

function banner(text) {
  $("#banner").textContent = text || "";
  $("#banner").hidden = !text;
}

function askKey() {
  const dialog = $("#key-dialog");
  if (dialog.open) return;
  $("#key-input").value = localStorage.getItem(KEY) || "";
  dialog.showModal();
}

$("#key-dialog").addEventListener("close", () => {
  if ($("#key-dialog").returnValue !== "save") return;
  localStorage.setItem(KEY, $("#key-input").value.trim());
  connect();
});
$("#key-button").addEventListener("click", askKey);

async function connect() {
  try {
    const s = await (await api("/stats")).json();
    banner("");
    state.model = s.model;
    state.caps = s.capabilities;
    $("#model").textContent = s.ready ? s.model : "model loading…";
    for (const mode of ["json_schema", "tools"]) {
      $(`#mode option[value=${mode}]`).hidden = !s.capabilities[mode];
    }
    $("#mode option[value=chat]").hidden = !s.capabilities.chat;
    if ($("#mode").selectedOptions[0].hidden) $("#mode").value = "completion";
    showMode();
    if (!s.ready) setTimeout(connect, 2000);
    if (!$("#dashboard-view").hidden) startStats();
  } catch (e) {
    $("#model").textContent = e.status === 401 ? "API key needed" : "not connected";
    banner(e.status === 401 ? "This server needs an API key: " + e.message : String(e.message || e));
  }
}

// ---- conversations ----------------------------------------------------------------------------
function loadConvs() {
  try { state.convs = JSON.parse(localStorage.getItem(CONVS)) || []; } catch (e) { state.convs = []; }
  if (!state.convs.length) newConv();
  state.current = state.convs[0];
}

function saveConvs() { localStorage.setItem(CONVS, JSON.stringify(state.convs)); }

function newConv() {
  const conv = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6),
                 title: "New conversation", messages: [] };
  state.convs.unshift(conv);
  state.current = conv;
  saveConvs();
}

function renderConvs() {
  const list = $("#conv-list");
  list.replaceChildren();
  for (const conv of state.convs) {
    const li = document.createElement("li");
    li.className = conv === state.current ? "current" : "";
    const open = document.createElement("button");
    open.type = "button";
    open.textContent = conv.title;
    open.setAttribute("aria-current", conv === state.current ? "true" : "false");
    open.addEventListener("click", () => { if (!state.busy) { state.current = conv; render(); } });
    const del = document.createElement("button");
    del.type = "button";
    del.textContent = "×";
    del.setAttribute("aria-label", "Delete " + conv.title);
    del.addEventListener("click", () => {
      if (state.busy) return;
      state.convs = state.convs.filter((c) => c !== conv);
      if (!state.convs.length) newConv();
      if (state.current === conv) state.current = state.convs[0];
      saveConvs();
      render();
    });
    li.append(open, del);
    list.append(li);
  }
}

function messageNode(msg) {
  const div = document.createElement("div");
  div.className = "msg " + msg.role;
  if (msg.reasoning) {
    const r = document.createElement("div");
    r.className = "reasoning";
    r.textContent = msg.reasoning;
    div.append(r);
  }
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = msg.content + (msg.tool_calls || []).map(
    (t) => `\ntool call: ${t.name}(${t.arguments})`).join("");
  div.append(body);
  if (msg.error) {
    const err = document.createElement("span");
    err.className = "error";
    err.textContent = (msg.content ? "\n" : "") + "Error: " + msg.error;
    div.append(err);
  }
  if (msg.meta) {
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = msg.meta;
    div.append(meta);
  }
  msg.node = div;
  return div;
}

function renderMessages() {
  const box = $("#messages");
  box.replaceChildren(...state.current.messages.map(messageNode));
  box.scrollTop = box.scrollHeight;
}

function updateMessage(msg) {
  const old = msg.node;
  old.replaceWith(messageNode(msg));
  const box = $("#messages");
  box.scrollTop = box.scrollHeight;
}

function render() { renderConvs(); renderMessages(); }

// ---- sending ------------------------------------------------------------------------------------
function num(id) {
  const v = $("#" + id).value.trim();
  return v === "" ? undefined : Number(v);
}

function sampling() {
  const stop = $("#stop_strings").value.split("\n").filter((s) => s !== "");
  const body = { temperature: num("temperature"), top_p: num("top_p"), max_tokens: num("max_tokens"),
                 seed: num("seed"), stream: true, stream_options: { include_usage: true } };
  const topK = num("top_k");
  if (topK) body.top_k = topK;
  if (stop.length) body.stop = stop;
  return body;
}

function chatBody(mode) {
  const body = sampling();
  const system = $("#system").value.trim();
  body.messages = (system ? [{ role: "system", content: system }] : []).concat(
    state.current.messages.filter((m) => !m.error && (m.role === "user" || m.content))
      .slice(0, -1).map((m) => ({ role: m.role, content: m.content })));
  if (mode === "json_schema") {
    let schema;
    try { schema = JSON.parse($("#schema").value); } catch (e) { throw new Error("JSON schema: " + e.message); }
    body.response_format = { type: "json_schema", json_schema: { name: "schema", schema, strict: true } };
  } else if (mode === "tools") {
    try { body.tools = JSON.parse($("#tools").value); } catch (e) { throw new Error("Tools: " + e.message); }
  }
  return body;
}

async function send() {
  const text = $("#prompt").value;
  if (!text.trim() || state.busy) return;
  const mode = $("#mode").value, conv = state.current;
  conv.messages.push({ role: "user", content: text });
  if (conv.title === "New conversation") conv.title = text.trim().slice(0, 40);
  const msg = { role: "assistant", content: "", reasoning: "" };
  conv.messages.push(msg);
  $("#prompt").value = "";
  render();
  const controller = new AbortController();
  state.busy = controller;
  $("#send").disabled = true;
  $("#stop").disabled = false;
  const t0 = performance.now();
  let tFirst = null, tLast = null, pieces = 0, usage = null, finish = null;
  try {
    let path, body;
    if (mode === "completion") {
      path = "/v1/completions";
      body = { ...sampling(), prompt: text };
    } else {
      path = "/v1/chat/completions";
      body = chatBody(mode);
      body.messages.push({ role: "user", content: text });
    }
    body.model = state.model;
    const resp = await api(path, { method: "POST", body: JSON.stringify(body), signal: controller.signal });
    for await (const data of sseData(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = mode === "completion" ? { content: choice.text } : choice.delta;
      const piece = delta.content || "", thought = delta.reasoning_content || delta.reasoning || "";
      for (const tc of delta.tool_calls || []) {
        msg.tool_calls = msg.tool_calls || [];
        const slot = msg.tool_calls[tc.index || 0] = msg.tool_calls[tc.index || 0] || { name: "", arguments: "" };
        if (tc.function && tc.function.name) slot.name += tc.function.name;
        if (tc.function && tc.function.arguments) slot.arguments += tc.function.arguments;
      }
      if (piece || thought || delta.tool_calls) {
        tLast = performance.now();
        if (tFirst === null) tFirst = tLast;
        pieces++;
      }
      msg.content += piece;
      msg.reasoning += thought;
      if (choice.finish_reason) finish = choice.finish_reason;
      updateMessage(msg);
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else msg.error = e.message || String(e);
  } finally {
    const tokens = usage ? usage.completion_tokens : pieces;
    const parts = [];
    if (tFirst !== null) parts.push(`TTFT ${Math.round(tFirst - t0)} ms`);
    if (tokens > 1 && tLast > tFirst) parts.push(`${((tokens - 1) / ((tLast - tFirst) / 1000)).toFixed(1)} tok/s`);
    parts.push(`${tokens} tokens`);
    if (finish) parts.push(finish);
    msg.meta = parts.join(" · ");
    updateMessage(msg);
    delete msg.node;
    saveConvs();
    state.busy = null;
    $("#send").disabled = false;
    $("#stop").disabled = true;
    renderConvs();
  }
}

function stop() { if (state.busy) state.busy.abort(); }

$("#composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("#stop").addEventListener("click", stop);
$("#prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
document.addEventListener("keydown", (e) => { if (e.key === "Escape" && state.busy) stop(); });
$("#new-chat").addEventListener("click", () => { if (!state.busy) { newConv(); render(); $("#prompt").focus(); } });

function showMode() {
  const mode = $("#mode").value;
  $("#system-field").hidden = mode === "completion";
  $("#schema-field").hidden = mode !== "json_schema";
  $("#tools-field").hidden = mode !== "tools";
}
$("#mode").addEventListener("change", showMode);

// ---- dashboard ----------------------------------------------------------------------------------
function fmt(v, digits = 0) {
  if (v === undefined || v === null || Number.isNaN(v)) return "–";
  return Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function rate(m, p, name, per) {
  if (!p) return null;
  const d = (m[per] || 0) - (p[per] || 0);
  return d > 0 ? ((m[name] || 0) - (p[name] || 0)) / d : null;
}

function renderStats(s) {
  const m = s.metrics, prev = state.last;
  for (const out of document.querySelectorAll("#dashboard-view output[data-metric]")) {
    out.textContent = fmt(m[out.dataset.metric]);
  }
  const compiles = document.querySelector("output[data-metric=maxjax_xla_compiles_since_ready_total]");
  compiles.classList.toggle("bad", (m.maxjax_xla_compiles_since_ready_total || 0) > 0);
  let tps = 0;
  if (prev) {
    const dt = s.time - prev.time;
    tps = dt > 0 ? (m.maxjax_generation_tokens_total - prev.metrics.maxjax_generation_tokens_total) / dt : 0;
    const pm = prev.metrics;
    $("#rows-per-step").textContent = fmt(rate(m, pm, "maxjax_engine_scheduled_rows_total", "maxjax_engine_steps_total"), 1);
    $("#tokens-per-step").textContent = fmt(rate(m, pm, "maxjax_engine_scheduled_tokens_total", "maxjax_engine_steps_total"), 1);
  }
  $("#tps").textContent = fmt(tps, 1);
  const q = m.maxjax_prefix_cache_queries_total || 0;
  $("#prefix-rate").textContent = q ? fmt(100 * m.maxjax_prefix_cache_hits_total / q, 1) + " %" : "–";
  state.history.push([s.time, tps]);
  while (state.history.length && state.history[0][0] < s.time - 300) state.history.shift();
  drawChart(s.time);
  const steps = m.maxjax_engine_steps_total || 0, phases = m.maxjax_step_phase_seconds_total || {};
  const total = Object.values(phases).reduce((a, b) => a + b, 0);
  $("#phases tbody").replaceChildren(...Object.entries(phases).map(([phase, sec]) =>
    row(phase, steps ? fmt(1000 * sec / steps, 2) : "–", total ? fmt(100 * sec / total, 1) + " %" : "–")));
  if (s.info && !state.infoShown) {
    state.infoShown = true;
    $("#buckets").replaceChildren(...s.info.buckets.map((b) => {
      const li = document.createElement("li");
      li.textContent = b;
      return li;
    }));
    const rows = [["model", s.info.model], ["max_length", s.info.max_length], ["page_size", s.info.page_size],
                  ["num_pages", s.info.num_pages],
                  ["structured_output", s.info.structured_output]];
    const named = new Set(rows.map(([k]) => k));
    rows.push(...Object.entries(s.info.engine_config).filter(([k]) => !named.has(k)));
    $("#config tbody").replaceChildren(...rows.map(([k, v]) => row(k, String(v))));
  }
  state.last = s;
}

function row(...cells) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = document.createElement("td");
    td.textContent = c;
    tr.append(td);
  }
  return tr;
}

function drawChart(now) {
  const max = Math.max(1, ...state.history.map(([, v]) => v));
  $("#chart-max").textContent = `(peak ${fmt(max, 1)})`;
  $("#chart-line").setAttribute("points", state.history.map(([t, v]) =>
    `${(300 - (now - t)).toFixed(1)},${(58 - 56 * v / max).toFixed(1)}`).join(" "));
}

async function startStats() {
  if (state.stream) return;
  const controller = new AbortController();
  state.stream = controller;
  try {
    const resp = await api("/stats/stream?interval=1", { signal: controller.signal });
    for await (const data of sseData(resp)) renderStats(JSON.parse(data));
  } catch (e) {
    if (e.name !== "AbortError") banner("Stats stream: " + (e.message || e));
  } finally {
    if (state.stream === controller) state.stream = null;
  }
}

function stopStats() {
  if (state.stream) state.stream.abort();
  state.stream = null;
}

// ---- views --------------------------------------------------------------------------------------
function showView(name) {
  const dash = name === "dashboard";
  $("#chat-view").hidden = dash;
  $("#dashboard-view").hidden = !dash;
  $("#tab-chat").setAttribute("aria-selected", String(!dash));
  $("#tab-dashboard").setAttribute("aria-selected", String(dash));
  if (dash) startStats(); else stopStats();
  if (location.hash !== "#" + name) history.replaceState(null, "", "#" + name);
}
$("#tab-chat").addEventListener("click", () => showView("chat"));
$("#tab-dashboard").addEventListener("click", () => showView("dashboard"));

if (matchMedia("(max-width: 760px)").matches) {
  $("#conversations").open = false;
  $("#settings").open = false;
}
loadConvs();
render();
showView(location.hash === "#dashboard" ? "dashboard" : "chat");
connect();
