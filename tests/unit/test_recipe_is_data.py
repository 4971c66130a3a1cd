"""A recipe is data: nothing read from a file makes countlens call anything but a data generator.

Every generated sample carries its recipe (`countlens.datasets.recipe`), and every saved result carries
its samples' recipes in its ``data_recipe`` attr, so a recipe is read back from files anyone can edit.
`rebuild` calls only the generators of the allow-list `GENERATORS`, kept beside the `recorded` wrapper,
with the arguments their signatures name, each plain JSON data; a recipe of another countlens version
or schema, or one written before recipes carried them, is refused naming what differs. Elsewhere, no
class or callable is looked up by a name read from a file, and no file is unpickled.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import xarray as xr

import countlens
import countlens.datasets as datasets
from countlens.datasets import count_pairs, rebuild, task_samples
from countlens.datasets.recipe import GENERATORS, RECIPE_SCHEMA, _generator
from countlens.errors import CheckpointError, InputError
from countlens.results import load, provenance, save

ROOT = Path(countlens.__file__).parent


@pytest.fixture(scope="module")
def recipe() -> dict:
    return task_samples("count", 1, seed=3)[0].recipe


def test_a_recipe_naming_anything_but_a_data_generator_calls_nothing(tmp_path):
    """An edited file's recipe that names a countlens function that writes is refused before it runs
    (before the fix, this one created ``made`` and wrote its owner marker there)."""
    target = tmp_path / "made"
    edited = {"generator": "countlens.files.claim_directory", "out": str(target), "command": "x", "spec": {}}
    with pytest.raises(InputError, match="no registered data generator"):
        rebuild(edited)
    for name in ("countlens.files.write_text", "countlens.datasets.recipe.rebuild", "os.system", 3):
        with pytest.raises(InputError, match="no registered data generator"):
            rebuild({"generator": name, "path": str(target)})
    assert not target.exists()


def test_a_recipe_in_a_saved_file_is_checked_when_rebuilt(tmp_path):
    """The recipe travels in a result's attrs; one edited there is refused, one as written rebuilds."""
    samples = task_samples("count", 2, seed=5)
    result = xr.DataArray([0.5, 0.25], dims="sample", attrs=provenance("toy", "qwen2_vl", samples=samples))
    save(result, tmp_path / "r.nc")
    entry = json.loads(load(tmp_path / "r.nc").attrs["data_recipe"])[0]
    assert rebuild({**entry, "index": entry["index"][0][1]}).scene == samples[1].scene
    with pytest.raises(InputError, match="no registered data generator"):
        rebuild({**entry, "generator": "countlens.results.save", "index": 0})


def test_arguments_are_those_the_generator_takes_and_plain_data(recipe):
    with pytest.raises(InputError, match=r"arguments \['out'\] it does not take"):
        rebuild({**recipe, "out": "/tmp/somewhere"})
    with pytest.raises(InputError, match=r"no \['seed'\], which it needs"):
        rebuild({k: v for k, v in recipe.items() if k != "seed"})
    with pytest.raises(InputError, match="plain JSON data"):
        rebuild({**recipe, "size_range": [0.1, float("nan")]})
    pair = count_pairs(1, 3, 5, image_size=64, seed=1)[0].clean.recipe
    with pytest.raises(InputError, match=r"grid fields \['path'\]"):
        rebuild({**pair, "grid": {"image_height": 64, "image_width": 64, "patch_size": 16, "path": "/tmp/x"}})


def test_a_recipe_of_another_version_or_schema_is_refused_naming_both(recipe):
    ours = re.escape(countlens.__version__)
    with pytest.raises(InputError, match=rf"countlens version '0\.0\.1', this one's '{ours}'"):
        rebuild({**recipe, "countlens_version": "0.0.1"})
    with pytest.raises(InputError, match=rf"recipe schema {RECIPE_SCHEMA + 1}, this one's {RECIPE_SCHEMA}"):
        rebuild({**recipe, "recipe_schema": RECIPE_SCHEMA + 1})
    old = {k: v for k, v in recipe.items() if k not in ("countlens_version", "recipe_schema")}
    with pytest.raises(InputError, match="written before recipes carried them"):
        rebuild(old)  # a recipe as countlens wrote it before they carried a version


def test_every_registered_generator_rebuilds_its_own_recipe_and_writes_nothing():
    """The allow-list: each generator is recorded (its module's import registers it), takes no path,
    and a recipe this version wrote makes its sample again."""
    suspicious = re.compile(r"path|dir|out|file|folder|root")
    for name in sorted(GENERATORS):
        fn = _generator(name)
        params = inspect.signature(fn).parameters
        assert not [p for p in params if suspicious.search(p)], f"{name} takes a path: {list(params)}"
    s = task_samples("count", 1, seed=2)[0]
    assert rebuild(s.recipe).scene == s.scene and s.recipe["recipe_schema"] == RECIPE_SCHEMA


def test_rebuild_is_public_and_documented():
    assert "rebuild" in datasets.__all__ and datasets.rebuild is rebuild
    assert "GENERATORS" in rebuild.__doc__ and "data_recipe" in rebuild.__doc__


def test_an_image_processor_type_read_from_a_file_must_name_an_image_processor(tmp_path):
    """A checkpoint's preprocessor_config.json names a class; any other transformers name is refused."""
    from countlens.model.processor_files import _load_image_processor

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "GenerationConfig"}))
    with pytest.raises(CheckpointError, match="no image processor class"):
        _load_image_processor(str(tmp_path))


def test_no_file_is_unpickled_and_no_name_read_is_imported():
    """Source scan: torch.load only with weights_only=True; import_module only where the name is ours (or,
    in model/adapt.py, the module of a loaded model's own attention class: its eager attention function)."""
    ours = {"__init__.py", "datasets/recipe.py", "model/adapt.py"}
    for path in ROOT.rglob("*.py"):
        text, where = path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix()
        assert "weights_only=False" not in text and "pickle.load" not in text, where
        if re.search(r"import_module\(|__import__\(", text):
            assert where in ours, f"{where} imports by a name; only {sorted(ours)} may (their names are countlens's)"


def test_a_recipe_naming_a_generator_by_its_former_module_rebuilds_the_same_sample():
    """A generator that moved keeps its recipes: the former name is looked up in `RENAMED` (data)."""
    from countlens.datasets.paper_generator import reference_grid, reference_sample
    from countlens.datasets.recipe import RENAMED

    sample = reference_sample("1A", 0, 0, reference_grid())
    old = next(k for k, v in RENAMED.items() if v == sample.recipe["generator"])
    assert rebuild({**sample.recipe, "generator": old}).scene == sample.scene
    assert all(new in GENERATORS for new in RENAMED.values())
