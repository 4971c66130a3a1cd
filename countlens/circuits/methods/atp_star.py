"""AtP*: attribution patching with the QK fix and GradDrop (Kramár, Lieberum, Shah & Nanda 2024).

Attribution patching (AtP, `countlens.circuits.methods.patching.attribution_patch`) estimates the effect of
patching a node n from the corrupt run into the clean one as Î(n) = (n_corrupt − n_clean)·∂LD/∂n, the
gradient taken at the clean run, LD the metric (`countlens.circuits.metrics`; default the logit difference;
one whose gradient vanishes at the clean run, such as ``kl``, is refused: every estimate would be 0).
AtP* (arXiv 2403.00745) fixes its two false-negative modes:

**The QK fix.** A query or key node reaches the metric through its head's attention softmax. When
that softmax saturates, its gradient is ≈ 0 and AtP calls the node unimportant even where the patch
moves the attention from one token to another. The fix recomputes the attention pattern A exactly
with the node patched and linearises only downstream of the pattern:
Î_fix(n) = Σ ∂LD/∂A · (A_patched − A_clean). With z = A·V per head (z: the head's output before
o_proj), ∂LD/∂A[s, t] = ∂LD/∂z[s] · v[t], so Î_fix(n) = Σ_s ∂LD/∂z[s] · Δz[s], Δz = (A_patched −
A_clean)·V. A key is patched one position at a time, as the paper's key nodes are (its Algorithm 4,
the fast K fix): replacing key t alone rescales row s of A, and Δz[s] = c_st · (v[t] − z[s]) with
c_st = (p_st − a_st) / (1 − a_st + p_st), a_st the clean weight and p_st = exp(q_s·k'_t·scale) / Z_s
the patched key's weight over the clean normaliser. countlens computes every row's patched row in
float64 from the query, key and value states the attention function receives (after any q/k norm and
after rotary embedding; with grouped-query attention head h reads kv head h // (heads / kv heads)),
and the weight of each row's largest clean key separately, so a saturated row (a_st → 1) loses no
precision. A value node is linear in the pattern: its estimate is AtP's, Δz = A_clean·(V' − V).

countlens scores **heads**: a head's z over ``positions`` (the site `patch_heads` patches). Patching
z with the corrupt run's z is running the head with corrupt q, k and v, and AtP on z already puts
the exactly recomputed corrupt z in: only what lies downstream of z is linearised. So for the
head's ``effect`` the QK fix changes nothing (the paper applies it to query and key nodes only; every
other node keeps AtP's estimate). The fix is what the per-head ``q_effect`` and ``k_effect`` are: the
head's queries at ``positions`` patched together (rows are independent), and its keys each patched
alone at every position and summed over them (the paper's key nodes summed into the head), with
``v_effect`` the head's values (AtP). Summing the three does not give the head's effect: it misses
their interaction, and on the organism ranked the heads worse than AtP (Spearman 0.43 against 0.85
with exact head patching, bench/attribution.py's pairs), so countlens does not rank heads by it.

**GradDrop.** A node's direct effect and its indirect effect through a later layer can cancel in
the gradient, so AtP sees ≈ 0. For each layer ℓ the gradient is taken again with layer ℓ's
contribution to the residual stream cut from the backward pass: the forward is unchanged, but the
gradient at layer ℓ's output goes straight to its input (the skip connection) and none flows through
its attention and MLP (countlens's layer is a decoder layer, attention and MLP cut together). With
Î_ℓ(n) the estimate under that gradient, AtP* scores
c(n) = E[(1/(L−1)) Σ_ℓ |Î_ℓ(n)|] (the paper's eq. for AtP+GradDrop): magnitudes, so that the L
estimates cannot cancel each other; a node's own layer ℓ gives 0 (nothing flows to n), hence L − 1.
countlens takes |·| per pair, after summing the node's positions, and divides the sum over pairs by
|Σ LD_corrupt − Σ LD_clean| (the metric's): every AtP* score is a magnitude ≥ 0 on the exact sweeps' scale (a head
whose exact effect is negative scores by its size). Cost: one forward of the corrupt run and one of
the clean run, then L + 1 backward passes through the clean run's retained graph (AtP: one), plus the
attention recomputation, O(seq² · d_head) per head and layer. ``graddrop=False`` gives the QK fix
alone, signed and summed over pairs like AtP's estimates (its ``effect`` is AtP's).

Supported: the families in `SUPPORTED`, whose attention is softmax(q·kᵀ·scale + mask)·v as
transformers' attention functions receive it; on every run countlens checks that its recomputation
reproduces each layer's z and refuses the model otherwise. Elsewhere use ``method="atp"``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens.circuits.engine import Hook, hooked, module_of
from countlens.circuits.engine.gradients import activation_gradients_only
from countlens.circuits.engine.metrics import metric_for, normalised
from countlens.circuits.engine.pair_batch import pairs_provenance, prepare_pairs
from countlens.circuits.engine.sweep import check_pair_sweep
from countlens.circuits.sites import HeadZ, K, Q, V, check_group, group_mask, heads_view
from countlens.errors import InputError
from countlens.model.adapt import attention_function

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch

#: Families whose attention AtP*'s recomputation reproduces (checked on every run; tested on the organism
#: and a tiny Qwen2.5-VL in tests/unit/test_atp_star.py).
SUPPORTED: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl")
#: The name under which countlens's recording attention function is registered with transformers.
_RECORDER = "countlens_atp_star"
#: Per-head node kinds of the QK fix: the head's queries, its keys (each position alone), its values.
#: The parts the QK fix estimates per head, as sites: its queries, keys and values.
PARTS: tuple[type, ...] = (Q, K, V)
#: Layer kinds whose attention the QK fix recomputes (softmax self-attention; `countlens.model.arch.LayerKind`).
SELF_ATTENTION: tuple[str, ...] = ("full", "sliding", "chunked")


def atp_star(
    vlm: VLM, pairs: Sequence, positions: str = "all", batch_size: int = 16, graddrop: bool = True, metric=None
) -> xr.Dataset:
    """AtP* (see the module docstring): ``effect`` over (layer, head) for each head's z, and
    ``q_effect``, ``k_effect``, ``v_effect`` for its query, key and value nodes, all magnitudes
    normalised by |Σ M_corrupt − Σ M_clean| (``graddrop=False``: signed, like AtP's), M the ``metric``
    (`countlens.circuits.metrics`; default the logit difference; one stationary at the clean run, such
    as ``kl``, is refused)."""
    check_pair_sweep(pairs, batch_size, "attribution_patch")
    check_group(positions)
    require_supported(vlm)
    metric = metric_for(vlm, pairs, metric, "AtP* (attribution_patch, method='atp*')", moving=True)
    arch = vlm.arch
    if graddrop and arch.n_layers < 2:
        raise InputError(f"GradDrop averages over the other L − 1 layers, and {vlm.name} has one; use graddrop=False")
    n_layers, n_heads = arch.n_layers, arch.n_heads
    drops = list(range(n_layers)) if graddrop else []
    # Per dropped layer (None: no layer dropped), per node kind: the sum over pairs (signed, or |·|).
    kinds = (HeadZ, *PARTS)
    sums = {k: torch.zeros(1 + len(drops), n_layers, n_heads, dtype=torch.float64) for k in kinds}
    clean_sum = corrupt_sum = 0.0
    differences = []  # per pair: M_corrupt − M_clean, for the normaliser's noise rule
    with activation_gradients_only(vlm.hf):
        for start in range(0, len(pairs), batch_size):
            pb = prepare_pairs(vlm, pairs[start : start + batch_size])
            with torch.no_grad():
                corrupt = _run(vlm, pb.corrupt, grad=False)
            clean = _run(vlm, pb.clean, grad=True)
            at = metric.at_clean(pb, clean["logits"])
            ld = metric(clean["logits"], at)
            corrupt_ld = metric(corrupt["logits"], at)
            clean_sum += float(ld.detach().sum())
            corrupt_sum += float(corrupt_ld.sum())
            differences.append((corrupt_ld.double() - ld.detach().double()).cpu().numpy())
            shifts = _shifts(clean, corrupt)  # per layer: the QK fix's Δz of q, k and v (float32 or wider)
            mask = group_mask(pb.clean, positions).to(torch.float64)
            # One gradient set at a time: L + 1 sets of every layer's z gradient would not fit a large model.
            for i, grads in enumerate(_gradients(clean, ld.sum(), drops)):
                for layer, by_kind in shifts.items():
                    h = arch.heads(layer)
                    g = heads_view(grads[layer].double(), h) * mask[..., None, None].to(grads[layer].device)
                    dz_head = corrupt["z"][layer].double() - clean["z"][layer].detach().double()
                    for kind, dz in {HeadZ: dz_head, **by_kind}.items():
                        per_pair = (g * heads_view(dz.double(), h).to(g.device)).sum((1, 3)).cpu()  # pair head
                        sums[kind][i, layer, :h] += per_pair.abs().sum(0) if graddrop else per_pair.sum(0)
            del clean, corrupt, shifts
    denom, noted = normalised(clean_sum, corrupt_sum, differences, metric)
    softmax = [layer for layer in range(n_layers) if arch.kind(layer) in SELF_ATTENTION]
    out = {}
    for kind, s in sums.items():
        if graddrop:  # (1/(L−1)) Σ_ℓ over the dropped layers; |·| was taken per pair
            est = s[1:].sum(0) / (n_layers - 1) / abs(denom)
        else:
            est = s[0] / denom
        for layer in range(n_layers):  # beyond a layer's own heads, and the QK fix off softmax layers: no node
            est[layer, arch.heads(layer) :] = float("nan")
            if kind is not HeadZ and layer not in softmax:
                est[layer] = float("nan")
        out["effect" if kind is HeadZ else f"{kind.part_name}_effect"] = (("layer", "head"), est.numpy())
    return xr.Dataset(
        out,
        coords={
            "layer": np.arange(n_layers),
            "head": np.arange(n_heads),
            "kind": ("layer", [arch.kind(layer) for layer in range(n_layers)]),
        },
        attrs={
            **pairs_provenance(vlm, pairs, **noted),
            "method": "atp*" if graddrop else "atp+qk-fix",
            "positions": positions,
            "graddrop": int(graddrop),
            "qk_fix_layers": softmax,
        },
    )


def require_supported(vlm: VLM) -> None:
    """Refuse AtP* on a model outside `SUPPORTED` (or a remote one: AtP* runs the model here)."""
    if vlm.arch.name not in SUPPORTED:
        raise InputError(
            f"AtP* (method='atp*') recomputes attention from the states transformers' attention functions "
            f"receive, which countlens supports for {', '.join(SUPPORTED)}; {vlm.name} is {vlm.arch.name}: "
            "use method='atp'"
        )
    if vlm.remote:
        raise InputError(f"{vlm.name} is a remote (NDIF) model: AtP* runs the model locally; use method='atp'")


class _Bypass(torch.autograd.Function):
    """GradDrop's cut: forward returns the layer's output unchanged; backward, while ``drop[layer]`` is
    set, sends the gradient straight to the layer's input (the skip connection alone), else through
    the layer as usual."""

    @staticmethod
    def forward(ctx, h_in: Tensor, h_out: Tensor, drop: dict, layer: int) -> Tensor:
        ctx.drop, ctx.layer = drop, layer
        return h_out.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.drop.get("layer") == ctx.layer:
            return grad, None, None, None
        return None, grad, None, None


def _record(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention function while AtP* records: keep what the layer's softmax reads, then
    run the model's own implementation (`_recording` stores it on the module) unchanged."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise InputError(
            f"{type(module).__name__} caps or adds sinks to its attention logits, which AtP*'s recomputation "
            "does not model; use method='atp'"
        )
    book = module._countlens_atp_star
    book["got"][book["layer"]] = {
        "q": query.detach(),
        "k": key.detach(),
        "v": value.detach(),
        "mask": None if attention_mask is None else attention_mask.detach(),
        "scaling": float(kwargs.get("scaling") or query.shape[-1] ** -0.5),
    }
    fn = attention_function(module, book["implementation"])
    return fn(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _RECORDER not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(_RECORDER, _record)


@contextmanager
def _recording(vlm: VLM, grad: bool, drop: dict) -> Iterator[dict]:
    """Inside the block, a forward records every softmax layer's attention inputs (``attn``) and every
    layer's z (``z``: with ``grad``, tensors whose gradient can be asked for), and with ``grad``
    passes each layer's output through `_Bypass`. Each attention module gets its own config copy
    naming the recorder (the model's masks stay those of its own implementation, as in
    `countlens.training.capture`); everything is restored afterwards."""
    _register()
    arch, model = vlm.arch, vlm.hf
    got: dict = {"attn": {}, "z": {}}
    inputs: dict[int, Tensor] = {}
    hooks, swapped = [], []

    def keep_z(layer):
        def hook(z):
            if grad and not z.requires_grad:
                z.requires_grad_(True)  # layer 0's z: nothing below it needs a gradient
            got["z"][layer] = z
            return None

        return hook

    try:
        for layer in range(arch.n_layers):
            hooks.append(Hook(arch.o_proj(layer), "input", keep_z(layer)))
            if arch.kind(layer) in SELF_ATTENTION:
                attn = module_of(model, arch.attention(layer))
                own = copy.copy(attn.config)
                own._attn_implementation = _RECORDER
                fast = attn.config._attn_implementation
                attn._countlens_atp_star = {"got": got["attn"], "layer": layer, "implementation": fast}
                swapped.append((attn, attn.config))
                attn.config = own
            if grad:
                block = arch.layer(layer)
                hooks.append(Hook(block, "input", lambda x, layer=layer: inputs.update({layer: x})))
                hooks.append(
                    Hook(block, "after", lambda m, a, k, out, layer=layer: _bypass(inputs.pop(layer), out, drop, layer))
                )
        with hooked(model, hooks):
            yield got
    finally:
        for attn, config in swapped:
            attn.config = config
            del attn._countlens_atp_star


def _bypass(h_in: Tensor, out, drop: dict, layer: int):
    if isinstance(out, tuple):  # a layer returning (hidden states, …)
        return (_Bypass.apply(h_in, out[0], drop, layer), *out[1:])
    return _Bypass.apply(h_in, out, drop, layer)


def _run(vlm: VLM, batch: Batch, grad: bool) -> dict:
    """One forward of ``batch`` (last-position logits), recording z and the attention inputs; with
    ``grad``, the graph kept for `_gradients` and ``drop`` the switch GradDrop's backward passes set."""
    drop: dict = {}
    with _recording(vlm, grad, drop) as got, torch.set_grad_enabled(grad):
        out = vlm.hf(**batch.inputs, use_cache=False, logits_to_keep=1)
    return {"logits": out.logits[:, -1].float(), "z": got["z"], "attn": got["attn"], "drop": drop}


def _gradients(clean: dict, total: Tensor, drops: Sequence[int]) -> Iterator[dict[int, Tensor]]:
    """∂ total / ∂z at every layer, one backward pass through the retained graph each: first with
    nothing dropped, then with each of ``drops`` dropped (the graph is let go after the last)."""
    layers = sorted(clean["z"])
    zs = [clean["z"][layer] for layer in layers]
    for i, dropped in enumerate([None, *drops]):
        clean["drop"]["layer"] = dropped
        got = torch.autograd.grad(total, zs, retain_graph=i < len(drops), allow_unused=True)
        yield {layer: torch.zeros_like(z) if g is None else g for layer, z, g in zip(layers, zs, got)}


def _shifts(clean: dict, corrupt: dict) -> dict[int, dict[type, Tensor]]:
    """Per layer, the QK fix's Δz (batch, seq, heads·d_head) of q, k and v on softmax layers (none
    elsewhere): computed in float64 (`_part_shifts`), kept in float32 or z's dtype if wider; the
    recorded attention inputs are let go layer by layer."""
    out = {}
    for layer, z in clean["z"].items():
        out[layer] = {}
        if layer in clean["attn"]:
            parts = _part_shifts(clean["attn"].pop(layer), corrupt["attn"].pop(layer), z)
            keep = torch.promote_types(z.dtype, torch.float32)
            out[layer] = {kind: d.to(keep) for kind, d in parts.items()}
    return out


def _part_shifts(clean: dict, corrupt: dict, z: Tensor) -> dict[type, Tensor]:
    """Δz of the QK fix for every head of one layer, (batch, seq, heads·d_head) in float64: ``q`` (its
    queries patched, the pattern recomputed), ``k`` (each key patched alone, summed over the keys) and
    ``v`` (its values patched under the clean pattern). Checks first that the recomputed clean
    attention reproduces the layer's z."""
    q, k, v = clean["q"].double(), clean["k"].double(), clean["v"].double()
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: head h reads kv head h // groups
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    k_new = corrupt["k"].double().repeat_interleave(groups, 1)
    v_new = corrupt["v"].double().repeat_interleave(groups, 1)
    allowed = _allowed(clean["mask"], q.shape[0], q.shape[2], k.shape[2], q.device)
    scale = clean["scaling"]
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    rows = allowed.any(-1, keepdim=True)  # a padded query row may see no key
    attn = torch.where(rows, torch.softmax(scores, -1), 0.0)
    z_clean = attn @ v  # batch head seq d_head
    _check_reproduces(z_clean, z, v, rows, float(scores[scores.isfinite()].abs().max()))
    q_scores = (corrupt["q"].double() @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    dq = torch.where(rows, torch.softmax(q_scores, -1), 0.0) @ v - z_clean
    key_scores = q @ k_new.transpose(-1, -2) * scale  # row s, column t: q_s · k'_t
    dk = key_shift(scores, key_scores.masked_fill(~allowed, float("-inf")), v, z_clean, rows)
    dv = attn @ (v_new - v)
    return {part: _flat(d) for part, d in zip(PARTS, (dq, dk, dv))}


def key_shift(scores: Tensor, key_scores: Tensor, v: Tensor, z: Tensor, rows: Tensor) -> Tensor:
    """Σ_t Δz[s] over key positions t, key t alone replaced (the fast K fix), (batch, head, seq, d).

    ``scores`` are the clean attention logits (−inf where masked), ``key_scores[s, t]`` the logit of
    row s on the patched key t, ``z`` the clean output, ``rows`` the rows with any key. Row s with key
    t replaced: z' = (W − e_t v_t + e'_t v_t) / (Z − e_t + e'_t) in terms of e = exp(score − max_s),
    Z = Σ e, W = Σ e·v. For every key but the row's largest (e ≤ 1 ≤ Z − e_t) this is exact in
    float64 as written; for the largest key t*, whose weight may be 1 − 10⁻²⁰, Z − e_t* is summed
    afresh over the other keys, shifted by the larger of their largest logit and the patched one."""
    top = scores.argmax(-1, keepdim=True)  # t* per row
    star = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)
    m = scores.gather(-1, top)
    e = torch.exp(scores - m).nan_to_num(0.0)  # rows without keys: m = −inf
    big_z = e.sum(-1, keepdim=True)
    w = e @ v
    # Keys t ≠ t*: z'_t = α_t W + β_t v_t. δ = patched logit − max; δ > 0 rescales by e^−δ.
    delta = key_scores - m
    delta = torch.where(torch.isnan(delta), float("-inf"), delta)  # rows without keys: zeroed below
    over = delta > 0
    shrink = torch.where(over, torch.exp(-delta.clamp(min=0)), 1.0)
    e_new = torch.where(over, 1.0, torch.exp(delta))
    z_new = (big_z - e) * shrink + e_new
    alpha = torch.where(star | ~torch.isfinite(scores), 0.0, shrink / z_new)
    beta = torch.where(star | ~torch.isfinite(scores), 0.0, (e_new - e * shrink) / z_new)
    n_keys = (torch.isfinite(scores) & ~star).sum(-1, keepdim=True)
    others = alpha.sum(-1, keepdim=True) * w + beta @ v - n_keys * z
    # The largest key t*: the other keys summed afresh, shifted by m2 = max(their max, patched logit).
    rest = scores.masked_fill(star, float("-inf"))
    patched = key_scores.gather(-1, top)
    m2 = torch.maximum(rest.max(-1, keepdim=True).values, patched)
    e_rest = torch.exp(rest - m2).nan_to_num(0.0)
    e_star = torch.exp(patched - m2).nan_to_num(0.0)
    z_star = (e_rest @ v + e_star * v.gather(-2, top.expand(*top.shape[:-1], v.shape[-1]))) / (
        e_rest.sum(-1, keepdim=True) + e_star
    )
    return torch.where(rows, others + z_star - z, 0.0)


def _allowed(mask: Tensor | None, batch: int, n_q: int, n_k: int, device) -> Tensor:
    """Bool[Tensor, "batch 1|heads q k"]: where the layer's mask lets a query see a key (None: causal)."""
    if mask is None:
        return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q).expand(batch, 1, n_q, n_k)
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2  # additive float masks: 0 where seen, the dtype's min elsewhere


def _check_reproduces(z_attn: Tensor, z: Tensor, v: Tensor, rows: Tensor, logits: float) -> None:
    """The recomputed softmax(q·kᵀ·scale + mask)·v must be the layer's z to the model's rounding: its
    attention weights round relative to the logits' size (``logits``, the largest |logit|), and z
    carries that times the values' size."""
    got = _flat(torch.where(rows, z_attn, 0.0))
    seen = rows.any(1).squeeze(-1)[..., None].to(z.device)  # batch seq
    want = z.detach().double()
    err = float(((got.to(want.device) - want).abs() * seen).max())
    tol = 64 * torch.finfo(z.dtype).eps * max(1.0, float(v.abs().max())) * max(1.0, logits)
    if not err <= tol:
        raise InputError(
            f"AtP*'s recomputed attention, softmax(q·kᵀ·scale + mask)·v, is off the model's z by {err:.3g} "
            f"(tolerance {tol:.3g}): this model's attention is not plain softmax attention; use method='atp'"
        )


def _flat(d: Tensor) -> Tensor:
    """(batch, head, seq, d_head) → (batch, seq, head·d_head), z's layout."""
    return d.transpose(1, 2).reshape(d.shape[0], d.shape[2], -1)
