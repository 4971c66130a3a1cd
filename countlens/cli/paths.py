"""Checks of the paths a command will write, made before any model loads or any work starts.

A command checks its output directory (`check_out`) and any file it writes (`check_file_out`) first,
so a path it cannot write fails at once, with the flag that named it, and a refused run leaves
the disk as it found it: these checks create nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from countlens.errors import ConfigError


def check_out(out: Path | None, flag: str = "--out") -> None:
    """Refuse an output directory that cannot be written, before any model loads; writes nothing."""
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {out} is a file; give a directory")
    base = out
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise ConfigError(f"{flag} {out}: {base} is a file, so no directory can be made under it; give another path")
    if not os.access(base, os.W_OK | os.X_OK) or base.resolve().parts[1:2] in (("proc",), ("sys",)):
        raise ConfigError(f"{flag} {out}: {base} is not writable; give a directory you can write to")


def check_file_out(path: Path | None, flag: str) -> None:
    """Refuse a file to write (e.g. ``--json``) that cannot be written, before any work; writes nothing."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file path")
    check_out(path.parent, f"{flag} {path}: its folder")
