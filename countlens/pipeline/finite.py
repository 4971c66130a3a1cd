"""`countlens check`'s first forward: are the model's outputs finite numbers at all?

Every later check compares numbers — a patched run against a clean one, heads' sum against the
attention output — and NaN compares unequal to everything, so a model whose outputs are NaN fails
them all, each with a fix that assumes countlens reads the checkpoint wrongly. One forward on a white
image says what is wrong instead: the logits are not finite, and which weights are (weight files
damaged, or a conversion that overflowed), or, with every weight finite, that the activations
overflow in the dtype the model was loaded in. `check` then skips the groups that need finite
outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from PIL import Image

from countlens.errors import CountlensError
from countlens.pipeline.selfcheck_groups import CheckRow

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

NAME = "outputs are finite"
#: The groups whose checks compare the model's outputs, and so mean nothing when those are NaN.
NEEDS_FINITE = ("image", "answers", "interventions", "memory")


def finite_outputs(vlm: VLM) -> CheckRow:
    """One forward of a white image at the model's own size: passed when every logit is finite."""
    g = vlm.geometry
    try:
        batch = vlm.prepare([Image.new("RGB", (g.image_width, g.image_height), "white")], ["How many?"])
    except CountlensError as err:  # the spec and image groups say why
        return CheckRow("spec", NAME, None, f"not run: one image cannot be prepared ({err})")
    with torch.no_grad():
        logits = vlm.hf(**batch.inputs).logits
    bad = int((~torch.isfinite(logits)).sum())
    if not bad:
        return CheckRow("spec", NAME, True, "every logit of one forward is finite", "exact")
    what = "NaN" if torch.isnan(logits).any() else "infinite"
    figure = f"{bad} of {logits.numel()} logits of one forward are {what}"
    weights = non_finite_weights(vlm)
    if weights:
        shown = ", ".join(weights[:3]) + (f" and {len(weights) - 3} more" if len(weights) > 3 else "")
        figure += f"; weights holding NaN or inf: {shown}"
        fix = (
            "the checkpoint's weights are damaged (or a conversion overflowed): copy the weight files again "
            "from the original checkpoint; countlens's checks need finite outputs and are skipped"
        )
    else:
        kind = str(vlm.hf.dtype).removeprefix("torch.")
        figure += f"; every weight is finite, so the activations overflow in {kind}"
        fix = "load the model in float32 or bfloat16 (--dtype); countlens's checks need finite outputs"
    return CheckRow("spec", NAME, False, figure, "exact", fix)


def non_finite_weights(vlm: VLM) -> list[str]:
    """The names of the model's parameters that hold a NaN or an infinity, in the model's order."""
    return [name for name, p in vlm.hf.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
