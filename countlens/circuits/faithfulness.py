"""Faithfulness: do the components a method names, together, carry the behaviour?

Patching one component at a time (`patch_heads`, `attribution_patch`) ranks components; a circuit
claim needs more: that the top of the ranking, kept while everything else is ablated, still does
the task, and that little outside it matters. This module measures that, following the circuit
localisation track of the MIB benchmark (Mueller et al. 2025).

**Nodes.** A node is one component's output over every position: a head's z (its slice of the
attention output projection's input, `Arch.o_proj`), a layer's MLP output (on a mixture-of-experts
layer, the whole MoE block's), or an input: the image tokens' embeddings and the other tokens'
embeddings (the input of layer 0 at those positions; on a cross-attention model the image node is the
image states every cross-attention layer reads, `CrossAttentionSpec.states`). ``nodes`` chooses which
kinds form the node set N; a ranking scores some of them (`node_scores`).

**The circuit at size s.** Rank the nodes of N by |score| (ties in node order), keep the top
⌊s·|N|⌋ (MIB's rounding) as the circuit C and ablate every other node of N, in one forward of the
clean input: an ablated node's output is overwritten by the corrupt input's output of the same node
(``ablation="patch"``, counterfactual patching: the corrupt run's activations, recorded once), or by
its mean over the clean and corrupt inputs of the pairs in the same chunk, per position
(``ablation="mean"``, countlens's choice of reference set). Nodes of C are recomputed in that forward
from what reaches them. Components outside N (e.g. the MLPs when N is the heads) are never ablated.

**The metric.** m = Σ over pairs of the logit difference LD = logit(clean answer) − logit(corrupt
answer) at the read position (`patching`: the first token where the two answers differ).
f(C) = (m(C) − m(∅)) / (m(N) − m(∅)): m(N) is the clean run, m(∅) the forward with every node of N
ablated. So f = 1 with every node kept and f = 0 with none, by construction; with N every node kind
and counterfactual patching, m(∅) is the corrupt run itself (every component's output is the corrupt
one), except where the image also enters inside the decoder (Qwen3-VL's DeepStack, Gemma 4's
per-layer inputs), which no node here covers.

**Areas.** Over the sizes (default MIB's 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100 % of N), with x the
fraction of N kept (⌊s·|N|⌋ / |N|) on a linear axis, trapezoids: CPR = ∫ f dx (higher is better),
CMD = ∫ |1 − f| dx (lower is better). MIB's code offers a log axis over counts too; countlens uses the
linear fraction because on small models the smallest sizes keep 0 nodes (log 0 is undefined), and a
fraction keeps models of different sizes on one scale. These are countlens's own measurements: no
paper's CPR or CMD is comparable without the same models, tasks and node set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens import memory
from countlens.circuits.pair_batch import logit_diff, prepare_pairs
from countlens.circuits.sites import group_mask, repeat_inputs
from countlens.circuits.sweep import check_pair_sweep
from countlens.errors import InputError
from countlens.labels import head_label
from countlens.results import provenance
from countlens.validate import require_choice

if TYPE_CHECKING:
    from jaxtyping import Bool, Float

    from countlens.vlm import VLM, Batch

#: MIB's circuit sizes: fractions of the node set kept.
SIZES: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
ABLATIONS: tuple[str, ...] = ("patch", "mean")
NODE_KINDS: tuple[str, ...] = ("head", "mlp", "input")
INPUTS: tuple[str, ...] = ("image", "text")


@dataclass(frozen=True, order=True)
class Node:
    """One component's output over every position: ``kind`` "head" (layer, head), "mlp" (layer) or
    "input" (``index`` "image" or "text"; layer −1)."""

    kind: str
    layer: int
    index: int | str = 0

    @property
    def label(self) -> str:
        if self.kind == "head":
            return head_label((self.layer, int(self.index)))
        if self.kind == "mlp":
            return f"MLP{self.layer}"
        return f"IN.{self.index}"


def graph_nodes(vlm: VLM, kinds: Sequence[str] = NODE_KINDS) -> list[Node]:
    """The model's nodes of ``kinds``, in forward order: inputs, then per layer its heads and its MLP."""
    for kind in kinds:
        require_choice(kind, "a node kind", NODE_KINDS, InputError)
    arch = vlm.arch
    out = [Node("input", -1, g) for g in INPUTS] if "input" in kinds else []
    for layer in range(arch.n_layers):
        if "head" in kinds:
            out += [Node("head", layer, h) for h in range(arch.heads(layer))]
        if "mlp" in kinds:
            out.append(Node("mlp", layer))
    return out


def node_scores(vlm: VLM, scores, kinds: Sequence[str] | None = None) -> dict[Node, float]:
    """A ranking's score per node. ``scores``: a DataArray over (layer, head) (a head ranking:
    `patch_heads`' or `attribution_patch`'s ``effect``, an ablation drop), or a mapping from node label
    (``L3H1``, ``MLP3``, ``IN.image``) to score. ``kinds``: the node set; by default the kinds the
    ranking scores. A node of the set the ranking does not score is refused by name."""
    if isinstance(scores, xr.DataArray):
        if set(scores.dims) != {"layer", "head"}:
            raise InputError(
                f"scores over {scores.dims}: give a DataArray over (layer, head), or {{node label: score}}"
            )
        # NaN: no head there (beyond a layer's own heads, e.g. Qwen3.5's linear layers have more).
        values = {
            head_label((int(la), int(h))): float(scores.sel(layer=la, head=h))
            for la in scores["layer"].values
            for h in scores["head"].values
            if not math.isnan(float(scores.sel(layer=la, head=h)))
        }
    elif isinstance(scores, Mapping):
        values = {str(k): float(v) for k, v in scores.items()}
    else:
        raise InputError(f"scores of type {type(scores).__name__}: give a DataArray over (layer, head) or a mapping")
    every = {n.label: n for n in graph_nodes(vlm)}
    unknown = sorted(set(values) - set(every))
    if unknown:
        raise InputError(
            f"scores name {unknown[:5]}, which are no nodes of {vlm.name}; node labels look like L0H1, MLP0, IN.image"
        )
    if kinds is None:
        kinds = tuple(k for k in NODE_KINDS if any(every[label].kind == k for label in values))
    chosen = graph_nodes(vlm, kinds)
    missing = [n.label for n in chosen if n.label not in values or math.isnan(values[n.label])]
    if missing:
        raise InputError(
            f"the ranking scores no {missing[:5]}{' …' if len(missing) > 5 else ''} of the node set {list(kinds)}; "
            "score every node of the set, or choose the kinds it scores"
        )
    return {n: values[n.label] for n in chosen}


def circuit_sizes(n_nodes: int, sizes: Sequence[float] = SIZES) -> list[int]:
    """Nodes kept at each size: ⌊s·|N|⌋, as MIB rounds (small sizes of a small model keep none)."""
    for s in sizes:
        if not (isinstance(s, (int, float)) and 0 <= s <= 1):
            raise InputError(f"size {s!r}: give fractions of the node set in [0, 1]")
    return [int(s * n_nodes + 1e-9) for s in sizes]


def areas(kept: Sequence[float], f: Sequence[float]) -> tuple[float, float]:
    """(CPR, CMD): trapezoid areas of f and of |1 − f| over the fraction kept (see the module docstring)."""
    x, y = np.asarray(kept, dtype=float), np.asarray(f, dtype=float)
    dx = np.diff(x)
    cpr = float((dx * (y[:-1] + y[1:]) / 2).sum())
    cmd = float((dx * (np.abs(1 - y[:-1]) + np.abs(1 - y[1:])) / 2).sum())
    return cpr, cmd


def smallest_faithful(ds: xr.Dataset, level: float = 0.8) -> xr.DataArray:
    """Per ranking, the smallest fraction of the node set whose circuit reaches ``level`` faithfulness
    (NaN where none does)."""
    reached = ds.faithfulness >= level
    kept = ds.kept_fraction.broadcast_like(ds.faithfulness).where(reached)
    return kept.min("size", skipna=True)


def mlp_path(vlm: VLM, layer: int) -> str:
    """A decoder layer's MLP module (``mlp``, or Llama 4's ``feed_forward``)."""
    path = vlm.arch.layer(layer)
    for name in ("mlp", "feed_forward"):
        try:
            vlm.hf.get_submodule(f"{path}.{name}")
        except AttributeError:
            continue
        return f"{path}.{name}"
    raise InputError(f"layer {layer} of {vlm.arch.name} has no mlp or feed_forward module: its MLP cannot be a node")


def image_positions(vlm: VLM, batch: Batch) -> Bool[Tensor, "batch seq"]:
    """Where the image tokens sit (none on a cross-attention model: its image is its states)."""
    if image_states_path(vlm) is not None:
        return torch.zeros_like(batch.inputs["attention_mask"], dtype=torch.bool)
    return group_mask(batch, "image")


def first_output(output):
    """A module's output tensor: Llama 4's MoE block returns (output, router logits)."""
    return output[0] if isinstance(output, tuple) else output


def image_states_path(vlm: VLM) -> str | None:
    cross = vlm.arch.spec.cross_attention
    return None if cross is None else cross.states


@torch.no_grad()
def record_nodes(vlm: VLM, batch: Batch, nodes: Sequence[Node]) -> dict:
    """The outputs of ``nodes``' sites in one forward of ``batch``: ``z[layer]``, ``mlp[layer]``,
    ``embed`` (layer 0's input) and ``states`` (a cross-attention model's image states)."""
    layers = sorted({n.layer for n in nodes if n.kind in ("head", "mlp")})
    inputs = any(n.kind == "input" for n in nodes)
    states_path = image_states_path(vlm)
    got: dict = {"z": {}, "mlp": {}}
    with vlm.read(batch):
        if inputs and states_path is not None:
            got["states"] = vlm.module(states_path).output.save()
        if inputs:
            got["embed"] = vlm.module(vlm.arch.layer(0)).input.save()
        for layer in layers:
            if any(n.kind == "head" and n.layer == layer for n in nodes):
                got["z"][layer] = vlm.module(vlm.arch.o_proj(layer)).input.save()
            if any(n.kind == "mlp" and n.layer == layer for n in nodes):
                got["mlp"][layer] = first_output(vlm.module(mlp_path(vlm, layer)).output).save()
    return got


def _mean(a: dict, b: dict) -> dict:
    """Per position, the mean of two recordings over both of their rows, broadcast to one's rows."""

    def avg(x: Tensor, y: Tensor) -> Tensor:
        both = torch.cat([x, y]).float()
        return both.mean(0, keepdim=True).expand_as(x).to(x.dtype)

    out = {
        "z": {k: avg(v, b["z"][k]) for k, v in a["z"].items()},
        "mlp": {k: avg(v, b["mlp"][k]) for k, v in a["mlp"].items()},
    }
    for key in ("embed", "states"):
        if key in a:
            out[key] = avg(a[key], b[key])
    return out


def _replica_masks(vlm: VLM, sets: Sequence[frozenset], n: int, image: Tensor) -> dict:
    """Per stacked replica (``n`` rows each), where its ablated nodes sit: ``z[layer]`` Bool (k·n, 1,
    width of the layer's z), ``mlp[layer]`` (k·n, 1, 1), ``embed`` (k·n, seq, 1) and ``states`` (k) for
    the image states; a site no replica ablates is left out."""
    arch = vlm.arch
    cross = image_states_path(vlm) is not None
    k = len(sets)
    z: dict[int, Tensor] = {}
    mlp: dict[int, Tensor] = {}
    embed = torch.zeros(k, *image.shape, dtype=torch.bool)
    states = torch.zeros(k, dtype=torch.bool)
    for r, ablate in enumerate(sets):
        for node in ablate:
            if node.kind == "head":
                d = arch.head_dim(node.layer)
                if node.layer not in z:
                    z[node.layer] = torch.zeros(k, arch.heads(node.layer) * d, dtype=torch.bool)
                z[node.layer][r, int(node.index) * d : (int(node.index) + 1) * d] = True
            elif node.kind == "mlp":
                mlp.setdefault(node.layer, torch.zeros(k, dtype=torch.bool))[r] = True
            elif node.index == "image" and cross:
                states[r] = True
            elif node.index == "image":
                embed[r] |= image
            else:
                embed[r] |= torch.ones_like(image) if cross else ~image
    return {
        "z": {la: m.repeat_interleave(n, 0)[:, None, :] for la, m in z.items()},
        "mlp": {la: m.repeat_interleave(n, 0)[:, None, None] for la, m in mlp.items()},
        "embed": embed.reshape(k * n, -1)[..., None] if embed.any() else None,
        "states": states if states.any() else None,
    }


@torch.no_grad()
def ablated_logits(
    vlm: VLM, batch: Batch, sets: Sequence[frozenset], values: dict, image: Tensor, max_rows: int | None = None
) -> Float[Tensor, "circuits batch vocab"]:
    """Last-position logits of ``batch`` once per set of ``sets``, that set's nodes overwritten by
    ``values``. The sets run stacked, as many copies of the batch a forward as memory holds
    (`countlens.memory.rows_per_forward`); each site is one ``where`` over the copies."""
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
    out = []
    for i in range(0, len(sets), per_pass):
        chunk = sets[i : i + per_pass]
        k = len(chunk)
        masks = _replica_masks(vlm, chunk, n, image)
        with vlm.trace(repeat_inputs(batch.inputs, k), use_cache=False, logits_to_keep=1):
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
            for layer in sorted(set(masks["z"]) | set(masks["mlp"])):
                if layer in masks["z"]:
                    zin = vlm.module(vlm.arch.o_proj(layer)).input
                    fill = torch.cat([values["z"][layer]] * k).to(zin.device, zin.dtype)
                    zin[:] = torch.where(masks["z"][layer].to(zin.device), fill, zin)
                if layer in masks["mlp"]:
                    mo = first_output(vlm.module(mlp_path(vlm, layer)).output)
                    fill = torch.cat([values["mlp"][layer]] * k).to(mo.device, mo.dtype)
                    where = masks["mlp"][layer]
                    if mo.ndim == 2:  # flattened tokens, rows · seq of them (Llama 4's MoE block)
                        where = where.view(-1, 1).repeat_interleave(mo.shape[0] // where.shape[0], 0)
                    mo[:] = torch.where(where.to(mo.device), fill, mo)
            logits = vlm.nn.output.logits[:, -1].save()
        out.append(logits.float().view(k, n, -1).cpu())
    return torch.cat(out)


def faithfulness(
    vlm: VLM,
    pairs: Sequence,
    scores,
    sizes: Sequence[float] = SIZES,
    ablation: str = "patch",
    nodes: Sequence[str] | None = None,
    batch_size: int = 16,
) -> xr.Dataset:
    """The faithfulness curve of one ranking (see the module docstring for the definition):
    ``faithfulness`` and ``metric`` over ``size``, with ``kept`` / ``kept_fraction`` and per-pair
    ``logit_diff``; ``cpr`` and ``cmd`` in its attrs. One ranking of `faithfulness_curves`."""
    ds = faithfulness_curves(vlm, pairs, {"scores": scores}, sizes, ablation, nodes, batch_size, random_draws=0)
    out = ds.sel(ranking="scores", drop=True)
    out.attrs.update(cpr=float(out.cpr), cmd=float(out.cmd))
    return out.drop_vars(["cpr", "cmd"])


def faithfulness_curves(
    vlm: VLM,
    pairs: Sequence,
    rankings: Mapping[str, object],
    sizes: Sequence[float] = SIZES,
    ablation: str = "patch",
    nodes: Sequence[str] | None = None,
    batch_size: int = 16,
    random_draws: int = 5,
    seed: int = 0,
) -> xr.Dataset:
    """Faithfulness curves of several rankings over one node set, from one corrupt recording per chunk
    of pairs: ``faithfulness``, ``metric`` (ranking × size), ``cpr`` / ``cmd`` per ranking. With
    ``random_draws`` > 0, that many random rankings (a permutation each, seeded by ``seed``) as
    rankings ``random0`` …, and ``random`` = their mean curve (its CPR / CMD the draws' mean; their
    standard deviation in ``cpr_std`` / ``cmd_std``; per-pair logit differences are then left out)."""
    check_pair_sweep(pairs, batch_size, "faithfulness")
    require_choice(ablation, "ablation", ABLATIONS, InputError)
    if not rankings and random_draws <= 0:
        raise InputError("no ranking to evaluate: give rankings={name: scores} or random_draws > 0")
    scored = {name: node_scores(vlm, s, nodes) for name, s in rankings.items()}
    node_set = next(iter(scored.values())) if scored else {n: 0.0 for n in graph_nodes(vlm, nodes or ("head",))}
    order = list(node_set)
    for name, s in scored.items():
        if list(s) != order:
            raise InputError(
                f"ranking {name!r} scores another node set than the others; give every ranking the same kinds"
            )
    n = len(order)
    kept = circuit_sizes(n, sizes)
    orders: dict[str, list[Node]] = {
        name: sorted(order, key=lambda node, s=s: (-abs(s[node]), order.index(node))) for name, s in scored.items()
    }
    rng = np.random.default_rng(seed)
    for d in range(random_draws):
        orders[f"random{d}"] = [order[i] for i in rng.permutation(n)]
    circuits = {(name, k): frozenset(o[:k]) for name, o in orders.items() for k in kept}
    distinct = sorted(set(circuits.values()), key=lambda c: (len(c), sorted(c)))
    lds = {c: [] for c in distinct}
    full_ld, empty_ld = [], []
    for start in range(0, len(pairs), batch_size):
        pb = prepare_pairs(vlm, pairs[start : start + batch_size])
        values = record_nodes(vlm, pb.corrupt, order)
        if ablation == "mean":
            values = _mean(record_nodes(vlm, pb.clean, order), values)
        image = image_positions(vlm, pb.clean)
        # The full and empty circuits, then every other distinct circuit, in stacked forwards (the sets
        # of nodes each ablates); a circuit of every node or of none is the full or empty run itself.
        middle = [c for c in distinct if 0 < len(c) < n]
        sets = [frozenset(), frozenset(order), *(frozenset(order) - c for c in middle)]
        logits = ablated_logits(vlm, pb.clean, sets, values, image)
        ld = [logit_diff(rows, pb.clean_id, pb.corrupt_id).cpu() for rows in logits]
        full_ld.append(ld[0])
        empty_ld.append(ld[1])
        for c in distinct:
            lds[c].append(ld[0] if len(c) == n else ld[1] if not c else ld[2 + middle.index(c)])
    m_full, m_empty = float(torch.cat(full_ld).sum()), float(torch.cat(empty_ld).sum())
    if m_full == m_empty:
        raise InputError(
            "ablating every node changes no logit difference (m(N) = m(∅)): the node set carries nothing of "
            "these pairs; give pairs whose answers differ, or a larger node set"
        )
    methods = list(orders)
    per_pair = np.stack([[torch.cat(lds[circuits[(m, k)]]).numpy() for k in kept] for m in methods])
    metric = per_pair.sum(-1)
    faith = (metric - m_empty) / (m_full - m_empty)
    fraction = np.asarray(kept, dtype=float) / n
    cpr, cmd = zip(*(areas(fraction, f) for f in faith))
    ds = xr.Dataset(
        {
            "faithfulness": (("ranking", "size"), faith),
            "metric": (("ranking", "size"), metric),
            "logit_diff": (("ranking", "size", "pair"), per_pair),
            "cpr": ("ranking", np.asarray(cpr)),
            "cmd": ("ranking", np.asarray(cmd)),
            "kept": ("size", np.asarray(kept)),
            "kept_fraction": ("size", fraction),
        },
        coords={"ranking": methods, "size": np.asarray(sizes, dtype=float), "pair": np.arange(len(pairs))},
    )
    if random_draws > 0:
        draws = ds.sel(ranking=[f"random{d}" for d in range(random_draws)])
        mean = draws[["faithfulness", "metric", "cpr", "cmd"]].mean("ranking").expand_dims(ranking=["random"])
        ds = xr.concat([ds.drop_vars("logit_diff"), mean], dim="ranking", data_vars="minimal")
        ds["cpr_std"] = xr.full_like(ds.cpr, np.nan).where(ds.ranking != "random", float(draws.cpr.std()))
        ds["cmd_std"] = xr.full_like(ds.cmd, np.nan).where(ds.ranking != "random", float(draws.cmd.std()))
    ds.attrs.update(
        provenance(vlm.name, vlm.arch.name, dataset={"pairs": len(pairs)}),
        method="faithfulness",
        ablation=ablation,
        nodes=",".join(dict.fromkeys(node.kind for node in order)),
        n_nodes=n,
        metric_full=m_full,
        metric_empty=m_empty,
        x_axis="fraction of the node set kept, linear",
    )
    return ds
