"""The checkpoints countlens ships, by the name `countlens.load` takes: plain data, no torch.

"toy" is the counting organism (`countlens.toy`); "planted-<circuit>" are its kin trained so that a
circuit named in advance carries the count (what was planted: `countlens.toy.catalogue`). They share the
organism's vocabulary, image size and prompts, and live as package data under ``countlens/toy/``.
"""

from __future__ import annotations

from pathlib import Path

_TOY = Path(__file__).resolve().parent.parent / "toy"
TOY_DIR = _TOY / "weights"
#: The planted circuits whose organisms ship (trained and passing their checks); the others of
#: `countlens.toy.planted.CIRCUITS` are recipes only: `countlens toy plant --circuit NAME` trains one.
SHIPPED_PLANTED: tuple[str, ...] = ("route", "two-hop", "spread")
#: Organisms whose ground truth is objects, not heads (`countlens.toy.regions`): "top-half" counts only
#: the objects in the image's top half.
SHIPPED_OBJECTS: tuple[str, ...] = ("top-half",)
#: Organisms whose ground truth is a set of edges (`countlens.toy.edge_plant`); their nodes (heads and
#: MLPs) are ground truth too.
SHIPPED_EDGES: tuple[str, ...] = ("value-route",)
#: Organisms whose ground truth is a feature one MLP unit computes (`countlens.toy.feature_plant`).
SHIPPED_FEATURES: tuple[str, ...] = ("count-ge-5",)
_PLANTED = SHIPPED_PLANTED + SHIPPED_OBJECTS + SHIPPED_EDGES + SHIPPED_FEATURES
ORGANISMS: dict[str, Path] = {
    "toy": TOY_DIR,
    **{f"planted-{name}": _TOY / "organisms" / name for name in _PLANTED},
}


def is_organism(name: object) -> bool:
    """Whether ``name`` is one of the shipped `ORGANISMS`."""
    return str(name) in ORGANISMS
