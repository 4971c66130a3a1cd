"""Misses: on wrongly counted scenes, which object carries least of the answer — by placement, size
and contact, with 95 % confidence intervals.

Reads an `countlens.circuits.objects.effects` result (dims ``scene``, ``object``). Definitions:

- **Wrongly counted**: a scene whose ``clean_correct`` is False (the arg-max at the read position is
  not the true answer's token), unless ``wrong`` (Bool over ``scene``) says otherwise.
- **Missed object**: in a wrongly counted scene, the object(s) with the least ``effect`` among those
  that cover a token (ties: each tied object). Objects covering no token (``n_tokens`` 0, effect NaN)
  are left out of every row and counted in the ``hidden`` attr; a NaN or ±inf effect of an object
  that covers tokens (not measured, or a broken result) is refused, naming its scene and object.
- **Groups** (the ``group`` dim: "all", or "factor:level" such as "placement:edge"): one row per
  level of three factors — ``placement`` (centred / edge / intersection),
  ``size`` (patches, binned at ``size_bins``: "<0.75", "0.75-1.25", …) and ``contact`` (touches /
  apart) — plus ``all``.
- ``mean_effect``: the mean ``effect`` of the group's objects over every scene; its CI is a
  percentile bootstrap over scenes (``n_boot`` resamples of the scenes with replacement, seed
  ``seed``; a resample's mean is Σ effect / Σ objects of the group over the drawn scenes).
- ``missed_rate``: missed objects / objects of the group in wrongly counted scenes; its CI is
  Wilson's score interval (`countlens.intervals.wilson`). NaN where the group has no such object.
  ``chance_rate``: the rate were
  the missed object drawn uniformly among its scene's measured objects (Σ over wrongly counted
  scenes of the group's objects there / the scene's objects, over the group's objects there) — the
  baseline a placement must beat to be "missed more".

`run_misses` is the table of a discover run's stored ``objects`` result, wrongly counted meaning
answered wrong by the run itself; `shown_rows` gives rows as text (value [CI]) for report.md and
compare.md.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from countlens.errors import InputError
from countlens.intervals import wilson
from countlens.validate import require_count, require_dataset, require_seed, require_share


def _size_labels(size_bins) -> list[str]:
    try:
        edges = [float(b) for b in size_bins]
    except (TypeError, ValueError):
        edges = []
    if (
        isinstance(size_bins, str)
        or not edges
        or any(b <= 0 or not np.isfinite(b) for b in edges)
        or edges != sorted(set(edges))
    ):
        raise InputError(f"size_bins are increasing sizes in patches > 0, e.g. (0.75, 1.25, 2.0); got {size_bins!r}")
    labels = [f"<{edges[0]:g}"] + [f"{a:g}-{b:g}" for a, b in zip(edges, edges[1:])] + [f">={edges[-1]:g}"]
    return labels


def object_misses(
    effects: xr.Dataset,
    wrong: xr.DataArray | None = None,
    size_bins=(0.75, 1.25, 2.0),
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> xr.Dataset:
    """The misses table of an `object_effects` result: per group (placement, size bin, contact, all)
    the objects' mean effect (bootstrap CI over scenes) and the missed rate on wrongly counted
    scenes (Wilson CI). The module docstring defines each column."""
    need = ("effect", "exists", "n_tokens", "placement", "size", "touches", "clean_correct")
    effects = require_dataset(effects, "effects", need)
    if set(effects["effect"].dims) != {"scene", "object"}:
        raise InputError(f"effects must be an object_effects result over (scene, object); got {effects['effect'].dims}")
    n_boot, seed = require_count(n_boot, "n_boot"), require_seed(seed)
    level = require_share(level, "level", below_one=True, above_zero=True)
    labels = _size_labels(size_bins)
    ds = effects.transpose("scene", "object", ...)
    if wrong is None:
        bad = ~ds["clean_correct"].values.astype(bool)
    else:
        if not isinstance(wrong, xr.DataArray) or wrong.dims != ("scene",) or wrong.sizes["scene"] != ds.sizes["scene"]:
            raise InputError("wrong is a Bool DataArray over the effects' scene dim (True: a wrongly counted scene)")
        bad = wrong.values.astype(bool)
    effect = ds["effect"].values.astype(float)
    measured = ds["exists"].values.astype(bool) & (ds["n_tokens"].values > 0)
    broken = [f"scene {a}, object {b}" for a, b in zip(*np.nonzero(measured & ~np.isfinite(effect)), strict=True)]
    if broken:
        raise InputError(
            f"effects: the effect at {'; '.join(broken[:5])}{' …' if len(broken) > 5 else ''} is not finite, though "
            "that object covers image tokens (NaN is for objects covering none): the least effect of a scene needs "
            "every such object measured, and finite; recompute object_effects with objects=None, or drop those "
            "scenes with effects.isel(scene=...)"
        )
    live = measured
    masked = np.where(live, effect, np.inf)
    least = masked.min(1, keepdims=True)
    missed = live & bad[:, None] & (masked == least)
    in_wrong = live & bad[:, None]

    size_bin = np.digitize(ds["size"].values, [float(b) for b in size_bins])
    groups = [("all", "all", live)]
    groups += [("placement", c, live & (ds["placement"].values == c)) for c in ("centred", "edge", "intersection")]
    groups += [("size", lab, live & (size_bin == k)) for k, lab in enumerate(labels)]
    touches = ds["touches"].values.astype(bool)
    groups += [("contact", "touches", live & touches), ("contact", "apart", live & ~touches)]

    rng = np.random.default_rng(seed)
    n_scenes = effect.shape[0]
    draws = rng.multinomial(n_scenes, np.full(n_scenes, 1 / n_scenes), size=n_boot)  # scene weights per resample
    rows = {k: [] for k in ("n_objects", "n_scenes", "mean_effect", "effect_low", "effect_high")}
    rows.update({k: [] for k in ("n_wrong_objects", "missed", "missed_rate", "missed_low", "missed_high")})
    rows["chance_rate"] = []
    per_scene = np.maximum(in_wrong.sum(1), 1)
    for _, _, sel in groups:
        total = np.where(sel, effect, 0.0).sum(1)
        count = sel.sum(1)
        rows["n_objects"].append(int(count.sum()))
        rows["n_scenes"].append(int((count > 0).sum()))
        with np.errstate(divide="ignore", invalid="ignore"):
            rows["mean_effect"].append(total.sum() / count.sum() if count.sum() else np.nan)
            boot = (draws @ total) / (draws @ count)
        boot = boot[np.isfinite(boot)]
        lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2]) if len(boot) else (np.nan, np.nan)
        rows["effect_low"].append(lo)
        rows["effect_high"].append(hi)
        k, n = int((missed & sel).sum()), int((in_wrong & sel).sum())
        rows["n_wrong_objects"].append(n)
        rows["missed"].append(k)
        rows["missed_rate"].append(k / n if n else np.nan)
        rows["chance_rate"].append(float(((in_wrong & sel).sum(1) / per_scene).sum() / n) if n else np.nan)
        wl, wh = wilson(k, n, level) if n else (np.nan, np.nan)
        rows["missed_low"].append(wl)
        rows["missed_high"].append(wh)
    out = xr.Dataset(
        {k: ("group", np.array(v)) for k, v in rows.items()},
        coords={
            "group": [lev if f == "all" else f"{f}:{lev}" for f, lev, _ in groups],
            "factor": ("group", [f for f, _, _ in groups]),
            "level": ("group", [lev for _, lev, _ in groups]),
        },
    )
    out.attrs.update(effects.attrs)
    out.attrs.update(
        method="object_misses",
        effects_method=str(effects.attrs.get("method", "")),
        wrong_scenes=int(bad.sum()),
        hidden=int((ds["exists"].values.astype(bool) & (ds["n_tokens"].values == 0)).sum()),
        ci=f"mean_effect: percentile bootstrap over scenes, {n_boot} resamples, seed {seed}; missed_rate: Wilson "
        f"score interval; level {level}",
        size_bins=str([float(b) for b in size_bins]),
    )
    return out


def run_misses(effects: xr.Dataset, **kw) -> xr.Dataset:
    """`object_misses` of a discover run's stored ``objects`` result (`countlens.pipeline.stages.objects`),
    wrongly counted = answered wrong by the run itself (``answered_right`` False), as its report and
    `countlens compare` read it."""
    effects = require_dataset(effects, "effects", ("answered_right",))
    return object_misses(effects, wrong=~effects["answered_right"].astype(bool), **kw)


#: The rows of the misses table by placement class, in the order the report and compare show them.
PLACEMENT_ROWS: tuple[str, ...] = ("placement:centred", "placement:edge", "placement:intersection", "all")


def _interval(value: float, low: float, high: float) -> str:
    return "–" if not np.isfinite(value) else f"{value:.2f} [{low:.2f}, {high:.2f}]"


def shown_rows(table: xr.Dataset, groups=PLACEMENT_ROWS):
    """The misses table's ``groups`` as text for a report (a pandas DataFrame indexed by level):
    objects, scenes, mean effect [CI], missed / objects in wrongly counted scenes, missed rate [CI],
    chance; "–" where a value is undefined."""
    import pandas as pd

    rows = {}
    for g in groups:
        r = {k: float(v) for k, v in table.sel(group=g).data_vars.items()}
        rows[str(table["level"].sel(group=g).item())] = {
            "objects": int(r["n_objects"]),
            "scenes": int(r["n_scenes"]),
            "mean effect [95 % CI]": _interval(r["mean_effect"], r["effect_low"], r["effect_high"]),
            "missed / in wrong scenes": f"{int(r['missed'])}/{int(r['n_wrong_objects'])}",
            "missed rate [95 % CI]": _interval(r["missed_rate"], r["missed_low"], r["missed_high"]),
            "chance": "–" if not np.isfinite(r["chance_rate"]) else f"{r['chance_rate']:.2f}",
        }
    return pd.DataFrame.from_dict(rows, orient="index")
