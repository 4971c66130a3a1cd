"""Loading a VLM offline: the shipped organism, a checkpoint directory, or a cached hub id.

countlens never downloads. A hub id must already be in the local Hugging Face cache; with
``remote=True`` the weights stay on NDIF and only the config and processor are read locally.
"""

from __future__ import annotations

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


from countlens.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    DeviceError,
    UnsupportedArchitectureError,
)
from countlens.model.arch import resolve, spec_for
from countlens.model.consistency import check_experts, check_processor, check_processor_settings
from countlens.model.families import REMOTE_CODE
from countlens.model.processor_files import load_processor
from countlens.model.shipped import ORGANISMS, is_organism
from countlens.model.sizing import fixed_size, pin_square
from countlens.model.vlm import VLM
from countlens.validate import require_image_side


def load(
    name_or_path: str | os.PathLike = "toy",
    *,
    dtype: str | torch.dtype | None = None,
    device_map: str | dict | None = None,
    attn_implementation: str | None = None,
    remote: bool = False,
) -> VLM:
    """Load a supported VLM offline: "toy" (the shipped organism), a planted organism ("planted-route",
    "planted-two-hop", "planted-spread", "planted-top-half", "planted-value-route", "planted-count-ge-5":
    `countlens.model.shipped.ORGANISMS`), a checkpoint directory, or a cached hub id.

    ``dtype`` ("bfloat16", torch.float16 …), ``device_map`` ("auto", "cuda", {…}) and
    ``attn_implementation`` ("eager", "sdpa") go to ``from_pretrained``. ``remote=True`` builds the
    model on the meta device and sends every `VLM.trace` to NDIF (needs nnsight's API key set up).
    """
    kind = None if dtype is None else torch_dtype(dtype)  # a bad dtype fails before anything is read
    path, label = resolve_path(name_or_path)
    if remote and (is_organism(str(name_or_path)) or Path(str(name_or_path)).expanduser().is_dir()):
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
    check_processor_settings(processor, config, resolve(config), path)  # before the weights are read
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
    except torch.OutOfMemoryError:
        raise
    except Exception as err:
        if type(err).__name__ != "SafetensorError":  # the model cannot be built from config.json's fields
            raise CheckpointError(_unbuildable(path, spec.loader, err)) from None
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


def _unbuildable(path: str, loader: str, err: Exception) -> str:
    """transformers' failure to build a model from a config it accepted (a field of the wrong type or
    sign: `rope_type` a list, a negative size), as the checkpoint's error: the model's code is
    transformers', its fields config.json's."""
    first = (str(err).strip().splitlines() or [""])[0]
    return (
        f"{Path(path) / 'config.json'}: transformers cannot build a {loader} from its fields "
        f"({type(err).__name__}: {first}); correct the field it names, or copy config.json whole from the "
        "original checkpoint"
    )


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
    families' ``remote_code``, `countlens.model.families.REMOTE_CODE`)."""
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
    if name in ORGANISMS and Path(name).expanduser().is_dir():
        raise CheckpointNotFoundError(
            f"{name!r} names both a shipped organism and a local folder ./{name}; say which: "
            f"countlens.load('./{name}') (or --model ./{name}) for the folder, or move the folder to load the organism"
        )
    if name in ORGANISMS:
        folder = ORGANISMS[name]
        if not (folder / "config.json").exists():
            circuit = name.removeprefix("planted-")
            how = "countlens toy train" if name == "toy" else f"countlens toy plant --circuit {circuit}"
            raise CheckpointNotFoundError(
                f"the weights of {name!r} are missing from {folder}; reinstall countlens, or train them with "
                f"`{how} --out DIR` and load them with countlens.load(DIR)"
            )
        return str(folder), name
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise CheckpointNotFoundError(
                f"{p} is a directory without config.json; give a Hugging Face checkpoint directory"
            )
        return str(p), name
    if p.exists():
        raise CheckpointNotFoundError(
            f"{p} is a file; give a checkpoint directory, a cached hub id or an organism ({', '.join(ORGANISMS)})"
        )
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True), name
    except Exception as err:
        raise CheckpointNotFoundError(
            f"{name!r} is neither a shipped organism ({', '.join(ORGANISMS)}), a local checkpoint directory, nor a "
            f"hub id in the local cache ({type(err).__name__}); countlens never downloads: copy the checkpoint to "
            "disk and pass its path"
        ) from None


#: Files one of which a checkpoint's tokenizer is read from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _require_prompt_files(where: str, label: str) -> None:
    """Refuse a checkpoint directory with no tokenizer file (a config-only copy), before transformers
    fails on it with an error that names no file."""
    if Path(where).is_dir() and not any((Path(where) / f).exists() for f in TOKENIZER_FILES):
        raise CheckpointError(
            f"{label}: no tokenizer files ({' / '.join(TOKENIZER_FILES)}): countlens writes every prompt with "
            "them; copy the checkpoint's tokenizer files and chat template beside its config"
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
    try:
        with torch.device("meta"):
            model = getattr(transformers, spec.loader).from_config(config, dtype=kind)
    except Exception as err:  # noqa: BLE001 — as in `load`: config.json's fields cannot build the model
        raise CheckpointError(_unbuildable(where, spec.loader, err)) from None
    vlm = VLM(model.eval(), processor, name=label)
    check_processor(vlm, where)
    return vlm
