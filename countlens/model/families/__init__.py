"""The registry of model families: one module per family, found by ``model_type`` or by the class name
of its image processor.

A family module (``countlens/model/families/<family>.py``) holds everything countlens knows of that family: its
`ArchSpec` entries (module paths and config names), its image processor's sizing rule, the tile grid
its processor cuts, PIL image processors where transformers has only torchvision ones, processor
fixes, and the checkpoints it refuses. It declares all of it as one `Family` (`countlens.model.families.spec`)
and imports nothing of countlens but that module. The shared code — `countlens.model.arch` (resolving a
spec against a config), `countlens.model.sizing`, `countlens.model.processors`, `countlens.model.layouts`,
`countlens.model.loading` — never names a family: it asks this registry, and calls what the family gave.
Nothing but this module imports a family module (`tests/unit/test_layers.py` holds both rules).

The grouping: a module per family of checkpoints that share their code in transformers or their
processor, so one reading of a module explains a family:

- ``qwen``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 (one tower layout, one image
  processor and its pixel budget);
- ``glm4v``: GLM-4.1V, Qwen2-VL's layout but its own processor (the budget counts two frames);
- ``llava``: LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision (one layout; NeXT and OneVision add "anyres" crops);
- ``idefics3``: Idefics3 and SmolVLM (one model class, two model types);
- and one module each for InternVL, Ovis2, Phi-4-multimodal, Llama-3.2-Vision (``mllama``),
  PaliGemma, Mistral 3 (Pixtral's tower and processor), Gemma 3, Gemma 4 and Llama 4: each has its
  own code in transformers, and the Gemmas and Llamas share none of their quirks.

Adding an architecture: a module here with its specs and `Family` (see docs/architectures.md).
"""

from __future__ import annotations

from countlens.model.families import (
    gemma3,
    gemma4,
    glm4v,
    idefics3,
    internvl,
    llama4,
    llava,
    mistral3,
    mllama,
    ovis2,
    paligemma,
    phi4_multimodal,
    qwen,
)
from countlens.model.families.spec import ArchSpec, Family, SizingRule

#: Every family, in the order countlens documents them.
FAMILIES: tuple[Family, ...] = tuple(
    m.FAMILY
    for m in (
        qwen,
        glm4v,
        llava,
        internvl,
        ovis2,
        phi4_multimodal,
        mllama,
        idefics3,
        paligemma,
        mistral3,
        gemma3,
        gemma4,
        llama4,
    )
)

#: Every spec by its name.
SPECS: dict[str, ArchSpec] = {s.name: s for f in FAMILIES for s in f.specs}
#: Every spec by each HF ``model_type`` it covers.
BY_MODEL_TYPE: dict[str, ArchSpec] = {t: s for s in SPECS.values() for t in s.model_types}
_FAMILY_OF_SPEC: dict[str, Family] = {s.name: f for f in FAMILIES for s in f.specs}
#: Remote-code model types, to be refused: model_type → (the conversion's model_type, an example).
REMOTE_CODE: dict[str, tuple[str, str]] = {k: v for f in FAMILIES for k, v in f.remote_code.items()}
#: Processor class names whose apply_chat_template is the mixin's in an image-only build.
MIXIN_CHAT_TEMPLATE: frozenset[str] = frozenset(n for f in FAMILIES for n in f.mixin_chat_template)


def family_of(spec: ArchSpec) -> Family:
    """The family a spec belongs to."""
    return _FAMILY_OF_SPEC[spec.name]


def image_processor_family(name: str) -> Family | None:
    """The family whose image processors' class names start as ``name`` does, or None."""
    for family in FAMILIES:
        if name.startswith(family.image_processors):
            return family
    return None


def sizing_rule(name: str, size: dict) -> SizingRule | None:
    """The dynamic-resolution rule of the image processor of class ``name`` whose ``size`` dict is
    ``size``: its family's, else a rule that claims any processor with the keys of ``size``; None
    for a fixed-size processor."""
    family = image_processor_family(name)
    if family is not None and family.sizing is not None:
        return family.sizing
    for family in FAMILIES:
        rule = family.sizing
        if rule is not None and rule.size_keys and all(k in size for k in rule.size_keys):
            return rule
    return None


def pil_image_processor(name: str) -> type | None:
    """The PIL image processor class ``name`` a family provides, or None."""
    for family in FAMILIES:
        if name in family.pil_image_processors:
            return family.pil_image_processors[name]()
    return None


def processor_class(name: str) -> type | None:
    """A working processor class ``name`` where a family fixes one transformers hides, or None."""
    for family in FAMILIES:
        if name in family.processor_classes:
            return family.processor_classes[name]()
    return None
