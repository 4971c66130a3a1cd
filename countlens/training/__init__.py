"""Circuit-guided LoRA fine-tuning. Not built yet: see the training issue."""
