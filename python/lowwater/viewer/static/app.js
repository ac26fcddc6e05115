// lowwater view: the run's config and summary, its memory plot, a table of
// rollouts (sort, filter, page) and each rollout's transcript on demand.
// Vanilla JS, no dependencies. Everything from the files goes into the page
// through textContent, never innerHTML: transcripts hold model output.
"use strict";

const PAGE = 200;
const ERROR_CLASSES = ["infra", "model", "environment", "timeout", "cancelled"];
const state = { rows: [], shown: [], sort: { key: "i", dir: 1 }, page: 0, selected: null };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

async function getJSON(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toFixed(digits);
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

function pct(x) { return x === null || x === undefined ? "" : (100 * x).toFixed(2) + " %"; }

function kv(table, pairs) {
  table.replaceChildren(...pairs.filter(([, v]) => v !== undefined && v !== "").map(([k, v]) =>
    el("tr", {}, el("td", {}, k), el("td", {}, v))));
}

// -- overview ---------------------------------------------------------------

function showRun(run) {
  const h = run.header;
  document.getElementById("title").textContent = `lowwater view · ${h.env} · run ${h.run_id}`;
  document.getElementById("subtitle").textContent =
    `${run.results} · model ${h.model} · started ${h.started}` + (run.summary ? "" : " · not finished (reload for new rows)");
  const skip = new Set(["type", "run_id", "env", "model", "started"]);
  kv(document.getElementById("config"), [
    ["environment", h.env], ["model", h.model],
    ...Object.entries(h).filter(([k]) => !skip.has(k)).map(([k, v]) => [k, fmt(v)]),
  ]);
  const s = run.summary ? run.summary.summary : null;
  if (s) {
    const rows = [
      ["rollouts", s.rollouts], ["completed", s.completed], ["errors", `${s.errors} (${pct(s.error_rate)})`],
      ["accuracy", pct(s.accuracy) + (s.accuracy_ci95 ? ` (95 % CI ${pct(s.accuracy_ci95[0])} – ${pct(s.accuracy_ci95[1])})` : "")],
      ["accuracy stderr", fmt(s.accuracy_stderr)], ["mean reward", fmt(s.reward_mean)], ["mean turns", fmt(s.turns_mean, 2)],
      ["wall time", `${fmt(s.wall_s, 2)} s`], ["rollouts/s", fmt(s.rollouts_per_s, 2)],
      ["RSS baseline / peak / resting", `${s.rss_baseline_mb} / ${s.rss_peak_mb} / ${s.rss_resting_mb} MiB`],
    ];
    if (s.pass_at_k) rows.push(["pass@k", Object.entries(s.pass_at_k).map(([k, v]) => `pass@${k} ${pct(v)}`).join(", ")]);
    if (s.pass_hat_k) rows.push(["pass^k", Object.entries(s.pass_hat_k).map(([k, v]) => `pass^${k} ${pct(v)}`).join(", ")]);
    for (const e of s.top_errors || []) rows.push([`${e.count}× ${e.class}`, e.message]);
    kv(document.getElementById("summary"), rows);
    plotMemory(run.summary.memory, h);
  } else {
    kv(document.getElementById("summary"), [["status", "the run has not finished: no summary yet"]]);
    document.getElementById("memory-note").textContent = "The memory record is written when the run finishes.";
  }
}

function ticks(max, n) {
  const raw = max / n, mag = Math.pow(10, Math.floor(Math.log10(raw || 1)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let v = 0; v <= max + 1e-9; v += step) out.push(v);
  return out;
}

function plotMemory(memory, header) {
  const plot = document.getElementById("memory-plot");
  plot.replaceChildren();
  const samples = (memory && memory.samples) || [];
  if (!samples.length) return;
  const W = 800, H = 280, L = 60, R = 60, T = 30, B = 40;
  const MiB = 1048576;
  const tMax = Math.max(samples[samples.length - 1][0], 1e-3);
  const yMax = Math.max(...samples.map((s) => s[1])) / MiB * 1.1;
  const nMax = Math.max(1, ...samples.map((s) => s[2])) * 1.1;
  const x = (t) => L + (W - L - R) * t / tMax;
  const y = (mb) => H - B - (H - T - B) * mb / yMax;
  const y2 = (n) => H - B - (H - T - B) * n / nMax;
  for (const v of ticks(yMax, 5)) {
    plot.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }));
    plot.append(svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, v.toFixed(0)));
  }
  for (const v of ticks(tMax, 8)) {
    plot.append(svg("text", { x: x(v), y: H - B + 16, "text-anchor": "middle" }, v < 10 ? v.toFixed(1) : v.toFixed(0)));
  }
  for (const v of ticks(nMax, 5)) {
    plot.append(svg("text", { x: W - R + 6, y: y2(v) + 4 }, v.toFixed(0)));
  }
  plot.append(svg("line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" }));
  plot.append(svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  plot.append(svg("line", { x1: W - R, x2: W - R, y1: T, y2: H - B, class: "axis" }));
  const base = memory.baseline_bytes / MiB;
  plot.append(svg("line", { x1: L, x2: W - R, y1: y(base), y2: y(base), stroke: "#1f6feb", "stroke-dasharray": "3 3" }));
  const line = (fn, color) => svg("polyline", {
    points: samples.map((s) => `${x(s[0]).toFixed(1)},${fn(s).toFixed(1)}`).join(" "),
    fill: "none", stroke: color, "stroke-width": 2,
  });
  plot.append(line((s) => y(s[1] / MiB), "#1f6feb"), line((s) => y2(s[2]), "#e67e22"));
  plot.append(svg("text", { x: W / 2, y: 16, "text-anchor": "middle", class: "title" },
    `RSS over the run · ${header.env} · ${header.model} · run ${header.run_id}`));
  plot.append(svg("text", { x: W / 2, y: H - 6, "text-anchor": "middle" }, "seconds since the baseline sample"));
  plot.append(svg("text", { x: 14, y: H / 2, transform: `rotate(-90 14 ${H / 2})`, "text-anchor": "middle" }, "RSS (MiB)"));
  plot.append(svg("text", { x: W - 8, y: H / 2, transform: `rotate(90 ${W - 8} ${H / 2})`, "text-anchor": "middle" }, "rollouts finished"));
  const legend = [["#1f6feb", "RSS"], ["#1f6feb", "RSS baseline", "3 3"], ["#e67e22", "rollouts finished"]];
  legend.forEach(([color, label, dash], i) => {
    const lx = L + 12 + i * 150;
    plot.append(svg("line", { x1: lx, x2: lx + 22, y1: T + 8, y2: T + 8, stroke: color, "stroke-width": 2, "stroke-dasharray": dash || "" }));
    plot.append(svg("text", { x: lx + 28, y: T + 12 }, label));
  });
  document.getElementById("memory-note").textContent =
    `${samples.length} samples from t = 0 to ${tMax.toFixed(2)} s; baseline ${base.toFixed(1)} MiB, peak ${(memory.peak_bytes / MiB).toFixed(1)} MiB.`;
}

// -- table -----------------------------------------------------------------

function filters() {
  const num = (id) => { const v = document.getElementById(id).value; return v === "" ? null : Number(v); };
  return {
    error: document.getElementById("f-error").value,
    min: num("f-reward-min"), max: num("f-reward-max"),
    correct: document.getElementById("f-correct").value,
    group: document.getElementById("f-group").value.trim(),
    task: document.getElementById("f-task").value.trim(),
  };
}

function matches(r, f) {
  if (f.error === "none" && r.error_class) return false;
  if (f.error === "any" && !r.error_class) return false;
  if (f.error && !["none", "any"].includes(f.error) && r.error_class !== f.error) return false;
  if (f.min !== null && !(r.reward !== null && r.reward >= f.min)) return false;
  if (f.max !== null && !(r.reward !== null && r.reward <= f.max)) return false;
  if (f.correct && String(Boolean(r.correct)) !== f.correct) return false;
  if (f.group && !String(r.group_id ?? "").includes(f.group)) return false;
  if (f.task && !String(r.task_id ?? "").includes(f.task)) return false;
  return true;
}

function compare(key, dir) {
  return (a, b) => {
    const u = a[key], v = b[key];
    if (u === v) return a.i - b.i;
    if (u === null || u === undefined) return 1;  // missing values last, either direction
    if (v === null || v === undefined) return -1;
    if (typeof u === "number" && typeof v === "number") return dir * (u - v);
    return dir * String(u).localeCompare(String(v), undefined, { numeric: true });
  };
}

function render() {
  const f = filters();
  state.shown = state.rows.filter((r) => matches(r, f)).sort(compare(state.sort.key, state.sort.dir));
  const pages = Math.max(1, Math.ceil(state.shown.length / PAGE));
  state.page = Math.min(state.page, pages - 1);
  const slice = state.shown.slice(state.page * PAGE, (state.page + 1) * PAGE);
  document.querySelector("#rows tbody").replaceChildren(...slice.map((r) => el("tr",
    { "data-rollout": r.rollout_id ?? "", class: r.rollout_id === state.selected ? "selected" : "", onclick: () => openTranscript(r) },
    el("td", {}, fmt(r.task_id)), el("td", { class: "mono" }, fmt(r.group_id)), el("td", {}, fmt(r.reward)),
    el("td", { class: r.correct ? "yes" : "no" }, r.error_class ? "" : (r.correct ? "yes" : "no")),
    el("td", { class: "err", title: r.error || "" }, r.error_class || ""), el("td", {}, fmt(r.turns)),
    el("td", {}, fmt(r.total_s, 2)), el("td", {}, fmt(r.attempts)), el("td", { class: "mono" }, fmt(r.rollout_id)))));
  document.getElementById("count").textContent = `${state.shown.length} of ${state.rows.length} rollouts`;
  document.getElementById("page").textContent = `page ${state.page + 1} of ${pages}`;
  document.getElementById("prev").disabled = state.page === 0;
  document.getElementById("next").disabled = state.page >= pages - 1;
  for (const th of document.querySelectorAll("#rows th")) {
    th.classList.toggle("asc", th.dataset.key === state.sort.key && state.sort.dir > 0);
    th.classList.toggle("desc", th.dataset.key === state.sort.key && state.sort.dir < 0);
  }
}

// -- transcript ------------------------------------------------------------

function text(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((p) => (p && typeof p === "object" ? (p.text ?? p.content ?? JSON.stringify(p)) : String(p))).join("\n");
  return JSON.stringify(content, null, 2);
}

function toolCall(call) {
  const fn = call.function || call;
  const args = fn.arguments ?? fn.input ?? call.arguments;
  return el("div", { class: "call" }, `→ ${fn.name || call.name || "tool"}(${typeof args === "string" ? args : JSON.stringify(args)})`);
}

function message(m) {
  if (!m || typeof m !== "object") return el("div", { class: "msg" }, el("pre", {}, text(m)));
  const role = m.role || m.type || "item";
  const box = el("div", { class: `msg ${role}` }, el("div", { class: "role" }, role + (m.tool_call_id ? ` (${m.tool_call_id})` : "")));
  if (Array.isArray(m.content)) {
    for (const part of m.content) {
      if (part && (part.type === "tool_use" || part.type === "function_call")) box.append(toolCall(part));
      else if (part && part.type === "tool_result") box.append(el("pre", {}, "tool result: " + text(part.content)));
      else box.append(el("pre", {}, text([part])));
    }
  } else if (m.content !== undefined && m.content !== null) {
    box.append(el("pre", {}, text(m.content)));
  }
  for (const call of m.tool_calls || []) box.append(toolCall(call));
  if (m.type === "function_call") box.append(toolCall(m));
  if (m.output !== undefined) box.append(el("pre", {}, text(m.output)));
  return box;
}

function toolName(t) {
  if (!t || typeof t !== "object") return String(t);
  return (t.function && t.function.name) || t.name || t.type || "tool";
}

// The tools a turn offered, folded: samples files write them once per change
// ("tools_same" on a turn that offered the previous turn's), and the JSON is
// put into the page only when the block is opened (a long run of turns with
// a large tool list would otherwise hold it once per turn).
function toolsBlock(tools, sameAs) {
  const names = tools.map(toolName).join(", ");
  const label = `tools offered (${tools.length})` + (sameAs === null ? "" : ` · same as turn ${sameAs + 1}`) + `: ${names}`;
  const body = el("pre", { class: "mono" });
  const block = el("details", { class: "tools" }, el("summary", {}, label), body);
  block.addEventListener("toggle", () => {
    if (block.open && !body.textContent) body.textContent = JSON.stringify(tools, null, 2);
  });
  return block;
}

function completion(c) {
  if (Array.isArray(c)) return c.map((item) => (item && item.type === "tool_use" ? el("div", { class: "msg assistant" }, toolCall(item)) : message(item && item.role ? item : { role: "assistant", content: [item] })));
  return [message(c && typeof c === "object" && !c.role ? { role: "assistant", ...c } : c)];
}

function showTranscript(s) {
  const body = document.getElementById("transcript-body");
  const outcome = s.error ? `error ${s.error.class}: ${s.error.message}` : `reward ${fmt(s.reward)} · ${JSON.stringify(s.metrics)}`;
  const parts = [
    el("table", { class: "kv" },
      el("tr", {}, el("td", {}, "task"), el("td", {}, fmt(s.task_id))),
      el("tr", {}, el("td", {}, "group"), el("td", { class: "mono" }, fmt(s.group_id))),
      el("tr", {}, el("td", {}, "outcome"), el("td", { class: s.error ? "err" : "" }, outcome)),
      el("tr", {}, el("td", {}, "reference answer"), el("td", {}, fmt(s.task && s.task.answer))),
      el("tr", {}, el("td", {}, "timing"), el("td", {},
        Object.entries(s.timing || {}).map(([k, v]) => `${k.replace(/_s$/, "")} ${fmt(v, 3)} s`).join(" · ")))),
    el("h3", {}, "Prompt"), el("pre", { id: "transcript-prompt" }, s.task ? s.task.prompt : ""),
  ];
  let tools = null, toolsFrom = null;
  (s.turns || []).forEach((turn, i) => {
    if (!turn.tools_same) { tools = Array.isArray(turn.tools) && turn.tools.length ? turn.tools : null; toolsFrom = i; }
    const box = el("div", { class: "turn" },
      el("h3", {}, `turn ${i + 1} · ${turn.protocol} · ${fmt(turn.duration_s, 3)} s` +
        (turn.usage ? ` · usage ${JSON.stringify(turn.usage)}` : "") + (turn.finish_reason ? ` · ${turn.finish_reason}` : "")));
    if (tools) box.append(toolsBlock(tools, turn.tools_same ? toolsFrom : null));
    if (turn.request_delta_start) box.append(el("div", { class: "note" }, `(${turn.request_delta_start} earlier messages not repeated)`));
    for (const m of turn.request_delta || []) box.append(message(m));
    box.append(...completion(turn.completion));
    if (turn.token_ids) box.append(el("div", { class: "note mono" }, `${turn.token_ids.length} token ids, logprobs ${turn.logprobs ? "captured" : "absent"}`));
    if (turn.error) box.append(el("div", { class: "err" }, `call error: ${turn.error}`));
    parts.push(box);
  });
  if (s.state && Object.keys(s.state).length) parts.push(el("h3", {}, "Environment state"), el("pre", {}, JSON.stringify(s.state, null, 2)));
  body.replaceChildren(...parts);
}

async function openTranscript(r) {
  state.selected = r.rollout_id;
  render();
  const panel = document.getElementById("transcript");
  panel.hidden = false;
  document.getElementById("transcript-title").textContent = `Transcript · ${r.rollout_id ?? "no rollout id"}`;
  const body = document.getElementById("transcript-body");
  if (!r.rollout_id) { body.replaceChildren(el("p", {}, "This row has no rollout (the task never ran: " + (r.error || "") + ").")); return; }
  body.replaceChildren(el("p", { class: "note" }, "loading…"));
  try {
    showTranscript(await getJSON(`/api/sample/${encodeURIComponent(r.rollout_id)}`));
  } catch (e) {
    body.replaceChildren(el("p", { class: "err" }, `No transcript: ${e.message}`));
  }
}

// -- start -----------------------------------------------------------------

async function main() {
  const select = document.getElementById("f-error");
  for (const c of ERROR_CLASSES) select.append(el("option", { value: c }, c));
  for (const id of ["f-error", "f-reward-min", "f-reward-max", "f-correct", "f-group", "f-task"]) {
    for (const event of ["input", "change"]) {  // a select may fire only "change" (and clear() only "change")
      document.getElementById(id).addEventListener(event, () => { state.page = 0; render(); });
    }
  }
  document.getElementById("filters").addEventListener("submit", (e) => e.preventDefault());
  for (const th of document.querySelectorAll("#rows th")) {
    th.addEventListener("click", () => {
      const key = th.dataset.key;
      state.sort = { key, dir: state.sort.key === key ? -state.sort.dir : 1 };
      render();
    });
  }
  document.getElementById("prev").addEventListener("click", () => { state.page -= 1; render(); });
  document.getElementById("next").addEventListener("click", () => { state.page += 1; render(); });
  document.getElementById("close").addEventListener("click", () => { document.getElementById("transcript").hidden = true; });
  const [run, rows] = await Promise.all([getJSON("/api/run"), getJSON("/api/rows")]);
  showRun(run);
  state.rows = rows.rows;
  render();
  document.body.dataset.ready = "true";
}

main().catch((e) => {
  document.body.dataset.ready = "error";
  document.getElementById("subtitle").textContent = `Could not load the run: ${e.message}`;
});
