"""The types a family module fills in: `ArchSpec` (where a model keeps its parts) and `Family` (all
countlens knows of one model family), plain data that the shared code reads.

An `ArchSpec` is pure data: module paths relative to the Hugging Face model, config attribute names,
and the name of the image-token layout. `countlens.model.arch.resolve` turns it into an `Arch` with the
numbers read off one model's config. A `Family` gathers a family's specs with the few functions
only that family needs: its image processor's sizing rule (`SizingRule`, read by `countlens.model.sizing`),
the tile grid its processor cuts (read by `countlens.model.processors`), PIL image processors where
transformers has only torchvision ones, and fixes to the processor classes transformers ships.
Shared code never names a family: it asks the registry (`countlens.model.families`) by ``model_type`` or by
the image processor's class name, and calls what the family gave.

Layouts (how image tokens sit on the image; `countlens.model.layouts` maps each token to its cell):
- ``grid``: the image's tokens are the token grid (patch grid ÷ merge) in row-major order.
- ``anyres``: the base image's grid in row-major order first, then the high-resolution image as one
  finer grid in row-major order with a newline token ending each row.
- ``tiles_thumbnail``: the image resized to a grid of tiles, each tile's token grid in row-major
  order, tiles in row-major order, then (when there is more than one tile) a thumbnail: the whole
  image at one tile's size.
- ``thumbnail_tiles``: the thumbnail first, then the tiles (separated by other tokens).
- ``hd_global``: the crops stitched into one grid with a newline per row, a separator, then the
  global image with a newline per row.
- ``padded_tiles``: the image resized into a canvas of tiles and padded, the tiles one after
  another, then the whole image stretched to one tile.
- ``cross_tiles``: no image tokens: the image states cross-attention layers read, tile slots of a
  class token and the tile's patches (`CrossAttentionSpec`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

#: How image tokens sit on the image (see the module docstring).
Layout = Literal["grid", "anyres", "tiles_thumbnail", "thumbnail_tiles", "hd_global", "cross_tiles", "padded_tiles"]
#: Axis order of a q-norm's output: (batch, seq, heads, d_head) or (batch, heads, seq, d_head).
QNormLayout = Literal["bshd", "bhsd"]
#: Order of the projector's output tokens: row-major, or Qwen2.5-VL's windows.
ProjectorOrder = Literal["grid", "window"]


@dataclass(frozen=True)
class Sandwich:
    """Norms on both sides of each block (Gemma 2-4, GLM-4): the MLP's input norm, and the norms of the attention's
    and the MLP's outputs before they join the residual stream (paths relative to a decoder layer).
    ``text_types``: where one spec covers language models with and without them (PaliGemma 1 is Gemma,
    PaliGemma 2 Gemma 2), the text model_types that have them; None: every model of the spec."""

    mlp_norm: str = "pre_feedforward_layernorm"
    after_attention: str = "post_attention_layernorm"
    after_mlp: str = "post_feedforward_layernorm"
    text_types: tuple[str, ...] | None = None


@dataclass(frozen=True)
class CrossAttentionSpec:
    """Where a cross-attention VLM (Llama-3.2-Vision) reads its image: some decoder layers attend
    from the text to the image states instead of to the text (paths relative to such a layer)."""

    layers_attr: str  # dotted config path of the cross-attention layers' indices
    states: str  # the module whose output is the image states every cross-attention layer reads
    attn: str = "cross_attn"
    q_norm: str = "cross_attn.q_norm"
    q_norm_layout: QNormLayout = "bhsd"
    o_proj: str = "cross_attn.o_proj"
    # The keyword under which each cross-attention module receives the image states.
    states_kwarg: str = "cross_attention_states"


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Linear-attention layers (Qwen3.5's Gated DeltaNet): no softmax, so no attention probabilities
    and no q to scale; each value head's output, after its gated norm, enters ``o_proj`` side by side,
    so a head's z is its slice of ``o_proj``'s input, as for softmax heads (paths relative to such a
    layer; head count and size on the text config)."""

    attn: str = "linear_attn"
    o_proj: str = "linear_attn.out_proj"
    heads_attr: str = "linear_num_value_heads"
    head_dim_attr: str = "linear_value_head_dim"
    # Its projections LoRA adapts (relative to ``attn``): q, k and v together, the output gate, the output.
    projections: tuple[str, ...] = ("in_proj_qkv", "in_proj_z", "out_proj")


#: How a mixture-of-experts layer's experts module combines its experts (`MoESpec.rule`).
ExpertRule = Literal["weighted_outputs", "scaled_inputs"]


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP (paths relative to a decoder layer; counts on the text config). Rules:

    - ``weighted_outputs`` (Qwen3-VL-MoE): the experts module is called as ``experts(x, top_k_index,
      top_k_weights)`` on the flattened tokens and returns Σ_j w_j · E_{i_j}(x), each expert
      E_e(x) = down[e] · act(gate[e] x) ⊙ (up[e] x), gate and up rows stacked in ``gate_up_proj[e]``;
      the router returns (logits, top-k weights, top-k indices).
    - ``scaled_inputs`` (Llama 4): the experts module runs every expert on every token, its input
      scaled by the routing weight (0 off the top-k), and returns (experts · tokens, d): expert e's
      contribution to token t is row e·T + t; the router returns (weights over all experts, logits);
      a shared expert beside them is not an expert here.

    A layer is a MoE layer where its experts module exists (`countlens.model.vlm.VLM` finds them)."""

    experts: str = "mlp.experts"
    router: str = "mlp.gate"
    n_experts_attr: str = "num_experts"
    top_k_attr: str = "num_experts_per_tok"
    rule: ExpertRule = "weighted_outputs"


@dataclass(frozen=True)
class ArchSpec:
    name: str
    model_types: tuple[str, ...]
    layers: str  # the decoder layers' ModuleList
    final_norm: str
    vision_blocks: str  # the vision encoder blocks' ModuleList
    vision_tower: str  # the whole vision encoder (run once and reused by batch-expanded sweeps)
    projector: str  # the module whose output is the image tokens' embeddings
    # Paths relative to one decoder layer:
    self_attn: str = "self_attn"
    q_proj: str = "self_attn.q_proj"
    k_proj: str = "self_attn.k_proj"
    # One projection computes q, k and v (Phi-4's ``qkv_proj``): its output is q (heads × d_head),
    # then k, then v; head temperature scales the q columns only.
    fused_qkv: bool = False
    q_norm: str | None = None
    # Where one spec covers several language models (InternVL: Qwen2.5 or Qwen3), the text
    # model_types that have the q-norm; None: every model of the spec has it.
    q_norm_text_types: tuple[str, ...] | None = None
    # Axis order of the q-norm's output: Qwen3 normalises (batch, seq, heads, d_head), Gemma 3
    # normalises after the transpose, (batch, heads, seq, d_head).
    q_norm_layout: QNormLayout = "bshd"
    # One q-norm module normalises q, then k, in each forward (Llama 4's parameter-free L2 norm, on its
    # RoPE layers only): temperature scales its first output of each attention call.
    q_norm_shared_with_k: bool = False
    # The value projection; with ``fused_qkv`` the fused projection (v is its last columns).
    v_proj: str = "self_attn.v_proj"
    o_proj: str = "self_attn.o_proj"
    # The MLP module (Llama 4's ``feed_forward``, a MoE block on its MoE layers): its input is the MLP's
    # input after its norm, its output what the MLP adds to the residual stream.
    mlp: str = "mlp"
    # A decoder layer's norms (relative to the layer): before attention and before the MLP; or, in
    # Gemma 2-4's "sandwich" layers, `Sandwich`: a norm before and after each block.
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    sandwich: Sandwich | None = None
    # The token embeddings; None: ``embed_tokens`` beside `layers` (every family's language model so far).
    embed_tokens: str | None = None
    lm_head: str = "lm_head"
    # Modules under the decoder's parent that are not the language model (a full fine-tune leaves them
    # frozen): Phi-4's image and audio embedders sit in ``model`` beside its layers.
    not_language: tuple[str, ...] = ()
    # The transformers Auto class that loads the checkpoint.
    loader: str = "AutoModelForImageTextToText"
    # Config attributes: "" for the top config itself (Phi-4 keeps its text settings there).
    text_config: str = "text_config"
    vision_config: str = "vision_config"
    image_token_attr: str = "image_token_id"  # a dotted path from the top config
    # Patches per side merged into one image token: a dotted config path from the top config
    # (``vision_config.spatial_merge_size``), or a number where the model's code fixes it (Phi-4's
    # 2 × 2 average pool); with ``merge_is_ratio`` the path holds the inverse, a downsampling ratio
    # (InternVL's ``downsample_ratio`` 0.5 → 2 × 2). None → 1 (or `pooled_tokens_attr`).
    merge: str | int | None = None
    merge_is_ratio: bool = False
    pooled_tokens_attr: str | None = None  # on the top config: tokens per image after pooling (Gemma3)
    layout: Layout = "grid"
    # The vision tower reads an image (tile, crop) of whole patches and a remainder as its whole patches:
    # its patch convolution has stride = patch and no padding, its position embeddings count whole patches
    # (SigLIP-so400m's 384 px of 14 px patches: 27 patches, 6 px dropped at the right and bottom). A fixed
    # processor size with a remainder is then a `Geometry` with ``dropped=True``; without it, refused.
    drops_remainder: bool = False
    # Order of the projector's output tokens: "grid" (row-major, as in the LM input) or "window"
    # (Qwen2.5-VL's windowed vision blocks; the LM input is reordered to row-major afterwards).
    projector_order: ProjectorOrder = "grid"
    # Multimodal rotary positions (Qwen): the attribute where a prefill leaves each row's offset
    # between sequence index and 3-D position id, which tokens fed after a KV cache must add.
    rope_deltas: str | None = None
    # Qwen3-VL's DeepStack adds image features inside its first decoder layers: the embeddings
    # (layer −1) do not carry all of the image.
    deepstack: bool = False
    # A text config attribute that, when > 0, gives every decoder layer its own input computed from the
    # embeddings (Gemma 4's per-layer inputs, E2B / E4B): the image then reaches each layer beside the
    # residual stream, so layer −1 does not carry all of it (as with DeepStack).
    per_layer_inputs_attr: str | None = None
    # A text config attribute: how many last layers reuse the keys and values an earlier layer stored
    # during the same forward (Gemma 4 E2B / E4B's KV sharing): no layer below them may be skipped.
    kv_shared_attr: str | None = None
    # Cross-attention VLMs: the image never enters the residual stream (no image tokens).
    cross_attention: CrossAttentionSpec | None = None
    # (module path, field): an output field a model's own forward reads but transformers 5.24 does not
    # write (Llama 4's reads ``image_outputs`` off its language model's output): set to None.
    missing_output_fields: tuple[tuple[str, str], ...] = ()
    # The vision tower packs every image of a batch into one sequence, (1, patches of all images, d)
    # (Pixtral's): its output repeats along axis 1, not 0, for batch-expanded sweeps.
    packed_tower: bool = False
    # Models whose processor has no chat template (PaliGemma): the prompt written around a question,
    # with ``{image}`` for the processor's image token and ``{question}``.
    plain_prompt: str | None = None
    # A per-token input that marks the tokens after the prompt (an answer) with 1: teacher-forced and
    # continued tokens get 1 there (PaliGemma's ``token_type_ids``: 0 is the bidirectional prefix).
    answer_token_type: str | None = None
    # Mixture-of-experts language models: where the experts are (`MoESpec`).
    moe: MoESpec | None = None
    # Hybrid language models: the layers whose ``layer_types`` entry is "linear_attention".
    linear_attention: LinearAttentionSpec | None = None


#: A processor's setting as a call uses it: ``setting(key, fallback)`` reads the processor's class
#: defaults, then the image processor's attribute (`countlens.model.processors.tile_grid`).
Setting = Callable[..., Any]


@dataclass(frozen=True)
class SizingRule:
    """How a dynamic-resolution image processor sizes an image (`countlens.model.sizing`), each function
    given the image processor and its ``size`` dict (entries that are None dropped).

    ``resize(ip, size, height, width, unit)``: the (height, width) the tower sees for an input of
    ``height`` × ``width`` pixels, ``unit`` = patch × merge. ``default_side(size)``: the side of the
    square image countlens assumes when none is given (None: `countlens.model.sizing.DEFAULT_DYNAMIC_SIDE`).
    ``pinned(side)``: the ``size`` dict that makes the processor keep square images of ``side`` px,
    or None where no setting can. A rule applies to its family's image processors (by class name), or,
    with ``size_keys``, to any other processor whose ``size`` has those keys."""

    resize: Callable[[Any, dict, int, int, int], tuple[int, int]]
    default_side: Callable[[dict], int | None] = lambda size: None
    pinned: Callable[[int], dict] | None = None
    size_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """Everything countlens knows of one model family, for the registry (`countlens.model.families`).

    ``names`` are the family's class-name prefixes (``"Idefics3"``, ``"Pixtral"``): with its specs'
    model types, the words that may appear in package code only in the family's own module
    (`tests/unit/test_layers.py`). ``image_processors`` are the class-name prefixes of its image
    processors (slow, fast and PIL builds share one), by which shared code finds the family of a
    processor. Every function is optional; shared code calls one only where the family gives it."""

    name: str
    specs: tuple[ArchSpec, ...]
    names: tuple[str, ...] = ()
    image_processors: tuple[str, ...] = ()
    # The image processor's dynamic-resolution rule (`countlens.model.sizing`).
    sizing: SizingRule | None = None
    # (ip, size) -> the (height, width) of every tile where the ``size`` dict does not say it, or None.
    tile_size: Callable[[Any, dict], tuple[int, int] | None] | None = None
    # (ip, setting, height, width) -> (rows, cols) of the tiles (crops) the processor cuts an image into.
    tile_grid: Callable[[Any, Setting, int, int], tuple[int, int]] | None = None
    # (ip, setting, height, width) -> what `countlens.model.layouts` needs beside the tile grid: the useful
    # token rows and columns (``hd_global``) or the resized image's size in pixels (``padded_tiles``).
    useful_grid: Callable[[Any, Setting, int, int], tuple[int, int]] | None = None
    # PIL image processors countlens provides, by class name: each a function returning the class
    # (built on first use: transformers' image backends take seconds to import).
    pil_image_processors: Mapping[str, Callable[[], type]] = field(default_factory=dict)
    # Processor classes transformers hides behind a torchvision placeholder, by class name: each a
    # function returning a working class.
    processor_classes: Mapping[str, Callable[[], type]] = field(default_factory=dict)
    # Processors whose own apply_chat_template only adds the video processor's settings: an image-only
    # build uses the mixin's (`countlens.model.processors.image_only`).
    mixin_chat_template: tuple[str, ...] = ()
    # Remote-code model types of the family's checkpoints: model_type -> (the transformers
    # conversion's model_type, an example of a converted checkpoint), refused by `countlens.model.loading`.
    remote_code: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # (visual, grid_thw) -> the order of merge units in a windowed vision tower (``projector_order``
    # "window"), as its own code computes it.
    window_index: Callable[[Any, Any], Any] | None = None

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(t for s in self.specs for t in s.model_types)
