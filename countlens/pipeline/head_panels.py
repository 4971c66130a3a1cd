"""What report.html shows of each head: the layer × head grid's colour layers and one panel per head.

The grid can be coloured by each per-head result the run holds: the signed patching effect
(``results/heads.nc``), AtP's and EAP-IG's estimates of it (``results/atp.nc``, ``results/eap_ig.nc``)
where the run has them, the numeric columns of the head table (``heads.csv``: importance, ablation
drop, image attention, VGS, CTER, …) and the class. A head's panel holds its row of the head table
as it is in ``heads.csv``, the three patching numbers, the tokens HeadLens decodes from it most often
(``results/headlens.nc``), the classification rules with the thresholds of the run's preset and
whether the head meets each (`class_rules`, the rules of `countlens.analysis.heads.classify_heads`),
and its attention on sample images (`head_images`). Everything is JSON-ready; `countlens.pipeline.html_report`
embeds it in the page, and ``templates/report.js`` draws it.
"""

from __future__ import annotations

import io
import math
from collections import Counter

import numpy as np
import pandas as pd
import xarray as xr

from countlens.analysis.heads import CLASSES, shown_columns
from countlens.analysis.overlays import head_overlays_png
from countlens.labels import head_label
from countlens.pipeline import presets
from countlens.pipeline.stages.base import ReportContext

#: The patching results a grid can be coloured by, when the run has them: (stage, label).
PATCHING: tuple[tuple[str, str], ...] = (
    ("heads", "patching effect (signed, exact)"),
    ("atp", "AtP estimate of the patching effect"),
    ("eap_ig", "EAP-IG estimate of the patching effect"),
)
#: Head-table columns that are no measurement of the head (its place, or its layer's kind).
_NOT_MEASURES = ("head_id", "layer", "head", "class", "kind", "depth")
#: The decoded tokens a panel lists: the most frequent among every sample's HeadLens top-k.
TOP_TOKENS = 8


def head_images(maps: xr.Dataset | None, layer: int, head: int) -> list[tuple[str, bytes]]:
    """The head's attention on sample images, as (caption, PNG bytes), for its panel: none unless the
    run's ``attention_maps`` result (the attention-maps stage, ``maps``) holds this head's maps."""
    if maps is None:
        return []
    stored = (maps.site_layer.values == layer) & (maps.site_head.values == head)
    if not stored.any():  # a large model's run keeps only its top heads' maps (the stage's size rule)
        return []
    # The one place the attention-maps stage is wired in: its overlays of this head's maps on the samples.
    return head_overlays_png(maps, layer, head)


def _finite(x) -> float | None:
    """JSON has no NaN: a missing number is null."""
    x = float(x)
    return x if math.isfinite(x) else None


def class_rules(thresholds) -> list[dict]:
    """The classification rules of `countlens.analysis.heads.classify_heads` in its order (first match
    wins) under ``thresholds`` (`countlens.settings.HeadThresholds`): each rule is met when all the
    conditions of any one of its ``any_of`` lists are; a condition is (column, comparison, threshold
    name, threshold value). A threshold that switches a test off (align_min 0, difficulty_min None)
    drops its condition, as the rules do."""
    t = thresholds
    routing_to = ("late", t.late) if t.routing_to is None else ("routing_to", t.routing_to)
    numeric_important = [("cter", ">=", "cter_min", t.cter_min), ("importance", ">=", "important", t.important)]
    grounding = [
        ("depth", "<=", "early", t.early),
        ("image_attention", ">=", "image_high", t.image_high),
        ("vgs", ">=", "vgs_min", t.vgs_min),
    ]
    routing = [
        ("depth", ">=", "routing_from", t.routing_from),
        ("depth", "<", *routing_to),
        ("image_attention", ">=", "image_high", t.image_high),
        *numeric_important,
    ]
    aggregation = [("depth", ">=", "late", t.late), ("image_attention", "<", "image_low", t.image_low)]
    aggregation += numeric_important + ([("alignment", ">=", "align_min", t.align_min)] if t.align_min > 0 else [])
    awareness = [[("constancy", ">=", "constant", t.constant)]]
    if t.difficulty_min is not None:
        awareness.append([("difficulty", ">=", "difficulty_min", t.difficulty_min)])
    rules = zip(CLASSES, ([grounding], [routing], [aggregation], awareness))
    fields = ("column", "op", "name", "threshold")
    return [{"class": name, "any_of": [[dict(zip(fields, c)) for c in conj] for conj in ors]} for name, ors in rules]


_OPS = {">=": np.greater_equal, "<=": np.less_equal, "<": np.less}


def _met(row: pd.Series, cond: dict) -> bool:
    value = float(row.get(cond["column"], np.nan))
    return bool(_OPS[cond["op"]](value, cond["threshold"]))  # NaN meets none, as in classify_heads


def _rules_for(row: pd.Series, rules: list[dict]) -> tuple[list[dict], str]:
    """Every rule with each condition's head value and whether it is met, and the class they give."""
    shown, given = [], CLASSES[-1]
    for rule in rules:
        ors = [
            [{**c, "value": _finite(row.get(c["column"], np.nan)), "met": _met(row, c)} for c in conj]
            for conj in rule["any_of"]
        ]
        matched = any(all(c["met"] for c in conj) for conj in ors)
        if matched and given == CLASSES[-1]:
            given = rule["class"]
        shown.append({"class": rule["class"], "any_of": ors, "matched": matched})
    return shown, given


def _top_tokens(hl: xr.Dataset) -> dict[tuple[int, int], list[tuple[str, float]]]:
    """Per head, the tokens most often among its decoded top-k, with the share of samples that have them."""
    tokens = hl.token.transpose("layer", "head", "sample", "k").values
    n_samples = tokens.shape[2]
    out = {}
    for (la, h), _ in np.ndenumerate(tokens[:, :, 0, 0]):
        counts = Counter()
        for sample in tokens[la, h]:
            # A sample counts a token once; ties keep the order the tokens were decoded in (a set's
            # order would change with the string hash seed, and the page with it).
            counts.update(list(dict.fromkeys(str(t) for t in sample)))
        out[(int(hl["layer"].values[la]), int(hl["head"].values[h]))] = [
            (tok, n / n_samples) for tok, n in counts.most_common(TOP_TOKENS)
        ]
    return out


def _grid_values(values: dict[tuple[int, int], float], n_layers: int, n_heads: int) -> list[list[float | None]]:
    return [[values.get((la, h)) for h in range(n_heads)] for la in range(n_layers)]


def head_data(ctx: ReportContext) -> dict:
    """The grid's colour layers and every head's panel, from the run's head table and stored results.
    The panels' images are left to the page builder, which asks `head_images` for as many heads as
    the page holds."""
    # The table as heads.csv holds it (`export_heads` writes this CSV): a float32 measurement computed
    # by discover reads back from heads.csv as the shorter float64 its CSV text spells.
    table = pd.read_csv(io.StringIO(shown_columns(ctx.table).to_csv(index=False)))
    spec_thresholds = presets.thresholds(ctx.spec.get("preset", ""))
    rules = class_rules(spec_thresholds)
    n_layers, n_heads = int(table["layer"].max()) + 1, int(table["head"].max()) + 1
    sites = [(int(la), int(h)) for la, h in zip(table["layer"], table["head"])]

    metrics = []
    patching = {}
    for stage, label in PATCHING:
        if stage in ctx.results and "effect" in ctx.results[stage]:
            effect = ctx.results[stage].effect
            values = {s: _finite(effect.sel(layer=s[0], head=s[1])) for s in sites}
            patching[stage] = (label, values)
            metrics.append({"key": stage, "label": label, "source": f"results/{stage}.nc", "signed": True})
            metrics[-1]["values"] = _grid_values(values, n_layers, n_heads)
    for column in (c for c in table.columns if c not in _NOT_MEASURES):
        values = {s: _finite(v) for s, v in zip(sites, table[column])}
        if all(v is None for v in values.values()):
            continue
        signed = any(v is not None and v < 0 for v in values.values())
        metrics.append(
            {"key": column, "label": column, "source": "heads.csv", "signed": signed}
            | {"values": _grid_values(values, n_layers, n_heads)}
        )
    by_site = dict(zip(sites, table["class"]))
    metrics.append(
        {"key": "class", "label": "class", "source": "heads.csv", "categories": list(CLASSES)}
        | {"values": _grid_values(by_site, n_layers, n_heads)}
    )

    tokens = _top_tokens(ctx.results["headlens"]) if "headlens" in ctx.results else {}
    heads = {}
    for (_, row), site in zip(table.iterrows(), sites):
        shown, given = _rules_for(row, rules)
        heads[head_label(site)] = {
            "id": head_label(site),
            "layer": site[0],
            "head": site[1],
            "class": row["class"],
            "numbers": [[c, _finite(v) if isinstance(v, (int, float, np.number)) else str(v)] for c, v in row.items()],
            "patching": [[label, values[site]] for label, values in patching.values()],
            "tokens": [[tok, share] for tok, share in tokens.get(site, [])],
            "rules": shown,
            "rules_class": given,
        }
    return {
        "n_layers": n_layers,
        "n_heads": n_heads,
        "metrics": metrics,
        "heads": heads,
        "preset": f"preset {ctx.spec['preset']}" if ctx.spec.get("preset") else "countlens's defaults",
        "attention_maps": "attention_maps" in ctx.results,
    }
