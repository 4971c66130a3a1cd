"""A pruned attribution graph as one self-contained HTML page: `graph_page`.

The page draws circuit-tracer's viewer JSON (`countlens.features.graph_files.graph_json`) with
inline SVG and a little inline JavaScript; it loads nothing (no scripts, fonts or images from
anywhere), so it opens from a disk, a mail attachment or an air-gapped machine alike.

**Layout.** Each node sits at

- **x = its token position** (``ctx_idx``): one column per prompt token, the tokens written along
  the bottom. Image tokens get narrow columns and one label for the whole run (``image × 36``), so
  a 6 × 6 grid of image tokens takes about as much room as a few words; a column widens where a row
  holds several nodes at one position (often many features at the last token).
- **y = its layer**: embeddings on the bottom row, then layer 0, 1, … (its features and its error
  node), and the logits on the top row.

**Marks.** Features are circles, error nodes grey squares, embeddings small green squares and logits
pink diamonds. A link (an edge ``source → target`` with weight ``A[target, source]``, the source's
direct effect on the target) is a line whose width grows with |weight| (relative to the largest)
and whose colour is its sign: orange adds to the target, blue takes away.

**Panel.** Hovering a node shows its fields beside the graph — node_id, kind, layer, position,
token, feature index, activation, influence (the cumulative share at its rank: small for the most
influential, `countlens.features.prune`), clerp (its label), for a logit its probability and for an
image token's embedding its cell and object. A click pins the panel and highlights the node's links.
The summary above the graph shows circuit-tracer's **graph scores** of the graph drawn
(`countlens.features.scores`), for a graph given as an `AttributionGraph` (the viewer JSON has no place for them).
With ``cards`` (a `countlens.features.cards.feature_cards` Dataset), a feature node whose
(layer, feature) has a card also shows its card: the top scenes' maximum activations,
``fires_on_objects``, the direct effect on each count word's logit and the ablated effect.

**Size.** The page embeds every node and link once, so it is for a *pruned* graph (hundreds of
nodes, a few thousand links): a graph with more than `MAX_LINKS` links is refused, and the message
says to prune it (`countlens.features.prune.prune`) first, or harder.
"""

from __future__ import annotations

import json
import math
import re
from html import escape
from pathlib import Path

from countlens.errors import InputError
from countlens.features.graph import AttributionGraph
from countlens.features.graph_files import graph_json
from countlens.features.scores import graph_scores
from countlens.files import refuse_output_over_input, write_text
from countlens.html_page import BASE_CSS, json_script
from countlens.labels import feature_label

#: The most links a page draws; a bigger graph is refused (prune it first).
MAX_LINKS = 20_000
#: The viewer JSON's ``feature_type`` → the node's kind on the page.
KINDS = {
    "cross layer transcoder": "feature",
    "mlp reconstruction error": "error",
    "embedding": "embedding",
    "logit": "logit",
}
#: Variables a cards Dataset must hold (what `feature_cards` returns).
CARD_VARIABLES = ("scene", "max_activation", "fires_on_objects", "direct", "ablated")
#: Layout, in SVG pixels: row height, node spacing in a cell, column widths, margins.
ROW_H, GAP, TEXT_W, IMAGE_W, LEFT, TOP, BOTTOM = 64, 12, 38, 9, 96, 24, 96
IMAGE_TOKENS = ("<|image_pad|>", "<image>", "<|image|>", "<image_soft_token>")
_IMAGE_CLERP = re.compile(r"image cell \((\d+), (\d+)\), (?:object (\d+)|no object)")
_FEATURE_ID = re.compile(r"(\d+)_(\d+)_(\d+)")


def graph_page(graph_or_json, path, title: str | None = None, cards=None) -> Path:
    """Write the page of a pruned attribution graph to ``path`` (see the module's docstring) and
    return the path. ``graph_or_json``: an `AttributionGraph` (``prune(attribution_graph(...))``),
    the viewer JSON dict `graph_json` returns, or the path of a ``graph.json`` file `save_graph`
    wrote. ``title``: the page's title (default: the JSON's slug). ``cards``: optional
    `feature_cards` Dataset shown on the panel of the features it covers.

    Every argument is checked before anything is written; the file is written whole or not at all."""
    if title is not None and (not isinstance(title, str) or not title.strip()):
        raise InputError(f"title must be a non-empty string (or None for the graph's slug), got {title!r}")
    target = _check_path(path)
    refuse_output_over_input(target, {"the graph's JSON file": graph_or_json}, "the page's path")
    data = _viewer_json(graph_or_json, title)
    card_data = _cards(cards)
    page = _html(_page_data(data, card_data), title or data["metadata"].get("slug") or "Attribution graph")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text(target, page)
    return target


def _check_path(path) -> Path:
    if not isinstance(path, (str, Path)) or not str(path):
        raise InputError(f"graph_page takes the page's file path, e.g. 'graph.html'; got {path!r}")
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a folder; give graph_page a file path such as {path / 'graph.html'}")
    return path


def _too_big(n_links: int, pruned: bool) -> InputError:
    fix = (
        "prune it first: prune(graph, node_threshold=0.8, edge_threshold=0.98) (countlens.features.prune)"
        if not pruned
        else "prune it harder: lower node_threshold / edge_threshold in prune(...)"
    )
    return InputError(f"the graph has {n_links} links, more than the page draws ({MAX_LINKS}); {fix}")


def _viewer_json(graph_or_json, title: str | None) -> dict:
    """The viewer JSON of ``graph_or_json``, checked: nodes with known kinds and unique ids, links
    between them with finite weights, at most `MAX_LINKS` links."""
    if isinstance(graph_or_json, AttributionGraph):
        if graph_or_json.n_edges > MAX_LINKS:
            raise _too_big(graph_or_json.n_edges, graph_or_json.node_threshold is not None)
        slug = re.sub(r"[^A-Za-z0-9_-]+", "-", title or "").strip("-") or "attribution-graph"
        data = graph_json(graph_or_json, slug)
        if graph_or_json.n_logits:  # circuit-tracer's graph scores, on the summary (the JSON has no place)
            data["metadata"].update({f"{k}_score": v for k, v in graph_scores(graph_or_json).items()})
        return data
    if isinstance(graph_or_json, (str, Path)):
        file = Path(graph_or_json)
        if not file.is_file():
            raise InputError(f"{file} is no file; give a graph.json that save_graph wrote, or the graph itself")
        try:
            graph_or_json = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise InputError(
                f"{file} cannot be read as JSON ({err}); give a graph.json that save_graph wrote"
            ) from None
    data = graph_or_json
    if not isinstance(data, dict) or not all(isinstance(data.get(k), t) for k, t in _TOP_KEYS):
        raise InputError(
            "graph_page takes an AttributionGraph or circuit-tracer's viewer JSON (graph_json(graph, slug): a dict "
            f"with metadata, nodes and links); got {type(data).__name__}"
            + (f" with keys {sorted(data)[:8]}" if isinstance(data, dict) else "")
        )
    nodes, links = data["nodes"], data["links"]
    if len(links) > MAX_LINKS:
        raise _too_big(len(links), data["metadata"].get("node_threshold") is not None)
    tokens = data["metadata"].get("prompt_tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise InputError("metadata.prompt_tokens must be a list of strings, one per position")
    ids: set[str] = set()
    for i, node in enumerate(nodes):
        ok = isinstance(node, dict) and isinstance(node.get("node_id"), str) and node.get("feature_type") in KINDS
        ok = ok and _integer(node.get("ctx_idx")) and node["ctx_idx"] >= 0 and isinstance(node.get("layer"), (str, int))
        if not ok:
            raise InputError(
                f"node {i} of the graph is not a viewer node (node_id, layer, ctx_idx ≥ 0 and feature_type one of "
                f"{sorted(KINDS)}): {str(node)[:160]}; write the JSON with graph_json"
            )
        if node["node_id"] in ids:
            raise InputError(f"node_id {node['node_id']!r} appears twice in the graph's nodes; node ids are unique")
        ids.add(node["node_id"])
        if KINDS[node["feature_type"]] not in ("embedding",) and not _integer(_int_or_none(node["layer"])):
            raise InputError(f"node {node['node_id']!r} has layer {node['layer']!r}; a non-embedding layer is a number")
    for i, link in enumerate(links):
        if not (isinstance(link, dict) and link.get("source") in ids and link.get("target") in ids):
            raise InputError(f"link {i} ({str(link)[:120]}) does not join two of the graph's node ids")
        w = link.get("weight")
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)):
            raise InputError(f"link {i} ({link['source']} → {link['target']}) has weight {w!r}; give a finite number")
    return data


_TOP_KEYS = (("metadata", dict), ("nodes", list), ("links", list))


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_or_none(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _number(value) -> str:
    """A number as the panel shows it (4 significant digits); "–" for None / NaN."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _finite(value) -> float | None:
    value = float(value)
    return round(value, 6) if math.isfinite(value) else None


def _cards(cards) -> dict:
    """The cards Dataset as {"L{layer}F{feature}": fields}, checked; {} for None."""
    if cards is None:
        return {}
    import xarray as xr

    if not isinstance(cards, xr.Dataset) or "card" not in cards.dims:
        raise InputError(
            f"cards must be the Dataset feature_cards(vlm, transcoders, samples, features) returns, got "
            f"{type(cards).__name__}"
        )
    lacking = [v for v in (*CARD_VARIABLES, "layer", "feature", "count") if v not in cards.variables]
    if lacking:
        raise InputError(f"the cards Dataset lacks {lacking}; give the Dataset feature_cards returns, unchanged")
    out = {}
    for i in range(cards.sizes["card"]):
        c = cards.isel(card=i)
        name = feature_label((int(c.layer), int(c.feature)))
        out[name] = {
            "scene": [int(s) for s in c.scene.values.ravel()],
            "max_activation": [_finite(v) for v in c.max_activation.values.ravel()],
            "fires_on_objects": _finite(c.fires_on_objects),
            "direct": [[int(n), _finite(v)] for n, v in zip(cards["count"].values, c.direct.values)],
            "ablated": _finite(c.ablated),
        }
    return out


def _kind_order(node) -> tuple:
    kind = KINDS[node["feature_type"]]
    influence = node.get("influence")
    influence = influence if isinstance(influence, (int, float)) and math.isfinite(influence) else 2.0
    return (list(KINDS.values()).index(kind), -float(node.get("token_prob") or 0), influence)


def _page_data(data: dict, cards: dict) -> dict:
    """What the page's script draws: nodes with their (x, y) and panel fields, links as
    [source index, target index, weight], the rows' and columns' labels, and the cards."""
    meta, nodes = data["metadata"], data["nodes"]
    tokens = list(meta.get("prompt_tokens") or [])
    n_pos = max([len(tokens), *(n["ctx_idx"] + 1 for n in nodes)])
    tokens += [""] * (n_pos - len(tokens))
    kinds = [KINDS[n["feature_type"]] for n in nodes]
    logit_layers = [int(n["layer"]) for n, k in zip(nodes, kinds) if k == "logit"]
    inner = [int(n["layer"]) for n, k in zip(nodes, kinds) if k in ("feature", "error")]
    n_layers = logit_layers[0] - 1 if logit_layers else max(inner, default=-1) + 1

    def row(node, kind) -> int:  # 0: embeddings; l + 1: layer l; n_layers + 1: logits
        return 0 if kind == "embedding" else n_layers + 1 if kind == "logit" else int(node["layer"]) + 1

    image = {n["ctx_idx"] for n in nodes if _IMAGE_CLERP.fullmatch(str(n.get("clerp", "")))}
    image |= {p for p, t in enumerate(tokens) if t in IMAGE_TOKENS}
    cells: dict[tuple[int, int], list[int]] = {}
    for i in sorted(range(len(nodes)), key=lambda i: _kind_order(nodes[i])):
        cells.setdefault((row(nodes[i], kinds[i]), nodes[i]["ctx_idx"]), []).append(i)
    widths = [IMAGE_W if p in image else TEXT_W for p in range(n_pos)]
    for (_, p), members in cells.items():
        widths[p] = max(widths[p], (len(members) - 1) * GAP + 10)
    starts = [LEFT + sum(widths[:p]) for p in range(n_pos)]
    n_rows = n_layers + 2
    xy = [(0.0, 0.0)] * len(nodes)
    for (r, p), members in cells.items():
        for j, i in enumerate(members):
            x = starts[p] + widths[p] / 2 + (j - (len(members) - 1) / 2) * GAP
            xy[i] = (round(x, 1), TOP + (n_rows - 1 - r) * ROW_H + ROW_H / 2)
    page_nodes = []
    for i, (node, kind) in enumerate(zip(nodes, kinds)):
        fields = _fields(node, kind, tokens)
        m = _FEATURE_ID.fullmatch(node["node_id"])
        card = feature_label((int(m.group(1)), int(m.group(2)))) if kind == "feature" and m else None
        page_nodes.append(
            {
                "id": node["node_id"],
                "kind": kind,
                "x": xy[i][0],
                "y": xy[i][1],
                "fields": fields,
                "card": card if card in cards else None,
            }
        )
    index = {n["node_id"]: i for i, n in enumerate(nodes)}
    links = [[index[e["source"]], index[e["target"]], float(f"{e['weight']:.4g}")] for e in data["links"]]
    runs, start = [], None  # image-token runs: [first, last]
    for p in range(n_pos + 1):
        if p < n_pos and p in image:
            start = p if start is None else start
        elif start is not None:
            runs.append([start, p - 1])
            start = None
    labels = ["embeddings", *(f"layer {i}" for i in range(n_layers)), "logits"]
    counts = {k: kinds.count(k) for k in KINDS.values()}
    return {
        "width": starts[-1] + widths[-1] + 16 if n_pos else LEFT + 16,
        "height": TOP + n_rows * ROW_H + BOTTOM,
        "rowH": ROW_H,
        "top": TOP,
        "rows": labels[::-1],
        "columns": [
            {"x": s, "w": w, "token": t, "image": p in image} for p, (s, w, t) in enumerate(zip(starts, widths, tokens))
        ],
        "imageRuns": runs,
        "nodes": page_nodes,
        "links": links,
        "cards": cards,
        "summary": [
            ["prompt", str(meta.get("prompt", ""))],
            ["transcoders", str(meta.get("scan", ""))],
            ["pruning", f"node threshold {_number(meta.get('node_threshold'))}"],
            [
                "graph scores",
                f"replacement {_number(meta.get('replacement_score'))}, completeness "
                f"{_number(meta.get('completeness_score'))} (circuit-tracer's; – from a JSON file)",
            ],
            ["nodes", ", ".join(f"{v} {k}s" for k, v in counts.items())],
            ["links", str(len(links))],
        ],
    }


def _fields(node: dict, kind: str, tokens: list[str]) -> list[list[str]]:
    """The panel's rows of one node: [name, value as shown]."""
    pos = node["ctx_idx"]
    out = [["node_id", node["node_id"]], ["kind", kind], ["layer", str(node["layer"])], ["position", str(pos)]]
    out.append(["token", tokens[pos] if pos < len(tokens) else ""])
    m = _FEATURE_ID.fullmatch(node["node_id"])
    if kind == "feature" and m:
        out.append(["feature", m.group(2)])
    if kind == "logit":
        out += [["vocab id", _number(node.get("feature"))], ["probability", _number(node.get("token_prob"))]]
    if kind == "feature":
        out.append(["activation", _number(node.get("activation"))])
    out.append(["influence", _number(node.get("influence"))])
    out.append(["clerp", str(node.get("clerp") or "")])
    image = _IMAGE_CLERP.fullmatch(str(node.get("clerp", ""))) if kind == "embedding" else None
    if image:
        row, col, obj = image.groups()
        out += [["cell", f"({row}, {col})"], ["object", obj if obj is not None else "none"]]
    return out


def _html(page: dict, title: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n<style>\n{BASE_CSS}{_CSS}</style>\n</head>\n<body>\n"
        f'<header><h1>{escape(title)}</h1><table id="summary"></table>{_LEGEND}</header>\n'
        '<div class="layout"><div id="figure"><svg id="graph" xmlns="http://www.w3.org/2000/svg"></svg></div>\n'
        '<aside id="side"><p id="hint">Hover over a node to see it; click to pin it and its links.</p>\n'
        '<div id="panel" hidden><h2 id="panel-id"></h2><table id="panel-fields"></table>'
        '<div id="panel-card" hidden><h3>Feature card</h3><table id="card-fields"></table>'
        '<table id="card-direct"><tr><th>count</th><th>direct effect</th></tr></table></div></div></aside></div>\n'
        f'<script type="application/json" id="graph-data">{json_script(page)}</script>\n'
        f"<script>\n{_SCRIPT}</script>\n</body>\n</html>\n"
    )


_LEGEND = (
    '<p id="legend"><span class="sw feature"></span>feature <span class="sw error"></span>error '
    '<span class="sw embedding"></span>embedding <span class="sw logit"></span>logit '
    '<span class="ln pos"></span>link adds to its target <span class="ln neg"></span>takes away '
    "(width ∝ |weight|)</p>"
)

_CSS = """\
header { padding: .5rem 1.5rem 0; } h1 { margin: .2rem 0; }
#summary th, #summary td { text-align: left; border: none; padding: 0 .6rem 0 0; }
#legend { font-size: 13px; } .sw, .ln { display: inline-block; width: 10px; height: 10px; margin: 0 3px 0 10px; }
.sw.feature { background: #4c6ef5; border-radius: 50%; } .sw.error { background: #adb5bd; }
.sw.embedding { background: #40c057; } .sw.logit { background: #e64980; transform: rotate(45deg); }
.ln { height: 3px; vertical-align: middle; width: 18px; }
.ln.pos { background: #e8590c; } .ln.neg { background: #1c7ed6; }
/* The layout's height is fixed and each side scrolls inside it: a panel that grows or shrinks with the
   node hovered must not change the page's height, or a scrolled page moves under the pointer. */
.layout { display: flex; gap: 1rem; padding: 0 1rem; height: 85vh; }
#figure { flex: 1; overflow: auto; border: 1px solid #dde; }
#side { flex: none; width: 330px; overflow-y: auto; font-size: 13px; }
#panel h2 { font-size: 1.1rem; word-break: break-all; } #panel th, #card-fields th { text-align: left; }
#panel td { text-align: left; word-break: break-word; }
.node { cursor: pointer; stroke: #fff; stroke-width: 1; } .node:hover, .node.on { stroke: #000; stroke-width: 2; }
.link { stroke-opacity: .35; } svg.focus .link { stroke-opacity: .06; } svg.focus .link.on { stroke-opacity: .9; }
.row-label { font-size: 11px; fill: #555; } .token { font-size: 10px; fill: #333; }
.band { fill: #f6f7fa; }
"""

_SCRIPT = r"""'use strict';
(function () {
  const data = JSON.parse(document.getElementById('graph-data').textContent);
  const NS = 'http://www.w3.org/2000/svg';
  const COLOUR = {feature: '#4c6ef5', error: '#adb5bd', embedding: '#40c057', logit: '#e64980'};
  const svg = document.getElementById('graph');
  svg.setAttribute('width', data.width); svg.setAttribute('height', data.height);
  function el(tag, attrs, parent, text) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function rows(table, pairs) {
    for (const [k, v] of pairs) {
      const tr = document.createElement('tr'); tr.dataset.field = k;
      const th = document.createElement('th'); th.textContent = k;
      const td = document.createElement('td'); td.textContent = v;
      tr.append(th, td); table.appendChild(tr);
    }
  }
  rows(document.getElementById('summary'), data.summary);
  const back = el('g', {}, svg);
  data.rows.forEach((label, r) => {
    const y = data.top + r * data.rowH;
    if (r % 2 === 0) el('rect', {class: 'band', x: 0, y: y, width: data.width, height: data.rowH}, back);
    el('text', {class: 'row-label', x: 6, y: y + data.rowH / 2 + 4}, back, label);
  });
  const base = data.top + data.rows.length * data.rowH;
  data.columns.forEach((c, p) => {
    if (c.image) return;
    const x = c.x + c.w / 2;
    el('text', {class: 'token', x: x, y: base + 10, transform: `rotate(50 ${x} ${base + 10})`}, back, c.token);
  });
  for (const [a, b] of data.imageRuns) {
    const x0 = data.columns[a].x, x1 = data.columns[b].x + data.columns[b].w;
    el('path', {d: `M${x0} ${base + 4}v6H${x1}v-6`, fill: 'none', stroke: '#40c057'}, back);
    el('text', {class: 'token', x: (x0 + x1) / 2 - 20, y: base + 24}, back, `image × ${b - a + 1}`);
  }
  const linkLayer = el('g', {}, svg), nodeLayer = el('g', {}, svg);
  const maxW = Math.max(1e-30, ...data.links.map(l => Math.abs(l[2])));
  const touching = data.nodes.map(() => []);
  for (const [s, t, w] of data.links) {
    const a = data.nodes[s], b = data.nodes[t];
    const line = el('line', {class: 'link', x1: a.x, y1: a.y, x2: b.x, y2: b.y,
      stroke: w >= 0 ? '#e8590c' : '#1c7ed6', 'stroke-width': (0.4 + 4 * Math.abs(w) / maxW).toFixed(2)}, linkLayer);
    touching[s].push(line); touching[t].push(line);
  }
  const marks = data.nodes.map((n, i) => {
    let m;
    const at = {class: `node kind-${n.kind}`, 'data-id': n.id, tabindex: 0, role: 'button', fill: COLOUR[n.kind]};
    if (n.kind === 'feature') m = el('circle', {...at, cx: n.x, cy: n.y, r: 5}, nodeLayer);
    else if (n.kind === 'logit') m = el('rect', {...at, x: n.x - 5, y: n.y - 5, width: 10, height: 10,
      transform: `rotate(45 ${n.x} ${n.y})`}, nodeLayer);
    else { const s = n.kind === 'error' ? 9 : 7;
      m = el('rect', {...at, x: n.x - s / 2, y: n.y - s / 2, width: s, height: s}, nodeLayer); }
    const clerp = n.fields.find(f => f[0] === 'clerp')[1];
    el('title', {}, m, clerp ? `${n.id} — ${clerp}` : n.id);
    m.addEventListener('mouseenter', () => show(i));
    m.addEventListener('mouseleave', () => pinned === null ? hide() : show(pinned));
    m.addEventListener('click', ev => { ev.stopPropagation(); pin(i); });
    m.addEventListener('keydown', ev => { if (ev.key === 'Enter' || ev.key === ' ') { ev.preventDefault(); pin(i); } });
    return m;
  });
  let pinned = null;
  const panel = document.getElementById('panel'), hint = document.getElementById('hint');
  function show(i) {
    const n = data.nodes[i];
    document.getElementById('panel-id').textContent = n.id;
    const table = document.getElementById('panel-fields'); table.replaceChildren(); rows(table, n.fields);
    const card = n.card ? data.cards[n.card] : null, box = document.getElementById('panel-card');
    box.hidden = !card;
    if (card) {
      const f = v => v === null ? '–' : Number(v).toPrecision(4);
      const t = document.getElementById('card-fields'); t.replaceChildren();
      rows(t, [['card', n.card], ['top scenes', card.scene.join(', ')],
        ['max activation', card.max_activation.map(f).join(', ')],
        ['fires on objects', card.fires_on_objects === null ? '–' : (100 * card.fires_on_objects).toFixed(0) + ' %'],
        ['ablated Δ log p', f(card.ablated)]]);
      const d = document.getElementById('card-direct');
      while (d.rows.length > 1) d.deleteRow(1);
      rows(d, card.direct.map(([c, v]) => [String(c), f(v)]));
    }
    panel.hidden = false; hint.hidden = true;
  }
  function hide() { panel.hidden = true; hint.hidden = false; }
  function pin(i) {
    unpin();
    pinned = i; marks[i].classList.add('on'); touching[i].forEach(l => l.classList.add('on'));
    svg.classList.add('focus'); show(i);
  }
  function unpin() {
    if (pinned === null) return;
    marks[pinned].classList.remove('on'); touching[pinned].forEach(l => l.classList.remove('on'));
    pinned = null; svg.classList.remove('focus');
  }
  svg.addEventListener('click', () => { unpin(); hide(); });
})();
"""
