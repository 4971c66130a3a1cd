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


class Bar:
    """``with Bar("training +SFT", 300) as bar: bar.update(step, "loss 0.41")`` — a rich bar on a
    terminal, else a line every ``total / lines`` steps and at the end."""

    def __init__(self, description: str, total: int, lines: int = 10):
        self.description, self.total, self.every = description, total, max(1, total // lines)
        self._bar = None

    def __enter__(self) -> Bar:
        if sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn(self.description),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} {task.fields[info]}"),
                TimeElapsedColumn(),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=self.total, info="")
        self._start = time.perf_counter()
        return self

    def update(self, done: int, info: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, info=info)
        elif done % self.every == 0 or done == self.total:
            print(
                f"{self.description}: {done}/{self.total} {info} ({time.perf_counter() - self._start:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


def duration_text(seconds: float) -> str:
    """Seconds as s, min, h or days, whichever reads best (a plan's time, a bench's)."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.1f} s"
