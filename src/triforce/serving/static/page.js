// triforce serve's page: sends the prompt to the OpenAI-compatible API with "stream": true, and draws each round's
// tokens as they come, each marked by the level that drafted it (the chunk's `triforce` field: its provenance).
// No library and no build step; every request goes to this server (its Content-Security-Policy allows nothing else).
"use strict";

const $ = (id) => document.getElementById(id);
const KINDS = ["ngram", "head", "retrieval", "h2o", "streaming", "kv4", "draft", "full"];
const WHAT = {ngram: "n-gram lookup", head: "draft head", retrieval: "retrieval cache", h2o: "H2O cache",
              streaming: "StreamingLLM cache", kv4: "4-bit KV", draft: "draft model", full: "the full model's own"};
const kindOf = (level) => level.split(":")[0];

let info = null;       // GET page/info: the model, its context, the server's stack, the methods a request may name
let run = null;        // the generation in progress (or the last one): its counts, for the panel and the chart

function message(text) {
  $("message").textContent = text || "";
  $("message").hidden = !text;
}

function status(text) { $("status").textContent = text; }

function megabytes(n) { return (n / 2 ** 20).toFixed(1) + " MB"; }

// ---- the server and the form ------------------------------------------------------------------------------

async function loadInfo() {
  try {
    const r = await fetch("page/info");
    info = await r.json();
  } catch (e) {
    $("server").textContent = "the server does not answer: is triforce serve running?";
    return;
  }
  $("server").textContent = `${info.model} · context ${info.max_context} tokens · stack ${info.stack}`;
  const method = $("method");
  method.add(new Option(`the server's (${info.method})`, ""));
  for (const m of info.methods) method.add(new Option(m, m));
  if (!info.stack_choice) {
    for (const id of ["method", "stack", "gammas"]) $(id).disabled = true;
  }
  $("max-tokens").value = Math.min(info.default_max_tokens, 256);
  legend(info.levels);
}

function legend(levels) {
  const box = $("legend");
  box.textContent = "";
  const kinds = [...new Set(levels.map(kindOf).concat(["full"]))];
  for (const kind of kinds) {
    const s = document.createElement("span");
    s.className = `lvl-${kind}`;
    s.textContent = kind === "full" ? "full: " + WHAT.full : `${kind}: ${WHAT[kind] || kind}`;
    box.append(s);
  }
  const cut = document.createElement("span");
  cut.className = "cut";
  cut.textContent = "cut draft";
  box.append(cut);
}

async function readFile(file) {
  // a file no prompt of the model's context could come from is refused here, before it is read or sent
  if (info && file.size > info.max_body_bytes) {
    message(`The file ${file.name} is ${megabytes(file.size)}: no prompt that long fits this model's context of ` +
            `${info.max_context} tokens (the server reads at most ${megabytes(info.max_body_bytes)}). ` +
            "Choose a shorter file.");
    $("file").value = "";
    return;
  }
  const text = await file.text();
  if (text.includes("\u0000")) {
    message(`${file.name} does not look like a text file (it holds NUL bytes).`);
    return;
  }
  message("");
  $("prompt").value = text;
  $("file-note").textContent = `${file.name}: ${text.length} characters`;
}

function body() {
  const prompt = $("prompt").value;
  const req = {max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value), stream: true};
  if ($("chat").checked) req.messages = [{role: "user", content: prompt}];
  else req.prompt = prompt;
  const stack = $("stack").value.trim() || $("method").value;
  if (stack) req.stack = stack;
  const gammas = $("gammas").value.trim();
  if (gammas) req.gammas = gammas;
  return req;
}

// ---- one generation -----------------------------------------------------------------------------------------

function newRun() {
  return {start: performance.now(), first: null, tokens: 0, rounds: 0, origins: {}, levels: {}, route: null,
          routes: [], samples: [], recent: [], final: null, controller: new AbortController()};
}

async function generate(event) {
  event.preventDefault();
  if (!$("prompt").value.trim()) {
    message("Type a prompt, or drop a text file, first.");
    return;
  }
  message("");
  $("answer").textContent = "";
  run = newRun();
  drawPanel();
  $("run").disabled = true;
  $("stop").disabled = false;
  status("prefilling the prompt…");
  const path = $("chat").checked ? "v1/chat/completions" : "v1/completions";
  try {
    const r = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"},
                                 body: JSON.stringify(body()), signal: run.controller.signal});
    if (!r.ok) {
      const err = await r.json().catch(() => null);
      throw new Error(err && err.error ? err.error.message : `HTTP ${r.status}`);
    }
    await readStream(r.body.getReader());
    if (!run.final) throw new Error("the stream ended without its last chunk");
  } catch (e) {
    if (e.name === "AbortError") status(`stopped after ${run.tokens} tokens`);
    else { message(e.message); status(""); }
  } finally {
    $("run").disabled = false;
    $("stop").disabled = true;
    drawPanel();
  }
}

// server-sent events: "data: {json}\n\n" ..., then "data: [DONE]"
async function readStream(reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 2);
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const chunk = JSON.parse(line.slice(6));
      if (chunk.error) throw new Error(chunk.error.message);
      onChunk(chunk);
    }
  }
}

function onChunk(chunk) {
  const ext = chunk.triforce;
  if (ext && ext.tokens) onRound(ext);
  else {  // a chunk without provenance (another server's): its text, unmarked
    const c = chunk.choices && chunk.choices[0];
    const text = c ? (c.text !== undefined ? c.text : (c.delta && c.delta.content) || "") : "";
    if (text) append(text, null, null);
  }
  if (ext && ext.stats) onFinal(ext, chunk.choices[0].finish_reason);
}

function append(text, level, id) {
  const span = document.createElement("span");
  span.className = level ? `tok lvl-${kindOf(level)}` : "plain";
  span.textContent = text;
  if (id !== null) {
    span.dataset.id = id;
    span.dataset.level = level;
    span.title = level === "full" ? `the full model's own token (id ${id})` : `drafted by ${level} (id ${id})`;
  }
  $("answer").append(span);
}

function onRound(ext) {
  const now = performance.now();
  if (run.first === null) {
    run.first = now;
    run.opening = ext;  // prompt_tokens, prefix_cache_tokens, time_to_first_token (the server's)
    status("generating…");
  }
  // the draft's cut tail goes before the full model's own token that replaced it (a round cut short by the end of
  // the answer has no such token, and its tail is not shown)
  const last = ext.tokens.length - 1;
  ext.tokens.forEach((t, i) => {
    if (i === last && ext.bonus !== null && ext.rejected.length) cut(ext);
    append(t.text || "", t.level, t.id);
    run.origins[t.level] = (run.origins[t.level] || 0) + 1;
  });
  for (const d of ext.drafts) {
    const c = run.levels[d.verifier] || (run.levels[d.verifier] = {rounds: 0, proposed: 0, accepted: 0});
    c.rounds += 1;
    c.proposed += d.drafted.length;
    c.accepted += d.accepted;
  }
  if (ext.route && ext.route !== run.route) {
    run.routes.push({token: run.tokens, route: ext.route});
    run.route = ext.route;
  }
  run.tokens += ext.tokens.length;
  run.rounds += 1;
  sample(ext, now);
  drawPanel();
}

function cut(ext) {
  const span = document.createElement("span");
  span.className = "cut";
  span.dataset.ids = ext.rejected.join(",");
  // (a line break in a cut draft is shown as a sign: the answer's own lines stay where they are)
  span.textContent = (ext.rejected_text || `(${ext.rejected.length} tokens)`).replace(/\n/g, "\u21b5");
  span.title = `drafted, then cut by the full model: ${ext.rejected.length} token(s)`;
  $("answer").append(span);
}

// one chart point per round: tokens/s over the last second or so, and the top verifier's acceptance over its last
// 8 verifications
function sample(ext, now) {
  run.recent.push({at: now, tokens: ext.tokens.length});
  while (run.recent.length > 2 && now - run.recent[0].at > 1000) run.recent.shift();
  const span = (now - run.recent[0].at) / 1000;
  const tokens = run.recent.slice(1).reduce((n, r) => n + r.tokens, 0);
  const top = ext.drafts.filter((d) => d.verifier === "full" && d.drafted.length);
  run.topRounds = (run.topRounds || []).concat(top.map((d) => [d.accepted, d.drafted.length])).slice(-8);
  const drafted = run.topRounds.reduce((n, r) => n + r[1], 0);
  run.samples.push({x: run.tokens, tps: span > 0.05 ? tokens / span : null,
                    acceptance: drafted ? run.topRounds.reduce((n, r) => n + r[0], 0) / drafted : null});
}

function onFinal(ext, finish) {
  run.final = ext;
  $("stats").textContent = JSON.stringify(ext, null, 1);
  status(`done: ${ext.finish_reason || finish}, ${run.tokens} tokens` +
         (ext.stack ? ` with ${ext.method === ext.stack ? ext.stack : ext.method}` : ""));
}

// ---- the panel ----------------------------------------------------------------------------------------------

function fixed(x, digits) { return x === null || x === undefined || Number.isNaN(x) ? "–" : x.toFixed(digits); }

function drawPanel() {
  if (!run) return;
  const f = run.final, o = run.opening;
  const elapsed = run.first !== null ? (performance.now() - run.first) / 1000 : 0;
  $("tps").textContent = f && f.tokens_per_second ? `${fixed(f.tokens_per_second, 1)} (the server's decode rate)`
    : run.tokens > 1 && elapsed > 0 ? `${fixed((run.tokens - 1) / elapsed, 1)} (live)` : "–";
  const ttft = f && f.time_to_first_token !== undefined ? f.time_to_first_token : o && o.time_to_first_token;
  $("ttft").textContent = ttft !== undefined && ttft !== null ? `${fixed(ttft, 2)} s` : "–";
  $("prompt-tokens").textContent = o ? o.prompt_tokens : "–";
  $("prefix-tokens").textContent = o ? `${o.prefix_cache_tokens} tokens reused` : "–";
  $("counts").textContent = `${run.tokens} · ${run.rounds}`;
  $("route").textContent = run.route || (f ? f.stack : "–");
  table("origins", ["level", "tokens", "share"], Object.entries(run.origins).sort((a, b) => b[1] - a[1]),
        ([level, n]) => [level, n, `${fixed(100 * n / Math.max(run.tokens, 1), 0)}%`]);
  table("levels", ["level", "rounds", "drafted", "accepted", "acceptance", "tokens_per_round"],
        Object.entries(run.levels), ([level, c]) => [level, c.rounds, c.proposed, c.accepted,
        c.proposed ? fixed(c.accepted / c.proposed, 2) : "–", fixed((c.accepted + c.rounds) / c.rounds, 2)]);
  const routes = $("routes");
  routes.textContent = "";
  for (const r of run.routes.slice(-40)) {
    const li = document.createElement("li");
    li.textContent = `token ${r.token}: ${r.route}`;
    routes.append(li);
  }
  $("route-count").textContent = run.routes.length ? `(${Math.max(run.routes.length - 1, 0)})` : "";
  chart();
}

// rows of a panel table; each row names its level (data-level), each cell its column (data-field)
function table(id, fields, entries, cells) {
  const body = $(id).querySelector("tbody");
  body.textContent = "";
  for (const entry of entries) {
    const tr = document.createElement("tr");
    tr.dataset.level = entry[0];
    cells(entry).forEach((value, i) => {
      const td = document.createElement("td");
      td.dataset.field = fields[i];
      if (i === 0) {
        const swatch = document.createElement("span");
        swatch.className = `swatch lvl-${kindOf(String(value))}`;
        td.append(swatch);
      }
      td.append(String(value));
      tr.append(td);
    });
    body.append(tr);
  }
}

// tokens/s (blue, left axis) and the full model's acceptance of drafts (orange, 0 to 1, right axis) over the answer
function chart() {
  const canvas = $("chart");
  const scale = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 340, h = canvas.clientHeight || 150;
  canvas.width = w * scale;
  canvas.height = h * scale;
  const g = canvas.getContext("2d");
  g.scale(scale, scale);
  g.clearRect(0, 0, w, h);
  const pad = {l: 34, r: 30, t: 10, b: 20};
  const pts = run.samples;
  const xMax = Math.max(pts.length ? pts[pts.length - 1].x : 1, 1);
  const yMax = Math.max(1, ...pts.map((p) => p.tps || 0)) * 1.1;
  const X = (x) => pad.l + (w - pad.l - pad.r) * x / xMax;
  const Y = (v, top) => h - pad.b - (h - pad.t - pad.b) * v / top;
  g.strokeStyle = "#d8d8dc";
  g.fillStyle = "#6b6b70";
  g.font = "10px system-ui, sans-serif";
  g.strokeRect(pad.l, pad.t, w - pad.l - pad.r, h - pad.t - pad.b);
  g.fillText(fixed(yMax, 0), 4, pad.t + 8);
  g.fillText("0", 4, h - pad.b);
  g.fillText("1", w - pad.r + 6, pad.t + 8);
  g.fillText(`tokens: ${xMax}`, pad.l, h - 5);
  g.fillStyle = "#1f6feb";
  g.fillText("tokens/s", pad.l + 90, h - 5);
  g.fillStyle = "#e07b00";
  g.fillText("acceptance", pad.l + 150, h - 5);
  line(g, pts, "tps", X, (v) => Y(v, yMax), "#1f6feb");
  line(g, pts, "acceptance", X, (v) => Y(v, 1), "#e07b00");
}

function line(g, pts, key, X, Y, color) {
  g.strokeStyle = color;
  g.lineWidth = 1.5;
  g.beginPath();
  let drawing = false;
  for (const p of pts) {
    if (p[key] === null) { drawing = false; continue; }
    if (drawing) g.lineTo(X(p.x), Y(p[key]));
    else g.moveTo(X(p.x), Y(p[key]));
    drawing = true;
  }
  g.stroke();
}

// ---- wiring -------------------------------------------------------------------------------------------------

function setUp() {
  $("form").addEventListener("submit", generate);
  $("stop").addEventListener("click", () => {
    if (run) run.controller.abort();  // the server sees the connection close and cancels the request
  });
  $("file").addEventListener("change", (e) => e.target.files[0] && readFile(e.target.files[0]));
  const prompt = $("prompt");
  prompt.addEventListener("dragover", (e) => { e.preventDefault(); prompt.classList.add("dropping"); });
  prompt.addEventListener("dragleave", () => prompt.classList.remove("dropping"));
  prompt.addEventListener("drop", (e) => {
    e.preventDefault();
    prompt.classList.remove("dropping");
    if (e.dataTransfer.files.length) readFile(e.dataTransfer.files[0]);
  });
  $("show-cut").addEventListener("change", (e) => $("answer").classList.toggle("hide-cut", !e.target.checked));
  loadInfo();
}

document.addEventListener("DOMContentLoaded", setUp);
