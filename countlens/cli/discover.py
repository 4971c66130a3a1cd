"""``countlens discover`` (a model → its counting circuit, in a run directory) and ``countlens plan``
(what that run needs of a device, before it runs): the options they share fill one
`DiscoverConfig`, over a preset's values when ``--preset`` is given (`discover_config`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import countlens
from countlens import distributed
from countlens.cli.options import DISCOVER, Device, Dtype, Model, check_positive, given, shown
from countlens.cli.paths import check_file_out, check_out
from countlens.errors import ConfigError
from countlens.pipeline.config import DiscoverConfig
from countlens.validate import require_image_side


def discover_config(preset: str | None, **values):
    """A DiscoverConfig from the flags given (None: not given): over the preset's values, if any,
    else over the defaults."""
    from countlens.pipeline import presets

    fields_given = given(**values)
    return presets.discover_config(preset, **fields_given) if preset else DiscoverConfig(**fields_given)


# DiscoverConfig fields that a preset may set: None (not given) leaves them to the preset, else to
# the DiscoverConfig default the help shows.
NPerCase = Annotated[
    int | None, typer.Option(help="COUNTINGTRICKS samples per case.", show_default=shown(DISCOVER["n_per_case"]))
]
NPairs = Annotated[
    int | None,
    typer.Option(
        help="Clean/corrupt pairs for patching, drawn stratified over the 72 ordered pairs of counts 1–9 "
        "(seeded by --seed): each gets ⌊n/72⌋ or ⌈n/72⌉ pairs and the clean counts are as even as n allows; "
        "the report gives the clean × corrupt table.",
        show_default=shown(DISCOVER["n_pairs"]),
    ),
]
NSamples = Annotated[
    int | None,
    typer.Option(
        help="Samples per task for lenses, attention and ablation.", show_default=shown(DISCOVER["n_samples"])
    ),
]
Prompt = Annotated[
    str | None,
    typer.Option(
        help="Prompt style: auto (short for toy, std otherwise), std (the papers' Pstd), number, objects, short.",
        show_default=shown(DISCOVER["prompt"]),
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


Methods = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated methods whose head rankings the faithfulness stage evaluates, by their registry "
        "names (`countlens methods`), e.g. exact,atp_star; default: every method discover ranks with.",
        show_default=False,
    ),
]


def tasks_of(tasks: str | None) -> tuple[str, ...] | None:
    """``--tasks`` (or ``--methods``) as DiscoverConfig's tuple (None: not given); the names are checked there."""
    return None if tasks is None else tuple(t.strip() for t in tasks.split(",") if t.strip())


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
    methods: Methods = None,
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
    from countlens.datasets.prompts import PAIR_PROMPTS
    from countlens.pipeline.discover import check_preset, discover
    from countlens.pipeline.rundir import check_run_dir

    check_out(out)
    check_run_dir(out)
    distributed.current()  # the launcher's RANK / WORLD_SIZE, if any, make sense
    if prompt is not None and prompt != "auto" and prompt not in PAIR_PROMPTS:
        raise ConfigError(f"--prompt {prompt!r}: use auto or one of {', '.join(PAIR_PROMPTS)}")
    check_positive(n_per_case=n_per_case, n_pairs=n_pairs, n_samples=n_samples, batch_size=batch_size)
    config = discover_config(
        preset,
        seed=seed,
        batch_size=batch_size,
        n_per_case=n_per_case,
        n_pairs=n_pairs,
        n_samples=n_samples,
        prompt=prompt,
        tasks=tasks_of(tasks),
        methods=tasks_of(methods),
        math=None if math is None else str(math.resolve()),  # absolute: a resume from elsewhere reads it
        spatial=None if spatial is None else str(spatial.resolve()),
        evaluate=evaluate,
        voc=None if voc is None else str(voc.resolve()),
        probes=True if voc is not None else None,
    )
    check_preset(config)  # before the model loads
    vlm = countlens.load(model, dtype=dtype, device_map=device, remote=remote)
    if not remote:  # the spec and image checks of `countlens check` (read-only), before any stage
        from countlens.pipeline.selfcheck import require

        require(vlm)
    if vlm.device.type == "cuda":  # a stage that cannot fit this GPU is refused now, not after the others ran
        from countlens.pipeline.plan import plan

        plan(vlm, config).require_fit()
    report = discover(vlm, out, config, log=typer.echo)
    typer.echo(f"report: {report}")


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
    methods: Methods = None,
    batch_size: BatchSize = DISCOVER["batch_size"],
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the plan as JSON here.")] = None,
) -> None:
    """Plan `countlens discover` before running it: per stage, its forwards, rows per stacked
    forward, pairs or samples a chunk (chosen to fit), peak memory and FLOPs, for the given image size,
    batch and device memory. A stage that does not fit is named, with what makes it fit, and the
    command fails after printing the plan.

    Example: countlens plan --model runs/qwen2.5-vl-7b --image-size 448 --memory 141 --device cuda --dtype bfloat16
    """
    import json
    import math

    from countlens.model.loading import meta_vlm
    from countlens.pipeline import plan

    check_positive(
        image_size=image_size, n_per_case=n_per_case, n_pairs=n_pairs, n_samples=n_samples, batch_size=batch_size
    )
    if image_size is not None:
        require_image_side(image_size, "--image-size", ConfigError)
    if memory is not None and not (memory > 0 and math.isfinite(memory)):
        raise ConfigError(f"--memory must be a finite number of GiB > 0, got {memory}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: plan for 'cpu' or 'cuda'")
    check_file_out(json_out, "--json")
    config = discover_config(
        preset,
        batch_size=batch_size,
        n_per_case=n_per_case,
        n_pairs=n_pairs,
        n_samples=n_samples,
        prompt=prompt,
        tasks=tasks_of(tasks),
        methods=tasks_of(methods),
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
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(p.to_dict(), indent=1) + "\n")
    p.require_fit()  # after the table: the refusal names each stage and what makes it fit
