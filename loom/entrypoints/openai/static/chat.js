// Loom's chat page: conversations kept in this browser (localStorage), answers streamed from
// /v1/chat/completions (SSE), a stop button, a system prompt and sampling settings, the model
// picker when the server serves several, and per answer its tokens, speed and time to first
// token. Everything the model or the user wrote enters the page through textContent or
// LoomMarkdown.render, which escapes it.
"use strict";

const STORE = "loom.chat.v1";
const $ = (id) => document.getElementById(id);
const state = { conversations: [], current: null, controller: null, models: [] };

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    state.conversations = Array.isArray(saved.conversations) ? saved.conversations : [];
    state.current = saved.current || null;
    const s = saved.settings || {};
    for (const [id, key] of [["system-prompt", "system"], ["temperature", "temperature"],
                             ["top-p", "top_p"], ["max-tokens", "max_tokens"], ["api-key", "api_key"]]) {
      if (s[key] !== undefined) $(id).value = s[key];
    }
  } catch (e) {
    state.conversations = [];
  }
}

function settings() {
  return {
    system: $("system-prompt").value, temperature: $("temperature").value,
    top_p: $("top-p").value, max_tokens: $("max-tokens").value, api_key: $("api-key").value,
  };
}

function save() {
  localStorage.setItem(STORE, JSON.stringify({
    conversations: state.conversations, current: state.current, settings: settings(),
  }));
}

function conversation() {
  return state.conversations.find((c) => c.id === state.current) || null;
}

function newConversation() {
  const c = { id: `c${Date.now()}${Math.random().toString(16).slice(2, 6)}`, title: "New chat",
              messages: [], created: Date.now() };
  state.conversations.unshift(c);
  state.current = c.id;
  save();
  renderAll();
  $("prompt").focus();
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of state.conversations) {
    const li = document.createElement("li");
    li.className = c.id === state.current ? "active" : "";
    li.dataset.id = c.id;
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = c.title;
    title.addEventListener("click", () => { if (!state.controller) { state.current = c.id; save(); renderAll(); } });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.title = "Delete this conversation";
    del.textContent = "\u00d7";
    del.addEventListener("click", () => {
      if (state.controller) return;
      state.conversations = state.conversations.filter((x) => x.id !== c.id);
      if (state.current === c.id) state.current = state.conversations[0]?.id || null;
      save();
      renderAll();
    });
    li.append(title, del);
    list.append(li);
  }
}

// An answer's Markdown (escaped inside), under its thinking (reasoning_content, from a model that
// thinks before it answers) as plain text in a collapsed block, open while nothing else came.
function renderAssistant(body, m) {
  body.innerHTML = LoomMarkdown.render(m.content);
  if (!m.reasoning) return;
  const details = document.createElement("details");
  details.className = "thinking";
  details.open = !m.content;
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const text = document.createElement("div");
  text.textContent = m.reasoning;
  details.append(summary, text);
  body.prepend(details);
}

function messageNode(m) {
  const div = document.createElement("div");
  div.className = `msg ${m.role}`;
  const body = document.createElement("div");
  body.className = "body";
  if (m.role === "assistant") renderAssistant(body, m);
  else body.textContent = m.content;
  div.append(body);
  if (m.role === "assistant") {
    const stats = document.createElement("div");
    stats.className = "msg-stats";
    stats.textContent = statsText(m);
    div.append(stats);
  }
  return div;
}

function statsText(m) {
  if (!m.stats) return "";
  const s = m.stats, parts = [];
  if (s.completion_tokens != null) parts.push(`${s.completion_tokens} tokens`);
  if (s.prompt_tokens != null) parts.push(`prompt ${s.prompt_tokens}`);
  if (s.tps != null) parts.push(`${s.tps.toFixed(1)} tok/s`);
  if (s.ttft_ms != null) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
  if (s.finish) parts.push(s.finish === "stopped" ? "stopped" : `finish: ${s.finish}`);
  return parts.join(" \u00b7 ");
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  const c = conversation();
  if (!c || !c.messages.length) {
    const empty = document.createElement("div");
    empty.className = "empty";
    empty.textContent = "Ask anything. Answers stream from the model served by Loom.";
    box.append(empty);
    return;
  }
  for (const m of c.messages) box.append(messageNode(m));
  box.scrollTop = box.scrollHeight;
}

function renderAll() { renderSidebar(); renderMessages(); }

function showError(text) {
  const e = $("error");
  e.textContent = text;
  e.hidden = !text;
}

async function loadModels() {
  try {
    const r = await fetch("/v1/models", { headers: authHeaders() });
    const data = await r.json();
    if (!r.ok) throw new Error(data.error?.message || r.statusText);
    state.models = data.data.map((m) => m.id);
  } catch (e) {
    showError(`cannot list models: ${e.message}`);
    return;
  }
  const picker = $("model-picker");
  picker.replaceChildren(...state.models.map((id) => new Option(id, id)));
  picker.hidden = state.models.length < 2;
  $("model-label").textContent = state.models.length === 1 ? state.models[0] : "";
}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function requestBody(c) {
  const s = settings();
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of c.messages) if (m.content || m.role !== "assistant") messages.push({ role: m.role, content: m.content });
  const body = { model: $("model-picker").value || state.models[0], messages, stream: true,
                 stream_options: { include_usage: true } };
  const temperature = parseFloat(s.temperature), topP = parseFloat(s.top_p), maxTokens = parseInt(s.max_tokens, 10);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  if (!Number.isNaN(topP)) body.top_p = topP;
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;
  return body;
}

// Reads the SSE stream; calls onEvent with each parsed `data:` JSON object.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  if (state.controller || !text.trim()) return;
  if (!conversation()) newConversation();
  const c = conversation();
  showError("");
  c.messages.push({ role: "user", content: text });
  if (c.title === "New chat") c.title = text.trim().slice(0, 40);
  const answer = { role: "assistant", content: "", stats: null };
  c.messages.push(answer);
  save();
  renderAll();
  const node = $("messages").lastElementChild;
  const body = node.querySelector(".body"), statsNode = node.querySelector(".msg-stats");
  node.classList.add("streaming");
  const controller = new AbortController();
  state.controller = controller;
  $("send").hidden = true;
  $("stop").hidden = false;
  const t0 = performance.now();
  let tFirst = null, tLast = null, usage = null, finish = null, chunks = 0;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(requestBody({ messages: c.messages.slice(0, -1) })),
    });
    if (!r.ok) {
      const data = await r.json().catch(() => ({}));
      throw new Error(data.error?.message || `${r.status} ${r.statusText}`);
    }
    await readEvents(r, (ev) => {
      if (ev.error) throw new Error(ev.error.message || "stream error");
      if (ev.usage) usage = ev.usage;
      const choice = ev.choices?.[0];
      if (!choice) return;
      const delta = choice.delta?.content || "", thought = choice.delta?.reasoning_content || "";
      if (delta || thought) {
        tLast = performance.now();
        if (tFirst === null) tFirst = tLast;
        chunks++;
        answer.content += delta;
        if (thought) answer.reasoning = (answer.reasoning || "") + thought;
        renderAssistant(body, answer);
        $("messages").scrollTop = $("messages").scrollHeight;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    });
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else { finish = "error"; showError(e.message); }
  } finally {
    const tokens = usage ? usage.completion_tokens : chunks;
    const span = tFirst !== null && tLast !== null ? (tLast - tFirst) / 1000 : 0;
    answer.stats = {
      completion_tokens: tokens, prompt_tokens: usage ? usage.prompt_tokens : null,
      tps: span > 0 && tokens > 1 ? (tokens - 1) / span : null,
      ttft_ms: tFirst !== null ? tFirst - t0 : null, finish,
    };
    state.controller = null;
    node.classList.remove("streaming");
    statsNode.textContent = statsText(answer);
    $("send").hidden = false;
    $("stop").hidden = true;
    save();
    renderSidebar();
  }
}

function init() {
  load();
  if (!conversation()) state.current = state.conversations[0]?.id || null;
  renderAll();
  loadModels();
  $("new-chat").addEventListener("click", () => { if (!state.controller) newConversation(); });
  $("settings-toggle").addEventListener("click", () => { $("settings").hidden = !$("settings").hidden; });
  for (const id of ["system-prompt", "temperature", "top-p", "max-tokens", "api-key"]) {
    $(id).addEventListener("change", save);
  }
  $("api-key").addEventListener("change", loadModels);
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
}

init();
