"""What a fine-tune trains on and what it is scored on: the training scenes of a recipe, the
evaluation columns (countlens's own, a paper's, a local benchmark copy's) and their metrics.

A `countlens.settings.Recipe` names its training source (`TRAINING`) and its columns (`EVALUATION`);
`training_data` builds the first from training seeds (≥ `TRAIN_SEED`) or a train split — never an
evaluation scene — and `evaluation_sets` the second from evaluation seeds and local copies
(`LOCAL_SETS`: FSC-147, PixMo-Count, MMMU, RealWorldQA, MathVista; nothing is downloaded).
`evaluation_metrics` scores one model on every column: accuracy and, for counting sets, MAE; a
general-reasoning column both by generation read by the benchmark's rule and by option
log-probability. The before/after job that trains and tabulates is `countlens.pipeline.finetune_job`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from countlens.analysis.benchmark_answers import writes_a_letter
from countlens.analysis.evaluate import generate, score
from countlens.analysis.metrics import summary
from countlens.datasets import loaders
from countlens.datasets.countingtricks import CASES, countingtricks
from countlens.datasets.loaders import load_fsc147, load_pixmo_count
from countlens.datasets.pairs import count_scenes
from countlens.datasets.tasks import task_samples
from countlens.errors import ConfigError, InputError
from countlens.settings import DEFAULT_RECIPE, SYNTHETIC_EVALUATION

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

TRAINING: tuple[str, ...] = ("countingtricks", "syn", "fsc147")
#: Evaluation columns read from a local benchmark copy (``local``'s key), scored by generation + parsing.
LOCAL_SETS: dict[str, str] = {
    "FSC-Val": "fsc147",
    "FSC-Test": "fsc147",
    "PixMo-Count": "pixmo",
    "MMMU": "mmmu",
    "RealWorldQA": "realworldqa",
    "MathVista": "mathvista",
}
#: The general-reasoning columns: generation read by each benchmark's rule (`benchmark_answers`), plus
#: "<name> options" (candidate log-probability over the options, multiple-choice questions only) and
#: "<name> unparsed" (the share of generated answers the rule could not read).
REASONING_SETS: tuple[str, ...] = ("MMMU", "RealWorldQA", "MathVista")
#: Tokens a general-reasoning question may generate (more where a gold answer is longer).
REASONING_NEW_TOKENS = 16
TRAIN_SEED = 1000  # training scenes come from seeds ≥ 1000; evaluation scenes from 7


def default_training_data(grid, n: int = 2048, prompt: str = "short", seed: int = TRAIN_SEED) -> list:
    """Half COUNTINGTRICKS (all 32 cases), half counting task scenes; training seeds only."""
    per_case = max(1, n // (2 * len(CASES)))
    tricks = countingtricks(None, per_case, grid, seed=seed, prompt=prompt, color=("red", "green", "blue"))
    if n <= len(tricks):  # small n: n scenes, spread over the cases (not one per case beyond what was asked)
        return [tricks[i * len(tricks) // n] for i in range(n)]
    return tricks + task_samples("count", n - len(tricks), seed, image_size=grid.image_height)


def training_data(recipe, grid, prompt: str, local: dict | None = None, n: int | None = None) -> list:
    """The recipe's training scenes: ``countingtricks`` (`default_training_data`), ``syn`` (SynDot and
    SynPoly-style scenes alternating, counts 1–10) or ``fsc147`` (the train split of ``local["fsc147"]``)."""
    n = recipe.n_train if n is None else n
    check_training_source(recipe, local)
    if recipe.training == "countingtricks":
        return default_training_data(grid, n or 2048, prompt=prompt)
    if recipe.training == "syn":
        return count_scenes(n or 8000, "dots+polygons", grid, seed=TRAIN_SEED, prompt=prompt)
    train = load_fsc147(local["fsc147"], split="train", limit=n)
    if not train:
        raise InputError(f"{local['fsc147']}: FSC-147's train split lists no images; pass a complete copy")
    return train


EVALUATION: tuple[str, ...] = (
    *SYNTHETIC_EVALUATION,
    "SynReal",
    "Circles (Syn)",
    "FSC-Val",
    "FSC-Test",
    "PixMo-Count",
    *REASONING_SETS,
)


#: The column a local copy adds to a recipe that has none of its columns.
LOCAL_DEFAULT_SET: dict[str, str] = {
    "fsc147": "FSC-Test",
    "pixmo": "PixMo-Count",
    "mmmu": "MMMU",
    "realworldqa": "RealWorldQA",
    "mathvista": "MathVista",
}


def load_reasoning(key: str, path, limit=None, log=None) -> list:
    """The questions of a general-reasoning copy (``local``'s key: mmmu, realworldqa or mathvista)."""
    if key == "mmmu":
        return loaders.load_mmmu(path, limit=limit, log=log)
    return (loaders.load_realworldqa if key == "realworldqa" else loaders.load_mathvista)(path, limit=limit)


REASONING_COPIES: tuple[str, ...] = ("mmmu", "realworldqa", "mathvista")


def evaluation_names(recipe, local: dict | None = None) -> tuple[str, ...]:
    """The recipe's columns, plus a column for each local copy given that none of them reads."""
    extra = [
        name
        for key, name in LOCAL_DEFAULT_SET.items()
        if key in (local or {}) and not any(LOCAL_SETS.get(x) == key for x in recipe.evaluation)
    ]
    return (*recipe.evaluation, *extra)


def check_training_source(recipe, local: dict | None) -> None:
    """Refuse a recipe whose training source is unknown, or FSC-147 without its local copy."""
    if recipe.training not in TRAINING:
        raise ConfigError(f"Recipe.training={recipe.training!r}: use one of {TRAINING}")
    if recipe.training == "fsc147" and not (local or {}).get("fsc147"):
        raise ConfigError(
            "this recipe fine-tunes on FSC-147's train split: pass a local copy "
            "(`--fsc147 ROOT` / local={'fsc147': ROOT}); no data set is downloaded"
        )


def evaluation_sets(
    grid,
    n: int = 200,
    prompt: str = "short",
    seed: int = 7,
    names: Sequence[str] | None = None,
    local: dict | None = None,
    log=print,
) -> dict[str, list]:
    """The evaluation columns ``names`` (default: countlens's own, `DEFAULT_RECIPE.evaluation`), ``n``
    scenes each (COUNTINGTRICKS families: n/8 per case; colour, shape: n/2). A local benchmark's column
    (`LOCAL_SETS`) comes from ``local`` and is left out, with a line in the log, when no copy is given."""
    names = DEFAULT_RECIPE.evaluation if names is None else names
    size, local, colors = grid.image_height, local or {}, ("red", "green", "blue")

    def tricks(family: str) -> list:
        cases = [c for c, case in CASES.items() if case.family == family]
        return countingtricks(cases, max(1, n // 8), grid, seed=seed, prompt=prompt, color=colors)

    def fsc(split: str):
        return lambda: load_fsc147(local["fsc147"], split=split, limit=n)

    def pixmo():
        return load_pixmo_count(local["pixmo"], limit=n)

    makers = {
        "count (in-dist.)": lambda: task_samples("count", n, seed, image_size=size),
        **{f"tricks {f}": (lambda f=f: tricks(f)) for f in ("position", "dilation", "adjacency")},
        "color": lambda: task_samples("color", n // 2, seed, image_size=size),
        "shape": lambda: task_samples("shape", n // 2, seed, image_size=size),
        "SynReal": lambda: count_scenes(n, "rendered", grid, seed=seed, prompt=prompt),
        "Circles (Syn)": lambda: countingtricks(
            None, max(1, n // len(CASES)), grid, seed=seed, prompt=prompt, shapes="circle", color=colors
        ),
        "FSC-Val": fsc("val"),
        "FSC-Test": fsc("test"),
        "PixMo-Count": pixmo,
        **{
            name: (lambda key=LOCAL_SETS[name]: load_reasoning(key, local[key], limit=n, log=log))
            for name in REASONING_SETS
        },
    }
    unknown = [x for x in names if x not in makers]
    if unknown:
        raise ConfigError(f"unknown evaluation sets {unknown}; use some of {list(EVALUATION)}")
    sets = {}
    for name in names:
        if name in LOCAL_SETS and not local.get(LOCAL_SETS[name]):
            log(f"{name}: no local copy given (--{LOCAL_SETS[name]}), column left out")
            continue
        samples = makers[name]()
        if samples:
            sets[name] = samples
        else:
            log(f"{name}: the local copy holds no samples for it, column left out")
    return sets


def evaluation_metrics(
    vlm: VLM, sets: dict[str, list], batch_size: int, generated: frozenset = frozenset()
) -> dict[str, float]:
    """Accuracy per set, and MAE (|predicted − true count| over parsed answers) per counting set:
    scoring (`score`) or, for the sets in ``generated`` (real benchmarks), greedy generation + parsing;
    a general-reasoning set (`REASONING_SETS`) both ways (`_reasoning_metrics`)."""
    out = {}
    for name, samples in sets.items():
        if name in REASONING_SETS:
            out.update(_reasoning_metrics(vlm, name, samples, batch_size))
            continue
        ds = (generate if name in generated else score)(vlm, samples, batch_size=batch_size)
        row = summary(ds).loc["all"]
        out[name] = float(row["accuracy"])
        if all(s.task == "count" for s in samples):
            out[f"{name} MAE"] = float(row["mae"])
    return out


def _reasoning_metrics(vlm: VLM, name: str, samples: list, batch_size: int) -> dict[str, float]:
    """A general-reasoning benchmark's three columns: ``name`` (greedy generation read by the benchmark's
    rule, every question), ``name options`` (the most probable option, teacher-forced, over the
    multiple-choice questions; NaN when there are none or the model's vocabulary cannot write every
    option, as the organism's cannot write letters) and ``name unparsed`` (generated answers the rule
    could not read)."""
    lengths = [_written_length(vlm, s.answer) for s in samples if not writes_a_letter(s)]
    ds = generate(vlm, samples, max_new_tokens=max([REASONING_NEW_TOKENS, *lengths]), batch_size=batch_size)
    options = [s for s in samples if getattr(s, "choices", None)]
    writable = all(_written_length(vlm, c) for s in options for c in s.choices)
    scored = score(vlm, options, batch_size=batch_size, method="candidates") if options and writable else None
    return {
        name: float(ds.correct.mean()),
        f"{name} options": float(scored.correct.mean()) if scored is not None else float("nan"),
        f"{name} unparsed": float(1 - ds.parsed.mean()),
    }


def _written_length(vlm: VLM, text: str) -> int:
    """The tokens ``text`` takes as the model writes it; 0 when its vocabulary cannot write it."""
    try:
        return len(vlm.answer_ids(str(text)))
    except InputError:
        return 0
