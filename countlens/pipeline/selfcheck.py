"""The self-check, `countlens check`: a first-contact proof that countlens reads *this* checkpoint right.

Everything the test matrix proves on tiny random-init models holds whatever the weights: the spec's
module paths and shapes, the image-token count and cell map, answers that round-trip through the
tokenizer, patching that carries the whole effect or none, heads that sum to their attention output.
So the same invariants can be proved on a user's own checkpoint in a minute, before any figure is
trusted. `check` runs them in five groups and returns one row each — passed, failed or skipped, the
measured figure, its tolerance and, on failure, what is wrong and what to do:

1. **spec** — paths resolve with the expected shapes; the processor agrees with the vision config;
   answers end as the chat template ends them; one forward's logits are finite (`finite`: NaN
   weights fail this one row, naming them, and the groups below are skipped);
2. **image** — the image-token count of the model's own image size, and a darkened quadrant of a
   white image changing, in every view of the image, the tokens countlens maps inside it more than
   those outside (a quadrant, not one cell: a trained tower spreads one cell's change over the image);
3. **answers** — counts 0–20 round-trip through the tokenizer; candidate scoring (a KV cache) equals
   a full teacher-forced forward;
4. **interventions** — patching every image token (or image state) carries the whole effect on a
   pair; patching everything at the last layer too; self-patching changes nothing; the heads'
   contributions sum to the attention output; β = 1 and an ablation of no head change nothing;
5. **memory** — the plan's bytes for one stacked sweep forward against the device's measured peak
   (CUDA only; skipped elsewhere).

Tolerances are relative to the size of the values rounded (the logits), as in the tests
(`tests/tolerance.py`): float32's 1e-5 is the tests' measured budget; bfloat16's and float16's scale
it by their precision (2⁻⁸, 2⁻¹¹ against 2⁻²³) and are not measured here (no GPU). `countlens
discover` runs groups 1–2 before its first stage (`require`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

from countlens.errors import CheckpointError, CountlensError
from countlens.pipeline import selfcheck_groups
from countlens.pipeline.finite import NAME as FINITE
from countlens.pipeline.finite import NEEDS_FINITE, finite_outputs
from countlens.pipeline.selfcheck_groups import CheckRow

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

GROUPS: tuple[str, ...] = ("spec", "image", "answers", "interventions", "memory")


def check(vlm: VLM, groups: tuple[str, ...] = GROUPS) -> list[CheckRow]:
    """The checks of ``groups`` on ``vlm`` (read-only), in order; see the module docstring."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise CountlensError(f"unknown check groups {sorted(unknown)}; use some of {GROUPS}")
    run: dict[str, Callable[[VLM], list[CheckRow]]] = {
        "spec": selfcheck_groups.spec,
        "image": selfcheck_groups.image,
        "answers": selfcheck_groups.answers,
        "interventions": selfcheck_groups.interventions,
        "memory": selfcheck_groups.memory,
    }
    rows: list[CheckRow] = []
    for group in GROUPS:
        if group not in groups:
            continue
        if failed([r for r in rows if r.name == selfcheck_groups.PATHS]):  # nothing else can run on a broken spec
            rows.append(CheckRow(group, "all", None, "not run: the spec's module paths do not resolve"))
            continue
        if group in NEEDS_FINITE and not any(r.name == FINITE for r in rows):
            rows.append(finite_outputs(vlm))  # once, before the first group that compares outputs
        if group in NEEDS_FINITE and failed([r for r in rows if r.name == FINITE]):
            rows.append(CheckRow(group, "all", None, f"not run: the model's outputs are not finite ({FINITE})"))
            continue
        try:
            rows += run[group](vlm)
        except CountlensError as err:  # the model cannot even be asked: that is this group's finding
            rows.append(CheckRow(group, "all", False, f"could not run: {err}", "", "fix what the message names"))
    return rows


def failed(rows: list[CheckRow]) -> list[CheckRow]:
    return [r for r in rows if r.passed is False]


def require(vlm: VLM, groups: tuple[str, ...] = ("spec", "image")) -> None:
    """Refuse a model that fails a check of ``groups`` (by default the fast ones, which `countlens
    discover` runs before its first stage), naming each failed check and its fix."""
    bad = failed(check(vlm, groups))
    if bad:
        rows = "; ".join(f"{r.name}: {r.figure} ({r.fix})" for r in bad)
        raise CheckpointError(f"countlens does not read {vlm.name} right: {rows}. `countlens check` shows every check")


def table(rows: list[CheckRow]) -> str:
    """The rows as a markdown table (the fix column only where something failed)."""
    show_fix = any(r.fix for r in rows)
    head = "| group | check | result | figure | tolerance |" + (" fix |" if show_fix else "")
    lines = [head, "|" + "---|" * (5 + show_fix)]
    for r in rows:
        cells = [r.group, r.name, r.status, r.figure, r.tolerance] + ([r.fix] if show_fix else [])
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def as_json(rows: list[CheckRow]) -> list[dict]:
    return [{**asdict(r), "status": r.status} for r in rows]
