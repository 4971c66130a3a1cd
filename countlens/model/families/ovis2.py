"""Ovis2 (transformers' ``ovis2``): the tower's output is a probability over a visual vocabulary, and
the image tokens are those probabilities times an embedding table (the "projector").

Tiles: the thumbnail first, then the tiles, separated by other tokens than the image token
("thumbnail_tiles"). The image processor takes the fewest tiles covering 90 % of the image
(``use_covering_area_grid``), else the grid closest to its aspect; transformers cuts the grid as
columns × rows, and `tile_grid` reads the grid the cut uses. The authors' remote-code checkpoints
(``ovis``) are refused, naming the conversion.
"""

from __future__ import annotations

from countlens.model.families.spec import ArchSpec, Family

SPECS = (
    ArchSpec(
        "ovis2",
        ("ovis2",),
        layers="model.language_model.layers",
        final_norm="model.language_model.norm",
        vision_blocks="model.vision_tower.transformer.encoder.layers",
        vision_tower="model.vision_tower",
        # Probabilities over the visual vocabulary times this table are the image tokens.
        projector="model.visual_embeddings_table",
        merge="vision_config.hidden_stride",
        layout="thumbnail_tiles",
    ),
)


def tile_grid(ip, setting, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of tiles, by the image processor's own functions and settings."""
    if not setting("crop_to_patches") or setting("max_patches") <= 1:
        return 1, 1
    from transformers.models.ovis2 import image_processing_pil_ovis2 as pil

    size = dict(ip.size)
    if setting("use_covering_area_grid", True):
        cols, rows = pil.get_min_tile_covering_grid(
            (height, width), target_patch_size=size["height"], max_image_tiles=setting("max_patches")
        )
    else:
        cols, rows = pil.get_optimal_tiled_canvas(
            (height, width), (size["height"], size["width"]), setting("min_patches"), setting("max_patches")
        )
    return int(rows), int(cols)


FAMILY = Family(
    "ovis2",
    SPECS,
    names=("Ovis2",),
    image_processors=("Ovis2ImageProcessor",),
    tile_grid=tile_grid,
    # transformers' Ovis2 code names converted 1B and 2B checkpoints only; none of AIDC-AI/Ovis2-8B.
    remote_code={
        "ovis": (
            "ovis2",
            "thisisiron/Ovis2-2B-hf (or -1B-hf, the conversions transformers' Ovis2 code names); no transformers "
            "conversion of the larger Ovis2 sizes (AIDC-AI/Ovis2-8B) is named there: convert the weights to "
            "transformers' Ovis2ForConditionalGeneration and save_pretrained them",
        )
    },
)
