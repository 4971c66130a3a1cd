"""tests/disk_cache.py: an entry is built once, and a newer build of the same kind and arguments
removes the entries it supersedes, and only those."""

from __future__ import annotations

import disk_cache


def test_a_new_entry_removes_only_the_ones_it_supersedes(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_cache, "cache_dir", lambda: tmp_path)
    code, args = "0123456789abcdef", "aaaaaaaaaaaa"
    old, other_args, other_kind = f"toy-run-{code}-{args}", f"toy-run-{code}-bbbbbbbbbbbb", f"run-{code}-{args}"
    for name in (old, other_args, other_kind):
        (tmp_path / name).mkdir()
        (tmp_path / f"{name}.lock").touch()
    built = []
    new = disk_cache.cached_dir(f"toy-run-fedcba9876543210-{args}", lambda d: built.append((d / "x").write_text("1")))
    assert (new / "x").read_text() == "1" and len(built) == 1
    assert not (tmp_path / old).exists() and not (tmp_path / f"{old}.lock").exists()
    assert (tmp_path / other_args).is_dir() and (tmp_path / other_kind).is_dir()
    disk_cache.cached_dir(new.name, lambda d: built.append(d))  # there: not built again
    assert len(built) == 1
