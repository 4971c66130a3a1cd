"""Sites: where circuits read and write, each a small frozen type, and the token groups they act on.

A site says three things: how it is **read** from a `countlens.circuits.edits.cache_run` result (the
value a patch copies), how it is **written** inside a traced forward (at an edit's masked positions,
in one replica of a stacked batch: `countlens.circuits.edits.run_edits`), and its **width** (the last
axis of a value written there).

- `Residual` — the residual stream after decoder layer ``l`` (the layer's output tensor); layer −1 is
  the input of layer 0 (the token embeddings with the projected image tokens).
- `HeadZ` — one head's output before o_proj: its columns of o_proj's input, (batch, seq,
  n_heads·d_head) viewed as (batch, seq, n_heads, d_head), with the layer's own heads and head size
  (`Arch.heads`, `Arch.head_dim`: Gemma 4's full and sliding layers differ; a linear-attention
  layer's heads are its value heads, whose gated outputs enter its ``out_proj`` side by side).
  Per-head quantities live here: slicing o_proj's *output* mixes every head, since o_proj is a
  dense map from all heads.
- `Expert` — mixture-of-experts layers: expert e's share of the experts module's output at token t,
  w_e(t)·E_e(x_t) (zero where the router did not choose e); a token's chosen experts' contributions
  sum to that output. Where that share can be seen depends on the layer's rule
  (`countlens.circuits.expert_rules`).
- `ImageStates` — cross-attention VLMs (Llama-3.2-Vision) only: the image states, which never enter
  the residual stream. At "layer −1" the projector's output, which every cross-attention layer
  reads; at a cross-attention layer ``l`` the states that layer alone reads (its k and v input). An
  edit's mask there is Bool[Tensor, "batch n_states"]: the states are its positions.

Sites of one kind at one layer are written together (each kind's ``write`` takes them all), and the
kinds in the order the forward reaches them (``stage``: image states, z, experts, the layer's
output), because nnsight enters each module once, in execution order.

Two more quantities read at these sites: the **head contribution** ĥ_i·W_O, head i's z times its
columns of o_proj's weight (the heads' contributions, plus any o_proj bias, sum to the o_proj
output), and **q**, after any q-norm (Qwen3, Gemma3) or else the q_proj output: head temperature
scales it.

Token groups (boolean masks over the padded batch): ``image`` (image tokens), ``last`` (where the
answer is read: the last prompt token, and any answer tokens teacher-forced after it up to the read
position — see `countlens.answers`), ``text`` (every other real token), ``all`` (all real tokens).
A cross-attention model has no image tokens; its image is the ``image_states`` group of
`countlens.circuits.patching.patch_layers` (a site, not positions in the sequence).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
from torch import Tensor

from countlens.circuits.expert_rules import expert_rule
from countlens.errors import InputError
from countlens.labels import head_key, is_head_pair

if TYPE_CHECKING:
    from jaxtyping import Bool, Float, Int

    from countlens.arch import Arch
    from countlens.vlm import VLM, Batch


class Placed(NamedTuple):
    """An edit placed in a stacked forward: replica ``replica`` (rows replica·n … of the stacked
    batch) gets ``value``, or else the cached run's, at the mask's entries — rows b, positions s; or,
    with ``op``, op(what the forward has there) (`countlens.circuits.interventions`)."""

    replica: int
    site: Site
    mask: Bool[Tensor, "batch positions"]
    value: Float[Tensor, "batch positions d"] | None
    b: Int[Tensor, " k"]
    s: Int[Tensor, " k"]
    op: Callable[[Tensor], Tensor] | None = None


def written(vlm: VLM, placed: Placed, cache: dict | None, current: Tensor) -> Tensor:
    """What a placed edit leaves at its entries, given what the forward has there (``current``, k × d)."""
    if placed.op is not None:
        return placed.op(current)
    return source(vlm, placed, cache, current.device).to(current.device, current.dtype)


def source(vlm: VLM, placed: Placed, cache: dict | None, device: torch.device) -> Float[Tensor, "k d"]:
    """What a placed edit writes at its entries: its value there, or the cached run's (on ``device``)."""
    if placed.value is None:
        return placed.site.read(vlm, cache, placed.b, placed.s, device)
    value, b, s = placed.value, placed.b, placed.s
    return value[b.to(value.device), s.to(value.device)]  # edit values may sit on the CPU


@dataclass(frozen=True)
class Residual:
    """The residual stream after decoder layer ``layer``; −1: the input of layer 0."""

    layer: int
    stage: ClassVar[int] = 3  # a layer's output: the last thing of the layer the forward reaches

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def read(self, vlm: VLM, cache: dict, b: Tensor, s: Tensor, device: torch.device) -> Float[Tensor, "k d_model"]:
        return cache["resid"][self.layer][b, s].to(device)

    def location(self, vlm: VLM) -> Location:
        if self.layer == -1:
            return Location(vlm.arch.layer(0), "input", whole)
        return Location(vlm.arch.layer(self.layer), "output", whole)

    @staticmethod
    def write(vlm: VLM, placed: Sequence[Placed], cache: dict | None, n: int, seq: int) -> None:
        """Inside a trace: the residual at one layer, every replica's entries."""
        layer = placed[0].site.layer
        module = vlm.module(vlm.arch.layer(max(layer, 0)))
        hid = module.input if layer == -1 else module.output
        for p in placed:
            b, s = p.b.to(hid.device) + p.replica * n, p.s.to(hid.device)
            hid[b, s] = written(vlm, p, cache, hid[b, s]).to(hid.dtype)


@dataclass(frozen=True)
class HeadZ:
    """Head ``head``'s z at decoder layer ``layer``: its columns of o_proj's input."""

    layer: int
    head: int
    stage: ClassVar[int] = 1

    def width(self, arch: Arch) -> int:
        return arch.head_dim(self.layer)

    def columns(self, arch: Arch) -> slice:
        """The head's columns of the layer's z (n_heads·d_head wide)."""
        d_head = arch.head_dim(self.layer)
        return slice(self.head * d_head, (self.head + 1) * d_head)

    def read(self, vlm: VLM, cache: dict, b: Tensor, s: Tensor, device: torch.device) -> Float[Tensor, "k d_head"]:
        return cache["z"][self.layer][b, s, self.columns(vlm.arch)].to(device)

    def location(self, vlm: VLM) -> Location:
        vlm.arch.heads(self.layer)
        return Location(vlm.arch.o_proj(self.layer), "input", columns(self.columns(vlm.arch)))

    @staticmethod
    def write(vlm: VLM, placed: Sequence[Placed], cache: dict | None, n: int, seq: int) -> None:
        """Inside a trace: heads' z at one layer, every replica's entries."""
        zin = vlm.module(vlm.arch.o_proj(placed[0].site.layer)).input
        for p in placed:
            cols = p.site.columns(vlm.arch)
            b, s = p.b.to(zin.device) + p.replica * n, p.s.to(zin.device)
            zin[b, s, cols] = written(vlm, p, cache, zin[b, s, cols]).to(zin.dtype)


@dataclass(frozen=True)
class Expert:
    """Expert ``expert``'s contribution at MoE layer ``layer`` (a cache recorded with experts=True)."""

    layer: int
    expert: int
    stage: ClassVar[int] = 2

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def read(self, vlm: VLM, cache: dict, b: Tensor, s: Tensor, device: torch.device) -> Float[Tensor, "k d_model"]:
        module = vlm.hf.get_submodule(vlm.arch.experts(self.layer))
        return expert_rule(vlm.arch).cached(module, cache["experts"][self.layer], self.expert, b, s, device)

    @staticmethod
    def write(vlm: VLM, placed: Sequence[Placed], cache: dict | None, n: int, seq: int) -> None:
        """Inside a trace: experts' contributions at one MoE layer, every replica's entries (the
        experts module sees the tokens flattened: row · seq + position)."""
        path = vlm.arch.experts(placed[0].site.layer)
        refuse_ops(placed, "an expert's contribution")
        writes = [
            ((p.b + p.replica * n) * seq + p.s, p.site.expert, lambda device, p=p: source(vlm, p, cache, device))
            for p in placed
        ]
        expert_rule(vlm.arch).write(vlm.hf.get_submodule(path), vlm.module(path), vlm.arch.n_experts, writes)


@dataclass(frozen=True)
class ImageStates:
    """A cross-attention model's image states: at layer −1 the projector's output, which every
    cross-attention layer reads; at a cross-attention layer the states that layer alone reads."""

    layer: int
    stage: ClassVar[int] = 0  # the projector's output, or a cross-attention layer's input

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def read(self, vlm: VLM, cache: dict, b: Tensor, s: Tensor, device: torch.device) -> Float[Tensor, "k d_model"]:
        states = cache["states"]
        return states[b.to(states.device), s.to(states.device)].to(device)

    @staticmethod
    def write(vlm: VLM, placed: Sequence[Placed], cache: dict | None, n: int, seq: int) -> None:
        """Inside a trace: image states at one layer, every replica's entries — the projector's output
        written in place, or a patched copy passed to the cross-attention layer in place of the
        states every cross-attention layer shares."""
        layer, cross = placed[0].site.layer, vlm.arch.spec.cross_attention
        refuse_ops(placed, "the image states")
        n_states = placed[0].mask.shape[1]

        def per_row(states: Tensor) -> Tensor:
            if states.numel() % (n_states * states.shape[-1]):
                raise InputError(
                    f"the image states {tuple(states.shape)} are not rows of {n_states} states: the edit's "
                    "mask was made for another batch (build it from the batch that runs)"
                )
            return states.view(-1, n_states, states.shape[-1])

        if layer == -1:
            rows = per_row(vlm.module(cross.states).output)  # (rows, images, tiles, patches, d): in place
        else:
            if vlm.arch.kind(layer) != "cross":
                raise ValueError(f"layer {layer} is not a cross-attention layer; its attention reads no image states")
            attn = vlm.module(f"{vlm.arch.layer(layer)}.{cross.attn}")
            args, kwargs = attn.inputs
            states = kwargs[cross.states_kwarg].clone()  # (rows · images · tiles, patches, d)
            rows = per_row(states)
        for p in placed:
            src = source(vlm, p, cache, rows.device)
            rows[p.b.to(rows.device) + p.replica * n, p.s.to(rows.device)] = src.to(rows.device, rows.dtype)
        if layer != -1:
            attn.inputs = (args, {**kwargs, cross.states_kwarg: states})


# ----------------------------------------------------------------------------- where a site lives


class Location(NamedTuple):
    """Where a site lives in the HF model: a module, whether the site is its ``input`` (first
    argument) or its ``output`` (first element), and ``view``: the site's (batch, seq, width) view of
    that tensor (in place: writing into the view writes the tensor)."""

    path: str
    io: str
    view: Callable[[Tensor], Tensor]


def whole(t: Tensor) -> Tensor:
    return t


def columns(cols: slice) -> Callable[[Tensor], Tensor]:
    """The view of a (batch, seq, width) tensor's columns ``cols``."""
    return lambda t: t[..., cols]


def head_axis(layout: str, head: int, n_heads: int, d_head: int) -> Callable[[Tensor], Tensor]:
    """The view of one head of q in ``layout`` ("bs(hd)", "bs(qkv)", "bshd", "bhsd") as (batch, seq, d_head)."""
    if layout in ("bs(hd)", "bs(qkv)"):
        return columns(slice(head * d_head, (head + 1) * d_head))
    if layout == "bshd":
        return lambda t: t[:, :, head]
    return lambda t: t[:, head]


def first_output(output):
    """A module's output tensor: Llama 4's MoE block returns (output, router logits)."""
    return output[0] if isinstance(output, tuple) else output


def mlp_path(vlm: VLM, layer: int) -> str:
    """A decoder layer's MLP module (``mlp``, or Llama 4's ``feed_forward``)."""
    path = vlm.arch.layer(layer)
    for name in ("mlp", "feed_forward"):
        try:
            vlm.hf.get_submodule(f"{path}.{name}")
        except AttributeError:
            continue
        return f"{path}.{name}"
    raise InputError(f"layer {layer} of {vlm.arch.name} has no mlp or feed_forward module: its MLP is no site")


def refuse_ops(placed: Sequence[Placed], what: str) -> None:
    if any(p.op is not None for p in placed):
        raise InputError(f"{what} can only be overwritten (Patch, Zero, Mean, Resample), not added to or scaled")


def write_at(vlm: VLM, placed: Sequence[Placed], cache: dict | None, n: int, seq: int) -> None:
    """Inside a trace: sites of one kind at one layer, written through their `Location`. A site
    without a recorded cache of its own reads its values from the edit (``Placed.value``) or ``op``."""
    for p in placed:
        loc = p.site.location(vlm)
        envoy = vlm.module(loc.path)
        view = loc.view(envoy.input if loc.io == "input" else first_output(envoy.output))
        b, s = p.b.to(view.device) + p.replica * n, p.s.to(view.device)
        view[b, s] = written(vlm, p, cache, view[b, s]).to(view.dtype)


@dataclass(frozen=True)
class Q:
    """Head ``head``'s query at ``layer``: after any q-norm, before rotary (where head temperature
    scales it: `Arch.q_site`); a fused projection's q columns."""

    layer: int
    head: int
    stage: ClassVar[float] = 0.5
    write = staticmethod(write_at)

    def width(self, arch: Arch) -> int:
        return arch.head_dim(self.layer)

    def location(self, vlm: VLM) -> Location:
        arch = vlm.arch
        path = arch.q_site(self.layer)
        if arch.spec.q_norm_shared_with_k and path.endswith(arch.spec.q_norm):
            raise InputError(
                f"{arch.name} normalises q and k with one module at layer {self.layer}: its q is no site of its own; "
                "scale a head's attention with countlens.circuits.head_temperature"
            )
        _check_head(arch, self.layer, self.head, arch.heads(self.layer), "head")
        return Location(
            path, "output", head_axis(arch.q_layout(self.layer), self.head, arch.heads(self.layer), self.width(arch))
        )


@dataclass(frozen=True)
class K:
    """Key-value head ``head``'s key at ``layer``: its columns of the k projection's output (before
    any k-norm and rotary; a fused qkv projection's k columns)."""

    layer: int
    head: int
    stage: ClassVar[float] = 0.6
    write = staticmethod(write_at)
    part: ClassVar[int] = 1

    def width(self, arch: Arch) -> int:
        return arch.head_dim(self.layer)

    def location(self, vlm: VLM) -> Location:
        arch = vlm.arch
        arch.require_softmax(self.layer, f"the {type(self).__name__.lower()} site")
        if arch.kind(self.layer) == "cross":
            raise InputError(
                f"layer {self.layer} of {arch.name} is a cross-attention layer: its keys and values are the "
                "image states' (the ImageStates site), not the text's"
            )
        d, base = arch.head_dim(self.layer), arch.layer(self.layer)
        if arch.spec.fused_qkv:
            path = f"{base}.{arch.spec.q_proj}"
            n_kv = (vlm.hf.get_submodule(path).out_features // d - arch.heads(self.layer)) // 2
            start = arch.heads(self.layer) * d + (self.part - 1) * n_kv * d
        else:
            k = f"{base}.{arch.spec.k_proj}"
            path = k if self.part == 1 else k.rsplit(".", 1)[0] + ".v_proj"
            n_kv, start = vlm.hf.get_submodule(path).out_features // d, 0
        _check_head(arch, self.layer, self.head, n_kv, "key-value head")
        return Location(path, "output", columns(slice(start + self.head * d, start + (self.head + 1) * d)))


@dataclass(frozen=True)
class V(K):
    """Key-value head ``head``'s value at ``layer``: its columns of the v projection's output."""

    stage: ClassVar[float] = 0.7
    part: ClassVar[int] = 2


@dataclass(frozen=True)
class MlpIn:
    """The input of layer ``layer``'s MLP (after its pre-MLP norm)."""

    layer: int
    stage: ClassVar[float] = 1.5
    write = staticmethod(write_at)

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def location(self, vlm: VLM) -> Location:
        return Location(mlp_path(vlm, self.layer), "input", whole)


@dataclass(frozen=True)
class MlpOut:
    """The output of layer ``layer``'s MLP (a mixture-of-experts layer's whole block)."""

    layer: int
    stage: ClassVar[float] = 2.5
    write = staticmethod(write_at)

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def location(self, vlm: VLM) -> Location:
        return Location(mlp_path(vlm, self.layer), "output", whole)


def _check_head(arch: Arch, layer: int, head: int, n: int, what: str) -> None:
    if not 0 <= head < n:
        raise InputError(f"{what} {head} out of range: layer {layer} of {arch.name} has {what}s 0..{n - 1}")


Site = Residual | HeadZ | Expert | ImageStates | Q | K | V | MlpIn | MlpOut


GROUPS: tuple[str, ...] = ("image", "last", "text", "all")
#: The image states of a cross-attention model, patched as a group of `patch_layers`.
STATES = "image_states"


def checked_heads(arch: Arch, heads: Iterable) -> list[tuple[int, int]]:
    """``heads`` as (layer, head) pairs, each given as a pair or a label such as "L3H2"
    (`countlens.labels.head_key`), checked against the model's layers and heads."""
    if isinstance(heads, str) or is_head_pair(heads):
        heads = [heads]  # one head given alone: "L0H0", (0, 0) or [0, 0]
    out = []
    for head in heads:
        layer, h = head_key(head)
        arch.layer(layer)
        if not 0 <= h < arch.heads(layer):
            raise InputError(
                f"head {h} out of range: layer {layer} of {arch.name} has heads 0..{arch.heads(layer) - 1}"
            )
        out.append((layer, h))
    return out


def check_group(group: str) -> str:
    """``group`` if it names a token group (`GROUPS`), else an `InputError` listing them. Sweeps call
    it before they open their store, so a misspelt group leaves no spec.json to block the rerun."""
    if group not in GROUPS:
        raise InputError(f"unknown token group {group!r}; use one of {GROUPS}")
    return group


def group_mask(batch: Batch, group: str) -> Bool[Tensor, "batch seq"]:
    """The positions of ``group`` in each row of a prepared `Batch`."""
    check_group(group)
    ids = batch.inputs["input_ids"]
    real = batch.inputs["attention_mask"].bool()
    mask = torch.zeros_like(real)
    if group == "all":
        return real.clone()
    answer = _answer_span(batch, ids.shape[1]).to(real.device)
    if group == "last":
        return answer
    if group == "image" and batch.state_cells:
        raise InputError(
            "this model has no image tokens: its image reaches the text only through cross-attention, as "
            "image states — a site (patch_layers' group 'image_states'), not positions in the sequence"
        )
    for b, pos in enumerate(batch.image_pos):
        mask[b, pos] = True
    if group == "image":
        return mask
    return real & ~mask & ~answer  # text: real tokens outside the image and the answer span


def _answer_span(batch: Batch, width: int) -> Tensor:
    """Bool[Tensor, "batch seq"]: each row's positions from its last prompt token to its read position."""
    pos = torch.arange(width)[None]
    return (pos >= batch.prompt_last[:, None]) & (pos <= batch.last[:, None])


def repeat_inputs(inputs: dict[str, Tensor], k: int) -> dict[str, Tensor]:
    """The batch stacked k times along dim 0 (replica r = rows r·B … (r+1)·B − 1).

    Every processor output has the sample (or, for Qwen's flattened patches, the per-image patch
    block in sample order) first, so concatenating copies keeps each replica's images aligned.
    """
    return {name: torch.cat([t] * k, dim=0) if isinstance(t, Tensor) else t for name, t in inputs.items()}


def repeat_output(out, k: int, dim: int = 0):
    """A module output (tensor, tuple, HF ModelOutput) with every tensor stacked k times along ``dim``,
    matching what the module computes on `repeat_inputs` (dim 1 for a vision tower that packs the
    batch's images into one sequence: `countlens.arch.ArchSpec.packed_tower`)."""
    if isinstance(out, Tensor):
        return torch.cat([out] * k, dim=dim)
    if isinstance(out, dict):  # HF ModelOutput is an ordered dict of its non-None fields
        return type(out)(**{name: repeat_output(v, k, dim) for name, v in out.items()})
    if isinstance(out, (tuple, list)):
        return type(out)(repeat_output(v, k, dim) for v in out)
    return out


def heads_view(z: Float[Tensor, "batch seq n_heads*d_head"], n_heads: int) -> Float[Tensor, "batch seq n_heads d_head"]:
    """z with its last axis split into the heads."""
    return z.view(*z.shape[:-1], n_heads, z.shape[-1] // n_heads)


def o_proj_weight(vlm: VLM, layer: int) -> Float[Tensor, "d_model n_heads*d_head"]:
    """o_proj's weight at ``layer``."""
    return vlm.hf.get_submodule(vlm.arch.o_proj(layer)).weight


def head_contributions(
    vlm: VLM, layer: int, z: Float[Tensor, "... n_heads*d_head"]
) -> Float[Tensor, "... n_heads d_model"]:
    """ĥ_i·W_O per head, from z."""
    w = o_proj_weight(vlm, layer)
    h = vlm.arch.heads(layer)
    w_heads = w.view(w.shape[0], h, -1).to(z.device, z.dtype)  # d_model × heads × d_head (z may sit on the CPU)
    return torch.einsum("...hd,mhd->...hm", heads_view(z, h), w_heads)
