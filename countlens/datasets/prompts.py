"""Counting prompts and the answers they ask for: the papers' standard prompt (Pstd), the number-only
form, a shape-agnostic variant, the organism's short form, and Digit-in-Conflict.

**Pstd** ("Counting to Four", its evaluation protocol) is verbatim: "How many {shapes} are there in the
image? Respond concisely with shape counts using the following format: {shape}: {number}". The
shape's plural fills ``{shapes}``, its singular fills ``{shape}``, and ``{number}`` stays in the
prompt as the slot the model fills, so its answer reads "circle: 7" (`answer_text`; parse it with
`countlens.analysis.parse.parse_shape_count`). The **number-only** form ("… Respond concisely with
the number only.", answer "7") is countlens's own, kept under the name ``number``; ``short`` is the
organism's training question.

Digit-in-Conflict appends a distractor digit (N±1 or N±2, never below 0) as a hint; the distractor is
recorded in the sample's meta (``distractor``) so that analysis can measure how often a model answers
it. ``conflict`` adds it to Pstd, ``number_conflict`` to the number-only form. Chat formatting is left
to `VLM.prepare`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from countlens.errors import InputError
from countlens.validate import require_choice, require_integer, require_text

PSTD = (
    "How many {plural} are there in the image? Respond concisely with shape counts using the "
    "following format: {shape}: {{number}}"
)
NUMBER_ONLY = "How many {plural} are there in the image? Respond concisely with the number only."
SHORT = "how many {plural} are there in the image?"
CONFLICT_HINT = " Hint: someone said there are {distractor}."


class PromptStyle(NamedTuple):
    """A question template, whether a distractor digit is added, and the answer's form."""

    template: str
    conflict: bool
    answer: str  # "{n}" or "{shape}: {n}"


#: Prompt styles by name.
PROMPTS: dict[str, PromptStyle] = {
    "std": PromptStyle(PSTD, False, "{shape}: {n}"),
    "number": PromptStyle(NUMBER_ONLY, False, "{n}"),
    "objects": PromptStyle(NUMBER_ONLY.replace("{plural}", "objects"), False, "{n}"),
    "short": PromptStyle(SHORT, False, "{n}"),
    "conflict": PromptStyle(PSTD, True, "{shape}: {n}"),
    "number_conflict": PromptStyle(NUMBER_ONLY, True, "{n}"),
}
#: Styles without a distractor: the ones a count pair (same question on both sides) can use.
PAIR_PROMPTS: tuple[str, ...] = tuple(k for k, p in PROMPTS.items() if not p.conflict)


def plural(shape: str) -> str:
    return shape if shape.endswith("s") else shape + "s"


def singular(shape: str) -> str:
    return shape[:-1] if shape.endswith("s") else shape


def _check_question(style: str, shape: str, count: int) -> None:
    require_choice(style, "prompt style", PROMPTS)
    require_text(shape, "shape")
    require_integer(count, "count", low=0)


def answer_text(style: str, shape: str, count: int) -> str:
    """The answer ``style`` asks for when ``count`` ``shape`` objects are shown ("7", "circle: 7")."""
    _check_question(style, shape, count)
    return PROMPTS[style].answer.format(shape=singular(shape), n=int(count))


def make_question(style: str, shape: str, count: int, rng: np.random.Generator | None) -> tuple[str, dict]:
    """(question, meta) for counting ``shape`` objects (``"objects"`` for all) under a prompt style;
    ``rng`` draws a conflict style's distractor and may be None for the other styles."""
    _check_question(style, shape, count)
    template, conflict, _ = PROMPTS[style]
    if conflict and not isinstance(rng, np.random.Generator):
        raise InputError(f"the {style!r} prompt draws a distractor digit: give rng, a numpy Generator")
    question = template.format(plural=plural(shape), shape=singular(shape))
    if not conflict:
        return question, {}
    offsets = [d for d in (-2, -1, 1, 2) if count + d >= 0]
    distractor = count + offsets[rng.integers(len(offsets))]
    return question + CONFLICT_HINT.format(distractor=distractor), {"distractor": int(distractor)}
