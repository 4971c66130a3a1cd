"""Sites inside attention: a head's query `Q`, a key-value head's key `K` and value `V`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from countlens.circuits.sites.location import HOOKS, TRACE, Location, check_indices, columns, head_axis, whole
from countlens.errors import InputError
from countlens.labels import attn_in_label, kv_label, pattern_label, query_label
from countlens.model.adapt import module_of

if TYPE_CHECKING:
    from countlens.model.arch import Arch
    from countlens.model.vlm import VLM


@dataclass(frozen=True)
class Q:
    """Head ``head``'s query at ``layer``: after any q-norm, before rotary (where head temperature
    scales it: `Arch.q_site`); a fused projection's q columns."""

    layer: int
    head: int
    stage: ClassVar[float] = 0.5
    block: ClassVar[int] = 0  # as an edge receiver: the layer's attention
    qkv: ClassVar[int] = 0  # its place among q, k and v
    part_name: ClassVar[str] = "q"
    backends: ClassVar[tuple[str, ...]] = (TRACE, HOOKS)

    def __post_init__(self):
        check_indices(self, layer=0, head=0)

    @property
    def label(self) -> str:
        return query_label((self.layer, self.head))

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
    block: ClassVar[int] = 0
    qkv: ClassVar[int] = 1
    part_name: ClassVar[str] = "k"
    backends: ClassVar[tuple[str, ...]] = (TRACE, HOOKS)

    def __post_init__(self):
        check_indices(self, layer=0, head=0)

    @property
    def label(self) -> str:
        return kv_label((self.layer, self.head), self.part_name)

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
        d = arch.head_dim(self.layer)
        if arch.spec.fused_qkv:
            path = arch.q_proj(self.layer)
            n_kv = (module_of(vlm.hf, path).out_features // d - arch.heads(self.layer)) // 2
            start = arch.heads(self.layer) * d + (self.qkv - 1) * n_kv * d
        else:
            path = arch.k_proj(self.layer) if self.qkv == 1 else arch.v_proj(self.layer)
            n_kv, start = module_of(vlm.hf, path).out_features // d, 0
        _check_head(arch, self.layer, self.head, n_kv, "key-value head")
        return Location(path, "output", columns(slice(start + self.head * d, start + (self.head + 1) * d)))


@dataclass(frozen=True)
class V(K):
    """Key-value head ``head``'s value at ``layer``: its columns of the v projection's output."""

    stage: ClassVar[float] = 0.7
    qkv: ClassVar[int] = 2
    part_name: ClassVar[str] = "v"


def _check_head(arch: Arch, layer: int, head: int, n: int, what: str) -> None:
    if not 0 <= head < n:
        raise InputError(f"{what} {head} out of range: layer {layer} of {arch.name} has {what}s 0..{n - 1}")


@dataclass(frozen=True)
class AttnIn:
    """The input of layer ``layer``'s whole attention block (after its norm): an edge receiver where
    q, k and v are not separate projections (a fused qkv, a linear-attention layer)."""

    layer: int
    block: ClassVar[int] = 0
    part_name: ClassVar[str] = "attn"
    backends: ClassVar[tuple[str, ...]] = (TRACE,)

    def __post_init__(self):
        check_indices(self, layer=0)

    @property
    def label(self) -> str:
        return attn_in_label(self.layer)

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def location(self, vlm: VLM) -> Location:
        """The attention module's input (the normed stream)."""
        return Location(vlm.arch.attention(self.layer), "input", whole)


@dataclass(frozen=True)
class Pattern:
    """Head ``head``'s attention probabilities at ``layer``, (batch, query, key): read only (`record`
    switches the language model to eager attention for it); to change attention, scale `Q`."""

    layer: int
    head: int
    backends: ClassVar[tuple[str, ...]] = (HOOKS,)  # read only

    def __post_init__(self):
        check_indices(self, layer=0, head=0)

    @property
    def label(self) -> str:
        return pattern_label((self.layer, self.head))

    def width(self, arch: Arch) -> None:
        """None: a pattern's last axis is the keys, as long as the sequence."""
        return None

    def location(self, vlm: VLM) -> Location:
        arch = vlm.arch
        arch.require_softmax(self.layer, "an attention pattern")
        _check_head(arch, self.layer, self.head, arch.heads(self.layer), "head")
        head = self.head
        return Location(arch.attention(self.layer), "weights", lambda t: t[:, head])
