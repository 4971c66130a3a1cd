"""``report.md`` of a discover run, and its figures, read from the run's stored results only.

Nothing here runs a model: `write_report` loads ``results/*.nc`` (`countlens.pipeline.rundir`),
measures what the report states (accuracies, the patching transition, AtP's rank agreement, the
Jaccard overlaps), draws the figures and renders the text from ``templates/report.md.j2`` (Jinja2: the
prose is there, the values are computed here). ``countlens report RUN`` re-renders it.
`countlens finetune` puts its before/after table into the report (`add_finetune_section`); that section
(`FINETUNE_SECTION`) is kept when the report is rebuilt. `splice_finetune_section` does both splices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from countlens import circuits
from countlens.analysis import plots
from countlens.analysis.attention_metrics import aggregate
from countlens.analysis.evaluate import accuracy, digit_in_conflict, number_avoidance, summary, unanswered
from countlens.analysis.heads import read_heads
from countlens.datasets.countingtricks import CASES
from countlens.errors import RunDirError
from countlens.pipeline import presets
from countlens.pipeline.config import STAGES, conflict_styles
from countlens.pipeline.rundir import load_run, read_spec
from countlens.results import head_label, top_sites

FINETUNE_SECTION = "## 9. Circuit-guided fine-tune"

# The report's prose: templates/report.md.j2. `fmt` formats as an f-string does (format(x, ".3f")).
_TEMPLATES = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"),
    keep_trailing_newline=True,
    undefined=StrictUndefined,
    autoescape=False,
)
_TEMPLATES.filters["fmt"] = format


def _transition(vap: xr.Dataset) -> tuple[int | None, int | None]:
    """(last layer where image tokens still carry half the effect, first layer where the last token does)."""
    img = vap.effect.sel(group="image_states" if "image_states" in vap.group else "image")
    last = vap.effect.sel(group="last")
    img_layers = [int(layer) for layer in vap.layer.values if float(img.sel(layer=layer)) >= 0.5]
    last_layers = [int(layer) for layer in vap.layer.values if float(last.sel(layer=layer)) >= 0.5]
    return (max(img_layers) if img_layers else None), (min(last_layers) if last_layers else None)


def write_report(
    model: str, arch: str, out: str | Path, table: pd.DataFrame | None = None, prompt: str | None = None
) -> Path:
    """Figures and ``report.md`` from the results in ``out`` (``table``: the head table, else heads.csv)."""
    out = Path(out)
    table = read_heads(out) if table is None else table  # checked before anything is drawn or written
    r = load_run(out)
    cases, std, conflict, vap, heads, atp, lens, hl, att, am, abl, temp = (r[s] for s in STAGES)
    avoid = number_avoidance(cases.where(cases["count"] >= 0, drop=True))
    overall = summary(cases).loc["all"]
    dic = digit_in_conflict(std, conflict)
    per_layer = aggregate(am, by=None, per_layer=True)
    mas_iou = per_layer.unstack("outcome")[["mas", "iou"]].round(3)
    mas_iou.columns = [f"{m} ({o})" for m, o in mas_iou.columns]
    if "pixel_iou" not in am:
        raise RunDirError(
            f"{out}/results/attention_metrics.nc lacks 'pixel_iou': it was written by an older "
            f"countlens; delete it and rerun `countlens discover --out {out}` to recompute it"
        )
    # Over the heads that have attention maps (not slots beyond a layer's heads, nor linear layers).
    by_head = am.pixel_iou.mean("sample", skipna=True)
    pixel_iou = {"top_head": _argmax_head(by_head.fillna(0.0)), "mean": float(by_head.mean(skipna=True))}
    spec = read_spec(out)
    prompt = prompt or spec["prompt"]
    k, jk = int(spec["top_k"]), int(spec["jaccard_k"])
    atp_score = circuits.compare(atp.effect, heads.effect, k=k)
    jac = circuits.jaccard(abl, k=jk)

    figs = out / "figures"
    design = spec.get("design", "countlens")
    if design == "paper-code":  # the MAS paper's generator: 18 circle cases, no adjacency family
        from countlens.datasets.paper_code_tricks import CODE_CASES, DILATION

        family = pd.Series({n: "dilation" if n in DILATION else "position" for n in CODE_CASES})
    else:
        family = pd.Series({n: c.family for n, c in CASES.items()})
    by_case = accuracy(cases, "case")["accuracy"].reindex(list(family.index))
    fam_acc = by_case.groupby(family).mean()
    plots.plot_bars(by_case, figs / "cases.png", "COUNTINGTRICKS accuracy per case")
    plots.plot_layers(vap, figs / "vap.png")
    plots.plot_heatmap(heads.effect, figs / "heads.png", "Head patching effect (z, all positions)", center=True)
    plots.plot_scatter(
        heads.effect,
        atp.effect,
        figs / "atp.png",
        "exact patching effect",
        "AtP estimate",
        f"AtP vs exact (Spearman {atp_score['spearman']:.2f})",
    )
    plots.plot_lens(lens, figs / "lens.png")
    plots.plot_heatmap(
        att.image_attention.mean("sample"), figs / "image_attention.png", "Attention of the last token on image tokens"
    )
    plots.plot_heatmap(
        abl.logp_drop.sel(task="count"),
        figs / "ablation_count.png",
        "Mean ablation: drop in log p(gold), counting",
        center=True,
    )
    first_img, first_last = _transition(vap)
    decoded_layer = next((int(la) for la in lens.layer.values if float(lens["rank"].sel(layer=la).median()) == 0), None)
    sharp = float(temp.sharpened.mean()), float(temp.base.mean())
    classes = table["class"].value_counts().to_dict()
    tops = {t: ", ".join(map(head_label, v)) for t, v in circuits.top_heads(abl, k=jk).items()}
    preset = None
    if spec.get("preset"):
        chosen = presets.get(spec["preset"])
        values = {**chosen.discover, **chosen.thresholds}
        preset = {
            "name": chosen.name,
            "paper": chosen.paper,
            "settings": ", ".join(f"{k_} = {v}" for k_, v in values.items()),
        }
    text = _TEMPLATES.get_template("report.md.j2").render(
        model=model,
        arch=arch,
        prompt=prompt,
        warning=unanswered(cases),
        preset=preset,
        family={f: fam_acc.get(f, float("nan")) for f in ("position", "dilation", "adjacency")},
        design=design,
        n_cases=int(cases.sizes["sample"]),
        overall={"accuracy": overall["accuracy"], "mae": overall["mae"], "unparsed": overall["unparsed"]},
        evaluation=spec.get("evaluate", "score"),
        max_new_tokens=spec.get("max_new_tokens"),
        case_table=by_case.to_frame().T.round(2).to_markdown(index=False),
        avoidance={"r": avoid["r"], "per_count": ", ".join(f"{k}: {v:.2f}" for k, v in avoid["per_count"].items())},
        conflict={**dic, "style": conflict_styles(model)[0]},
        vap={
            "n_pairs": int(vap.sizes["pair"]),
            "image_sentence": _image_sentence(first_img, "image_states" in vap.group),
            "first_last": first_last,
            "effect_table": vap.effect.to_pandas().round(3).to_markdown(),
            "overwrite_table": vap.overwrite.to_pandas().round(3).to_markdown(),
        },
        top_effects=_top_effects(heads.effect, 5),
        atp=atp_score,
        lens={"decoded_layer": decoded_layer, "final_p_gold": float(lens.prob.isel(layer=-1).mean())},
        headlens={
            "r2": ", ".join(f"{float(v):.2f}" for v in hl.r2.values),
            "most_image_attentive": _argmax_head(att.image_attention.mean("sample")),
            "top_vgs": _argmax_head(hl.vgs),
            "top_cter": _argmax_head(hl.cter),
        },
        attention={
            "n_scenes": int(am.sizes["sample"]),
            "mas_iou_table": mas_iou.to_markdown(),
            "pixel_iou": pixel_iou,
            "position": am.attrs.get("position", "last prompt token"),
            "code": _code_attention(am),
            "probes": _probes(r.get("probes")),
        },
        classes_table=pd.Series(classes).to_frame("heads").to_markdown(),
        heads_table=table.head(10).round(3).to_markdown(index=False),
        ablation={
            "k": jac.attrs["k"],
            "top_heads": "; ".join(f"{t}: {v}" for t, v in tops.items()),
            "jaccard_table": jac.to_pandas().round(2).to_markdown(),
            "reasoning": _reasoning_sources(spec, [str(t) for t in abl.task.values]),
        },
        temperature={
            "betas": temp.attrs["betas"],
            "base": sharp[1],
            "sharpened": sharp[0],
            "n_scenes": int(temp.sizes["sample"]),
        },
    )
    path = out / "report.md"
    kept = path.read_text() if path.exists() else ""
    if FINETUNE_SECTION in kept:  # the section `countlens finetune` wrote is not rebuilt from results/
        text = splice_finetune_section(text, kept[kept.index(FINETUNE_SECTION) :])
    path.write_text(text)
    return path


def splice_finetune_section(report: str, section: str) -> str:
    """``report`` with ``section`` (the text from `FINETUNE_SECTION` on) as its fine-tune section: in
    place of the one it has, else after its end."""
    return report.split(FINETUNE_SECTION, 1)[0].rstrip("\n") + "\n\n" + section


def add_finetune_section(run: str | Path, finetune_out: str | Path, command: str) -> Path | None:
    """Put the before/after table of a fine-tune (``finetune_out/before_after.md``, written by
    `countlens.pipeline.finetune_job.before_after`) into ``run``'s report.md, under `FINETUNE_SECTION`
    with the ``command`` that made it; an earlier fine-tune's section is replaced. Returns the report's
    path, or None (nothing written) when the run has no report."""
    path = Path(run) / "report.md"
    if not path.exists():
        return None
    table = (Path(finetune_out) / "before_after.md").read_text()
    section = f"{FINETUNE_SECTION}\n\nCommand: `{command}`.\n\n{table}"
    path.write_text(splice_finetune_section(path.read_text(), section))
    return path


def _top_effects(effect: xr.DataArray, k: int) -> str:
    return ", ".join(
        f"{head_label((layer, head))} ({value:.2f})" for layer, head, value in top_sites(effect, k, absolute=True)
    )


def _image_sentence(layer: int | None, states: bool = False) -> str:
    if states:  # a cross-attention model: the image is its states, read at the cross-attention layers
        if layer is None:
            return "The image states never carry half the effect by themselves, not even where they enter"
        if layer == -1:
            return (
                "The image states carry the count where they enter (layer −1: what every cross-attention "
                "layer reads), but no single cross-attention layer's own read carries half of it"
            )
        return f"The image states read at cross-attention layer {layer} carry at least half the effect alone"
    if layer is None:
        return "Image tokens never carry half the effect by themselves, not even at the input"
    if layer == -1:
        return (
            "Image tokens carry the count at the input (layer −1, the embeddings) but not after layer 0: "
            "layer 0 already moves it onto text positions"
        )
    return f"Image tokens carry at least half the effect up to layer {layer}"


def _probes(ds) -> str | None:
    """AP@50 per tap of a `probes` stage, for the report."""
    if ds is None:
        return None
    return ", ".join(f"{t} {float(v):.3f}" for t, v in zip(ds.tap.values, ds.ap50.values))


def _code_attention(am) -> dict | None:
    """The MAS code's diagnostics of an ``at="generation"`` attention_metrics result, for the report."""
    if "sets" not in am:
        return None
    import torch

    from countlens.analysis.code_attention import modality_shares

    shares = modality_shares(torch.tensor(am.sets.transpose("sample", "layer", "set").values))
    right = am.correct.values.astype(bool)

    def by_outcome(name: str) -> str:
        values = am[name].values.astype(float)
        parts = [
            f"{label} {np.nanmean(values[m]):.3f}" for label, m in (("correct", right), ("wrong", ~right)) if m.any()
        ]
        return ", ".join(parts) or "none"

    return {
        "shares": ", ".join(f"{k} {v:.1%}" for k, v in shares.items()),
        "vra": by_outcome("vra_code"),
        "ars": by_outcome("ars_code"),
    }


def _reasoning_sources(spec: dict, tasks: list[str]) -> dict[str, str]:
    """Where each reasoning task of the ablation came from: a local copy's path, or "" (procedural)."""
    return {t: spec.get(t, "") for t in ("math", "spatial") if t in tasks}


def _argmax_head(da: xr.DataArray) -> str:
    [(layer, head, value)] = top_sites(da, 1)
    return f"{head_label((layer, head))} ({value:.2f})"
