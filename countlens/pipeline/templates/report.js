// report.html's head explorer, inlined into the page by countlens.pipeline.html_report. It reads the
// JSON in #report-data (countlens.pipeline.head_panels.head_data), draws the layer × head grid coloured
// by the chosen result, and fills #panel with a clicked head's data. Text goes in through textContent
// only: decoded tokens are arbitrary strings.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const $ = (id) => document.getElementById(id);
  const el = (tag, text, cls) => {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  };
  const fmt = (v) => (typeof v === "number" ? (Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(4)))) : v === null ? "–" : String(v));

  // Colour scales: signed results diverge from white at 0 (blue below, red above, symmetric); the
  // others run from pale to dark over their range; classes get one colour each.
  const mix = (a, b, t) => a.map((x, i) => Math.round(x + (b[i] - x) * t));
  const rgb = (c) => `rgb(${c[0]},${c[1]},${c[2]})`;
  const ramp = (stops, t) => {
    t = Math.min(1, Math.max(0, t));
    const i = Math.min(stops.length - 2, Math.floor(t * (stops.length - 1)));
    return mix(stops[i], stops[i + 1], t * (stops.length - 1) - i);
  };
  const DIVERGING = [[59, 76, 192], [255, 255, 255], [180, 4, 38]];
  const SEQUENTIAL = [[255, 255, 229], [254, 153, 41], [102, 37, 6]];
  const CLASS_COLOURS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#e8e8e8"];

  function scale(metric) {
    if (metric.categories) {
      const colour = (v) => CLASS_COLOURS[metric.categories.indexOf(v) % CLASS_COLOURS.length];
      return { colour, legend: () => legendCategories(metric, colour) };
    }
    const values = metric.values.flat().filter((v) => v !== null);
    if (metric.signed) {
      const m = Math.max(...values.map(Math.abs)) || 1;
      return { colour: (v) => rgb(ramp(DIVERGING, (v / m + 1) / 2)), legend: () => legendBar(DIVERGING, -m, m) };
    }
    const lo = Math.min(...values), hi = Math.max(...values);
    const span = hi - lo || 1;
    return { colour: (v) => rgb(ramp(SEQUENTIAL, (v - lo) / span)), legend: () => legendBar(SEQUENTIAL, lo, hi) };
  }

  function legendBar(stops, lo, hi) {
    const box = $("legend");
    box.replaceChildren();
    const bar = el("div", null, "bar");
    bar.style.background = `linear-gradient(to right, ${stops.map(rgb).join(", ")})`;
    const labels = el("div");
    labels.style.width = "240px";
    labels.style.display = "flex";
    labels.style.justifyContent = "space-between";
    labels.append(el("span", fmt(lo)), el("span", fmt(hi)));
    box.append(bar, labels);
  }

  function legendCategories(metric, colour) {
    const box = $("legend");
    box.replaceChildren();
    for (const c of metric.categories) {
      const sw = el("span", null, "swatch");
      sw.style.background = colour(c);
      box.append(sw, el("span", c));
    }
  }

  let selected = null;

  function drawGrid(metric) {
    const s = scale(metric);
    const table = el("table");
    const header = el("tr");
    header.append(el("th"));
    for (let h = 0; h < data.n_heads; h++) header.append(el("th", `H${h}`));
    table.append(header);
    for (let la = 0; la < data.n_layers; la++) {
      const row = el("tr");
      row.append(el("th", `L${la}`));
      for (let h = 0; h < data.n_heads; h++) {
        const id = `L${la}H${h}`;
        const v = metric.values[la][h];
        const cell = el("td", null, "cell");
        cell.dataset.head = id;
        if (!(id in data.heads)) {
          cell.classList.add("absent");
          cell.title = `${id}: no head here`;
        } else {
          cell.title = `${id}: ${metric.label} = ${fmt(v)}`;
          if (v === null) cell.classList.add("absent");
          else cell.style.background = s.colour(v);
          cell.tabIndex = 0;
          cell.setAttribute("role", "button");
          cell.addEventListener("click", () => openPanel(id));
          cell.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") openPanel(id); });
          if (id === selected) cell.classList.add("selected");
        }
        row.append(cell);
      }
      table.append(row);
    }
    $("grid").replaceChildren(table);
    $("metric-source").textContent = `from ${metric.source}`;
    s.legend();
  }

  function rows(target, pairs, attrs) {
    target.replaceChildren();
    for (const [name, value] of pairs) {
      const tr = el("tr");
      if (attrs) {
        tr.dataset.col = name;
        tr.dataset.value = value === null ? "" : String(value);
      }
      tr.append(el("th", name), el("td", fmt(value)));
      target.append(tr);
    }
  }

  function openPanel(id) {
    const head = data.heads[id];
    selected = id;
    document.querySelectorAll("#grid td.selected").forEach((c) => c.classList.remove("selected"));
    document.querySelector(`#grid td[data-head="${id}"]`).classList.add("selected");
    $("panel-id").textContent = id;
    $("panel-class").textContent = `class: ${head.class}`;
    rows($("panel-numbers"), head.numbers, true);
    rows($("panel-patching"), head.patching, true);
    rows($("panel-tokens"), head.tokens.map(([t, share]) => [JSON.stringify(t), share]), false);
    $("panel-preset").textContent = data.preset;
    const rules = $("panel-rules");
    rules.replaceChildren();
    if (head.rules_class !== head.class) {
      rules.append(el("p", `These thresholds give ${head.rules_class}, not heads.csv's ${head.class}: ` +
        "the table was re-classified with other thresholds (countlens classify).", "missing"));
    }
    for (const rule of head.rules) {
      const box = el("div", null, "rule" + (rule.class === head.rules_class && rule.matched ? " gave" : ""));
      box.append(el("strong", `${rule.class}: ${rule.matched ? "met" : "not met"}`));
      rule.any_of.forEach((conds, i) => {
        const line = el("div", i > 0 ? "or: " : "");
        conds.forEach((c, j) => {
          const op = { ">=": "≥", "<=": "≤", "<": "<" }[c.op];
          const text = `${c.met ? "✓" : "✗"} ${c.column} ${fmt(c.value)} ${op} ${c.name} ${fmt(c.threshold)}`;
          line.append(el("span", text + (j < conds.length - 1 ? ", " : ""), c.met ? "met" : "unmet"));
        });
        box.append(line);
      });
      rules.append(box);
    }
    if (!head.rules.some((r) => r.matched)) rules.append(el("p", "No rule is met: other."));
    const images = $("panel-images");
    images.replaceChildren();
    for (const [caption, uri] of head.images) {
      const fig = el("figure");
      const img = el("img");
      img.src = uri;
      img.alt = caption;
      fig.append(img, el("figcaption", caption));
      images.append(fig);
    }
    if (head.images_left_out) images.append(el("p", "More images than the page holds: see results/attention_maps.nc.", "missing"));
    if (!head.images.length && !head.images_left_out) {
      images.append(el("p", data.attention_maps
        ? `Not embedded: the page holds the images of the ${data.image_heads} most important heads.`
        : "None in this run (it has no results/attention_maps.nc).", "missing"));
    }
    $("panel").hidden = false;
  }

  const select = $("metric");
  data.metrics.forEach((m, i) => select.append(new Option(m.label, String(i))));
  select.addEventListener("change", () => drawGrid(data.metrics[Number(select.value)]));
  $("panel-close").addEventListener("click", () => { $("panel").hidden = true; });
  drawGrid(data.metrics[0]);
})();
