"""Donors: where a `Patch`'s or `Resample`'s values come from in one forward.

A donor's values (Float[Tensor, "rows seq_d d"], `countlens.circuits.record` of a donor batch) are
written into a forward by sample (`countlens.circuits.sites.positions.row_index`): forward row r takes
the values' row ``rows[r]``. Which of its positions, `donor_rows` decides:

- **The same layout** — the values are as wide as the forward and, where they know the batch they were
  recorded on (`countlens.circuits.sites.positions.layout_of`), each row's padding and image tokens sit
  in the same columns as its donor row's: column s takes the donor's column s. This is the only rule for
  values that do not know their batch (a plain tensor), and for `ImageStates`.
- **Another layout** (another prompt length, another question or task, another padding): the positions
  are resolved by name in each run — the forward's in its own frame, the donor's in the frame of the
  batch the values were recorded on — and written position by position, in order: the k-th chosen
  position of forward row r takes the k-th of its donor row. ``last``, ``image``, ``text``, ``all``,
  `Cells` and `Objects` (an object's tokens in the donor's own scene) resolve in both runs. Where a row
  and its donor row hold different numbers of such positions (``all`` over prompts of 49 and 52
  tokens; an object covering 3 tokens in the donor's scene and 4 in the edited one), the forward is
  refused naming both counts: no rule pairs them. A position the donor lacks (an object its scene
  does not have, a cell outside its grid) is refused naming it. A `Mask` (columns of the edited batch)
  and ``Objects(of="donor")`` (the pair's corrupt side in `effect`) name no position of another run:
  from a donor as wide as the forward they are written column for column, as ever, and from one of
  another width refused. Every refusal comes before the forward runs (under `intervene`, before its
  first layer; in `effect`, before the pair batch's edited forward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from countlens.circuits.sites.positions import Frame, Group, Mask, Objects
from countlens.errors import InputError

if TYPE_CHECKING:
    from jaxtyping import Bool, Float

    from countlens.model.vlm import VLM

#: What to do about a donor whose positions do not pair with the forward's.
ALIKE = (
    "choose positions both runs hold as many of ('last', 'image' at one image size, Cells, Objects covering "
    "as many tokens), or record the donor on a batch prepared like this one (for count pairs, the answers' "
    "forced prefix included: record(vlm, prepare_pairs(vlm, pairs).corrupt, [site]))"
)


class DonorRows(NamedTuple):
    """Where one forward's donor values come from: ``rows``, each forward row's row of the values; and
    for a donor of another layout ``at``, the values' (rows, columns) of each chosen position of the
    forward, in the order of ``mask.nonzero()``."""

    rows: Tensor
    at: tuple[Tensor, Tensor] | None = None

    def take(self, values: Tensor, b: Tensor, s: Tensor) -> Float[Tensor, "k d"]:
        """``values`` at the forward's rows ``b``, positions ``s``: the chosen positions
        (``mask.nonzero()``, in that order) for a donor of another layout."""
        if self.at is None:
            return values[self.rows[b.cpu()], s.cpu()]
        if len(b) != len(self.at[0]):
            raise InputError(f"a donor of another layout is written at its {len(self.at[0])} chosen positions only")
        return values[self.at[0].to(values.device), self.at[1].to(values.device)]

    def full(self, values: Tensor, mask: Bool[Tensor, "batch seq"]) -> Float[Tensor, "batch seq d"]:
        """The values over every position of the forward (an `countlens.circuits.engine.edits.Edit`'s
        value): the donor's column for column, or for another layout at the chosen positions (0 elsewhere,
        where nothing is written)."""
        if self.at is None:
            b, s = torch.meshgrid(torch.arange(mask.shape[0]), torch.arange(mask.shape[1]), indexing="ij")
            return self.take(values, b.flatten(), s.flatten()).view(*mask.shape, -1)
        out = values.new_zeros(*mask.shape, values.shape[-1])
        out[mask.cpu()] = self.take(values, *mask.nonzero(as_tuple=True))
        return out


def donor_rows(vlm: VLM, item, frame: Frame, mask: Bool[Tensor, "rows seq"]) -> DonorRows:
    """Where ``item``'s (a `Patch`'s, a `Resample`'s) values come from in the forward of ``frame``, whose
    chosen positions are ``mask``: the same layout column for column, another one position by position
    (the module's rules), refused before the forward where they do not pair."""
    values, seq = item.values, frame.input_ids.shape[1]
    rows = item.rows_for(frame)
    what = f"{type(item).__name__} at {item.site}"
    layout = item.donor_layout()
    if type(item.site).__name__ == "ImageStates" or (layout is None and values.shape[1] == seq):
        if values.shape[1] != seq:
            raise InputError(
                f"{what}: the donor values cover {values.shape[1]} positions, this forward {seq}; donors must be "
                "prepared like the edited batch (same image size and question)"
            )
        return DonorRows(rows)
    if layout is None:
        raise InputError(
            f"{what}: the donor values cover {values.shape[1]} positions, this forward {seq}, and they do not "
            "know the batch they were recorded on (a tensor made from record's is unmarked): pass record(vlm, "
            "donor_batch, [site])[site] itself — a donor of another layout is then written by position name — "
            "or prepare the donor like the edited batch (same image size and question; for count pairs under "
            "effect, the answers' forced prefix included: prepare_pairs(vlm, pairs) teacher-forces each pair's "
            "shared answer prefix, which vlm.prepare_samples does not, so record(vlm, prepare_pairs(vlm, "
            "pairs).corrupt, [site])[site], with into=[p.clean for p in pairs])"
        )
    there, order = layout
    lay = rows if order is None else order[rows]  # each forward row's row of the donor's batch
    positions = item.positions
    named = repr(positions.name) if isinstance(positions, Group) else repr(positions)
    unnamed = isinstance(positions, Mask) or (isinstance(positions, Objects) and positions.of == "donor")
    if values.shape[1] == seq and (unnamed or _aligned(vlm, frame, there, lay)):
        return DonorRows(rows)  # unnamed positions of a donor as wide as the forward: column for column, as ever
    if unnamed:
        raise InputError(
            f"{what}: the donor was recorded on a batch of another layout, where positions are resolved by name in "
            f"each run, and {named} names the edited batch's own columns or the pair's corrupt side; use a "
            "token group ('last', 'image', 'text', 'all'), Cells or Objects (the donor's own scene)"
        )
    try:
        theirs = positions.mask(vlm, there).cpu()[lay]
    except InputError as err:
        raise InputError(f"{what}: {named} does not exist in the donor's batch (another layout): {err}") from err
    here = mask.cpu().bool()
    n_here, n_there = here.sum(1), theirs.sum(1)
    bad = (n_here != n_there).nonzero().flatten()
    if len(bad):
        b = int(bad[0])
        raise InputError(
            f"{what}: {named} holds {int(n_here[b])} positions in row {b} of this forward and "
            f"{int(n_there[b])} in its donor (row {int(lay[b])} of the batch the values were recorded on, another "
            f"layout: {values.shape[1]} positions, this forward {seq}); a donor of another layout is written "
            f"position by position in order, so each row needs as many as its donor ({len(bad)} of "
            f"{len(here)} rows differ): {ALIKE}"
        )
    b, s = theirs.nonzero(as_tuple=True)  # row-major, as mask.nonzero(): the k-th of each row pairs up
    return DonorRows(rows, (rows[b], s))


def _aligned(vlm: VLM, frame: Frame, there: Frame, lay: Tensor) -> bool:
    """Whether each forward row's padding and image tokens sit in the same columns as its donor row's."""
    seq = frame.input_ids.shape[1]
    here_real = frame.attention_mask[:, -seq:].bool().cpu()
    if not torch.equal(here_real, there.attention_mask.bool().cpu()[lay]):
        return False
    token = vlm.arch.image_token_id
    return token is None or torch.equal(frame.input_ids.cpu() == token, there.input_ids.cpu()[lay] == token)
