"""Mistral 3 (Mistral-Small-3.1 …): Pixtral's vision tower over the image at its own size, a 2 × 2
patch merger; [IMG] tokens row by row, each row ended by [IMG_BREAK] (the last by [IMG_END]), which
are other tokens than the image token. The tower packs every image of a batch into one sequence.

Sizing (Pixtral's image processor): shrunk (never enlarged) until its longest side fits
``size["longest_edge"]``, then each side rounded *up* to whole tokens.

Processor: transformers declares PixtralProcessor as needing torchvision only because its module
imports one sizing helper from the torchvision image processor; without torchvision the class is a
placeholder. `processor_class` imports the module with that helper taken from the PIL image
processor, which defines the same function.
"""

from __future__ import annotations

import math

from countlens.model.families.spec import ArchSpec, Family, SizingRule

SPECS = (
    ArchSpec(
        "mistral3",
        ("mistral3",),
        layers="model.language_model.layers",
        final_norm="model.language_model.norm",
        vision_blocks="model.vision_tower.transformer.layers",
        vision_tower="model.vision_tower",
        projector="model.multi_modal_projector",
        merge="spatial_merge_size",
        packed_tower=True,
    ),
)


def _resize(ip, size: dict, height: int, width: int, unit: int) -> tuple[int, int]:
    # PixtralImageProcessor.resize: shrink by the longest side's ratio (floored), never enlarge, then
    # round each side up to whole tokens.
    ratio = max(height / size["longest_edge"], width / size["longest_edge"])
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return math.ceil(height / unit) * unit, math.ceil(width / unit) * unit


LONGEST_EDGE = SizingRule(
    _resize, default_side=lambda size: size["longest_edge"], pinned=lambda side: {"longest_edge": side}
)


def processor_class() -> type:
    """A working PixtralProcessor without torchvision (see the module docstring)."""
    import sys
    import types

    from transformers.models.pixtral import image_processing_pil_pixtral as pil

    module = "transformers.models.pixtral.image_processing_pixtral"
    if module not in sys.modules:  # the torchvision module cannot be imported: stand in its one helper
        stand_in = types.ModuleType(module)
        stand_in.get_resize_output_image_size = pil.get_resize_output_image_size
        sys.modules[module] = stand_in
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    return PixtralProcessor


FAMILY = Family(
    "mistral3",
    SPECS,
    names=("Mistral3", "Pixtral"),
    image_processors=("PixtralImageProcessor",),
    sizing=LONGEST_EDGE,
    processor_classes={"PixtralProcessor": processor_class},
)
