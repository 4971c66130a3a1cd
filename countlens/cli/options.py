"""The options several commands share, and where option defaults come from.

An option that fills a settings dataclass field takes its default from that dataclass: `defaults`
reads the fields (`dataclasses.fields`) of `DiscoverConfig`, `HeadThresholds`, `FinetuneConfig`,
`Recipe` and the organism's `TrainConfig`, none of whose modules imports torch. An option left
``None`` means "not given": the preset's value, else the dataclass default its help shows
(`shown`); `given` keeps the options given.

The ``classify`` thresholds are one option per `HeadThresholds` field, made from the fields by
`with_threshold_options`: a field added to the dataclass is an option, with its default in the help.
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Annotated

import typer

from countlens.errors import ConfigError
from countlens.pipeline.config import DiscoverConfig
from countlens.settings import FinetuneConfig, HeadThresholds, Recipe
from countlens.toy.schedule import TrainConfig


def defaults(cls: type) -> dict:
    """The field defaults of the dataclass ``cls`` (a field with a ``default_factory`` is left out)."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


DISCOVER = defaults(DiscoverConfig)
THRESHOLDS = defaults(HeadThresholds)
FINETUNE = defaults(FinetuneConfig)
RECIPE = defaults(Recipe)
TOY_TRAIN = defaults(TrainConfig)


def shown(value, none: str = "") -> str:
    """A default as an option's help shows it (0.001, not 1e-03; 0, not 0.0); ``none`` says what a
    default of None means."""
    if value is None:
        return none
    return f"{value:g}" if isinstance(value, float) else str(value)


def given(**values) -> dict:
    """The options given on the command line: those whose value is not None."""
    return {k: v for k, v in values.items() if v is not None}


def check_positive(**values: int | None) -> None:
    """Refuse a count option below 1 (None: not given), naming it as typed (``--batch-size``)."""
    for name, value in values.items():
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")


Model = Annotated[str, typer.Option(help="'toy', a local checkpoint directory, or a cached hub id.")]
Device = Annotated[str | None, typer.Option(help="e.g. cuda; default: where from_pretrained puts it.")]
Dtype = Annotated[str | None, typer.Option(help="e.g. bfloat16.")]
Run = Annotated[Path, typer.Option(help="A `countlens discover` run directory.")]

#: Each `HeadThresholds` field's option: its help, and what its default of None means (if it can be None).
THRESHOLD_HELP: dict[str, tuple[str, str]] = {
    "early": ("Depth (layer / last layer) at or below which a head is early.", ""),
    "late": ("Depth at or above which a head is late (aggregation).", ""),
    "image_high": ("Image-attention share that counts as reading the image.", ""),
    "image_low": ("Image-attention share below which a head ignores the image.", ""),
    "vgs_min": ("Minimum VGS of a visual-grounding head.", ""),
    "cter_min": ("Minimum CTER of routing and aggregation heads.", ""),
    "important": ("Minimum importance (|patching effect|) of routing and aggregation heads.", ""),
    "constant": ("Top-1 constancy of an awareness head.", ""),
    "routing_from": ("Depth from which routing heads may sit.", ""),
    "routing_to": ("Depth below which routing heads sit.", "--late"),
    "align_min": ("Share of samples whose top-1 token is the count, for an aggregation head (0: not tested).", ""),
    "difficulty_min": ("Difficulty-word share that makes an awareness head.", "not tested"),
}


def with_threshold_options(command):
    """``command`` (``def command(run, **thresholds)``) with one ``--<threshold>`` option per
    `HeadThresholds` field after its own parameters, in the fields' order; typer passes them in
    ``thresholds``, None when not given.

    typer reads a command's options from its signature, so the signature is rewritten: the
    thresholds' names come from the dataclass once, not spelled out in the command and again where
    its values are gathered."""
    signature = inspect.signature(command, eval_str=True)  # typer reads resolved annotations
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    options = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[
                float | None,
                typer.Option(
                    help=THRESHOLD_HELP[f.name][0], show_default=shown(THRESHOLDS[f.name], THRESHOLD_HELP[f.name][1])
                ),
            ],
        )
        for f in fields(HeadThresholds)
    ]
    command.__signature__ = signature.replace(parameters=[*own, *options])
    return command
