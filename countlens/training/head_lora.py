"""Head-level fine-tunes: LoRA adapters restricted to chosen heads' slices of q, k, v and o.

A LoRA adapter adds ΔW = B·A (scaled) to a projection. For q_proj (and k_proj, v_proj) head h's
output rows are its slice; for o_proj head h's input columns are. Restricting the adapter to heads
H zeroes B's rows outside H's q / k / v slices (a key-value head is trained when any of its query
heads is in H) and A's columns outside H's o_proj slice, and masks their gradients, so ΔW is exactly
zero outside those slices for the whole run: AdamW's update of an entry whose gradient was always 0
is 0, and its decoupled weight decay keeps 0 at 0. Other heads' weights are unchanged to the bit.
A fused qkv projection (Phi-4) has q's rows, then k's, then v's.

`top_heads_from(table, k, classes)` picks the heads a fine-tune targets from a head table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from countlens.analysis.heads import read_heads
from countlens.circuits.engine import on_gradient
from countlens.errors import ConfigError
from countlens.labels import head_label, top_sites
from countlens.validate import require_count, require_sequence

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


def head_rows(vlm: VLM, layer: int, heads: Sequence[int], part: str, out_features: int) -> torch.Tensor:
    """Bool[Tensor, "out_features"]: the rows of ``part``'s projection ("q", "k", "v" or "qkv") that the
    ``heads`` of ``layer`` own (for k and v: their key-value heads)."""
    arch = vlm.arch
    d, n = arch.head_dim(layer), arch.heads(layer)
    mask = torch.zeros(out_features, dtype=torch.bool)
    n_kv = (out_features // d - n) // 2 if part == "qkv" else out_features // d if part != "q" else n
    group = max(1, n // max(n_kv, 1))
    for h in heads:
        if part in ("q", "qkv"):
            mask[h * d : (h + 1) * d] = True
        kv = h // group
        if part in ("k", "v"):
            mask[kv * d : (kv + 1) * d] = True
        if part == "qkv":
            for start in (n * d, n * d + n_kv * d):
                mask[start + kv * d : start + (kv + 1) * d] = True
    return mask


def restrict_to_heads(vlm: VLM, model, heads: Sequence[tuple[int, int]]) -> int:
    """Zero and freeze (by gradient masks) every LoRA entry of ``model`` outside ``heads``' slices;
    returns how many LoRA modules were restricted. ``model``: the peft model around ``vlm.hf``."""
    arch, spec = vlm.arch, vlm.arch.spec
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    parts = {spec.q_proj.rsplit(".", 1)[-1]: "qkv" if spec.fused_qkv else "q", spec.o_proj.rsplit(".", 1)[-1]: "o"}
    if not spec.fused_qkv:
        parts[spec.k_proj.rsplit(".", 1)[-1]] = "k"
        parts[spec.v_proj.rsplit(".", 1)[-1]] = "v"
    restricted = 0
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
            continue
        layer = _layer_of(name, spec.layers)
        part = parts.get(name.rsplit(".", 1)[-1])
        if layer is None or part is None or not name.endswith(f"{spec.self_attn}.{name.rsplit('.', 1)[-1]}"):
            continue
        mine = by_layer.get(layer, [])
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        if part == "o":  # head h's z columns of o_proj's input
            cols = head_rows(vlm, layer, mine, "q", a.shape[1])
            _keep(a, cols[None, :].expand_as(a))
            _keep(b, torch.ones_like(b, dtype=torch.bool) if mine else torch.zeros_like(b, dtype=torch.bool))
        else:
            rows = head_rows(vlm, layer, mine, part, b.shape[0])
            _keep(b, rows[:, None].expand_as(b))
        restricted += 1
    if not restricted:
        raise ConfigError(f"target_heads found no LoRA module on {arch.name}'s attention projections to restrict")
    return restricted


def _keep(param: torch.nn.Parameter, mask: torch.Tensor) -> None:
    mask = mask.to(param.device, param.dtype)
    with torch.no_grad():
        param.mul_(mask)
    on_gradient(param, lambda grad: grad * mask)


def _layer_of(name: str, layers: str) -> int | None:
    """The decoder layer index in a module name under ``layers`` (peft prefixes it), else None."""
    marker = f"{layers}."
    if marker not in name:
        return None
    rest = name.split(marker, 1)[1]
    first = rest.split(".", 1)[0]
    return int(first) if first.isdigit() else None


def check_heads(vlm: VLM, heads: Sequence[tuple[int, int]]) -> None:
    """Refuse, before training, heads the model lacks or whose layer has no softmax self-attention
    with separate per-head projections (linear-attention and cross-attention layers)."""
    arch = vlm.arch
    for layer, head in heads:
        if not 0 <= layer < arch.n_layers or not 0 <= head < arch.heads(layer):
            raise ConfigError(f"target head L{layer}H{head} is not a head of {arch.name}")
        if arch.kind(layer) not in ("full", "sliding", "chunked"):
            raise ConfigError(
                f"target head L{layer}H{head} sits in a {arch.kind(layer)}-attention layer; head-level LoRA trains "
                "self-attention heads' q / k / v / o slices: choose heads of its self-attention layers"
            )


def top_heads_from(circuit, k: int = 5, classes: Sequence[str] | None = None) -> tuple[tuple[int, int], ...]:
    """The ``k`` most important heads of ``circuit``: a head table (a `countlens discover` run directory or
    its ``heads.csv`` DataFrame; only heads of ``classes`` when given; self-attention layers only), or an
    importance DataArray over (layer, head) such as ``patch_heads(...).effect`` (by |value|). NaN is
    no head (or an unmeasured one) and left out; ±inf is refused, and so is a ranking with no finite
    value: it selects no head, and an empty selection would not be "every head"."""
    import numpy as np
    import pandas as pd
    import xarray as xr

    require_count(k, "k")
    if isinstance(circuit, xr.DataArray):
        if set(circuit.dims) != {"layer", "head"} or classes is not None:
            raise ConfigError(
                "an importance DataArray must have dims (layer, head) and carries no classes; give a head table "
                f"to choose by class (got dims {circuit.dims})"
            )
        flat = circuit.transpose("layer", "head")
        cells = [(int(a), int(b)) for a in flat["layer"].values for b in flat["head"].values]
        _require_ranked(cells, flat.values.astype(float).reshape(-1), "the importance DataArray")
        return tuple((layer, head) for layer, head, _ in top_sites(circuit, k, absolute=True))
    table = read_heads(circuit) if isinstance(circuit, (str, Path)) else circuit
    if not isinstance(table, pd.DataFrame) or not {"layer", "head", "class", "importance"} <= set(table.columns):
        raise ConfigError(
            "circuit must be an importance DataArray over (layer, head), a discover run directory or its head "
            f"table (a DataFrame with layer, head, class and importance); got {type(circuit).__name__}"
        )
    if classes is not None:
        classes = require_sequence(classes, "classes", example="('cross-modal routing',)")
    if "kind" in table:
        table = table[table["kind"].isin(("full", "sliding", "chunked"))]
    if classes is not None:
        known = sorted(set(table["class"]))
        unknown = [c for c in classes if c not in known]
        if unknown:
            raise ConfigError(f"no head of class {unknown} in the table; its classes are {known}")
        table = table[table["class"].isin(list(classes))]
    try:
        importance = table["importance"].to_numpy(dtype=float)
    except (TypeError, ValueError):
        raise ConfigError("the head table's importance column holds non-numbers; give numbers per head") from None
    cells = [(int(r.layer), int(r.head)) for r in table.itertuples()]
    _require_ranked(
        cells, importance, "the head table's importance" + (f" of classes {list(classes)}" if classes else "")
    )
    table = table[np.isfinite(importance)]
    top = table.sort_values("importance", ascending=False, kind="stable").head(k)
    return tuple((int(r.layer), int(r.head)) for r in top.itertuples())


def _require_ranked(cells: list[tuple[int, int]], values, what: str) -> None:
    """A `ConfigError` where ``values`` (one per head of ``cells``) hold ±inf, or no finite value."""
    import numpy as np

    infinite = [head_label(c) for c, v in zip(cells, values, strict=True) if np.isinf(v)]
    if infinite:
        raise ConfigError(
            f"{what} holds ±inf at {', '.join(infinite[:5])}{' …' if len(infinite) > 5 else ''}: an inf ranks "
            "first whatever it means; rank with finite importances (NaN where a head is not measured)"
        )
    if not np.isfinite(values).any():
        nan = ", all NaN" if len(values) else ""
        raise ConfigError(
            f"{what} has no finite value ({len(values)} heads{nan}): it ranks no head; give a measured ranking "
            "(e.g. patch_heads(...).effect), or leave target_heads None to train every head"
        )
