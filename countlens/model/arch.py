"""Resolving a model: its family's `ArchSpec` (`countlens.model.families`) plus the numbers read off its config.

`spec_for(config)` finds the spec of a config's ``model_type`` in the registry of families
(`countlens.model.families`); `resolve(config)` turns it into an `Arch`: the spec plus the numbers read off
one model's config (layers and their kinds, heads, d_head, image token id, patch and merge size).
`Arch` turns a layer index into module paths (`Arch.q_site`, `Arch.o_proj`, `Arch.experts` …), so
that the rest of countlens never writes a module path. This module names no family: what differs
between families is data in their specs.

The spec types (`ArchSpec`, `CrossAttentionSpec`, `LinearAttentionSpec`, `MoESpec`) live in
`countlens.model.families.spec` and are importable from here too; `SPECS` is every spec by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from countlens.errors import CheckpointError, LayerError, UnsupportedArchitectureError
from countlens.model.families import BY_MODEL_TYPE, SPECS
from countlens.model.families.spec import (
    ArchSpec,
    CrossAttentionSpec,
    ExpertRule,
    Layout,
    LinearAttentionSpec,
    MoESpec,
    ProjectorOrder,
    QNormLayout,
)

__all__ = [
    "SOFTMAX_KINDS",
    "SPECS",
    "Arch",
    "ArchSpec",
    "CrossAttentionSpec",
    "ExpertRule",
    "LayerKind",
    "Layout",
    "LinearAttentionSpec",
    "MoESpec",
    "ProjectorOrder",
    "QNormLayout",
    "resolve",
    "spec_for",
    "text_config",
]

#: What a decoder layer's attention is: softmax over the whole prefix ("full"), over a sliding window
#: ("sliding"), within fixed chunks of the sequence ("chunked", Llama 4), a linear recurrence without
#: softmax ("linear", Qwen3.5's Gated DeltaNet), or softmax over the image states ("cross",
#: Llama-3.2-Vision).
LayerKind = Literal["full", "sliding", "chunked", "linear", "cross"]
#: Layer kinds whose heads have attention probabilities (head temperature and attention metrics).
SOFTMAX_KINDS: tuple[str, ...] = ("full", "sliding", "chunked", "cross")
#: The text config's ``layer_types`` values, as layer kinds.
_LAYER_TYPES = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "linear",
}


@dataclass(frozen=True)
class Arch:
    """A spec resolved against one model's config."""

    spec: ArchSpec
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    image_token_id: int
    patch_size: int
    merge_size: int
    q_norm: str | None = None  # the spec's q-norm where this model has one
    cross_layers: tuple[int, ...] = ()  # decoder layers that attend to the image states
    # Per decoder layer: its kind (`LayerKind`), heads and head size. ``n_heads`` is the widest layer's
    # heads (the head axis of every per-head result; NaN beyond a layer's own heads), ``d_head`` the
    # softmax heads' size where every layer has the same.
    kinds: tuple[str, ...] = ()
    head_counts: tuple[int, ...] = ()
    head_dims: tuple[int, ...] = ()
    # Mixture-of-experts models: experts per MoE layer, experts chosen per token, and the MoE layers
    # (found on the model by `countlens.model.vlm.VLM`: a spec cannot say which layers stay dense).
    n_experts: int = 0
    experts_top_k: int = 0
    expert_layers: tuple[int, ...] = ()
    # The layers whose q-norm module exists, where only some have one (Llama 4: its RoPE layers; found
    # on the model by `countlens.model.vlm.VLM`); None: every layer of a model with a q-norm.
    q_norm_layers: tuple[int, ...] | None = None
    # Whether the input of layer 0 ("layer −1") carries all of the image: not with DeepStack (Qwen3-VL)
    # or per-layer inputs (Gemma 4 E2B / E4B), which add image features inside the decoder.
    image_in_embeddings: bool = True
    # Last layers that reuse an earlier layer's keys and values (Gemma 4 E2B / E4B); 0 for most models.
    kv_shared_layers: int = 0
    # Whether this model's layers have the spec's `Sandwich` norms (Gemma 2-4).
    sandwiched: bool = False

    def __post_init__(self):
        n = self.n_layers
        kinds = self.kinds or tuple("cross" if i in self.cross_layers else "full" for i in range(n))
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "head_counts", self.head_counts or (self.n_heads,) * n)
        object.__setattr__(self, "head_dims", self.head_dims or (self.d_head,) * n)

    @property
    def name(self) -> str:
        return self.spec.name

    def layer(self, i: int) -> str:
        self._check_layer(i)
        return f"{self.spec.layers}.{i}"

    def kind(self, i: int) -> str:
        """Layer ``i``'s `LayerKind`: "full", "sliding", "linear" or "cross"."""
        self._check_layer(i)
        return self.kinds[i]

    def heads(self, i: int) -> int:
        """Layer ``i``'s heads (a linear-attention layer's value heads)."""
        self._check_layer(i)
        return self.head_counts[i]

    def head_dim(self, i: int) -> int:
        """The size of each of layer ``i``'s heads: its z is ``heads(i)`` × ``head_dim(i)`` wide."""
        self._check_layer(i)
        return self.head_dims[i]

    def softmax(self, i: int) -> bool:
        """Whether layer ``i``'s heads have attention probabilities (not a linear-attention layer)."""
        return self.kind(i) in SOFTMAX_KINDS

    def require_softmax(self, i: int, what: str) -> None:
        """Refuse ``what`` (head temperature, reading attention) on a linear-attention layer."""
        if not self.softmax(i):
            raise LayerError(
                f"{what} needs softmax attention, but layer {i} of {self.name} is a {self.kind(i)}-attention "
                f"layer (no softmax, no attention probabilities); use one of its softmax layers: {self.softmax_layers}"
            )

    @property
    def softmax_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.kinds[i] in SOFTMAX_KINDS]

    @property
    def uniform_heads(self) -> bool:
        """Every layer has ``n_heads`` heads of ``d_head``."""
        return set(self.head_counts) == {self.n_heads} and set(self.head_dims) == {self.d_head}

    def attention(self, i: int) -> str:
        """Layer ``i``'s attention module: self-attention, cross-attention on a cross layer, or the
        linear attention of a linear layer."""
        kind = self.kind(i)
        if kind == "cross":
            return f"{self.layer(i)}.{self.spec.cross_attention.attn}"
        if kind == "linear":
            return f"{self.layer(i)}.{self.spec.linear_attention.attn}"
        return f"{self.layer(i)}.{self.spec.self_attn}"

    def q_site(self, i: int) -> str:
        """The module whose output is q after any q-norm (where head temperature scales q)."""
        self.require_softmax(i, "q (head temperature)")
        if self.kind(i) == "cross":
            return f"{self.layer(i)}.{self.spec.cross_attention.q_norm}"
        return f"{self.layer(i)}.{self.spec.q_proj if self._no_q_norm(i) else self.q_norm}"

    def _no_q_norm(self, i: int) -> bool:
        return self.q_norm is None or (self.q_norm_layers is not None and i not in self.q_norm_layers)

    def q_layout(self, i: int) -> str:
        """Axis order of `q_site`'s output: "bs(hd)" (a projection), "bs(qkv)" (a fused one), "bshd" or "bhsd"."""
        if self.kind(i) == "cross":
            return self.spec.cross_attention.q_norm_layout
        if not self._no_q_norm(i):
            return self.spec.q_norm_layout
        return "bs(qkv)" if self.spec.fused_qkv else "bs(hd)"

    def o_proj(self, i: int) -> str:
        """Layer ``i``'s output projection, whose input is every head's z side by side."""
        kind = self.kind(i)
        if kind == "cross":
            return f"{self.layer(i)}.{self.spec.cross_attention.o_proj}"
        if kind == "linear":
            return f"{self.layer(i)}.{self.spec.linear_attention.o_proj}"
        return f"{self.layer(i)}.{self.spec.o_proj}"

    def q_proj(self, i: int) -> str:
        """Layer ``i``'s q projection (a fused qkv projection where the spec has one)."""
        return f"{self.layer(i)}.{self.spec.q_proj}"

    def k_proj(self, i: int) -> str:
        """Layer ``i``'s k projection (a fused qkv projection where the spec has one)."""
        return f"{self.layer(i)}.{self.spec.k_proj}"

    def v_proj(self, i: int) -> str:
        """Layer ``i``'s v projection (a fused qkv projection where the spec has one)."""
        return f"{self.layer(i)}.{self.spec.v_proj}"

    def mlp(self, i: int) -> str:
        """Layer ``i``'s MLP module (its input: the normed residual; its output: what it adds)."""
        return f"{self.layer(i)}.{self.spec.mlp}"

    def attn_norm(self, i: int) -> str:
        """The norm before layer ``i``'s attention."""
        return f"{self.layer(i)}.{self.spec.attn_norm}"

    def mlp_norm(self, i: int) -> str:
        """The norm before layer ``i``'s MLP."""
        name = self.spec.sandwich.mlp_norm if self.sandwiched else self.spec.mlp_norm
        return f"{self.layer(i)}.{name}"

    def post_norms(self, i: int) -> tuple[str, ...]:
        """The norms of layer ``i``'s attention and MLP outputs before they join the stream (Gemma 2-4's);
        () for pre-norm layers."""
        if not self.sandwiched:
            self._check_layer(i)
            return ()
        s = self.spec.sandwich
        return (f"{self.layer(i)}.{s.after_attention}", f"{self.layer(i)}.{s.after_mlp}")

    def norms(self, i: int) -> tuple[str, ...]:
        """Every norm of decoder layer ``i`` on the residual stream's path: before attention, before the
        MLP, and any after them (q- and k-norms inside attention are not among them)."""
        return (self.attn_norm(i), self.mlp_norm(i), *self.post_norms(i))

    @property
    def final_norm(self) -> str:
        return self.spec.final_norm

    @property
    def embed(self) -> str:
        """The token embeddings."""
        return self.spec.embed_tokens or f"{self.spec.layers.rsplit('.', 1)[0]}.embed_tokens"

    @property
    def lm_head(self) -> str:
        return self.spec.lm_head

    def vision_block(self, i: int) -> str:
        """Block ``i`` of the vision tower."""
        return f"{self.spec.vision_blocks}.{i}"

    @property
    def vision_encoder(self) -> str:
        """The module that holds the vision blocks (a windowed tower's own ordering rule reads it)."""
        return self.spec.vision_blocks.rsplit(".", 1)[0]

    def experts(self, i: int) -> str:
        """Layer ``i``'s experts module (a MoE layer's)."""
        self._check_layer(i)
        if i not in self.expert_layers:
            raise LayerError(
                f"layer {i} of {self.name} has no experts; its mixture-of-experts layers are {list(self.expert_layers)}"
            )
        return f"{self.layer(i)}.{self.spec.moe.experts}"

    def router(self, i: int) -> str:
        """Layer ``i``'s router (a MoE layer's)."""
        return self.experts(i).removesuffix(self.spec.moe.experts) + self.spec.moe.router

    @property
    def projections(self) -> tuple[str, ...]:
        """The attention projections' module names (LoRA's targets): q, k, v, o, or fused qkv and o."""
        if self.spec.fused_qkv:
            return (self.spec.q_proj.rsplit(".", 1)[-1], self.spec.o_proj.rsplit(".", 1)[-1])
        names = (self.spec.q_proj, self.spec.k_proj, self.spec.v_proj, self.spec.o_proj)
        return tuple(p.rsplit(".", 1)[-1] for p in names)

    def _check_layer(self, i: int) -> None:
        if not 0 <= i < self.n_layers:
            raise LayerError(f"layer {i} out of range: {self.name} has layers 0..{self.n_layers - 1}")

    def __repr__(self) -> str:
        kinds = {k: self.kinds.count(k) for k in dict.fromkeys(self.kinds)}
        mixed = "" if list(kinds) == ["full"] else " (" + ", ".join(f"{n} {k}" for k, n in kinds.items()) + ")"
        return (
            f"Arch({self.name}: {self.n_layers} layers{mixed} × {self.n_heads} heads (kv {self.n_kv_heads}), "
            f"d_head {self.d_head}, d_model {self.d_model}, patch {self.patch_size}, merge {self.merge_size}, "
            f"image token {self.image_token_id})"
        )


def spec_for(config) -> ArchSpec:
    model_type = getattr(config, "model_type", None)
    if model_type not in BY_MODEL_TYPE:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} ({type(config).__name__}) has no countlens spec. Supported: "
            f"{', '.join(sorted(BY_MODEL_TYPE))}. To add one, write a family module in countlens/model/families/ "
            "(its ArchSpec and Family; see docs/architectures.md) and add its tiny builder under "
            "countlens/toy/tiny_models/."
        )
    return BY_MODEL_TYPE[model_type]


def text_config(config, spec: ArchSpec):
    """The language model's config: the spec's sub-config, or the config itself (Phi-4)."""
    return getattr(config, spec.text_config) if spec.text_config else config


def resolve(config) -> Arch:
    spec = spec_for(config)
    text = text_config(config, spec)
    vision = getattr(config, spec.vision_config)
    n_heads = text.num_attention_heads
    per_layer = _layer_configs(text)
    kinds, head_counts, head_dims = _layers(config, spec, text, per_layer)
    softmax_dims = [d for k, d in zip(kinds, head_dims) if k in SOFTMAX_KINDS] or head_dims
    d_head = max(softmax_dims)
    image_token_id = _config_value(config, spec.image_token_attr, "the image token id", None)
    if image_token_id is None:
        image_token_id = config.image_token_index
    patch = vision.patch_size[0] if isinstance(vision.patch_size, (list, tuple)) else vision.patch_size
    if isinstance(spec.merge, int):
        merge = spec.merge
    elif spec.merge:
        merge = _config_value(config, spec.merge, "the merge size")
        if spec.merge_is_ratio:
            merge = _inverse_ratio(merge, spec.merge)
    elif spec.pooled_tokens_attr:
        side = vision.image_size // patch
        per_side = round(getattr(config, spec.pooled_tokens_attr) ** 0.5)
        merge = side // per_side
    else:
        merge = 1
    return Arch(
        spec=spec,
        n_layers=text.num_hidden_layers,
        n_heads=max(head_counts),
        n_kv_heads=max(getattr(c, "num_key_value_heads", None) or n_heads for c in per_layer),
        d_head=d_head,
        d_model=text.hidden_size,
        image_token_id=int(image_token_id),
        patch_size=int(patch),
        merge_size=int(merge),
        q_norm=spec.q_norm if _has_q_norm(spec, text) else None,
        cross_layers=_cross_layers(config, spec),
        kinds=kinds,
        head_counts=head_counts,
        head_dims=head_dims,
        image_in_embeddings=not spec.deepstack
        and not (spec.per_layer_inputs_attr and getattr(text, spec.per_layer_inputs_attr, 0)),
        kv_shared_layers=int(getattr(text, spec.kv_shared_attr, 0) or 0) if spec.kv_shared_attr else 0,
        sandwiched=spec.sandwich is not None
        and (spec.sandwich.text_types is None or getattr(text, "model_type", None) in spec.sandwich.text_types),
        n_experts=int(getattr(text, spec.moe.n_experts_attr, 0) or 0) if spec.moe else 0,
        experts_top_k=int(getattr(text, spec.moe.top_k_attr, 0) or 0) if spec.moe else 0,
    )


def _layer_configs(text) -> list:
    """Each decoder layer's config: the text config, or where its settings vary by layer (transformers'
    heterogeneous configs: Gemma 4's full-attention layers have their own head size) the layer's view."""
    n = text.num_hidden_layers
    try:
        per_layer = text.per_layer_config
    except AttributeError:
        per_layer = None
    return [text] * n if per_layer is None else [per_layer[i] for i in range(n)]


def _layers(config, spec: ArchSpec, text, per_layer: list) -> tuple[tuple, tuple, tuple]:
    """Per decoder layer: its kind, heads and head size."""
    n = text.num_hidden_layers
    cross = set(_cross_layers(config, spec))
    types = getattr(text, "layer_types", None) or ["full_attention"] * n
    if len(types) != n:
        raise CheckpointError(f"{type(text).__name__}.layer_types has {len(types)} entries for {n} layers")
    kinds = []
    for i, t in enumerate(types):
        kind = "cross" if i in cross else _LAYER_TYPES.get(t)
        if kind is None:
            raise CheckpointError(
                f"layer {i} is of type {t!r}, which countlens does not know; known: {sorted(_LAYER_TYPES)}"
            )
        if kind == "linear" and spec.linear_attention is None:
            raise CheckpointError(
                f"layer {i} is a linear-attention layer, but the {spec.name} spec names no linear attention"
            )
        kinds.append(kind)
    counts, dims = [], []
    for kind, layer in zip(kinds, per_layer):
        if kind == "linear":
            lin = spec.linear_attention
            counts.append(int(getattr(text, lin.heads_attr)))
            dims.append(int(getattr(text, lin.head_dim_attr)))
        else:
            heads = int(layer.num_attention_heads)
            counts.append(heads)
            dims.append(int(getattr(layer, "head_dim", None) or layer.hidden_size // heads))
    return tuple(kinds), tuple(counts), tuple(dims)


def _cross_layers(config, spec: ArchSpec) -> tuple[int, ...]:
    if spec.cross_attention is None:
        return ()
    return tuple(sorted(int(i) for i in _config_value(config, spec.cross_attention.layers_attr, "the cross layers")))


def _has_q_norm(spec: ArchSpec, text) -> bool:
    return spec.q_norm is not None and (
        spec.q_norm_text_types is None or getattr(text, "model_type", None) in spec.q_norm_text_types
    )


_REQUIRED = object()


def _config_value(config, path: str, what: str, default=_REQUIRED):
    """The value at a dotted ``path`` from the top config; ``default`` where it is missing, or an error."""
    value = config
    for part in path.split("."):
        if not hasattr(value, part):
            if default is not _REQUIRED:
                return default
            raise CheckpointError(f"{type(config).__name__} has no {path!r}, which countlens reads as {what}")
        value = getattr(value, part)
    return value


def _inverse_ratio(ratio: float, path: str) -> int:
    """The merge size a downsampling ratio stands for (0.5 → 2), refusing ratios that are not 1/n."""
    merge = round(1 / ratio) if ratio and ratio > 0 else 0
    if merge < 1 or abs(merge * ratio - 1) > 1e-6:
        raise CheckpointError(f"{path} = {ratio!r} is not 1/n for a whole n; countlens needs a whole merge size")
    return merge
