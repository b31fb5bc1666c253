// Timelines on a time axis: rows (a job's instances, or the fleet's jobs) of marks placed at
// their slot's time, every row of a chart on one scale, and every chart of a page on the same
// window. Marks closer than a few pixels are drawn as one: the worst of them (a failure is
// never hidden by the successes around it) over a grey band that says how many there are.
"use strict";

import { axisLabel, duration, time, zoneOffsetMs } from "./format.js";
import { SEVERITY, shape, svgNode, word } from "./shapes.js";

const STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800]
  .map((s) => s * 1000);
// A slot nobody ran by design (overlap, claimed elsewhere) ranks below a completed run: it never
// hides one; a fault ranks above a failure.
const SLOT_SEVERITY = { missed: 9, "backend-error": 8, double: 8, late: 7, "clock-skew": 6, paused: 0.7, overlap: 0.5, "not-acquired": 0.4, next: 0 };
const MERGE_PX = 11; // marks closer than this are drawn as one (a mark is 10-12 px wide)

function severity(mark) {
  return SEVERITY[mark.kind] ?? SLOT_SEVERITY[mark.kind] ?? 1;
}

function runTitle(run, job = null) {
  const lines = [
    `${job ? `${job} · ` : ""}${word(run.outcome || "running")}`,
    `slot ${time(run.slot_ms)}`,
    `on ${run.instance_id} · ${run.reason}${run.attempt > 1 ? `, attempt ${run.attempt}` : ""}`,
  ];
  if (run.late_ms !== undefined && run.late_ms !== null) lines.push(`started ${duration(run.late_ms)} after its slot`);
  if (run.finished_ms) lines.push(`took ${duration(run.finished_ms - run.started_ms)}`);
  if (run.error) lines.push(run.error);
  return lines.join("\n");
}

export function runMark(run, jobName, { withJob = false } = {}) {
  return {
    ms: run.slot_ms,
    kind: run.outcome || "running",
    title: runTitle(run, withJob ? jobName : null),
    href: run.run_id && run.outcome ? `#/jobs/${encodeURIComponent(jobName)}/runs/${encodeURIComponent(run.run_id)}` : null,
    runId: run.run_id,
    backfilled: run.reason === "backfill", // an operator's run of a past slot: ringed
  };
}

export function slotMark(slot) {
  const named = word(slot.state);
  const detail = slot.detail && !named.includes(slot.detail) ? `\n${slot.detail}` : "";
  return { ms: slot.slot_ms, kind: slot.state, title: `slot ${time(slot.slot_ms)}: ${named}${detail}`, href: null };
}

function clusters(marks, x) {
  const sorted = [...marks].sort((a, b) => a.ms - b.ms);
  const groups = [];
  for (const mark of sorted) {
    const px = x(mark.ms);
    const last = groups[groups.length - 1];
    if (last && px - last.x0 < MERGE_PX) {
      last.marks.push(mark);
      last.x1 = px;
    } else {
      groups.push({ x0: px, x1: px, marks: [mark] });
    }
  }
  return groups;
}

function describeGroup(group) {
  const counts = {};
  for (const mark of group.marks) counts[mark.kind] = (counts[mark.kind] || 0) + 1;
  const parts = Object.entries(counts).sort((a, b) => b[1] - a[1])
    .map(([kind, n]) => `${n} ${word(kind)}`);
  const first = group.marks[0].ms, last = group.marks[group.marks.length - 1].ms;
  return `${group.marks.length} marks, ${time(first)} – ${time(last, { date: false })}\n${parts.join(", ")}`;
}

function niceStep(spanMs, plotPx, minPx) {
  const want = (spanMs * minPx) / Math.max(plotPx, 1);
  return STEPS.find((step) => step >= want) || STEPS[STEPS.length - 1];
}

// rows: [{label, href, here, marks: [{ms, kind, title, href}]}]
export function drawChart(box, { from, to, now, rows, knownFrom = null, ariaLabel }) {
  const width = Math.max(280, Math.floor(box.clientWidth || box.parentElement?.clientWidth || 900));
  const narrow = width < 560;
  const labelW = narrow ? 0 : Math.min(200, Math.round(width * 0.24));
  const rowH = narrow ? 40 : 28;
  const markY = narrow ? 27 : 14;
  const axisH = 24;
  const x0 = labelW + 12, x1 = width - 12;
  const end = to + (to - from) * 0.06; // a little of the future: the next slots
  const x = (ms) => x0 + ((ms - from) / (end - from)) * (x1 - x0);
  const height = axisH + rows.length * rowH + 6;
  const svg = svgNode("svg", { class: "timeline", viewBox: `0 0 ${width} ${height}`, width, height, role: "img" });
  svg.setAttribute("aria-label", ariaLabel);

  const defs = svgNode("defs");
  const hatch = svgNode("pattern", { id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" });
  hatch.append(svgNode("line", { x1: 0, y1: 0, x2: 0, y2: 6, class: "hatch-line" }));
  defs.append(hatch);
  svg.append(defs);

  // the future, the unknown past, the ticks
  svg.append(svgNode("rect", { x: x(now), y: axisH, width: Math.max(0, x1 - x(now)), height: height - axisH, class: "future" }));
  if (knownFrom !== null && knownFrom > from) {
    const w = Math.min(x(knownFrom), x1) - x0;
    const rect = svgNode("rect", { x: x0, y: axisH, width: Math.max(0, w), height: height - axisH, class: "unknown" });
    const tip = svgNode("title");
    tip.textContent = `no records kept before ${time(knownFrom)}`;
    rect.append(tip);
    svg.append(rect);
  }
  const step = niceStep(end - from, x1 - x0, narrow ? 64 : 88);
  const offset = zoneOffsetMs(from);
  for (let t = Math.ceil((from + offset) / step) * step - offset; t <= end; t += step) {
    const px = x(t);
    svg.append(svgNode("line", { x1: px, x2: px, y1: axisH - 4, y2: height, class: "tick" }));
    const label = svgNode("text", { x: px, y: axisH - 8, "text-anchor": "middle" });
    label.textContent = axisLabel(t, step);
    if (px > x0 + 20 && px < x1 - 20) svg.append(label);
  }
  svg.append(svgNode("line", { x1: x0, x2: x1, y1: axisH, y2: axisH, class: "axis" }));

  rows.forEach((row, i) => {
    const top = axisH + i * rowH;
    const y = top + markY;
    if (i % 2 === 1) svg.append(svgNode("rect", { x: 0, y: top, width, height: rowH, class: "lane-band" }));
    svg.append(svgNode("line", { x1: x0, x2: x1, y1: y, y2: y, class: "lane-line" }));
    const label = svgNode("text", { x: narrow ? x0 : 4, y: narrow ? top + 12 : y + 4, class: `lane-label${row.here ? " here" : ""}` });
    label.textContent = row.label;
    if (row.href) {
      const link = svgNode("a", { href: row.href });
      link.append(label);
      svg.append(link);
    } else {
      svg.append(label);
    }
    const shown = row.marks.filter((mark) => mark.ms >= from && mark.ms <= end);
    for (const group of clusters(shown, x)) {
      const worst = group.marks.reduce((a, b) => (severity(b) > severity(a) ? b : a));
      const cx = group.marks.length === 1 ? group.x0 : x(worst.ms);
      const node = shape(worst.kind, 5);
      node.setAttribute("transform", `translate(${cx.toFixed(1)},${y})`);
      const tip = svgNode("title");
      tip.textContent = group.marks.length === 1 ? worst.title : `${describeGroup(group)}\n— shown: ${worst.title}`;
      if (group.marks.length > 1) {
        svg.append(svgNode("rect", { x: group.x0 - 5, y: y - 4, width: group.x1 - group.x0 + 10, height: 8, rx: 4, class: "density" }));
      }
      node.append(tip);
      if (worst.runId) node.dataset.runId = worst.runId;
      if (worst.backfilled) {
        node.classList.add("backfilled");
        node.append(svgNode("circle", { r: 8, class: "backfill-ring" }));
      }
      node.dataset.count = group.marks.length;
      if (worst.href) {
        const link = svgNode("a", { href: worst.href, tabindex: "-1" });
        link.append(node);
        svg.append(link);
      } else {
        svg.append(node);
      }
    }
  });
  const nowLine = svgNode("line", { x1: x(now), x2: x(now), y1: axisH - 4, y2: height, class: "now" });
  const nowTip = svgNode("title");
  nowTip.textContent = `now: ${time(now)}`;
  nowLine.append(nowTip);
  svg.append(nowLine);
  box.replaceChildren(svg);
  return svg;
}
