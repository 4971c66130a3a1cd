"""Gemma 4: its full-attention layers have their own head size (a heterogeneous text config, read per
layer by `countlens.model.arch`); the image at the most pooled tokens its aspect allows, row-major over the
pooled grid; the projector's output is flat (tokens of all images, d). E2B / E4B give every decoder
layer its own input computed from the embeddings (so layer −1 does not carry all of the image) and
let their last layers reuse an earlier layer's keys and values (so no layer below them may be skipped).

Sizing (Gemma 4's image processor): enlarged or shrunk to the most ``max_soft_tokens`` pooled tokens
its aspect allows, each side rounded *down* to the unit (transformers' own function); it cannot be
pinned to one square size.
"""

from __future__ import annotations

from countlens.model.families.spec import ArchSpec, Family, Sandwich, SizingRule

SPECS = (
    ArchSpec(
        "gemma4",
        ("gemma4",),
        layers="model.language_model.layers",
        final_norm="model.language_model.norm",
        vision_blocks="model.vision_tower.encoder.layers",
        vision_tower="model.vision_tower",
        projector="model.embed_vision",
        q_norm="self_attn.q_norm",
        merge="vision_config.pooling_kernel_size",
        per_layer_inputs_attr="hidden_size_per_layer_input",
        kv_shared_attr="num_kv_shared_layers",
        sandwich=Sandwich(),
    ),
)


def _resize(ip, size: dict, height: int, width: int, unit: int) -> tuple[int, int]:
    # The model pools ``unit``-px cells; the budget counts pooled tokens.
    if not getattr(ip, "do_resize", True):
        return height, width
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    kernel = int(ip.pooling_kernel_size)
    return get_aspect_ratio_preserving_size(
        height, width, int(ip.patch_size), int(ip.max_soft_tokens) * kernel**2, kernel
    )


FAMILY = Family(
    "gemma4",
    SPECS,
    names=("Gemma4",),
    image_processors=("Gemma4ImageProcessor",),
    sizing=SizingRule(_resize),
)
