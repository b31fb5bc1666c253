// Talking to the admin API: relative URLs (the app may be mounted under any prefix or behind a
// proxy), a timeout on every call (a page never hangs on a server that does not answer), the
// admin token from sessionStorage for changes.
"use strict";

const TOKEN_KEY = "brokersched-token";
const TIMEOUT_MS = 6000; // the server bounds its backend reads at 2 s; this is for the server

export class ApiError extends Error {
  constructor(message, status, body = {}) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

export const jobPath = (name, suffix = "") => `jobs/${encodeURIComponent(name)}${suffix}`;

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

async function call(url, options = {}) {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
  let response;
  try {
    response = await fetch(url, { cache: "no-store", credentials: "same-origin", ...options, signal: abort.signal });
  } catch (error) {
    const why = error.name === "AbortError" ? `no answer within ${TIMEOUT_MS / 1000} s` : "the server cannot be reached";
    throw new ApiError(why, 0);
  } finally {
    clearTimeout(timer);
  }
  let body = {};
  try {
    body = await response.json();
  } catch {
    body = { error: response.statusText };
  }
  if (!response.ok) throw new ApiError(body.error || response.statusText, response.status, body);
  return body;
}

export function get(url, params = null) {
  if (params) {
    const query = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== null && v !== undefined && v !== ""));
    if ([...query].length) url += `?${query}`;
  }
  // A deployment with a read token needs one to read: the stored token (read or admin) goes too.
  return call(url, { headers: token() ? { Authorization: `Bearer ${token()}` } : {} });
}

// What this tab may change: with the stored token (or `candidate`), or the host application's
// session (cookies go with every same-origin request).
export function session(candidate = null) {
  const value = candidate ?? token();
  return call("session", { headers: value ? { Authorization: `Bearer ${value}` } : {} });
}

export function change(name, action, body = null) {
  const headers = {};
  if (token()) headers.Authorization = `Bearer ${token()}`;
  const options = { method: "POST", headers };
  if (body !== null) {
    headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  return call(jobPath(name, `/${action}`), options);
}

// Ask a run to stop, wherever in the fleet it runs (cooperative: its context is aborted).
export function abortRun(runId) {
  const headers = {};
  if (token()) headers.Authorization = `Bearer ${token()}`;
  return call(`runs/${encodeURIComponent(runId)}/abort`, { method: "POST", headers });
}
