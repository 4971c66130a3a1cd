"""Loading a VLM offline: the shipped organism, a checkpoint directory, or a cached hub id.

countlens never downloads. A hub id must already be in the local Hugging Face cache; with
``remote=True`` the weights stay on NDIF and only the config and processor are read locally.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import torch

try:  # huggingface_hub's checks of transformers' config classes (raised by AutoConfig)
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # an older huggingface_hub: its configs are not validated

    class StrictDataclassError(Exception):
        """Never raised: this huggingface_hub does not validate configs."""


from countlens.arch import spec_for
from countlens.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    DeviceError,
    ImageTokenCountError,
    UnsupportedArchitectureError,
)
from countlens.models import REMOTE_CODE, pil_image_processor
from countlens.sizing import fixed_size, pin_square
from countlens.validate import require_image_side
from countlens.vlm import VLM

TOY_DIR = Path(__file__).parent / "toy" / "weights"


def load(
    name_or_path: str | os.PathLike = "toy",
    *,
    dtype: str | torch.dtype | None = None,
    device_map: str | dict | None = None,
    attn_implementation: str | None = None,
    remote: bool = False,
) -> VLM:
    """Load a supported VLM offline: "toy" (the shipped organism), a checkpoint directory, or a cached hub id.

    ``dtype`` ("bfloat16", torch.float16 …), ``device_map`` ("auto", "cuda", {…}) and
    ``attn_implementation`` ("eager", "sdpa") go to ``from_pretrained``. ``remote=True`` builds the
    model on the meta device and sends every `VLM.trace` to NDIF (needs nnsight's API key set up).
    """
    kind = None if dtype is None else torch_dtype(dtype)  # a bad dtype fails before anything is read
    path, label = resolve_path(name_or_path)
    if remote and (str(name_or_path) == "toy" or Path(str(name_or_path)).expanduser().is_dir()):
        raise CheckpointNotFoundError(
            "remote=True needs a hub id that NDIF serves (e.g. 'Qwen/Qwen2.5-VL-7B-Instruct'), "
            f"not {str(name_or_path)!r}; "
            "local checkpoints run locally: drop remote=True"
        )
    if not remote:  # NDIF places remote models itself
        device_map = rank_device(device_map)
        _check_device(device_map)
    config = read_config(path)
    spec = spec_for(config)  # fail early, before loading weights, for an unsupported architecture
    check_experts(config, spec, path)
    processor = load_processor(path, config)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if kind is not None:
        kwargs["dtype"] = kind
    if device_map is not None:
        kwargs["device_map"] = device_map
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if remote:
        from nnsight.modeling.transformers import TransformersModel

        envoy = TransformersModel(str(name_or_path), processor=processor, task="image-text-to-text", **kwargs)
        return VLM(envoy._module, processor, name=label, remote=True, envoy=envoy)
    import transformers

    try:
        # ignore_mismatched_sizes: transformers then reports the tensors whose shapes disagree with
        # config.json (in ``info``) instead of raising a RuntimeError that names none of them;
        # `_refuse_mismatched_weights` refuses them by name.
        model, info = getattr(transformers, spec.loader).from_pretrained(
            path, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
    except OSError as err:  # e.g. a directory with a config but no weights
        raise CheckpointNotFoundError(f"could not load weights from {path}: {err}") from None
    except Exception as err:
        if type(err).__name__ != "SafetensorError":  # truncated or corrupt weight files
            raise
        files = ", ".join(sorted(p.name for p in Path(path).glob("*.safetensors"))) or "its .safetensors files"
        raise CheckpointError(
            f"the weights in {path} ({files}) cannot be read: {err}; the file is truncated or "
            "corrupt, copy it again from the original checkpoint"
        ) from None
    _refuse_mismatched_weights(path, info)
    _refuse_missing_weights(path, info)
    vlm = VLM(model.eval(), processor, name=label)
    check_processor(vlm, path)
    return vlm


def _refuse_missing_weights(path: str, info: dict) -> None:
    """transformers initialises the tensors a checkpoint lacks at random and only warns; a vision tower
    partly random would give results that look like a model's. Refuse, naming what is missing."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        files = ", ".join(sorted(p.name for p in Path(path).glob("*.safetensors"))) or "no .safetensors file"
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CheckpointError(
            f"{path} ({files}) lacks {len(missing)} weight tensors of the model: {shown}; the checkpoint is "
            "partial — copy every weight file (and model.safetensors.index.json) from the original checkpoint"
        )


def _refuse_mismatched_weights(path: str, info: dict) -> None:
    """A weight tensor whose shape is not the one config.json gives its module: the config was edited,
    or comes from another size of the model. transformers (asked to ignore mismatched sizes) left
    such a tensor at random; refuse, naming it and both shapes."""
    mismatched = sorted(info.get("mismatched_keys") or [], key=lambda row: row[0])
    if mismatched:
        name, saved, wanted = mismatched[0]
        more = f" (and {len(mismatched) - 1} more tensors)" if len(mismatched) > 1 else ""
        raise CheckpointError(
            f"{path}: the weight {name} has shape {list(saved)} in the checkpoint's weight files but config.json "
            f"makes it {list(wanted)}{more}; config.json and the weights come from different models — copy "
            "config.json from the checkpoint the weights were saved with"
        )


def check_experts(config, spec, path: str) -> None:
    """Refuse a mixture-of-experts config whose router would choose more experts per token than the
    layer has: transformers builds such a model, and it fails only in its first forward."""
    if spec.moe is None:
        return
    from countlens.arch import text_config

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
    """Refuse a checkpoint whose processor disagrees with its model config, before any real input:
    an image size the vision tower does not take, or a number of image tokens per image (one tile)
    other than the config's patch and merge give. Either would fail later, deep in a forward, or —
    worse — run with image tokens mapped to the wrong cells."""
    from PIL import Image

    ip, arch = vlm.processor.image_processor, vlm.arch
    files = "the image processor (preprocessor_config.json / processor_config.json)"
    size = fixed_size(ip)
    side = getattr(getattr(vlm.hf.config, arch.spec.vision_config), "image_size", None)
    if size is not None and side is not None and arch.spec.pooled_tokens_attr is None:
        side = tuple(side) if isinstance(side, (list, tuple)) else (side, side)
        if tuple(size) != side:
            raise CheckpointError(
                f"{path}: {files} resizes images (tiles) to {size[0]}×{size[1]} px but config.json's "
                f"vision_config.image_size is {side[0]}×{side[1]}; make the two agree (copy both files from "
                "one original checkpoint)"
            )
    no_prompt = not getattr(vlm.processor, "chat_template", None) and arch.spec.plain_prompt is None
    if arch.spec.layout == "anyres" or no_prompt:
        return  # anyres adds crops to the base grid; without a chat template there is no prompt to try
    g = vlm.geometry
    try:  # `countlens.layouts` checks the count against the config's grid (and the processor's tiles)
        vlm.prepare([Image.new("RGB", (g.image_width, g.image_height))], ["how many?"])
    except ImageTokenCountError as err:
        rows, cols = g.token_grid
        raise CheckpointError(
            f"{path}: {files} and config.json disagree: for one {g.image_height}×{g.image_width} image, "
            f"{str(err).removeprefix('sample 0: ')}; config.json gives {rows}×{cols} image tokens per image or tile "
            f"(patch {arch.patch_size}, merge {arch.merge_size}). Copy both files from one original checkpoint"
        ) from None


def rank_device(device_map):
    """``"cuda"`` means this rank's GPU when a launcher started several processes (``LOCAL_RANK``
    set, ``WORLD_SIZE`` > 1): ``"cuda:<LOCAL_RANK>"``, so eight ranks do not all load on GPU 0.
    Anything else is kept."""
    local, world = os.environ.get("LOCAL_RANK"), os.environ.get("WORLD_SIZE", "1")
    if device_map == "cuda" and local is not None and world.isdigit() and int(world) > 1 and local.isdigit():
        return f"cuda:{local}"
    return device_map


def _check_device(device_map) -> None:
    """Refuse a CUDA device on a build or machine without one, before anything loads."""
    wanted = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    on_cuda = [d for d in wanted if str(d).startswith("cuda") or (isinstance(d, int) and not isinstance(d, bool))]
    if on_cuda and not torch.cuda.is_available():  # an int is a CUDA ordinal to from_pretrained
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise DeviceError(
            f"device {device_map!r}: {why}; leave --device unset to run on the CPU, or install a "
            "CUDA build of torch on a GPU machine (make test TORCH_SPEC=...)"
        )


def read_config(path: str):
    """The checkpoint's config (transformers' `AutoConfig`), refused when config.json cannot be read,
    names a model type transformers does not know, or lacks the ``vision_config`` that transformers
    would otherwise fill with its default tower (planning, or loading, a model that is not the
    checkpoint's)."""

    from transformers import AutoConfig

    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as err:  # missing, unreadable, not JSON
        raise CheckpointError(f"{file} cannot be read ({err}); restore it from the original checkpoint") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} is not a JSON object; restore it from the original checkpoint")
    _refuse_remote_code(file, raw)
    _refuse_quantised(file, raw)
    try:
        # Never the checkpoint's own code: transformers would otherwise ask on a terminal whether to run it.
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except StrictDataclassError as err:  # fields that disagree (layer_types for another number of layers)
        raise CheckpointError(_strict_config_message(file, err)) from None
    except (ValueError, KeyError) as err:  # a model_type transformers itself does not know
        raise UnsupportedArchitectureError(f"{file}: {err}") from None
    except OSError as err:
        raise CheckpointError(f"{file} cannot be read ({err}); restore it from the original checkpoint") from None
    if "vision_config" not in raw and hasattr(config, "vision_config"):
        raise CheckpointError(
            f"{file} has no vision_config, so transformers would build its default vision tower instead of "
            "the checkpoint's; copy config.json whole from the original checkpoint"
        )
    return config


def _strict_config_message(file: Path, err: Exception) -> str:
    """huggingface_hub's validation error of a config class, as one line naming config.json and the
    fields: its first line names transformers' validator, the last its message (which names the fields)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    detail = lines[-1].removeprefix("ValueError: ").removeprefix("TypeError: ") if lines else type(err).__name__
    return (
        f"{file} does not hold together: {detail}; correct those fields of config.json, or copy it whole from "
        "the original checkpoint"
    )


def _refuse_quantised(file: Path, raw: dict) -> None:
    """Refuse a quantised checkpoint (a ``quantization_config`` in config.json: bitsandbytes, GPTQ,
    AWQ, FP8 …). countlens patches, ablates and fine-tunes the model's own floating-point weights, and
    `countlens plan` sizes them; quantised layers would change both. Refused alike by `load`,
    `meta_vlm` (`countlens plan`) and `countlens check`, which all read config.json here."""
    quant = [c for c in (raw, raw.get("text_config")) if isinstance(c, dict) and c.get("quantization_config")]
    if quant:
        q = quant[0]["quantization_config"]
        method = q.get("quant_method", "unnamed") if isinstance(q, dict) else "unnamed"
        raise CheckpointError(
            f"{file} has a quantization_config (quant_method {method!r}): countlens runs a model's unquantised "
            "floating-point weights and does not support quantised checkpoints; load the original, unquantised "
            "checkpoint instead (with dtype='bfloat16' — countlens --dtype bfloat16 — to halve its memory)"
        )


def _refuse_remote_code(file: Path, raw: dict) -> None:
    """A checkpoint in its authors' remote-code format (``auto_map`` naming its own modules): countlens
    never runs a checkpoint's code, so it names the transformers conversion of the same weights (the
    families' ``remote_code``, `countlens.models.REMOTE_CODE`)."""
    kind = raw.get("model_type")
    if kind in REMOTE_CODE:
        native, example = REMOTE_CODE[kind]
        raise UnsupportedArchitectureError(
            f"{file}: model_type {kind!r} is the authors' remote-code format, whose code countlens never "
            f"runs; load the transformers conversion of the same model (model_type {native!r}), e.g. {example}"
        )
    if "auto_map" in raw and kind is not None:
        from transformers import CONFIG_MAPPING

        if kind not in CONFIG_MAPPING:
            raise UnsupportedArchitectureError(
                f"{file}: model_type {kind!r} needs the checkpoint's own code (auto_map), which countlens never "
                "runs; use a checkpoint saved in a format transformers ships (a '-hf' conversion, if its authors "
                "publish one)"
            )


def torch_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    """``dtype`` as torch names it ("bfloat16" → torch.bfloat16; "auto" kept), or an error naming it.
    Only floating dtypes: countlens runs the model's own arithmetic (int8 weights come quantised,
    through the checkpoint's quantisation config, not through ``dtype``)."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        value = dtype
    else:
        value = getattr(torch, str(dtype), None)
    if value != "auto" and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ConfigError(
            f"dtype {dtype!r} is not a floating torch dtype; use e.g. 'bfloat16', 'float16', 'float32' or 'auto'"
        )
    return value


def resolve_path(name_or_path: str | os.PathLike) -> tuple[str, str]:
    """(local directory, label) of "toy", a checkpoint directory or a cached hub id; never downloads."""
    name = str(name_or_path)
    if name == "toy":
        if not (TOY_DIR / "config.json").exists():
            raise CheckpointNotFoundError(
                f"the organism's weights are missing from {TOY_DIR}; reinstall countlens, or train one with "
                "`countlens toy train --out DIR` and load it with countlens.load(DIR)"
            )
        return str(TOY_DIR), "toy"
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise CheckpointNotFoundError(
                f"{p} is a directory without config.json; give a Hugging Face checkpoint directory"
            )
        return str(p), name
    if p.exists():
        raise CheckpointNotFoundError(f"{p} is a file; give a checkpoint directory, a cached hub id or 'toy'")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True), name
    except Exception as err:
        raise CheckpointNotFoundError(
            f"{name!r} is neither 'toy', a local checkpoint directory, nor a hub id in the local cache "
            f"({type(err).__name__}); countlens never downloads: copy the checkpoint to disk and pass its path"
        ) from None


def load_processor(path: str, config):
    """The model's processor, offline, with one parse of its tokenizer.

    The stock processor (`AutoProcessor`) is used where it can be built. Where it cannot — its video
    sub-processor needs torchvision, absent here — the image-only build is made directly: trying
    `AutoProcessor` first would parse the tokenizer (seconds for a 151k-entry vocabulary) before
    failing on the video processor, and the fallback would parse it again."""
    import transformers
    from transformers import AutoProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.utils import is_torchvision_available

    from countlens.processors import processor_class

    name = PROCESSOR_MAPPING_NAMES.get(config.model_type, "")
    placeholder = not is_torchvision_available() and type(getattr(transformers, name, None)).__name__ == "DummyObject"
    proc_cls = processor_class(name)
    needs_video = proc_cls is not None and "video_processor" in proc_cls.get_attributes()
    if proc_cls is not None and placeholder:  # AutoProcessor would build the torchvision placeholder
        return _image_only_processor(path, proc_cls)
    if proc_cls is None or not needs_video or is_torchvision_available():
        try:
            processor = AutoProcessor.from_pretrained(path, local_files_only=True)
            # Without a loadable processor class AutoProcessor quietly returns the bare tokenizer.
            if getattr(processor, "image_processor", None) is not None:
                return processor
        except Exception:  # noqa: BLE001 — the image-only build below reports its own, clearer error
            pass
    if proc_cls is None:
        raise UnsupportedArchitectureError(
            f"{path}: transformers has no processor class for model_type "
            f"{config.model_type!r}; save the checkpoint's processor with it"
        )
    return _image_only_processor(path, proc_cls)


def _image_only_processor(path: str, proc_cls: type):
    """``proc_cls`` built from the checkpoint's tokenizer, image processor, chat template and
    settings, without a video sub-processor (`countlens.processors.image_only`)."""
    from transformers import AutoTokenizer

    from countlens.processors import image_only

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    image_processor = _load_image_processor(path)
    template_file = Path(path) / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else tokenizer.chat_template
    # The processor's own settings (e.g. LLaVA's num_image_tokens, vision_feature_select_strategy).
    settings_file = Path(path) / "processor_config.json"
    settings = _checkpoint_json(settings_file) if settings_file.exists() else {}
    cls = image_only(proc_cls)
    accepted = inspect.signature(proc_cls.__init__).parameters
    extra = {
        k: v
        for k, v in settings.items()
        if k in accepted and k not in ("image_processor", "tokenizer", "video_processor", "chat_template")
    }
    if "audio_processor" in accepted:  # Phi-4-multimodal: its (numpy) audio feature extractor, never used here
        from transformers import AutoFeatureExtractor

        extra["audio_processor"] = AutoFeatureExtractor.from_pretrained(path, local_files_only=True)
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template, **extra)


def _checkpoint_json(file: Path) -> dict:
    """A checkpoint's JSON settings file, refused (naming it) when it is not a JSON object."""
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file} cannot be read ({err}); restore it from the original checkpoint") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file} is not a JSON object; restore it from the original checkpoint")
    return value


def _load_image_processor(path: str):
    import transformers

    # Older checkpoints keep it in preprocessor_config.json, newer ones nest it in processor_config.json.
    flat, nested = Path(path) / "preprocessor_config.json", Path(path) / "processor_config.json"
    if flat.exists():
        cfg = _checkpoint_json(flat)
    elif nested.exists() and "image_processor" in _checkpoint_json(nested):
        cfg = _checkpoint_json(nested)["image_processor"]
    else:
        raise CheckpointNotFoundError(
            f"{path} has no image processor config (preprocessor_config.json); copy it from the original checkpoint"
        )
    name = cfg.pop("image_processor_type", "")
    if not name:
        raise CheckpointError(
            f"{path}'s image processor config names no image_processor_type; copy it from the original checkpoint"
        )
    # Prefer a PIL backend, transformers' or a family's own (`countlens.models`): the
    # torchvision-backed processors don't run without torchvision.
    pil = name.removesuffix("Pil").removesuffix("Fast") + "Pil"
    cls = getattr(transformers, pil, None)
    if cls is None:
        cls = pil_image_processor(pil)
    if cls is not None:
        return cls.from_dict(cfg)
    try:
        return getattr(transformers, name).from_dict(cfg)
    except (AttributeError, ImportError) as err:  # unknown, or a torchvision backend
        raise CheckpointNotFoundError(
            f"{path} names the image processor {name!r}, which cannot be built here ({err}); countlens needs a "
            "PIL image processor for it (in its family's module under countlens/models/)"
        ) from None


#: Files one of which a checkpoint's tokenizer is read from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _require_prompt_files(where: str, label: str) -> None:
    """Refuse a checkpoint directory with no tokenizer file (a config-only copy), before transformers
    fails on it with an error that names no file."""
    if Path(where).is_dir() and not any((Path(where) / f).exists() for f in TOKENIZER_FILES):
        raise CheckpointError(
            f"{label}: no tokenizer files ({' / '.join(TOKENIZER_FILES)}): the plan prepares each stage's "
            "prompts; copy the checkpoint's tokenizer files and chat template beside its config"
        )


def meta_vlm(path: str, dtype: str | torch.dtype | None = None, image_size: int | None = None):
    """A `countlens.VLM` of the checkpoint at ``path`` built on the meta device: its config and
    processor read, no weights (what `countlens plan` reads). ``image_size`` pins a dynamic-resolution
    processor to square images of that side."""
    import transformers

    kind = None if dtype is None else torch_dtype(dtype)  # a bad dtype fails before anything is read
    if image_size is not None:
        require_image_side(image_size, "image_size", ConfigError)
    where, label = resolve_path(path)
    config = read_config(where)
    spec = spec_for(config)
    check_experts(config, spec, where)
    _require_prompt_files(where, label)
    processor = load_processor(where, config)
    if not getattr(processor, "chat_template", None) and spec.plain_prompt is None:
        raise CheckpointError(
            f"{label}: no chat template (chat_template.jinja / chat_template.json, or tokenizer_config.json's "
            "chat_template): the plan prepares each stage's prompts; copy the checkpoint's chat template beside its "
            "config"
        )
    if image_size is not None:
        ip = processor.image_processor
        fixed = fixed_size(ip)
        if fixed is None:
            if not pin_square(ip, image_size):
                raise ConfigError(
                    f"--image-size {image_size}: {label}'s processor sizes each image by its own token budget; "
                    "leave --image-size unset"
                )
        elif fixed != (image_size, image_size):
            raise ConfigError(
                f"--image-size {image_size}: {label}'s processor resizes every image to {fixed[0]}×"
                f"{fixed[1]}; leave --image-size unset"
            )
    kind = kind or torch_dtype(getattr(config, "dtype", None) or torch.float32)
    with torch.device("meta"):
        model = getattr(transformers, spec.loader).from_config(config, dtype=kind)
    vlm = VLM(model.eval(), processor, name=label)
    check_processor(vlm, where)
    return vlm
