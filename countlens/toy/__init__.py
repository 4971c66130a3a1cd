"""The model organism: a small Qwen2-VL trained by countlens on its own synthetic scenes.

`countlens.load("toy")` loads the shipped weights in ``weights/`` (HF format, with the recipe and
the training log beside them); `countlens.toy.train.train` (CLI: ``countlens toy train``) rebuilds
them from scratch. Its planted-circuit kin (`countlens.toy.planted`, trained by `countlens.toy.plant`,
CLI: ``countlens toy plant``) ship in ``organisms/`` and load by name (`countlens.model.shipped`).
"""
