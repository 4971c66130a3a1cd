"""A fuzz test of the command line: every command, every option, hypothesis-chosen values.

For each example hypothesis picks a command, one of its options and a value for it — negative,
zero, huge, NaN, infinite, of the wrong type, or a path to a file, a directory, a missing place or a
place under a file — and the command runs with its other options at their defaults. Whatever the
value, the command must either refuse it (exit status 2; when countlens answers, one ``error:``
line; never a traceback or an internal error) or accept it and get as far as its work, which here
is a stub (`Reached`: loading a model, exporting, training, planning), so that the test stays
bounded; a command whose work is only printing (`PRINT_ONLY`) accepts by exiting 0.
Either way nothing is written: every check runs before the first file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import typer.main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from countlens.cli import app

runner = CliRunner()


class Reached(BaseException):  # noqa: N818 - not an error: the command accepted its options
    """Raised by the stubs: the command checked its options and reached its work."""


def _stub(*args, **kwargs):
    raise Reached


def _commands(group, prefix: tuple[str, ...] = ()) -> dict:
    """Every command of the (typer-built click) group, by its words: ("data", "countingtricks")."""
    out = {}
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group
            out.update(_commands(command, (*prefix, name)))
        else:
            out[(*prefix, name)] = command
    return out


COMMANDS = _commands(typer.main.get_command(app))
OPTIONS = {
    path: [p for p in command.params if p.param_type_name == "option" and p.name != "help"]
    for path, command in COMMANDS.items()
}
CASES = [(path, option.opts[0]) for path, options in OPTIONS.items() for option in options]

#: Values of every kind; "<...>" names a place made fresh for each example.
PLACES = ("<file>", "<dir>", "<missing>", "<under-file>", "<run>")
WORDS = (
    *("-1", "0", "1", "2", "2.5", "-0.5", "1e-3", "nan", "inf", "-inf", "1e400", "99999999999999999999999"),
    *("", " ", "abc", "toy", "cuda", "int8", "bfloat16", "counting-to-four", "L0H0", "1A,1A", "1A,99Z", ",", "-"),
)
VALUES = st.one_of(
    st.sampled_from(WORDS + PLACES),
    st.integers(-(10**12), 10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


def _places(root: Path) -> dict[str, Path]:
    (root / "a_file").write_text("x")
    (root / "a_dir").mkdir()
    run = root / "a_run"
    run.mkdir()
    (run / "spec.json").write_text('{"model": "toy", "arch": "qwen2_vl"}')
    (run / "heads.csv").write_text("head_id,layer,head,class,importance\nL0H0,0,0,other,0.5\n")
    return {
        "<file>": root / "a_file",
        "<dir>": root / "a_dir",
        "<missing>": root / "nowhere" / "deeper",
        "<under-file>": root / "a_file" / "below",
        "<run>": run,
    }


def _argv(path: tuple[str, ...], opt: str, value: str | None, places: dict[str, Path]) -> list[str]:
    """The command with the fuzzed option, and its required options (given their usual places)."""
    required = {
        "--out": places["<missing>"],
        "--run": places["<run>"],
        "--circuit": places["<run>"],
        "--transcoders": places["<dir>"],
        "--family": "gemma3",
    }
    command = COMMANDS[path]
    args = [*path]
    for p in command.params:
        if p.param_type_name == "option" and p.required and p.opts[0] != opt:
            args += [p.opts[0], str(required[p.opts[0]])]
    if value is None:  # a flag
        return [*args, opt]
    return [*args, opt, str(places.get(value, value))]


#: Commands whose whole work is printing (no model, nothing written): accepting a value means exit status 0.
PRINT_ONLY = {("methods",)}


def _listing(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


@pytest.fixture
def stubs(monkeypatch):
    """Each command's work replaced by `Reached`: loading a model (or its config), exporting, training,
    planning, building a tiny model."""
    import countlens
    import countlens.datasets.export
    import countlens.model.loading
    import countlens.pipeline.plan
    import countlens.toy.tiny_models
    import countlens.toy.train

    monkeypatch.setattr(countlens, "load", _stub)
    monkeypatch.setattr(countlens.datasets.export, "export_countingtricks", _stub)
    monkeypatch.setattr(countlens.toy.train, "train", _stub)
    monkeypatch.setattr(countlens.pipeline.plan, "plan", _stub)
    monkeypatch.setattr(countlens.model.loading, "meta_vlm", _stub)
    monkeypatch.setattr(countlens.toy.tiny_models, "save", _stub)
    for name in ("RANK", "WORLD_SIZE", "COUNTLENS_DEBUG"):
        monkeypatch.delenv(name, raising=False)


# Derandomized, as the property tests: CI runs the same examples every time. To explore, set
# COUNTLENS_FUZZ_EXAMPLES (e.g. 5000): that many random examples, a new draw each run.
EXPLORE = os.environ.get("COUNTLENS_FUZZ_EXAMPLES")


@settings(
    max_examples=int(EXPLORE or 250),
    derandomize=EXPLORE is None,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=st.sampled_from(CASES), value=VALUES)
def test_every_option_is_refused_in_one_line_or_accepted_and_nothing_is_written(stubs, case, value):
    path, opt = case
    option = next(p for p in OPTIONS[path] if p.opts[0] == opt)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        places = _places(root)
        argv = _argv(path, opt, None if option.is_flag else value, places)
        before = _listing(root)
        try:
            result = runner.invoke(app, argv)
        except Reached:  # accepted: the command got as far as its (stubbed) work
            result = None
        if result is not None and not (path in PRINT_ONLY and result.exit_code == 0):
            shown = f"countlens {' '.join(argv)}\n{result.output}"
            assert "Traceback" not in result.output and "internal error" not in result.output, shown
            assert result.exit_code == 2, shown
            if result.output.startswith("error:"):
                assert result.output.strip().count("\n") == 0, shown
        assert _listing(root) == before, f"countlens {' '.join(argv)} wrote files"


def test_the_fuzz_covers_every_command_and_option():
    assert {" ".join(p) for p in COMMANDS} >= {
        "eval",
        "discover",
        "check",
        "plan",
        "classify",
        "report",
        "compare",
        "finetune",
        "toy train",
        "data countingtricks",
    }
    assert len(CASES) >= 60  # every option of every command is a case hypothesis can pick
