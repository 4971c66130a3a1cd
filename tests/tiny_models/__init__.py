"""The tests' names for the package's tiny models (`countlens.toy.tiny_models`: one builder module per
family, the same builders `countlens.toy.tiny` and ``countlens model tiny`` use). Importing this also
keeps the converted real vocabularies in the tests' disk cache (`real_vocab`)."""

from __future__ import annotations

import os

import real_vocab  # noqa: F401 — installs the disk cache for the vocabularies' conversions

from countlens.toy.tiny_models import BUILDERS, FAMILIES, IMAGE_SIZE, NAMES, QWEN_VOCAB, build, inputs

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_IMAGE_SIZE = IMAGE_SIZE
TINY_NAMES = NAMES
build_tiny = build
tiny_inputs = inputs

__all__ = ["BUILDERS", "FAMILIES", "QWEN_VOCAB", "TINY_IMAGE_SIZE", "TINY_NAMES", "build_tiny", "tiny_inputs"]
