"""A checkpoint that disagrees with itself, refused at `countlens.load` with one message per kind.

A checkpoint directory is several files written by different tools: config.json (the model), the
weights, the image processor's settings, the tokenizer. Copied together from one original they
agree; assembled by hand, or edited, they can disagree in ways transformers builds without a word
and that fail only later — deep in a forward, or worse, silently, with image tokens mapped to the
wrong cells. Each disagreement has its own check here, and its own message naming both files, both
values and the fix:

- `check_experts`: a router choosing more experts per token than a layer has;
- `check_processor`:
  1. the image processor's patch (or merge) size is not the vision tower's: the processor would cut
     a grid the model reads as a larger image (the token counts agree; the forward fails);
  2. the image processor resizes to another size than the tower takes;
  3. then one image is prepared; when that fails, the first cause found is named: the tokenizer
     lacks the token the processor writes for an image, or is larger than the embedding and writes
     it at another id (another model's tokenizer); config.json's image-token id is not the
     tokenizer's image token (an edited id); the processor cannot prepare an image with its image
     processor (another family's); or it writes another number of image tokens than config.json's
     grid gives.

A disagreement is looked for only where something fails, or where it is certain to fail later:
real checkpoints differ in harmless ways (a tokenizer with unused added tokens beyond the
embedding), and those must load.

`countlens check` reports the same refusals as its spec group's processor row.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from countlens.errors import CheckpointError, CountlensError, ImageTokenCountError
from countlens.model.arch import text_config
from countlens.model.processor_files import VOCABULARY_FILES
from countlens.model.sizing import fixed_size

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

#: The files that hold an image processor's settings, as the messages name them.
IMAGE_PROCESSOR_FILES = "the image processor (preprocessor_config.json / processor_config.json)"
#: The files that hold a tokenizer.
TOKENIZER_FILES = "tokenizer.json / tokenizer_config.json"


def check_experts(config, spec, path: str) -> None:
    """Refuse a mixture-of-experts config whose router would choose more experts per token than the
    layer has: transformers builds such a model, and it fails only in its first forward."""
    if spec.moe is None:
        return
    text = text_config(config, spec)
    n, k = getattr(text, spec.moe.n_experts_attr, None), getattr(text, spec.moe.top_k_attr, None)
    if isinstance(n, int) and isinstance(k, int) and not 0 < k <= n:
        # The fields as config.json spells them (a config class may alias num_experts to num_local_experts).
        saved = getattr(text, "attribute_map", {})
        where = f"{spec.text_config}." if spec.text_config else ""
        top_k, experts = (where + saved.get(a, a) for a in (spec.moe.top_k_attr, spec.moe.n_experts_attr))
        raise CheckpointError(
            f"{Path(path) / 'config.json'}: {top_k} = {k} experts per token, but {experts} = {n} experts per "
            f"layer; a router chooses between 1 and {n} experts: restore both fields from the original "
            "checkpoint's config.json"
        )


def check_processor(vlm: VLM, path: str) -> None:
    """Refuse a checkpoint whose processor, tokenizer and config.json disagree (the module docstring
    lists the kinds, in the order they are checked), before any real input."""
    check_processor_settings(vlm.processor, vlm.hf.config, vlm.arch, path)
    _check_tokens_per_image(vlm, path)


def check_processor_settings(processor, config, arch, path: str) -> None:
    """The checks that need no model (patch and merge size, image size): `countlens.load` runs them
    before it reads the weights."""
    _check_patch(processor.image_processor, arch, path)
    _check_image_size(processor.image_processor, config, arch, path)
    _check_normalisation(processor.image_processor, path)


def _check_normalisation(ip, path: str) -> None:
    """A rescale factor or an image std that would blank or blow up every image (0, negative, not finite):
    named as the processor setting it is, before any image is drawn."""
    import math

    factor = getattr(ip, "rescale_factor", None)
    if getattr(ip, "do_rescale", False) and not (
        isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0
    ):
        raise CheckpointError(
            f"{path}: preprocessor_config.json's rescale_factor is {factor!r}: every image would be rescaled to "
            "nothing (or overflow); give its published value (usually 1/255 = 0.00392156862745098)"
        )
    std = getattr(ip, "image_std", None)
    if getattr(ip, "do_normalize", False) and isinstance(std, (list, tuple)):
        if not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in std):
            raise CheckpointError(
                f"{path}: preprocessor_config.json's image_std is {list(std)}: normalising divides by it; give "
                "its published, positive values"
            )


def _check_image_token(vlm: VLM, path: str) -> None:
    """Why one image's tokens went wrong, when the tokenizer is the cause: it lacks the processor's
    image token, or writes it at another id than config.json's. Called only once a prepared image has
    failed: families whose processor names a marker rather than the token placed at each image
    position (Gemma 3's <start_of_image>, Llama 4's <|image|>) are told apart by their processor's
    own ``image_token_id``, and the diagnosis is skipped for them."""
    token = getattr(vlm.processor, "image_token", None)
    if not isinstance(token, str) or not token or vlm.arch.spec.cross_attention is not None:
        return  # a processor without an image token in the text (or a cross-attention model's marker)
    tok, arch = vlm.tokenizer, vlm.arch
    found = tok.convert_tokens_to_ids(token)
    own = getattr(vlm.processor, "image_token_id", None)
    if isinstance(own, int) and own != found:
        return  # the processor's image token is a marker, not the token at image positions
    vocab = _embedded_rows(vlm)
    unknown = found is None or (found == tok.unk_token_id and token != tok.unk_token)
    # A tokenizer larger than the embedding is not proof alone (checkpoints add unused tokens), but
    # with an image token the model cannot embed, or at another id than config.json's, it is.
    larger = vocab is not None and len(tok) > vocab and (found >= vocab or found != arch.image_token_id)
    if (unknown or larger) and not any((Path(path) / f).exists() for f in VOCABULARY_FILES):
        raise CheckpointError(
            f"{path} has no tokenizer vocabulary (none of {', '.join(VOCABULARY_FILES)}), so the tokenizer "
            "countlens was given is not this checkpoint's; copy tokenizer.json and tokenizer_config.json from "
            "the original checkpoint"
        )
    if unknown or larger:
        why = (
            f"has no token {token!r}, the image token {_name(vlm.processor)} writes"
            if unknown
            else f"holds {len(tok)} tokens, more than the {vocab} the model embeds, and writes the image token "
            f"{token!r} as id {found}, not config.json's {arch.image_token_id}"
        )
        raise CheckpointError(
            f"{path}: the tokenizer ({TOKENIZER_FILES}) {why}: it is another model's tokenizer; copy the "
            "tokenizer files from the checkpoint config.json and the weights come from"
        )
    if found != arch.image_token_id:
        field = arch.spec.image_token_attr or "image_token_index"
        raise CheckpointError(
            f"{path}: config.json's {field} is {arch.image_token_id}, but the tokenizer writes the image token "
            f"{token!r} as id {found}; the model would find no image tokens in its input: set {field} to {found} "
            "(or copy config.json from the original checkpoint)"
        )


def _embedded_rows(vlm: VLM) -> int | None:
    """The rows of the model's input embedding (the tokens it can read), or None when unknown."""
    try:
        return int(vlm.hf.get_input_embeddings().weight.shape[0])
    except (AttributeError, NotImplementedError, TypeError):
        return None


def _check_patch(ip, arch, path: str) -> None:
    """The image processor's patch and merge sizes must be the vision tower's: a Qwen-style processor
    reports the patch grid it cut, and a grid cut with patch 8 for a tower of patch 16 reads as an
    image twice the size — the counts of tokens agree, the model fails in its first forward."""
    for field, theirs, config_field in (
        ("patch_size", arch.patch_size, f"{arch.spec.vision_config}.patch_size"),
        ("merge_size", arch.merge_size, str(arch.spec.merge)),
    ):
        mine = _side(getattr(ip, field, None))
        if field == "merge_size" and mine is not None and not isinstance(arch.spec.merge, str):
            continue  # the family's merge is not a config field; its processor's merge_size means another thing
        if mine is not None and mine != theirs:
            raise CheckpointError(
                f"{path}: {IMAGE_PROCESSOR_FILES} has {field} {mine}, but config.json's {config_field} is "
                f"{theirs}; the processor would cut a patch grid the vision tower cannot read: set {field} to "
                f"{theirs} (or copy both files from one original checkpoint)"
            )


def _side(value) -> int | None:
    """A patch or merge size as an int: an int, or a square {"height": h, "width": h}; None otherwise."""
    if isinstance(value, dict) and value.get("height") == value.get("width"):
        value = value.get("height")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_image_size(ip, config, arch, path: str) -> None:
    size = fixed_size(ip)
    side = getattr(getattr(config, arch.spec.vision_config), "image_size", None)
    if size is not None and side is not None and arch.spec.pooled_tokens_attr is None:
        side = tuple(side) if isinstance(side, (list, tuple)) else (side, side)
        if tuple(size) != side:
            raise CheckpointError(
                f"{path}: {IMAGE_PROCESSOR_FILES} resizes images (tiles) to {size[0]}×{size[1]} px but config.json's "
                f"vision_config.image_size is {side[0]}×{side[1]}; make the two agree (copy both files from "
                "one original checkpoint)"
            )


def _check_tokens_per_image(vlm: VLM, path: str) -> None:
    """One image through the processor: it must prepare, and write the tokens config.json's grid gives."""
    from PIL import Image

    arch = vlm.arch
    no_prompt = not getattr(vlm.processor, "chat_template", None) and arch.spec.plain_prompt is None
    if arch.spec.layout == "anyres" or no_prompt:
        return  # anyres adds crops to the base grid; without a chat template there is no prompt to try
    g = vlm.geometry
    try:  # `countlens.model.layouts` checks the count against the config's grid (and the processor's tiles)
        vlm.prepare([Image.new("RGB", (g.image_width, g.image_height))], ["how many?"])
    except ImageTokenCountError as err:
        _check_image_token(vlm, path)
        rows, cols = g.token_grid
        raise CheckpointError(
            f"{path}: {IMAGE_PROCESSOR_FILES} and config.json disagree: for one {g.image_height}×{g.image_width} "
            f"image, {str(err).removeprefix('sample 0: ')}; config.json gives {rows}×{cols} image tokens per image "
            f"or tile (patch {arch.patch_size}, merge {arch.merge_size}). Copy both files from one original checkpoint"
        ) from None
    except (CountlensError, AttributeError, KeyError, TypeError, ValueError) as err:
        _check_image_token(vlm, path)
        raise CheckpointError(_unpreparable(vlm, path, err)) from None


def _unpreparable(vlm: VLM, path: str, err: Exception) -> str:
    """Why the processor cannot prepare one image, naming another family's image processor when the
    image processor is not one transformers pairs with config.json's model_type."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    ip = type(vlm.processor.image_processor).__name__
    kind = vlm.hf.config.model_type
    named = IMAGE_PROCESSOR_MAPPING_NAMES.get(kind) or ()
    names = list(named.values()) if isinstance(named, dict) else [named] if isinstance(named, str) else list(named)
    bases = {_base(n) for n in names if n}
    detail = f"{type(err).__name__}: {err}" if not isinstance(err, CountlensError) else str(err)
    if bases and _base(ip) not in bases:
        return (
            f"{path}: {IMAGE_PROCESSOR_FILES} builds a {_base(ip)}, another model family's image processor: "
            f"config.json's model_type {kind!r} takes a {' or '.join(sorted(bases))}, and {_name(vlm.processor)} "
            f"cannot prepare an image with it ({detail}); copy the processor files from the original checkpoint"
        )
    return (
        f"{path}: {_name(vlm.processor)} cannot prepare one image ({detail}); the processor files do not fit "
        "config.json: copy them from the original checkpoint"
    )


def _base(name: str) -> str:
    return name.removesuffix("Pil").removesuffix("Fast")


def _name(processor) -> str:
    """The processor's class as transformers names it (countlens's image-only builds add a prefix)."""
    return type(processor).__name__.removeprefix("ImageOnly")
