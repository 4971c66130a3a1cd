"""Head paths of an attribution graph: how much of the answer flows through each attention head.

An attribution graph (`countlens.features.graph`) is built on the **local replacement model** of one
prompt: attention patterns and RMSNorm scales frozen at the clean run, MLPs replaced by transcoder
writes plus frozen error terms. That model is *affine* in its sources (features, errors, embeddings),
and so is every head in it: with its pattern frozen, a head's output ``z_h · W_O[:, h]`` is a linear
map of the residual stream it reads. The graph's nodes are features, so its attention paths are
implicit — an edge from an image-token embedding to the answer's logit is the sum of every route
through the frozen heads. This module splits them by head, exactly.

Quantities, for one target logit (the graph's first logit node, else the most probable token) whose
**value** is the demeaned logit ``(W_U[v] − mean_u W_U[u]) · h`` the graph's logit row sums to:

- **path** (the total effect through head h): the value minus the value with h's output removed — its
  slice of z (the input of ``o_proj``) zeroed, its pattern still frozen, everything downstream
  recomputed linearly. Every route that passes through h counts, whatever heads it also passes.
  Routes through two heads count in both, so paths of heads in *different* layers do not add up;
  heads of one layer are parallel, so theirs do: the paths of a layer's heads sum to the effect of
  removing that layer's heads together, and a last-layer head's path is its direct effect.
- **direct** (h as the last head): the value minus the value with h's output removed and every other
  head's z held at its clean value, so only routes whose last head is h change. These add up:
  ``value = no_heads + Σ_h direct_h`` exactly, ``no_heads`` the value with every head removed (the
  routes through no head: residual stream, MLP skip paths, biases).
- **image** (the image tokens' attribution through h): the image-token embeddings' summed attribution
  to the logit — the sum of the graph's edges from the image positions' embedding nodes to the logit
  row, ``image_total`` = value − value with those embeddings zeroed, writes held — minus the same sum
  with h removed. Linear, so it is the image sources' effect that passes through h (every route).
  ``image_direct`` is the same with h as the last head, and ``image_total = image_no_heads +
  Σ_h image_direct_h``.
- **share** = image / image_total: the share of the image's attribution that runs through h. On an
  organism whose count is carried by known heads (``planted-route``: L0H2), the planted heads should
  hold the large shares; `planted_path_recovery` scores the ranking of |share| against them (AUROC,
  precision@|C|, `countlens.circuits.graph.recovery`).

**Features** (``features=``). ``"frozen"`` (the default) holds every feature's write at its clean
value: the routes counted are the graph's edges, those that reach the logit without passing a feature
(an MLP that reads a head's output on the way is an edge into a feature node, held). ``"linear"``
follows the graph's feature-to-feature edges too: each active feature's activation moves with its
pre-activation, ``a_f = a_f,clean + (pre_f − pre_f,clean)`` (the derivative of TopK, ReLU and JumpReLU
at the clean point, the active set held; inactive features stay 0; the error terms stay held). The
model stays affine, so every identity above holds, and ``image_total`` is the image embedding nodes'
total through the graph: ``Σ A_Li + A_LF D⁻¹ (I − A_FF D⁻¹)⁻¹ Σ A_Fi`` over image nodes i (``D`` the
activations; ``graph_image`` computes it from the adjacency when the graph holds every active
feature). This linearisation is countlens's: circuit-tracer ranks nodes by the normalised |A| instead.

**Against** (``against=``, a second vocab id): the value is the target's logit minus that one's,
``(W_U[t] − W_U[a]) · h``; every quantity is then the target's minus the other's. With ``a`` the
neighbouring count, what moves both logits alike (content that is not the count) cancels.

Computation: one frozen forward (``LocalReplacement.run``) per row, rows batched ``batch_size`` at a
time; a forward pre-hook on each layer's ``o_proj`` zeroes (or freezes) each row's heads, and with
linear features one on each MLP fills the writes the replacement model's MLP hook then reads. Heads
beyond a layer's own (mixed-width models) are NaN.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine import Hook, hooked
from countlens.circuits.graph.recovery import auroc, precision_at
from countlens.errors import InputError
from countlens.features.graph import AttributionGraph, LocalReplacement, token_positions
from countlens.features.replacement import check_graphable
from countlens.labels import head_keys
from countlens.model.adapt import module_of
from countlens.validate import require_choice, require_count

if TYPE_CHECKING:
    from countlens.features.transcoder import TranscoderSet
    from countlens.model.vlm import VLM

#: The per-head variables of `head_shares`, in order.
VARIABLES: tuple[str, ...] = ("path", "direct", "image", "image_direct", "share")
#: How `head_shares` treats the feature nodes: held at their clean activations (sources, as the graph's
#: edges hold them) or moving linearly with their pre-activations (the graph's feature-to-feature edges).
FEATURES: tuple[str, ...] = ("frozen", "linear")


@dataclass(frozen=True)
class _Row:
    """One frozen forward: ``image`` says whether the image embeddings are zeroed; ``removed`` lists
    the (layer, head)s whose output is zeroed; ``frozen``: every other head's z is held at the clean
    run's (of the same image setting)."""

    image: bool
    removed: tuple[tuple[int, int], ...] = ()
    frozen: bool = False


def head_shares(
    vlm: VLM,
    transcoders: TranscoderSet,
    sample,
    graph: AttributionGraph | None = None,
    target: int | None = None,
    batch_size: int = 32,
    features: str = "frozen",
    against: int | None = None,
) -> xr.Dataset:
    """Per head, what of the target logit's demeaned value flows through it in the local replacement
    model of ``sample`` (see the module's docstring): an ``xr.Dataset`` over (layer, head) with
    ``path``, ``direct``, ``image``, ``image_direct`` and ``share``; attrs ``target`` (vocab id),
    ``target_string``, ``against`` (vocab id or −1), ``features``, ``value``, ``no_heads``,
    ``image_total``, ``image_no_heads``, ``n_image`` and, with a ``graph`` that allows it,
    ``graph_image`` (the graph's own figure for ``image_total``, equal to it: its image embedding edges
    into the logit row; with ``features="linear"`` their total through its feature-to-feature edges,
    which needs every active feature in the graph). ``graph``: the sample's attribution graph;
    ``target`` defaults to its first logit node (without a graph, the most probable token).
    ``batch_size``: rows per forward. ``features``: "frozen" (feature writes held, as the graph's
    edges are) or "linear" (features move with their pre-activations, the graph's linearisation).
    ``against``: a second vocab id; the value is then the target's logit minus this one's."""
    _check(vlm, transcoders, sample)
    require_count(batch_size, "batch_size")
    require_choice(features, "features", FEATURES)
    prepared = vlm.prepare_samples([sample])
    ids = prepared.inputs["input_ids"][0].cpu()
    if not len(prepared.image_pos[0]):
        raise InputError("head_shares splits the image tokens' attribution: the sample has no image tokens")
    vocab = module_of(vlm.hf, vlm.arch.lm_head).weight.shape[0]
    for name, token in (("target", target), ("against", against)):
        if token is not None and (
            isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= int(token) < vocab
        ):
            raise InputError(f"{name} takes a vocab id 0 … {vocab - 1}, got {token!r}")
    if graph is not None:
        if not isinstance(graph, AttributionGraph):
            raise InputError(f"graph takes an AttributionGraph (attribution_graph(...)), got {type(graph).__name__}")
        same = graph.n_layers == vlm.arch.n_layers and torch.equal(graph.tokens.cpu(), ids)
        if not same or not torch.equal(graph.objects.cpu(), token_positions(prepared, sample, len(ids))[1]):
            raise InputError("graph is not this sample's attribution graph on this model: its tokens or objects differ")
        graph.logit_node()  # refuses a graph without logit nodes
        target = int(graph.logit_tokens[0]) if target is None else int(target)
        graph.logit_node(target)  # refuses a token that is no logit node of the graph
    if against is not None and target is not None and int(against) == int(target):
        raise InputError(f"against={against} is the target itself: give another vocab id (or None for the logit alone)")

    lr = LocalReplacement(vlm, transcoders, sample)
    target = int(lr.logits.argmax()) if target is None else int(target)
    if against is not None and int(against) == target:  # the top logit, found by the recording forward
        raise InputError(f"against={against} is the target (the most probable token): give another vocab id")
    direction = lr.demeaned(torch.tensor([target]))[0]
    if against is not None:
        direction = direction - lr.demeaned(torch.tensor([int(against)]))[0]
    linear = features == "linear"
    image_pos = lr.batch.image_pos[0]
    arch = vlm.arch
    heads = [(layer, h) for layer in range(arch.n_layers) for h in range(arch.heads(layer))]

    with torch.no_grad():
        final, z_clean = _record_z(lr, image_pos, linear)
        rows = [_Row(image=i, removed=r, frozen=f) for i in (False, True) for r, f in _removals(heads)]
        values = _values(lr, rows, image_pos, z_clean, direction, batch_size, linear)
    got = dict(zip(rows, values))
    value, blind = (final @ direction).tolist()
    if graph is not None:
        recorded = float(graph.values[graph.logit_node(target)])
        own = float(final[0] @ lr.demeaned(torch.tensor([target]))[0])
        if abs(recorded - own) > 1e-3 * max(abs(own), 1.0):
            raise InputError(
                f"graph's value of logit {target} is {recorded:.4g}, this sample's {own:.4g}: not this sample's graph"
            )
    image_total = value - blind

    shape = (arch.n_layers, arch.n_heads)
    out = {name: np.full(shape, np.nan) for name in VARIABLES}
    for layer, h in heads:
        one = ((layer, h),)
        out["path"][layer, h] = value - got[_Row(False, one)]
        out["direct"][layer, h] = value - got[_Row(False, one, True)]
        out["image"][layer, h] = image_total - (got[_Row(False, one)] - got[_Row(True, one)])
        out["image_direct"][layer, h] = image_total - (got[_Row(False, one, True)] - got[_Row(True, one, True)])
    scale = image_total if image_total != 0 else np.nan
    out["share"] = out["image"] / scale
    everything = tuple(heads)
    no_heads = got[_Row(False, everything)]
    attrs = {
        "target": target,
        "target_string": vlm.token_strings([target])[0],
        "against": -1 if against is None else int(against),
        "features": features,
        "value": value,
        "no_heads": no_heads,
        "image_total": image_total,
        "image_no_heads": no_heads - got[_Row(True, everything)],
        "n_image": len(image_pos),
    }
    if graph is not None:
        on_image = torch.isin(graph.embeddings, image_pos.cpu())
        sources = torch.zeros(graph.n_nodes, dtype=torch.bool)
        sources[graph.start("embedding") : graph.start("logit")] = on_image
        rows_of = [target] if against is None else [target, int(against)]
        if all(int(t) in graph.logit_tokens.tolist() for t in rows_of) and (not linear or _complete(graph, lr)):
            totals = [_graph_total(graph, sources, graph.logit_node(t), linear) for t in rows_of]
            attrs["graph_image"] = totals[0] - (totals[1] if against is not None else 0.0)
    coords = {"layer": np.arange(arch.n_layers), "head": np.arange(arch.n_heads)}
    return xr.Dataset({k: (("layer", "head"), v) for k, v in out.items()}, coords=coords, attrs=attrs)


def planted_path_recovery(shares: xr.Dataset | xr.DataArray, circuit_heads: Collection[tuple[int, int]]) -> dict:
    """AUROC and precision@|C| of |share| (a `head_shares` Dataset — its ``share`` — or any (layer,
    head) DataArray, e.g. a mean over scenes) against the planted heads ``circuit_heads`` (a set of
    (layer, head), `countlens.toy.catalogue.planted_circuit_of(name).heads`, or labels such as "L0H2")."""
    if isinstance(shares, xr.Dataset):
        if "share" not in shares:
            raise InputError(f"a Dataset of shares has a 'share' variable (head_shares); got {list(shares)}")
        shares = shares["share"]
    if not isinstance(shares, xr.DataArray):
        raise InputError(f"shares takes head_shares(...) or a (layer, head) DataArray, got {type(shares).__name__}")
    circuit = set(head_keys(circuit_heads, "circuit_heads"))  # pairs or labels; never empty
    return {"auroc": auroc(shares, circuit), "precision": precision_at(shares, circuit), "k": len(circuit)}


# ----------------------------------------------------------------------------- internals


def _check(vlm, transcoders, sample) -> None:
    """attribution_graph's refusals, before any forward."""
    check_graphable(vlm, transcoders, sample, "head_shares")


def _removals(heads: list[tuple[int, int]]) -> Iterator[tuple[tuple[tuple[int, int], ...], bool]]:
    """(removed heads, frozen) of every row a base needs: each head alone, totally and directly, and
    every head at once."""
    for cell in heads:
        yield (cell,), False
        yield (cell,), True
    yield tuple(heads), False


def _record_z(
    lr: LocalReplacement, image_pos: torch.Tensor, linear: bool
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The clean and the image-blind rows (image embeddings zeroed): their final norm outputs at the last
    position, (2, d_model) float32, and their z at every layer's o_proj, (2, seq, width)."""
    arch = lr.vlm.arch
    z: dict[int, torch.Tensor] = {}
    keep = [
        Hook(arch.o_proj(la), "input", lambda t, la=la: z.update({la: t.detach().clone()}))
        for la in range(arch.n_layers)
    ]
    with hooked(lr.vlm.hf, keep), _linear_features(lr, 2, linear) as writes:
        got = lr.run(_embeds(lr, [False, True], image_pos), writes)
    return got["final"][:, -1].float(), z


def _embeds(lr: LocalReplacement, blind: list[bool], image_pos: torch.Tensor) -> torch.Tensor:
    embed = lr.embed.expand(len(blind), -1, -1).clone()
    for r, b in enumerate(blind):
        if b:
            embed[r, image_pos] = 0
    return embed


@contextmanager
def _linear_features(lr: LocalReplacement, n: int, linear: bool) -> Iterator[dict[int, torch.Tensor] | None]:
    """With ``linear``, the writes to give ``lr.run`` for ``n`` rows: per layer a buffer that a forward
    pre-hook on the MLP fills from the MLP's input before the replacement model's own MLP hook reads
    it — the clean writes plus ``(pre(x) − pre_clean) · [a_clean ≠ 0] @ W_dec``, each active feature
    moving with its pre-activation (the derivative of TopK, ReLU and JumpReLU there; the active set
    held), the error term held. Without ``linear``: None (the clean writes, features held)."""
    if not linear:
        yield None
        return
    arch = lr.vlm.arch
    writes = {layer: w.expand(n, -1, -1).clone() for layer, w in lr.writes.items()}

    def fill(layer: int):
        tc = lr.transcoders.layer(layer)
        active = (lr.act[layer] != 0).to(tc.dtype)

        def hook(x):
            moved = (tc.pre_activations(x.to(tc.dtype)) - lr.pre[layer]) * active
            writes[layer].copy_(lr.writes[layer] + moved @ tc.W_dec)

        return hook

    with hooked(lr.vlm.hf, [Hook(arch.mlp(layer), "input", fill(layer)) for layer in writes]):
        yield writes


@contextmanager
def _head_hooks(lr: LocalReplacement, rows: list[_Row], z_clean: dict[int, torch.Tensor] | None) -> Iterator[None]:
    """Forward pre-hooks on every o_proj: per row, zero its removed heads' slices of z and, for a
    frozen row, hold every other head's z at the clean run's (of the row's image setting)."""
    arch = lr.vlm.arch
    n = len(rows)
    hooks = []
    for layer in range(arch.n_layers):
        n_heads, d_head = arch.heads(layer), arch.head_dim(layer)
        keep = torch.ones(n, n_heads)
        for r, row in enumerate(rows):
            for cell_layer, h in row.removed:
                if cell_layer == layer:
                    keep[r, h] = 0
        frozen = torch.tensor([row.frozen for row in rows])
        source = torch.tensor([int(row.image) for row in rows])

        def hook(z, keep=keep, frozen=frozen, source=source, layer=layer, n_heads=n_heads, d=d_head):
            zv = z.view(*z.shape[:-1], n_heads, d)
            if frozen.any():
                clean = z_clean[layer][source].view_as(zv)
                zv = torch.where(frozen.view(-1, 1, 1, 1).to(z.device), clean.to(zv.dtype), zv)
            zv = zv * keep.to(z.device, z.dtype).view(n, 1, n_heads, 1)
            return zv.reshape(z.shape)

        hooks.append(Hook(arch.o_proj(layer), "input", hook))
    with hooked(lr.vlm.hf, hooks):
        yield


def _values(
    lr: LocalReplacement,
    rows: list[_Row],
    image_pos: torch.Tensor,
    z_clean: dict[int, torch.Tensor] | None,
    direction: torch.Tensor,
    batch_size: int,
    linear: bool,
) -> list[float]:
    """The value (the final norm's output at the last position, read along ``direction``) in the
    frozen model, one per row."""
    out: list[float] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        with _head_hooks(lr, chunk, z_clean), _linear_features(lr, len(chunk), linear) as writes:
            got = lr.run(_embeds(lr, [row.image for row in chunk], image_pos), writes)
        out += (got["final"][:, -1].float() @ direction).tolist()
    return out


def _complete(graph: AttributionGraph, lr: LocalReplacement) -> bool:
    """Whether ``graph`` holds every feature active in ``lr`` (no ``max_features`` cut)."""
    return graph.n_features == sum(int((a != 0).sum()) for a in lr.act.values())


def _graph_total(graph: AttributionGraph, sources: torch.Tensor, node: int, linear: bool) -> float:
    """The total attribution to ``node`` of the non-feature nodes ``sources`` marks (a bool mask): the sum
    of their edges into it and, with ``linear``, their routes through the feature nodes, each feature's
    activation moving with its pre-activation: ``δa = (I − A_FF D⁻¹)⁻¹ A_FS 1`` (``D`` the activations;
    ``A_FF`` is strictly lower triangular in node order, layer-major), plus ``A_nF D⁻¹ δa``."""
    a = graph.adjacency.double()
    total = float(a[node, sources].sum())
    if not linear:
        return total
    f = graph.n_features
    acts = graph.activations.double()
    system = torch.eye(f, dtype=torch.float64) - a[:f, :f] / acts[None, :]
    moved = torch.linalg.solve_triangular(system, a[:f, sources].sum(1, keepdim=True), upper=False)[:, 0]
    return total + float((a[node, :f] / acts) @ moved)
