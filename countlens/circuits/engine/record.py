"""Recording sites: any set of sites read in one forward, through the engine's torch hooks.

`record` returns each site's value over a prepared batch, Float[Tensor, "batch seq d"], and with a metric
its gradient there, in the engine's one `Cache`; `mean_activation`
averages one site over samples' tokens at chosen positions (a `countlens.circuits.Mean` reference, half
of a steering vector). `location` is where a site is read and written by a torch hook: its
`countlens.circuits.sites.Location` (a module, its input or output, the site's view), after the site
is checked against the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.circuits.engine.attention import eager_attention
from countlens.circuits.engine.cache import Cache
from countlens.circuits.engine.gradients import activation_gradients_only
from countlens.circuits.engine.hooks import Hook, hooked
from countlens.circuits.sites import Location, check_site
from countlens.circuits.sites.location import HOOKS
from countlens.circuits.sites.positions import Frame, as_positions, with_layout, with_samples
from countlens.errors import InputError
from countlens.model.arguments import require_batch, require_vlm
from countlens.validate import require_count, require_sequence

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.circuits.sites import Site
    from countlens.model.vlm import VLM, Batch


def rows_seq(t: Tensor, frame: Frame) -> Tensor:
    """``t`` as (rows, seq, …): an MoE block's flattened tokens (rows · seq, d) viewed back."""
    rows, seq = frame.input_ids.shape
    return t.view(rows, seq, -1) if t.ndim == 2 and t.shape[0] == rows * seq else t


def location(vlm: VLM, site: Site) -> Location:
    """Where ``site`` lives in ``vlm`` for a torch hook, after `check_site` refused what is no site or one
    the model lacks."""
    if not hasattr(site, "location") or isinstance(site, type):
        raise InputError(
            f"{site!r:.60} is no site; name one with countlens.circuits' Residual(layer), HeadZ(layer, head), Q, K, "
            "V, MlpIn, MlpOut or Pattern"
        )
    check_site(vlm, site)
    if HOOKS not in getattr(site, "backends", ()):
        raise InputError(
            f"{site} is written inside the experts or cross-attention modules, or is an edge node: patch it through "
            "effect() or patch_experts / patch_layers; intervene and record take Residual, HeadZ, Q, K, V, MlpIn, "
            "MlpOut, Logits and Pattern (read only)"
        )
    return site.location(vlm)


def require_local(vlm: VLM, what: str) -> None:
    if vlm.remote:
        raise InputError(f"{what} runs torch hooks on a local model; {vlm.name} is remote (NDIF): use vlm.trace")


def record(
    vlm: VLM,
    batch: Batch,
    sites: Sequence[Site],
    metric: Callable[[Tensor], Tensor] | None = None,
    on_device: bool = False,
) -> Cache:
    """One forward of a prepared ``batch``: a `Cache` of each site's value, Float[Tensor, "batch seq d"] on
    the CPU (a `Pattern`'s: Float[Tensor, "batch query key"]), marked with the samples of its rows where
    the batch has them (`VLM.prepare_samples`; `countlens.circuits.sites.positions.samples_of`) and with the
    batch itself (`countlens.circuits.sites.positions.layout_of`: a donor of another layout), and the
    read position's logits (``cache.logits``). ``on_device``: values and gradients stay where the model
    computed them, in its dtype (for methods that go on computing there), instead of float32 copies on
    the CPU.

    With ``metric`` (the read position's logits, Float[Tensor, "batch vocab"] → one value per row), also
    each site's gradient of the metric's sum over rows, ``cache.grad[site]``, shaped like its value: rows
    do not interact, so a row's gradient is its own metric's. The forward then runs with the embeddings
    as a leaf and no parameter requiring a gradient (`activation_gradients_only`)."""
    require_vlm(vlm, "record")
    require_batch(batch, "record")
    require_local(vlm, "record")
    sites = require_sequence(sites, "sites", example="[Residual(3), HeadZ(0, 1)]")
    if metric is not None and not callable(metric):
        raise InputError(f"record's metric is a function of the logits (batch, vocab) → (batch,), not {metric!r:.60}")
    for site in sites:
        location(vlm, site)  # refuses what is no site before anything is hashed or run
    locations = {site: location(vlm, site) for site in dict.fromkeys(sites)}
    if metric is not None and any(loc.io == "weights" for loc in locations.values()):
        raise InputError("record takes no metric with a Pattern: attention weights are read, not differentiated")
    before = [site for site in locations if not hasattr(site, "layer")]  # a vision block runs before layer 0
    if metric is not None and before:
        raise InputError(
            f"record's metric is differentiated from layer 0's input on; {before[0]} runs before it: record it "
            "without a metric, or take the gradient at Residual(-1)"
        )
    frame = Frame.of(batch)
    got: dict = {}

    def keeper(site, loc):
        def keep(t):
            got[site] = (t, loc.view(rows_seq(t, frame)))

        return keep

    patterns = any(loc.io == "weights" for loc in locations.values())
    hooks = [Hook(loc.path, loc.io, keeper(site, loc)) for site, loc in locations.items()]
    if metric is not None:
        hooks.insert(0, Hook(vlm.arch.layer(0), "input", lambda x: x.detach().requires_grad_(True)))
    grad = metric is not None
    with (
        torch.set_grad_enabled(grad),
        activation_gradients_only(vlm.hf) if grad else nullcontext(),
        hooked(vlm.hf, hooks),
        eager_attention(vlm) if patterns else nullcontext(),
    ):
        logits = vlm.hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits[:, -1]
        if grad:
            total = metric(logits.float()).sum()
            tensors = {id(t): t for t, _ in got.values()}  # each module tensor once, however many sites view it
            grads = dict(zip(tensors, torch.autograd.grad(total, list(tensors.values()), allow_unused=True)))

    def kept(t: Tensor) -> Tensor:
        return t.detach() if on_device else t.detach().float().cpu().clone()

    cache = Cache({site: kept(view) for site, (_, view) in got.items()}, logits=kept(logits))
    if grad:
        for site, (t, _) in got.items():
            g = grads[id(t)]
            g = torch.zeros_like(t) if g is None else g
            cache.grad[site] = kept(locations[site].view(rows_seq(g, frame)))  # a Cache too: label access
    for values in cache.values():
        if len(values) == len(batch):  # a vision block's rows are the tower's patches, not samples
            with_layout(values, batch)  # a donor of another layout: positions resolved in its own frame
            if batch.samples is not None:  # each row knows its sample: a Patch writes it into that sample's row
                with_samples(values, batch.samples)
    return cache


@torch.no_grad()
def mean_activation(
    vlm: VLM, samples: Sequence, site: Site, positions="all", batch_size: int = 16
) -> Float[Tensor, " d"]:
    """The mean of ``site`` over ``samples``' tokens at ``positions`` (Float[Tensor, "d"], float32, CPU)."""
    require_vlm(vlm, "mean_activation")
    from countlens.model.vlm import check_samples

    check_samples(samples, "mean_activation")
    require_count(batch_size, "batch_size")
    positions = as_positions(positions)
    positions.check(vlm)
    location(vlm, site)
    total, count = torch.zeros(site.width(vlm.arch), dtype=torch.float64), 0
    for _, batch in vlm.batches(samples, batch_size):
        values = record(vlm, batch, [site])[site]
        mask = positions.mask(vlm, Frame.of(batch)).cpu()
        total += values[mask].double().sum(0)
        count += int(mask.sum())
    if count == 0:
        raise InputError(f"no token of the {len(samples)} samples lies at {positions}: nothing to average")
    return (total / count).float()
