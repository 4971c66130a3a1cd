"""The tiny models' real vocabularies (`countlens.toy.tiny_models.vocab`, and the families' special-token
tables in their tiny modules), re-exported here under the names the tests use, their conversions kept in
the tests' disk cache (`disk_cache`): ~0.5 s a read instead of 2–15 s a conversion, across sessions and
xdist workers."""

from __future__ import annotations

from countlens.toy.tiny_models import vocab
from countlens.toy.tiny_models.internvl import INTERNVL3_SPECIALS, INTERNVL3_VOCAB  # noqa: F401
from countlens.toy.tiny_models.ovis2 import OVIS2_SPECIALS  # noqa: F401
from countlens.toy.tiny_models.phi4_multimodal import PHI4MM_NAMED, PHI4MM_RSTRIP, PHI4MM_SPECIALS  # noqa: F401
from countlens.toy.tiny_models.qwen import (  # noqa: F401
    QWEN2_5_SPECIALS,
    QWEN2_VL_SPECIALS,
    QWEN3_5_VOCAB,
    qwen3_5_tokenizer,
)
from countlens.toy.tiny_models.vocab import *  # noqa: F403 — every public name, as before the move


def _disk(kind: str, args: tuple, convert) -> str:
    from disk_cache import cached_text, entry_key

    return cached_text(entry_key(kind, *args), convert)


vocab.keep_conversions(_disk)
