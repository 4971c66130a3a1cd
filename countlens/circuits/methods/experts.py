"""Experts as sites: where a mixture-of-experts model routes each token, and which experts carry the count.

A mixture-of-experts (MoE) MLP sends each token to its router's top-k experts and adds their
outputs, each times its routing weight: out(x_t) = Σ_j w_j(t) · E_{i_j(t)}(x_t). Expert e's
**contribution** to token t is w_e(t) · E_e(x_t), zero where the router did not choose e; a token's
contributions sum to the experts' output (`countlens.circuits.sites.expert_rules.expert_contribution`).
Llama 4 scales the expert's input instead, E_e(w_e(t) · x_t), running every expert on every token:
its contribution is the experts module's own row for (e, t); its shared expert, which every token
passes through, is not one of them. How each rule is recorded, read and written lives in
`countlens.circuits.sites.expert_rules`. So an expert is a site (`countlens.circuits.sites.Expert`) as a
head is:

- `routing` reads the router's choice per token (top-k experts and their weights), and
  `expert_usage` the share of a token group's tokens routed to each expert;
- `patch_experts` copies, expert by expert, the corrupt run's contribution into the clean run at a
  token group (zero where the corrupt run did not choose that expert; the clean run's own routing is
  left as it is elsewhere): ``effect`` / ``overwrite`` over (layer, expert), normalised like
  `countlens.circuits.methods.patching.patch_heads`;
- `expert_means` and `ablate_experts` mean-ablate experts: each contribution replaced by its mean
  over a reference set per token group (image, last, other text), as heads are
  (`countlens.circuits.methods.ablation`); `expert_ablation_scan` ablates each expert alone.

Routing is read, not changed: a patched or ablated expert changes the tokens' later layers, which
route again by their own (now changed) inputs. countlens defines these sites; the papers, which
study dense models, define none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens.circuits.engine.edits import Edit, cache_run, run_edits
from countlens.circuits.engine.interventions import Patch
from countlens.circuits.engine.metrics import metric_for
from countlens.circuits.engine.run import effect_sweep
from countlens.circuits.engine.sweep import check_pair_sweep
from countlens.circuits.methods.ablation import ABLATION_GROUPS, gold_scores, group_masks, group_values, joint_ablation
from countlens.circuits.sites import Expert, check_group, group_mask
from countlens.circuits.sites.expert_rules import expert_rule
from countlens.distributed import Shard
from countlens.errors import InputError
from countlens.labels import expert_key, expert_label, is_head_pair
from countlens.model.adapt import module_of
from countlens.model.answers import answer_window
from countlens.model.arguments import require_batch, require_layers, require_vlm
from countlens.model.vlm import check_samples
from countlens.results import provenance
from countlens.validate import require_count

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.model.vlm import VLM, Batch


#: Expert ablations built and run together (each edit holds a full-width value per token).
SITES_PER_PASS = 8


def require_experts(vlm: VLM, what: str) -> list[int]:
    """The model's MoE layers, or an error naming ``what`` for a dense model."""
    if not vlm.arch.expert_layers:
        raise InputError(
            f"{what} needs a mixture-of-experts model; {vlm.arch.name} has no experts (its MLPs are dense)"
        )
    return list(vlm.arch.expert_layers)


def _layers(vlm: VLM, layers: Sequence[int] | None, what: str) -> list[int]:
    moe = require_experts(vlm, what)
    if layers is None:
        return moe
    for layer in require_layers(vlm, layers, what):
        vlm.arch.experts(int(layer))  # a LayerError naming the MoE layers
    return sorted(int(x) for x in layers)


@torch.no_grad()
def routing(vlm: VLM, batch: Batch, layers: Sequence[int] | None = None) -> dict[int, tuple[Tensor, Tensor]]:
    """Per MoE layer, the router's choice for every token of a prepared batch: (top-k expert indices,
    their weights), Int and Float[Tensor, "batch seq top_k"] (padding positions included)."""
    require_vlm(vlm, "routing")
    require_batch(batch, "routing")
    layers = _layers(vlm, layers, "routing")
    rows, seq = batch.inputs["input_ids"].shape
    rule, top_k = expert_rule(vlm.arch), vlm.arch.experts_top_k
    got = {}
    with vlm.read(batch):
        for layer in layers:
            got[layer] = rule.record_routing(vlm, layer)
    return {layer: tuple(t.view(rows, seq, -1).cpu() for t in rule.chosen(g, top_k)) for layer, g in got.items()}


def expert_usage(
    vlm: VLM, samples: Sequence, positions: str = "last", layers: Sequence[int] | None = None, batch_size: int = 16
) -> xr.DataArray:
    """The share of ``positions``' tokens (a token group: "last", "image", "text", "all") whose top-k
    includes each expert: (layer, expert); each layer's shares sum to top-k."""
    require_vlm(vlm, "expert_usage")
    check_samples(samples, "expert_usage")
    check_group(positions)
    layers = _layers(vlm, layers, "expert_usage")
    counts = torch.zeros(len(layers), vlm.arch.n_experts, dtype=torch.float64)
    tokens = 0
    for _, batch in vlm.batches(samples, batch_size):
        mask = group_mask(batch, positions)
        chosen = routing(vlm, batch, layers)
        for i, layer in enumerate(layers):
            index = chosen[layer][0][mask]  # tokens × top_k
            counts[i] += torch.bincount(index.flatten(), minlength=vlm.arch.n_experts).double()
        tokens += int(mask.sum())
    return xr.DataArray(
        (counts / max(tokens, 1)).numpy(),
        dims=("layer", "expert"),
        coords={"layer": layers, "expert": np.arange(vlm.arch.n_experts)},
        name="expert_usage",
        attrs={
            **provenance(vlm.name, vlm.arch.name, dataset={"samples": len(samples)}, samples=samples),
            "method": "expert_usage",
            "positions": positions,
            "tokens": tokens,
        },
    )


def patch_experts(
    vlm: VLM,
    pairs: Sequence,
    layers: Sequence[int] | None = None,
    positions: str = "all",
    batch_size: int = 16,
    store=None,
    progress: bool = False,
    shard: Shard | None = None,
    metric=None,
) -> xr.Dataset:
    """Expert patching: each expert's contribution at ``positions`` copied from the corrupt run into
    the clean run, one (layer, expert) at a time; ``effect`` / ``overwrite`` over (layer, expert), per
    pair ``logit_diff`` over (layer, expert, pair), as `countlens.circuits.methods.patching.patch_heads`."""
    require_vlm(vlm, "patch_experts")
    check_pair_sweep(pairs, batch_size, "patch_experts")
    metric = metric_for(vlm, pairs, metric, "patch_experts")
    check_group(positions)
    layers = _layers(vlm, layers, "patch_experts")
    experts = list(range(vlm.arch.n_experts))

    sets = [[Patch(Expert(layer, e), positions=positions)] for layer in layers for e in experts]

    spec = {"layers": layers, "positions": positions}
    coords = {"layer": layers, "expert": experts}
    ds = effect_sweep(vlm, pairs, sets, coords, "patch_experts", spec, batch_size, store, progress, shard, metric)
    ds.attrs.update(method="patch_experts", positions=positions)
    return ds


@torch.no_grad()
def expert_means(vlm: VLM, samples: Sequence, batch_size: int = 16) -> Float[Tensor, "moe_layer group expert d_model"]:
    """Each expert's mean contribution per token group (`countlens.circuits.methods.ablation.ABLATION_GROUPS`)
    over a reference set, MoE layers in order; zero counts where the expert was not chosen."""
    require_vlm(vlm, "expert_means")
    check_samples(samples, "expert_means")
    layers = require_experts(vlm, "expert_means")
    arch = vlm.arch
    sums = torch.zeros(len(layers), len(ABLATION_GROUPS), arch.n_experts, arch.d_model, dtype=torch.float64)
    counts = torch.zeros(len(ABLATION_GROUPS), dtype=torch.float64)
    rule = expert_rule(arch)
    for _, batch in vlm.batches(samples, batch_size, teacher_force=True):
        masks = group_masks(batch)
        recorded = cache_run(vlm, batch, layers, resid=False, z=False, experts=True)["experts"]
        for i, layer in enumerate(layers):
            module = module_of(vlm.hf, arch.experts(layer))
            for g, m in enumerate(masks):
                rule.add_group_sum(module, recorded[layer], m, sums[i, g])
        counts += torch.tensor([float(m.sum()) for m in masks], dtype=torch.float64)
    return (sums / counts.clamp(min=1)[None, :, None, None]).float()


def _mean_edit(vlm: VLM, batch: Batch, means: Tensor, layer: int, expert: int) -> Edit:
    """Expert ``expert`` at ``layer`` set to its group mean at every real token."""
    real, value = group_values(batch, means[vlm.arch.expert_layers.index(layer), :, expert])
    return Edit(Expert(layer, expert), real, value)


def _check_means(vlm: VLM, means: Tensor) -> None:
    arch = vlm.arch
    want = (len(arch.expert_layers), len(ABLATION_GROUPS), arch.n_experts, arch.d_model)
    if tuple(means.shape) != want:
        raise InputError(
            f"expert means of shape {tuple(means.shape)}, but {arch.name} needs {want} "
            "(MoE layers, token groups, experts, d_model): compute them with expert_means(vlm, samples)"
        )


def checked_experts(vlm: VLM, experts) -> list[tuple[int, int]]:
    """``experts`` as (layer, expert) pairs, each given as a pair of integers or a label such as "L1E0"
    (`countlens.labels.expert_key`; one expert may be given alone), checked against the model's MoE
    layers and experts."""
    require_experts(vlm, "ablate_experts")
    if isinstance(experts, str) or is_head_pair(experts):
        experts = [experts]
    sites = [expert_key(x) for x in experts]
    for layer, e in sites:
        vlm.arch.experts(layer)  # a LayerError naming the MoE layers
        if not 0 <= e < vlm.arch.n_experts:
            raise InputError(f"expert {e} out of range: {vlm.arch.name} has experts 0..{vlm.arch.n_experts - 1}")
    return sites


def ablate_experts(
    vlm: VLM,
    samples: Sequence,
    experts: Sequence[tuple[int, int] | str],
    means: Tensor | None = None,
    batch_size: int = 16,
) -> xr.Dataset:
    """Mean-ablate ``experts`` jointly — each (layer, expert) or the label results give it, such as
    "L1E0" — : per sample ``correct`` and ``logp`` before and after (``base_correct``,
    ``base_logp``), as `countlens.circuits.methods.ablation.ablate`."""
    require_vlm(vlm, "ablate_experts")
    check_samples(samples, "ablate_experts")
    require_count(batch_size, "batch_size")
    sites = checked_experts(vlm, experts)
    means = expert_means(vlm, samples, batch_size) if means is None else means
    _check_means(vlm, means)
    data = joint_ablation(
        vlm, samples, batch_size, lambda batch: [_mean_edit(vlm, batch, means, layer, e) for layer, e in sites]
    )
    return xr.Dataset(
        data,
        coords={"sample": np.arange(len(samples))},
        attrs={
            **provenance(vlm.name, vlm.arch.name, dataset={"samples": len(samples)}, samples=samples),
            "experts": ",".join(map(expert_label, sites)),
            "method": "ablate_experts",
        },
    )


def expert_ablation_scan(vlm: VLM, samples: Sequence, means: Tensor | None = None, batch_size: int = 16) -> xr.Dataset:
    """Mean-ablate each expert alone: ``acc_drop`` and ``logp_drop`` over (layer, expert), MoE layers
    only (replicas stacked in one forward, as `countlens.circuits.methods.ablation.ablation_scan`)."""
    require_vlm(vlm, "expert_ablation_scan")
    check_samples(samples, "expert_ablation_scan")
    require_count(batch_size, "batch_size")
    layers = require_experts(vlm, "expert_ablation_scan")
    means = expert_means(vlm, samples, batch_size) if means is None else means
    _check_means(vlm, means)
    sites = [(layer, e) for layer in layers for e in range(vlm.arch.n_experts)]
    ok_rows, drop_rows, base_ok = [], [], []
    for _, batch in vlm.batches(samples, batch_size, teacher_force=True):
        gold, keep = batch.answer_ids, answer_window(batch.answer_ids)
        b_ok, b_logp = gold_scores(run_edits(vlm, batch, None, [[]], keep=keep)[0], gold)
        # A few sites at a time: each edit holds a (batch, seq, d_model) value, and a large MoE model has
        # thousands of (layer, expert) sites (Qwen3-VL-30B-A3B: 48 × 128).
        scores = torch.cat(
            [
                run_edits(
                    vlm,
                    batch,
                    None,
                    [_mean_edit(vlm, batch, means, layer, e) for layer, e in sites[i : i + SITES_PER_PASS]],
                    keep=keep,
                    reduce=lambda rows, gold=gold: torch.stack(gold_scores(rows, gold)).float(),
                )
                for i in range(0, len(sites), SITES_PER_PASS)
            ]
        )
        ok_rows.append(scores[:, 0].bool().numpy())
        drop_rows.append((b_logp[None] - scores[:, 1]).numpy())
        base_ok.append(b_ok.numpy())
    ok, drop, base = np.concatenate(ok_rows, 1), np.concatenate(drop_rows, 1), np.concatenate(base_ok)
    shape = (len(layers), vlm.arch.n_experts)
    return xr.Dataset(
        {
            "acc_drop": (("layer", "expert"), (base.mean() - ok.mean(1)).reshape(shape)),
            "logp_drop": (("layer", "expert"), drop.mean(1).reshape(shape)),
            "base_acc": base.mean(),
        },
        coords={"layer": layers, "expert": np.arange(vlm.arch.n_experts)},
        attrs={
            **provenance(vlm.name, vlm.arch.name, dataset={"samples": len(samples)}, samples=samples),
            "method": "expert_mean_ablation",
            "groups": ",".join(ABLATION_GROUPS),
        },
    )
