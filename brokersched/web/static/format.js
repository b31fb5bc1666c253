// Times, durations and DOM helpers. Every time is shown in UTC or in the browser's zone (the
// toggle in the top bar, kept in localStorage); a job's schedule also in the job's own zone.
"use strict";

const ZONE_KEY = "brokersched-zone";

export function zoneMode() {
  return localStorage.getItem(ZONE_KEY) === "local" ? "local" : "utc";
}

export function setZoneMode(mode) {
  localStorage.setItem(ZONE_KEY, mode === "local" ? "local" : "utc");
}

export function localZoneName() {
  return Intl.DateTimeFormat().resolvedOptions().timeZone || "local";
}

const pad = (n, width = 2) => String(n).padStart(width, "0");

// "+05:30" and the like: Intl may not know fixed offsets; they are done by hand.
const OFFSET = /^([+-])(\d{2}):?(\d{2})$/;

function parts(ms, zone) {
  const offset = OFFSET.exec(zone);
  if (zone === "UTC" || offset) {
    const shift = offset ? (offset[1] === "-" ? -1 : 1) * (Number(offset[2]) * 60 + Number(offset[3])) * 60000 : 0;
    const d = new Date(ms + shift);
    return { y: d.getUTCFullYear(), mo: d.getUTCMonth() + 1, d: d.getUTCDate(), h: d.getUTCHours(),
             mi: d.getUTCMinutes(), s: d.getUTCSeconds(), ms: d.getUTCMilliseconds(), name: zone };
  }
  const format = new Intl.DateTimeFormat("en-GB", {
    timeZone: zone === "local" ? undefined : zone, hourCycle: "h23", year: "numeric", month: "2-digit",
    day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit", timeZoneName: "short",
  });
  const out = { ms: ((ms % 1000) + 1000) % 1000 };
  for (const { type, value } of format.formatToParts(new Date(ms))) {
    if (type === "year") out.y = Number(value);
    else if (type === "month") out.mo = Number(value);
    else if (type === "day") out.d = Number(value);
    else if (type === "hour") out.h = Number(value);
    else if (type === "minute") out.mi = Number(value);
    else if (type === "second") out.s = Number(value);
    else if (type === "timeZoneName") out.name = value;
  }
  return out;
}

// "2026-03-02 12:01:00 UTC" in the chosen zone (or `zone`: an IANA name, "UTC", "+05:30").
export function time(ms, { zone = null, millis = false, seconds = true, date = true } = {}) {
  if (ms === null || ms === undefined) return "–";
  const z = zone || (zoneMode() === "local" ? "local" : "UTC");
  let p;
  try {
    p = parts(ms, z);
  } catch {
    p = parts(ms, "UTC");
  }
  let text = `${pad(p.h)}:${pad(p.mi)}`;
  if (seconds) text += `:${pad(p.s)}`;
  if (millis) text += `.${pad(p.ms, 3)}`;
  if (date) text = `${p.y}-${pad(p.mo)}-${pad(p.d)} ${text}`;
  return `${text} ${p.name}`;
}

export function axisLabel(ms, stepMs) {
  const z = zoneMode() === "local" ? "local" : "UTC";
  const p = parts(ms, z);
  const clock = stepMs < 60000 ? `${pad(p.h)}:${pad(p.mi)}:${pad(p.s)}` : `${pad(p.h)}:${pad(p.mi)}`;
  if (stepMs >= 6 * 3600000 || (p.h === 0 && p.mi === 0 && p.s === 0)) return `${pad(p.mo)}-${pad(p.d)} ${clock}`;
  return clock;
}

// The zone's offset from UTC at `ms`, in ms (for aligning axis ticks on the zone's hours).
export function zoneOffsetMs(ms) {
  return zoneMode() === "local" ? -new Date(ms).getTimezoneOffset() * 60000 : 0;
}

export function duration(ms) {
  if (ms === null || ms === undefined) return "–";
  const sign = ms < 0 ? "-" : "";
  ms = Math.abs(ms);
  if (ms < 1000) return `${sign}${Math.round(ms)} ms`;
  if (ms < 10000) return `${sign}${(ms / 1000).toFixed(2)} s`;
  if (ms < 60000) return `${sign}${(ms / 1000).toFixed(1)} s`;
  const s = Math.round(ms / 1000);
  if (s < 3600) return `${sign}${Math.floor(s / 60)} min ${pad(s % 60)} s`;
  if (s < 86400) return `${sign}${Math.floor(s / 3600)} h ${pad(Math.floor((s % 3600) / 60))} min`;
  return `${sign}${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

// "3 min ago", "in 12 s"
export function relative(ms, now) {
  if (ms === null || ms === undefined) return "–";
  const delta = ms - now;
  const span = Math.abs(delta);
  let text;
  if (span < 1000) return "now";
  if (span < 60000) text = `${Math.round(span / 1000)} s`;
  else if (span < 3600000) text = `${Math.round(span / 60000)} min`;
  else if (span < 86400000) text = `${(span / 3600000).toFixed(span < 36000000 ? 1 : 0)} h`;
  else text = `${Math.round(span / 86400000)} d`;
  return delta < 0 ? `${text} ago` : `in ${text}`;
}

export const WINDOWS = [["15m", 900000], ["1h", 3600000], ["6h", 21600000], ["24h", 86400000], ["7d", 604800000]];

export function windowMs(name) {
  const found = WINDOWS.find(([key]) => key === name);
  return found ? found[1] : 3600000;
}

// -- DOM ----------------------------------------------------------------------------------------

// Every text from the server goes through textContent (never innerHTML).
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("aria-") || key === "role" || key === "for") node.setAttribute(key, value);
    else node[key] = value;
  }
  node.append(...present(children));
  return node;
}

// Children worth appending: no null, undefined or false (replaceChildren would print them).
export function present(children) {
  return children.flat().filter((child) => child !== null && child !== undefined && child !== false);
}

export function text(value) {
  return document.createTextNode(value === null || value === undefined ? "–" : String(value));
}
