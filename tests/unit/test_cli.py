"""The command line: help works, eval writes its tables, bad arguments exit 2 and write nothing."""

import pytest
from typer.testing import CliRunner

from countlens.cli import app

runner = CliRunner()


def test_help_of_every_command():
    commands = ("eval", "toy", "toy train", "data countingtricks", "discover", "plan", "classify", "report", "compare")
    commands += ("finetune", "toy plant", "features", "features train")
    for args in (["--help"], *([*c.split(), "--help"] for c in commands)):
        result = runner.invoke(app, args)
        assert result.exit_code == 0 and "Usage" in result.output, args


@pytest.mark.slow  # the eval command end to end
def test_eval_writes_tables(tiny_checkpoint, tmp_path):
    out = tmp_path / "eval"
    result = runner.invoke(app, ["eval", "--model", str(tiny_checkpoint("qwen2_vl")), "--n", "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Counting, per N" in (out / "accuracy.md").read_text()
    assert len((out / "samples.csv").read_text().splitlines()) == 1 + 8 + 2 + 2


@pytest.mark.slow  # the eval command end to end
def test_eval_splits_counting_by_scene_kind(tiny_checkpoint, loaded, tmp_path):
    import pandas as pd

    from countlens.datasets.tasks import task_samples

    out, model = tmp_path / "eval", tiny_checkpoint("qwen2_vl")
    result = runner.invoke(app, ["eval", "--model", str(model), "--n", "40", "--out", str(out)])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out / "samples.csv").query("task == 'count'")
    want = [
        "total (how many objects)"
        if s.meta["shape"] == "any"
        else "named shape among other shapes"
        if s.meta["mixed"]
        else "one shape only"
        for s in task_samples("count", 40, 1, image_size=loaded("qwen2_vl").geometry.image_height)
    ]
    assert df["scene"].tolist() == want and len(set(want)) == 3
    table = (out / "accuracy.md").read_text().split("per scene kind")[1].split("## ")[0]
    rows = {
        cells[0]: cells[1:]
        for line in table.splitlines()
        if line.startswith("| ")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    for kind, group in df[df["count"] <= 10].groupby("scene"):
        assert rows[kind] == [f"{group['correct'].mean():.3f}", str(len(group))]


def test_bad_arguments_exit_2_and_write_nothing(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["eval", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o1")], "never downloads"),
        (["eval", "--seed", "5000", "--out", str(tmp_path / "o2")], "training scenes"),
        (["eval", "--out", str(a_file)], "is a file"),
        (["toy", "train", "--out", str(a_file)], "is a file"),
        (["features", "train", "--out", str(a_file)], "is a file"),
        (["features", "train", "--out", str(tmp_path / "o3"), "--k", "600"], "give k ≤ width"),
        (["features", "train", "--out", str(tmp_path / "o4"), "--steps", "0"], "--steps must be ≥ 1"),
        (["toy", "plant", "--circuit", "nope", "--out", str(tmp_path / "o5")], "value-route"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_data_countingtricks_writes_images_and_manifest(tmp_path):
    out = tmp_path / "tricks"
    args = [
        "data",
        "countingtricks",
        "--out",
        str(out),
        "--cases",
        "1A,12A",
        "--n",
        "3",
        "--image-size",
        "224",
        "--patch-size",
        "14",
        "--workers",
        "1",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 6
    assert len(list(out.rglob("*.png"))) == 6


def test_data_countingtricks_rejects_bad_arguments(tmp_path):
    for extra, message in (
        (["--cases", "1A,99Z"], "unknown COUNTINGTRICKS case"),
        (["--image-size", "12", "--patch-size", "16"], "smaller than --patch-size"),
        (["--prompt", "loud"], "unknown prompt style"),
    ):
        out = tmp_path / "x"
        result = runner.invoke(app, ["data", "countingtricks", "--out", str(out), "--n", "2", *extra])
        assert result.exit_code == 2 and message in result.output, (extra, result.output)
        assert not out.exists()


def test_importing_countlens_and_its_cli_loads_no_torch():
    """--help answers at once and data generation stays light: torch loads only when a command needs it."""
    import subprocess
    import sys

    probe = (
        "import sys, countlens, countlens.cli, countlens.datasets; "
        "print(sorted(m for m in ('torch', 'transformers', 'nnsight') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_option_defaults_are_the_dataclasses():
    """The defaults the options use and their help states are read from the dataclasses they fill."""
    from dataclasses import MISSING, fields

    from countlens.analysis.heads import HeadThresholds
    from countlens.cli import options
    from countlens.pipeline.config import DiscoverConfig
    from countlens.settings import DEFAULT_RECIPE, Recipe
    from countlens.toy.recipe import TrainConfig
    from countlens.training.finetune import FinetuneConfig

    for read, cls in (
        (options.DISCOVER, DiscoverConfig),
        (options.THRESHOLDS, HeadThresholds),
        (options.FINETUNE, FinetuneConfig),
        (options.RECIPE, Recipe),
        (options.TOY_TRAIN, TrainConfig),
    ):
        assert read == {f.name: f.default for f in fields(cls) if f.default is not MISSING}, cls
    # Without --preset, finetune runs countlens's own recipe: the FinetuneConfig defaults its help states.
    for name in ("steps", "batch_size", "lr", "lora_r"):
        assert DEFAULT_RECIPE.config.get(name, options.FINETUNE[name]) == options.FINETUNE[name], name


def test_one_handler_turns_any_countlens_error_into_exit_2(tmp_path, monkeypatch):
    from countlens.errors import RunDirError
    from countlens.pipeline import rundir

    def unreadable(run):
        raise RunDirError(f"{run} says what went wrong")

    monkeypatch.setattr(rundir, "read_spec", unreadable)
    result = runner.invoke(app, ["report", "--run", str(tmp_path)])
    assert result.exit_code == 2 and result.output == f"error: {tmp_path} says what went wrong\n", result.output
    assert not (tmp_path / "report.md").exists()


def test_any_other_exception_is_one_internal_error_line_and_debug_shows_the_traceback(tmp_path, monkeypatch):
    from countlens.pipeline import rundir

    def broken(run):
        raise KeyError("a bug\nover two lines")

    monkeypatch.setattr(rundir, "read_spec", broken)
    result = runner.invoke(app, ["report", "--run", str(tmp_path)])
    assert result.exit_code == 70 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("internal error in countlens") and "`countlens report`" in result.output
    assert "KeyError" in result.output and "countlens --debug report" in result.output
    debug = runner.invoke(app, ["--debug", "report", "--run", str(tmp_path)])
    assert isinstance(debug.exception, KeyError)  # the traceback, unhandled
    monkeypatch.setenv("COUNTLENS_DEBUG", "1")
    assert isinstance(runner.invoke(app, ["report", "--run", str(tmp_path)]).exception, KeyError)


def test_an_interrupted_data_export_resumes_when_the_command_is_rerun(tmp_path, monkeypatch):
    """Ctrl-C: one line saying a rerun resumes; the rerun writes the rest, as an uninterrupted run."""
    from countlens.datasets import export

    real = export.generate

    def interrupted(*args, **kwargs):
        for k, item in enumerate(real(*args, **kwargs)):
            if k == 3:
                raise KeyboardInterrupt
            yield item

    argv = ["data", "countingtricks", "--cases", "1A,4A", "--n", "3", "--workers", "1", "--image-size", "96"]
    argv += ["--patch-size", "16", "--out"]
    monkeypatch.setattr(export, "generate", interrupted)
    stopped = runner.invoke(app, [*argv, str(tmp_path / "a")])
    assert stopped.exit_code == 130 and "interrupted: rerun the same command to resume" in stopped.output
    assert (tmp_path / "a" / "manifest.jsonl.partial").exists() and not (tmp_path / "a" / "manifest.jsonl").exists()
    monkeypatch.setattr(export, "generate", real)
    assert runner.invoke(app, [*argv, str(tmp_path / "a")]).exit_code == 0
    assert runner.invoke(app, [*argv, str(tmp_path / "b")]).exit_code == 0

    def files(root):
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert files(tmp_path / "a") == files(tmp_path / "b")
