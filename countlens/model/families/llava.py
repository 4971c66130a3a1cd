"""LLaVA-1.5, LLaVA-NeXT, LLaVA-NeXT-Video and LLaVA-OneVision: a CLIP / SigLIP tower, a projector,
and a language model under ``model.language_model``.

LLaVA-1.5's image tokens are its patch grid row-major (the CLS token dropped). NeXT, NeXT-Video and
OneVision ("anyres") show the image twice: the base image's grid row-major, then the high-resolution
crops stitched into one finer grid, row-major with a newline token ending each row. NeXT-Video reads
an image exactly as NeXT does; its video pooler (``model.vision_resampler``) acts on videos only, and
countlens builds its processor without the video processor (`countlens.model.processor_files`).
OneVision's SigLIP reads 384 px images and crops of 14 px patches: 27 whole patches and 6 px its patch
convolution drops (``drops_remainder``; `countlens.model.geometry`).
"""

from __future__ import annotations

from countlens.model.families.spec import ArchSpec, Family

_PATHS = dict(
    layers="model.language_model.layers",
    final_norm="model.language_model.norm",
    vision_blocks="model.vision_tower.encoder.layers",
    vision_tower="model.vision_tower",
    projector="model.multi_modal_projector",
)

SPECS = (
    ArchSpec("llava", ("llava",), **_PATHS),
    ArchSpec("llava_next", ("llava_next",), layout="anyres", **_PATHS),
    ArchSpec("llava_next_video", ("llava_next_video",), layout="anyres", **_PATHS),
    ArchSpec("llava_onevision", ("llava_onevision",), layout="anyres", drops_remainder=True, **_PATHS),
)

FAMILY = Family("llava", SPECS, names=("Llava",))
