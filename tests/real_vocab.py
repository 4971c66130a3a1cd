"""The tiny models' real vocabularies (`countlens.model.tiny_models.vocab`, re-exported here under the
names the tests use), their conversions kept in the tests' disk cache (`disk_cache`): ~0.5 s a read
instead of 2–15 s a conversion, across sessions and xdist workers."""

from __future__ import annotations

from countlens.model.tiny_models import vocab
from countlens.model.tiny_models.vocab import *  # noqa: F403 — every public name, as before the move


def _disk(kind: str, args: tuple, convert) -> str:
    from disk_cache import cached_text, entry_key

    return cached_text(entry_key(kind, *args), convert)


vocab.keep_conversions(_disk)
