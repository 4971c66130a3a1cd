"""Where the count travels and which heads carry it: activation patching and attribution patching.

``vap`` patches each layer's residual stream over one token group (image, last, text) from the
corrupt run into the clean one; ``heads`` patches each head's z; ``atp`` estimates the head effects
from three passes (attribution patching) and ``eap_ig`` with the gradient integrated from the corrupt
input to the clean (`countlens.circuits.graph.integrated`), both scored against ``heads``. ``heads``,
``atp`` and ``eap_ig`` compute their registry method's result (`countlens.circuits.methods.registry`: exact
patching, AtP, EAP-IG at its `IG_STEPS`) and plan its `Cost`. ``vap`` and ``heads`` are
sweeps: a sharded run splits them between its ranks, and each streams its chunks so a killed run
resumes mid-sweep. The head effects are checked before any later stage reads them.
"""

from __future__ import annotations

import xarray as xr

from countlens import circuits
from countlens.analysis import plots
from countlens.analysis.heads import check_effects, head_sites
from countlens.analysis.tables import finite_markdown
from countlens.circuits.methods.registry import Method, method
from countlens.labels import head_label, top_sites
from countlens.model.memory import Widths, widths
from countlens.pipeline.costs import (
    FLOOR_KNOB,
    Forward,
    Planner,
    StagePlan,
    chunk_sizes,
    forward_bytes,
    pair_shape,
    run_rows,
)
from countlens.pipeline.stages.base import ReportContext, RunContext, Section, Stage


def _vap(run: RunContext) -> xr.Dataset:
    return circuits.patch_layers(
        run.vlm, run.pairs, batch_size=run.batch_size, store=run.store("vap"), progress=True, shard=run.shard
    )


#: The registry's methods these stages compute.
EXACT, ATP_METHOD, EAP_IG_METHOD = method("exact"), method("atp"), method("eap_ig")


def _heads(run: RunContext) -> xr.Dataset:
    return EXACT.result(
        run.vlm, run.pairs, run.batch_size, store=run.store(EXACT.stage), progress=True, shard=run.shard
    )


def _check_heads(run: RunContext, heads: xr.Dataset) -> None:
    check_effects(heads.effect, sites=head_sites(heads))  # the importance every later stage reads


def gradient_row_bytes(w: Widths, seq: int, patches: int, kept_sets: int) -> int:
    """What one more pair adds to a gradient stage's peak (`_plan_gradients`): its ``kept_sets`` sets of
    every layer's residual and z held across the chunk, and its forward with a backward pass."""
    per_layer = seq * (w.d_model + w.n_heads * w.d_head) * w.act_bytes
    grad = Forward(1, seq, grad=True, extra=2 * w.n_layers * per_layer)
    return kept_sets * w.n_layers * per_layer + forward_bytes(w, grad, patches)


def _plan_gradients(p: Planner, m: Method, kept_sets: int) -> StagePlan:
    """Per chunk of pairs: ``m``'s plain forwards (recordings), then its forwards with a backward pass
    (`Cost`), each keeping a layer's residual and z (and their gradients) per layer; ``kept_sets`` such
    sets of every layer held across the chunk. The chunk: as many pairs as fit (`Planner.chunk`)."""
    w, b, seq = p.w, p.w.act_bytes, p.pair_seq
    recordings, passes = m.cost.plain(w.n_layers), m.cost.grad(w.n_layers)
    pairs = p.samples("pairs")
    chunk, notes, fits = p.chunk(m.stage, gradient_row_bytes(w, seq, p.patches, kept_sets))
    n0 = min(chunk, len(pairs))
    per_layer = n0 * seq * (w.d_model + w.n_heads * w.d_head) * b
    fw = []
    for n, k in chunk_sizes(len(pairs), chunk).items():
        per = n * seq * (w.d_model + w.n_heads * w.d_head) * b
        fw += [
            Forward(n, seq, count=recordings * k),
            Forward(n, seq, count=passes * k, grad=True, extra=2 * w.n_layers * per),
        ]
    kept = kept_sets * w.n_layers * per_layer
    return StagePlan(m.stage, fw, kept=kept, batch=chunk, notes=notes, fits=fits, knob=FLOOR_KNOB)


def gradient_rows(run: RunContext, m: Method, kept_sets: int) -> int:
    """The pairs a chunk of ``m``'s stage takes in this run: the batch size, or fewer where the memory
    free now holds fewer (`countlens.pipeline.costs.run_rows`, the rule the plan chose by)."""
    if run.vlm.remote:
        return run.batch_size
    seq, patches = pair_shape(run.vlm, run.pairs, run.batch_size)
    row = gradient_row_bytes(widths(run.vlm), seq, patches, kept_sets)
    return run_rows(run.vlm, m.stage, row, run.batch_size)


#: Sets of every layer's residual and z each gradient method holds across a chunk (`_plan_gradients`).
KEPT_SETS = {"atp": 1, "eap_ig": 4}


def _gradient_result(run: RunContext, m: Method) -> xr.Dataset:
    return m.result(run.vlm, run.pairs, gradient_rows(run, m, KEPT_SETS[m.stage]))


def _plan_atp(p: Planner) -> StagePlan:
    """The corrupt run recorded, then the clean one forward and backward."""
    return _plan_gradients(p, ATP_METHOD, kept_sets=KEPT_SETS["atp"])


VAP = Stage(
    "vap",
    inputs=("pairs",),
    compute=_vap,
    plan=lambda p: p.patching("vap", [la for la in range(-1, p.w.n_layers) for _ in range(3)]),
    sweep=True,
    variables={"effect": ("layer", "group"), "logit_diff": ("layer", "group", "pair")},
)
HEADS = Stage(
    "heads",
    inputs=("pairs",),
    compute=_heads,
    plan=lambda p: p.patching("heads", [la for la in range(p.w.n_layers) for _ in range(p.w.n_heads)]),
    check=_check_heads,
    sweep=True,
    variables={"effect": ("layer", "head")},  # logit_diff: optional (RESULT_DIMS["heads"])
)
ATP = Stage(
    "atp",
    inputs=("pairs",),
    compute=lambda run: _gradient_result(run, ATP_METHOD),
    plan=_plan_atp,
    variables={"effect": ("layer", "head"), "resid_effect": ("layer",)},
)


def _plan_eap_ig(p: Planner) -> StagePlan:
    """Two recording forwards, then a forward and backward per step, per chunk of pairs."""
    return _plan_gradients(p, EAP_IG_METHOD, kept_sets=KEPT_SETS["eap_ig"])


EAP_IG = Stage(
    "eap_ig",
    inputs=("pairs",),
    compute=lambda run: _gradient_result(run, EAP_IG_METHOD),
    plan=_plan_eap_ig,
    variables={"effect": ("layer", "head"), "mlp_effect": ("layer",), "input_effect": ("input",)},
)


def transition(vap: xr.Dataset) -> tuple[int | None, int | None]:
    """(last layer where image tokens still carry half the effect, first layer where the last token does)."""
    img = vap.effect.sel(group="image_states" if "image_states" in vap.group else "image")
    last = vap.effect.sel(group="last")
    img_layers = [int(layer) for layer in vap.layer.values if float(img.sel(layer=layer)) >= 0.5]
    last_layers = [int(layer) for layer in vap.layer.values if float(last.sel(layer=layer)) >= 0.5]
    return (max(img_layers) if img_layers else None), (min(last_layers) if last_layers else None)


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


def _vap_values(ctx: ReportContext) -> dict:
    vap = ctx.results["vap"]
    first_img, first_last = transition(vap)
    return {
        "vap": {
            "n_pairs": int(vap.sizes["pair"]),
            "image_sentence": _image_sentence(first_img, "image_states" in vap.group),
            "first_last": first_last,
            "effect_table": finite_markdown(vap.effect.to_pandas().round(3)),
            "overwrite_table": finite_markdown(vap.overwrite.to_pandas().round(3)),
        }
    }


def _top_effects(effect: xr.DataArray, k: int) -> str:
    return ", ".join(
        f"{head_label((layer, head))} ({value:.2f})" for layer, head, value in top_sites(effect, k, absolute=True)
    )


def _against_exact(ctx: ReportContext, m: Method) -> dict:
    return circuits.compare(m.from_run(ctx.results), EXACT.from_run(ctx.results), k=int(ctx.spec["top_k"]))


def _atp_score(ctx: ReportContext) -> dict:
    return _against_exact(ctx, ATP_METHOD)


def _eap_ig_score(ctx: ReportContext) -> dict:
    return _against_exact(ctx, EAP_IG_METHOD)


def _heads_values(ctx: ReportContext) -> dict:
    return {
        "top_effects": _top_effects(ctx.results["heads"].effect, 5),
        "atp": _atp_score(ctx),
        "eap_ig": {**_eap_ig_score(ctx), "steps": int(ctx.results["eap_ig"].attrs["steps"])},
    }


def _draw_vap(ctx: ReportContext) -> None:
    plots.plot_layers(ctx.results["vap"], ctx.figures / "vap.png")


def _draw_heads(ctx: ReportContext) -> None:
    heads, atp = ctx.results["heads"], ctx.results["atp"]
    plots.plot_heatmap(heads.effect, ctx.figures / "heads.png", "Head patching effect (z, all positions)", center=True)
    plots.plot_scatter(
        heads.effect,
        atp.effect,
        ctx.figures / "atp.png",
        "exact patching effect",
        "AtP estimate",
        f"AtP vs exact (Spearman {_atp_score(ctx)['spearman']:.2f})",
    )


VAP_SECTION = Section("vap.md.j2", _vap_values, _draw_vap, stages=("vap",))
HEADS_SECTION = Section("heads.md.j2", _heads_values, _draw_heads, stages=("heads", "atp", "eap_ig"))
