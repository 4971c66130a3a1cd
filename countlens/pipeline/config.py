"""What one `countlens discover` run computes: `DiscoverConfig` and its checks (the stages themselves:
`countlens.pipeline.stages`).

A configuration is pure data; `validate_config` refuses values no stage can run with before anything
is written. Paper presets (`countlens.pipeline.presets`) fill these fields; they import this module,
never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from countlens.errors import ConfigError, InputError
from countlens.model.shipped import is_organism
from countlens.validate import require_choice, require_count, require_distinct, require_positive, require_seed

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

#: How a run reads the model's answers on COUNTINGTRICKS and Digit-in-Conflict: scoring candidate
#: answers (`countlens.analysis.evaluate.score`) or greedy generation parsed as the papers do (`generate`).
EVALUATIONS: tuple[str, ...] = ("score", "generate")


@dataclass(frozen=True)
class DiscoverConfig:
    n_per_case: int = 100  # COUNTINGTRICKS samples per case
    n_pairs: int = 128  # clean/corrupt pairs for patching
    n_samples: int = 128  # task samples for lens, HeadLens, attention, ablation (per task)
    seed: int = 0
    prompt: str = "auto"  # "auto": the organisms' short form for "toy" and its kin, else Pstd
    pair_kind: str = "shapes"
    alpha: float = 1.2  # head temperature: β_h = α·γ_h
    top_k: int = 5  # heads sharpened; AtP's top-k overlap with exact patching
    batch_size: int = 16
    jaccard_k: int = 5  # top heads per task compared across tasks (Jaccard)
    tasks: tuple[str, ...] = ("count", "color", "shape")  # mean-ablated tasks (`datasets.tasks`), "count" first
    math: str = ""  # a local MathVista copy for the math task ("": the procedural one, `datasets.reasoning`)
    spatial: str = ""  # a local CLEVR root for the spatial task ("": the procedural one)
    evaluate: str = "score"  # COUNTINGTRICKS and Digit-in-Conflict: "score" (candidates) or "generate" (parse)
    max_new_tokens: int = 8  # the generation budget of evaluate="generate"
    parser: str = "countlens"  # how evaluate="generate" reads a count: countlens's or "paper-code" (the MAS code's)
    design: str = "countlens"  # the cases stage's COUNTINGTRICKS: countlens's 32 cases or the MAS code's 18
    attention_at: str = "prompt"  # attention diagnostics at the last "prompt" token or last "generation" step
    probes: bool = False  # a `probes` stage: the MAS code's detection probes on its three taps
    voc: str = ""  # a local VOC2007 folder for the probes ("": COUNTINGTRICKS scenes, shapes as classes)
    preset: str = ""  # a `countlens.pipeline.presets` name whose values these are ("": none)
    # The faithfulness stage's rankings: names of the registry's methods discover ranks with
    # (`countlens.circuits.methods.registry`); () ranks with all of them. spec.json holds it only when it names some.
    methods: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        validate_config(self)


def validate_config(c: DiscoverConfig) -> None:
    """Refuse settings no stage can run with, naming the setting (the preset's name is checked
    where the presets are known: `countlens.pipeline.presets.get`). Every `DiscoverConfig` is
    checked when it is made."""
    # The names checked here are imported here, not at the top: the CLI imports this module at start-up
    # (its options' defaults), and the datasets (numpy), parsers and method registry (torch) stay unloaded.
    from countlens.datasets.pairs import check_kind
    from countlens.datasets.prompts import PAIR_PROMPTS

    for name in ("n_per_case", "n_pairs", "n_samples", "batch_size", "top_k", "jaccard_k"):
        require_count(getattr(c, name), name, ConfigError)
    require_seed(c.seed, "seed", ConfigError)
    if c.prompt != "auto" and c.prompt not in PAIR_PROMPTS:
        raise ConfigError(f"prompt {c.prompt!r}: use 'auto' or one of {PAIR_PROMPTS}")
    try:
        check_kind(c.pair_kind)
    except InputError as err:
        raise ConfigError(f"pair_kind: {err}") from None
    require_positive(c.alpha, "alpha (head temperature)", ConfigError)
    from countlens.datasets.tasks import REASONING_TASKS, TASKS

    if not isinstance(c.tasks, tuple) or not c.tasks or c.tasks[0] != "count":
        raise ConfigError(f"tasks {c.tasks!r}: give a tuple of task names that starts with 'count'")
    for task in c.tasks:
        require_choice(task, "a task", TASKS + REASONING_TASKS, ConfigError)
    require_distinct(c.tasks, "tasks", ConfigError)
    require_choice(c.evaluate, "evaluate", EVALUATIONS, ConfigError)
    require_count(c.max_new_tokens, "max_new_tokens", ConfigError)
    from countlens.analysis.parse import PARSERS

    require_choice(c.parser, "parser", PARSERS, ConfigError)
    from countlens.datasets.countingtricks import DESIGNS

    require_choice(c.design, "design", DESIGNS, ConfigError)
    require_choice(c.attention_at, "attention_at", ("prompt", "generation"), ConfigError)
    from countlens.circuits.methods.registry import check_discover_names

    if not isinstance(c.methods, tuple):
        raise ConfigError(
            f"methods {c.methods!r}: give a tuple of method names (an empty one: all discover ranks with)"
        )
    check_discover_names(c.methods, ConfigError)
    if not isinstance(c.probes, bool):
        raise ConfigError(f"probes={c.probes!r}: give True or False")
    if not isinstance(c.voc, str):
        raise ConfigError(f'voc={c.voc!r}: give the VOC2007 folder\'s path as a str ("": scenes)')
    if c.voc and not c.probes:
        raise ConfigError(f"voc={c.voc!r} gives data for the probes stage, which this run leaves out; set probes=True")
    if c.voc and not Path(c.voc).exists():
        raise ConfigError(f"voc={c.voc!r}: no such directory; give a VOC2007 folder (ImageSets/, Annotations/ …)")
    for name in ("math", "spatial"):
        path = getattr(c, name)
        if not isinstance(path, str):  # spec.json holds it as text
            raise ConfigError(f'{name}={path!r}: give the local copy\'s path as a str ("": the procedural task)')
        if path and name not in c.tasks:
            raise ConfigError(
                f"{name}={path!r} gives a local copy for a task the run leaves out; add {name!r} to tasks"
            )
        if path and not Path(path).exists():
            raise ConfigError(f"{name}={path!r}: no such file or directory; give the path of a local copy")


def default_prompt(model: str) -> str:
    """The prompt style a model is asked in unless told otherwise: the organism's short form on the
    organism (its vocabulary cannot write Pstd's answers), Pstd elsewhere."""
    return "short" if is_organism(model) else "std"


def resolved_prompt(vlm: VLM, c: DiscoverConfig) -> str:
    """The prompt style a run uses: ``c.prompt``, or for "auto" the model's `default_prompt`."""
    return default_prompt(vlm.name) if c.prompt == "auto" else c.prompt


def conflict_styles(model: str) -> tuple[str, str]:
    """The Digit-in-Conflict prompt styles (base, with distractor): Pstd, except for the organism,
    whose vocabulary cannot write Pstd's "circle: 7" answers and gets the number-only prompt."""
    return ("number", "number_conflict") if is_organism(model) else ("std", "conflict")
