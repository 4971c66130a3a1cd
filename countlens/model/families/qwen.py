"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE: one vision tower and merger under
``model.visual``, 3-D rotary positions, and an image processor that keeps the image's aspect within a
pixel budget.

Sizing: ``smart_resize`` — the size nearest the image's, each side a multiple of patch × merge, whose
area lies between ``size["shortest_edge"]`` and ``size["longest_edge"]`` pixels. Any image processor
with both bounds (and no rule of its own family) follows it.

Qwen2.5-VL's vision blocks hold the merge units window by window (``projector_order="window"``);
`window_index` is that order, from the model's own code. Qwen3-VL adds image features inside its
first decoder layers (DeepStack); Qwen3-VL-MoE has mixture-of-experts MLPs; Qwen3.5 is hybrid: Gated
DeltaNet linear attention on most layers, softmax on every fourth, its softmax layers' q_proj writing
each head's query then its output gate; Qwen3.5-MoE is Qwen3.5's hybrid layout with routed experts.
"""

from __future__ import annotations

from countlens.model.families.spec import ArchSpec, Family, LinearAttentionSpec, MoESpec, SizingRule

_PATHS = dict(
    layers="model.language_model.layers",
    final_norm="model.language_model.norm",
    vision_blocks="model.visual.blocks",
    vision_tower="model.visual",
    projector="model.visual.merger",
    merge="vision_config.spatial_merge_size",
    rope_deltas="model.rope_deltas",
)

SPECS = (
    ArchSpec("qwen2_vl", ("qwen2_vl",), **_PATHS),
    ArchSpec("qwen2_5_vl", ("qwen2_5_vl",), projector_order="window", **_PATHS),
    ArchSpec("qwen3_vl", ("qwen3_vl",), q_norm="self_attn.q_norm", deepstack=True, **_PATHS),
    ArchSpec("qwen3_vl_moe", ("qwen3_vl_moe",), q_norm="self_attn.q_norm", deepstack=True, moe=MoESpec(), **_PATHS),
    ArchSpec("qwen3_5", ("qwen3_5",), q_norm="self_attn.q_norm", linear_attention=LinearAttentionSpec(), **_PATHS),
    # Qwen3.5-35B-A3B: the hybrid layers of Qwen3.5 with Qwen3-VL-MoE's routed experts on every layer
    # (256, 8 per token) and a gated shared expert beside them, which is no expert here (as Llama 4's).
    ArchSpec(
        "qwen3_5_moe",
        ("qwen3_5_moe",),
        q_norm="self_attn.q_norm",
        linear_attention=LinearAttentionSpec(),
        moe=MoESpec(),
        **_PATHS,
    ),
)


def _resize(ip, size: dict, height: int, width: int, unit: int) -> tuple[int, int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, unit, size["shortest_edge"], size["longest_edge"])


def _default_side(size: dict) -> int | None:
    """A pinned budget (both bounds equal) keeps square images of its side."""
    lo, hi = size["shortest_edge"], size["longest_edge"]
    return round(lo**0.5) if lo == hi else None


def _pinned(side: int) -> dict:
    return {"shortest_edge": side * side, "longest_edge": side * side}


#: Claimed by its size keys, not by class name: any image processor with both bounds follows it.
PIXEL_BUDGET = SizingRule(_resize, _default_side, _pinned, size_keys=("shortest_edge", "longest_edge"))


def window_index(visual, grid_thw):
    """Qwen2.5-VL's order of merge units inside its vision blocks, from the model's own code."""
    if hasattr(visual, "get_window_index"):  # transformers 4.x keeps it on the tower
        return visual.get_window_index(grid_thw)[0]
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import get_vision_window_index

    return get_vision_window_index(grid_thw, visual.spatial_merge_size, visual.window_size, visual.patch_size)[0]


FAMILY = Family(
    "qwen",
    SPECS,
    names=("Qwen2VL", "Qwen2_5_VL", "Qwen3VL", "Qwen3_5"),
    sizing=PIXEL_BUDGET,
    window_index=window_index,
)
