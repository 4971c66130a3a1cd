"""A loaded Hugging Face model made ready for countlens: per-layer facts of its `Arch` read from the
model itself, and fixes to its forward that the spec asks for. `countlens.model.vlm.VLM` applies them once,
when it wraps the model.

- `with_expert_layers`: which layers are mixture-of-experts (a config may keep some dense);
- `with_q_norm_layers`: which layers have the spec's q-norm (a family may leave it out of some);
- `bidirectional_vision`: a vision tower that declares itself causal made bidirectional, as ViTs are
  trained;
- `add_missing_output_fields`: output fields a parent's forward reads but transformers does not write
  (`countlens.model.families.spec.ArchSpec.missing_output_fields`), added as None by a forward hook;
- `module_of`: the torch module a spec path names (the one door to one outside this package and the
  engine); `attention_function`: the attention function a module runs under its implementation.
"""

from __future__ import annotations

import dataclasses

from countlens.model.arch import Arch


def with_expert_layers(arch: Arch, hf_model) -> Arch:
    """``arch`` with its mixture-of-experts layers: those whose experts module exists (Qwen3-VL-MoE keeps
    the layers its config's ``mlp_only_layers`` names dense)."""
    moe = arch.spec.moe
    if moe is None or arch.n_experts == 0:
        return arch
    layers = hf_model.get_submodule(arch.spec.layers)
    found = tuple(i for i, layer in enumerate(layers) if _has_module(layer, moe.experts))
    return dataclasses.replace(arch, expert_layers=found)


def with_q_norm_layers(arch: Arch, hf_model) -> Arch:
    """``arch`` with the layers that have its q-norm, where some lack it (Llama 4's NoPE layers)."""
    if arch.q_norm is None:
        return arch
    layers = hf_model.get_submodule(arch.spec.layers)
    found = tuple(i for i, layer in enumerate(layers) if _has_module(layer, arch.q_norm))
    return arch if len(found) == arch.n_layers else dataclasses.replace(arch, q_norm_layers=found)


def add_missing_output_fields(hf_model, fields: tuple[tuple[str, str], ...]) -> None:
    """Give modules' outputs the fields their parent's forward reads but transformers does not write
    (`countlens.model.families.spec.ArchSpec.missing_output_fields`), None, by a forward hook installed once."""
    for path, name in fields:
        module = hf_model.get_submodule(path)
        if getattr(module, "_countlens_fields", None):
            continue

        def add(mod, args, output, name=name):
            if not hasattr(output, name):
                object.__setattr__(output, name, None)
            return output

        module.register_forward_hook(add)
        module._countlens_fields = True


def module_of(model, module, missing_ok: bool = False):
    """The module a path (from the family spec) names in ``model`` (``""``: the model itself), or the module
    given; with ``missing_ok``, None where the model has no such module. Outside the model layer and the
    engine, code reaches a torch module through this (or nnsight's envoy, `VLM.module`), never by
    `get_submodule`."""
    if not isinstance(module, str):
        return module
    try:
        return model.get_submodule(module)
    except AttributeError:
        if missing_ok:
            return None
        raise


def _has_module(root, path: str) -> bool:
    return module_of(root, path, missing_ok=True) is not None


def bidirectional_vision(hf_model, tower: str) -> None:
    """Make every attention module of the vision tower bidirectional, as ViTs are trained.

    transformers 5.24's Phi-4-multimodal vision attention says ``is_causal = True``; under SDPA, when
    no patch is padded, its mask is dropped and the tower runs causally (measured: a bright patch
    then changes only the tokens after it). Towers that are already bidirectional are unchanged."""
    for module in hf_model.get_submodule(tower).modules():
        if getattr(module, "is_causal", False) is True:
            module.is_causal = False


def attention_function(module, implementation: str):
    """The attention function ``module`` runs under ``implementation`` (its config's
    ``_attn_implementation``): its own modelling file's ``eager_attention_forward``, or transformers'
    registered kernel of that name."""
    if implementation == "eager":
        import importlib

        return importlib.import_module(type(module).__module__).eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[implementation]
