"""Counting prompts: the papers' standard prompt (Pstd), a shape-agnostic variant, the organism's short
form, and Digit-in-Conflict.

Digit-in-Conflict appends a distractor digit (N±1 or N±2, never below 0) as a hint to the standard
prompt; the distractor is recorded in the sample's meta (``distractor``) so that analysis can
measure how often a model answers it. Chat formatting is left to `VLM.prepare`.
"""

from __future__ import annotations

import numpy as np

PSTD = "How many {plural} are there in the image? Respond concisely with the number only."
SHORT = "how many {plural} are there in the image?"
CONFLICT_HINT = " Hint: someone said there are {distractor}."

#: Prompt styles: name → (template, whether a distractor digit is added).
PROMPTS: dict[str, tuple[str, bool]] = {
    "std": (PSTD, False),
    "objects": (PSTD.replace("{plural}", "objects"), False),
    "short": (SHORT, False),
    "conflict": (PSTD, True),
}


def plural(shape: str) -> str:
    return shape if shape.endswith("s") else shape + "s"


def make_question(style: str, shape: str, count: int, rng: np.random.Generator) -> tuple[str, dict]:
    """(question, meta) for counting ``shape`` objects (``"objects"`` for all) under a prompt style."""
    template, conflict = PROMPTS[style]
    question = template.format(plural=plural(shape))
    if not conflict:
        return question, {}
    offsets = [d for d in (-2, -1, 1, 2) if count + d >= 0]
    distractor = count + offsets[rng.integers(len(offsets))]
    return question + CONFLICT_HINT.format(distractor=distractor), {"distractor": int(distractor)}
