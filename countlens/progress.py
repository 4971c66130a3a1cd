"""Progress of long loops: a live bar on a terminal, and a plain line per step when output is a file
or a pipe (a bar redrawn there shows nothing until the loop ends)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def track(items: Sequence[T] | Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Yield ``items``, reporting progress on stderr (rich's bar on a terminal, else one line each)."""
    if sys.stderr.isatty():
        from rich.progress import track as bar

        yield from bar(items, description=description, total=total)
        return
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    start = time.perf_counter()
    for i, item in enumerate(items, 1):
        yield item
        of = f"/{total}" if total is not None else ""
        print(f"{description}: {i}{of} ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
