// The brokersched dashboard: the jobs table, a timeline of recent slots per job (one lane per
// instance), live updates from the event stream, and the trigger/pause/resume buttons.
// Plain JavaScript, no build step. Every text from the server goes through textContent.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const LANE = 22, LEFT = 170, RIGHT = 12, TOP = 16;
const state = { jobs: [], history: {}, skips: {}, live: {}, instance: "", changes: false };

const $ = (selector) => document.querySelector(selector);
const path = (name, suffix = "") => `jobs/${encodeURIComponent(name)}${suffix}`;
const time = (iso) => new Date(iso).toISOString().replace("T", " ").replace(".000Z", "Z");

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  node.append(...children);
  return node;
}

function svg(tag, attrs = {}, title = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (title !== null) {
    const tip = document.createElementNS(SVG, "title");
    tip.textContent = title;
    node.append(tip);
  }
  return node;
}

function say(message, error = false) {
  const status = $("#status");
  status.textContent = message;
  status.className = error ? "error" : "";
}

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

// -- the jobs table -----------------------------------------------------------------------

async function loadJobs() {
  const body = await getJSON("jobs");
  state.jobs = body.jobs;
  state.instance = body.instance_id;
  state.changes = body.changes_enabled;
  $("#instance").textContent = `instance ${body.instance_id}`;
  $("#backend").textContent = body.backend;
  renderJobs();
}

function options(job) {
  return Object.entries(job.options)
    .filter(([, value]) => value !== null)
    .map(([key, value]) => `${key}=${value}`)
    .join("\n");
}

function lastRun(job) {
  if (job.history_error) return el("span", { className: "outcome-failed", textContent: job.history_error });
  if (!job.last) return "–";
  const last = job.last;
  return el("span", {
    className: `outcome-${last.outcome}`,
    textContent: `${last.outcome} · ${time(last.slot)} · ${last.instance_id}`,
    title: last.error || `${last.reason}, ${last.late_ms} ms late`,
  });
}

function actions(job) {
  const why = state.changes ? "" : "changes are disabled: no admin token is configured on the server";
  const button = (action) => {
    const node = el("button", { type: "button", textContent: action, disabled: !state.changes,
                                title: why, onclick: () => change(job.name, action) });
    node.dataset.action = action;
    return node;
  };
  return [button("trigger"), button(job.state === "paused" ? "resume" : "pause")];
}

function renderJobs() {
  const rows = state.jobs.map((job) => {
    const row = el("tr", {},
      el("td", { className: "name", textContent: job.name }),
      el("td", { textContent: job.kind }),
      el("td", { textContent: job.schedule }),
      el("td", { textContent: job.zone }),
      el("td", { className: "options", textContent: options(job) }),
      el("td", { className: `state state-${job.state}`, textContent: job.state }),
      el("td", { className: "next", textContent: job.next_runs.slice(0, 3).map(time).join("\n") || "–" }),
      el("td", { className: "last" }, lastRun(job)),
      el("td", {}, ...actions(job)));
    row.dataset.job = job.name;
    return row;
  });
  $("#jobs tbody").replaceChildren(...rows);
}

// -- changes --------------------------------------------------------------------------------

function token() {
  return sessionStorage.getItem("brokersched-token") || "";
}

async function change(name, action) {
  if (!token()) return say("enter the admin token first (top right)", true);
  const response = await fetch(path(name, `/${action}`), {
    method: "POST",
    headers: { Authorization: `Bearer ${token()}` },
  });
  const body = await response.json();
  if (!response.ok) return say(`${action} ${name}: ${body.error}`, true);
  say(action === "trigger" ? `${name}: triggered; ${body.detail}` : `${name}: ${body.state} (${body.scope})`);
  refresh(name);
}

// -- the timelines --------------------------------------------------------------------------

async function loadHistory(name) {
  try {
    state.history[name] = await getJSON(path(name, "/history?limit=100"));
  } catch (error) {
    state.history[name] = { records: [], slots: [], now_ms: Date.now(), error: error.message };
  }
}

function marksOf(name) {
  const history = state.history[name] || { records: [], slots: [], now_ms: Date.now() };
  const recorded = new Set(history.records.map((r) => r.run_id));
  // runs started here and not recorded yet: shown as running
  const running = Object.values(state.live[name] || {}).filter((r) => !recorded.has(r.run_id));
  return { history, runs: [...history.records, ...running], skips: state.skips[name] || [] };
}

function renderTimeline(name) {
  const { history, runs, skips } = marksOf(name);
  const box = el("div", { className: "timeline" }, el("h3", { textContent: name }));
  box.dataset.job = name;
  if (history.error) box.append(el("p", { className: "empty", textContent: history.error }));
  const times = [...runs.map((r) => r.slot_ms), ...history.slots, ...skips.map((s) => s.slot_ms)];
  if (!times.length) {
    box.append(el("p", { className: "empty", textContent: "no runs recorded yet" }));
    return box;
  }
  const lanes = [...new Set([state.instance, ...runs.map((r) => r.instance_id)])].sort();
  const start = Math.min(...times), end = Math.max(history.now_ms, Date.now(), ...times);
  const span = Math.max(end - start, 1000);
  const width = 900, height = TOP + LANE * (lanes.length + 1) + 6;
  const x = (ms) => LEFT + ((ms - start) / span) * (width - LEFT - RIGHT);
  const y = (lane) => TOP + LANE * lane + LANE / 2;
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, "data-job": name });

  // lane 0: the schedule (missed slots); then one lane per instance
  ["schedule", ...lanes].forEach((label, lane) => {
    chart.append(svg("line", { x1: LEFT, x2: width - RIGHT, y1: y(lane), y2: y(lane), class: "lane-line" }));
    const text = svg("text", { x: 4, y: y(lane) + 4 });
    text.textContent = label === state.instance ? `${label} (here)` : label;
    chart.append(text);
  });
  const bySlot = new Map();
  for (const run of runs) {
    if (run.reason === "manual" || run.reason === "start") continue;  // not slots of the schedule
    bySlot.set(run.slot_ms, (bySlot.get(run.slot_ms) || 0) + 1);
  }
  for (const [slot, count] of bySlot) {
    if (count > 1) chart.append(svg("rect", { x: x(slot) - 6, y: TOP, width: 12, height: height - TOP, class: "double" },
                                    `slot ${time(new Date(slot).toISOString())} ran ${count} times`));
  }
  for (const slot of history.slots) {
    if (bySlot.has(slot)) continue;
    chart.append(svg("rect", { x: x(slot) - 5, y: y(0) - 5, width: 10, height: 10, class: "mark missed" },
                     `slot ${time(new Date(slot).toISOString())}: missed, no instance ran it`));
  }
  for (const skip of skips) {
    const cx = x(skip.slot_ms), cy = y(lanes.indexOf(state.instance) + 1);
    chart.append(svg("path", { d: `M${cx - 5},${cy + 5} L${cx + 5},${cy + 5} L${cx},${cy - 5} Z`, class: "mark skip" },
                     `slot ${time(new Date(skip.slot_ms).toISOString())}: skipped here (${skip.reason})`));
  }
  for (const run of runs) {
    const outcome = run.outcome || "running";
    const late = run.late_ms === undefined ? "" : `, ${run.late_ms} ms late`;
    const tip = `slot ${time(run.slot)} on ${run.instance_id}: ${outcome} (${run.reason}${late})` +
      (run.error ? `\n${run.error}` : "");
    const mark = svg("circle", { cx: x(run.slot_ms), cy: y(lanes.indexOf(run.instance_id) + 1), r: 6,
                                 class: `mark run ${outcome}` }, tip);
    mark.dataset.outcome = outcome;
    mark.dataset.runId = run.run_id;
    mark.dataset.lateMs = run.late_ms ?? "";
    chart.append(mark);
  }
  box.append(chart);
  return box;
}

function renderTimelines() {
  $("#timelines").replaceChildren(...state.jobs.map((job) => renderTimeline(job.name)));
}

// -- live updates ---------------------------------------------------------------------------

const pending = new Set();
let timer = null;

function refresh(name = null) {
  if (name !== null) pending.add(name);
  clearTimeout(timer);
  timer = setTimeout(async () => {
    const names = pending.size ? [...pending] : state.jobs.map((job) => job.name);
    pending.clear();
    try {
      await loadJobs();
      await Promise.all(names.map(loadHistory));
      renderTimelines();
    } catch (error) {
      say(`cannot reach the scheduler: ${error.message}`, true);
    }
  }, 250);
}

function onEvent(kind, message) {
  const event = JSON.parse(message.data);
  const name = event.job;
  if (kind === "start") {
    const live = (state.live[name] ||= {});
    live[event.run_id] = { ...event, slot: new Date(event.slot_ms).toISOString() };
  } else if (kind === "skip") {
    const skips = (state.skips[name] ||= []);
    skips.push(event);
    skips.splice(0, skips.length - 50);
  } else if (state.live[name]) {
    delete state.live[name][event.run_id];
  }
  renderTimelines();
  refresh(name);
}

function connect() {
  const source = new EventSource("events");
  source.onopen = () => {
    $("#live").textContent = "live";
    $("#live").className = "live-on";
    refresh();
  };
  source.onerror = () => {
    $("#live").textContent = "reconnecting…";
    $("#live").className = "live-off";
  };
  for (const kind of ["start", "complete", "fail", "skip"]) {
    source.addEventListener(kind, (message) => onEvent(kind, message));
  }
}

document.addEventListener("DOMContentLoaded", async () => {
  $("#token").value = token();
  $("#token-form").addEventListener("submit", (submit) => {
    submit.preventDefault();
    sessionStorage.setItem("brokersched-token", $("#token").value.trim());
    say("token set for this tab");
  });
  try {
    await loadJobs();
    await Promise.all(state.jobs.map((job) => loadHistory(job.name)));
    renderTimelines();
  } catch (error) {
    say(`cannot reach the scheduler: ${error.message}`, true);
  }
  connect();
  setInterval(refresh, 10000); // next runs move on, other instances' runs arrive
});
