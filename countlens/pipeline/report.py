"""``report.md`` of a discover run, and its figures, read from the run's stored results only.

Nothing here runs a model: `write_report` loads ``results/*.nc`` (`countlens.pipeline.rundir`),
measures what the report states (accuracies, the patching transition, AtP's rank agreement, the
Jaccard overlaps), draws the figures and writes the text. ``countlens report RUN`` re-renders it.
The section `countlens finetune` appends (`FINETUNE_SECTION`) is kept when the report is rebuilt.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr

from countlens import circuits
from countlens.analysis import plots
from countlens.analysis.attention_metrics import aggregate
from countlens.analysis.evaluate import accuracy, digit_in_conflict, number_avoidance, summary
from countlens.datasets.countingtricks import CASES
from countlens.pipeline import presets
from countlens.pipeline.config import STAGES, conflict_styles
from countlens.pipeline.rundir import load_run, read_spec

FINETUNE_SECTION = "## 9. Circuit-guided fine-tune"


def _transition(vap: xr.Dataset) -> tuple[int | None, int | None]:
    """(last layer where image tokens still carry half the effect, first layer where the last token does)."""
    img = vap.effect.sel(group="image")
    last = vap.effect.sel(group="last")
    img_layers = [int(layer) for layer in vap.layer.values if float(img.sel(layer=layer)) >= 0.5]
    last_layers = [int(layer) for layer in vap.layer.values if float(last.sel(layer=layer)) >= 0.5]
    return (max(img_layers) if img_layers else None), (min(last_layers) if last_layers else None)


def write_report(model: str, arch: str, out: str | Path, table: pd.DataFrame | None = None,
                 prompt: str | None = None) -> Path:
    """Figures and ``report.md`` from the results in ``out`` (``table``: the head table, else heads.csv)."""
    out = Path(out)
    r = load_run(out)
    cases, std, conflict, vap, heads, atp, lens, hl, att, am, abl, temp = (r[s] for s in STAGES)
    avoid = number_avoidance(cases.where(cases["count"] >= 0, drop=True))
    overall = summary(cases).loc["all"]
    dic = digit_in_conflict(std, conflict)
    per_layer = aggregate(am, by=None, per_layer=True)
    mas_iou = per_layer.unstack("outcome")[["mas", "iou"]].round(3)
    mas_iou.columns = [f"{m} ({o})" for m, o in mas_iou.columns]
    paper_iou = ""
    if "pixel_iou" in am:  # runs made before it have the head-mean IoU only
        by_head = am.pixel_iou.mean("sample", skipna=True).fillna(0.0)
        paper_iou = (f"\n\nThe paper's Attention-IoU (one layer-head's map back-projected to the pixels, "
                     f"binarised at 0.5 × max, vs the object pixels; `pixel_iou`): highest mean over the scenes "
                     f"{_argmax_head(by_head)}, mean over all heads {float(by_head.mean()):.3f}.")
    table = pd.read_csv(out / "heads.csv") if table is None else table
    spec = read_spec(out)
    prompt = prompt or spec.get("prompt", "?")
    k = int(spec.get("top_k", 5))
    jk = int(spec.get("jaccard_k", k))
    atp_score = circuits.compare(atp.effect, heads.effect, k=k)
    jac = circuits.jaccard(abl, k=jk)

    figs = out / "figures"
    by_case = accuracy(cases, "case")["accuracy"].reindex(list(CASES))
    family = pd.Series({n: c.family for n, c in CASES.items()})
    fam_acc = by_case.groupby(family).mean()
    plots.plot_bars(by_case, figs / "cases.png", "COUNTINGTRICKS accuracy per case")
    plots.plot_layers(vap, figs / "vap.png")
    plots.plot_heatmap(heads.effect, figs / "heads.png", "Head patching effect (z, all positions)", center=True)
    plots.plot_scatter(heads.effect, atp.effect, figs / "atp.png", "exact patching effect", "AtP estimate",
                       f"AtP vs exact (Spearman {atp_score['spearman']:.2f})")
    plots.plot_lens(lens, figs / "lens.png")
    plots.plot_heatmap(att.image_attention.mean("sample"), figs / "image_attention.png",
                       "Attention of the last token on image tokens")
    plots.plot_heatmap(abl.logp_drop.sel(task="count"), figs / "ablation_count.png",
                       "Mean ablation: drop in log p(gold), counting", center=True)
    first_img, first_last = _transition(vap)
    decoded_layer = next((int(la) for la in lens.layer.values if float(lens["rank"].sel(layer=la).median()) == 0), None)
    sharp = float(temp.sharpened.mean()), float(temp.base.mean())
    classes = table["class"].value_counts().to_dict()
    tops = {t: ", ".join(f"L{la}H{h}" for la, h in v) for t, v in circuits.top_heads(abl, k=jk).items()}
    vap_table = vap.effect.to_pandas().round(3).to_markdown()
    overwrite_table = vap.overwrite.to_pandas().round(3).to_markdown()
    preset_line = ""
    if spec.get("preset"):
        chosen = presets.get(spec["preset"])
        values = {**chosen.discover, **chosen.thresholds}
        preset_line = (f"\n\nPreset `{chosen.name}` ({chosen.paper}): " + ", ".join(f"{k_} = {v}" for k_, v in values.items())
                       + " (their sources: `countlens.pipeline.presets`; what is still countlens's own: docs/fidelity.md).")
    text = f"""# Counting circuit of `{model}` ({arch})

Produced by `countlens discover`. Prompt style: `{prompt}`. Every number below is read from the
result files in `results/` (xarray netCDF; `countlens.results.load`).{preset_line}

## 1. COUNTINGTRICKS

![cases](figures/cases.png)

Mean accuracy: position cases (1–4) **{fam_acc.get('position', float('nan')):.3f}**, dilation (5A–8A)
**{fam_acc.get('dilation', float('nan')):.3f}**, adjacency (9–15) **{fam_acc.get('adjacency', float('nan')):.3f}**
({int(cases.sizes['sample'])} samples); over all cases, accuracy **{overall['accuracy']:.3f}** and MAE
**{overall['mae']:.2f}** (|predicted − true count| over the parsed answers). Per case:

{by_case.to_frame().T.round(2).to_markdown(index=False)}

Number avoidance: Pearson r between the count and its accuracy = **{avoid['r']:.2f}** (per count:
{", ".join(f"{k}: {v:.2f}" for k, v in avoid['per_count'].items())}).

Digit-in-Conflict (position cases, the same {dic['n_std']} images under the `{conflict_styles(model)[0]}` prompt and with
a distractor digit N±1 / N±2 in it): accuracy {dic['accuracy_std']:.3f} → {dic['accuracy_conflict']:.3f}; the
distractor is answered in {dic['distractor_share']:.1%} of conflict answers.

## 2. Where the count travels: visual activation patching

![vap](figures/vap.png)

Effect = share of the corrupt answer's logit difference that patching one layer's residual stream,
over one token group, carries into the clean run ({int(vap.sizes['pair'])} pairs).
{_image_sentence(first_img)};
{"the last prompt token carries at least half from layer " + str(first_last) if first_last is not None else "the last token never carries half"}.

{vap_table}

Overwrite rate (the papers' measure): the share of pairs whose prediction becomes the corrupt answer.

{overwrite_table}

## 3. Heads: exact patching and attribution patching

![heads](figures/heads.png) ![atp](figures/atp.png)

Top heads by exact patching effect: {_top_effects(heads.effect, 5)}. AtP ranks heads
with Spearman ρ = **{atp_score['spearman']:.3f}** against exact patching (top-{atp_score['top_k']} overlap
{atp_score['top_k_overlap']:.2f}), from three passes instead of one sweep.

## 4. Logit lens

![lens](figures/lens.png)

The gold answer is the top token (median rank 0) from layer **{decoded_layer}** on; mean p(gold) after the last
layer is {float(lens.prob.isel(layer=-1).mean()):.3f}.

## 5. HeadLens and attention

![attention](figures/image_attention.png)

HeadLens maps fit with held-out R² per layer: {", ".join(f"{float(v):.2f}" for v in hl.r2.values)}.
Most image-attentive head: {_argmax_head(att.image_attention.mean("sample"))}; highest VGS:
{_argmax_head(hl.vgs)}; highest CTER: {_argmax_head(hl.cter)}.

Attention diagnostics on {int(am.sizes['sample'])} COUNTINGTRICKS scenes (last prompt token, head mean;
`countlens.analysis.attention_metrics`): MAS = share of attention on image tokens, Attention-IoU =
binarised (≥ 0.5 × max) attention map vs object cells, split by whether the answer was correct.

{mas_iou.to_markdown()}{paper_iou}

## 6. Head classes

{pd.Series(classes).to_frame("heads").to_markdown()}

The full table is in `heads.csv` / `heads.md` / `heads.tex` (rules in `countlens.analysis.heads`; thresholds: {"the preset's, `countlens.pipeline.presets`" if spec.get("preset") else "the defaults, `HeadThresholds`"}; `countlens classify` changes them).

{table.head(10).round(3).to_markdown(index=False)}

## 7. Mean ablation across tasks

![ablation](figures/ablation_count.png)

Top-{jac.attrs['k']} heads by drop in log p(gold): {"; ".join(f"{t}: {v}" for t, v in tops.items())}.
Jaccard overlap between tasks' sets:

{jac.to_pandas().round(2).to_markdown()}

## 8. Head temperature

Sharpening {temp.attrs['betas']} (β = α·γ from head patching): counting accuracy
{sharp[1]:.3f} → **{sharp[0]:.3f}** on {int(temp.sizes['sample'])} held-out scenes.
"""
    path = out / "report.md"
    if path.exists() and FINETUNE_SECTION in path.read_text():
        # Keep the section `countlens finetune` appended: it is not rebuilt from results/.
        text = text.rstrip("\n") + "\n\n" + FINETUNE_SECTION + path.read_text().split(FINETUNE_SECTION, 1)[1]
    path.write_text(text)
    return path


def _top_effects(effect: xr.DataArray, k: int) -> str:
    flat = effect.stack(site=("layer", "head"))
    order = np.argsort(-np.abs(flat.values), kind="stable")[:k]
    return ", ".join(f"L{flat.site.values[i][0]}H{flat.site.values[i][1]} ({float(flat.values[i]):.2f})" for i in order)


def _image_sentence(layer: int | None) -> str:
    if layer is None:
        return "Image tokens never carry half the effect by themselves, not even at the input"
    if layer == -1:
        return ("Image tokens carry the count at the input (layer −1, the embeddings) but not after layer 0: "
                "layer 0 already moves it onto text positions")
    return f"Image tokens carry at least half the effect up to layer {layer}"


def _argmax_head(da: xr.DataArray) -> str:
    flat = da.stack(site=("layer", "head"))
    layer, head = flat.site.values[int(np.argmax(flat.values))]
    return f"L{layer}H{head} ({float(flat.max()):.2f})"
