// One shape and one colour per outcome, slot state and job state: the timelines, the badges and
// the legends draw from this table, so a colour-blind reader tells them apart by shape. Which
// words there are comes from the API (GET /vocabulary, app.vocabulary): this table only says how
// each is drawn, and a word it lacks (a newer release's) gets the default shape and itself as
// its word, so it is never left out of a legend or a filter.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

export const KINDS = {
  // runs
  completed: { shape: "circle", colour: "var(--completed)", word: "completed", cls: "o-completed" },
  failed: { shape: "cross", colour: "var(--failed)", word: "failed", cls: "o-failed" },
  "timed-out": { shape: "hourglass", colour: "var(--timed-out)", word: "timed out", cls: "o-timed-out" },
  interrupted: { shape: "square", colour: "var(--interrupted)", word: "interrupted", cls: "o-interrupted" },
  replaced: { shape: "forward", colour: "var(--replaced)", word: "replaced by a later slot", cls: "o-replaced" },
  running: { shape: "ring", colour: "var(--running)", word: "running", cls: "o-running" },
  // slots no instance ran
  missed: { shape: "hollow-square", colour: "var(--failed)", word: "missed: nobody ran it", cls: "o-missed" },
  overlap: { shape: "dash", colour: "var(--neutral)", word: "skipped: previous run still going" },
  paused: { shape: "bars", colour: "var(--warn)", word: "skipped: paused" },
  late: { shape: "hollow-triangle", colour: "var(--warn)", word: "skipped here: late" },
  "backend-error": { shape: "hollow-triangle", colour: "var(--failed)", word: "skipped here: backend error" },
  "clock-skew": { shape: "hollow-triangle", colour: "var(--neutral)", word: "skipped here: clock skew" },
  "not-acquired": { shape: "small-ring", colour: "var(--neutral)", word: "claimed elsewhere, no record yet" },
  double: { shape: "double", colour: "var(--failed)", word: "ran more than once", cls: "o-missed" },
  next: { shape: "dotted-ring", colour: "var(--neutral)", word: "next slot" },
  // job states
  armed: { shape: "circle", colour: "var(--completed)", word: "armed" },
  idle: { shape: "ring", colour: "var(--neutral)", word: "idle" },
  disabled: { shape: "slashed", colour: "var(--neutral)", word: "disabled" },
  "state-running": { shape: "play", colour: "var(--running)", word: "running" },
  "state-paused": { shape: "bars", colour: "var(--warn)", word: "paused" },
};

// A word this table lacks: drawn as a neutral diamond, named as the API names it.
const UNKNOWN = { shape: "diamond", colour: "var(--neutral)", cls: "o-neutral" };
// Which outcome stands for a crowd of runs drawn as one mark: the worst.
export const SEVERITY = { missed: 6, failed: 5, "timed-out": 4, interrupted: 3, running: 2, replaced: 1.5, completed: 1 };

// How `kind` is drawn and named.
export function look(kind) {
  return KINDS[kind] || { ...UNKNOWN, word: kind };
}

export const word = (kind) => look(kind).word;

// The kinds of run marks: the API's outcomes, and a run still going.
export const runKinds = (vocabulary) => [...vocabulary.outcomes, "running"];

export function svgNode(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

// The shape of `kind` centred on (0, 0), `s` its half-size, as one SVG group.
export function shape(kind, s = 6) {
  const { shape: form, colour } = look(kind);
  const g = svgNode("g", { class: `mark mark-${kind}`, "data-kind": kind });
  const fill = { fill: colour, stroke: "none" };
  const line = (w) => ({ fill: "none", stroke: colour, "stroke-width": w, "stroke-linecap": "round" });
  const t = s * 0.9;
  switch (form) {
    case "circle": g.append(svgNode("circle", { r: s, ...fill })); break;
    case "ring": g.append(svgNode("circle", { r: s - 1.2, ...line(2.4), fill: "#fff" })); break;
    case "small-ring": g.append(svgNode("circle", { r: s * 0.45, ...line(1.5), fill: "#fff" })); break;
    case "dotted-ring": g.append(svgNode("circle", { r: s * 0.7, ...line(1.3), fill: "#fff", "stroke-dasharray": "2 2" })); break;
    case "cross": g.append(svgNode("path", { d: `M${-t},${-t}L${t},${t}M${t},${-t}L${-t},${t}`, ...line(s * 0.62) })); break;
    case "hourglass": g.append(svgNode("path", { d: `M${-s},${-s}H${s}L${-s},${s}H${s}Z`, ...fill, "stroke-linejoin": "round" })); break;
    case "forward": g.append(svgNode("path", { d: `M${-s},${-s}L0,0L${-s},${s}ZM0,${-s}L${s},0L0,${s}Z`, ...fill })); break;
    case "square": g.append(svgNode("rect", { x: -s * 0.85, y: -s * 0.85, width: s * 1.7, height: s * 1.7, ...fill })); break;
    case "hollow-square": g.append(svgNode("rect", { x: -s * 0.8, y: -s * 0.8, width: s * 1.6, height: s * 1.6, ...line(2), fill: "#fff" })); break;
    case "dash": g.append(svgNode("rect", { x: -s, y: -1.5, width: s * 2, height: 3, rx: 1.5, ...fill })); break;
    case "bars":
      g.append(svgNode("rect", { x: -s * 0.75, y: -s, width: s * 0.5, height: s * 2, ...fill }),
               svgNode("rect", { x: s * 0.25, y: -s, width: s * 0.5, height: s * 2, ...fill }));
      break;
    case "hollow-triangle": g.append(svgNode("path", { d: `M${-s},${-s * 0.8}H${s}L0,${s}Z`, ...line(1.8), fill: "#fff", "stroke-linejoin": "round" })); break;
    case "double":
      g.append(svgNode("circle", { cx: -s * 0.45, r: s * 0.75, ...line(1.8), fill: "none" }),
               svgNode("circle", { cx: s * 0.45, r: s * 0.75, ...line(1.8), fill: "none" }));
      break;
    case "diamond": g.append(svgNode("path", { d: `M0,${-s}L${s},0L0,${s}L${-s},0Z`, ...line(1.8), fill: "#fff", "stroke-linejoin": "round" })); break;
    case "play": g.append(svgNode("path", { d: `M${-s * 0.7},${-s}L${s},0L${-s * 0.7},${s}Z`, ...fill })); break;
    case "slashed":
      g.append(svgNode("circle", { r: s - 1, ...line(1.8), fill: "none" }),
               svgNode("path", { d: `M${-s * 0.6},${s * 0.6}L${s * 0.6},${-s * 0.6}`, ...line(1.8) }));
      break;
    default: g.append(svgNode("circle", { r: s, ...fill }));
  }
  return g;
}

// A small inline icon of `kind` for text: badges, legends, table cells.
export function icon(kind, size = 12) {
  const svg = svgNode("svg", { width: size, height: size, viewBox: `${-size / 2} ${-size / 2} ${size} ${size}`,
                               "aria-hidden": "true", focusable: "false" });
  svg.append(shape(kind, size / 2 - 1));
  return svg;
}

const STATE_KIND = { running: "state-running", paused: "state-paused" };

// "● completed": a shape, a colour and a word; `label` replaces the word.
export function badge(kind, label = null, { big = false, state = false } = {}) {
  const key = state ? STATE_KIND[kind] || kind : kind;
  const info = look(key);
  const span = document.createElement("span");
  const cls = state ? `s-${kind}` : info.cls || "o-neutral";
  span.className = `badge ${cls}${big ? " big" : ""}`;
  span.dataset.kind = kind;
  span.append(icon(key, big ? 14 : 12), document.createTextNode(label ?? info.word));
  return span;
}

export function legend(kinds) {
  const box = document.createElement("div");
  box.className = "legend";
  box.setAttribute("aria-label", "legend");
  for (const kind of kinds) {
    const item = document.createElement("span");
    item.append(icon(kind, 12), document.createTextNode(word(kind)));
    box.append(item);
  }
  return box;
}
