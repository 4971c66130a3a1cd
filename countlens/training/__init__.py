"""Circuit-guided fine-tuning: answer-only SFT plus focus / MAS attention losses at the circuit's
layers (LoRA via peft, accelerate). What a fine-tune is, as data, is torch-free beside it:
`countlens.settings` (`FinetuneConfig`, `Recipe`). The before/after table that runs recipes is a
main job: `countlens.pipeline.finetune_job`."""

from countlens.training.finetune import FinetuneConfig, finetune, target_layers_from, with_adapter
from countlens.training.head_lora import top_heads_from
from countlens.training.losses import answer_ce, focus_loss, gaussian_prior, mas_loss

__all__ = [
    "FinetuneConfig",
    "answer_ce",
    "finetune",
    "focus_loss",
    "gaussian_prior",
    "mas_loss",
    "target_layers_from",
    "top_heads_from",
    "with_adapter",
]
