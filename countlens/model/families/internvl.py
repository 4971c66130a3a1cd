"""InternVL3 and InternVL3.5 (transformers' ``internvl`` conversion): an InternViT tower, pixel-shuffled
by ``downsample_ratio`` (0.5 → 2 × 2), and a Qwen2.5 (InternVL3) or Qwen3 (InternVL3.5) language
model — only the latter has a q-norm.

Tiles: the image processor (GotOcr2's) resizes the image to the grid of tiles closest to its aspect
(at most ``max_patches``), each tile's tokens row-major, tiles row-major, then a thumbnail when there
are several ("tiles_thumbnail"). The processor always asks for ``crop_to_patches``, whatever the image
processor says. The authors' remote-code checkpoints (``internvl_chat``) are refused, naming the
conversion.
"""

from __future__ import annotations

from countlens.model.families.spec import ArchSpec, Family

SPECS = (
    ArchSpec(
        "internvl",
        ("internvl",),
        layers="model.language_model.layers",
        final_norm="model.language_model.norm",
        vision_blocks="model.vision_tower.encoder.layer",
        vision_tower="model.vision_tower",
        projector="model.multi_modal_projector",
        q_norm="self_attn.q_norm",  # InternVL3.5's Qwen3 language models; InternVL3's Qwen2.5 have none
        q_norm_text_types=("qwen3", "qwen3_moe"),
        merge="downsample_ratio",
        merge_is_ratio=True,
        layout="tiles_thumbnail",
    ),
)


def tile_grid(ip, setting, height: int, width: int) -> tuple[int, int]:
    """(rows, cols): the tiled canvas closest to the image's aspect (transformers' own function)."""
    if not setting("crop_to_patches") or setting("max_patches") <= 1:
        return 1, 1
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    size = dict(ip.size)
    cols, rows = get_optimal_tiled_canvas(
        (height, width), (size["height"], size["width"]), setting("min_patches"), setting("max_patches")
    )
    return int(rows), int(cols)


FAMILY = Family(
    "internvl",
    SPECS,
    names=("InternVL", "GotOcr2"),
    image_processors=("GotOcr2ImageProcessor",),
    tile_grid=tile_grid,
    remote_code={"internvl_chat": ("internvl", "OpenGVLab/InternVL3-8B-hf for OpenGVLab/InternVL3-8B")},
)
