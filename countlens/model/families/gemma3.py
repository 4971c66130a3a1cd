"""Gemma 3: a SigLIP tower whose patch grid is average-pooled to ``mm_tokens_per_image`` tokens (4 × 4
at 896 px), row-major; a q-norm normalising after the transpose (batch, heads, seq, d_head).
"""

from __future__ import annotations

from countlens.model.families.spec import ArchSpec, Family, Sandwich

SPECS = (
    ArchSpec(
        "gemma3",
        ("gemma3",),
        layers="model.language_model.layers",
        final_norm="model.language_model.norm",
        vision_blocks="model.vision_tower.encoder.layers",
        vision_tower="model.vision_tower",
        projector="model.multi_modal_projector",
        q_norm="self_attn.q_norm",
        q_norm_layout="bhsd",
        sandwich=Sandwich(),
        pooled_tokens_attr="mm_tokens_per_image",
    ),
)

FAMILY = Family("gemma3", SPECS, names=("Gemma3",))
