"""The torch-hook backend: the one place countlens registers a hook on a model's module or tensor.

A `Hook` names a module (a path the family spec gave, ``""`` for the whole model, or the module itself)
and what it does there, by ``kind``:

- ``"input"``: ``fn(x)`` on the module's first input (positional, or a decoder layer's ``hidden_states``);
  a tensor it returns replaces that input.
- ``"output"``: ``fn(y)`` on the module's first output (a tuple's first element); a tensor it returns
  replaces it.
- ``"weights"``: ``fn(w)`` on an attention module's weights (its second output), read only.
- ``"before"``: ``fn(module, args, kwargs)`` before the call; ``(args, kwargs)`` it returns replace them.
- ``"after"``: ``fn(module, args, kwargs, output)`` after the call; an output it returns replaces it.

`hooked` attaches a list of them for a ``with`` block and always removes them; `attach` keeps one until
its handle is removed (a hook whose life is a fine-tune's). `on_gradient` hooks a tensor's gradient.
Where a run may be remote (NDIF), nnsight's trace is the other backend (`countlens.model.vlm.VLM.trace`):
sites written inside traces go through `countlens.circuits.engine.writes`; torch hooks serve local runs
and modules that run on stacked copies inside one forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

from countlens.circuits.sites import first_arg, first_output, replace_first
from countlens.model.adapt import module_of

Kind = Literal["input", "output", "weights", "before", "after"]
KINDS: tuple[str, ...] = get_args(Kind)


class Hook(NamedTuple):
    """What to do at one module during a forward (see the module docstring)."""

    module: str | torch.nn.Module
    kind: Kind
    fn: Callable


def attach(model: torch.nn.Module, hook: Hook):
    """Register ``hook`` on ``model`` and return its handle (``handle.remove()`` takes it off)."""
    target, fn = module_of(model, hook.module), hook.fn
    if hook.kind == "input":

        def pre(mod, args, kwargs):
            new = fn(first_arg(args, kwargs))
            return None if new is None else replace_first(args, kwargs, new)

        return target.register_forward_pre_hook(pre, with_kwargs=True)
    if hook.kind == "output":

        def post(mod, args, out):
            new = fn(first_output(out))
            if new is None:
                return None
            return (new, *out[1:]) if isinstance(out, tuple) else new

        return target.register_forward_hook(post)
    if hook.kind == "weights":
        return target.register_forward_hook(lambda mod, args, out: fn(out[1]) and None)
    if hook.kind == "before":
        return target.register_forward_pre_hook(fn, with_kwargs=True)
    if hook.kind == "after":
        return target.register_forward_hook(fn, with_kwargs=True)
    raise ValueError(f"a hook's kind is one of {KINDS}, not {hook.kind!r}")  # a programming error


@contextmanager
def hooked(model: torch.nn.Module, hooks: Sequence[Hook]) -> Iterator[None]:
    """``hooks`` on ``model`` for the ``with`` block, in order; every one removed on the way out (also
    when attaching a later one or the block fails)."""
    handles = []
    try:
        for hook in hooks:
            handles.append(attach(model, hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def on_gradient(tensor: Tensor, fn: Callable[[Tensor], Tensor | None]):
    """Call ``fn`` on ``tensor``'s gradient in every backward (a tensor it returns replaces it); the handle."""
    return tensor.register_hook(fn)
