"""Random edits of a checkpoint's settings files: `countlens.load` either loads the model or refuses
with a `CountlensError` naming the checkpoint — never another exception (which the CLI would call a
bug in countlens).

Each case is one seeded edit of one field of the organism's config.json or
preprocessor_config.json: the field deleted, nulled, made a string, a negative, a zero, doubled, a
list or a non-finite number. A model that loads must still prepare an image (the spec group of
`countlens check` runs the same processor check at load).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

import countlens
from countlens.errors import CountlensError
from countlens.model.shipped import TOY_DIR

FILES = ("config.json", "preprocessor_config.json")
CASES = 20


def _leaves(value, path=()):
    """Every (key path) of a JSON object's scalar or list fields."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _leaves(inner, (*path, key))
    else:
        yield path


def _mutate(value, rng: random.Random):
    kinds = ["delete", None, "x", -1, 0, "double", [], float("nan")]
    kind = rng.choice(kinds)
    if kind == "double":
        return value * 2 if isinstance(value, (int, float)) and not isinstance(value, bool) else "double"
    return kind


def _edit(where: Path, seed: int) -> str:
    """One seeded edit of one field of one settings file under ``where``; what it did, for the report."""
    rng = random.Random(seed)
    file = where / rng.choice(FILES)
    data = json.loads(file.read_text())
    path = rng.choice(sorted(_leaves(data), key=str))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    new = _mutate(parent[path[-1]], rng)
    if new == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    file.write_text(json.dumps(data))  # NaN is written as JSON's NaN literal, as Python's json reads it
    return f"{file.name}: {'.'.join(path)} → {new!r}"


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    made = []
    for seed in range(CASES):
        where = root / f"case_{seed}"
        shutil.copytree(TOY_DIR, where, ignore=shutil.ignore_patterns("train_log.jsonl"))
        made.append((where, _edit(where, seed)))
    return made


@pytest.mark.parametrize("seed", range(CASES))
def test_an_edited_checkpoint_loads_or_is_refused_by_name(copies, seed):
    where, edit = copies[seed]
    try:
        vlm = countlens.load(where)
    except CountlensError as err:
        assert str(where) in str(err) or "config.json" in str(err) or "preprocessor_config" in str(err), (edit, err)
        return
    except Exception as err:  # noqa: BLE001 — the test's point: no other exception type
        pytest.fail(f"{edit}: {type(err).__name__}: {err}")
    from PIL import Image

    g = vlm.geometry
    batch = vlm.prepare([Image.new("RGB", (g.image_width, g.image_height))], ["how many?"])
    assert len(batch.image_pos[0]) == g.token_grid[0] * g.token_grid[1], edit
