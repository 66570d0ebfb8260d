// The page: polls /ui/api/now, refetches what changed, draws charts as SVG.
// Every value from the server goes in as text (textContent, SVG text nodes, setAttribute of
// numbers): no markup is ever built from data, so a conversation cannot run script here.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const state = { token: null, cursors: [null], view: "dashboard", session: null, convAfter: -1, poll: 2000, timer: null, user: "" };

// --- small DOM helpers ------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  return node;
}
function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}
const $ = (id) => document.getElementById(id);
function setText(id, text) { $(id).textContent = text === null || text === undefined ? "" : String(text); }
function pct(x) { return (100 * x).toFixed(0) + " %"; }
function signed(x) { return x === null || x === undefined ? "–" : (x >= 0 ? "+" : "−") + Math.abs(x).toFixed(2); }
function when(iso) { return iso ? iso.replace("T", " ").slice(0, 19) : "–"; }
function short(s, n) { s = s || ""; return s.length > n ? s.slice(0, n) + "…" : s; }
function say(text, bad) {
  const m = $("message");
  m.textContent = text; m.hidden = !text; m.className = bad ? "bad" : "good";
}

// The user an admin picked (none: everyone's); a user's key reads its own whatever this says.
function withUser(path) {
  if (!state.user) return path;
  return path + (path.includes("?") ? "&" : "?") + "user=" + encodeURIComponent(state.user);
}

async function api(path, body) {
  path = withUser(path);
  const init = { credentials: "same-origin", headers: { "X-Clawbridge-UI": "1" } };
  if (body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  if (r.status === 401) { window.location.reload(); throw new Error("signed out"); }
  const data = await r.json();
  if (!r.ok) throw new Error((data.error && data.error.message) || r.statusText);
  return data;
}

// --- Now ---------------------------------------------------------------------------------------
function renderNow(now) {
  const s = now.status, w = now.waiting, l = s.learner;
  setText("model", [s.model, s.backend && s.backend + " backend"].filter(Boolean).join(" · "));
  setText("serving", "v" + s.version + (s.instruction ? ` + ${s.instruction.split("\n").length} preference(s) as an instruction` : ""));
  if (s.user) {
    setText("backend", (s.live ? `${s.sessions_open} open conversations of ${s.user}` : "no server running: the recorded data, read-only")
      + " · one adapter trains for every user");
  } else {
    setText("backend", s.live ? `${s.in_flight} in flight · ${s.requests} requests · ${s.sessions_open} open conversations`
                              : "no server running: the recorded data, read-only");
  }
  const spool = s.spool;  // writes the store could not take (docs/operating.md#when-the-store-is-down)
  if (spool && spool.store_down_since) {
    setText("backend", `store unreachable since ${when(spool.store_down_since)} · ${spool.depth} writes spooled, replayed when it is back`
      + (spool.turns_lost ? ` · ${spool.turns_lost} turns lost` : ""));
  } else if (spool && spool.depth) {
    setText("backend", `replaying ${spool.depth} spooled writes into the store`);
  }
  setText("waiting", `${w.turns_to_judge} to judge · ${w.samples_to_train} to train`);
  setText("waiting-detail", `${w.samples_being_judged} being judged (turns to judge: of the newest ${w.turns_window})`);
  const pause = $("pause");
  if (!l) {
    setText("training", s.live ? "off" : "–");
    setText("training-detail", s.live ? "this server captures without training (--no-train)" : "");
    pause.hidden = true;
  } else {
    const word = l.stopped ? "stopped" : l.paused ? "paused" : l.busy ? "a step is running" : "on";
    setText("training", word);
    $("training").className = "value " + (l.stopped || l.errors ? "bad" : l.paused ? "warn" : "good");
    const bits = [];
    if (l.stopped) bits.push(l.stopped);
    if (l.paused) bits.push(l.paused);
    if (l.errors) bits.push(`${l.errors} learner errors (see the server log)`);
    if (l.fields.step !== undefined) bits.push(`last step #${l.fields.step}`);
    if (l.fields["mean reward"] !== undefined) bits.push(`mean reward ${l.fields["mean reward"]}`);
    setText("training-detail", bits.join(" · "));
    pause.hidden = !now.actions.pause;
    pause.textContent = l.paused ? "resume training" : "pause training";
    pause.dataset.paused = l.paused ? "1" : "0";
  }
  const sp = s.spend;
  if (sp && sp.spent_usd !== undefined) {
    setText("cost", "$" + Number(sp.spent_usd).toFixed(2));
    setText("cost-detail", `on ${sp.platform}` + (sp.budget_usd !== null && sp.budget_usd !== undefined ? ` of a $${sp.budget_usd} budget` : "")
      + (sp.training_allowed === false ? " — training stopped by the budget" : ""));
  } else {
    setText("cost", "–");
    setText("cost-detail", !s.user ? "this backend keeps no cost (a local model is free)"
      : now.viewer && now.viewer.admin ? "the server's cost: shown with every user's data" : "the server's cost is its operator's");
  }
  renderViewer(now);
  setText("updated", "updated " + new Date().toLocaleTimeString());
}

// Whose data the page shows: a user's key its own user's; an admin key everyone's, or the user
// picked in the list.
function renderViewer(now) {
  const v = now.viewer || {}, pick = $("user"), box = $("user-pick");
  setText("viewer", v.admin ? (v.user ? `showing ${v.user}'s data` : "showing every user's data") : `signed in as ${v.user}`);
  box.hidden = !Array.isArray(now.users);
  if (box.hidden) return;
  const names = ["", ...now.users];
  if (state.user && !names.includes(state.user)) names.push(state.user);
  const shown = [...pick.options].map((o) => o.value);
  if (shown.join("\n") !== names.join("\n")) {
    pick.replaceChildren(...names.map((n) => el("option", { value: n }, n || "every user")));
  }
  pick.value = state.user;
}

// --- charts ------------------------------------------------------------------------------------
const W = 420, H = 180, PAD = { l: 40, r: 10, t: 10, b: 28 };

function frame(host, ymin, ymax, labels, yfmt) {
  host.replaceChildren();
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  const iw = W - PAD.l - PAD.r, ih = H - PAD.t - PAD.b;
  const x = (i) => PAD.l + ((i + 0.5) * iw) / labels.length;  // the middle of version i's band
  const y = (v) => PAD.t + ih - ((v - ymin) / (ymax - ymin)) * ih;
  for (const v of [ymin, (ymin + ymax) / 2, ymax]) {
    root.append(svg("line", { x1: PAD.l, x2: W - PAD.r, y1: y(v), y2: y(v), class: "grid" }));
    root.append(svg("text", { x: PAD.l - 4, y: y(v) + 4, "text-anchor": "end", class: "axis" }, yfmt(v)));
  }
  const step = Math.max(1, Math.ceil(labels.length / 12));
  labels.forEach((lab, i) => {
    if (i % step === 0) root.append(svg("text", { x: x(i), y: H - 10, "text-anchor": "middle", class: "axis" }, lab));
  });
  host.append(root);
  return { root, x, y, iw, ih };
}

function empty(host, text) { host.replaceChildren(el("p", { class: "muted" }, text)); }

function drawReactions(vs) {
  const host = $("chart-reactions");
  const rows = vs.filter((v) => v.reactions && v.reactions.judged > 0);
  if (!rows.length) return empty(host, "No judged turns yet: the chart fills in as the user answers.");
  const f = frame(host, 0, 1, rows.map((v) => "v" + v.version), pct);
  const bw = Math.max(6, Math.min(36, f.iw / rows.length - 6));
  rows.forEach((v, i) => {
    const r = v.reactions, n = r.judged;
    let top = 0;
    for (const [k, cls] of [["up", "up"], ["neutral", "neutral"], ["down", "down"]]) {
      const share = r[k] / n;
      const rect = svg("rect", { x: f.x(i) - bw / 2, y: f.y(1 - top), width: bw, height: Math.max(0, f.y(1 - top - share) - f.y(1 - top)), class: cls });
      rect.append(svg("title", {}, `v${v.version}: ${r[k]} of ${n} judged ${k === "up" ? "+1" : k === "down" ? "−1" : "0"} (${pct(share)})`));
      f.root.append(rect);
      top += share;
    }
  });
}

function drawReward(vs) {
  const host = $("chart-reward");
  const rows = vs.filter((v) => v.reactions && v.reactions.mean_reward !== null);
  if (!rows.length) return empty(host, "No rewards yet.");
  const f = frame(host, -1, 1, rows.map((v) => "v" + v.version), (v) => (v > 0 ? "+" : "") + v.toFixed(1));
  const pts = rows.map((v, i) => [f.x(i), f.y(v.reactions.mean_reward)]);
  f.root.append(svg("polyline", { points: pts.map((p) => p.join(",")).join(" "), class: "line" }));
  rows.forEach((v, i) => {
    const c = svg("circle", { cx: pts[i][0], cy: pts[i][1], r: 4, class: "dot" });
    c.append(svg("title", {}, `v${v.version}: mean reward ${signed(v.reactions.mean_reward)} over ${v.reactions.judged} judged turns`));
    f.root.append(c);
  });
}

// The gate's figures are drawn by name: `{group}_candidate` against the group's reference
// figures (`{group}_serving`, `{group}_v0`, `{group}_twin`, …; p-values left out), so
// figures a newer gate records appear without a change here.
function gateSeries(vs) {
  const series = new Map();
  for (const v of vs) {
    const fig = (v.gate && v.gate.figures) || {};
    for (const [k, val] of Object.entries(fig)) {
      const m = /^(.+)_candidate$/.exec(k);
      if (!m || typeof val !== "number") continue;
      const g = m[1];
      if (!series.has(g)) series.set(g, new Set());
      for (const [k2, v2] of Object.entries(fig)) {
        if (k2.startsWith(g + "_") && k2 !== k && !k2.includes("_p_") && typeof v2 === "number" && v2 >= 0 && v2 <= 1 && !k2.endsWith("_n"))
          series.get(g).add(k2.slice(g.length + 1));
      }
    }
  }
  return series;
}

function drawGate(vs) {
  const host = $("chart-gate");
  const rows = vs.filter((v) => v.gate);
  if (!rows.length) return empty(host, "No gate decisions yet (the gate judges each candidate before it serves).");
  const series = gateSeries(rows);
  const f = frame(host, 0, 1, rows.map((v) => "v" + v.version), pct);
  const groups = [...series.keys()];
  groups.forEach((g, gi) => {
    const cls = "g" + (gi % 4);
    rows.forEach((v, i) => {
      const fig = v.gate.figures || {};
      const dx = (gi - (groups.length - 1) / 2) * 7;
      if (typeof fig[g + "_candidate"] === "number") {
        const c = svg("circle", { cx: f.x(i) + dx, cy: f.y(fig[g + "_candidate"]), r: 4, class: "cand " + cls });
        c.append(svg("title", {}, `v${v.version} ${g}: candidate ${pct(fig[g + "_candidate"])}`));
        f.root.append(c);
      }
      for (const ref of series.get(g)) {
        if (typeof fig[g + "_" + ref] !== "number") continue;
        const c = svg("circle", { cx: f.x(i) + dx, cy: f.y(fig[g + "_" + ref]), r: 4, class: "ref " + cls });
        c.append(svg("title", {}, `v${v.version} ${g}: ${ref} ${pct(fig[g + "_" + ref])}`));
        f.root.append(c);
      }
    });
    f.root.append(svg("text", { x: PAD.l + 4 + gi * 90, y: PAD.t + 10, class: "legend " + cls }, "● " + g));
  });
  rows.forEach((v, i) => {
    const ok = v.gate.decision === "accepted";
    const mark = svg("text", { x: f.x(i), y: H - 20, "text-anchor": "middle", class: ok ? "ok" : "held" }, ok ? "✓" : "✗");
    mark.append(svg("title", {}, `v${v.version}: ${ok ? "accepted" : "held back"} — ${v.gate.reason || ""}`));
    f.root.append(mark);
  });
}

// --- versions table ----------------------------------------------------------------------------
function madeBy(v) {
  if (v.version === 0) return "the base model";
  if (v.step !== null && v.step !== undefined) return `training step ${v.step}`;
  if (v.restores !== null && v.restores !== undefined) return `a copy of v${v.restores}`;
  return "–";
}

function gateCell(g) {
  if (!g) return el("td", {}, "–");
  const ok = g.decision === "accepted";
  const td = el("td", {}, el("span", { class: "badge " + (ok ? "trained" : "dropped") }, ok ? "accepted" : "held back"), " ", g.reason || "");
  const f = g.figures || {};
  if (typeof f.price_points === "number") {
    const plain = typeof f.probe_v0 === "number" ? pct(f.probe_v0) : "?", asked = typeof f.probe_twin === "number" ? pct(f.probe_twin) : "?";
    td.append(el("div", { class: "price" }, `price of the preferences: ${f.price_points.toFixed(0)} points of general answers (base model ${plain} plain → ${asked} asked)`));
  }
  const figs = Object.entries(g.figures || {}).map(([k, v]) => `${k} ${typeof v === "number" ? +v.toFixed(4) : v}`);
  const extra = Object.entries(g).filter(([k]) => !["version", "serving", "decision", "reason", "figures"].includes(k))
    .map(([k, v]) => `${k} ${typeof v === "object" ? JSON.stringify(v) : v}`);
  if (figs.length || extra.length) td.append(el("details", {}, el("summary", {}, "figures"), el("div", { class: "figs" }, [...extra, ...figs].join(" · "))));
  return td;
}

function renderVersions(vs, canRollback, serving) {
  const body = $("versions").querySelector("tbody");
  body.replaceChildren();
  for (const v of [...vs].reverse()) {
    const r = v.reactions;
    const tr = el("tr", { "data-version": v.version },
      el("td", {}, "v" + v.version, v.version === serving ? el("span", { class: "badge trained" }, "serving") : null),
      el("td", {}, madeBy(v)),
      el("td", {}, when(v.created_at)),
      el("td", {}, r ? `${r.up} / ${r.neutral} / ${r.down} of ${r.judged}` : "–"),
      el("td", {}, r ? signed(r.mean_reward) : "–"),
      gateCell(v.gate),
      el("td", {}));
    if (canRollback && v.version !== serving) {
      const b = el("button", { type: "button", class: "rollback", "data-version": v.version }, `serve v${v.version} again`);
      b.addEventListener("click", () => rollback(v.version));
      tr.lastChild.append(b);
    }
    body.append(tr);
  }
}

async function rollback(version) {
  if (!window.confirm(`Serve the weights of v${version} again, as a new version? Training continues from them.`)) return;
  try {
    const out = await api("/ui/api/rollback", { version });
    say(`v${out.version} now serves the weights of v${out.restored} (was v${out.previous}).`);
    await refresh(true);
  } catch (e) { say("Rollback failed: " + e.message, true); }
}

async function togglePause() {
  const paused = $("pause").dataset.paused !== "1";
  try {
    await api("/ui/api/training", { paused });
    say(paused ? "Training paused: turns are still judged; no step runs until you resume." : "Training resumed.");
    await refresh(true);
  } catch (e) { say("Could not change training: " + e.message, true); }
}

// --- turns -------------------------------------------------------------------------------------
function verdict(t) {
  if (t.reward === null || t.reward === undefined) return el("span", { class: "muted" }, "–");
  const cls = t.reward > 0 ? "up" : t.reward < 0 ? "down" : "neutral";
  const span = el("span", { class: "verdict " + cls }, t.reward > 0 ? "+1" : t.reward < 0 ? "−1" : "0");
  const votes = (t.votes || []).filter((v) => v !== null).map((v) => (typeof v === "number" ? (v > 0 ? "+" : "") + v : String(v)));
  const bits = [];
  if (votes.length) bits.push("votes " + votes.join(" "));
  if (t.feedback !== null && t.feedback !== undefined) bits.push("explicit feedback");
  return el("span", {}, span, bits.length ? el("span", { class: "muted" }, " " + bits.join(", ")) : null);
}

function sessionLink(sid) {
  return el("a", { href: "#/session/" + encodeURIComponent(sid), class: "session" }, short(sid, 18));
}

function nextText(t) {
  if (!t.next) return el("span", { class: "muted" }, "–");
  return el("span", {}, short(t.next.map((m) => m.text).join(" / "), 140));
}

function renderTurns(page) {
  const body = $("turns").querySelector("tbody");
  body.replaceChildren();
  if (!page.turns.length) body.append(el("tr", {}, el("td", { colspan: 10, class: "muted" }, "No conversations yet: point your agent at this server.")));
  for (const t of page.turns) {
    body.append(el("tr", { "data-turn": t.id, class: "turn" },
      el("td", {}, when(t.created_at)),
      el("td", {}, t.user || "–"),
      el("td", {}, sessionLink(t.session_id), " #" + t.index),
      el("td", {}, "v" + t.version),
      el("td", { class: "text" }, short(t.asked, 160)),
      el("td", { class: "text" }, short(t.answer, 160)),
      el("td", { class: "text" }, nextText(t)),
      el("td", {}, verdict(t)),
      el("td", { class: "text" }, t.hint ? short(t.hint, 120) : "–"),
      el("td", {}, el("span", { class: "badge " + t.state }, t.status))));
  }
  state.next = page.next;
  $("older").hidden = !page.next;
  $("newest").hidden = state.cursors.length <= 1;
}

function renderPreferences(prefs, canAct) {
  const ul = $("preferences");
  ul.replaceChildren();
  if (!prefs || !prefs.length) ul.append(el("li", { class: "muted" }, "None yet: a preference is heard in the user's corrections."));
  for (const p of prefs || []) {
    const li = el("li", { class: p.state === "applied" || p.state === "learned" ? "" : "muted", "data-preference": p.id },
      `#${p.id} `, el("span", { class: "badge " + p.state }, p.state), " ", el("q", {}, p.text),
      ` — ${p.user}'s · ${p.kind || "not form"} · heard ${p.count}× · since ${when(p.since)} · ${p.note}`);
    if (canAct && p.state !== "applied" && p.state !== "learned" && !p.note.startsWith("never")) {
      const b = el("button", { type: "button", class: "confirm" }, "Confirm");
      b.addEventListener("click", () => preferenceAction(p.id, "confirm"));
      li.append(" ", b);
    }
    if (canAct && p.state !== "dropped") {
      const b = el("button", { type: "button", class: "forget" }, "Forget");
      b.addEventListener("click", () => preferenceAction(p.id, "forget"));
      li.append(" ", b);
    }
    ul.append(li);
  }
}

async function preferenceAction(id, action) {
  if (action === "forget" && !window.confirm(`Forget preference #${id}? Its instruction stops now and its samples not trained yet are dropped.`)) return;
  try {
    const out = await api("/ui/api/preferences", { id, action });
    say(action === "confirm" ? `#${id} is applied: the next answers are served with it.`
      : `#${id} is dropped; ${out.samples_dropped} samples dropped.` + (out.rollback_command ? ` To go back to the weights before it: ${out.rollback_command} (or "serve v${out.rollback_to} again" below).` : ""));
    await refresh(true);
  } catch (e) { say(`Could not ${action} #${id}: ` + e.message, true); }
}

function renderHints(hints) {
  const ul = $("hints");
  ul.replaceChildren();
  if (!hints.length) ul.append(el("li", { class: "muted" }, "None yet: hints come from the user's corrections."));
  for (const h of hints) ul.append(el("li", {}, el("q", {}, h.hint), el("span", { class: "muted" }, ` — ${h.samples} samples, ${h.trained} trained, last ${when(h.last)}`)));
}

// --- a conversation ----------------------------------------------------------------------------
function messageBlock(m) {
  const box = el("div", { class: "msg " + (["user", "assistant", "tool", "system"].includes(m.role) ? m.role : "other") },
    el("div", { class: "role" }, m.role), el("pre", {}, m.text));
  if (m.tool_calls) box.append(el("div", { class: "muted" }, "tool calls: " + m.tool_calls.join(", ")));
  return box;
}

function renderConversation(data, append) {
  const host = $("conv-turns");
  if (!append) host.replaceChildren();
  const s = data.session;
  setText("conv-id", s.id);
  setText("conv-meta", `${s.user}'s · ${s.turns} turns (${s.main_turns} main) · started ${when(s.created_at)} · ` + (s.done ? `ended (${s.done_reason || "done"})` : "open"));
  for (const t of data.turns) {
    const card = el("article", { class: "turn-card", id: "turn-" + t.index },
      el("h3", {}, `turn #${t.index} · v${t.version} · ${when(t.created_at)} `, el("span", { class: "badge " + t.state }, t.status)));
    const own = t.messages.filter((m) => m.role !== "system");
    const system = t.messages.filter((m) => m.role === "system");
    if (system.length) card.append(el("details", {}, el("summary", {}, "system prompt"), ...system.map(messageBlock)));
    own.forEach((m) => card.append(messageBlock(m)));
    card.append(messageBlock({ role: "assistant", text: t.answer, tool_calls: t.answer_tool_calls }));
    if (t.next) card.append(el("div", { class: "next" }, el("div", { class: "label" }, "what came next"), ...t.next.map(messageBlock)));
    card.append(el("p", {}, "verdict: ", verdict(t), t.hint ? el("span", {}, " · hint: ", el("q", {}, t.hint)) : null,
      t.sample && t.sample.rewrite ? " · trained with a rewrite" : null));
    host.append(card);
  }
  state.convNext = data.next;
  $("conv-more").hidden = !data.next;
}

async function openConversation(sid, append) {
  const after = append ? state.convNext : -1;
  const data = await api(`/ui/api/sessions/${encodeURIComponent(sid)}?after=${encodeURIComponent(after)}`);
  renderConversation(data, append);
}

// --- the loop ----------------------------------------------------------------------------------
async function loadDashboard() {
  const [progress, page] = await Promise.all([
    api("/ui/api/progress"),
    api("/ui/api/turns?learning=" + ($("all-turns").checked ? "0" : "1")
        + (state.cursors[state.cursors.length - 1] ? "&before=" + encodeURIComponent(state.cursors[state.cursors.length - 1]) : "")),
  ]);
  state.progress = progress;
  drawReactions(progress.versions);
  drawReward(progress.versions);
  drawGate(progress.versions);
  renderVersions(progress.versions, state.now && state.now.actions.rollback, state.now && state.now.status.version);
  renderPreferences(progress.preferences, state.now && state.now.actions.preferences);
  renderHints(progress.hints);
  renderTurns(page);
}

async function refresh(force) {
  try {
    const now = await api("/ui/api/now");
    state.now = now;
    state.poll = Math.max(500, 1000 * (now.poll_s || 2));
    renderNow(now);
    if (force || now.token !== state.token) {
      state.token = now.token;
      if (state.view === "dashboard") await loadDashboard();
      else if (state.session) await openConversation(state.session, false);
    }
    document.body.dataset.token = now.token;
  } catch (e) {
    if (e.message !== "signed out") setText("updated", "cannot reach the server: " + e.message);
  }
}

function route() {
  const m = /^#\/session\/(.+)$/.exec(window.location.hash);
  state.view = m ? "conversation" : "dashboard";
  state.session = m ? decodeURIComponent(m[1]) : null;
  $("dashboard").hidden = state.view !== "dashboard";
  $("conversation").hidden = state.view !== "conversation";
  refresh(true);
}

function schedule() {
  clearTimeout(state.timer);
  state.timer = setTimeout(async () => { if (!document.hidden) await refresh(false); schedule(); }, state.poll);
}

document.addEventListener("DOMContentLoaded", () => {
  $("pause").addEventListener("click", togglePause);
  $("user").addEventListener("change", () => { state.user = $("user").value; state.cursors = [null]; refresh(true); });
  $("older").addEventListener("click", () => { state.cursors.push(state.next); refresh(true); });
  $("newest").addEventListener("click", () => { state.cursors = [null]; refresh(true); });
  $("all-turns").addEventListener("change", () => { state.cursors = [null]; refresh(true); });
  $("conv-more").addEventListener("click", () => openConversation(state.session, true));
  window.addEventListener("hashchange", route);
  route();
  schedule();
});
