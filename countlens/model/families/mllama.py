"""Llama-3.2-Vision (transformers' ``mllama``): a cross-attention VLM. No image tokens enter the
residual stream; some decoder layers attend from the text to the image states instead
(`CrossAttentionSpec`): a fixed number of tile slots, each a class token then the tile's patches
row-major ("cross_tiles").

Tiles: the canvas of at most ``max_image_tiles`` tiles that scales the image least (transformers'
own function).
"""

from __future__ import annotations

from countlens.model.families.spec import ArchSpec, CrossAttentionSpec, Family

SPECS = (
    ArchSpec(
        "mllama",
        ("mllama",),
        layers="model.language_model.layers",
        final_norm="model.language_model.norm",
        vision_blocks="model.vision_model.transformer.layers",  # the local encoder (then 8 gated global blocks)
        vision_tower="model.vision_model",
        projector="model.multi_modal_projector",
        layout="cross_tiles",
        cross_attention=CrossAttentionSpec(
            layers_attr="text_config.cross_attention_layers", states="model.multi_modal_projector"
        ),
    ),
)


def tile_grid(ip, setting, height: int, width: int) -> tuple[int, int]:
    from transformers.models.mllama.image_processing_pil_mllama import get_optimal_tiled_canvas

    tile = dict(ip.size)["height"]
    canvas_h, canvas_w = get_optimal_tiled_canvas(height, width, setting("max_image_tiles"), tile)
    return int(canvas_h) // tile, int(canvas_w) // tile


FAMILY = Family("mllama", SPECS, names=("Mllama",), image_processors=("MllamaImageProcessor",), tile_grid=tile_grid)
