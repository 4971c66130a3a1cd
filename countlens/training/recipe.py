"""What a fine-tune is, as data: a `Recipe` says what trains, on what, and what the before/after
table measures; `DEFAULT_RECIPE` is countlens's own protocol (no paper's).

A recipe fills `countlens.training.finetune.FinetuneConfig` fields and names rows (the variants of
`countlens.pipeline.finetune_job.VARIANTS`), a training source and evaluation columns; the job that
runs it checks those names (`countlens.pipeline.finetune_job.check_recipe`). Paper recipes are in
`countlens.pipeline.presets`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from countlens.errors import ConfigError
from countlens.validate import require_count, require_positive


@dataclass(frozen=True)
class Recipe:
    """A fine-tune protocol for `countlens.pipeline.finetune_job.before_after`: what trains, on what, and
    which rows and columns the before/after table has."""

    config: dict = field(default_factory=dict)  # FinetuneConfig fields
    epochs: float | None = None  # steps = ceil(epochs · training scenes / batch_size); None: config's steps
    rows: tuple[str, ...] = ("+SFT", "+SFT+focus", "+SFT+focus+temperature", "+SFT+focus+MAS")
    training: str = "countingtricks"  # `finetune_job.TRAINING`: countingtricks, syn or fsc147
    n_train: int | None = 2048  # None: the whole training split
    # Columns (`finetune_job.EVALUATION`); a local copy given (--fsc147, --pixmo, --mmmu, --realworldqa,
    # --mathvista) that none of them reads adds its own, and a local column listed here is left out when no
    # copy is given.
    evaluation: tuple[str, ...] = (
        "count (in-dist.)",
        "tricks position",
        "tricks dilation",
        "tricks adjacency",
        "color",
        "shape",
    )
    layers: str = "circuit"  # attention-loss layers: "circuit" (its VG and routing heads' layers) or "all"
    temperature_classes: tuple[str, ...] = ()  # heads the temperature row sharpens; (): top-k by importance
    sources: dict = field(default_factory=dict)
    # The paper's own figures for the general-reasoning columns, quoted under the table as not comparable.
    quoted: str = ""

    def __post_init__(self) -> None:
        if self.epochs is not None:
            require_positive(self.epochs, "Recipe.epochs", ConfigError)
        if self.n_train is not None:
            require_count(self.n_train, "Recipe.n_train", ConfigError)


#: countlens's own protocol (no paper's): the before/after table of `countlens finetune` without --preset.
DEFAULT_RECIPE = Recipe(config={"steps": 300, "batch_size": 16, "lr": 1e-3, "lora_r": 32, "lora_alpha": 64})
