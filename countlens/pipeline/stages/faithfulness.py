"""Is it a circuit? The faithfulness of the top heads of each ranking the run computed.

The rankings are the registry's methods that discover ranks with (`countlens.circuits.methods.registry`;
only those of the run's ``methods`` when it names some): exact head patching (``heads``), attribution
patching (``atp``), EAP-IG (``eap_ig``), the drop in log p(gold) when a head is mean-ablated on
counting (``ablation``) and AtP* (computed here, on the families `countlens.circuits.methods.atp_star`
supports; its scores are kept as ``atp_star_effect``); beside them random rankings (the registry's
`RANDOM_DRAWS`). The circuit at each of MIB's sizes keeps the top heads and patches every other head's z from
the corrupt run; f(C) says how much of the clean run's logit difference it keeps
(`countlens.circuits.graph.faithfulness`: the definition, the node set, CPR and CMD). The report's section
draws the curves and tabulates CPR, CMD and the smallest circuit reaching 80 % faithfulness. These are
countlens's own measurements on the run's pairs: no paper's figure is comparable with them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pandas as pd
import xarray as xr

from countlens.analysis import plots
from countlens.analysis.tables import finite_markdown
from countlens.circuits.graph.faithfulness import SIZES, circuit_sizes, faithfulness_curves, smallest_faithful
from countlens.circuits.graph.recovery import auroc, precision_at
from countlens.circuits.methods.registry import RANDOM_DRAWS, discover_methods, method
from countlens.labels import head_label
from countlens.pipeline.costs import Forward, Planner, StagePlan, chunk_sizes, sweep_rows
from countlens.pipeline.stages.base import ReportContext, RunContext, Section, Stage
from countlens.toy.catalogue import planted_circuit_of

#: The faithfulness a circuit must reach to count as carrying the behaviour in the report's table.
LEVEL = 0.8


def _rankings(
    results: dict, names: Sequence[str] = (), computed: dict[str, xr.DataArray] | None = None
) -> dict[str, xr.DataArray]:
    """The head rankings of the registry's discover methods (those of ``names`` when it names some), by
    label, each a DataArray over (layer, head): read from the run's results (a stage's, or this stage's
    own `Method.variable`), or from ``computed`` (by method name)."""
    computed = computed or {}
    out = {}
    for m in discover_methods(names=names):
        ranking = computed.get(m.name)
        ranking = m.from_run(results) if ranking is None else ranking
        if ranking is not None:
            out[m.label] = ranking
    return out


def _faithfulness(run: RunContext) -> xr.Dataset:
    # Methods no earlier stage computed (AtP*) are computed here, where the family supports them.
    names = run.config.methods
    computed = {
        m.name: m.ranking(run.vlm, run.pairs, run.batch_size)
        for m in discover_methods(run.vlm, names)
        if m.stage is None
    }
    ds = faithfulness_curves(
        run.vlm,
        run.pairs,
        _rankings(run.results, names, computed),
        nodes=("head",),
        batch_size=run.batch_size,
        random_draws=RANDOM_DRAWS,
        seed=run.config.seed,
    )
    for name, ranking in computed.items():
        ds[method(name).variable] = ranking
    return ds


def _plan(p: Planner) -> StagePlan:
    """Per chunk of pairs: the corrupt run recorded, then every distinct circuit (at most rankings ×
    sizes, and the empty and full ones) as stacked copies of the clean batch."""
    w, b, seq = p.w, p.w.act_bytes, p.pair_seq
    pairs = p.samples("pairs")
    n0 = min(p.bs, len(pairs))
    chosen = discover_methods(names=p.c.methods)
    circuits = (len(chosen) + RANDOM_DRAWS) * len(set(circuit_sizes(w.n_layers * w.n_heads, SIZES))) + 2
    kept = n0 * seq * w.n_layers * w.n_heads * w.d_head * b  # every layer's corrupt z
    rows = sweep_rows(w, seq, p.free, kept, 1, p.patches)
    fw = []
    for n, k in chunk_sizes(len(pairs), p.bs).items():
        per = max(1, rows // n)
        for m in chosen:  # the methods this stage computes itself (no stage before it does)
            if m.stage is None:
                fw += [Forward(n, seq, count=m.cost.plain(w.n_layers) * k)]
                fw += [Forward(n, seq, count=m.cost.grad(w.n_layers) * k, grad=True)]
        fw += [Forward(n, seq, count=k)]  # the corrupt run, recorded
        full, rest = divmod(circuits, per)
        fw += [Forward(per * n, seq, count=k * full)] if full else []
        fw += [Forward(rest * n, seq, count=k)] if rest else []
    return StagePlan("faithfulness", fw, kept=kept, rows=rows, batch=p.bs)


FAITHFULNESS = Stage(
    "faithfulness",
    inputs=("pairs",),
    compute=_faithfulness,
    plan=_plan,
    variables={"faithfulness": ("ranking", "size"), "cpr": ("ranking",), "cmd": ("ranking",)},
)


def _table(ds: xr.Dataset, unit: str = "heads", draws: int = RANDOM_DRAWS) -> pd.DataFrame:
    smallest = smallest_faithful(ds, LEVEL)
    rows = []
    for r in ds.ranking.values:
        name = str(r)
        if name.startswith("random") and name != "random":
            continue
        fraction = float(smallest.sel(ranking=name))
        cpr, cmd = float(ds.cpr.sel(ranking=name)), float(ds.cmd.sel(ranking=name))
        if name == "random":
            cpr_s = f"{cpr:.3f} ± {float(ds.cpr_std.sel(ranking=name)):.3f}"
            cmd_s = f"{cmd:.3f} ± {float(ds.cmd_std.sel(ranking=name)):.3f}"
            name = f"random (mean of {draws})"
        else:
            cpr_s, cmd_s = f"{cpr:.3f}", f"{cmd:.3f}"
        reach = "—" if math.isnan(fraction) else f"{fraction:.1%} ({round(fraction * ds.attrs['n_nodes'])} {unit})"
        rows.append({"ranking": name, "CPR": cpr_s, "CMD": cmd_s, f"smallest circuit with f ≥ {LEVEL}": reach})
    return pd.DataFrame(rows)


def _curve(ds: xr.Dataset) -> pd.DataFrame:
    """f(C) per ranking (random: the draws' mean) by the fraction kept, one row per distinct size."""
    shown = [str(r) for r in ds.ranking.values if not str(r)[-1].isdigit()]
    table = pd.DataFrame(
        ds.faithfulness.sel(ranking=shown).values.T,
        index=pd.Index([f"{x:.1%}" for x in ds.kept_fraction.values], name="kept"),
        columns=shown,
    )
    return table[~table.index.duplicated()].round(3)


def _recovery(ctx: ReportContext) -> dict | None:
    """On a planted organism (`countlens.model.shipped`): each ranking's AUROC and precision@|C| against
    the circuit planted in it; None on any other model."""
    circuit = planted_circuit_of(ctx.model)
    if circuit is None:
        return None
    k = len(circuit.heads)
    rows = [
        {
            "ranking": name,
            "AUROC": f"{auroc(s, circuit.heads):.3f}",
            f"precision@{k}": f"{precision_at(s, circuit.heads):.3f}",
        }
        for name, s in _rankings(ctx.results, ctx.spec.get("methods", ())).items()
    ]
    return {
        "heads": ", ".join(head_label(h) for h in sorted(circuit.heads)),
        "table": finite_markdown(pd.DataFrame(rows), index=False, disable_numparse=True),  # 1.000 stays 1.000
    }


def _edges(ctx: ReportContext) -> dict | None:
    """The edge stage's table and curve, why the model has no edges, or None for a run without it."""
    ds = ctx.results.get("edge_faithfulness")
    if ds is None:
        return None
    if "refused" in ds.attrs:
        return {"refused": ds.attrs["refused"]}
    return {
        "n_edges": int(ds.attrs["n_nodes"]),
        "steps": int(ds.attrs["steps"]),
        "table": finite_markdown(_table(ds, "edges"), index=False),
        "curve": finite_markdown(_curve(ds)),
    }


def _values(ctx: ReportContext) -> dict:
    ds = ctx.results["faithfulness"]
    return {
        "faithfulness": {
            "n_pairs": int(json.loads(ds.attrs["dataset"])["pairs"]),
            "n_nodes": int(ds.attrs["n_nodes"]),
            "table": finite_markdown(_table(ds), index=False),
            "curve": finite_markdown(_curve(ds)),
            "level": LEVEL,
            "recovery": _recovery(ctx),
            "edges": _edges(ctx),
        }
    }


def _draw(ctx: ReportContext) -> None:
    plots.plot_faithfulness(ctx.results["faithfulness"], ctx.figures / "faithfulness.png")
    edges = ctx.results.get("edge_faithfulness")
    if edges is not None and "refused" not in edges.attrs:
        plots.plot_faithfulness(
            edges, ctx.figures / "edge_faithfulness.png", "Faithfulness of each ranking's top edges"
        )


SECTION = Section("faithfulness.md.j2", _values, _draw, stages=("faithfulness", "edge_faithfulness"))
