"""The organism's training schedule, `TrainConfig`: steps, batches, learning rate, the vision tower's
pretraining and the task mix that `countlens.toy.train` follows (`countlens.toy.recipe` holds the
model it trains, and re-exports this). Pure data and its range checks: the command line reads its
defaults for ``countlens toy train --help`` without loading the scene generator.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from countlens.errors import ConfigError
from countlens.validate import (
    require_bool,
    require_choice,
    require_count,
    require_nonnegative,
    require_positive,
    require_seed,
)


@dataclass(frozen=True)
class TrainConfig:
    """The training schedule (see `countlens.toy.train`)."""

    seed: int = 0
    steps: int = 5000
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 100
    vision_pretrain: int = (
        0  # steps of shape pretraining of the vision tower on small crops (off in the shipped recipe)
    )
    crop_size: int = 64  # side (px) of those one-object crops; objects keep their in-scene sizes
    crop_batch: int = 64
    pretrain_reads: str = (
        "tokens"  # what vision_pretrain's head reads: the "centre" token, pooled "tokens", pooled "patches"
    )
    vision_warmup: int = 300  # steps of dense pretraining of the vision tower (see train.vision_warmup)
    freeze_vision: bool = (
        False  # freeze patch embedding and blocks after crop pretraining (else after the dense warmup)
    )
    weight_decay: float = 0.01
    task_mix: dict = field(default_factory=lambda: {"count": 0.7, "color": 0.15, "shape": 0.15})
    threads: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.pretrain_reads, str) or self.pretrain_reads not in ("centre", "tokens", "patches"):
            raise ConfigError(
                f"pretrain_reads {self.pretrain_reads!r:.40} is unknown; use 'centre', 'tokens' or 'patches'"
            )
        require_seed(self.seed, "seed", ConfigError)
        for name in ("batch_size", "crop_size", "crop_batch", "threads"):
            require_count(getattr(self, name), name, ConfigError)
        for name in ("steps", "warmup", "vision_pretrain", "vision_warmup"):  # steps 0: the tower's pretraining only
            require_seed(getattr(self, name), name, ConfigError)
        require_positive(self.lr, "lr", ConfigError)
        require_nonnegative(self.weight_decay, "weight_decay", ConfigError)
        require_bool(self.freeze_vision, "freeze_vision", ConfigError)
        from countlens.datasets.tasks import TASKS  # here, not at the top: reading the fields stays light

        for task, weight in self.task_mix.items():
            require_choice(task, "task_mix's task", TASKS, ConfigError)
            require_nonnegative(weight, f"task_mix[{task!r}]", ConfigError)
        if not sum(self.task_mix.values()) > 0:
            raise ConfigError(f"task_mix {self.task_mix}: give some task a weight > 0")

    def to_dict(self) -> dict:
        return asdict(self)
