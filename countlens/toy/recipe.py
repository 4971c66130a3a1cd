"""The organism's recipe: a small Qwen2-VL with its own word-level tokenizer, chat template and processor.

Everything here is built offline from code: the tokenizer from a fixed vocabulary (`VOCAB`), the
processor from `Qwen2VLImageProcessorPil` (pinned to one image size) and the model from a config.
The same functions build the shipped organism and the test fixtures, so the two cannot drift.
The training schedule, `TrainConfig`, is `countlens.toy.schedule`'s (imported here, where the recipe
is saved with it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from countlens.datasets.scene import OBJECT_COLORS, SHAPES
from countlens.errors import ConfigError
from countlens.model.geometry import Geometry
from countlens.model.processors import image_only
from countlens.toy.schedule import TrainConfig
from countlens.validate import require_count, require_image_side, require_integer, require_positive

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "[UNK]",
]
NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
# Words of the organism's tasks and of the papers' prompts (Pstd, Digit-in-Conflict), so that
# those prompts tokenize without unknown words even where the organism never saw them.
WORDS = (
    "system user assistant how many what which is are there in the image ? . , : ; ' \" ( ) - "
    "object objects shape shapes color colour of a an and or with to only number answer respond "
    "concisely using following format count total left right top bottom further yes no none "
    "picture photo please this that it see do you i think maybe not exactly hint someone said "
    "circle circles square squares triangle triangles dot dots ball balls item items thing things "
    "big small large tiny round"
).split()
VOCAB: list[str] = list(
    dict.fromkeys(
        SPECIAL_TOKENS
        + [str(i) for i in range(0, 101)]
        + NUMBER_WORDS
        + list(OBJECT_COLORS)
        + ["black", "white", "gray", "grey", "pink", "brown"]
        + list(SHAPES)
        + WORDS
    )
)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


#: `ToyConfig`'s sizes besides the image's: positive integers.
SIZES = ("patch_size", "merge_size", "vision_depth", "vision_dim", "vision_heads", "text_layers", "hidden", "heads")
SIZES += ("kv_heads", "intermediate")


@dataclass(frozen=True)
class ToyConfig:
    """Sizes of the organism. Defaults are the shipped organism's."""

    image_size: int = 192
    # With 16 px patches the tower never learns to tell circles from squares (12–22 px objects
    # straddle patches). With 8 px patches, `TrainConfig.vision_pretrain` (reading the "centre"
    # token) and `freeze_vision`, the image token at an object's centre does (0.96), but 144 image
    # tokens make every training step 2× slower (0.57 vs 0.28 s, tower frozen). Measured:
    # docs/organism/organism_vision.py, cell_shape.py, train_step.py and docs/organism/vision.md.
    patch_size: int = 16
    merge_size: int = 2
    vision_depth: int = 2
    vision_dim: int = 64
    vision_heads: int = 2
    text_layers: int = 6
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    mrope_section: tuple[int, int, int] = (4, 6, 6)  # sums to head_dim / 2 = 16
    # Init std of every weight. HF's 0.02 suits wide pretrained models; at this width it leaves
    # the image signal so faint that a from-scratch model learns only the answer prior for
    # thousands of steps (measured: 32 fixed scenes not memorised in 150 steps at 0.02, memorised
    # at 0.1).
    init_std: float = 0.1

    def __post_init__(self) -> None:
        """Every size a positive integer, before a tokenizer, processor or model is built from them."""
        require_image_side(self.image_size, "image_size", ConfigError)
        for name in SIZES:
            require_count(getattr(self, name), name, ConfigError)
        require_positive(self.init_std, "init_std", ConfigError)
        section = self.mrope_section
        if not isinstance(section, (tuple, list)) or len(section) != 3:
            raise ConfigError(f"mrope_section takes three integers (time, height, width), got {section!r:.60}")
        for part in section:
            require_integer(part, "each of mrope_section", ConfigError, low=0)

    @property
    def geometry(self):
        return Geometry.square(self.image_size, self.patch_size, self.merge_size)

    def to_dict(self) -> dict:
        return asdict(self)


def build_tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != "[UNK]"],
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_image_processor(cfg: ToyConfig):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = cfg.image_size * cfg.image_size
    return Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=2,
        size={"shortest_edge": pixels, "longest_edge": pixels},
    )


def build_processor(cfg: ToyConfig, tokenizer=None, image_processor=None):
    from transformers import Qwen2VLProcessor

    return image_only(Qwen2VLProcessor)(
        image_processor=image_processor or build_image_processor(cfg),
        tokenizer=tokenizer or build_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )


def build_config(cfg: ToyConfig):
    from transformers import Qwen2VLConfig

    tok = {t: VOCAB.index(t) for t in SPECIAL_TOKENS}
    head_dim = cfg.hidden // cfg.heads
    if 2 * sum(cfg.mrope_section) != head_dim:
        raise ValueError(f"mrope_section {cfg.mrope_section} must sum to head_dim/2 = {head_dim // 2}")
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(VOCAB),
            hidden_size=cfg.hidden,
            intermediate_size=cfg.intermediate,
            num_hidden_layers=cfg.text_layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(cfg.mrope_section)},
            tie_word_embeddings=False,
            initializer_range=cfg.init_std,
            bos_token_id=tok["<|im_start|>"],
            eos_token_id=tok["<|im_end|>"],
            pad_token_id=tok["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=cfg.vision_depth,
            embed_dim=cfg.vision_dim,
            hidden_size=cfg.hidden,
            num_heads=cfg.vision_heads,
            mlp_ratio=2,
            patch_size=cfg.patch_size,
            spatial_merge_size=cfg.merge_size,
            temporal_patch_size=2,
            in_channels=3,
            initializer_range=cfg.init_std,
        ),
        initializer_range=cfg.init_std,
        image_token_id=tok["<|image_pad|>"],
        video_token_id=tok["<|video_pad|>"],
        vision_start_token_id=tok["<|vision_start|>"],
        vision_end_token_id=tok["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    return config


def build_model(cfg: ToyConfig, seed: int = 0):
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(build_config(cfg)).eval()


def save_recipe(out: Path, cfg: ToyConfig, train: TrainConfig) -> None:
    import json

    (out / "countlens_recipe.json").write_text(
        json.dumps({"toy": cfg.to_dict(), "train": train.to_dict()}, indent=2) + "\n"
    )
