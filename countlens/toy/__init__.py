"""The model organism: a small Qwen2-VL trained by countlens on its own synthetic scenes.

`countlens.load("toy")` loads the shipped weights in ``weights/`` (HF format, with the recipe and
the training log beside them); `countlens.toy.train.train` (CLI: ``countlens toy train``) rebuilds
them from scratch. Its planted-circuit kin (`countlens.toy.planted`, trained by `countlens.toy.plant`,
CLI: ``countlens toy plant``) ship in ``organisms/`` and load by name (`countlens.model.shipped`).
`tiny_models` builds random-init models of every other family at toy sizes (the test suite's builders),
for trying an architecture offline; `tiny(name)` below is its door. They live here, above the model
layer, because their tokenizers read the organism's vocabulary and the prompts (`countlens.toy.recipe`,
`countlens.datasets.prompts`).
"""

from __future__ import annotations


def tiny(name: str, out=None, **kw):
    """A tiny random-init model of the registry's ``name`` ("gemma3", "qwen2_5_vl", "llava_next" …) as a
    loaded `countlens.VLM`, for trying a family offline: `countlens.toy.tiny_models.tiny` (``out``: the
    folder to keep the checkpoint in; ``countlens model tiny --family NAME --out DIR`` writes one)."""
    from countlens.toy.tiny_models import tiny as tiny_vlm

    return tiny_vlm(name, out, **kw)
