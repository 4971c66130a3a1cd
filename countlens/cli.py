"""The `countlens` command line: every command is a thin call into the packages.

Options are typer's ``Annotated`` parameters. An option that fills a dataclass field takes its
default from that dataclass (`_defaults`); one left ``None`` means "not given": the preset's value,
else the dataclass default its help shows. Any `CountlensError` a command raises, its own checks of
the options included, reaches one handler (`CountlensGroup`): ``error: <message>`` in red on stderr,
exit status 2. Every command checks its options and the files it will read before it writes
anything, so a refused run leaves its output as it found it. Anything else that escapes a command is
a countlens bug: one line (``internal error in countlens …``, the command, the exception) and exit
status 70, with the traceback under ``countlens --debug …`` (or ``COUNTLENS_DEBUG=1``); Ctrl-C ends
with one line saying whether a rerun resumes, exit status 130.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from countlens.errors import ConfigError, CountlensError, RunDirError
from countlens.validate import require_image_side

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
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror or err}{where}; free space or fix the permissions there, then rerun the command"
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
    import os

    return bool(ctx.find_root().params.get("debug")) or os.environ.get("COUNTLENS_DEBUG", "") not in ("", "0")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("countlens")
    except PackageNotFoundError:
        return "(not installed)"


app = typer.Typer(cls=CountlensGroup, no_args_is_help=True, help="countlens: counting as a probe of how VLMs reason.")
toy_app = typer.Typer(
    cls=CountlensGroup, no_args_is_help=True, help="The shipped model organism: train it from scratch."
)
app.add_typer(toy_app, name="toy")
data_app = typer.Typer(cls=CountlensGroup, no_args_is_help=True, help="Generate controlled counting data sets on disk.")
app.add_typer(data_app, name="data")


@app.callback()
def main_options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback of an internal error (also: COUNTLENS_DEBUG=1).")
    ] = False,
) -> None:
    """countlens: counting as a probe of how VLMs reason."""


def _defaults(where: str) -> dict:
    """The field defaults of the dataclass ``where`` ("countlens.module:Class"), read from its source.

    Reading the class instead of importing its module keeps ``--help`` light: `FinetuneConfig`'s and
    `HeadThresholds`' modules import torch. A field without a literal default (a ``default_factory``)
    is left out; the tests check the result against `dataclasses.fields` of the imported class."""
    module, name = where.split(":")
    path = Path(__file__).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    body = next(
        node.body for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef) and node.name == name
    )
    out = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            try:
                out[node.target.id] = ast.literal_eval(node.value)
            except ValueError:  # field(default_factory=...)
                pass
    return out


def _shown(value, none: str = "") -> str:
    """A default as an option's help shows it (0.001, not 1e-03; 0, not 0.0); ``none`` says what a
    default of None means."""
    if value is None:
        return none
    return f"{value:g}" if isinstance(value, float) else str(value)


DISCOVER = _defaults("countlens.pipeline.config:DiscoverConfig")
THRESHOLDS = _defaults("countlens.analysis.heads:HeadThresholds")
FINETUNE = _defaults("countlens.training.finetune:FinetuneConfig")
RECIPE = _defaults("countlens.training.recipe:Recipe")
TOY_TRAIN = _defaults("countlens.toy.recipe:TrainConfig")

Model = Annotated[str, typer.Option(help="'toy', a local checkpoint directory, or a cached hub id.")]
Device = Annotated[str | None, typer.Option(help="e.g. cuda; default: where from_pretrained puts it.")]
Dtype = Annotated[str | None, typer.Option(help="e.g. bfloat16.")]
Run = Annotated[Path, typer.Option(help="A `countlens discover` run directory.")]


def _check_out(out: Path | None, flag: str = "--out") -> None:
    """Refuse an output directory that cannot be written, before any model loads; writes nothing."""
    import os

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


def _check_file_out(path: Path | None, flag: str) -> None:
    """Refuse a file to write (e.g. ``--json``) that cannot be written, before any work; writes nothing."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file path")
    _check_out(path.parent, f"{flag} {path}: its folder")


def _check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")


@toy_app.command("train")
def toy_train(
    out: Annotated[Path, typer.Option(help="Directory to write the HF checkpoint, recipe and training log into.")],
    seed: Annotated[int, typer.Option(help="Seed of the initialisation and of the training scenes.")] = TOY_TRAIN[
        "seed"
    ],
    steps: Annotated[
        int | None,
        typer.Option(
            help="Override the recipe's number of steps (e.g. for a quick check).",
            show_default=_shown(TOY_TRAIN["steps"]),
        ),
    ] = None,
) -> None:
    """Train the organism deterministically (about 25 min on 2 CPU cores).

    Example: countlens toy train --seed 0 --out runs/toy-model
    """
    from dataclasses import replace

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from countlens.toy.recipe import ToyConfig, TrainConfig
    from countlens.toy.train import train

    _check_out(out)
    tc = TrainConfig(seed=seed)
    if steps is not None:
        tc = replace(tc, steps=steps)  # TrainConfig checks its ranges: before anything is written
    with Progress(
        TextColumn("training"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} {task.fields[info]}"),
        TimeElapsedColumn(),
    ) as bar:
        task = bar.add_task("train", total=tc.steps, info="")

        def report(row: dict) -> None:
            bar.update(
                task,
                completed=row["step"] + 1,
                info=f"loss {row['loss']:.3f}"
                + (f" held-out {row['held_out_acc']:.3f}" if "held_out_acc" in row else ""),
            )

        last = train(out, ToyConfig(), tc, progress=report)
    typer.echo(f"saved to {out}: {last}")


@app.command("eval")
def eval_cmd(
    model: Model = "toy",
    out: Annotated[
        Path | None, typer.Option(help="Directory for samples.csv and accuracy.md (nothing written if omitted).")
    ] = None,
    n: Annotated[int, typer.Option(help="Counting scenes to score (each other task gets n/4).")] = 600,
    seed: Annotated[int, typer.Option(help="Evaluation seed (< 1000: never a training seed of the organism).")] = 1,
    batch_size: Annotated[int, typer.Option()] = 32,
    device: Device = None,
    dtype: Dtype = None,
) -> None:
    """Score a model on held-out task scenes: accuracy per task and, for counting, per count.

    Example: countlens eval --model toy --out runs/eval
    """
    import numpy as np

    import countlens
    from countlens.analysis import accuracy, score
    from countlens.datasets.tasks import TASKS, TRAIN_SEED_BASE, scene_kind, task_samples

    _check_out(out)
    _check_positive(n=n, batch_size=batch_size)
    if not 0 <= seed < TRAIN_SEED_BASE:
        raise ConfigError(
            f"--seed {seed}: evaluation seeds are 0..{TRAIN_SEED_BASE - 1}; larger ones are the "
            "organism's training scenes"
        )
    vlm = countlens.load(model, dtype=dtype, device_map=device)
    size = vlm.geometry.image_height
    samples = task_samples("count", n, seed, image_size=size)
    samples += [s for t in TASKS if t != "count" for s in task_samples(t, max(1, n // 4), seed, image_size=size)]
    ds = score(vlm, samples, batch_size=batch_size, progress=True)
    ds = ds.assign(scene=("sample", np.array([scene_kind(s) for s in samples], dtype=object)))
    by_task = accuracy(ds, "task")
    counting = ds.where(ds.task == "count", drop=True)
    up_to_ten = counting.where(counting["count"] <= 10, drop=True)
    by_scene = accuracy(up_to_ten, "scene")
    by_count = accuracy(counting, "count")
    by_count.index = by_count.index.astype(int)
    upto10 = float(up_to_ten.correct.mean())
    text = (
        f"# Held-out accuracy of {model} (seed {seed})\n\n"
        f"Counting, N ≤ 10: **{upto10:.3f}**\n\n## Per task\n\n{by_task.to_markdown(floatfmt=('g', '.3f', 'g'))}\n\n"
        f"## Counting with N ≤ 10, per scene kind\n\n{by_scene.to_markdown(floatfmt=('g', '.3f', 'g'))}\n\n"
        f"## Counting, per N\n\n{by_count.to_markdown(floatfmt=('g', '.3f', 'g'))}\n"
    )
    typer.echo(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        ds.to_dataframe().to_csv(out / "samples.csv")
        (out / "accuracy.md").write_text(text)


def _grid(model: str, image_size: int | None, patch_size: int | None):
    """The patch grid from plain numbers, the organism's recipe (no weights needed) or a loaded model."""
    from countlens.geometry import Geometry

    if (image_size is None) != (patch_size is None):
        raise ConfigError("give both --image-size and --patch-size, or neither (the model's grid)")
    if image_size is not None:
        if image_size < 1 or patch_size < 1:
            raise ConfigError(f"--image-size {image_size} and --patch-size {patch_size} must be positive pixel sizes")
        require_image_side(image_size, "--image-size", ConfigError)
        if image_size < patch_size:
            raise ConfigError(f"--image-size {image_size} is smaller than --patch-size {patch_size}")
        return Geometry.data_grid(image_size, patch_size)
    if model == "toy":
        from countlens.toy.recipe import ToyConfig

        return ToyConfig().geometry
    import countlens

    return countlens.load(model).geometry


@data_app.command("countingtricks")
def data_countingtricks(
    out: Annotated[Path, typer.Option(help="Directory for images/<case>/*.png and manifest.jsonl.")],
    cases: Annotated[str | None, typer.Option(help="Comma-separated cases, e.g. 1A,4A,9B (default: all 32).")] = None,
    n: Annotated[int, typer.Option(help="Samples per case.")] = 1000,
    seed: Annotated[int, typer.Option()] = 0,
    model: Annotated[
        str | None,
        typer.Option(
            help="Model whose patch grid places the objects.",
            show_default="toy; --design paper-code: the code's 384 px / 27 px",
        ),
    ] = None,
    image_size: Annotated[
        int | None, typer.Option(help="Plain grid instead of a model's: image side in pixels.")
    ] = None,
    patch_size: Annotated[
        int | None, typer.Option(help="Plain grid instead of a model's: patch side in pixels.")
    ] = None,
    shapes: Annotated[
        str, typer.Option(help="Comma-separated shapes the samples cycle through.")
    ] = "circle,square,triangle",
    color: Annotated[
        str, typer.Option(help="Object colour, or several comma-separated (one drawn per object).")
    ] = "red",
    prompt: Annotated[
        str,
        typer.Option(
            help="Prompt style: std (the papers' Pstd, answers 'circle: 7'), number "
            "(number only), objects, short, conflict or number_conflict "
            "(Digit-in-Conflict)."
        ),
    ] = "std",
    workers: Annotated[
        int | None, typer.Option(help="Processes (default: all cores); output is identical for any number.")
    ] = None,
    counts: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated counts the samples cycle through (default: 3…12, as the grid allows), e.g. 3,4,5."
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(help="Replace a previous export in --out (only its images, manifest and export.json)."),
    ] = False,
    design: Annotated[
        str,
        typer.Option(
            help="countlens (its 32 cases) or paper-code (the MAS paper generator's 18 red-circle cases, "
            "counts 1-10, layouts shared across cases; its grid: --image-size 384 --patch-size 27)."
        ),
    ] = "countlens",
) -> None:
    """Write COUNTINGTRICKS images and a manifest with every object's geometry.

    Example: countlens data countingtricks --out runs/tricks --cases 1A,4A,9B --n 100
    """
    from rich.progress import Progress

    from countlens.datasets.countingtricks import CASES
    from countlens.datasets.export import check_export, export_countingtricks

    _check_out(out)
    _check_positive(n=n, workers=workers)
    try:
        wanted = None if counts is None else tuple(int(x) for x in counts.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--counts {counts!r}: give comma-separated integers, e.g. 3,4,5") from None
    if design == "paper-code" and model is None and image_size is None and patch_size is None:
        from countlens.datasets.paper_code_tricks import code_grid

        grid = code_grid()  # the code's own grid
    else:
        grid = _grid(model or "toy", image_size, patch_size)
    if design == "paper-code":
        from countlens.datasets.paper_code_tricks import CODE_CASES

        if wanted is not None or shapes not in ("circle", "circle,square,triangle") or "," in color:
            raise ConfigError(
                "--design paper-code draws one colour of circles at the code's counts (1-10); "
                "leave --counts and --shapes out and give one --color"
            )
        names = list(CODE_CASES) if cases is None else [c.strip() for c in cases.split(",") if c.strip()]
        kw = dict(color=color, prompt=prompt, design=design)
    elif design == "countlens":
        names = list(CASES) if cases is None else [c.strip() for c in cases.split(",") if c.strip()]
        kw = dict(shapes=tuple(shapes.split(",")), color=tuple(color.split(",")), prompt=prompt, counts=wanted)
    else:
        raise ConfigError(f"--design {design!r}: use countlens or paper-code")
    check_export(out, names, n, grid, seed, workers, overwrite, **kw)  # before the progress bar
    with Progress() as bar:
        task = bar.add_task("countingtricks", total=len(names) * n)
        manifest = export_countingtricks(
            out,
            names,
            n,
            grid,
            seed,
            workers,
            overwrite=overwrite,
            progress=lambda k: bar.update(task, completed=k),
            log=typer.echo,
            **kw,
        )
    typer.echo(f"{manifest}: {len(names) * n} images")


def _given(**values) -> dict:
    """The options given on the command line: those whose value is not None."""
    return {k: v for k, v in values.items() if v is not None}


def _discover_config(preset: str | None, **values):
    """A DiscoverConfig from the flags given (None: not given): over the preset's values, if any,
    else over the defaults."""
    from countlens.pipeline import presets
    from countlens.pipeline.config import DiscoverConfig

    given = _given(**values)
    return presets.discover_config(preset, **given) if preset else DiscoverConfig(**given)


# DiscoverConfig fields that a preset may set: None (not given) leaves them to the preset, else to
# the DiscoverConfig default the help shows.
NPerCase = Annotated[
    int | None, typer.Option(help="COUNTINGTRICKS samples per case.", show_default=_shown(DISCOVER["n_per_case"]))
]
NPairs = Annotated[
    int | None, typer.Option(help="Clean/corrupt pairs for patching.", show_default=_shown(DISCOVER["n_pairs"]))
]
NSamples = Annotated[
    int | None,
    typer.Option(
        help="Samples per task for lenses, attention and ablation.", show_default=_shown(DISCOVER["n_samples"])
    ),
]
Prompt = Annotated[
    str | None,
    typer.Option(
        help="Prompt style: auto (short for toy, std otherwise), std (the papers' Pstd), number, objects, short.",
        show_default=_shown(DISCOVER["prompt"]),
    ),
]
BatchSize = Annotated[int, typer.Option()]
Tasks = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated tasks mean-ablated and compared by Jaccard, count first: count, color, shape, "
        "math, spatial (the counting-circuits preset: count,math,spatial,color).",
        show_default=",".join(DISCOVER["tasks"]),
    ),
]


def _tasks(tasks: str | None) -> tuple[str, ...] | None:
    """``--tasks`` as DiscoverConfig's tuple (None: not given); the names are checked there."""
    return None if tasks is None else tuple(t.strip() for t in tasks.split(",") if t.strip())


@app.command("discover")
def discover_cmd(
    out: Annotated[Path, typer.Option(help="Run directory: results/, figures/, heads.csv and report.md go here.")],
    model: Model = "toy",
    preset: Annotated[
        str | None,
        typer.Option(
            help="A paper's protocol: counting-circuits or counting-to-four "
            "(countlens.pipeline.presets); the flags below override it."
        ),
    ] = None,
    n_per_case: NPerCase = None,
    n_pairs: NPairs = None,
    n_samples: NSamples = None,
    seed: Annotated[int, typer.Option()] = DISCOVER["seed"],
    prompt: Prompt = None,
    tasks: Tasks = None,
    math: Annotated[
        Path | None, typer.Option(help="A local MathVista copy (testmini parquet / JSON) for the math task.")
    ] = None,
    spatial: Annotated[Path | None, typer.Option(help="A local CLEVR root for the spatial task.")] = None,
    evaluate: Annotated[
        str | None,
        typer.Option(
            help="How COUNTINGTRICKS and Digit-in-Conflict answers are read: score (candidate answers' "
            "log-probability) or generate (greedy answers parsed as the papers do; the report gives the "
            "unparsed share).",
            show_default=DISCOVER["evaluate"],
        ),
    ] = None,
    voc: Annotated[
        Path | None,
        typer.Option(
            help="A local VOC2007 folder: adds the MAS paper's detection probes (its recipe, its three taps), "
            "trained on trainval and scored on test (counting-to-four runs them on scenes without it)."
        ),
    ] = None,
    batch_size: BatchSize = DISCOVER["batch_size"],
    device: Device = None,
    dtype: Dtype = None,
    remote: Annotated[bool, typer.Option(help="Run traces on NDIF (needs a hub id and an NDIF key).")] = False,
) -> None:
    """Find the counting circuit: COUNTINGTRICKS, VAP, head patching, AtP, logit lens, HeadLens,
    head classes, mean ablation across tasks, head temperature; writes report.md. Resumable.

    Example: countlens discover --model toy --out runs/toy
    """
    import countlens
    from countlens import distributed
    from countlens.datasets.prompts import PAIR_PROMPTS
    from countlens.pipeline.discover import check, discover
    from countlens.pipeline.rundir import check_run_dir

    _check_out(out)
    check_run_dir(out)
    distributed.current()  # the launcher's RANK / WORLD_SIZE, if any, make sense
    if prompt is not None and prompt != "auto" and prompt not in PAIR_PROMPTS:
        raise ConfigError(f"--prompt {prompt!r}: use auto or one of {', '.join(PAIR_PROMPTS)}")
    _check_positive(n_per_case=n_per_case, n_pairs=n_pairs, n_samples=n_samples, batch_size=batch_size)
    config = _discover_config(
        preset,
        seed=seed,
        batch_size=batch_size,
        n_per_case=n_per_case,
        n_pairs=n_pairs,
        n_samples=n_samples,
        prompt=prompt,
        tasks=_tasks(tasks),
        math=None if math is None else str(math.resolve()),  # absolute: a resume from elsewhere reads it
        spatial=None if spatial is None else str(spatial.resolve()),
        evaluate=evaluate,
        voc=None if voc is None else str(voc.resolve()),
        probes=True if voc is not None else None,
    )
    check(config)  # before the model loads
    vlm = countlens.load(model, dtype=dtype, device_map=device, remote=remote)
    if not remote:  # the spec and image checks of `countlens check` (read-only), before any stage
        from countlens.pipeline.check import require

        require(vlm)
    report = discover(vlm, out, config, log=typer.echo)
    typer.echo(f"report: {report}")


@app.command("check")
def check_cmd(
    model: Model = "toy",
    device: Device = None,
    dtype: Dtype = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the table as JSON here.")] = None,
) -> None:
    """Prove that countlens reads this checkpoint right: the spec, the image-token layout, the
    answers, the interventions' invariants and the memory plan, one row per check (read-only).
    Exits 1 when a check fails.

    Example: countlens check --model /models/Qwen2.5-VL-7B-Instruct --device cuda --dtype bfloat16
    """
    import json

    import countlens
    from countlens.pipeline.check import as_json, check, failed, table

    _check_file_out(json_out, "--json")
    vlm = countlens.load(model, dtype=dtype, device_map=device)
    rows = check(vlm)
    typer.echo(table(rows))
    if json_out is not None:
        json_out.write_text(json.dumps(as_json(rows), indent=1))
    bad = failed(rows)
    typer.echo(f"{len(rows) - len(bad)} of {len(rows)} checks passed or skipped; {len(bad)} failed")
    if bad:
        raise typer.Exit(1)


@app.command("plan")
def plan_cmd(
    model: Annotated[
        str,
        typer.Option(
            help="'toy', a local checkpoint directory (its config and processor are "
            "read; no weights), or a cached hub id."
        ),
    ] = "toy",
    image_size: Annotated[
        int | None,
        typer.Option(help="Square image side in pixels (dynamic-resolution processors); default: the processor's."),
    ] = None,
    memory: Annotated[
        float | None,
        typer.Option(
            help="The device's memory in GiB (e.g. 141 for an H200); default: this machine's available memory."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="Where discover would run: cpu or cuda.")] = "cpu",
    dtype: Annotated[str | None, typer.Option(help="e.g. bfloat16; default: the checkpoint's.")] = None,
    preset: Annotated[str | None, typer.Option(help="Plan a preset's run (as `countlens discover --preset`).")] = None,
    n_per_case: NPerCase = None,
    n_pairs: NPairs = None,
    n_samples: NSamples = None,
    prompt: Prompt = None,
    tasks: Tasks = None,
    batch_size: BatchSize = DISCOVER["batch_size"],
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the plan as JSON here.")] = None,
) -> None:
    """Plan `countlens discover` before running it: per stage, its forwards, rows per stacked
    forward, peak memory and FLOPs, for the given image size, batch and device memory.

    Example: countlens plan --model runs/qwen2.5-vl-7b --image-size 448 --memory 141 --device cuda --dtype bfloat16
    """
    import json
    import math

    from countlens.loading import meta_vlm
    from countlens.pipeline import plan

    _check_positive(
        image_size=image_size, n_per_case=n_per_case, n_pairs=n_pairs, n_samples=n_samples, batch_size=batch_size
    )
    if image_size is not None:
        require_image_side(image_size, "--image-size", ConfigError)
    if memory is not None and not (memory > 0 and math.isfinite(memory)):
        raise ConfigError(f"--memory must be a finite number of GiB > 0, got {memory}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: plan for 'cpu' or 'cuda'")
    _check_file_out(json_out, "--json")
    config = _discover_config(
        preset,
        batch_size=batch_size,
        n_per_case=n_per_case,
        n_pairs=n_pairs,
        n_samples=n_samples,
        prompt=prompt,
        tasks=_tasks(tasks),
    )
    vlm = meta_vlm(model, dtype=dtype, image_size=image_size)
    p = plan.plan(vlm, config, memory=None if memory is None else int(memory * 2**30), device=device)
    gib = 2**30
    typer.echo(
        f"{p.model} on {p.device} with {p.memory / gib:.1f} GiB: weights {p.widths.weight_bytes / gib:.2f} GiB, "
        f"runtime {p.base / gib:.2f} GiB, {p.image_size} px images ({p.patches} patches each); "
        f"batch {batch_size}"
    )
    typer.echo(p.table().to_markdown())
    for s in p.stages:
        for note in s.notes:
            typer.echo(f"{s.name}: {note}")
    over = p.over()
    if over:
        typer.echo(f"over {p.memory / gib:.1f} GiB: {', '.join(over)}; lower --batch-size or give a larger device")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(p.to_dict(), indent=1) + "\n")


@app.command("classify")
def classify_cmd(
    run: Run,
    early: Annotated[
        float | None,
        typer.Option(
            help="Depth (layer / last layer) at or below which a head is early.",
            show_default=_shown(THRESHOLDS["early"]),
        ),
    ] = None,
    late: Annotated[
        float | None,
        typer.Option(
            help="Depth at or above which a head is late (aggregation).", show_default=_shown(THRESHOLDS["late"])
        ),
    ] = None,
    image_high: Annotated[
        float | None,
        typer.Option(
            help="Image-attention share that counts as reading the image.",
            show_default=_shown(THRESHOLDS["image_high"]),
        ),
    ] = None,
    image_low: Annotated[
        float | None,
        typer.Option(
            help="Image-attention share below which a head ignores the image.",
            show_default=_shown(THRESHOLDS["image_low"]),
        ),
    ] = None,
    vgs_min: Annotated[
        float | None,
        typer.Option(help="Minimum VGS of a visual-grounding head.", show_default=_shown(THRESHOLDS["vgs_min"])),
    ] = None,
    cter_min: Annotated[
        float | None,
        typer.Option(
            help="Minimum CTER of routing and aggregation heads.", show_default=_shown(THRESHOLDS["cter_min"])
        ),
    ] = None,
    important: Annotated[
        float | None,
        typer.Option(
            help="Minimum importance (|patching effect|) of routing and aggregation heads.",
            show_default=_shown(THRESHOLDS["important"]),
        ),
    ] = None,
    constant: Annotated[
        float | None,
        typer.Option(help="Top-1 constancy of an awareness head.", show_default=_shown(THRESHOLDS["constant"])),
    ] = None,
    routing_from: Annotated[
        float | None,
        typer.Option(help="Depth from which routing heads may sit.", show_default=_shown(THRESHOLDS["routing_from"])),
    ] = None,
    routing_to: Annotated[
        float | None,
        typer.Option(
            help="Depth below which routing heads sit.", show_default=_shown(THRESHOLDS["routing_to"], none="--late")
        ),
    ] = None,
    align_min: Annotated[
        float | None,
        typer.Option(
            help="Share of samples whose top-1 token is the count, for an aggregation head (0: not tested).",
            show_default=_shown(THRESHOLDS["align_min"]),
        ),
    ] = None,
    difficulty_min: Annotated[
        float | None,
        typer.Option(
            help="Difficulty-word share that makes an awareness head.",
            show_default=_shown(THRESHOLDS["difficulty_min"], none="not tested"),
        ),
    ] = None,
) -> None:
    """Re-classify a run's heads with other thresholds; rewrites heads.csv / .md / .tex and report.md.
    Thresholds not given keep the run's (its preset's, else the defaults in brackets).

    Example: countlens classify --run runs/toy --cter-min 0.6
    """
    from countlens.analysis.heads import export_heads, head_table
    from countlens.pipeline.presets import thresholds as preset_thresholds
    from countlens.pipeline.report import write_report
    from countlens.pipeline.rundir import load_run, read_spec

    given = _given(
        early=early,
        late=late,
        image_high=image_high,
        image_low=image_low,
        vgs_min=vgs_min,
        cter_min=cter_min,
        important=important,
        constant=constant,
        routing_from=routing_from,
        routing_to=routing_to,
        align_min=align_min,
        difficulty_min=difficulty_min,
    )
    spec = read_spec(run)
    thresholds = preset_thresholds(spec.get("preset", ""), **given)  # their ranges, before the results are read
    r = load_run(run)
    table = head_table(r["heads"], r["ablation"], r["headlens"], r["attention"], thresholds)
    export_heads(table, run)
    write_report(spec["model"], spec["arch"], run, table=table)
    typer.echo(table["class"].value_counts().to_string())


@app.command("report")
def report_cmd(run: Run) -> None:
    """Re-render a run's figures and report.md from its saved results.

    Example: countlens report --run runs/toy
    """
    from countlens.pipeline.report import write_report
    from countlens.pipeline.rundir import read_spec

    spec = read_spec(run)
    path = write_report(spec["model"], spec["arch"], run)
    typer.echo(f"report: {path}")


@app.command("finetune")
def finetune_cmd(
    circuit: Annotated[Path, typer.Option(help="A `countlens discover` run directory (its heads.csv and report.md).")],
    model: Annotated[str, typer.Option(help="The model the circuit was found in.")] = "toy",
    out: Annotated[
        Path | None,
        typer.Option(
            help="Where adapters and the table go (default: CIRCUIT/finetune, with a preset CIRCUIT/finetune-PRESET)."
        ),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            help="A paper's recipe: counting-circuits or counting-to-four "
            "(countlens.pipeline.presets); the flags below override it."
        ),
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option(
            help="Optimiser steps per variant.", show_default=f"{FINETUNE['steps']}; a preset: from its epochs"
        ),
    ] = None,
    epochs: Annotated[
        float | None, typer.Option(help="Epochs over the training scenes (sets the steps); default: the preset's.")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="Global batch.", show_default=_shown(FINETUNE["batch_size"]))
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Learning rate.", show_default=_shown(FINETUNE["lr"]))] = None,
    lora_r: Annotated[
        int | None, typer.Option(help="LoRA rank (alpha = 2 × rank).", show_default=_shown(FINETUNE["lora_r"]))
    ] = None,
    method: Annotated[
        str | None,
        typer.Option(
            help="lora (adapters on the language model's attention) or full (every language-model weight; "
            "the MAS paper's script).",
            show_default="lora; a preset: its own",
        ),
    ] = None,
    layers: Annotated[
        str | None, typer.Option(help="Comma-separated target layers (default: from the circuit's head classes).")
    ] = None,
    n_train: Annotated[
        int | None,
        typer.Option(
            help="Training scenes.", show_default=f"{RECIPE['n_train']}: half COUNTINGTRICKS, half counting scenes"
        ),
    ] = None,
    n_eval: Annotated[
        int, typer.Option(help="Evaluation scenes per set (COUNTINGTRICKS: n/8 per case; local copies: their first n).")
    ] = 200,
    fsc147: Annotated[
        Path | None,
        typer.Option(
            help="A local FSC-147 copy: its FSC-Val / FSC-Test columns (and counting-to-four's training data)."
        ),
    ] = None,
    pixmo: Annotated[Path | None, typer.Option(help="A local PixMo-Count file (JSONL or parquet): its column.")] = None,
    mmmu: Annotated[
        Path | None,
        typer.Option(help="A local MMMU copy (its parquet files, or a folder of them): MMMU columns, both ways."),
    ] = None,
    realworldqa: Annotated[
        Path | None,
        typer.Option(help="A local RealWorldQA copy (parquet, or a folder of them): its columns, both ways."),
    ] = None,
    mathvista: Annotated[
        Path | None,
        typer.Option(help="A local MathVista testmini (parquet / JSON, or its folder): its columns, both ways."),
    ] = None,
) -> None:
    """Circuit-guided LoRA fine-tunes (SFT, +focus, +MAS, +temperature) and the before/after table
    (accuracy, MAE), appended to CIRCUIT/report.md. Resumable.

    Example: countlens finetune --model toy --circuit runs/toy
    """
    from dataclasses import replace

    from countlens.analysis.heads import read_heads
    from countlens.pipeline import presets
    from countlens.pipeline.finetune_job import before_after

    try:
        recipe = presets.recipe(preset or "")
    except CountlensError as err:
        raise ConfigError(f"--preset: {err}") from None
    if epochs is not None and not epochs > 0:
        raise ConfigError(f"--epochs {epochs}: give a positive number")
    if epochs is not None and steps is not None:
        raise ConfigError("--steps and --epochs both set the run's length; give one of them")
    try:
        read_heads(circuit)
    except CountlensError as err:
        raise RunDirError(f"--circuit {circuit}: {err}") from None
    out = out or circuit / (f"finetune-{preset}" if preset else "finetune")  # a preset's adapters apart
    _check_out(out)
    try:
        target = tuple(int(x) for x in layers.split(",")) if layers else ()
    except ValueError:
        raise ConfigError(f"--layers {layers!r}: give comma-separated integers, e.g. 0,1") from None
    _check_positive(steps=steps, n_train=n_train, n_eval=n_eval, batch_size=batch_size, lora_r=lora_r)
    local = _given(fsc147=fsc147, pixmo=pixmo, mmmu=mmmu, realworldqa=realworldqa, mathvista=mathvista)
    given = _given(
        steps=steps, batch_size=batch_size, lr=lr, lora_r=lora_r, target_layers=target or None, method=method
    )
    if lora_r is not None:
        given["lora_alpha"] = 2 * lora_r
    table = before_after(
        model,
        circuit,
        out,
        overrides=given,
        n_train=n_train,
        n_eval=n_eval,
        recipe=replace(recipe, epochs=epochs) if epochs is not None else recipe,
        preset=preset or "",
        local=local,
        log=typer.echo,
    )
    if table is None:  # a data-parallel rank other than 0: rank 0 writes the table and the report
        return
    report = circuit / "report.md"
    if report.exists():
        from countlens.pipeline.report import FINETUNE_SECTION

        text = report.read_text().split(FINETUNE_SECTION)[0].rstrip("\n")
        section = (out / "before_after.md").read_text()
        flags = " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in _given(
                preset=preset,
                steps=steps,
                epochs=epochs,
                batch_size=batch_size,
                lr=lr,
                lora_r=lora_r,
                method=method,
                layers=layers,
                n_train=n_train,
                n_eval=n_eval,
                fsc147=fsc147,
                pixmo=pixmo,
                mmmu=mmmu,
                realworldqa=realworldqa,
                mathvista=mathvista,
            ).items()
        )
        report.write_text(
            f"{text}\n\n{FINETUNE_SECTION}\n\nCommand: `countlens finetune --model {model} "
            f"--circuit {circuit}{' ' + flags if flags else ''}`.\n\n{section}"
        )
    typer.echo(table.round(3).to_string())


def main() -> None:
    app()


if __name__ == "__main__":
    main()
