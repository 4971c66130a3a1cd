"""Head temperature: sharpen (β > 1) or flatten (β < 1) chosen heads' attention at inference time.

Head h's attention is softmax(β_h · q_h·k / √d). Scaling the head's q slice by β_h — after any
q-norm, before rotary — scales exactly those logits, because rotary embedding is linear in q; so
the edit holds for eager, SDPA and flash attention alike and needs no attention weights. It is a
forward hook on the q site (`Arch.q_site`), active inside the context manager, for plain forwards,
generation, nnsight traces and models with a LoRA adapter alike. β = 1 leaves the model untouched.

`beta_from_importance` builds β_h = α·γ_h from a patching or ablation result, with γ_h the head's
importance divided by the largest among the chosen heads (so the most important head gets α).
Heads whose β would fall below ``floor`` (default 1: the method sharpens, it does not flatten) are
left alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine import Hook, hooked
from countlens.circuits.sites import checked_heads
from countlens.errors import InputError
from countlens.labels import head_label, top_sites
from countlens.model.arguments import require_vlm
from countlens.validate import require_count, require_dataarray, require_positive

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


@contextmanager
def head_temperature(vlm: VLM, betas: Mapping[tuple[int, int] | str, float]) -> Iterator[None]:
    """``with head_temperature(vlm, {(layer, head): β, ...}): ...`` scales those heads' attention logits;
    a head may also be named by its label, ``{"L3H2": 1.2}``; β is a finite number > 0."""
    require_vlm(vlm, "head_temperature")
    arch = vlm.arch
    if not isinstance(betas, Mapping):
        raise InputError(
            f"betas must map heads to β, e.g. {{(3, 2): 1.2}} or {{'L3H2': 1.2}}; got {type(betas).__name__}"
        )
    by_layer: dict[int, dict[int, float]] = {}
    seen: set[tuple[int, int]] = set()
    for key, beta in betas.items():
        [(layer, head)] = checked_heads(arch, [key])
        arch.require_softmax(layer, f"head temperature of {head_label((layer, head))}")
        require_positive(beta, f"β of head {head_label((layer, head))}")
        if (layer, head) in seen:
            raise InputError(f"head {head_label((layer, head))} is given twice in betas; give it once")
        seen.add((layer, head))
        if beta != 1.0:
            by_layer.setdefault(layer, {})[head] = float(beta)
    hooks = []
    for layer, heads in by_layer.items():
        hook = _scaler(heads, arch.heads(layer), arch.head_dim(layer), arch.q_layout(layer))
        if arch.spec.q_norm_shared_with_k and arch.q_site(layer).endswith(arch.spec.q_norm):
            # Llama 4: one norm module normalises q, then k, in each attention call: scale its first.
            calls = {"n": 0}
            hooks.append(Hook(arch.attention(layer), "before", lambda m, a, k, calls=calls: calls.update(n=0)))
            hook = _first_call_only(hook, calls)
        hooks.append(Hook(arch.q_site(layer), "after", hook))
    with hooked(vlm.hf, hooks):
        yield


def _first_call_only(hook, calls: dict):
    """``hook`` on a module's first call since ``calls`` was reset (q before k through a shared norm)."""

    def first(module, args, kwargs, output):
        calls["n"] += 1
        return hook(module, args, kwargs, output) if calls["n"] == 1 else output

    return first


def _scaler(heads: dict[int, float], n_heads: int, d_head: int, layout: str):
    """A hook scaling head h of q by β_h; ``layout``: "bs(hd)" (q_proj output, heads·d_head last),
    "bs(qkv)" (a fused projection's output: q's heads·d_head columns first, then k and v, left as
    they are), "bshd" or "bhsd" (a q-norm's output, per `ArchSpec.q_norm_layout`)."""

    def hook(module, args, kwargs, output):
        # β in float32: in bf16, 1.2 would become 1.203125.
        scale = torch.ones(n_heads, device=output.device, dtype=torch.float32)
        for h, beta in heads.items():
            scale[h] = beta
        if layout == "bs(hd)" and output.shape[-1] == n_heads * d_head:
            return (output.float() * scale.repeat_interleave(d_head)).to(output.dtype)
        if layout == "bs(qkv)" and output.shape[-1] > n_heads * d_head:
            kv = torch.ones(output.shape[-1] - n_heads * d_head, device=output.device)
            return (output.float() * torch.cat([scale.repeat_interleave(d_head), kv])).to(output.dtype)
        if layout == "bshd" and output.shape[-2:] == (n_heads, d_head):
            return (output.float() * scale[:, None]).to(output.dtype)
        if layout == "bhsd" and output.dim() == 4 and output.shape[1] == n_heads and output.shape[-1] == d_head:
            return (output.float() * scale[:, None, None]).to(output.dtype)
        raise InputError(
            f"unexpected q shape {tuple(output.shape)} at {module.__class__.__name__} for layout "
            f"{layout!r} ({n_heads} heads of {d_head}); fix q_norm_layout in the family's spec "
            "(countlens/model/families/)"
        )

    return hook


def beta_from_importance(
    importance: xr.DataArray, alpha: float = 1.2, top_k: int = 10, floor: float = 1.0
) -> dict[tuple[int, int], float]:
    """β_h = α·γ_h for the ``top_k`` heads by |importance| (an xr.DataArray over layer × head). NaN
    slots are no candidates (no head there, or a layer without softmax masked out); ±inf, or no finite
    value at all (a degenerate patching denominator), is refused."""
    require_dataarray(importance, "importance", ("layer", "head"))
    require_positive(alpha, "alpha")
    require_count(top_k, "top_k")
    grid = importance.transpose("layer", "head")
    values = grid.values.astype(float)
    rows, cols = np.nonzero(np.isinf(values) | (np.isnan(values) & ~np.isfinite(values).any()))
    if len(rows):
        heads = [head_label((grid["layer"].values[r], grid["head"].values[c])) for r, c in zip(rows, cols)]
        raise InputError(
            f"importance is not finite (NaN or ±inf) at heads {heads[:5]}{' …' if len(heads) > 5 else ''}; "
            "choose heads from a result that defines every head's importance"
        )
    top = top_sites(importance, top_k, absolute=True)
    peak = max((abs(v) for _, _, v in top), default=0.0)
    if peak <= 0:
        return {}
    betas = {(layer, head): alpha * abs(v) / peak for layer, head, v in top}
    return {k: b for k, b in betas.items() if b >= floor}
