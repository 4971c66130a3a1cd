"""The command tree of `countlens` and the one handler every command ends in.

Any `CountlensError` a command raises, its own checks of the options included, reaches one handler
(`CountlensGroup`): ``error: <message>`` in red on stderr, exit status 2. Every command checks its
options and the files it will read before it writes anything, so a refused run leaves its output as
it found it. A failure of the machine (memory, disk, permissions) is a user's error too, said in one
line. Anything else that escapes a command is a countlens bug: one line (``internal error in
countlens …``, the command, the exception) and exit status 70, with the traceback under ``countlens
--debug …`` (or ``COUNTLENS_DEBUG=1``); Ctrl-C ends with one line saying whether a rerun resumes,
exit status 130.

The commands live one group to a module (`countlens.cli.model`, with ``model tiny``, `discover`, `methods`, `report`,
`compare`, `finetune`, `data`, `toy`, `features`); this module only names them, in the order
``countlens --help`` lists them.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer
from typer.core import TyperGroup

from countlens.cli.compare import compare_cmd
from countlens.cli.data import data_countingtricks
from countlens.cli.discover import discover_cmd, plan_cmd
from countlens.cli.features import features_graph, features_plan, features_train
from countlens.cli.finetune import finetune_cmd
from countlens.cli.methods import methods_cmd
from countlens.cli.model import check_cmd, eval_cmd, tiny_cmd
from countlens.cli.report import classify_cmd, report_cmd
from countlens.cli.toy import toy_plant, toy_train
from countlens.errors import CountlensError

#: Exit statuses: a user's error (bad input or state), a countlens bug (sysexits' EX_SOFTWARE), Ctrl-C.
USER_ERROR, INTERNAL_ERROR, INTERRUPTED = 2, 70, 130
#: Commands that resume where they stopped when rerun with the same options.
RESUMABLE = ("discover", "finetune", "countingtricks")


class CountlensGroup(TyperGroup):
    """A command group whose commands end in one line, never a traceback: a `CountlensError` (bad
    input or state a user can fix) as ``error: <message>`` with exit status 2; Ctrl-C with exit
    status 130; any other exception, a countlens bug, as ``internal error …`` with exit status 70
    (the traceback with ``countlens --debug`` or ``COUNTLENS_DEBUG=1``)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except CountlensError as err:
            typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=USER_ERROR) from None
        except KeyboardInterrupt:
            name = _command(ctx).rsplit(" ", 1)[-1]
            how = (
                "rerun the same command to resume where it stopped"
                if name in RESUMABLE
                else "no progress is saved; rerun the command to start again"
            )
            typer.secho(f"interrupted: {how}", fg=typer.colors.YELLOW, err=True)
            raise typer.Exit(code=INTERRUPTED) from None
        except Exception as err:
            # click's and typer's own (usage errors, exit 2; typer.Exit) are theirs to print, as is a
            # closed pipe (`countlens plan | head`).
            if type(err).__module__.split(".")[0] in ("click", "typer") or isinstance(err, BrokenPipeError):
                raise
            if _debug(ctx):
                raise
            known = _known(err)
            if known:
                typer.secho(f"error: {known}", fg=typer.colors.RED, err=True)
                raise typer.Exit(code=USER_ERROR) from None
            detail = " ".join(str(err).split())  # one line, whatever the exception's text
            typer.secho(
                f"internal error in countlens {_version()} running `{_command(ctx)}`: {type(err).__name__}: "
                f"{detail} — a bug in countlens: please report it with the traceback that `countlens --debug "
                f"{_command(ctx).removeprefix('countlens ')} …` prints",
                fg=typer.colors.RED,
                err=True,
            )
            raise typer.Exit(code=INTERNAL_ERROR) from None


def _known(err: Exception) -> str | None:
    """The one-line message of a failure of the machine rather than of countlens: memory, disk,
    permissions (None for anything else, a bug)."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":  # host, or torch's device
        first = str(err).strip().splitlines()[0] if str(err).strip() else "no detail"
        return f"out of memory ({first}); lower --batch-size, or see what fits with `countlens plan` first"
    if isinstance(err, OSError) and err.errno is not None:
        return _os_error(err)
    return None


def _os_error(err: OSError) -> str:
    """An `OSError`'s one line, with the fix for its cause: a full disk, a missing permission, a path
    whose parent is a file, ... (the file library's own failures arrive here as `OSError` too:
    `countlens.files.machine_error`)."""
    import errno

    name = err.filename
    where = f": {name}" if name else ""
    said = f"{err.strerror or err}{where}"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{said}; the disk (or your quota) is full: free space there, or write elsewhere, then rerun the command"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{said}; fix the permissions there, or write elsewhere, then rerun the command"
    if err.errno in (errno.ENOTDIR, errno.EEXIST) and name:
        blocker = _file_in_the_way(name)
        if blocker is not None:
            return f"{said}; {blocker} is a file, not a folder, so nothing can be made under it: give another path"
    if err.errno == errno.EISDIR and name:
        return f"{said}; it is a folder where a file was expected: give a file path"
    if err.errno == errno.ENOENT and name:
        return f"{said}; it does not exist (moved or deleted meanwhile?): check the path, then rerun the command"
    return f"{said}; the operating system refused it there: fix that, then rerun the command"


def _file_in_the_way(name) -> str | None:
    """The first part of path ``name`` that exists and is not a folder (None when there is none)."""
    from pathlib import Path

    path = Path(str(name))
    for part in reversed([path, *path.parents]):
        if part.exists() and not part.is_dir():
            return str(part)
    return None


def _command(ctx) -> str:
    """The command as typed, e.g. ``countlens data countingtricks`` (its options left out: they may
    name private paths)."""
    names, c = [ctx.invoked_subcommand or ""], ctx
    while c.parent is not None:
        names.append(c.info_name or "")
        c = c.parent
    return " ".join(["countlens", *reversed([n for n in names if n])])


def _debug(ctx) -> bool:
    return bool(ctx.find_root().params.get("debug")) or os.environ.get("COUNTLENS_DEBUG", "") not in ("", "0")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("countlens")
    except PackageNotFoundError:
        return "(not installed)"


app = typer.Typer(cls=CountlensGroup, no_args_is_help=True, help="countlens: counting as a probe of how VLMs reason.")
toy_app = typer.Typer(
    cls=CountlensGroup,
    no_args_is_help=True,
    help="The shipped organisms: train the organism, or plant a circuit in it.",
)
data_app = typer.Typer(cls=CountlensGroup, no_args_is_help=True, help="Generate controlled counting data sets on disk.")

app.command("eval")(eval_cmd)
app.command("discover")(discover_cmd)
app.command("check")(check_cmd)
app.command("plan")(plan_cmd)
app.command("methods")(methods_cmd)
app.command("classify")(classify_cmd)
app.command("report")(report_cmd)
app.command("compare")(compare_cmd)
app.command("finetune")(finetune_cmd)
app.add_typer(toy_app, name="toy")
toy_app.command("train")(toy_train)
toy_app.command("plant")(toy_plant)
app.add_typer(data_app, name="data")
data_app.command("countingtricks")(data_countingtricks)
features_app = typer.Typer(
    cls=CountlensGroup, no_args_is_help=True, help="Below the heads: transcoders of a model's MLPs and their features."
)
app.add_typer(features_app, name="features")
features_app.command("train")(features_train)
features_app.command("graph")(features_graph)
features_app.command("plan")(features_plan)
model_app = typer.Typer(
    cls=CountlensGroup, no_args_is_help=True, help="Models to try countlens on: tiny random-init ones of every family."
)
app.add_typer(model_app, name="model")
model_app.command("tiny")(tiny_cmd)


@app.callback()
def main_options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback of an internal error (also: COUNTLENS_DEBUG=1).")
    ] = False,
) -> None:
    """countlens: counting as a probe of how VLMs reason."""


def main() -> None:
    """The console script `countlens` (and ``python -m countlens.cli``)."""
    app()
