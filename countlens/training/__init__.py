"""Circuit-guided fine-tuning: answer-only SFT plus focus / MAS attention losses at the circuit's
layers (LoRA via peft, accelerate), inference-time head temperature, and the before/after report."""

from countlens.training.finetune import FinetuneConfig, finetune, target_layers_from, with_adapter
from countlens.training.losses import answer_ce, focus_loss, gaussian_prior, mas_loss
from countlens.training.report import before_after

__all__ = ["FinetuneConfig", "answer_ce", "before_after", "finetune", "focus_loss", "gaussian_prior", "mas_loss",
           "target_layers_from", "with_adapter"]
