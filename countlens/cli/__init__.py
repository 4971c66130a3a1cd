"""The `countlens` command line: every command is a thin call into the packages.

    countlens --help                 # the console script (pyproject's [project.scripts]: `main`)
    python -m countlens.cli --help   # the same, as launchers run it (`__main__`)

`app` holds the command tree and the one error handler every command ends in (`countlens.cli.app`);
`options` fills the options from the settings dataclasses and holds the ones several commands share;
`paths` checks what a command will write before it starts. One module per command group: `model`
(eval, check), `discover` (discover, plan), `report` (classify, report), `compare`, `finetune`, `data`, `toy`.
Importing this package imports no torch, so ``--help`` answers at once: commands import the
packages that do their work when they run.
"""

from countlens.cli.app import app, main

__all__ = ["app", "main"]
