"""Building a checkpoint's processor from its files: the one place countlens makes a processor.

A processor is a tokenizer, an image processor, a chat template and the processor class's own
settings, each from its own file of the checkpoint. transformers' failures to read any of them —
a ValueError about sentencepiece for a copy without tokenizer.json, an OSError for absent audio
settings, a TypeError for a setting of the wrong type — name neither the file nor the fix; each is
turned here into a `CheckpointError` that does. What countlens never uses (Phi-4-multimodal's audio
feature extractor) is built from its family's defaults when the checkpoint lacks its settings.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from countlens.errors import CheckpointError, CheckpointNotFoundError, UnsupportedArchitectureError
from countlens.model.families import pil_image_processor
from countlens.model.processors import image_only, processor_class


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

    name = PROCESSOR_MAPPING_NAMES.get(config.model_type, "")
    placeholder = not is_torchvision_available() and type(getattr(transformers, name, None)).__name__ == "DummyObject"
    proc_cls = processor_class(name)
    needs_video = proc_cls is not None and "video_processor" in proc_cls.get_attributes()
    if proc_cls is not None and placeholder:  # AutoProcessor would build the torchvision placeholder
        return _image_only_processor(path, proc_cls, config.model_type)
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
    return _image_only_processor(path, proc_cls, config.model_type)


def _image_only_processor(path: str, proc_cls: type, model_type: str):
    """``proc_cls`` built from the checkpoint's tokenizer, image processor, chat template and
    settings, without a video sub-processor (`countlens.model.processors.image_only`)."""
    tokenizer = _tokenizer(path)
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
        extra["audio_processor"] = _audio_processor(path, model_type)
    try:
        return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template, **extra)
    except (AttributeError, KeyError, TypeError, ValueError) as err:  # settings the class cannot take
        raise CheckpointError(
            f"{path}: its processor settings (processor_config.json, tokenizer_config.json) cannot build a "
            f"{proc_cls.__name__} ({type(err).__name__}: {err}); copy them from the original checkpoint"
        ) from None


#: The files a tokenizer's vocabulary can come in (one of them is enough).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "vocab.txt")


def _tokenizer(path: str):
    """The checkpoint's tokenizer, or an error naming the files it lacks: transformers' own (a
    ValueError about sentencepiece, for a copy without tokenizer.json) names neither."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        present = sorted(p.name for p in Path(path).iterdir() if p.name.startswith(("tokenizer", "vocab", "merges")))
        if not any((Path(path) / f).exists() for f in VOCABULARY_FILES):
            raise CheckpointError(
                f"{path} has no tokenizer vocabulary (none of {', '.join(VOCABULARY_FILES)}; it has "
                f"{', '.join(present) or 'no tokenizer file'}), so transformers cannot build its tokenizer; copy "
                "tokenizer.json and tokenizer_config.json from the original checkpoint"
            ) from None
        raise CheckpointError(
            f"{path}: its tokenizer files ({', '.join(present)}) cannot be read ({_first_line(err)}); copy them "
            "again from the original checkpoint"
        ) from None


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _audio_processor(path: str, model_type: str):
    """The checkpoint's audio feature extractor; where its settings are absent (a copy made without
    them), the family's defaults: the processor class needs one to build, and countlens never runs
    audio, so its settings change nothing here."""
    import transformers
    from transformers import AutoFeatureExtractor
    from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING_NAMES

    try:
        return AutoFeatureExtractor.from_pretrained(path, local_files_only=True)
    except OSError:  # no audio settings in processor_config.json / preprocessor_config.json
        name = FEATURE_EXTRACTOR_MAPPING_NAMES.get(model_type)
        cls = getattr(transformers, name, None) if name else None
        if cls is None:
            raise CheckpointError(
                f"{path} has no audio feature extractor settings (processor_config.json's audio_processor), "
                f"which its {model_type} processor needs to build; copy processor_config.json from the original "
                "checkpoint"
            ) from None
        return cls()


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
    # Prefer a PIL backend, transformers' or a family's own (`countlens.model.families`): the
    # torchvision-backed processors don't run without torchvision.
    pil = name.removesuffix("Pil").removesuffix("Fast") + "Pil"
    cls = getattr(transformers, pil, None)
    if cls is None:
        cls = pil_image_processor(pil)
    if cls is None:
        try:
            cls = getattr(transformers, name)
        except (AttributeError, ImportError) as err:  # unknown, or a torchvision backend
            raise CheckpointNotFoundError(
                f"{path} names the image processor {name!r}, which cannot be built here ({err}); countlens needs a "
                "PIL image processor for it (in its family's module under countlens/model/families/)"
            ) from None
    from transformers.image_processing_utils import ImageProcessingMixin

    if not (isinstance(cls, type) and issubclass(cls, ImageProcessingMixin)):  # a file names a class, never a call
        raise CheckpointError(
            f"{path}: image_processor_type {name!r} is no image processor class of transformers; copy "
            "preprocessor_config.json from the original checkpoint"
        )
    try:
        return cls.from_dict(cfg)
    except (AttributeError, KeyError, TypeError, ValueError) as err:  # settings of the wrong type or shape
        raise CheckpointError(
            f"{path}: the image processor settings (preprocessor_config.json) cannot build a {name} "
            f"({type(err).__name__}: {err}); copy the file from the original checkpoint"
        ) from None
