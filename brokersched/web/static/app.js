// The brokersched dashboard: hash routes that survive a reload (#/, #/jobs/NAME,
// #/jobs/NAME/runs/ID, with the window and filters in the query), live updates from the event
// stream, the state of the backend and of the event stream in the top bar, and sign-in for
// changes (the admin token kept in this tab, or the host application's own session).
// Plain JavaScript modules, no build step, nothing loaded from elsewhere.
"use strict";

import { ApiError, abortRun, change, get, session, setToken, token } from "./api.js";
import { WINDOWS, el, relative, setZoneMode, time, zoneMode } from "./format.js";
import { JobPage, OverviewPage, RunPage } from "./pages.js";

const $ = (selector) => document.querySelector(selector);
const REFRESH_MS = 10000; // other instances' runs arrive through the backend only
const LIVE_DEBOUNCE_MS = 1500; // a busy fleet's events redraw the page at most this often

export const app = {
  about: { instance_id: "", running: true, backend_status: { reachable: null } },
  session: { changes_enabled: false, token_accepted: false, authorized: false, via: null },
  // The words of the API (GET /vocabulary): outcomes, reasons, states, events... The page has
  // no list of its own; until they are read, it knows none.
  vocabulary: null,
  live: {}, // job -> run_id -> a run going on here (from "start" events)
  prefs: { window: localStorage.getItem("brokersched-window") || "1h" },
  page: null,
  serverNow: null, // [the server clock's now_ms, Date.now() when it was read]
  streaming: false,

  now() {
    if (!this.serverNow) return Date.now();
    return this.serverNow[0] + (Date.now() - this.serverNow[1]);
  },

  learn(about) {
    if (about) {
      this.about = { ...this.about, ...about };
      if (about.now_ms) this.serverNow = [about.now_ms, Date.now()];
    }
    renderHeader();
  },

  // The backend's and the scheduler's state, for pages whose own answers do not carry it.
  async refreshAbout() {
    let health;
    try {
      health = await get("health");
    } catch (error) {
      if (!(error instanceof ApiError) || !error.body || !error.body.status) throw error;
      health = error.body;
    }
    this.learn({
      running: health.status !== "stopped",
      backend_status: health.backend || this.about.backend_status,
      now_ms: health.now_ms,
    });
  },

  go(hash, prefs = null) {
    if (prefs && prefs.window) {
      this.prefs.window = prefs.window;
      localStorage.setItem("brokersched-window", prefs.window);
    }
    if (location.hash === hash) route();
    else location.hash = hash;
  },
};

// -- status: the top bar, the banner, the status line -------------------------------------------

function say(message, error = false) {
  const status = $("#status");
  status.textContent = message;
  status.className = `status-line${error ? " error" : ""}`;
}

function pill(node, text, kind, title = null) {
  node.textContent = text;
  node.className = `pill pill-${kind}`;
  if (title) node.title = title;
}

let unreachable = null; // why the server itself cannot be reached

function renderHeader() {
  const backend = app.about.backend_status || {};
  const live = $("#live");
  if (unreachable) pill(live, "server unreachable", "bad", unreachable);
  else if (app.streaming) pill(live, "live", "ok", "following this instance's event stream");
  else if (app.polling) pill(live, "polling", "ok", "reads need a token here, which a browser's event stream cannot send: this page reads again every few seconds");
  else pill(live, "reconnecting…", "warn", "the event stream is reconnecting");
  const name = app.about.backend ? app.about.backend.split("(")[0] : "backend";
  if (backend.reachable === false) pill($("#backend"), `${name} unreachable`, "bad", backend.error || "");
  else if (backend.reachable === true) pill($("#backend"), `${name} ok`, "ok", app.about.backend || "");
  else pill($("#backend"), `${name} …`, "muted", "not read yet");
  const banner = $("#banner");
  if (unreachable) {
    banner.replaceChildren(el("strong", {}, "This page cannot reach the scheduler's server. "),
      `${unreachable}. What you see is from ${relative(lastOk, Date.now())}; retrying.`);
    banner.hidden = false;
  } else if (backend.reachable === false) {
    const since = backend.since_ms ? ` since ${time(backend.since_ms, { date: false })} (${relative(backend.since_ms, app.now())})` : "";
    banner.replaceChildren(el("strong", {}, `The backend is unreachable${since}. `),
      `No slot runs while it is (a claim that cannot be made is skipped, never run unclaimed); runs and history below are the last known. `,
      backend.error ? el("code", {}, backend.error) : null);
    banner.hidden = false;
  } else {
    banner.hidden = true;
  }
  if (!app.about.running && app.about.instance_id && !unreachable) {
    banner.replaceChildren(el("strong", {}, "The scheduler of this instance is not running: "), "no slot is armed here.");
    banner.hidden = false;
  }
  $("#zone").textContent = zoneMode() === "local" ? "local time" : "UTC";
  const button = $("#signin-button");
  const s = app.session;
  button.classList.toggle("signed-in", s.authorized || s.via === "read-token");
  if (s.via === "read-token") {
    button.textContent = "signed in (read-only) · sign out";
    button.title = "this token may read, not change: sign in with the admin token to change jobs";
    button.disabled = false;
  } else if (s.authorized) {
    button.textContent = s.via === "host" ? "signed in (session)" : "signed in · sign out";
    button.disabled = s.via === "host";
  } else if (s.reads_protected && !s.can_read) {
    button.textContent = "Sign in to view";
    button.disabled = !s.token_accepted;
  } else if (!s.changes_enabled) {
    button.textContent = "read-only";
    button.title = "changes are disabled: the server has no admin token (BROKERSCHED_ADMIN_TOKEN) and no authorize=";
    button.disabled = true;
  } else if (!s.token_accepted) {
    button.textContent = "read-only";
    button.title = "changes need a session of the application this dashboard is part of: sign in there";
    button.disabled = true;
  } else {
    button.textContent = "Sign in";
    button.disabled = false;
  }
  $("#about").textContent = app.about.instance_id
    ? `instance ${app.about.instance_id} · ${app.about.backend || ""} · times in ${zoneMode() === "local" ? "this browser's zone" : "UTC"}`
    : "";
}

// -- routes --------------------------------------------------------------------------------------

function parseRoute() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, query = ""] = raw.split("?");
  const params = new URLSearchParams(query);
  const parts = path.split("/").filter(Boolean).map((part) => {
    try {
      return decodeURIComponent(part);
    } catch {
      return part;
    }
  });
  if (parts[0] === "jobs" && parts.length === 2) return { page: "job", name: parts[1], params };
  if (parts[0] === "jobs" && parts[2] === "runs" && parts.length === 4) {
    return { page: "run", name: parts[1], runId: parts[3], params };
  }
  return { page: "overview", params };
}

function renderCrumbs(page) {
  const items = page.crumbs().map(([label, href], i) => el("li", { className: i ? "name" : "" },
    href ? el("a", { href }, label) : el("span", { "aria-current": "page" }, label)));
  $("#crumbs").replaceChildren(...items);
  document.title = `${page.crumbs().map(([label]) => label).reverse().join(" · ")} · brokersched`;
}

let lastOk = Date.now();

// A refresh redraws the page's parts: the element that had the keyboard's focus is found again
// in the new drawing (same section, same target) and gets it back.
function focusKey(element) {
  if (!element || element === document.body || !$("#view").contains(element)) return null;
  if (element.id) return `#${CSS.escape(element.id)}`;
  const section = element.closest("section[id]");
  const scope = section ? `#${CSS.escape(section.id)} ` : "";
  if (element.tagName === "A" && element.getAttribute("href")) {
    return `${scope}a[href="${CSS.escape(element.getAttribute("href"))}"]`;
  }
  if (element.dataset.action) {
    return `${scope}[data-action="${CSS.escape(element.dataset.action)}"][data-job="${CSS.escape(element.dataset.job || "")}"]`;
  }
  if (element.dataset.window) return `${scope}[data-window="${CSS.escape(element.dataset.window)}"]`;
  return null;
}

// What has the focus, as focusKey says; kept up to date as it moves, so a redraw that removed
// the focused element (the browser then puts the focus on the body) can give it back.
let focused = null;

function restoreFocus() {
  const lost = !document.activeElement || document.activeElement === document.body;
  if (!lost || !focused) return;
  const again = document.querySelector(focused);
  if (again) again.focus({ preventScroll: true });
}

async function update(page) {
  try {
    await page.update();
    restoreFocus();
    lastOk = Date.now();
    if (unreachable) {
      unreachable = null;
      renderHeader();
    }
  } catch (error) {
    if (page !== app.page) return;
    if (error instanceof ApiError && error.status === 0) {
      unreachable = error.message;
      renderHeader();
    } else if (error instanceof ApiError && error.status === 404) {
      $("#view").replaceChildren(el("div", { className: "panel" }, el("p", { className: "empty" }, error.message, " ", el("a", { href: "#/" }, "Back to the overview"))));
    } else {
      say(error.message, true);
      if (error.body && error.body.backend) app.learn({ backend_status: error.body.backend });
    }
  }
}

function route() {
  if (!app.vocabulary) { // the pages draw their filters and legends from the API's words
    loadVocabulary().then(route, (error) => say(`Cannot read the API's words (GET vocabulary): ${error.message}; retrying.`, true));
    return;
  }
  const info = parseRoute();
  const picked = info.params.get("window");
  if (picked && WINDOWS.some(([name]) => name === picked)) {
    app.prefs.window = picked; // one time scale for every page, until another is picked
    localStorage.setItem("brokersched-window", picked);
  }
  const Page = { overview: OverviewPage, job: JobPage, run: RunPage }[info.page];
  const previous = app.page;
  const page = new Page(app, info);
  const samePlace = previous && previous.constructor === Page && previous.name === page.name && previous.runId === page.runId;
  app.page = page;
  renderCrumbs(page);
  page.mount($("#view"));
  if (!samePlace) {
    say("");
    window.scrollTo(0, 0);
    focused = null;
    $("#view").focus({ preventScroll: true });
  }
  update(page);
}

let pending = null;
function refreshSoon(delay = LIVE_DEBOUNCE_MS) {
  if (pending) return;
  pending = setTimeout(() => {
    pending = null;
    if (app.page && !document.hidden) update(app.page);
  }, delay);
}

// -- the event stream ----------------------------------------------------------------------------

function onEvent(kind, message) {
  const event = JSON.parse(message.data);
  const runs = (app.live[event.job] ||= {});
  if (kind === "start") {
    runs[event.run_id] = { ...event, started_ms: Date.now() };
  } else if (kind === "complete" || kind === "fail") {
    delete runs[event.run_id];
  }
  refreshSoon();
}

// The event stream, once both the words and the session are known: a deployment whose reads
// need a token gets none (a browser's EventSource cannot send one), and the page polls.
function startStream() {
  if (app.source || !app.vocabulary || !app.sessionRead) return;
  if (app.session.reads_protected && app.session.via !== "host") {
    app.polling = true;
    renderHeader();
    return;
  }
  app.source = connect();
}

function connect() {
  const source = new EventSource("events");
  source.onopen = () => {
    app.streaming = true;
    renderHeader();
    refreshSoon(0);
  };
  source.onerror = () => {
    app.streaming = false;
    app.live = {}; // what runs here is read again once reconnected
    renderHeader();
  };
  for (const kind of app.vocabulary.events) {
    source.addEventListener(kind, (message) => onEvent(kind, message));
  }
  return source;
}

// -- changes and sign-in -------------------------------------------------------------------------

async function loadVocabulary() {
  const words = await get("vocabulary");
  if (!app.vocabulary) {
    app.vocabulary = words;
    startStream(); // the stream's events are among the words
  }
}

async function loadSession() {
  try {
    app.session = await session();
    app.learn({ instance_id: app.session.instance_id, backend: app.session.backend });
    if (token() && !app.session.authorized && app.session.via !== "read-token") setToken(""); // a token the server does not take
    if (app.session.reads_protected && !app.session.can_read && app.session.token_accepted) {
      say("This dashboard needs a token to view: sign in with the read-only token or the admin token.", true);
      if (!$("#signin").open) openSignIn(() => location.reload());
    }
  } catch (error) {
    app.session = { ...app.session };
  }
  app.sessionRead = true;
  startStream();
  renderHeader();
}

let afterSignIn = null;

function openSignIn(then = null) {
  afterSignIn = then;
  $("#signin-error").textContent = "";
  $("#token").value = "";
  $("#signin").showModal();
  $("#token").focus();
}

async function submitSignIn(event) {
  event.preventDefault();
  const value = $("#token").value.trim();
  try {
    const answer = await session(value);
    const reader = answer.via === "read-token";
    if (!answer.authorized && !reader) {
      $("#signin-error").textContent = answer.token_accepted
        ? "This is not one of the server's tokens."
        : "This server takes no token (changes are authorised by the host application).";
      return;
    }
    setToken(value);
    app.session = answer;
    $("#signin").close();
    renderHeader();
    say(reader ? "Signed in, read-only: this token may read, not change. It is kept in this browser tab only."
      : "Signed in: the token is kept in this browser tab only.");
    const then = afterSignIn;
    afterSignIn = null;
    if (then) then();
  } catch (error) {
    $("#signin-error").textContent = error.message;
  }
}

// The dialog of a pause (until when, why) or a skip (how many slots, why) of one job.
let changing = null;

function openChange(name, action) {
  if (!app.session.authorized && !(app.session.changes_enabled && app.session.token_accepted)) {
    return say(`${action} ${name}: not allowed; changes need a session of the application this dashboard is part of (sign in there)`, true);
  }
  changing = { name, action };
  const pause = action === "pause";
  $("#change-title").textContent = pause ? `Pause ${name}` : `Skip slots of ${name}`;
  $("#change-scope").textContent = pause
    ? "For the whole fleet: no instance runs its slots until it is resumed, or until the time chosen (the first slot at or after it runs)."
    : "For the whole fleet: its next slots are skipped wherever they fall due; the slots after them run. A later skip replaces this one.";
  $("#change-pause").hidden = !pause;
  $("#change-skip").hidden = pause;
  $("#change-submit").textContent = pause ? "Pause" : "Skip";
  $("#change-until").value = "";
  $("#change-at").value = "";
  $("#change-at").hidden = true;
  $("#change-count").value = "1";
  $("#change-note").value = "";
  $("#change-error").textContent = "";
  $("#change").showModal();
}

// The body of the change asked in the dialog, or an error message.
function changeBody() {
  const body = {};
  const note = $("#change-note").value.trim();
  if (note) body.note = note;
  if (changing.action === "skip") {
    const count = Number($("#change-count").value);
    if (!Number.isInteger(count) || count < 1 || count > 1000) return "Slots to skip: a whole number from 1 to 1000.";
    body.count = count;
    return body;
  }
  const until = $("#change-until").value;
  if (until === "at") {
    const at = Date.parse($("#change-at").value); // datetime-local: this browser's time zone
    if (Number.isNaN(at)) return "Until: pick a time.";
    if (at <= Date.now()) return "Until: pick a time in the future.";
    body.until = new Date(at).toISOString();
  } else if (until) {
    body.until = new Date(Date.now() + Number.parseInt(until, 10) * 3_600_000).toISOString();
  }
  return body;
}

async function submitChange(event) {
  event.preventDefault();
  const body = changeBody();
  if (typeof body === "string") {
    $("#change-error").textContent = body;
    return;
  }
  $("#change").close();
  await act(changing.name, changing.action, null, body);
}

async function act(name, action, runId = null, body = null) {
  if (!app.session.authorized) {
    if (app.session.changes_enabled && app.session.token_accepted) return openSignIn(() => act(name, action, runId, body));
    return say(`${action} ${name}: not allowed; changes need a session of the application this dashboard is part of (sign in there)`, true);
  }
  try {
    if (action === "abort") {
      const body = await abortRun(runId);
      say(`${name}: abort of run ${runId} requested; ${body.detail}`);
    } else {
      const answer = await change(name, action, body);
      say(action === "trigger" ? `${name}: triggered. ${answer.detail}` : changed(name, action, answer));
    }
  } catch (error) {
    if (error.status === 401 && app.session.token_accepted) {
      setToken("");
      app.session = { ...app.session, authorized: false, via: null };
      renderHeader();
      return openSignIn(() => act(name, action, runId, body));
    }
    say(`${action} ${name}: ${error.message}`, true);
  }
  refreshSoon(0);
}

// What a change of a job did, in the status line: its state, until when, the slots skipped.
function changed(name, action, answer) {
  const control = answer.control || {};
  let said = `${name}: ${answer.state}`;
  if (action === "pause" && control.until) said += ` until ${time(Date.parse(control.until))}`;
  if (action === "skip" && control.skip) {
    said = `${name}: skips its next ${control.skip.count === 1 ? "slot" : `${control.skip.count} slots`}, through ${time(control.skip.through_ms)}`;
  }
  return `${said} (${answer.scope})`;
}

// The same change of each job in turn ("resume all"), each through its own route and the same
// sign-in; the status line says what was done and what was refused.
async function actOnAll(names, action) {
  if (!names.length) return;
  if (!app.session.authorized) {
    if (app.session.changes_enabled && app.session.token_accepted) return openSignIn(() => actOnAll(names, action));
    return say(`${action}: not allowed; changes need a session of the application this dashboard is part of (sign in there)`, true);
  }
  const done = [];
  const refused = [];
  for (const name of names) {
    try {
      await change(name, action);
      done.push(name);
    } catch (error) {
      if (error.status === 401 && app.session.token_accepted) {
        setToken("");
        app.session = { ...app.session, authorized: false, via: null };
        renderHeader();
        return openSignIn(() => actOnAll(names.filter((n) => !done.includes(n)), action));
      }
      refused.push(`${name}: ${error.message}`);
    }
  }
  const jobs = (n) => `${n} job${n === 1 ? "" : "s"}`;
  say(refused.length
    ? `${action}: done for ${jobs(done.length)} of ${names.length}; refused: ${refused.join("; ")}`
    : `${action}: done for ${jobs(done.length)}, for the whole fleet (${done.join(", ")})`, refused.length > 0);
  refreshSoon(0);
}

// -- start ---------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("#signin-form").addEventListener("submit", submitSignIn);
  $("#change-form").addEventListener("submit", submitChange);
  $("#change-cancel").addEventListener("click", () => $("#change").close());
  $("#change-until").addEventListener("change", () => {
    const at = $("#change-until").value === "at";
    $("#change-at").hidden = !at;
    if (at) $("#change-at").focus();
  });
  $("#signin-cancel").addEventListener("click", () => $("#signin").close());
  $("#signin-button").addEventListener("click", () => {
    if (["token", "read-token"].includes(app.session.via)) {
      setToken("");
      app.session = { ...app.session, authorized: false, via: null, actions: [] };
      say("Signed out.");
      renderHeader();
      refreshSoon(0);
    } else {
      openSignIn();
    }
  });
  $("#zone").addEventListener("click", () => {
    setZoneMode(zoneMode() === "local" ? "utc" : "local");
    renderHeader();
    if (app.page) update(app.page);
  });
  $("#view").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (button && button.dataset.action === "resume-all") actOnAll(JSON.parse(button.dataset.jobs), "resume");
    else if (button && button.dataset.action.endsWith("-dialog")) openChange(button.dataset.job, button.dataset.action.replace("-dialog", ""));
    else if (button && button.dataset.job) act(button.dataset.job, button.dataset.action, button.dataset.runId || null);
  });
  document.addEventListener("focusin", (event) => {
    focused = focusKey(event.target);
  });
  document.addEventListener("mousedown", (event) => {
    if (!event.target.closest("a, button, select, input, [tabindex]")) focused = null;
  });
  window.addEventListener("hashchange", route);
  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => app.page && app.page.resize(), 150);
  });
  document.addEventListener("visibilitychange", () => !document.hidden && refreshSoon(0));
  renderHeader();
  Promise.all([loadSession(), loadVocabulary().catch(() => null)]).then(() => route());
  setInterval(() => (app.vocabulary ? refreshSoon(0) : route()), REFRESH_MS);
});
