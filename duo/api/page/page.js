// duo's chat page. It chats with duo-target through its own /v1/chat/completions, streamed with the duo_sources
// extension, colours each answer by where its tokens came from, and shows what speculation did: per answer (the
// stream's last chunk: duo_stats and usage) and for the server (/metrics, polled). The model's text only ever goes
// into the page as textContent, never as markup.
"use strict";

const KEY_STORE = "duo.apiKey";
const METRICS_EVERY_MS = 2000;
const CHART_SPAN_MS = 5 * 60 * 1000;
const SOURCES = new Set(["draft", "lookup", "grammar", "target"]);

const $ = (id) => document.getElementById(id);

// The conversation, and the latest answer's record (the browser test reads it: window.duoPage.last).
const chat = {messages: [], controller: null, last: null};
window.duoPage = chat;

// ---- the API ----------------------------------------------------------------------------------------------------

function apiHeaders() {
  const headers = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

function requestBody() {
  const history = chat.messages.slice(0, -1).map((m) => ({role: m.role, content: m.content}));
  const system = $("system").value.trim();
  const body = {messages: system ? [{role: "system", content: system}, ...history] : history, stream: true,
                stream_options: {include_usage: true}, duo_sources: true};
  const temperature = parseFloat($("temperature").value);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

async function errorText(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    message = (await response.json()).error.message || message;
  } catch (_) { /* not duo's JSON error: the status says it */ }
  return response.status === 401 ? `${message} (enter the server's key under Settings)` : message;
}

// Server-sent events: `data:` lines, events apart by a blank line; [DONE] ends OpenAI's stream.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {done, value} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data && data !== "[DONE]") onEvent(JSON.parse(data));
    }
  }
}

// ---- a conversation ---------------------------------------------------------------------------------------------

async function answer() {
  const reply = {role: "assistant", content: "", pieces: [], reasoning: [], steps: [], status: "…",
                 stats: null, usage: null, finish: null};
  chat.messages.push(reply);
  chat.last = null;
  reply.view = addView(reply);
  const controller = new AbortController();
  setBusy(controller);
  showError("");
  showRequest(reply);
  try {
    const response = await fetch("/v1/chat/completions", {method: "POST", headers: apiHeaders(),
                                                          body: JSON.stringify(requestBody()), signal: controller.signal});
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (chunk) => onChunk(reply, chunk));
    reply.status = reply.finish ? `finished (${reply.finish})` : "ended without a finish";
  } catch (error) {
    reply.status = error.name === "AbortError" ? "stopped" : "failed";
    if (error.name !== "AbortError") showError(error.message);
  } finally {
    setBusy(null);
    drawAnswer(reply);
    showRequest(reply);
    chat.last = {content: reply.content, stats: reply.stats, usage: reply.usage, steps: reply.steps,
                 finish: reply.finish, status: reply.status};
    pollMetrics();  // the server's counters now hold this answer's steps
  }
}

function onChunk(reply, chunk) {
  if (chunk.error) throw new Error(chunk.error.message);
  if (chunk.usage) reply.usage = chunk.usage;
  if (chunk.duo_stats) reply.stats = chunk.duo_stats;
  const extension = chunk.duo || {};
  reply.steps.push(...(extension.steps || []));
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    if (delta.content) {
      reply.content += delta.content;
      addText(reply.pieces, delta.content, extension.sources);
    }
    if (delta.reasoning_content) addText(reply.reasoning, delta.reasoning_content, extension.sources);
    if (choice.finish_reason) reply.finish = choice.finish_reason;
  }
  scheduleDraw(reply);
  showRequest(reply);
}

// A delta's text as [text, source] pieces: the chunk's sources where they spell it, else of no known source.
function addText(pieces, text, sources) {
  const known = Array.isArray(sources) && sources.map((piece) => piece[0]).join("") === text;
  for (const [piece, source] of known ? sources : [[text, null]]) {
    const kind = SOURCES.has(source) ? source : null;
    const last = pieces[pieces.length - 1];
    if (last && last[1] === kind) last[0] += piece;
    else pieces.push([piece, kind]);
  }
}

function onSubmit(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || chat.controller) return;
  $("prompt").value = "";
  const message = {role: "user", content: text};
  chat.messages.push(message);
  message.view = addView(message);
  answer();
}

function regenerate() {
  const last = chat.messages[chat.messages.length - 1];
  if (chat.controller || !last || last.role !== "assistant") return;
  chat.messages.pop();
  last.view.root.remove();
  answer();
}

function clearChat() {
  if (chat.controller) chat.controller.abort();
  chat.messages = [];
  $("messages").replaceChildren();
  setBusy(null);
}

function setBusy(controller) {
  chat.controller = controller;
  $("send").disabled = Boolean(controller);
  $("stop").disabled = !controller;
  const last = chat.messages[chat.messages.length - 1];
  $("regenerate").disabled = Boolean(controller) || !last || last.role !== "assistant";
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// ---- drawing messages -------------------------------------------------------------------------------------------

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function addView(message) {
  const root = element("div", `message ${message.role}`);
  root.append(element("div", "who", message.role === "user" ? "you" : "duo"));
  const view = {root};
  if (message.role === "user") {
    root.append(element("div", "answer", message.content));
  } else {
    view.reasoning = element("details", "reasoning");
    view.reasoning.append(element("summary", "", "reasoning"));
    view.reasoningText = element("div");
    view.reasoning.append(view.reasoningText);
    view.reasoning.hidden = true;
    view.answer = element("div", "answer");
    view.status = element("div", "status");
    root.append(view.reasoning, view.answer, view.status);
  }
  $("messages").append(root);
  root.scrollIntoView({block: "end"});
  return view;
}

let drawing = null;

function scheduleDraw(reply) {
  if (drawing) return;
  drawing = requestAnimationFrame(() => {
    drawing = null;
    drawAnswer(reply);
  });
}

function drawAnswer(reply) {
  const view = reply.view;
  view.answer.replaceChildren(...blocksOf(reply.pieces));
  view.reasoning.hidden = reply.reasoning.length === 0;
  view.reasoningText.replaceChildren(...spans(reply.reasoning, 0, Infinity));
  view.status.textContent = reply.status;
}

// An answer's text in blocks: prose, and code between ``` fences (the fence lines themselves are not shown).
function blocks(text) {
  const found = [];
  const fence = /^ {0,3}```(.*)$/gm;
  let at = 0, inCode = false, lang = "", match;
  while ((match = fence.exec(text)) !== null) {
    let end = match.index + match[0].length;
    if (text[end] === "\n") end += 1;
    const before = text[match.index - 1] === "\n" && !inCode ? match.index - 1 : match.index;  // the line break
    if (before > at) found.push({code: inCode, start: at, end: before, lang});
    if (!inCode) lang = match[1].trim();
    inCode = !inCode;
    at = end;
  }
  if (at < text.length) found.push({code: inCode, start: at, end: text.length, lang});
  return found;
}

function blocksOf(pieces) {
  const text = pieces.map((piece) => piece[0]).join("");
  return blocks(text).map((block) => {
    if (!block.code) {
      const prose = element("span", "prose");
      prose.append(...spans(pieces, block.start, block.end));
      return prose;
    }
    const pre = element("pre");
    if (block.lang) pre.append(element("span", "lang", block.lang));
    const code = element("code");
    code.append(...spans(pieces, block.start, block.end));
    pre.append(code);
    return pre;
  });
}

// The pieces' text between characters `start` and `end`, a span per piece, marked with its source.
function spans(pieces, start, end) {
  const out = [];
  let at = 0;
  for (const [text, source] of pieces) {
    const from = Math.max(start, at), to = Math.min(end, at + text.length);
    if (from < to) {
      const span = element("span", source ? `src-${source}` : "", text.slice(from - at, to - at));
      if (source) span.dataset.source = source;
      out.push(span);
    }
    at += text.length;
    if (at >= end) break;
  }
  return out;
}

// ---- this answer's numbers --------------------------------------------------------------------------------------

// A number shown as `text`, the number itself in data-value (what the browser test compares with the stream's).
function setStat(id, value, text) {
  $(id).textContent = text;
  $(id).dataset.value = value === null || value === undefined ? "" : String(value);
}

const percent = (ratio) => `${(100 * ratio).toFixed(0)}%`;

function showRequest(reply) {
  if (reply.stats) showFinished(reply.stats, reply.usage);
  else showLive(reply);
}

// While it streams: what the steps told so far.
function showLive(reply) {
  const tokens = reply.steps.reduce((n, step) => n + step.length, 0);
  const drafts = reply.steps.reduce((n, step) => n + step.filter((source) => source !== "target").length, 0);
  setStat("req-tokens", tokens, `${tokens} (streaming)`);
  setStat("req-tps", null, "–");
  setStat("req-per-step", null, reply.steps.length ? (tokens / reply.steps.length).toFixed(2) : "–");
  setStat("req-acceptance", null, `${drafts} so far`);
  for (const id of ["req-lookup", "req-ttft", "req-draft", "req-speculation"]) setStat(id, null, "–");
}

// Once it ended: the last chunk's duo_stats (and usage).
function showFinished(stats, usage) {
  const tokens = usage ? usage.completion_tokens : stats.generated_tokens;
  setStat("req-tokens", tokens, String(tokens));
  setStat("req-tps", stats.tokens_per_second, stats.tokens_per_second.toFixed(1));
  const perStep = stats.verify_steps ? stats.generated_tokens / stats.verify_steps : null;
  setStat("req-per-step", perStep, perStep === null ? "–" : perStep.toFixed(2));
  const verified = stats.draft_tokens_verified, accepted = stats.draft_tokens_accepted;
  const acceptance = verified ? accepted / verified : null;
  setStat("req-acceptance", acceptance, verified ? `${percent(acceptance)} (${accepted} of ${verified})` : "none verified");
  const lookup = stats.lookup_tokens_verified;
  setStat("req-lookup", stats.lookup_tokens_accepted,
          lookup ? `${stats.lookup_tokens_accepted} of ${lookup} accepted` : "none proposed");
  setStat("req-ttft", stats.time_to_first_token_s, `${(1000 * stats.time_to_first_token_s).toFixed(0)} ms`);
  setStat("req-draft", stats.draft_connected ? 1 : 0,
          stats.draft_connected ? "connected" : "none: the target decoded alone");
  const speculation = !stats.draft_connected ? "off (no draft)" : stats.speculation || "fixed (not adaptive)";
  setStat("req-speculation", null, speculation);
}

// ---- the server: /metrics ---------------------------------------------------------------------------------------

// Prometheus' text format: `name{labels} value` lines; a map of "name{labels}" to the value.
function parseMetrics(text) {
  const values = new Map();
  for (const line of text.split("\n")) {
    const match = /^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (match) values.set(match[1] + (match[2] || ""), Number(match[3]));
  }
  return values;
}

const server = {samples: [], rates: []};  // samples: {t, emitted, steps}; rates: {t, rate} (tokens/s)

function recordSample(metrics, now) {
  const sample = {t: now, emitted: metrics.get("duo:spec_decode_num_emitted_tokens_total") || 0};
  const previous = server.samples[server.samples.length - 1];
  if (previous && sample.emitted >= previous.emitted && now > previous.t) {
    server.rates.push({t: now, rate: (sample.emitted - previous.emitted) / ((now - previous.t) / 1000)});
  }
  server.samples = [...server.samples.slice(-1), sample];
  server.rates = server.rates.filter((point) => now - point.t <= CHART_SPAN_MS);
}

function draftState(metrics) {
  for (const state of ["connected", "disconnected", "incompatible", "none"]) {
    if (metrics.get(`duo:draft_state{state="${state}"}`) === 1) return state;
  }
  return "unknown";
}

function showServer(metrics, now) {
  recordSample(metrics, now);
  const state = draftState(metrics);
  const on = metrics.get("duo:spec_decode_on") === 1, gain = metrics.get("duo:spec_decode_gain") || 0;
  const draft = {none: "none attached: the target decodes alone", connected: on ? "connected, speculating" :
                 "connected, resting"}[state] || state;
  setStat("srv-draft", state, draft);
  const judged = gain ? `${gain.toFixed(2)}x decoding alone` : "not judged yet";
  setStat("srv-verdict", gain, state === "none" ? "off (no draft)" : on ? `on: ${judged}` : `judged off: ${judged}`);
  const rate = server.rates.length ? server.rates[server.rates.length - 1].rate : null;
  setStat("srv-tps", rate, rate === null ? "–" : rate.toFixed(1));
  const steps = metrics.get("duo:spec_decode_num_steps_total") || 0;
  const emitted = metrics.get("duo:spec_decode_num_emitted_tokens_total") || 0;
  setStat("srv-per-step", steps ? emitted / steps : null, steps ? (emitted / steps).toFixed(2) : "–");
  const verified = metrics.get("duo:spec_decode_num_draft_tokens_total") || 0;
  const accepted = metrics.get("duo:spec_decode_num_accepted_tokens_total") || 0;
  setStat("srv-acceptance", verified ? accepted / verified : null,
          verified ? `${percent(accepted / verified)} (${accepted} of ${verified})` : "none verified");
  setStat("srv-requests", metrics.get("duo:num_requests_running") || 0,
          `${metrics.get("duo:num_requests_running") || 0} running, ${metrics.get("duo:num_requests_waiting") || 0} waiting`);
  showBadge(state === "connected" ? "ok" : state === "none" ? "alone" : "down",
            state === "none" ? "no draft: decoding alone" : `draft ${state}`);
  drawChart(now);
}

function showBadge(kind, text) {
  $("server-state").className = `badge ${kind}`;
  $("server-state").textContent = text;
}

async function pollMetrics() {
  try {
    const response = await fetch("/metrics", {cache: "no-store"});
    if (response.status === 501) return showBadge("alone", "no metrics: start duo-target with --metrics");
    if (!response.ok) throw new Error(`/metrics answered ${response.status}`);
    showServer(parseMetrics(await response.text()), Date.now());
  } catch (error) {
    showBadge("down", "server unreachable");
  }
}

// Tokens/s of the last CHART_SPAN_MS, newest on the right.
function drawChart(now) {
  const canvas = $("chart"), ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  const top = niceCeiling(Math.max(1, ...server.rates.map((point) => point.rate)));
  const x = (t) => width * (1 - (now - t) / CHART_SPAN_MS), y = (rate) => height - 4 - (height - 20) * rate / top;
  g.fillStyle = "#5d6773";
  g.font = "11px system-ui, sans-serif";
  g.fillText(`${top} tok/s`, 4, 12);
  g.strokeStyle = "#d8dde3";
  g.beginPath();
  g.moveTo(0, y(top));
  g.lineTo(width, y(top));
  g.stroke();
  g.strokeStyle = g.fillStyle = "#2f6fd0";
  g.lineWidth = 1.5;
  g.beginPath();
  server.rates.forEach((point, i) => (i ? g.lineTo : g.moveTo).call(g, x(point.t), y(point.rate)));
  g.stroke();
  const newest = server.rates[server.rates.length - 1];
  if (newest) g.fillRect(x(newest.t) - 2, y(newest.rate) - 2, 4, 4);  // the latest sample, alone at first
}

function niceCeiling(value) {
  const step = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * step).find((nice) => nice >= value);
}

// ---- start ------------------------------------------------------------------------------------------------------

async function showModel() {
  const models = await (await fetch("/v1/models")).json();
  $("model").textContent = models.data[0].id;
}

function start() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("input", () => {
    const key = $("api-key").value.trim();
    if (key) localStorage.setItem(KEY_STORE, key);
    else localStorage.removeItem(KEY_STORE);
  });
  $("composer").addEventListener("submit", onSubmit);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", clearChat);
  const colours = () => $("messages").classList.toggle("colours", $("colours").checked);
  $("colours").addEventListener("change", colours);
  colours();
  showModel();
  pollMetrics();
  setInterval(pollMetrics, METRICS_EVERY_MS);
}

start();
