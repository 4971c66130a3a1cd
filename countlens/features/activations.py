"""What transcoders learn from and how well they do it: MLP activations from a stated data mix, and
the fidelity of a set on held-out activations.

**The mix.** A transcoder learns the map ``x → y`` of one MLP (its input, after
``post_attention_layernorm``, and its output, what it adds to the residual stream) from activations
at every real token — image tokens, chat-template tokens, question and answer-slot tokens; never a
pad (``attention_mask`` 0). The tokens come from a *mix*: ``{"count": 384, "color": 64, "shape": 64,
"text": 128}`` (`DEFAULT_MIX`) asks for 384 counting scenes, 64 and 64 scenes of the organism's two
other tasks (`countlens.datasets.tasks`) and 128 plain text prompts. A plain text prompt is a task's
question with no image, in the model's chat template (the organism's vocabulary is its questions'
words); it is tokenised by the tokenizer alone and run through the language model without pixels.
Scenes come from seed ``DATA_SEED_BASE + seed`` (7000 +), away from the organism's training scenes
(1000 +) and the evaluations' small seeds; text prompts take the questions of samples from index
`TEXT_START` of the same seed. The held-out split takes, of each kind, ``ceil(n × held_out)`` further
samples after the training ones: same distribution, no shared sample.

**Fidelity** on held-out activations, per layer:

- ``fvu`` (fraction of variance unexplained) = ``Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` over held-out tokens,
  ``ȳ`` the held-out mean output: 0 is a perfect reconstruction, 1 is no better than the mean.
- ``l0`` = the mean number of non-zero feature activations per token (≤ k for TopK).
- ``dead`` = the number of features that are zero on every held-out token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine import Hook, hooked
from countlens.datasets.tasks import TASKS, task_sample, task_samples
from countlens.errors import InputError
from countlens.features.transcoder import TranscoderSet
from countlens.model.arguments import require_layers, require_vlm
from countlens.model.processors import render_chat
from countlens.model.vlm import check_samples
from countlens.validate import require_count, require_integer, require_tensor

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

#: The mix's kinds: the organism's three tasks (scenes) and plain text prompts.
KINDS: tuple[str, ...] = ("count", "color", "shape", "text")
#: Samples of each kind for training (the held-out split adds ``held_out`` of each).
DEFAULT_MIX: dict[str, int] = {"count": 384, "color": 64, "shape": 64, "text": 128}
#: Transcoder data use seeds from here (the organism trains on 1000 +, evaluations use small seeds).
DATA_SEED_BASE = 7000
#: The sample index from which text prompts take their questions.
TEXT_START = 1_000_000


def check_mix(mix: Mapping[str, int] | None) -> dict[str, int]:
    """The mix as a dict over `KINDS` (missing kinds 0); an `InputError` for anything else."""
    if mix is None:
        return dict(DEFAULT_MIX)
    if not isinstance(mix, Mapping):
        raise InputError(f"mix must be a dict of sample counts, e.g. {DEFAULT_MIX}; got {type(mix).__name__}")
    unknown = sorted(set(mix) - set(KINDS))
    if unknown:
        raise InputError(f"mix has kinds {unknown}; use {list(KINDS)} (the tasks' scenes and 'text' prompts)")
    out = {kind: require_integer(mix.get(kind, 0), f"mix[{kind!r}]", low=0) for kind in KINDS}
    if not sum(out.values()):
        raise InputError(f"mix asks for no samples; give some, e.g. {DEFAULT_MIX}")
    return out


def held_out_mix(mix: Mapping[str, int], share: float) -> dict[str, int]:
    """The held-out split's counts: ``ceil(n × share)`` of each kind the mix has."""
    return {kind: math.ceil(n * share) for kind, n in mix.items()}


def mix_samples(mix: Mapping[str, int], seed: int, start: Mapping[str, int] | None = None) -> tuple[list, list[str]]:
    """(scene samples, text prompts) of a mix under ``seed``, each kind from index ``start[kind]``."""
    start = start or {}
    data_seed = DATA_SEED_BASE + seed
    scenes = [
        s for kind in TASKS if mix.get(kind) for s in task_samples(kind, mix[kind], data_seed, start.get(kind, 0))
    ]
    first = TEXT_START + start.get("text", 0)
    texts = [
        task_sample(TASKS[i % len(TASKS)], data_seed, i).question for i in range(first, first + mix.get("text", 0))
    ]
    return scenes, texts


class Activations(NamedTuple):
    """Per layer, the MLP's inputs and outputs at real tokens: ``inputs[l]`` and ``outputs[l]`` are
    ``(tokens, d_model)`` float32 tensors in the same token order; ``kinds`` names each token's source."""

    inputs: dict[int, torch.Tensor]
    outputs: dict[int, torch.Tensor]
    kinds: np.ndarray

    @property
    def n_tokens(self) -> int:
        return len(self.kinds)


@torch.no_grad()
def collect_activations(
    vlm: VLM, layers: Sequence[int], samples: Sequence, texts: Sequence[str] = (), batch_size: int = 32
) -> Activations:
    """Each layer's MLP input and output at the real tokens of ``samples`` (scenes, through
    `VLM.prepare_samples`) and ``texts`` (plain prompts, no image), via forward hooks on the MLPs;
    ``layers`` None: every layer."""
    require_vlm(vlm, "collect_activations")
    layers = require_layers(vlm, layers, "collect_activations")
    layers = list(range(vlm.arch.n_layers)) if layers is None else layers
    require_count(batch_size, "batch_size")
    for name, given in (("samples", samples), ("texts", texts)):
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise InputError(f"collect_activations: {name} must be a list (or empty), got {type(given).__name__}")
    if not len(samples) and not len(texts):
        raise InputError("collect_activations got no samples and no texts; give some of either")
    if len(samples):
        check_samples(samples, "collect_activations")
    if not all(isinstance(t, str) for t in texts):
        raise InputError("collect_activations: texts must be a list of strings (plain prompts)")
    got_in: dict[int, list] = {layer: [] for layer in layers}
    got_out: dict[int, list] = {layer: [] for layer in layers}
    mask: list[torch.Tensor] = []

    def hook(layer: int):
        def record(module, args, kwargs, output):
            x = args[0] if args else next(iter(kwargs.values()))
            keep = mask[-1]
            got_in[layer].append(x[keep].detach().float().cpu())
            got_out[layer].append(output[keep].detach().float().cpu())

        return record

    kinds: list[str] = []
    with hooked(vlm.hf, [Hook(vlm.arch.mlp(layer), "after", hook(layer)) for layer in layers]):
        for chunk, batch in vlm.batches(list(samples), batch_size):
            mask.append(batch.inputs["attention_mask"].bool())
            vlm.hf(**batch.inputs)
            kinds += [s.task for s, m in zip(chunk, mask[-1]) for _ in range(int(m.sum()))]
        tok = vlm.tokenizer
        for i in range(0, len(texts), batch_size):
            chats = [
                render_chat(vlm.processor, [{"role": "user", "content": [{"type": "text", "text": t}]}], vlm.name)
                for t in texts[i : i + batch_size]
            ]
            enc = tok(chats, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
            mask.append(enc["attention_mask"].bool())
            vlm.hf(input_ids=enc["input_ids"].to(vlm.device), attention_mask=enc["attention_mask"].to(vlm.device))
            kinds += ["text"] * int(mask[-1].sum())
    return Activations(
        {layer: torch.cat(v) for layer, v in got_in.items()},
        {layer: torch.cat(v) for layer, v in got_out.items()},
        np.array(kinds, dtype=object),
    )


def fvu(y: torch.Tensor, y_hat: torch.Tensor) -> float:
    """Fraction of variance unexplained, ``Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` over the rows of ``y`` (tokens)."""
    require_tensor(y, "fvu's y")
    require_tensor(y_hat, "fvu's y_hat")
    if y.shape != y_hat.shape or y.ndim != 2 or len(y) < 2:
        raise InputError(
            f"fvu takes two (tokens ≥ 2, d_model) tensors of one shape; got {tuple(y.shape)}, {tuple(y_hat.shape)}"
        )
    y, y_hat = y.double(), y_hat.double()
    total = ((y - y.mean(0)) ** 2).sum()
    if total == 0:
        raise InputError("fvu: the outputs do not vary (all tokens equal): there is no variance to explain")
    return float(((y - y_hat) ** 2).sum() / total)


@torch.no_grad()
def fidelity(transcoders: TranscoderSet, activations: Activations, chunk: int = 4096) -> xr.Dataset:
    """FVU, L0 and dead features of each layer's transcoder on ``activations`` (the held-out split):
    an `xr.Dataset` over ``layer`` with ``fvu``, ``l0``, ``dead`` and ``dead_share``."""
    if not isinstance(transcoders, TranscoderSet):
        raise InputError(
            f"fidelity takes a TranscoderSet (train_transcoders, load_transcoders), got {transcoders!r:.60}"
        )
    if not isinstance(activations, Activations):
        raise InputError(f"fidelity takes the Activations collect_activations returns, got {activations!r:.60}")
    require_count(chunk, "chunk")
    rows = {"fvu": [], "l0": [], "dead": []}
    for layer, tc in transcoders.items():
        if layer not in activations.inputs:
            raise InputError(
                f"fidelity: no activations of layer {layer}; collect the set's layers {list(transcoders.layers)}"
            )
        x, y = activations.inputs[layer], activations.outputs[layer]
        y_hat, active, fired = [], 0, torch.zeros(tc.d_transcoder, dtype=torch.bool)
        for i in range(0, len(x), chunk):
            xi = x[i : i + chunk].to(tc.dtype)
            a = tc.encode(xi)
            y_hat.append(tc.decode(a, xi).float())
            nz = a != 0
            active += int(nz.sum())
            fired |= nz.any(0)
        rows["fvu"].append(fvu(y, torch.cat(y_hat)))
        rows["l0"].append(active / len(x))
        rows["dead"].append(int((~fired).sum()))
    ds = xr.Dataset(
        {name: ("layer", np.array(values)) for name, values in rows.items()},
        coords={"layer": list(transcoders.layers)},
    )
    ds["dead_share"] = ds["dead"] / transcoders.d_transcoder
    ds["fvu"].attrs["meaning"] = "Σ‖y − ŷ‖² / Σ‖y − ȳ‖² over held-out tokens (0 perfect, 1 no better than the mean)"
    ds["l0"].attrs["meaning"] = "mean number of non-zero feature activations per token"
    ds["dead"].attrs["meaning"] = "features zero on every held-out token"
    ds.attrs["n_tokens"] = activations.n_tokens
    return ds
