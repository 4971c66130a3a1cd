"""Recovery of a known circuit: how well a method's ranking of heads finds a circuit planted in advance.

A discovery method scores every head (exact patching, AtP, EAP-IG, an ablation drop …); on an
organism whose circuit C is known (`countlens.toy.planted`), its ranking is scored as InterpBench
(Gupta et al. 2024) and the MIB benchmark score theirs:

- **AUROC**: the probability that a head of C scores higher, in |score|, than a head outside it (ties
  count one half) — the Mann–Whitney U statistic divided by |C|·|not C|. 1 is a perfect ranking, 0.5
  a random one.
- **precision@k**: the share of C among the top k heads by |score| (k = |C| by default, where
  precision and recall coincide). Ties at the k-th score are broken by head order, as
  `countlens.circuits.graph.faithfulness` ranks nodes.

Heads that do not exist (NaN beyond a layer's own heads) are left out of both; a ±inf score is
refused, naming its cell, as it would rank first whatever it means. The circuit's heads are read
by `countlens.labels.head_keys`: (layer, head) pairs or labels such as ``"L3H2"``, one head alone or
a collection, never empty or a head twice.

Over any named nodes (`node_recovery`: heads and MLPs by label, as an organism whose MLPs are nodes
needs) the same two figures, ties at the k-th score broken by the scores' order.

At object level (`object_recovery`) the same two figures score a per-object score over (scene,
object) — exact object effects or an attribution — against the objects an organism counts by design
(``sample.meta["top"]`` of the top-half organism, `countlens.toy.regions`): objects pooled over scenes,
precision at k = the number of counted objects.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import xarray as xr

from countlens.errors import InputError
from countlens.labels import head_keys, head_label
from countlens.validate import require_integer

_INF_FIX = "an inf ranks first whatever it means: score with finite values (a degenerate denominator gives inf)"


def _split(scores: xr.DataArray, circuit) -> tuple[np.ndarray, np.ndarray, list, set]:
    """(|scores| of C's heads, |scores| of the other heads, the existing heads in order, C)."""
    if not isinstance(scores, xr.DataArray) or set(scores.dims) != {"layer", "head"}:
        raise InputError(
            f"a ranking of heads is a DataArray with dims (layer, head); got {getattr(scores, 'dims', scores)!r:.60}"
        )
    c = set(head_keys(circuit, "circuit"))
    s = np.abs(scores.transpose("layer", "head").values.astype(float))
    layers, heads = scores["layer"].values.tolist(), scores["head"].values.tolist()
    cells = [(layer, head) for layer in layers for head in heads]
    flat = s.reshape(-1)
    infinite = [head_label(cell) for cell, v in zip(cells, flat, strict=True) if np.isinf(v)]
    if infinite:
        raise InputError(
            f"the ranking holds ±inf at {', '.join(infinite[:5])}{' …' if len(infinite) > 5 else ''}; {_INF_FIX}"
        )
    exists = ~np.isnan(flat)
    missing = c - {cell for cell, e in zip(cells, exists, strict=True) if e}
    if missing:
        raise InputError(
            f"circuit heads {sorted(missing)} are not heads of the ranking (layers {layers}, heads {heads})"
        )
    inside = np.array([cell in c for cell in cells])
    if inside.sum() == exists.sum():
        raise InputError("the circuit holds every head: there is nothing outside it to rank below")
    kept = [cell for cell, e in zip(cells, exists, strict=True) if e]
    return flat[inside & exists], flat[~inside & exists], kept, c


def auroc(scores: xr.DataArray, circuit: Collection[tuple[int, int] | str]) -> float:
    """P(|score| of a head of ``circuit`` > |score| of a head outside it), ties one half."""
    pos, neg = _split(scores, circuit)[:2]
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


def precision_at(scores: xr.DataArray, circuit: Collection[tuple[int, int] | str], k: int | None = None) -> float:
    """Share of ``circuit`` among the top ``k`` heads by |score| (default k = |circuit|)."""
    _, _, cells, members = _split(scores, circuit)
    k = len(members) if k is None else require_integer(k, "precision_at: k (how many top heads)")
    if not 1 <= k <= len(cells):
        raise InputError(f"k={k}: choose 1 ≤ k ≤ {len(cells)} (the heads ranked)")
    flat = np.abs(scores.transpose("layer", "head").values.astype(float)).reshape(-1)
    values = flat[~np.isnan(flat)]
    order = np.argsort(-values, kind="stable")[:k]  # ties: head order
    return float(sum(cells[i] in members for i in order) / k)


def _mann_whitney(pos: np.ndarray, neg: np.ndarray) -> float:
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


def node_recovery(scores: Mapping[str, float], circuit: Collection[str]) -> dict:
    """AUROC and precision@|C| of |``scores``| (node label → score, e.g. ``L0H2``, ``MLP1``) against the
    nodes ``circuit`` names; NaN scores are left out, ±inf ones refused."""
    infinite = [k for k, v in scores.items() if np.isinf(v)]
    if infinite:
        raise InputError(f"node scores hold ±inf at {', '.join(map(str, infinite[:5]))}; {_INF_FIX}")
    live = {k: abs(float(v)) for k, v in scores.items() if not np.isnan(v)}
    members = {circuit} if isinstance(circuit, str) else set(circuit)
    if not members:
        raise InputError("circuit is empty: name the circuit's nodes, e.g. {'L0H2', 'MLP1'}")
    missing = members - set(live)
    if missing:
        raise InputError(f"circuit nodes {sorted(missing)} are not scored (scored: {sorted(live)[:6]}…)")
    pos = np.array([v for k, v in live.items() if k in members])
    neg = np.array([v for k, v in live.items() if k not in members])
    if not len(neg):
        raise InputError("the circuit holds every node: there is nothing outside it to rank below")
    order = sorted(live, key=lambda k: -live[k])[: len(members)]  # stable: ties keep the scores' order
    return {
        "auroc": round(_mann_whitney(pos, neg), 4),
        "precision": round(sum(k in members for k in order) / len(members), 4),
    }


def object_recovery(scores: xr.DataArray, samples: Sequence, key: str = "top") -> dict:
    """AUROC and precision@|C| of |``scores``| (dims scene, object; NaN: no object or no token) against
    each sample's ``meta[key]`` (one flag per object: counted by design), with the mean |score| and its
    normal 95 % interval on each side."""
    if set(scores.dims) != {"scene", "object"}:
        raise InputError(f"object scores have dims (scene, object); got {scores.dims}")
    s = np.abs(scores.transpose("scene", "object").values.astype(float))
    if s.shape[0] != len(samples):
        raise InputError(f"{s.shape[0]} scenes of scores for {len(samples)} samples: give the samples scored")
    infinite = [f"scene {a}, object {b}" for a, b in zip(*np.nonzero(np.isinf(s)), strict=True)]
    if infinite:
        raise InputError(f"object scores hold ±inf at {'; '.join(infinite[:5])}; {_INF_FIX}")
    truth = np.zeros_like(s, dtype=bool)
    for k, sample in enumerate(samples):
        flags = (getattr(sample, "meta", None) or {}).get(key)
        if flags is None or len(flags) > s.shape[1]:
            raise InputError(f"sample {k} has no meta[{key!r}] flag per object: score an organism's own scenes")
        truth[k, : len(flags)] = flags
    live = ~np.isnan(s)
    pos, neg = s[live & truth], s[live & ~truth]
    if not len(pos) or not len(neg):
        raise InputError("object recovery needs objects on both sides: counted and not counted")
    order = np.argsort(-s[live], kind="stable")[: len(pos)]

    def mean_ci(x):
        se = float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")
        return round(float(x.mean()), 4), [
            round(float(x.mean()) - 1.959964 * se, 4),
            round(float(x.mean()) + 1.959964 * se, 4),
        ]

    (pm, pci), (nm, nci) = mean_ci(pos), mean_ci(neg)
    return {
        "auroc": round(_mann_whitney(pos, neg), 4),
        "precision": round(float(truth[live][order].mean()), 4),
        "counted": int(len(pos)),
        "ignored": int(len(neg)),
        "counted_mean_abs": pm,
        "counted_ci95": pci,
        "ignored_mean_abs": nm,
        "ignored_ci95": nci,
    }
