"""GLM-4.1V: Qwen2-VL's layout (a vision tower and merger under ``model.visual``, 3-D rotary
positions, a 2 × 2 merge), with its own image processor.

Sizing: Qwen2-VL's pixel budget counted over the two temporal frames an image is repeated into, so
its bounds are twice the image's area (transformers' ``glm4v`` ``smart_resize``).
"""

from __future__ import annotations

from countlens.model.families.spec import ArchSpec, Family, Sandwich, SizingRule

SPECS = (
    ArchSpec(
        "glm4v",
        ("glm4v",),
        layers="model.language_model.layers",
        final_norm="model.language_model.norm",
        vision_blocks="model.visual.blocks",
        vision_tower="model.visual",
        projector="model.visual.merger",
        merge="vision_config.spatial_merge_size",
        rope_deltas="model.rope_deltas",
        # GLM-4's layers norm each block's output too, under their own names.
        sandwich=Sandwich("post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm"),
    ),
)

#: Frames an image is repeated into; the pixel budget counts them all.
FRAMES = 2


def _resize(ip, size: dict, height: int, width: int, unit: int) -> tuple[int, int]:
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    frames = int(getattr(ip, "temporal_patch_size", FRAMES))
    return smart_resize(
        frames, height, width, frames, unit, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
    )


def _default_side(size: dict) -> int | None:
    """A pinned budget (both bounds equal) keeps square images of its side."""
    lo, hi = size["shortest_edge"], size["longest_edge"]
    return round((lo / FRAMES) ** 0.5) if lo == hi else None


def _pinned(side: int) -> dict:
    return {"shortest_edge": side * side * FRAMES, "longest_edge": side * side * FRAMES}


FAMILY = Family(
    "glm4v",
    SPECS,
    names=("Glm4v",),
    image_processors=("Glm4vImageProcessor",),
    sizing=SizingRule(_resize, _default_side, _pinned),
)
