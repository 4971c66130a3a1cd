"""What was planted in each shipped organism: the circuit (heads) or the edges a planted organism's
count runs through, by the organism's name (`countlens.model.shipped.ORGANISMS`). Plain data, no torch."""

from __future__ import annotations

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
