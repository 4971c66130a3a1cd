"""The settings of head classification and of a fine-tune, as data: `HeadThresholds`, `FinetuneConfig`
and `Recipe` (with `DEFAULT_RECIPE`, countlens's own protocol), each checking its ranges when built.

They sit here, apart from `countlens.analysis.heads` and `countlens.training` that use them, because
those packages import torch and these need nothing but the range checks: the command line reads their
fields' defaults (`dataclasses.fields`) to fill its options and its ``--help``, and that stays light.
The other settings it reads are torch-free where they are: `countlens.pipeline.config.DiscoverConfig`
and the organism's `countlens.toy.recipe.TrainConfig`.

A recipe says what a fine-tune is: it fills `FinetuneConfig` fields and names rows (the variants of
`countlens.pipeline.finetune_job.VARIANTS`), a training source and evaluation columns; the job that
runs it checks those names (`countlens.pipeline.finetune_job.check_recipe`). Paper recipes are in
`countlens.pipeline.presets`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from countlens.errors import ConfigError
from countlens.validate import (
    require_bool,
    require_choice,
    require_count,
    require_distinct,
    require_nonnegative,
    require_order,
    require_positive,
    require_seed,
    require_share,
)

#: How `countlens.training.losses.mas_loss` averages its hinge: over target tokens, per sample first, or
#: as the paper's code does.
MAS_REDUCE: tuple[str, ...] = ("token", "sample", "paper")
#: What the answer cross-entropy reads (`countlens.training.collate`): every answer token, or its digits.
CE_ON: tuple[str, ...] = ("answer", "digits")
#: The learning-rate schedules after the warm-up (`FinetuneConfig.schedule`).
SCHEDULES: tuple[str, ...] = ("linear", "cosine")
#: What a fine-tune trains (`FinetuneConfig.method`): LoRA adapters, or every language-model weight.
FINETUNE_KINDS: tuple[str, ...] = ("lora", "full")


@dataclass(frozen=True)
class HeadThresholds:
    """The thresholds of `countlens.analysis.heads.classify_heads` (its module docstring gives the rules).
    The defaults are countlens's, sized for the organism; `countlens.pipeline.presets` holds a paper's."""

    early: float = 0.34  # depth at or below which a head is "early"
    late: float = 0.5  # depth at or above which a head is "late"
    image_high: float = 0.3
    image_low: float = 0.2
    vgs_min: float = 0.2
    cter_min: float = 0.5
    important: float = 0.05  # importance: |patching effect| (share of the logit difference)
    constant: float = 0.9
    routing_from: float = 0.0  # depth band of routing heads: routing_from ≤ depth < routing_to
    routing_to: float | None = None  # None: late
    align_min: float = 0.0  # aggregation: top-1 token = the count on ≥ this share (0: not tested)
    difficulty_min: float | None = None  # awareness by difficulty words (None: not tested)

    def __post_init__(self) -> None:
        """Shares and depths in [0, 1], bands in order, importance ≥ 0: a threshold outside them
        would class no head (or every head) without saying so."""
        for name in ("early", "late", "image_high", "image_low", "vgs_min", "cter_min", "constant", "routing_from"):
            require_share(getattr(self, name), name, ConfigError)
        require_share(self.align_min, "align_min", ConfigError)  # 0, not None, switches it off
        for name in ("routing_to", "difficulty_min"):
            if getattr(self, name) is not None:
                require_share(getattr(self, name), name, ConfigError)
        require_nonnegative(self.important, "important", ConfigError)
        require_order(("early", self.early), ("late", self.late), ConfigError)
        require_order(("image_low", self.image_low), ("image_high", self.image_high), ConfigError)
        routing_to = ("late", self.late) if self.routing_to is None else ("routing_to", self.routing_to)
        require_order(("routing_from", self.routing_from), routing_to, ConfigError)


@dataclass(frozen=True)
class FinetuneConfig:
    """What `countlens.training.finetune.finetune` trains and how (its module docstring gives the loss)."""

    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: float = 0.03
    schedule: str = "linear"  # after the warm-up: "linear" decay to 0, or "cosine" (the MAS paper's script)
    max_grad_norm: float = 0.0  # clip the gradient's global norm to this (0: no clipping)
    method: str = "lora"  # "lora" (adapters on the LM's attention) or "full" (every LM weight; the MAS code's)
    lora_r: int = 32
    lora_alpha: int = 64
    lora_dropout: float = 0.0
    lora_target_layers_only: bool = False
    target_layers: tuple[int, ...] = ()
    # Heads, as (layer, head) pairs or labels ("L3H2"): LoRA trains only their q / k / v / o slices
    # (`countlens.training.head_lora`). None: no restriction; an empty selection is refused.
    target_heads: tuple[tuple[int, int], ...] | None = None
    focus: float = 1.0  # λ_focus (0 switches the term off)
    mas: float = 0.0  # λ_mas (the papers' default when used: 0.1)
    tau: float = 0.4
    sigma: float = 1.0
    mas_reduce: str = "token"
    ce_on: str = "answer"  # "digits": the CE on the count's digit tokens only (Counting Circuits' L_SFT)
    seed: int = 0
    save_every: int = 50
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Every field in its range, so a bad value is refused before a model loads or a file is
        written (a learning rate of 0 would save an identity adapter as a result)."""
        for name in ("steps", "batch_size", "grad_accum", "lora_r", "lora_alpha", "save_every"):
            require_count(getattr(self, name), name, ConfigError)
        require_positive(self.lr, "lr", ConfigError)
        require_bool(self.lora_target_layers_only, "lora_target_layers_only", ConfigError)
        require_positive(self.sigma, "sigma", ConfigError)
        for name in ("weight_decay", "focus", "mas", "max_grad_norm"):
            require_nonnegative(getattr(self, name), name, ConfigError)
        require_share(self.warmup, "warmup", ConfigError, below_one=True)
        require_share(self.lora_dropout, "lora_dropout", ConfigError, below_one=True)
        require_share(self.tau, "tau", ConfigError)
        require_seed(self.seed, "seed", ConfigError)
        require_choice(self.mas_reduce, "mas_reduce", MAS_REDUCE, ConfigError)
        require_choice(self.schedule, "schedule", SCHEDULES, ConfigError)
        require_choice(self.method, "method", FINETUNE_KINDS, ConfigError)
        require_choice(self.ce_on, "ce_on", CE_ON, ConfigError)
        if not isinstance(self.target_layers, (tuple, list)):
            raise ConfigError(
                f"target_layers is a tuple of layers, e.g. (4, 5), or () for none; got {self.target_layers!r:.60}"
            )
        object.__setattr__(self, "target_layers", tuple(self.target_layers))
        for layer in self.target_layers:
            require_seed(layer, "a target layer", ConfigError)
        require_distinct(self.target_layers, "target_layers", ConfigError)
        if self.target_heads is not None:  # None: every head; an empty selection is refused, never "every head"
            from countlens.labels import head_keys  # numpy only where heads are given: --help stays light

            heads = head_keys(self.target_heads, "target_heads", ConfigError, "None (the default) to train every head")
            object.__setattr__(self, "target_heads", heads)
            if self.method != "lora":
                raise ConfigError(
                    "target_heads trains LoRA adapters restricted to those heads' slices: use method='lora' "
                    "(a full fine-tune would change every weight)"
                )


#: The before/after columns every fine-tune can make from generated scenes alone (no local copy): a
#: recipe's default, and the first columns of `countlens.pipeline.finetune_sets.EVALUATION`.
SYNTHETIC_EVALUATION: tuple[str, ...] = (
    "count (in-dist.)",
    "tricks position",
    "tricks dilation",
    "tricks adjacency",
    "color",
    "shape",
)


@dataclass(frozen=True)
class Recipe:
    """A fine-tune protocol for `countlens.pipeline.finetune_job.before_after`: what trains, on what, and
    which rows and columns the before/after table has."""

    config: dict = field(default_factory=dict)  # FinetuneConfig fields
    epochs: float | None = None  # steps = ceil(epochs · training scenes / batch_size); None: config's steps
    rows: tuple[str, ...] = ("+SFT", "+SFT+focus", "+SFT+focus+temperature", "+SFT+focus+MAS")
    training: str = "countingtricks"  # `finetune_sets.TRAINING`: countingtricks, syn or fsc147
    n_train: int | None = 2048  # None: the whole training split
    # Columns (`finetune_sets.EVALUATION`); a local copy given (--fsc147, --pixmo, --mmmu, --realworldqa,
    # --mathvista) that none of them reads adds its own, and a local column listed here is left out when no
    # copy is given.
    evaluation: tuple[str, ...] = SYNTHETIC_EVALUATION
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
