"""RelP: relevance patching (Rezaei Jafari, Eberle, Khakzar & Nanda 2025, arXiv 2508.21258).

Attribution patching (AtP) estimates patching a node n from the corrupt run into the clean one as
(n_corrupt − n_clean)·∂LD/∂n. RelP keeps that form and replaces the local gradient by the propagation
coefficients of Layer-wise Relevance Propagation: the backward pass of the clean run is taken through
a model whose non-linear parts are frozen at their clean values by LRP's rules for transformers —

- **LN-rule**: a normalisation y = s(x)·x·w (every RMSNorm of the language model, the final one too)
  is linear in x with its scale s(x) held at the clean run's value;
- **Identity-rule**: the MLP's activation a = act(g) passes relevance unchanged: a = g·(act(g)/g) with
  the ratio held at its clean value (0 where g = 0);
- **Half-rule**: the gated MLP's product a ⊙ b sends half of the gradient to each factor,
  0.5·(b·da + a·db);
- **AH-rule**: attention probabilities are constants: the softmax reads q and k detached, so the
  gradient reaches a head's values only.

The forward values are unchanged (each rule's rewrite computes the same numbers), so RelP costs what
AtP costs: the corrupt run, and the clean run with one backward pass. countlens scores heads (a head's
z over ``positions``, as `patch_heads` patches) and the residual stream after each layer, normalised
like the exact sweeps: Σ_pairs estimate / (Σ LD_corrupt − Σ LD_clean). LD is the metric
(`countlens.circuits.metrics`; default the logit difference), and it must be linear in the logits: the
rules conserve relevance from the metric down only then, so RelP refuses any other by name.

Supported: the families in `SUPPORTED`, whose decoder layers are RMSNorm, softmax attention and a
gated MLP ``down(act(gate(x)) * up(x))``; every run checks that the rewritten forward reproduces the
model's own logits and refuses the model otherwise. countlens's implementation follows the paper's
rules as its text states them; its figures on VLMs are countlens's own and not comparable with the
paper's (text models, IOI).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens.circuits.engine import Hook, hooked, module_of
from countlens.circuits.engine.edits import cache_run
from countlens.circuits.engine.freeze import frozen, frozen_ratio
from countlens.circuits.engine.metrics import Metric, metric_for, normalised
from countlens.circuits.engine.pair_batch import (
    PairBatch,
    pairs_provenance,
    prepare_pairs,
)
from countlens.circuits.engine.record import record
from countlens.circuits.engine.sweep import check_pair_sweep
from countlens.circuits.sites import HeadZ, Residual, check_group, first_arg, group_mask, heads_view
from countlens.errors import InputError

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch

#: Families whose layers are RMSNorm, softmax attention and a gated MLP (the rules above).
SUPPORTED: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl")
#: The rewritten forward's logits may differ from the model's own by rounding only (relative to their size).
REPRODUCES = 1e-4


def refusal(vlm: VLM) -> str | None:
    """None where RelP runs on ``vlm``, else why not."""
    if vlm.arch.name not in SUPPORTED:
        return f"RelP's rules are written for {', '.join(SUPPORTED)} (RMSNorm, gated MLP), not {vlm.arch.name}"
    if vlm.remote:
        return "a remote model: RelP runs the model locally"
    return None


def _half(a: Tensor, b: Tensor) -> Tensor:
    """a ⊙ b whose gradient is half to each factor: 0.5·(b·da + a·db)."""
    return 0.5 * (a * b.detach() + a.detach() * b)


@contextmanager
def lrp_rules(vlm: VLM) -> Iterator[None]:
    """Inside: every forward of ``vlm``'s language model follows the four rules (values unchanged): the
    LN- and AH-rules are the engine's `frozen` (norms and attention detached), the MLP's rules hooks here."""

    def mlp_hook(module, args, kwargs, out):
        x = first_arg(args, kwargs)
        g = module.gate_proj(x)
        a = frozen_ratio(module.act_fn(g), g)
        return module.down_proj(_half(a, module.up_proj(x)))

    arch = vlm.arch
    for layer in range(arch.n_layers):
        if not all(
            hasattr(module_of(vlm.hf, arch.mlp(layer)), p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")
        ):
            raise InputError(f"layer {layer}'s MLP of {vlm.name} is not a gated MLP: RelP's half-rule needs one")
    mlps = [Hook(arch.mlp(layer), "after", mlp_hook) for layer in range(arch.n_layers)]
    with hooked(vlm.hf, mlps), frozen(vlm, norms="detach", attention="detach"):
        yield


def _clean_pass(vlm: VLM, batch: Batch, pb: PairBatch, metric: Metric) -> tuple:
    """The clean run under the rules (`record` with ``metric`` as its metric): the metric per pair, and each
    layer's z and output with their RelP coefficients."""
    arch = vlm.arch
    layers = range(arch.n_layers)
    heads = [HeadZ(layer, h) for layer in layers for h in range(arch.heads(layer))]
    with lrp_rules(vlm):
        cache = record(
            vlm,
            batch,
            heads + [Residual(layer) for layer in layers],
            lambda lg: metric(lg, metric.at_clean(pb, lg)),
            on_device=True,
        )

    def z(values: dict, layer: int) -> Tensor:  # a layer's heads side by side again: o_proj's input
        return torch.cat([values[HeadZ(layer, h)] for h in range(arch.heads(layer))], -1)

    logits = cache.logits.float()
    return (
        logits,
        metric(logits, metric.at_clean(pb, logits)),
        [z(cache, layer) for layer in layers],
        [cache[Residual(layer)] for layer in layers],
        [z(cache.grad, layer) for layer in layers],
        [cache.grad[Residual(layer)] for layer in layers],
    )


def relevance_patch(vlm: VLM, pairs: Sequence, positions: str = "all", batch_size: int = 16, metric=None) -> xr.Dataset:
    """RelP estimates of head patching (``effect`` over (layer, head)) and of residual patching over
    ``positions`` (``resid_effect`` over layer), normalised like the exact sweeps (module docstring).
    ``metric``: one linear in the logits (`countlens.circuits.metrics`; default the logit difference): RelP's
    relevance is conserved only for those, and any other is refused by name."""
    check_pair_sweep(pairs, batch_size, "relevance_patch")
    check_group(positions)
    metric = metric_for(vlm, pairs, metric, "RelP (relevance_patch)", linear=True)
    why = refusal(vlm)
    if why is not None:
        raise InputError(f"relevance_patch does not run on {vlm.name}: {why}; use attribution_patch")
    arch = vlm.arch
    n_layers, n_heads = arch.n_layers, arch.n_heads
    head_est = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    resid_est = torch.zeros(n_layers, dtype=torch.float64)
    clean_sum = corrupt_sum = 0.0
    differences = []  # per pair: M_corrupt − M_clean, for the normaliser's noise rule
    for start in range(0, len(pairs), batch_size):
        pb = prepare_pairs(vlm, pairs[start : start + batch_size])
        corrupt = cache_run(vlm, pb.corrupt, range(n_layers))
        logits, ld, zs, hs, gz, gh = _clean_pass(vlm, pb.clean, pb, metric)
        own = vlm.forward(pb.clean, use_cache=False, logits_to_keep=1).logits[:, -1].float()
        gap = float((logits - own).abs().max())
        if gap > REPRODUCES * max(1.0, float(own.abs().max())):
            raise InputError(
                f"RelP's rewritten forward of {vlm.name} moves its logits by {gap:.3g}: its layers are not the "
                "RMSNorm / gated-MLP / softmax-attention blocks the rules are written for; use attribution_patch"
            )
        m = group_mask(pb.clean, positions).to(torch.float64)
        for layer in range(n_layers):
            dz = (corrupt["z"][layer].double() - zs[layer].double()) * gz[layer].double()
            per_head = heads_view(dz, arch.heads(layer)).sum(-1) * m[..., None].to(dz.device)
            head_est[layer, : arch.heads(layer)] += per_head.sum((0, 1)).cpu()
            dh = (corrupt["resid"][layer].double() - hs[layer].double()) * gh[layer].double()
            resid_est[layer] += (dh.sum(-1) * m.to(dh.device)).sum().cpu()
        corrupt_ld = metric(corrupt["logits"], metric.at_clean(pb, logits))
        clean_sum += float(ld.sum())
        corrupt_sum += float(corrupt_ld.sum())
        differences.append((corrupt_ld.double() - ld.double().to(corrupt_ld.device)).cpu().numpy())
    denom, noted = normalised(clean_sum, corrupt_sum, differences, metric)
    for layer in range(n_layers):  # beyond a layer's own heads: no site
        head_est[layer, arch.heads(layer) :] = float("nan")
    return xr.Dataset(
        {
            "effect": (("layer", "head"), (head_est / denom).numpy()),
            "resid_effect": ("layer", (resid_est / denom).numpy()),
        },
        coords={
            "layer": np.arange(n_layers),
            "head": np.arange(n_heads),
            "kind": ("layer", [arch.kind(layer) for layer in range(n_layers)]),
        },
        attrs={
            **pairs_provenance(vlm, pairs, **noted),
            "method": "relevance_patch",
            "positions": positions,
        },
    )
