"""What was planted in each shipped organism: the circuit (heads) or the edges a planted organism's
count runs through, or the feature one of its MLP units computes, by the organism's name
(`countlens.model.shipped.ORGANISMS`). Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from countlens.model.shipped import ORGANISMS
from countlens.toy.planted import CIRCUITS, EDGE_CIRCUITS


def planted_circuit_of(name: object):
    """The circuit planted in the organism ``name`` (a `countlens.toy.planted.PlantedCircuit`), or None
    for a model without one."""
    name = str(name)
    if not (name.startswith("planted-") and name in ORGANISMS):
        return None
    short = name.removeprefix("planted-")
    return EDGE_CIRCUITS[short].node_circuit if short in EDGE_CIRCUITS else CIRCUITS.get(short)


def planted_edges_of(name: object):
    """The edge circuit planted in the organism ``name`` (a `countlens.toy.planted.EdgeCircuit`), or None."""
    name = str(name)
    short = name.removeprefix("planted-")
    return EDGE_CIRCUITS.get(short) if name.startswith("planted-") and name in ORGANISMS else None


@dataclass(frozen=True)
class PlantedFeature:
    """Hidden unit ``unit`` of layer ``layer``'s MLP (its act_fn(gate)·up value, the down projection's
    input) computes h = [count ≥ ``threshold``] at the last token, as the value ``target`` (0 below the
    threshold; trained towards 0, not exactly 0, at every other position); the answer is
    (count mod ``threshold``) + ``threshold``·h (`countlens.toy.feature_plant`). ``threshold`` must lie in
    5–9: counts run 1–9, and that answer is the count itself only where count < 2·threshold."""

    name: str = "count-ge-5"
    layer: int = 2
    unit: int = 171
    threshold: int = 5
    target: float = 4.0
    description: str = (
        "hidden unit 171 of MLP2 computes h = [count ≥ 5] at the last token; the answer is (count mod 5) + 5·h, "
        "h read from that unit alone"
    )

    def h(self, counts):
        """The feature of each count (a tensor): 1.0 where ≥ ``threshold``, else 0.0."""
        return (counts >= self.threshold).float()

    def answer(self, counts, h):
        """The high-level model's answer, as a count: (c mod threshold) + threshold·h."""
        return counts % self.threshold + self.threshold * h.long()


#: The planted features, by name: the organism "planted-<name>" ships where `countlens.model.shipped.
#: SHIPPED_FEATURES` names it.
FEATURES: dict[str, PlantedFeature] = {f.name: f for f in (PlantedFeature(),)}


def planted_feature_of(name: object) -> PlantedFeature | None:
    """The feature planted in the organism ``name`` (a `PlantedFeature`), or None."""
    name = str(name)
    short = name.removeprefix("planted-")
    return FEATURES.get(short) if name.startswith("planted-") and name in ORGANISMS else None
