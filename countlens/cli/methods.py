"""``countlens methods``: the attribution methods of the registry (`countlens.circuits.methods.registry`), one
row each: its name (what ``countlens discover --methods`` takes), label, level, what it scores, on
which families it runs, which metrics it takes (any, moving: not KL, linear: the logit difference, none),
whether discover ranks with it, and its forwards per chunk of pairs (plain +
with a backward), as a formula in the layer count L or at ``--layers``. The object rankers follow,
each applying a method per object of a scene."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import typer

from countlens.cli.options import check_positive


def cost_text(count: Callable[[int], int], layers: int | None) -> str:
    """``count`` (a function of the layer count) at ``layers``, or as a formula a + b·L when it is one."""
    if layers is not None:
        return str(count(layers))
    a, b = count(0), count(1) - count(0)
    if any(count(n) != a + b * n for n in (2, 3, 32)):  # not linear in L: its values at a few depths
        return ", ".join(f"{count(n)} at L={n}" for n in (1, 2, 32))
    if b == 0:
        return str(a)
    slope = "L" if b == 1 else f"{b}·L"
    return f"({slope} + {a})" if a else slope


def methods_cmd(
    layers: Annotated[
        int | None,
        typer.Option(help="Give each method's forwards at this many decoder layers (default: as formulas in L)."),
    ] = None,
) -> None:
    """List the registered attribution methods: name, label, level, what each scores, where it runs,
    whether discover ranks with it, and its forwards per chunk of pairs (plain + with a backward).

    Example: countlens methods --layers 28
    """
    import pandas as pd

    from countlens.circuits.methods.registry import METHODS, OBJECT_RANKERS

    check_positive(layers=layers)
    rows = []
    for m in METHODS:
        ranked = "no" if not m.in_discover else f"yes ({m.stage or 'faithfulness'} stage)"
        rows.append(
            {
                "name": m.name,
                "label": m.label,
                "level": m.level,
                "scores": ", ".join(kind.__name__ for kind in m.scores),
                "families": "all" if m.everywhere else "some",
                "metrics": m.metric,
                "discover": ranked,
                "forwards (plain + grad)": f"{cost_text(m.cost.plain, layers)} + {cost_text(m.cost.grad, layers)}",
            }
        )
    for r in OBJECT_RANKERS:
        rows.append(
            {
                "name": r.name,
                "label": r.label,
                "level": r.of.level,
                "scores": f"objects ({', '.join(kind.__name__ for kind in r.scores)} spans)",
                "families": "all" if r.of.everywhere else "some",
                "metrics": r.of.metric,
                "discover": "no",
                "forwards (plain + grad)": (
                    f"{cost_text(r.of.cost.plain, layers)} + {cost_text(r.of.cost.grad, layers)} per chunk of scenes"
                ),
            }
        )
    typer.echo(pd.DataFrame(rows).to_markdown(index=False))
