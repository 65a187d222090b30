// Loom's live engine view: polls /dashboard/feed once a second and draws gauges, three small
// SVG charts and the table of requests. Text enters the page through textContent only.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

function fmt(x, digits = 1) { return x == null ? "-" : Number(x).toFixed(digits); }
function pct(x) { return x == null ? "-" : `${(100 * x).toFixed(1)}%`; }

function lastDefined(values, n) {
  const xs = values.slice(-n).filter((v) => v != null);
  return xs.length ? xs : null;
}

function chart(svg, seriesList, t) {
  svg.replaceChildren();
  const W = 600, H = 140, pad = 4;
  const all = seriesList.flatMap((s) => s.values.filter((v) => v != null));
  const max = Math.max(1, ...all);
  const span = Math.max(60, ...t.map((v) => -v));  // seconds on the x axis, up to 10 minutes
  const x = (ti) => W + (ti / span) * W;
  const y = (v) => H - pad - (v / max) * (H - 2 * pad);
  const grid = document.createElementNS(SVG, "line");
  grid.setAttribute("x1", 0); grid.setAttribute("x2", W);
  grid.setAttribute("y1", y(max)); grid.setAttribute("y2", y(max));
  grid.setAttribute("class", "grid");
  svg.append(grid);
  $(`${svg.id}-max`).textContent = `(top: ${fmt(max, max >= 100 ? 0 : 1)})`;
  for (const s of seriesList) {
    let d = "", pen = false;
    s.values.forEach((v, i) => {
      if (v == null) { pen = false; return; }
      const at = `${x(t[i]).toFixed(1)},${y(v).toFixed(1)}`;
      d += pen ? `L${at} ` : `M${at} L${at} `;  // a lone point draws as a dot (round caps)
      pen = true;
    });
    const path = document.createElementNS(SVG, "path");
    path.setAttribute("d", d.trim() || "M0,0");
    path.setAttribute("class", `line ${s.cls}`);
    svg.append(path);
  }
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function render(feed) {
  const now = feed.now, series = feed.series;
  $("model-name").textContent = feed.model;
  $("uptime").textContent = `up ${Math.round(feed.uptime_s)} s`;
  $("running").textContent = now.running;
  $("waiting").textContent = now.waiting;
  $("kv-usage").textContent = pct(now.kv_cache_usage);
  $("kv-bar").style.width = `${Math.min(100, 100 * now.kv_cache_usage)}%`;
  const kv = feed.kv_cache;
  $("kv-size").textContent = `${(kv.num_blocks - 1) * kv.block_size} tokens in ${kv.num_blocks} blocks of ${kv.block_size}`;
  $("prefix-hit").textContent = pct(now.prefix_cache_hit_rate);
  const tps = lastDefined(series.generation_tps, 2);
  $("tps").textContent = tps ? fmt(tps.reduce((a, b) => a + b, 0) / tps.length) : "-";
  const ttft = lastDefined(series.ttft_ms, 12);
  $("ttft").textContent = ttft ? `${fmt(ttft.reduce((a, b) => a + b, 0) / ttft.length, 0)} ms` : "-";
  chart($("chart-tps"), [{ values: series.generation_tps, cls: "tps" }], series.t);
  chart($("chart-ttft"), [{ values: series.ttft_ms, cls: "ttft" }], series.t);
  chart($("chart-load"), [{ values: series.running, cls: "running" },
                          { values: series.waiting, cls: "waiting" }], series.t);
  const rows = feed.requests.map((r) => {
    const tr = document.createElement("tr");
    tr.className = `req state-${r.state}`;
    tr.append(cell(r.id, "id"), cell(r.state, "state"), cell(r.prompt_tokens),
              cell(r.output_tokens), cell(r.max_tokens ?? "-"), cell(`${fmt(r.age_s)} s`),
              cell(r.ttft_ms == null ? "-" : `${fmt(r.ttft_ms, 0)} ms`));
    return tr;
  });
  document.querySelector("#requests tbody").replaceChildren(...rows);
  $("no-requests").hidden = rows.length > 0;
}

async function poll() {
  try {
    const r = await fetch("/dashboard/feed", { cache: "no-store" });
    if (!r.ok) throw new Error(`${r.status}`);
    render(await r.json());
    $("feed-status").textContent = "live";
    $("feed-status").className = "ok";
  } catch (e) {
    $("feed-status").textContent = `feed unavailable (${e.message})`;
    $("feed-status").className = "bad";
  }
  setTimeout(poll, 1000);
}

poll();
