// The three pages: the fleet overview (#/), a job (#/jobs/NAME), a run (#/jobs/NAME/runs/ID).
// Each page builds its frame once (mount) and fills it from the API on every refresh (update),
// so a refresh never takes the focus from a filter or a button.
"use strict";

import { get, jobPath } from "./api.js";
import { WINDOWS, duration, el, present, relative, text, time, windowMs } from "./format.js";
import { badge, legend, runKinds, word } from "./shapes.js";
import { drawChart, runMark, slotMark } from "./timeline.js";

export const jobHref = (name) => `#/jobs/${encodeURIComponent(name)}`;
export const runHref = (name, runId) => `${jobHref(name)}/runs/${encodeURIComponent(runId)}`;

function panel(title, { tools = [], id = null, flush = false } = {}) {
  const body = el("div", { className: `panel-body${flush ? " flush" : ""}` });
  const heading = el("h2", {}, title);
  const section = el("section", { className: "panel" },
    el("div", { className: "panel-head" }, heading, el("div", { className: "tools" }, ...tools)), body);
  if (id) section.id = id;
  section.setAttribute("aria-label", typeof title === "string" ? title : heading.textContent);
  return { section, body, heading };
}

function table(headers, rows, { empty = "nothing yet", className = "" } = {}) {
  if (!rows.length) return el("p", { className: "empty" }, empty);
  return el("table", { className: `responsive ${className}` },
    el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", { scope: "col" }, h.replace(/^~/, ""))))),
    el("tbody", {}, ...rows));
}

// A row of cells; `labels` name them for the stacked layout of a phone. In a compact table a
// phone shows the cells side by side instead, each labelled only where `labels[i]` starts
// with "~" (a number whose meaning is not obvious, e.g. "~took").
function row(labels, cells, { href = null, dataset = {} } = {}) {
  const tr = el("tr", { dataset });
  cells.forEach((cell, i) => {
    const td = cell instanceof HTMLElement && cell.tagName === "TD" ? cell : el("td", {}, cell);
    const label = labels[i] ?? "";
    td.dataset.label = label.replace(/^~/, "");
    if (label.startsWith("~")) td.dataset.phoneLabel = label.slice(1);
    tr.append(td);
  });
  if (href) {
    tr.classList.add("link-row");
    tr.addEventListener("click", (event) => {
      if (!event.target.closest("a, button")) location.hash = href.slice(1);
    });
  }
  return tr;
}

// Who paused or disabled a job for the fleet, when, why, and until when a pause lasts.
function controlNote(job) {
  const control = job.control;
  const latest = control && (control.halted_by || control.latest);
  if (!latest) return "";
  const until = control.paused && control.until ? ` until ${time(Date.parse(control.until))}` : "";
  const note = latest.note ? ` ("${latest.note}")` : "";
  return `${until} by ${latest.actor} at ${time(Date.parse(latest.at))}${note}`;
}

// The slots a pending skip passes over, said in a line; null when none is pending.
function skipNote(job, app) {
  const skip = job.control && job.control.skip;
  if (!skip || !skip.left) return null;
  const slots = skip.left === 1 ? "its next slot" : `its next ${skip.left} slots`;
  return `Skips ${slots}, through ${time(skip.through_ms)}, on every instance.`;
}

function stateBadge(job, app) {
  const fleetWide = job.control !== null && job.control !== undefined;
  let label = job.state === "paused" && !fleetWide ? "paused here" : job.state;
  const blocked = app.about.backend_status && app.about.backend_status.reachable === false;
  if (blocked && ["armed", "running"].includes(job.state)) {
    label = `${job.state}, backend down`; // its slots are skipped until the backend answers
  }
  const node = blocked && ["armed", "running"].includes(job.state)
    ? badge("backend-error", label) : badge(job.state, label, { state: true });
  if (blocked) node.classList.add("blocked");
  node.title = {
    armed: "waiting for its next slot",
    running: "a run is going on this instance",
    paused: fleetWide ? `paused for the whole fleet${controlNote(job)}`
      : `paused on this instance (${app.about.instance_id}); other instances still run it`,
    idle: "the scheduler is not running, or the schedule has ended",
    disabled: job.control && job.control.disabled ? `disabled for the whole fleet${controlNote(job)}: no slot and no manual run`
      : "scheduling is switched off here or for this job: it runs on trigger only",
  }[job.state] || job.state;
  return node;
}

function outcomeBadge(record, label = null) {
  return badge(record.outcome, label);
}

// Whether the viewer may make ``action``: a signed-in viewer sees only the changes its
// credentials allow (a read-only token, none); one not signed in sees them all (a click asks
// for a token).
function mayChange(app, action) {
  return !app.session.via || (app.session.actions || []).includes(action.replace("-dialog", ""));
}

function actionButtons(job, app, { big = false } = {}) {
  const disabled = !app.session.changes_enabled;
  const why = disabled ? "changes are disabled: the server has no admin token (BROKERSCHED_ADMIN_TOKEN) and no authorize=" : "";
  const make = (action, label) => mayChange(app, action) && el("button", {
    type: "button", textContent: label, disabled, title: why || `${label} ${job.name}`,
    className: big && action === "trigger" ? "primary" : "",
    dataset: { action, job: job.name },
    "aria-label": `${label} ${job.name}`,
  });
  const toggle = job.state === "paused" ? make("resume", "Resume")
    : big ? make("pause-dialog", "Pause…") : make("pause", "Pause");
  const buttons = big ? [make("trigger", "Trigger"), toggle, make("skip-dialog", "Skip…")]
    : [make("trigger", "Trigger"), toggle];
  return buttons.filter(Boolean);
}

function windowControl(current, onPick) {
  const group = el("div", { className: "segmented", role: "group", "aria-label": "time window" });
  for (const [name] of WINDOWS) {
    const button = el("button", { type: "button", textContent: name, dataset: { window: name } });
    button.setAttribute("aria-pressed", String(name === current));
    button.addEventListener("click", () => onPick(name));
    group.append(button);
  }
  return group;
}

function when(ms, app, { zone = null } = {}) {
  return el("span", { className: "nowrap", title: time(ms, { zone: "UTC", millis: true }) },
    relative(ms, app.now()), el("span", { className: "sub" }, time(ms, { zone })));
}

function errorLine(message) {
  return message ? el("span", { className: "error-cell" }, message.length > 180 ? `${message.slice(0, 180)}…` : message) : text("");
}

function chartRowsForJob(timeline, app, jobName) {
  const here = timeline.here;
  const live = Object.values(app.live[jobName] || {});
  const recorded = new Set(timeline.runs.map((run) => run.run_id));
  const runs = [...timeline.runs, ...live.filter((run) => !recorded.has(run.run_id))];
  const lanes = [...new Set([...timeline.lanes, ...runs.map((run) => run.instance_id)])].sort();
  const slotRow = {
    label: "not run", marks: timeline.slots.map(slotMark),
  };
  const laneRows = lanes.map((lane) => ({
    label: lane === here ? `${lane} (here)` : lane,
    here: lane === here,
    marks: runs.filter((run) => run.instance_id === lane).map((run) => runMark(run, jobName)),
  }));
  return [slotRow, ...laneRows];
}

function livenessBadge(inst) {
  const kind = { alive: "completed", late: "late", dead: "interrupted", stopped: "idle" }[inst.liveness] || "idle";
  const node = badge(kind, inst.liveness);
  node.title = {
    alive: `published itself ${inst.age_ms} ms ago (every ${inst.heartbeat_ms} ms)`,
    late: "missed a heartbeat or more: overloaded, or on its way down",
    dead: "no heartbeat for 3 periods: killed, or cut off from the backend; its leases hold their slots until they expire",
    stopped: "stopped gracefully",
  }[inst.liveness];
  return node;
}

// -- the overview ------------------------------------------------------------------------------

export class OverviewPage {
  constructor(app, route) {
    this.app = app;
    this.window = route.params.get("window") || app.prefs.window;
  }

  crumbs() {
    return [["Fleet overview", null]];
  }

  mount(view) {
    this.cards = el("div", { className: "cards", id: "summary" });
    this.failures = panel("Failures in the last hour", { id: "failures" });
    this.jobs = panel("Jobs", { id: "jobs", flush: true });
    this.chart = panel("Timeline", {
      id: "fleet-timeline", flush: true,
      tools: [windowControl(this.window, (name) => this.app.go(`#/?window=${name}`, { window: name }))],
    });
    this.chartBox = el("div", { className: "timeline-box" });
    this.chart.body.append(this.chartBox,
      legend([...runKinds(this.app.vocabulary), ...this.app.vocabulary.slot_states, "next"]));
    this.instances = panel("Instances", { id: "instances", flush: true });
    this.next = panel("Next runs", { id: "next-runs", flush: true });
    view.replaceChildren(
      this.cards, this.failures.section, this.jobs.section, this.chart.section,
      el("div", { className: "grid" }, this.instances.section, this.next.section));
  }

  async update() {
    const data = this.keepKnown(await get("overview", { window: this.window }));
    this.app.learn(data);
    this.data = data;
    this.renderCards(data);
    this.renderFailures(data);
    this.renderJobs(data);
    this.renderChart();
    this.renderInstances(data);
    this.renderNext(data);
  }

  resize() {
    if (this.data) this.renderChart();
  }

  // A job whose history cannot be read now (the backend is unreachable) keeps what was last
  // read of it: its runs and its failures are the last known, as the banner says.
  keepKnown(data) {
    const before = this.known || {};
    this.known = {};
    data.jobs = data.jobs.map((job) => {
      const last = before[job.name];
      if (!job.history_error) {
        this.known[job.name] = job;
        return job;
      }
      if (!last) return job;
      this.known[job.name] = last;
      return { ...last, state: job.state, next_runs: job.next_runs, history_error: job.history_error };
    });
    // What could not be read is the last known ("stale"), or, when nothing was read yet,
    // "unknown": never a calm zero.
    const previous = this.data;
    if (data.failures.unread.length) {
      if (previous && !previous.failures.unknown) {
        data.failures = { ...previous.failures, stale: data.failures.error };
        data.instances = previous.instances;
      } else {
        data.failures = { ...data.failures, unknown: true };
      }
    }
    if (data.fleet && data.fleet.error) {
      data.fleet = previous && previous.fleet && !previous.fleet.unknown
        ? { ...previous.fleet, error: data.fleet.error }
        : { ...data.fleet, unknown: true };
    }
    return data;
  }

  // The jobs paused for the fleet (a job paused here only, on a backend without fleet records,
  // is resumed here): "resume all" resumes each of them.
  pausedJobs() {
    return this.data ? this.data.jobs.filter((job) => job.state === "paused").map((job) => job.name) : [];
  }

  renderCards(data) {
    const app = this.app;
    const states = data.jobs.reduce((acc, job) => ({ ...acc, [job.state]: (acc[job.state] || 0) + 1 }), {});
    const failures = data.failures;
    const latest = failures.runs[0];
    const next = data.next_runs[0];
    const card = (label, value, sub, cls = "") => el("div", { className: `card ${cls}` },
      el("div", { className: "label" }, label), el("div", { className: "value" }, value), el("div", { className: "sub" }, sub));
    const fleet = data.fleet && data.fleet.supported ? data.fleet : null;
    const seen = fleet ? fleet.instances.filter((inst) => inst.liveness === "alive").length : data.instances.length;
    const gone = fleet ? fleet.instances.filter((inst) => ["late", "dead"].includes(inst.liveness)) : [];
    const running = fleet ? ` · ${fleet.runs.length} run${fleet.runs.length === 1 ? "" : "s"} in progress` : "";
    const unread = (label, why) => {
      const node = card(label, "?", "the backend could not be read", "warn unknown");
      node.title = why;
      return node;
    };
    const instances = fleet && fleet.unknown
      ? unread("Instances alive", fleet.error)
      : card(fleet ? "Instances alive" : "Instances", String(seen),
        fleet ? `${fleet.error ? "last read: " : ""}${gone.length ? `${gone.map((inst) => `${inst.id} ${inst.liveness}`).join(" · ")}${running}` : `all alive${running}`}`
          : `${app.about.instance_id} serves this page${seen > 1 ? ` · ${seen - 1} more seen in runs` : ""}`,
        gone.some((inst) => inst.liveness === "dead") ? "bad" : fleet && fleet.error ? "warn" : "");
    let failed;
    if (failures.unknown) {
      failed = unread("Failures, last hour", failures.error);
      if (failures.count) failed.querySelector(".value").textContent = `≥ ${failures.count}`;
    } else {
      const sub = latest ? `latest: ${latest.job}, ${relative(Date.parse(latest.finished_at || latest.started_at), app.now())}` : "none";
      failed = card("Failures, last hour", `${failures.complete ? "" : "≥ "}${failures.count}`,
        failures.stale ? `last read (not refreshed) · ${sub}` : sub,
        failures.count ? "bad" : failures.stale ? "warn" : "good");
    }
    this.cards.replaceChildren(instances, this.jobsCard(data, states), failed,
      card("Next run", next ? relative(next.at_ms, app.now()) : "–", next ? `${next.job} · ${time(next.at_ms, { date: false })}` : "nothing armed"));
  }

  // Every job paused or disabled is a fleet that runs nothing: said, in the warning colour,
  // with the way out.
  jobsCard(data, states) {
    const app = this.app;
    const held = ["paused", "disabled"].filter((state) => states[state]);
    const stopped = data.jobs.length > 0 && held.reduce((n, state) => n + states[state], 0) === data.jobs.length;
    const counts = app.vocabulary.job_states.filter((s) => !["armed", "idle"].includes(s) && states[s]).map((s) => `${states[s]} ${s}`).join(" · ");
    const sub = stopped ? `every job is ${held.join(" or ")}: nothing runs · ${counts}` : counts || "all armed";
    const paused = this.pausedJobs();
    const resume = paused.length && mayChange(this.app, "resume") ? el("button", {
      type: "button", className: stopped ? "primary resume-all" : "resume-all",
      textContent: paused.length === 1 ? "Resume the paused job" : `Resume all ${paused.length} paused jobs`,
      disabled: !app.session.changes_enabled,
      title: app.session.changes_enabled ? `resume for the whole fleet: ${paused.join(", ")}` : "changes are disabled: the server has no admin token (BROKERSCHED_ADMIN_TOKEN) and no authorize=",
      dataset: { action: "resume-all", jobs: JSON.stringify(paused) },
    }) : null;
    return el("div", { className: `card${stopped ? " warn" : ""}`, id: "jobs-card" },
      el("div", { className: "label" }, "Jobs"), el("div", { className: "value" }, String(data.jobs.length)),
      el("div", { className: "sub" }, sub), resume);
  }

  renderFailures(data) {
    const { groups, count, complete, unknown, stale, error } = data.failures;
    this.failures.heading.replaceChildren("Failures in the last hour ",
      el("span", { className: "count" }, unknown && !count ? "(unknown)" : `(${complete ? "" : "at least "}${count})`));
    const why = unknown || stale
      ? el("p", { className: "note padded warn-text" }, unknown
        ? `The failures of the last hour are unknown: ${error}.`
        : `Not refreshed: ${stale}. These are the failures last read.`)
      : null;
    if (unknown && !groups.length) {
      this.failures.body.classList.remove("flush");
      this.failures.body.replaceChildren(why);
      return;
    }
    if (!groups.length) {
      this.failures.body.replaceChildren(el("p", { className: "empty" }, badge("completed", "No failed, timed-out or interrupted run in the last hour")));
      this.failures.body.classList.remove("flush");
      return;
    }
    this.failures.body.classList.add("flush");
    // Failures alike are one row (Sentry-like): the job, the error, how many, the latest run.
    const labels = ["latest", "job", "error", "~runs", "instances"];
    const shown = groups.slice(0, 8);
    const rows = shown.map((group) => {
      const latest = group.latest;
      const at = Date.parse(latest.finished_at || latest.started_at);
      return row(labels, [
        el("a", { href: runHref(group.job, latest.run_id), className: "run-link", "aria-label": `latest ${group.outcome} run of ${group.job}` },
          outcomeBadge(latest), el("span", { className: "sub" }, relative(at, this.app.now()))),
        el("a", { href: jobHref(group.job), className: "mono" }, group.job),
        errorLine(group.error || word(group.outcome)),
        el("a", { href: `${jobHref(group.job)}?outcome=${encodeURIComponent(group.outcome)}`, title: "all of them, in the job's history" },
          `${group.count}×`),
        el("span", { className: "mono" }, group.instances.join(", ")),
      ], { href: runHref(group.job, latest.run_id), dataset: { runId: latest.run_id, job: group.job } });
    });
    const more = groups.length > shown.length
      ? el("p", { className: "note padded" }, `and ${groups.length - shown.length} more kinds of failure: see each job's history.`)
      : null;
    this.failures.body.replaceChildren(...present([why, table(labels, rows, { className: "failures compact" }), more]));
  }

  renderJobs(data) {
    const app = this.app;
    const labels = ["job", "state", "~last run", "~next run", `~runs (${this.window})`, ""];
    const rows = data.jobs.map((job) => {
      const kinds = new Set([...runKinds(app.vocabulary), ...Object.keys(job.counts)]);
      const counts = [...kinds].filter((kind) => job.counts[kind])
        .map((kind) => badge(kind, String(job.counts[kind])));
      const last = job.last
        ? el("a", { href: runHref(job.name, job.last.run_id) }, outcomeBadge(job.last),
            el("span", { className: "sub" }, `${relative(Date.parse(job.last.started_at), app.now())} · ${job.last.instance_id}`))
        : job.history_error ? el("span", { className: "error-cell" }, job.history_error) : text("never ran");
      const next = job.next_runs.length && ["armed", "running"].includes(job.state)
        ? when(Date.parse(job.next_runs[0]), app) : text("–");
      return row(labels, [
        el("td", { className: "name" }, el("a", { href: jobHref(job.name), className: "mono job-link" }, job.name),
          el("span", { className: "sub" }, job.schedule)),
        stateBadge(job, app),
        last,
        next,
        el("span", { className: "counts" }, ...(counts.length ? counts : [text("none")])),
        el("span", { className: "actions" }, ...actionButtons(job, app)),
      ], { dataset: { job: job.name } });
    });
    this.jobs.body.replaceChildren(table(labels, rows, { className: "jobs compact", empty: "no job is registered" }));
  }

  renderChart() {
    const data = this.data;
    const span = windowMs(this.window);
    const now = this.app.now();
    const rows = data.jobs.map((job) => {
      const tl = job.timeline;
      const live = Object.values(this.app.live[job.name] || {});
      const recorded = new Set(tl.runs.map((run) => run.run_id));
      const marks = [
        ...tl.runs.map((run) => runMark(run, job.name, { withJob: true })),
        ...live.filter((run) => !recorded.has(run.run_id)).map((run) => runMark(run, job.name, { withJob: true })),
        ...tl.slots.map(slotMark),
        ...data.next_runs.filter((next) => next.job === job.name)
          .map((next) => ({ ms: next.at_ms, kind: "next", title: `${job.name}: next slot ${time(next.at_ms)}`, href: null })),
      ];
      return { label: job.name, href: jobHref(job.name), marks };
    });
    drawChart(this.chartBox, {
      from: now - span, to: now, now, rows,
      ariaLabel: `runs of every job over the last ${this.window}, one row per job`,
    });
  }

  async renderInstances(data) {
    const fleet = data.fleet;
    if (!fleet || !fleet.supported) return this.renderSeenInRuns(data);
    const app = this.app;
    const labels = ["instance", "liveness", "last seen", "runs now", "version"];
    const rows = fleet.instances.map((inst) => row(labels, [
      el("span", { className: "mono" }, inst.id,
        el("span", { className: "sub" }, `${inst.host} · pid ${inst.pid}${inst.here ? " · serves this page" : ""}`)),
      livenessBadge(inst),
      el("span", { title: time(Date.parse(inst.last_seen), { millis: true }), className: "relative" }, relative(Date.parse(inst.last_seen), app.now())),
      text(inst.running.length),
      el("span", { className: "mono" }, inst.version),
    ], { dataset: { instance: inst.id, liveness: inst.liveness } }));
    const runLabels = ["run", "job", "instance", "started", ""];
    const runs = fleet.runs.map((run) => row(runLabels, [
      el("span", { className: "mono" }, run.run_id, run.held ? el("span", { className: "sub" }, "its instance is dead: the lease holds the slot until it expires") : null),
      el("a", { href: jobHref(run.job), className: "mono" }, run.job),
      el("span", { className: "mono" }, run.instance_id, el("span", { className: "sub" }, run.liveness)),
      el("span", { title: run.started_at, className: "relative" }, relative(Date.parse(run.started_at), app.now())),
      run.liveness === "dead" ? text("") : el("button", {
        type: "button", textContent: "Abort", disabled: !app.session.changes_enabled,
        dataset: { action: "abort", job: run.job, runId: run.run_id },
        "aria-label": `abort run ${run.run_id} of ${run.job}`,
      }),
    ], { dataset: { runId: run.run_id } }));
    this.instances.body.replaceChildren(
      table(labels, rows, { empty: fleet.unknown ? "unknown: the fleet's presence could not be read" : "no instance has published itself yet" }),
      el("h3", { className: "subhead padded" }, "Runs in progress, anywhere"),
      table(runLabels, runs, { empty: fleet.unknown ? "unknown" : "none" }),
      el("p", { className: "note padded" },
        `Every instance publishes itself through the backend each heartbeat: late after 1.5 heartbeats without one, dead after 3.${fleet.error ? ` Not read now: ${fleet.error}.` : ""}`));
  }

  renderSeenInRuns(data) {
    const labels = ["instance", "seen", `runs (${this.window})`, `failures (${this.window})`];
    const rows = data.instances.map((inst) => row(labels, [
      el("span", { className: "mono" }, inst.instance_id, inst.here ? el("span", { className: "sub" }, "serves this page") : null),
      inst.here ? badge("armed", this.app.about.running ? "here, running" : "here, stopped", { state: true })
        : el("span", {}, relative(inst.last_run_ms, this.app.now()), el("span", { className: "sub" }, "last run recorded")),
      text(inst.runs),
      inst.failures ? badge("failed", String(inst.failures)) : text("0"),
    ], { dataset: { instance: inst.instance_id } }));
    this.instances.body.replaceChildren(table(labels, rows),
      el("p", { className: "note padded" },
        "Instances seen in the recorded runs (the history of every job): this backend keeps no presence of the fleet."));
  }

  renderNext(data) {
    if (!data.next_runs.length) {
      this.next.body.replaceChildren(el("p", { className: "empty" }, "No job is armed."));
      return;
    }
    const items = data.next_runs.slice(0, 12).map((next) => el("li", {},
      el("span", { className: "when" }, relative(next.at_ms, this.app.now())),
      el("a", { href: jobHref(next.job), className: "mono" }, next.job),
      el("span", { className: "at mono" }, time(next.at_ms, { date: false }))));
    this.next.body.replaceChildren(el("ol", { className: "next-list" }, ...items));
  }
}

// -- a job ---------------------------------------------------------------------------------------

export class JobPage {
  constructor(app, route) {
    this.app = app;
    this.name = route.name;
    this.params = route.params;
    this.window = route.params.get("window") || app.prefs.window;
  }

  crumbs() {
    return [["Fleet overview", "#/"], [this.name, null]];
  }

  link(changes) {
    const params = new URLSearchParams(this.params);
    for (const [key, value] of Object.entries(changes)) {
      if (value === null || value === "") params.delete(key);
      else params.set(key, value);
    }
    const query = params.toString();
    return `${jobHref(this.name)}${query ? `?${query}` : ""}`;
  }

  mount(view) {
    this.title = el("h1", {}, this.name);
    this.state = el("span");
    this.actions = el("div", { className: "actions" });
    this.schedule = panel("Schedule", { id: "schedule" });
    this.options = panel("Options and last run", { id: "options" });
    this.chart = panel("Timeline: one lane per instance", {
      id: "job-timeline", flush: true,
      tools: [windowControl(this.window, (name) => this.app.go(this.link({ window: name }), { window: name }))],
    });
    this.chartBox = el("div", { className: "timeline-box" });
    this.chartNote = el("p", { className: "note padded" });
    this.chart.body.append(this.chartBox, this.chartNote, legend([...runKinds(this.app.vocabulary), ...this.app.vocabulary.slot_states, "next"]));
    this.history = panel("History", { id: "history", flush: true, tools: [this.filters()] });
    this.historyBody = el("div");
    this.pager = el("div", { className: "pager" });
    this.history.body.append(this.historyBody, this.pager);
    view.replaceChildren(
      el("div", { className: "page-head" }, this.title, this.state, this.actions),
      el("div", { className: "grid" }, this.schedule.section, this.options.section),
      el("div", { className: "stack" }, el("div"), this.chart.section, this.history.section));
  }

  filters() {
    const select = (name, label, choices) => {
      const id = `filter-${name}`;
      const node = el("select", { id, name, dataset: { filter: name } },
        el("option", { value: "" }, "any"),
        ...choices.map(([value, shown]) => el("option", { value }, shown)));
      node.value = this.params.get(name) || "";
      if (node.value !== (this.params.get(name) || "")) { // an instance not listed yet
        node.append(el("option", { value: this.params.get(name) }, this.params.get(name)));
        node.value = this.params.get(name);
      }
      node.addEventListener("change", () => this.app.go(this.link({ [name]: node.value, before: null, page: null })));
      return el("label", { for: id }, label, node);
    };
    this.instanceSelect = select("instance", "instance", []);
    const words = this.app.vocabulary;
    return el("div", { className: "filters", role: "group", "aria-label": "filter the history" },
      select("outcome", "outcome", [[words.failures.join(","), "any failure"],
        ...words.outcomes.map((o) => [o, word(o)])]),
      select("reason", "reason", words.run_reasons.map((r) => [r, r])),
      this.instanceSelect);
  }

  async update() {
    const app = this.app;
    const query = {
      limit: 25,
      outcome: this.params.get("outcome"),
      reason: this.params.get("reason"),
      instance: this.params.get("instance"),
      before: this.params.get("before"),
    };
    let [job, , timeline, history] = await Promise.all([
      get(jobPath(this.name)),
      app.refreshAbout(),
      get(jobPath(this.name, "/timeline"), { window: this.window }).catch((error) => ({ error })),
      get(jobPath(this.name, "/history"), query).catch((error) => ({ error })),
    ]);
    this.job = job;
    if (timeline.error && this.timeline && !this.timeline.error) {
      this.timeline = { ...this.timeline, stale: timeline.error.message };
    } else {
      this.timeline = timeline;
    }
    if (history.error && this.history && !this.history.error) {
      this.renderStale(history.error.message);
      history = null;
    } else if (!history.error) {
      this.history = history;
    }
    this.state.replaceChildren(stateBadge(job, app));
    this.actions.replaceChildren(...actionButtons(job, app, { big: true }));
    this.renderSchedule(job);
    this.renderOptions(job);
    this.renderChart();
    if (history) this.renderHistory(history);
  }

  // The values the server accepts (a later release may add a reason): each in its select.
  offerChoices(choices) {
    if (!choices) return;
    for (const [name, values] of Object.entries(choices)) {
      const select = document.getElementById(`filter-${name}`);
      if (!select) continue;
      const have = new Set([...select.options].map((option) => option.value));
      for (const value of values) {
        if (!have.has(value)) select.append(el("option", { value }, word(value)));
      }
    }
  }

  renderStale(message) {
    const note = this.historyBody.querySelector(".stale-note") || el("p", { className: "note padded stale-note" });
    note.textContent = `Not refreshed: ${message}. These are the last runs read.`;
    this.historyBody.prepend(note);
  }

  resize() {
    if (this.timeline) this.renderChart();
  }

  renderSchedule(job) {
    const zone = job.zone;
    const headers = zone === "UTC" ? ["~#", "UTC", "when"] : ["~#", zone, "UTC", "when"];
    const rows = job.next_runs.slice(0, 6).map((iso, i) => {
      const ms = Date.parse(iso);
      const cells = [text(i + 1)];
      if (zone !== "UTC") cells.push(el("span", { className: "mono" }, time(ms, { zone })));
      cells.push(el("span", { className: "mono" }, time(ms, { zone: "UTC" })), text(relative(ms, this.app.now())));
      return row(headers, cells);
    });
    const fleetWide = job.control !== null && job.control !== undefined;
    const paused = job.state === "paused"
      ? el("p", { className: "note" }, badge("paused", fleetWide
        ? `Paused for the whole fleet${controlNote(job)}: no instance runs its slots${job.control.until ? " before then" : ""}.`
        : `Paused on ${this.app.about.instance_id}: its slots are not armed here; other instances still run them.`, { state: true }))
      : null;
    const skips = skipNote(job, this.app);
    const skipping = skips ? el("p", { className: "note" }, badge("paused", skips, { state: true })) : null;
    this.schedule.body.replaceChildren(...present([
      el("dl", { className: "facts" },
        el("dt", {}, "trigger"), el("dd", { className: "mono" }, job.schedule),
        el("dt", {}, "kind"), el("dd", {}, job.kind),
        el("dt", {}, "time zone"), el("dd", {}, zone, zone !== "UTC" ? el("span", { className: "muted" }, " (and UTC below)") : null)),
      paused,
      skipping,
      el("h3", { className: "subhead" }, "Next slots"),
      table(headers, rows, { className: "compact", empty: !["armed", "running"].includes(job.state) ? `none: the job is ${job.state} here` : "it will not fire again" })]));
  }

  renderOptions(job) {
    const facts = el("dl", { className: "facts pairs" });
    for (const [key, value] of Object.entries(job.options)) {
      if (value === null) continue;
      facts.append(el("div", {}, el("dt", {}, key), el("dd", { className: "mono" }, String(value))));
    }
    const last = job.last
      ? el("p", {}, "Last run: ", el("a", { href: runHref(job.name, job.last.run_id) }, outcomeBadge(job.last)),
        ` ${relative(Date.parse(job.last.started_at), this.app.now())} on `, el("span", { className: "mono" }, job.last.instance_id))
      : el("p", { className: "muted" }, job.history_error || "It has not run yet.");
    this.options.body.replaceChildren(last, facts);
  }

  renderChart() {
    const tl = this.timeline;
    if (!tl || tl.error) {
      this.chartBox.replaceChildren(el("p", { className: "empty error-text" }, tl ? tl.error.message : "…"));
      return;
    }
    const now = this.app.now();
    const span = windowMs(this.window);
    const rows = chartRowsForJob(tl, this.app, this.name);
    const next = (this.job?.next_runs || []).map((iso) => Date.parse(iso))
      .filter((ms) => ms <= now + span * 0.06)
      .map((ms) => ({ ms, kind: "next", title: `next slot ${time(ms)}`, href: null }));
    rows[0].marks.push(...next);
    drawChart(this.chartBox, {
      from: now - span, to: now, now, rows, knownFrom: tl.known_from_ms,
      ariaLabel: `runs of ${this.name} over the last ${this.window}: one lane per instance, and the slots no instance ran`,
    });
    const counts = {};
    for (const mark of rows.flatMap((r) => r.marks)) counts[mark.kind] = (counts[mark.kind] || 0) + 1;
    const parts = Object.entries(counts).filter(([kind]) => kind !== "next")
      .map(([kind, n]) => `${n} ${word(kind)}`);
    const stale = tl.stale ? `Not refreshed: ${tl.stale}. ` : "";
    this.chartNote.textContent = `${stale}${parts.length ? `${parts.join(" · ")}.` : "Nothing in this window."} A slot is drawn on the lane of the instance that ran it; "not run" holds the slots of the schedule no instance ran, and why.`;
    const lanes = [...new Set([...tl.lanes])];
    const select = this.instanceSelect.querySelector("select");
    const have = new Set([...select.options].map((o) => o.value));
    for (const lane of lanes) if (!have.has(lane)) select.append(el("option", { value: lane }, lane));
  }

  renderHistory(history) {
    if (history.error) {
      this.historyBody.replaceChildren(el("p", { className: "empty error-text" }, history.error.message));
      this.pager.replaceChildren();
      return;
    }
    this.offerChoices(history.choices);
    const labels = ["outcome", "slot", "instance", "reason", "~late", "~took", "error"];
    const rows = history.records.map((r) => row(labels, [
      el("a", { href: runHref(this.name, r.run_id), "aria-label": `run ${r.run_id}: ${r.outcome}` }, outcomeBadge(r)),
      el("span", { className: "mono nowrap" }, time(r.slot_ms)),
      el("span", { className: "mono" }, r.instance_id),
      text(r.attempt > 1 ? `${r.reason} #${r.attempt}` : r.reason),
      el("span", { className: "num" }, duration(r.late_ms)),
      el("span", { className: "num" }, duration(r.duration_ms)),
      errorLine(r.error),
    ], { href: runHref(this.name, r.run_id), dataset: { runId: r.run_id, outcome: r.outcome } }));
    const filtered = ["outcome", "reason", "instance"].some((key) => this.params.get(key));
    this.historyBody.replaceChildren(table(labels, rows, {
      className: "history compact", empty: filtered ? "No run matches these filters." : "No run recorded yet.",
    }));
    const page = Number(this.params.get("page") || 1);
    const first = (page - 1) * 25 + 1;
    const shown = history.records.length;
    const summary = shown
      ? `runs ${first}–${first + shown - 1}${history.matched !== undefined ? ` of ${history.matched}${filtered ? " matching" : ""}` : ""}`
      : "";
    const newest = el("a", { href: this.link({ before: null, page: null }), className: "pager-newest" }, "« Newest");
    const older = history.next
      ? el("a", { href: this.link({ before: history.next, page: String(page + 1) }), className: "pager-older", rel: "next" }, "Older »")
      : el("span", { className: "muted" }, "no older runs kept");
    this.pager.replaceChildren(...present([page > 1 ? newest : null, el("span", { className: "muted" }, summary), el("div", { className: "tools" }, older)]));
  }
}

// -- a run ---------------------------------------------------------------------------------------

export class RunPage {
  constructor(app, route) {
    this.app = app;
    this.name = route.name;
    this.runId = route.runId;
  }

  crumbs() {
    return [["Fleet overview", "#/"], [this.name, jobHref(this.name)], [`run ${this.runId}`, null]];
  }

  mount(view) {
    this.view = view;
    view.replaceChildren(el("p", { className: "muted" }, "Loading the run…"));
  }

  async update() {
    const [data] = await Promise.all([
      get(jobPath(this.name, `/runs/${encodeURIComponent(this.runId)}`)),
      this.app.refreshAbout(),
    ]);
    const { run, job, attempts } = data;
    const app = this.app;
    const here = run.instance_id === app.about.instance_id;
    const slotMs = run.slot_ms;
    const zone = job.zone;
    const nav = el("div", { className: "actions" },
      data.newer ? el("a", { href: runHref(this.name, data.newer), rel: "prev" }, "‹ Newer run") : null,
      data.older ? el("a", { href: runHref(this.name, data.older), rel: "next" }, "Older run ›") : null);
    const facts = el("dl", { className: "facts pairs" });
    const fact = (label, ...value) => facts.append(el("div", {}, el("dt", {}, label), el("dd", {}, ...value)));
    fact("job", el("a", { href: jobHref(this.name), className: "mono" }, this.name), el("span", { className: "muted" }, ` · ${job.schedule}`));
    fact("slot", el("span", { className: "mono" }, time(slotMs, { zone, millis: true })),
      zone !== "UTC" ? el("span", { className: "sub mono" }, time(slotMs, { zone: "UTC", millis: true })) : null);
    fact("ran on", el("span", { className: "mono" }, run.instance_id), here ? el("span", { className: "muted" }, " (this instance)") : null);
    fact("reason", text(run.reason));
    const then = data.next_attempt; // what follows a failed run: a retry, a take-over, or nothing
    fact("attempt", text(then ? `${run.attempt}; ${then.summary}` : String(run.attempt)),
      then ? el("span", { className: "sub" }, then.detail) : null);
    fact("started", el("span", { className: "mono" }, time(Date.parse(run.started_at), { millis: true })));
    fact("finished", el("span", { className: "mono" }, run.finished_at ? time(Date.parse(run.finished_at), { millis: true }) : "–"));
    fact("took", text(duration(run.duration_ms)));
    fact("lateness", text(`${duration(run.late_ms)} after its slot`),
      el("span", { className: "sub" }, `jitter up to ${job.options.jitter}; a slot later than max_late (${job.options.max_late}) is skipped`));
    fact("run id", el("span", { className: "mono" }, run.run_id));

    const summary = panel("Run", { id: "run" });
    summary.body.append(...present([run.error ? el("p", { className: "error-line", id: "run-error" }, run.error) : null, facts]));

    const trace = panel("Traceback", { id: "traceback", flush: true });
    if (run.traceback) {
      trace.body.append(el("pre", { className: "traceback", tabIndex: 0, "aria-label": "traceback" }, run.traceback));
    } else {
      const NO_TRACEBACK = {
        interrupted: "An interrupted run has no traceback: its runner stopped or died (see attempts).",
        missed: "A missed slot has no traceback: no instance ran it (the error says why it was not run here).",
      };
      const why = app.vocabulary.failures.includes(run.outcome)
        ? (NO_TRACEBACK[run.outcome] || "No traceback was recorded for this run (a record written by an earlier release, or by an instance that cut it).")
        : "The run did not fail: there is no traceback.";
      trace.body.append(el("p", { className: "empty" }, why));
    }

    const returned = panel("Result", { id: "result", flush: true });
    if (run.result !== null && run.result !== undefined) {
      // As recorded: a JSON value (a result over 4 KiB is a {"$cut": ...} marker with its start).
      returned.body.append(el("pre", { className: "result", tabIndex: 0, "aria-label": "result" }, JSON.stringify(run.result, null, 2)));
    } else {
      const why = run.outcome === "completed"
        ? "No result was recorded: the handler returned nothing (or a value that is not JSON), results are off (record_results=False), or an earlier release wrote this record."
        : "The run did not return: there is no result.";
      returned.body.append(el("p", { className: "empty" }, why));
    }

    const labels = ["~attempt", "outcome", "instance", "started", "~took", ""];
    const rows = attempts.map((a) => row(labels, [
      text(a.attempt),
      outcomeBadge(a),
      el("span", { className: "mono" }, a.instance_id),
      el("span", { className: "mono nowrap" }, time(Date.parse(a.started_at))),
      text(duration(a.duration_ms)),
      a.run_id === run.run_id ? el("span", { className: "muted" }, "this run") : el("a", { href: runHref(this.name, a.run_id) }, "open"),
    ], { dataset: { runId: a.run_id } }));
    const tries = panel(`Attempts at this slot (${attempts.length})`, { id: "attempts", flush: true });
    tries.body.append(table(labels, rows, { className: "compact" }));

    this.view.replaceChildren(
      el("div", { className: "page-head" }, el("h1", {}, `Run ${run.run_id}`), badge(run.outcome, null, { big: true }), nav),
      el("div", { className: "stack" }, summary.section, returned.section, trace.section, tries.section));
  }

  resize() {}
}
