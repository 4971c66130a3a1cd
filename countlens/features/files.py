"""Transcoder sets on disk, in circuit-tracer's published format (decoderesearch/circuit-tracer).

A set is a folder::

    config.yaml             model_kind: transcoder_set
                            model_name: toy
                            feature_input_hook: mlp.hook_in
                            feature_output_hook: mlp.hook_out
                            scan: countlens/toy/topk-512-16
                            activation: topk          # countlens writes it for TopK sets
                            k: 16                     # the features kept per token (TopK only)
    layer_0.safetensors     W_enc (d_transcoder, d_model)   b_enc (d_transcoder,)
    layer_1.safetensors     W_dec (d_transcoder, d_model)   b_dec (d_model,)
    …                       optional: activation_function.threshold (d_transcoder,) → JumpReLU
                                      W_skip (d_model, d_model) → a linear skip path

one ``layer_{i}.safetensors`` per decoder layer, ``i`` from 0 with none missing. A set without a
threshold and without ``k`` is a ReLU set. circuit-tracer writes a TopK set's ``k`` as a scalar
tensor ``k`` in each layer file; countlens writes it in ``config.yaml`` and reads either (they must
agree). ``config.yaml`` may also carry circuit-tracer's ``transcoders`` list (the layer files'
addresses); countlens reads the files beside it whatever the list says, after checking it names them.

`load_transcoders` checks everything before any tensor reaches a model — a folder of another format,
missing or non-contiguous layers, widths that differ across layers, a ``d_model`` or a layer count
other than the model's, keys it does not know, a NaN or ±inf in any tensor — each an `InputError`
naming the file (and the tensor) and the fix.
`save_transcoders` writes into a temp folder beside the target and renames it into place, so a
failed write leaves the old set (or nothing), never half a set.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from countlens.errors import InputError
from countlens.features.transcoder import (
    FEATURE_INPUT_HOOK,
    FEATURE_OUTPUT_HOOK,
    Transcoder,
    TranscoderSet,
    require_float_dtype,
)
from countlens.files import writer_id
from countlens.model.arguments import require_vlm
from countlens.validate import require_finite_tensor, require_path, require_text

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

CONFIG = "config.yaml"
LAYER_FILE = re.compile(r"layer_(\d+)\.safetensors")
CONFIG_KEYS = {
    "model_kind",
    "model_name",
    "feature_input_hook",
    "feature_output_hook",
    "scan",
    "activation",
    "k",
    "transcoders",
}
REQUIRED_TENSORS = ("W_enc", "W_dec", "b_enc", "b_dec")
OPTIONAL_TENSORS = ("activation_function.threshold", "W_skip", "k")


def save_transcoders(
    transcoders: TranscoderSet, folder: str | Path, *, model_name: str | None = None, scan: str | None = None
) -> Path:
    """Write ``transcoders`` as a circuit-tracer transcoder set in ``folder`` (replacing a set already
    there); returns the folder. ``model_name`` and ``scan`` default to the set's own."""
    if not isinstance(transcoders, TranscoderSet):
        raise InputError(f"save_transcoders takes a TranscoderSet, got {type(transcoders).__name__}")
    n = len(transcoders)
    if transcoders.layers != tuple(range(n)):
        raise InputError(
            f"the set covers layers {list(transcoders.layers)}; the file format holds layers 0 … n − 1 with none "
            "missing: train every layer (layers=None) before saving"
        )
    activations = {t.activation for t in transcoders}
    ks = {t.k for t in transcoders}
    if len(activations) > 1 or len(ks) > 1:
        raise InputError(f"the layers differ in activation ({activations}) or k ({ks}); a set file holds one")
    folder = require_path(folder, "folder", example="'transcoders'")
    for name, value in (("model_name", model_name), ("scan", scan)):
        if value is not None:
            require_text(value, name, empty=True)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder} is a file; give a folder to write the transcoder set into")
    if folder.is_dir() and any(folder.iterdir()) and not _is_set(folder):
        raise InputError(
            f"{folder} holds files that are not a transcoder set; give an empty or new folder (countlens replaces "
            "only a set it can read)"
        )
    config = {
        "model_kind": "transcoder_set",
        "model_name": model_name if model_name is not None else transcoders.model_name,
        "feature_input_hook": FEATURE_INPUT_HOOK,
        "feature_output_hook": FEATURE_OUTPUT_HOOK,
        "scan": scan if scan is not None else transcoders.scan,
    }
    activation = activations.pop()
    if activation == "topk":
        config.update(activation="topk", k=int(ks.pop()))
    elif activation == "jumprelu":
        config["activation"] = "jumprelu"
    import yaml
    from safetensors.torch import save_file

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.{writer_id()}-{secrets.token_hex(4)}.tmp")
    tmp.mkdir()
    try:
        (tmp / CONFIG).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        for i, t in enumerate(transcoders):
            tensors = {name: getattr(t, name).detach().contiguous().cpu() for name in REQUIRED_TENSORS}
            if t.W_skip is not None:
                tensors["W_skip"] = t.W_skip.detach().contiguous().cpu()
            if activation == "jumprelu":
                tensors["activation_function.threshold"] = t.activation_function.threshold.contiguous().cpu()
            save_file(tensors, str(tmp / f"layer_{i}.safetensors"))
        if folder.exists():
            old = folder.with_name(f".{folder.name}.{writer_id()}-{secrets.token_hex(4)}.old")
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _is_set(folder: Path) -> bool:
    try:
        _read_config(folder)
    except InputError:
        return False
    return True


def _read_config(folder: Path) -> dict:
    """``config.yaml`` of a transcoder set, checked; an `InputError` for any other folder."""
    import yaml

    file = folder / CONFIG
    if not file.is_file():
        others = sorted(p.name for p in folder.iterdir())[:6] if folder.is_dir() else []
        raise InputError(
            f"{folder} has no {CONFIG}: a folder in another format (it holds {others or 'nothing'}); give a "
            "circuit-tracer transcoder set (config.yaml with model_kind: transcoder_set and layer_{i}.safetensors)"
        )
    try:
        config = yaml.safe_load(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise InputError(f"{file} is not text ({err}): restore it from the transcoder set it came from") from None
    except yaml.YAMLError as err:  # an edited or truncated config.yaml: say where it breaks
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
        what = getattr(err, "problem", None) or type(err).__name__
        raise InputError(
            f"{file} is broken YAML at {where} ({what}): fix that line, or restore the file from the set it came from"
        ) from None
    if not isinstance(config, dict) or config.get("model_kind") != "transcoder_set":
        kind = config.get("model_kind") if isinstance(config, dict) else type(config).__name__
        raise InputError(
            f"{file} says model_kind {kind!r}, not transcoder_set: a folder in another format (countlens reads "
            "per-layer transcoder sets, not cross-layer transcoders or SAEs)"
        )
    unknown = sorted(set(config) - CONFIG_KEYS)
    if unknown:
        raise InputError(f"{file} has keys countlens does not know: {unknown}; it reads {sorted(CONFIG_KEYS)}")
    for key, want in (("feature_input_hook", FEATURE_INPUT_HOOK), ("feature_output_hook", FEATURE_OUTPUT_HOOK)):
        if config.get(key, want) != want:
            raise InputError(
                f"{file}: {key} is {config[key]!r}; countlens's transcoders read and write at the MLP ({want}): "
                "a set trained elsewhere in the model cannot replace its MLPs"
            )
    activation = config.get("activation")
    if activation is not None and activation not in ("topk", "jumprelu", "relu"):
        raise InputError(f"{file}: activation {activation!r} is unknown; use topk, jumprelu or relu")
    k = config.get("k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise InputError(f"{file}: k must be an integer ≥ 1, got {k!r}")
    return config


def _layer_files(folder: Path, config: dict) -> list[Path]:
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := LAYER_FILE.fullmatch(p.name))}
    if not found:
        raise InputError(f"{folder} has {CONFIG} but no layer_{{i}}.safetensors; the set's weights are missing")
    n = max(found) + 1
    missing = sorted(set(range(n)) - set(found))
    if missing:
        raise InputError(
            f"{folder} lacks layer_{{i}}.safetensors for layers {missing} (it has {sorted(found)}); a set holds "
            "every layer from 0 with none missing: copy the missing files"
        )
    listed = config.get("transcoders")
    if listed is not None:
        names = [Path(str(x)).name for x in listed] if isinstance(listed, list) else None
        if names != [f"layer_{i}.safetensors" for i in range(n)]:
            raise InputError(
                f"{folder}/{CONFIG}: its transcoders list {listed!r:.120} does not name layer_0 … layer_{n - 1}"
                ".safetensors in order; fix the list or drop it"
            )
    return [found[i] for i in range(n)]


def _shapes(file: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as err:  # safetensors raises its own error types for a truncated or foreign file
        raise InputError(f"{file} is not a readable safetensors file ({err}); copy it again") from None


def _check_layer(file: Path, shapes: dict) -> tuple[int, int]:
    """(d_transcoder, d_model) of one layer file, after checking its keys and shapes."""
    unknown = sorted(set(shapes) - set(REQUIRED_TENSORS) - set(OPTIONAL_TENSORS))
    if unknown:
        raise InputError(
            f"{file} has tensors countlens does not know: {unknown}; a transcoder layer holds "
            f"{list(REQUIRED_TENSORS)} and optionally {list(OPTIONAL_TENSORS)}"
        )
    missing = [key for key in REQUIRED_TENSORS if key not in shapes]
    if missing:
        raise InputError(f"{file} lacks {missing}; every transcoder layer holds {list(REQUIRED_TENSORS)}")
    if len(shapes["W_enc"]) != 2:
        raise InputError(f"{file}: W_enc has shape {shapes['W_enc']}; it must be (d_transcoder, d_model)")
    d_tc, d_model = shapes["W_enc"]
    want = {
        "W_dec": (d_tc, d_model),
        "b_enc": (d_tc,),
        "b_dec": (d_model,),
        "activation_function.threshold": (d_tc,),
        "W_skip": (d_model, d_model),
        "k": (),
    }
    for key, shape in shapes.items():
        if key in want and shape != want[key] and not (key == "k" and shape == (1,)):
            raise InputError(
                f"{file}: {key} has shape {shape}; with W_enc {shapes['W_enc']} (d_transcoder, d_model) it must be "
                f"{want[key]}"
            )
    return d_tc, d_model


def load_transcoders(folder: str | Path, vlm: VLM | None = None, *, dtype: torch.dtype | None = None) -> TranscoderSet:
    """The transcoder set in ``folder`` (circuit-tracer's format, see the module's docstring), checked
    against ``vlm`` (its hidden size and layer count) where given. Tensors keep the file's dtype
    unless ``dtype`` is given, so a save → load round trip is bit for bit."""
    folder = require_path(folder, "folder", example="'transcoders'")
    if vlm is not None:
        require_vlm(vlm, "load_transcoders")
    if dtype is not None:
        require_float_dtype(dtype, "dtype")
    if not folder.is_dir():
        raise InputError(
            f"{folder} is not a folder; give the folder of a transcoder set (config.yaml, layer_*.safetensors)"
        )
    config = _read_config(folder)
    files = _layer_files(folder, config)
    shapes = [_shapes(f) for f in files]
    dims = [_check_layer(f, s) for f, s in zip(files, shapes)]
    widths = sorted({d for d, _ in dims})
    if len(widths) > 1:
        per = ", ".join(f"layer {i}: {d}" for i, (d, _) in enumerate(dims))
        raise InputError(f"{folder}: the layers differ in d_transcoder ({per}); a set shares one width")
    d_models = sorted({m for _, m in dims})
    if len(d_models) > 1:
        raise InputError(f"{folder}: the layers differ in d_model ({d_models}); they must read one model")
    d_tc, d_model = dims[0]
    has = [set(s) for s in shapes]
    for key in ("activation_function.threshold", "W_skip", "k"):
        if 0 < sum(key in h for h in has) < len(has):
            raise InputError(
                f"{folder}: some layers have {key} and some not; every layer of a set has the same tensors"
            )
    if vlm is not None:
        hidden, n_layers = vlm.arch.d_model, vlm.arch.n_layers
        if d_model != hidden:
            raise InputError(
                f"{folder}: the transcoders read d_model {d_model}, but {vlm.name or vlm.arch.name}'s hidden size is "
                f"{hidden}: a set trained for another model"
            )
        if len(files) != n_layers:
            raise InputError(
                f"{folder} holds {len(files)} layers, but {vlm.name or vlm.arch.name} has {n_layers}: a set trained "
                "for another model (or one missing its last layers)"
            )
    jump, skip, k_tensor = ("activation_function.threshold" in has[0], "W_skip" in has[0], "k" in has[0])
    activation = config.get("activation") or ("jumprelu" if jump else "topk" if (k_tensor or "k" in config) else "relu")
    if jump != (activation == "jumprelu"):
        raise InputError(
            f"{folder}: config.yaml says activation {activation!r} but the layers "
            f"{'hold' if jump else 'lack'} activation_function.threshold (JumpReLU's); make them agree"
        )
    if activation == "relu" and ("k" in config or k_tensor):
        raise InputError(f"{folder}: a relu set with a k; k is for topk sets: drop it or say activation: topk")
    from safetensors.torch import load_file

    tensors = [load_file(str(f)) for f in files]
    for file, layer in zip(files, tensors):  # finite at the door: a NaN weight would silence every feature
        for key, value in layer.items():
            require_finite_tensor(
                value,
                f"{file}: tensor {key}",
                fix="the set's training diverged, or the file was damaged: retrain the set, or copy the file again",
            )
    k = config.get("k")
    if activation == "topk":
        ks = {int(t["k"].item()) for t in tensors if "k" in t}
        if k is not None:
            ks.add(int(k))
        if len(ks) != 1:
            raise InputError(
                f"{folder}: a topk set needs one k; found {sorted(ks) or 'none'} (config.yaml's k and the layers' "
                "k tensors must agree)"
            )
        k = ks.pop()
    out = []
    for t in tensors:
        t.pop("k", None)
        if dtype is not None:
            t = {key: v.to(dtype) for key, v in t.items()}
        threshold = t.pop("activation_function.threshold", None)
        tc = Transcoder(
            d_model,
            d_tc,
            activation,
            k=k if activation == "topk" else None,
            threshold=threshold,
            skip=skip,
            dtype=t["W_enc"].dtype,
        )
        with torch.no_grad():
            for key, value in t.items():
                getattr(tc, key).copy_(value)
        out.append(tc)
    return TranscoderSet(out, model_name=str(config.get("model_name") or ""), scan=str(config.get("scan") or ""))
