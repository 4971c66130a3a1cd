"""The organisms countlens ships, by the name `countlens.load` takes: plain data, no torch.

"toy" is the counting organism (`countlens.toy`); "planted-<circuit>" are its kin trained so that a
circuit named in advance carries the count (`countlens.toy.planted`). They share the organism's
vocabulary, image size and prompts.
"""

from __future__ import annotations

from pathlib import Path

from countlens.toy.planted import CIRCUITS, EDGE_CIRCUITS

_TOY = Path(__file__).parent / "toy"
TOY_DIR = _TOY / "weights"
#: The planted circuits whose organisms ship (trained and passing their checks); the others of
#: `CIRCUITS` are recipes only: `countlens toy plant --circuit NAME` trains one.
SHIPPED_PLANTED: tuple[str, ...] = ("route", "two-hop", "spread")
#: Organisms whose ground truth is objects, not heads (`countlens.toy.regions`): "top-half" counts only
#: the objects in the image's top half.
SHIPPED_OBJECTS: tuple[str, ...] = ("top-half",)
#: Organisms whose ground truth is a set of edges (`countlens.toy.edge_plant`); their nodes (heads and
#: MLPs) are ground truth too.
SHIPPED_EDGES: tuple[str, ...] = ("value-route",)
ORGANISMS: dict[str, Path] = {
    "toy": TOY_DIR,
    **{f"planted-{name}": _TOY / "organisms" / name for name in SHIPPED_PLANTED + SHIPPED_OBJECTS + SHIPPED_EDGES},
}


def is_organism(name: object) -> bool:
    """Whether ``name`` is one of the shipped `ORGANISMS`."""
    return str(name) in ORGANISMS


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
