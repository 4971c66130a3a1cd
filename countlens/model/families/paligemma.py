"""PaliGemma (1, 2): a SigLIP tower's patch grid row-major, and no chat template: the prompt is the
mix checkpoints' question-answering task prefix, and a bidirectional prefix that ``token_type_ids``
marks (0 on the prompt, 1 on an answer).
"""

from __future__ import annotations

from countlens.model.families.spec import ArchSpec, Family, Sandwich

SPECS = (
    ArchSpec(
        "paligemma",
        ("paligemma",),
        layers="model.language_model.layers",
        final_norm="model.language_model.norm",
        vision_blocks="model.vision_tower.encoder.layers",
        vision_tower="model.vision_tower",
        projector="model.multi_modal_projector",
        # The processor adds <bos> after the image tokens and "\n" at the end (PaliGemmaProcessor).
        plain_prompt="{image}answer en {question}",
        answer_token_type="token_type_ids",
        sandwich=Sandwich(text_types=("gemma2",)),  # PaliGemma 2; PaliGemma 1 is Gemma (pre-norm)
    ),
)

FAMILY = Family("paligemma", SPECS, names=("PaliGemma",))
