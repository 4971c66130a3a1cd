"""Attribution graphs as files: circuit-tracer's viewer JSON, and an xarray Dataset.

**The JSON** (`graph_json`, `save_graph`) is the format circuit-tracer's graph viewer reads
(``create_graph_files``): an object with

- ``metadata``: ``slug``, ``scan``, ``transcoder_list`` ([]), ``prompt_tokens`` (the prompt's tokens
  as strings), ``prompt``, ``node_threshold`` (the pruning threshold, or null), ``schema_version`` 1;
- ``qParams``: ``pinnedIds`` [], ``supernodes`` [], ``linkType`` "both", ``clickedId`` "", ``sg_pos`` "";
- ``nodes``: one object per node with ``node_id``, ``feature``, ``layer`` (a string), ``ctx_idx``
  (position), ``feature_type``, ``token_prob``, ``is_target_logit``, ``run_idx`` 0,
  ``reverse_ctx_idx`` 0, ``jsNodeId``, ``clerp`` (a label), ``influence``, ``activation``;
- ``links``: ``{source, target, weight}`` for every non-zero edge, ``weight = A[target, source]``.

Node ids, per kind (``cantor(l, f) = (l + f)(l + f + 1)/2 + f``):

| kind | node_id | feature | layer | feature_type | jsNodeId |
|---|---|---|---|---|---|
| feature | ``{l}_{f}_{pos}`` | cantor(l, f) | ``l`` | cross layer transcoder | ``{l}_{f}-0`` |
| error | ``0_{l}_{pos}`` | −1 | ``l`` | mlp reconstruction error | ``{l}_{pos}-0`` |
| embedding | ``E_{token id}_{pos}`` | pos | ``E`` | embedding | ``E_{token id}-{pos}`` |
| logit | ``{n_layers+1}_{vocab id}_{last}`` | vocab id | ``n_layers+1`` | logit | ``L_{vocab id}-{last}`` |

A logit's ``clerp`` is ``Output "{token}" (p=0.123)``, ``token_prob`` its probability and
``is_target_logit`` true for the most probable only. An image token's embedding clerp names its cell
and object: ``image cell (r, c), object 2`` (``no object`` where none). ``influence`` is the node's
cumulative influence share (`countlens.features.prune`; computed here for an unpruned graph).

**The Dataset** (`graph_dataset`): ``adjacency`` over (``target``, ``source``), both indexing the
nodes, with node coordinates ``kind``, ``layer`` (−1 for embeddings, ``n_layers`` for logits),
``position``, ``feature`` (feature index, vocab id for a logit, −1 otherwise), ``object`` (the
object of the node's position, −1 if none), ``node_id``; plus ``activation``, ``value``,
``constant`` and ``influence`` over ``node``; its attrs hold circuit-tracer's graph scores,
``replacement_score`` and ``completeness_score`` (`countlens.features.scores`; NaN for a graph
without logit nodes), with the prompt, scan, layers, answer token and pruning thresholds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from countlens.errors import InputError
from countlens.features.graph import AttributionGraph
from countlens.features.prune import cumulative_share, node_influence
from countlens.features.scores import graph_scores
from countlens.files import atomic_path

if TYPE_CHECKING:
    import xarray as xr


def cantor(a: int, b: int) -> int:
    """Cantor's pairing of two naturals, ``(a + b)(a + b + 1)/2 + b`` (circuit-tracer's feature ids)."""
    return (a + b) * (a + b + 1) // 2 + b


def _check(graph, what: str) -> AttributionGraph:
    if not isinstance(graph, AttributionGraph):
        raise InputError(f"{what} takes an AttributionGraph (attribution_graph(...)), got {type(graph).__name__}")
    return graph


def _node_rows(graph: AttributionGraph) -> list[dict]:
    """Per node: kind, layer, position, feature, object, node_id, jsNodeId, clerp, activation."""
    rows = []
    for (layer, pos, f), act in zip(graph.features.tolist(), graph.activations.tolist()):
        rows.append(
            {
                "kind": "feature",
                "layer": layer,
                "position": pos,
                "feature": f,
                "node_id": f"{layer}_{f}_{pos}",
                "js": f"{layer}_{f}-0",
                "clerp": "",
                "activation": act,
            }
        )
    for layer, pos in graph.errors.tolist():
        rows.append(
            {
                "kind": "error",
                "layer": layer,
                "position": pos,
                "feature": -1,
                "node_id": f"0_{layer}_{pos}",
                "js": f"{layer}_{pos}-0",
                "clerp": "",
                "activation": None,
            }
        )
    for pos in graph.embeddings.tolist():
        token = int(graph.tokens[pos])
        row, col = graph.cells[pos].tolist()
        obj = int(graph.objects[pos])
        if row >= 0:
            clerp = f"image cell ({row}, {col}), " + (f"object {obj}" if obj >= 0 else "no object")
        else:
            clerp = f'Embedding "{graph.token_strings[pos]}"'
        rows.append(
            {
                "kind": "embedding",
                "layer": -1,
                "position": pos,
                "feature": -1,
                "node_id": f"E_{token}_{pos}",
                "js": f"E_{token}-{pos}",
                "clerp": clerp,
                "activation": None,
            }
        )
    last, top = graph.last, graph.n_layers + 1
    for v, p, s in zip(graph.logit_tokens.tolist(), graph.logit_probs.tolist(), graph.logit_strings):
        rows.append(
            {
                "kind": "logit",
                "layer": graph.n_layers,
                "position": last,
                "feature": v,
                "node_id": f"{top}_{v}_{last}",
                "js": f"L_{v}-{last}",
                "clerp": f'Output "{s}" (p={p:.3f})',
                "activation": None,
                "prob": p,
            }
        )
    return rows


def _influence(graph: AttributionGraph) -> np.ndarray:
    if graph.influence is not None:
        return graph.influence.numpy()
    return cumulative_share(node_influence(graph)).numpy()


def graph_json(graph: AttributionGraph, slug: str, scan: str | None = None, prompt_tokens=None) -> dict:
    """The graph in circuit-tracer's viewer format (see the module's docstring). ``scan`` defaults to
    the transcoders' scan name, ``prompt_tokens`` to the graph's token strings."""
    _check(graph, "graph_json")
    if not isinstance(slug, str) or not slug:
        raise InputError(f"slug must be a non-empty name for the graph, e.g. 'toy-count-3'; got {slug!r}")
    scan = graph.scan if scan is None else scan
    if not isinstance(scan, str):
        raise InputError(f"scan must be a string (the transcoders' name), got {type(scan).__name__}")
    tokens = graph.token_strings if prompt_tokens is None else prompt_tokens
    if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, str) for t in tokens):
        raise InputError("prompt_tokens must be a list of strings, one per position")
    tokens = list(tokens)
    rows, infl = _node_rows(graph), _influence(graph)
    n_logit = graph.start("logit")
    nodes = []
    for i, r in enumerate(rows):
        kind = r["kind"]
        nodes.append(
            {
                "node_id": r["node_id"],
                "feature": cantor(r["layer"], r["feature"])
                if kind == "feature"
                else (r["position"] if kind == "embedding" else r["feature"]),
                "layer": "E" if kind == "embedding" else str(r["layer"] + (1 if kind == "logit" else 0)),
                "ctx_idx": r["position"],
                "feature_type": {
                    "feature": "cross layer transcoder",
                    "error": "mlp reconstruction error",
                    "embedding": "embedding",
                    "logit": "logit",
                }[kind],
                "token_prob": r.get("prob", 0.0),
                "is_target_logit": i == n_logit,
                "run_idx": 0,
                "reverse_ctx_idx": 0,
                "jsNodeId": r["js"],
                "clerp": r["clerp"],
                "influence": float(infl[i]),
                "activation": r["activation"],
            }
        )
    a = graph.adjacency
    target, source = a.nonzero(as_tuple=True)
    ids = [r["node_id"] for r in rows]
    links = [
        {"source": ids[s], "target": ids[t], "weight": float(wt)}
        for t, s, wt in zip(target.tolist(), source.tolist(), a[target, source].tolist())
    ]
    return {
        "metadata": {
            "slug": slug,
            "scan": scan,
            "transcoder_list": [],
            "prompt_tokens": tokens,
            "prompt": graph.prompt,
            "node_threshold": graph.node_threshold,
            "schema_version": 1,
        },
        "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
        "nodes": nodes,
        "links": links,
    }


def save_graph(graph: AttributionGraph, path: str | Path, slug: str | None = None) -> Path:
    """Write `graph_json` to ``path`` (slug default: the file's stem); returns the path."""
    _check(graph, "save_graph")
    if not isinstance(path, (str, Path)) or not str(path):
        raise InputError(f"save_graph takes a file path, e.g. 'graph.json'; got {path!r}")
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a folder; give save_graph a file path such as {path / 'graph.json'}")
    if slug is not None and not isinstance(slug, str):
        raise InputError(f"slug must be a name for the graph (or None for the file's stem), got {slug!r:.60}")
    data = graph_json(graph, slug or path.stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(data))
    return path


def graph_dataset(graph: AttributionGraph) -> xr.Dataset:
    """The graph as an `xr.Dataset` (see the module's docstring)."""
    import xarray as xr

    _check(graph, "graph_dataset")
    rows = _node_rows(graph)
    n = graph.n_nodes
    position = np.array([r["position"] for r in rows], dtype=np.int64)
    coords = {
        "kind": ("node", np.array([r["kind"] for r in rows], dtype=object)),
        "layer": ("node", np.array([r["layer"] for r in rows], dtype=np.int64)),
        "position": ("node", position),
        "feature": ("node", np.array([r["feature"] for r in rows], dtype=np.int64)),
        "object": ("node", graph.objects.numpy()[position] if n else np.zeros(0, dtype=np.int64)),
        "node_id": ("node", np.array([r["node_id"] for r in rows], dtype=object)),
    }
    activation = np.array([np.nan if r["activation"] is None else r["activation"] for r in rows], dtype=np.float32)
    ds = xr.Dataset(
        {
            "activation": ("node", activation),
            "value": ("node", graph.values.numpy()),
            "constant": ("node", graph.constant.numpy()),
            "influence": ("node", _influence(graph).astype(np.float32)),
        },
        coords={"node": np.arange(n), **coords},
    )
    ds["adjacency"] = xr.DataArray(
        graph.adjacency.numpy(),
        dims=("target", "source"),
        coords={
            "target": np.arange(n),
            "source": np.arange(n),
            **{f"target_{k}": ("target", v[1]) for k, v in coords.items()},
            **{f"source_{k}": ("source", v[1]) for k, v in coords.items()},
        },
    )
    ds["adjacency"].attrs["meaning"] = "A[target, source]: the source's direct effect on the target's value"
    scores = graph_scores(graph) if graph.n_logits else {"replacement": np.nan, "completeness": np.nan}
    ds.attrs.update(
        {
            "prompt": graph.prompt,
            "scan": graph.scan,
            "n_layers": graph.n_layers,
            "answer_token": graph.answer_token,
            "node_threshold": -1.0 if graph.node_threshold is None else graph.node_threshold,
            "edge_threshold": -1.0 if graph.edge_threshold is None else graph.edge_threshold,
            **{f"{k}_score": float(v) for k, v in scores.items()},
        }
    )
    return ds
