"""Architecture specs: where each supported VLM keeps its layers, heads, image tokens and patch grid.

One `ArchSpec` per architecture, as pure data (module paths relative to the Hugging Face
``…ForConditionalGeneration`` model, config attribute names, and the name of the image-token
layout). This is the only place in countlens that knows module paths. `resolve(config)` turns the
spec into an `Arch`: the spec plus the numbers read off one model's config (layers, heads, d_head,
image token id, patch and merge size).

Adding an architecture means adding one `ArchSpec` to `SPECS`, keyed by the HF config's
``model_type``; print ``[n for n, _ in model.named_modules()]`` on a tiny config to find the paths,
and add the architecture to the test matrix (``tests/tiny_models.py``).

Layouts (how image tokens sit on the image; `countlens.layouts` maps each token to its cell):
- ``grid``: the image's tokens are the token grid (patch grid ÷ merge) in row-major order.
- ``anyres``: LLaVA-NeXT / OneVision — the base image's grid in row-major order first, then the
  high-resolution image as one finer grid in row-major order with a newline token ending each row.
- ``tiles_thumbnail``: InternVL, Idefics3 / SmolVLM — the image resized to a grid of tiles, each
  tile's token grid in row-major order, tiles in row-major order, then (when there is more than one
  tile) a thumbnail: the whole image at one tile's size (Idefics3's "global image"; its tags and
  newlines between tiles are other tokens than the image token).
- ``thumbnail_tiles``: Ovis2 — the thumbnail first, then the tiles (separated by other tokens).
- ``hd_global``: Phi-4-multimodal — the crops stitched into one grid with a newline per row, a
  separator, then the global image with a newline per row.
- ``cross_tiles``: Llama-3.2-Vision — no image tokens: the image states its cross-attention layers
  read, tile slots of a class token and the tile's patches (`CrossAttentionSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from countlens.errors import CheckpointError, LayerError, UnsupportedArchitectureError

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

#: How image tokens sit on the image (see the module docstring).
Layout = Literal["grid", "anyres", "tiles_thumbnail", "thumbnail_tiles", "hd_global", "cross_tiles", "padded_tiles"]
#: Axis order of a q-norm's output: (batch, seq, heads, d_head) or (batch, heads, seq, d_head).
QNormLayout = Literal["bshd", "bhsd"]
#: Order of the projector's output tokens: row-major, or Qwen2.5-VL's windows.
ProjectorOrder = Literal["grid", "window"]


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

    A layer is a MoE layer where its experts module exists (`countlens.vlm.VLM` finds them)."""

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
    o_proj: str = "self_attn.o_proj"
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


_QWEN = dict(
    layers="model.language_model.layers",
    final_norm="model.language_model.norm",
    vision_blocks="model.visual.blocks",
    vision_tower="model.visual",
    projector="model.visual.merger",
    merge="vision_config.spatial_merge_size",
    rope_deltas="model.rope_deltas",
)
_LLAVA = dict(
    layers="model.language_model.layers",
    final_norm="model.language_model.norm",
    vision_blocks="model.vision_tower.encoder.layers",
    vision_tower="model.vision_tower",
    projector="model.multi_modal_projector",
)

SPECS: dict[str, ArchSpec] = {
    s.name: s
    for s in [
        ArchSpec("qwen2_vl", ("qwen2_vl",), **_QWEN),
        ArchSpec("qwen2_5_vl", ("qwen2_5_vl",), projector_order="window", **_QWEN),
        ArchSpec("qwen3_vl", ("qwen3_vl",), q_norm="self_attn.q_norm", deepstack=True, **_QWEN),
        ArchSpec("qwen3_vl_moe", ("qwen3_vl_moe",), q_norm="self_attn.q_norm", deepstack=True, moe=MoESpec(), **_QWEN),
        # Hybrid: Gated DeltaNet linear attention on most layers (`LinearAttentionSpec`), softmax on every
        # fourth; its softmax layers' q_proj writes each head's query then its output gate.
        ArchSpec("qwen3_5", ("qwen3_5",), q_norm="self_attn.q_norm", linear_attention=LinearAttentionSpec(), **_QWEN),
        # GLM-4.1V: Qwen2-VL's layout (3-D rotary, a 2 × 2 merge); its image processor's pixel budget
        # counts an image's two temporal frames (`countlens.sizing`).
        ArchSpec("glm4v", ("glm4v",), **_QWEN),
        ArchSpec("llava", ("llava",), **_LLAVA),
        ArchSpec("llava_next", ("llava_next",), layout="anyres", **_LLAVA),
        ArchSpec("llava_onevision", ("llava_onevision",), layout="anyres", **_LLAVA),
        ArchSpec(
            "internvl",
            ("internvl",),
            layers="model.language_model.layers",
            final_norm="model.language_model.norm",
            vision_blocks="model.vision_tower.encoder.layer",
            vision_tower="model.vision_tower",
            projector="model.multi_modal_projector",
            q_norm="self_attn.q_norm",  # InternVL3.5's Qwen3 language models; InternVL3's Qwen2.5 have none
            q_norm_text_types=("qwen3", "qwen3_moe"),
            merge="downsample_ratio",
            merge_is_ratio=True,
            layout="tiles_thumbnail",
        ),
        ArchSpec(
            "ovis2",
            ("ovis2",),
            layers="model.language_model.layers",
            final_norm="model.language_model.norm",
            vision_blocks="model.vision_tower.transformer.encoder.layers",
            vision_tower="model.vision_tower",
            # Probabilities over the visual vocabulary times this table are the image tokens.
            projector="model.visual_embeddings_table",
            merge="vision_config.hidden_stride",
            layout="thumbnail_tiles",
        ),
        ArchSpec(
            "phi4_multimodal",
            ("phi4_multimodal",),
            layers="model.layers",
            final_norm="model.norm",
            not_language=("model.embed_tokens_extend",),
            vision_blocks="model.embed_tokens_extend.image_embed.img_processor.encoder.layers",
            vision_tower="model.embed_tokens_extend.image_embed.img_processor",
            # img_projection_up → GELU → img_projection_down, siblings of the tower; the last is named.
            projector="model.embed_tokens_extend.image_embed.img_projection_down",
            q_proj="self_attn.qkv_proj",
            k_proj="self_attn.qkv_proj",
            fused_qkv=True,
            loader="AutoModelForCausalLM",
            text_config="",
            image_token_attr="vision_config.image_token_id",
            merge=2,  # a fixed 2 × 2 average pool in the model's code
            layout="hd_global",
        ),
        ArchSpec(
            "mllama",
            ("mllama",),
            layers="model.language_model.layers",
            final_norm="model.language_model.norm",
            vision_blocks="model.vision_model.transformer.layers",  # the local encoder (then 8 gated global blocks)
            vision_tower="model.vision_model",
            projector="model.multi_modal_projector",
            layout="cross_tiles",
            cross_attention=CrossAttentionSpec(
                layers_attr="text_config.cross_attention_layers", states="model.multi_modal_projector"
            ),
        ),
        # Idefics3 and SmolVLM: Llama / SmolLM text; the image resized to whole tiles, each tile's tokens
        # (pixel-shuffled by scale_factor, row-major) after a row-and-column tag, then the whole image.
        ArchSpec(
            "idefics3",
            ("idefics3", "smolvlm"),
            layers="model.text_model.layers",
            final_norm="model.text_model.norm",
            vision_blocks="model.vision_model.encoder.layers",
            vision_tower="model.vision_model",
            projector="model.connector",
            merge="scale_factor",
            layout="tiles_thumbnail",
        ),
        ArchSpec(
            "paligemma",
            ("paligemma",),
            layers="model.language_model.layers",
            final_norm="model.language_model.norm",
            vision_blocks="model.vision_tower.encoder.layers",
            vision_tower="model.vision_tower",
            projector="model.multi_modal_projector",
            # The mix checkpoints' question-answering task prefix; the processor adds <bos> after the
            # image tokens and "\n" at the end (PaliGemmaProcessor).
            plain_prompt="{image}answer en {question}",
            answer_token_type="token_type_ids",
        ),
        # Mistral 3 (Mistral-Small-3.1 …): Pixtral's tower over the image at its own size (longest edge,
        # whole tokens), a 2 × 2 patch merger; [IMG] tokens row by row, each row ended by [IMG_BREAK]
        # (the last by [IMG_END]), which are other tokens than the image token.
        ArchSpec(
            "mistral3",
            ("mistral3",),
            layers="model.language_model.layers",
            final_norm="model.language_model.norm",
            vision_blocks="model.vision_tower.transformer.layers",
            vision_tower="model.vision_tower",
            projector="model.multi_modal_projector",
            merge="spatial_merge_size",
            packed_tower=True,
        ),
        # Gemma 4: its full-attention layers have their own head size (a heterogeneous text config:
        # `_layer_configs`); the image at the most pooled tokens its aspect allows (`countlens.sizing`),
        # row-major over the pooled grid; the projector's output is flat (tokens of all images, d).
        ArchSpec(
            "gemma4",
            ("gemma4",),
            layers="model.language_model.layers",
            final_norm="model.language_model.norm",
            vision_blocks="model.vision_tower.encoder.layers",
            vision_tower="model.vision_tower",
            projector="model.embed_vision",
            q_norm="self_attn.q_norm",
            merge="vision_config.pooling_kernel_size",
            per_layer_inputs_attr="hidden_size_per_layer_input",
            kv_shared_attr="num_kv_shared_layers",
        ),
        # Llama 4 (Scout, Maverick): no ``model.`` prefix; chunked attention on its RoPE layers, global
        # attention without RoPE on every fourth; mixture-of-experts MLPs whose experts run on every
        # token, the routing weight scaling the input; images padded onto a canvas of tiles, then a
        # stretched global tile; only <|patch|> tokens (the config's image token) carry it.
        ArchSpec(
            "llama4",
            ("llama4",),
            layers="language_model.model.layers",
            final_norm="language_model.model.norm",
            lm_head="language_model.lm_head",
            vision_blocks="vision_model.model.layers",
            vision_tower="vision_model",
            projector="multi_modal_projector",
            q_norm="self_attn.qk_norm",
            q_norm_shared_with_k=True,
            merge="vision_config.pixel_shuffle_ratio",
            merge_is_ratio=True,
            layout="padded_tiles",
            missing_output_fields=(("language_model", "image_outputs"),),
            moe=MoESpec(
                experts="feed_forward.experts",
                router="feed_forward.router",
                n_experts_attr="num_local_experts",
                rule="scaled_inputs",
            ),
        ),
        ArchSpec(
            "gemma3",
            ("gemma3",),
            q_norm="self_attn.q_norm",
            q_norm_layout="bhsd",
            pooled_tokens_attr="mm_tokens_per_image",
            **_LLAVA,
        ),
    ]
}
_BY_MODEL_TYPE = {t: s for s in SPECS.values() for t in s.model_types}


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
    # (found on the model by `countlens.vlm.VLM`: a spec cannot say which layers stay dense).
    n_experts: int = 0
    experts_top_k: int = 0
    expert_layers: tuple[int, ...] = ()
    # The layers whose q-norm module exists, where only some have one (Llama 4: its RoPE layers; found
    # on the model by `countlens.vlm.VLM`); None: every layer of a model with a q-norm.
    q_norm_layers: tuple[int, ...] | None = None
    # Whether the input of layer 0 ("layer −1") carries all of the image: not with DeepStack (Qwen3-VL)
    # or per-layer inputs (Gemma 4 E2B / E4B), which add image features inside the decoder.
    image_in_embeddings: bool = True
    # Last layers that reuse an earlier layer's keys and values (Gemma 4 E2B / E4B); 0 for most models.
    kv_shared_layers: int = 0

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
        return tuple(p.rsplit(".", 1)[-1] for p in (self.spec.q_proj, self.spec.k_proj, "v_proj", self.spec.o_proj))

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
    if model_type not in _BY_MODEL_TYPE:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} ({type(config).__name__}) has no countlens spec. Supported: "
            f"{', '.join(sorted(_BY_MODEL_TYPE))}. To add one, write an ArchSpec in countlens/arch.py "
            "(module paths and config names; see its docstring) and add a tiny config to tests/tiny_models.py."
        )
    return _BY_MODEL_TYPE[model_type]


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
