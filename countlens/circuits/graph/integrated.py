"""EAP-IG on nodes: attribution patching with the gradient integrated from the corrupt input to the clean.

Attribution patching (AtP, `attribution_patch`) estimates the effect of patching a node's corrupt
activation into the clean run as (a_corrupt − a_clean) · ∂LD/∂a, the gradient taken at the clean run, LD
the metric (`countlens.circuits.metrics`; default the logit difference).
Where the metric is not linear in a between the two runs (a saturated softmax, a gate), one gradient
misjudges the change. EAP-IG (Hanna et al. 2024, "Have faith in faithfulness"; the MIB benchmark's
recommended default) averages the gradient over m points of the straight path between the two inputs,
as integrated gradients do (any metric: KL from the clean run too, whose gradient at the clean run
alone is zero):

    score(a) = (a_corrupt − a_clean) · (1/m) Σ_{k=1..m} ∂LD/∂a |_{x_k},   x_k = x_corrupt + (k/m)(x_clean − x_corrupt)

— "EAP-IG-inputs": the interpolation is of the model's inputs, here the input of decoder layer 0 (the
token embeddings with the projected image tokens in place) and, on a cross-attention model, the image
states. With m = 1 the one point is the clean input, and the score is AtP's. Nodes are those of
`countlens.circuits.graph.faithfulness` (heads' z, MLP blocks, the image and text inputs); a node's score
sums over every position, as MIB sums them, and is normalised like the exact sweeps: divided by
Σ LD_corrupt − Σ LD_clean, so 1 means "as much as patching everything". Where the image also enters
inside the decoder (Qwen3-VL's DeepStack, Gemma 4's per-layer inputs) those additions are not
interpolated: they stay the clean input's.

Cost: two recording forwards and m forward-and-backward passes per chunk of pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine.gradients import activation_gradients_only
from countlens.circuits.engine.metrics import Metric, metric_for, normalised
from countlens.circuits.engine.pair_batch import pairs_provenance, prepare_pairs
from countlens.circuits.engine.sweep import check_pair_sweep
from countlens.circuits.graph.nodes import Node, image_positions, image_states_path, record_nodes
from countlens.circuits.sites import INPUTS, Embed, HeadZ, MlpOut, first_output, heads_view
from countlens.labels import head_label, input_label, mlp_label
from countlens.model.arguments import require_vlm
from countlens.validate import require_count

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch


def _every_node(vlm: VLM) -> list[Node]:
    arch = vlm.arch
    nodes: list[Node] = [Embed(part) for part in INPUTS]
    for layer in range(arch.n_layers):
        nodes += [HeadZ(layer, h) for h in range(arch.heads(layer))]
        nodes.append(MlpOut(layer))
    return nodes


def _gradients(vlm: VLM, batch: Batch, embed: torch.Tensor, states: torch.Tensor | None, pb, metric: Metric) -> dict:
    """One forward and backward of ``batch`` with layer 0's input (and a cross-attention model's image
    states) replaced by the given tensors: the gradient of Σ ``metric`` with respect to every node's output."""
    arch = vlm.arch
    embed = embed.detach().clone().requires_grad_(True)
    if states is not None:
        states = states.detach().clone().requires_grad_(True)
    zs, mlps, gz, gm = [], [], [], []
    with activation_gradients_only(vlm.hf):
        with torch.enable_grad(), vlm.read(batch):
            if states is not None:
                vlm.module(image_states_path(vlm)).output = states
            vlm.module(arch.layer(0)).input = embed
            for layer in range(arch.n_layers):
                z = vlm.module(arch.o_proj(layer)).input
                z.requires_grad_(True)
                zs.append(z.save())
                out = first_output(vlm.module(vlm.arch.mlp(layer)).output)
                out.requires_grad_(True)
                mlps.append(out.save())
            logits = vlm.nn.output.logits[:, -1].float()
            ld = metric(logits, pb)
            with ld.sum().backward():
                for layer in reversed(range(arch.n_layers)):
                    gm.append(mlps[layer].grad.save())
                    gz.append(zs[layer].grad.save())
    return {
        "z": dict(enumerate(g.detach() for g in gz[::-1])),
        "mlp": dict(enumerate(g.detach() for g in gm[::-1])),
        "embed": embed.grad.detach(),
        "states": None if states is None else states.grad.detach(),
    }


#: EAP-IG's interpolation steps by default (MIB's authors' default family of settings), on nodes and
#: on edges (`countlens.circuits.graph.edge_attribution`); the registry (`countlens.circuits.methods.registry`)
#: reads it.
IG_STEPS = 5


def node_attribution(vlm: VLM, pairs: Sequence, steps: int = IG_STEPS, batch_size: int = 16, metric=None) -> xr.Dataset:
    """EAP-IG scores of every node (see the module docstring): ``effect`` over (layer, head) for the
    heads (NaN beyond a layer's own heads), ``mlp_effect`` over layer, ``input_effect`` over the input
    groups (image, text), each normalised like the exact sweeps. ``steps`` = 1 is AtP. ``metric``:
    `countlens.circuits.metrics` (default the logit difference); any metric with ``steps`` > 1 (``kl``
    too), one whose gradient at the clean run is not zero with ``steps`` = 1."""
    require_vlm(vlm, "node_attribution")
    check_pair_sweep(pairs, batch_size, "node_attribution")
    require_count(steps, "steps")
    who = "EAP-IG (node_attribution)" if steps > 1 else "node_attribution with steps=1 (AtP)"
    metric = metric_for(vlm, pairs, metric, who, moving=steps == 1)
    arch = vlm.arch
    nodes = _every_node(vlm)
    cross = image_states_path(vlm) is not None
    heads = torch.zeros(arch.n_layers, arch.n_heads, dtype=torch.float64)
    mlp = torch.zeros(arch.n_layers, dtype=torch.float64)
    inputs = torch.zeros(len(INPUTS), dtype=torch.float64)
    clean_sum = corrupt_sum = 0.0
    differences = []  # per pair: M_corrupt − M_clean, for the normaliser's noise rule
    for start in range(0, len(pairs), batch_size):
        pb = prepare_pairs(vlm, pairs[start : start + batch_size])
        corrupt, clean = (record_nodes(vlm, b, nodes, logits=True) for b in (pb.corrupt, pb.clean))
        pb = metric.at_clean(pb, clean["logits"])
        grads: dict = {}
        for k in range(1, steps + 1):
            alpha = k / steps
            embed = corrupt["embed"] + alpha * (clean["embed"] - corrupt["embed"])
            states = corrupt["states"] + alpha * (clean["states"] - corrupt["states"]) if cross else None
            got = _gradients(vlm, pb.clean, embed, states, pb, metric)
            for key in ("z", "mlp"):
                for layer, g in got[key].items():
                    grads.setdefault(key, {})[layer] = grads.get(key, {}).get(layer, 0) + g.double() / steps
            for key in ("embed", "states"):
                if got[key] is not None:
                    grads[key] = grads.get(key, 0) + got[key].double() / steps
        for layer in range(arch.n_layers):
            dz = (corrupt["z"][layer].double() - clean["z"][layer].double()) * grads["z"][layer]
            heads[layer, : arch.heads(layer)] += heads_view(dz, arch.heads(layer)).sum((0, 1, 3)).cpu()
            dm = (corrupt["mlp"][layer].double() - clean["mlp"][layer].double()) * grads["mlp"][layer]
            mlp[layer] += float(dm.sum())
        de = ((corrupt["embed"].double() - clean["embed"].double()) * grads["embed"]).sum(-1).cpu()
        image = image_positions(vlm, pb.clean)
        if cross:  # the image is its states; every token is text
            ds_ = (corrupt["states"].double() - clean["states"].double()) * grads["states"]
            inputs[0] += float(ds_.sum())
            inputs[1] += float(de.sum())
        else:
            inputs[0] += float(de[image].sum())
            inputs[1] += float(de[~image].sum())
        # the normaliser from the recordings' own forwards
        clean_m, corrupt_m = metric(clean["logits"], pb), metric(corrupt["logits"], pb)
        clean_sum += float(clean_m.sum())
        corrupt_sum += float(corrupt_m.sum())
        differences.append((corrupt_m.double() - clean_m.double()).cpu().numpy())
    denom, noted = normalised(clean_sum, corrupt_sum, differences, metric)
    for layer in range(arch.n_layers):  # beyond a layer's own heads: no node
        heads[layer, arch.heads(layer) :] = float("nan")
    return xr.Dataset(
        {
            "effect": (("layer", "head"), (heads / denom).numpy()),
            "mlp_effect": ("layer", (mlp / denom).numpy()),
            "input_effect": ("input", (inputs / denom).numpy()),
        },
        coords={
            "layer": np.arange(arch.n_layers),
            "head": np.arange(arch.n_heads),
            "input": list(INPUTS),
            "kind": ("layer", [arch.kind(layer) for layer in range(arch.n_layers)]),
        },
        attrs={
            **pairs_provenance(vlm, pairs, **noted),
            "method": "eap-ig" if steps > 1 else "atp",
            "steps": steps,
        },
    )


def node_scores_of(ds: xr.Dataset) -> dict[str, float]:
    """A `node_attribution` result as {node label: score}, every node, for `faithfulness`."""
    scores = {input_label(str(g)): float(v) for g, v in zip(ds["input"].values, ds.input_effect.values)}
    for layer in ds["layer"].values:
        for head in ds["head"].values:
            value = float(ds.effect.sel(layer=layer, head=head))
            if not np.isnan(value):
                scores[head_label((int(layer), int(head)))] = value
        scores[mlp_label(int(layer))] = float(ds.mlp_effect.sel(layer=layer))
    return scores
