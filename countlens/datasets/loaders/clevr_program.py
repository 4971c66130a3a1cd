"""CLEVR's functional programs run on its scene graphs: the check that a local copy's question is about
its own scene.

Each CLEVR question carries the program that answers it (``scene`` → ``filter_color[red]`` → ``unique``
→ ``relate[left]`` → ``count`` …, nodes ``{"function", "inputs", "value_inputs"}``; older copies name the
step ``type`` and its value ``side_inputs``), and each scene lists its objects' attributes and, per
relation, which objects stand that way of each object (``relationships["left"][i]``: the objects left
of object i). `run_program` executes the program as CLEVR's generator defines the functions, so a
question whose ``unique`` step finds no object or several (its program names an object its scene does
not hold), or whose result differs from the file's answer, is refused with the step that fails.
"""

from __future__ import annotations

ATTRIBUTES: tuple[str, ...] = ("color", "shape", "size", "material")


class ProgramError(ValueError):
    """A program that does not run on its scene; the message names the step."""


def run_program(program: list, scene: dict) -> str:
    """The answer ``program`` gives on ``scene``, as CLEVR writes answers ("yes", "3", "red")."""
    objects = scene["objects"]
    results: list = []
    for k, node in enumerate(program):
        name = node.get("function") or node.get("type")
        values = node.get("value_inputs") or node.get("side_inputs") or []
        args = [results[i] for i in node.get("inputs", [])]
        results.append(_step(str(name), values, args, objects, scene.get("relationships", {}), k))
    out = results[-1]
    return ("yes" if out else "no") if isinstance(out, bool) else str(out)


def _step(name: str, values: list, args: list, objects: list, relations: dict, k: int):
    where = f"program step {k} ({name}{'[' + values[0] + ']' if values else ''})"
    if name == "scene":
        return frozenset(range(len(objects)))
    kind, _, attribute = name.partition("_")
    if kind == "filter" and attribute in ATTRIBUTES:
        return frozenset(i for i in args[0] if objects[i].get(attribute) == values[0])
    if name == "unique":
        if len(args[0]) != 1:
            raise ProgramError(
                f"{where} finds {len(args[0])} objects, not one: the program names an object its scene does not hold"
            )
        return next(iter(args[0]))
    if name == "relate":
        table = relations.get(values[0])
        if table is None or args[0] >= len(table):
            raise ProgramError(f"{where}: the scene has no {values[0]!r} relationships for object {args[0]}")
        return frozenset(table[args[0]])
    if name in ("union", "intersect"):
        return args[0] | args[1] if name == "union" else args[0] & args[1]
    if name == "count":
        return len(args[0])
    if name == "exist":
        return len(args[0]) > 0
    if kind == "query" and attribute in ATTRIBUTES:
        return objects[args[0]].get(attribute)
    if kind == "same" and attribute in ATTRIBUTES:
        own = objects[args[0]].get(attribute)
        return frozenset(i for i, o in enumerate(objects) if i != args[0] and o.get(attribute) == own)
    if kind == "equal" and (attribute in ATTRIBUTES or attribute == "integer"):
        return args[0] == args[1]
    if name in ("less_than", "greater_than"):
        return args[0] < args[1] if name == "less_than" else args[0] > args[1]
    raise ProgramError(f"{where}: not one of CLEVR's functions")
