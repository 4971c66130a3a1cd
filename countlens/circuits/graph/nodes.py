"""Nodes: the components a circuit is made of, recorded and ablated in stacked forwards.

A node is one component's output over every position, named by its site
(`countlens.circuits.sites`): a head's z (`HeadZ`, its slice of the attention output projection's
input, `Arch.o_proj`), a layer's MLP output (`MlpOut`; on a mixture-of-experts layer, the whole MoE
block's, or each `Expert`), or an input (`Embed`): the image tokens' embeddings and the other tokens'
embeddings (the input of layer 0 at those positions; on a cross-attention model the image node is
the image states every cross-attention layer reads, `CrossAttentionSpec.states`). A node set is
chosen by kind names (`NODE_KINDS`), each naming one site kind. `record_nodes` records their outputs in
one forward; `ablated_logits` runs a batch once per set of nodes, each set's nodes overwritten by
recorded values (`countlens.circuits.graph.faithfulness` defines the circuits and the metric).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.circuits.engine.writes import Placed, write_experts
from countlens.circuits.sites import (
    INPUTS,
    Embed,
    Expert,
    HeadZ,
    MlpOut,
    first_output,
    group_mask,
    repeat_inputs,
    skip_tower,
    tower_output,
)
from countlens.circuits.sites.expert_rules import expert_rule
from countlens.errors import InputError
from countlens.model import memory
from countlens.validate import require_choice

if TYPE_CHECKING:
    from jaxtyping import Bool, Float

    from countlens.model.vlm import VLM, Batch

#: The node kinds a node set is chosen by, each a site kind: a head's z, a layer's MLP (block) output, an
#: input part's embeddings, and a MoE layer's expert (its contribution).
NODE_SITES: dict[str, type] = {"head": HeadZ, "mlp": MlpOut, "input": Embed, "expert": Expert}
NODE_KINDS: tuple[str, ...] = tuple(NODE_SITES)
#: The kinds every model has (the default node set of the whole graph).
BASE_KINDS: tuple[str, ...] = ("head", "mlp", "input")
#: A node: one component's output over every position.
Node = HeadZ | MlpOut | Embed | Expert


def kind_of(node: Node) -> str:
    """The node kind (`NODE_KINDS`) ``node`` is of."""
    return next(name for name, site in NODE_SITES.items() if type(node) is site)


def node_key(node: Node) -> tuple:
    """A total order of nodes: by kind's name, layer, then head, expert or input part."""
    return (kind_of(node), node.layer, getattr(node, "head", getattr(node, "expert", getattr(node, "part", 0))))


def graph_nodes(vlm: VLM, kinds: Sequence[str] = BASE_KINDS) -> list[Node]:
    """The model's nodes of ``kinds``, in forward order: inputs, then per layer its heads and its MLP.
    With "expert", a mixture-of-experts layer's experts stand for its MLP node (the block's other
    parts, such as a shared expert, are then no node); on a model without experts "expert" is refused."""
    for kind in kinds:
        require_choice(kind, "a node kind", NODE_KINDS, InputError)
    arch = vlm.arch
    experts = "expert" in kinds
    if experts and not arch.expert_layers:
        raise InputError(f"{vlm.name} has no mixture-of-experts layers: its nodes have no 'expert' kind")
    out: list[Node] = [Embed(part) for part in INPUTS] if "input" in kinds else []
    for layer in range(arch.n_layers):
        if "head" in kinds:
            out += [HeadZ(layer, h) for h in range(arch.heads(layer))]
        if experts and layer in arch.expert_layers:
            out += [Expert(layer, e) for e in range(arch.n_experts)]
        elif "mlp" in kinds:
            out.append(MlpOut(layer))
    return out


def image_positions(vlm: VLM, batch: Batch) -> Bool[Tensor, "batch seq"]:
    """Where the image tokens sit (none on a cross-attention model: its image is its states)."""
    if image_states_path(vlm) is not None:
        return torch.zeros_like(batch.inputs["attention_mask"], dtype=torch.bool)
    return group_mask(batch, "image")


def image_states_path(vlm: VLM) -> str | None:
    cross = vlm.arch.spec.cross_attention
    return None if cross is None else cross.states


def record_nodes(
    vlm: VLM, batch: Batch | dict, nodes: Sequence[Node], logits: bool = False, grad: bool = False
) -> dict:
    """The outputs of ``nodes``' sites in one forward of ``batch`` (a `Batch` or the model's inputs):
    ``z[layer]``, ``mlp[layer]``, ``embed`` (layer 0's input) and ``states`` (a cross-attention model's
    image states); with ``logits``, the same forward's last-position logits too (float32), so that a
    method's normalising logit differences cost no forward of their own. With ``grad`` (opt-in) the
    forward keeps its graph: the recording can be ablation values that train (`countlens.toy.edge_plant`)."""
    with torch.set_grad_enabled(grad):
        return _record(vlm, batch, nodes, logits)


def _record(vlm: VLM, batch: Batch | dict, nodes: Sequence[Node], logits: bool) -> dict:
    by_kind = {kind: {n.layer for n in nodes if isinstance(n, site)} for kind, site in NODE_SITES.items()}
    inputs = bool(by_kind["input"])
    states_path = image_states_path(vlm)
    got: dict = {"z": {}, "mlp": {}, "experts": {}}
    with vlm.read(batch):
        if inputs and states_path is not None:
            got["states"] = vlm.module(states_path).output.save()
        if inputs:
            got["embed"] = vlm.module(vlm.arch.layer(0)).input.save()
        for layer in sorted(by_kind["head"] | by_kind["mlp"] | by_kind["expert"]):
            if layer in by_kind["head"]:
                got["z"][layer] = vlm.module(vlm.arch.o_proj(layer)).input.save()
            if layer in by_kind["expert"]:
                got["experts"][layer] = expert_rule(vlm.arch).record(vlm.module(vlm.arch.experts(layer)))
            if layer in by_kind["mlp"]:
                got["mlp"][layer] = first_output(vlm.module(vlm.arch.mlp(layer)).output).save()
        if logits:
            got["logits"] = vlm.nn.output.logits[:, -1].save()
    if logits:
        got["logits"] = got["logits"].float()
    rows, seq = (batch if isinstance(batch, dict) else batch.inputs)["input_ids"].shape
    got["experts"] = {
        layer: expert_rule(vlm.arch).per_token(saved, rows, seq, vlm.arch.n_experts)
        for layer, saved in got["experts"].items()
    }
    return got


def mean_of(a: dict, b: dict) -> dict:
    """Per position, the mean of two recordings over both of their rows, broadcast to one's rows."""

    def avg(x: Tensor, y: Tensor) -> Tensor:
        both = torch.cat([x, y]).float()
        return both.mean(0, keepdim=True).expand_as(x).to(x.dtype)

    if a.get("experts"):
        raise InputError(
            "mean ablation of experts is not defined here (an expert's contribution is recorded as its "
            "routing and input, whose mean is no mean contribution): use ablation='patch' with expert nodes"
        )
    out = {
        "z": {k: avg(v, b["z"][k]) for k, v in a["z"].items()},
        "mlp": {k: avg(v, b["mlp"][k]) for k, v in a["mlp"].items()},
    }
    for key in ("embed", "states"):
        if key in a:
            out[key] = avg(a[key], b[key])
    return out


def replica_masks(vlm: VLM, sets: Sequence[frozenset], n: int, image: Tensor) -> dict:
    """Per stacked replica (``n`` rows each), where its ablated nodes sit: ``z[layer]`` Bool (k·n, 1,
    width of the layer's z), ``mlp[layer]`` (k·n, 1, 1), ``experts[layer]`` [(replica, expert)],
    ``embed`` (k·n, seq, 1) and ``states`` (k) for the image states; a site no replica ablates is left out."""
    arch = vlm.arch
    cross = image_states_path(vlm) is not None
    k = len(sets)
    z: dict[int, Tensor] = {}
    mlp: dict[int, Tensor] = {}
    experts: dict[int, list[tuple[int, int]]] = {}
    embed = torch.zeros(k, *image.shape, dtype=torch.bool)
    states = torch.zeros(k, dtype=torch.bool)
    for r, ablate in enumerate(sets):
        for node in ablate:
            if isinstance(node, HeadZ):
                d = arch.head_dim(node.layer)
                if node.layer not in z:
                    z[node.layer] = torch.zeros(k, arch.heads(node.layer) * d, dtype=torch.bool)
                z[node.layer][r, node.head * d : (node.head + 1) * d] = True
            elif isinstance(node, MlpOut):
                mlp.setdefault(node.layer, torch.zeros(k, dtype=torch.bool))[r] = True
            elif isinstance(node, Expert):
                experts.setdefault(node.layer, []).append((r, node.expert))
            elif node.part == "image" and cross:
                states[r] = True
            elif node.part == "image":
                embed[r] |= image
            else:
                embed[r] |= torch.ones_like(image) if cross else ~image
    return {
        "z": {la: m.repeat_interleave(n, 0)[:, None, :] for la, m in z.items()},
        "mlp": {la: m.repeat_interleave(n, 0)[:, None, None] for la, m in mlp.items()},
        "experts": {la: sorted(pairs) for la, pairs in experts.items()},
        "embed": embed.reshape(k * n, -1)[..., None] if embed.any() else None,
        "states": states if states.any() else None,
    }


def _write_experts(vlm: VLM, layer: int, ablated: list[tuple[int, int]], values: dict, batch: Batch) -> None:
    """Inside a trace: each (replica, expert)'s contribution at every position of that replica's rows
    replaced by the recorded run's (`countlens.circuits.sites.Expert`'s write, the edits' own)."""
    n, seq = batch.inputs["input_ids"].shape
    b, s = torch.ones(n, seq, dtype=torch.bool).nonzero(as_tuple=True)
    mask = torch.ones(n, seq, dtype=torch.bool)
    placed = [Placed(r, Expert(layer, e), mask, None, b, s) for r, e in ablated]
    write_experts(vlm, placed, {"experts": values["experts"]}, n, seq)


@torch.no_grad()
def ablated_logits(
    vlm: VLM, batch: Batch, sets: Sequence[frozenset], values: dict, image: Tensor, max_rows: int | None = None
) -> Float[Tensor, "circuits batch vocab"]:
    """Last-position logits of ``batch`` once per set of ``sets``, that set's nodes overwritten by
    ``values``. The sets run stacked, as many copies of the batch a forward as memory holds
    (`countlens.model.memory.rows_per_forward`); each site is one ``where`` over the copies."""
    n = len(batch)
    if max_rows is None:
        free = memory.model_free_bytes(vlm)
        if free is None:
            max_rows = memory.MAX_ROWS
        else:
            w = memory.widths(vlm)
            max_rows = memory.rows_per_forward(
                w, int(batch.inputs["input_ids"].shape[1]), free, 1, batch.patches(w.merge)
            )
    per_pass = max(1, max_rows // n)
    states_path = image_states_path(vlm)
    tower = tower_output(vlm, batch) if len(sets) > 1 else None
    out = []
    for i in range(0, len(sets), per_pass):
        chunk = sets[i : i + per_pass]
        k = len(chunk)
        masks = replica_masks(vlm, chunk, n, image)
        with vlm.trace(repeat_inputs(batch.inputs, k), use_cache=False, logits_to_keep=1):
            if tower is not None:
                skip_tower(vlm, tower, k)
            if masks["states"] is not None:
                site = vlm.module(states_path).output
                per = values["states"].shape[0]  # the states' rows of one copy of the batch
                where = masks["states"].repeat_interleave(per).view(-1, *[1] * (site.ndim - 1))
                fill = torch.cat([values["states"]] * k).to(site.device, site.dtype)
                site[:] = torch.where(where.to(site.device), fill, site)
            if masks["embed"] is not None:
                hid = vlm.module(vlm.arch.layer(0)).input
                fill = torch.cat([values["embed"]] * k).to(hid.device, hid.dtype)
                hid[:] = torch.where(masks["embed"].to(hid.device), fill, hid)
            for layer in sorted(set(masks["z"]) | set(masks["mlp"]) | set(masks["experts"])):
                if layer in masks["z"]:
                    zin = vlm.module(vlm.arch.o_proj(layer)).input
                    fill = torch.cat([values["z"][layer]] * k).to(zin.device, zin.dtype)
                    zin[:] = torch.where(masks["z"][layer].to(zin.device), fill, zin)
                if layer in masks["experts"]:
                    _write_experts(vlm, layer, masks["experts"][layer], values, batch)
                if layer in masks["mlp"]:
                    mo = first_output(vlm.module(vlm.arch.mlp(layer)).output)
                    fill = torch.cat([values["mlp"][layer]] * k).to(mo.device, mo.dtype)
                    where = masks["mlp"][layer]
                    if mo.ndim == 2:  # flattened tokens, rows · seq of them (Llama 4's MoE block)
                        where = where.view(-1, 1).repeat_interleave(mo.shape[0] // where.shape[0], 0)
                    mo[:] = torch.where(where.to(mo.device), fill, mo)
            logits = vlm.nn.output.logits[:, -1].save()
        out.append(logits.float().view(k, n, -1).cpu())
    return torch.cat(out)
