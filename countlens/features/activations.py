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

The store, for a mix that does not fit the memory bound: `countlens.features.activation_store`.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine import Hook, hooked
from countlens.datasets.tasks import TASKS, task_sample, task_samples
from countlens.errors import InputError
from countlens.features.activation_store import (
    KINDS,
    MAX_MEMORY,
    ActivationStore,
    StoreWriter,
    open_store,
    require_memory,
    store_dtype,
)
from countlens.features.transcoder import TranscoderSet
from countlens.model.arguments import require_layers, require_torch_device, require_vlm
from countlens.model.processors import render_chat
from countlens.model.vlm import check_samples
from countlens.validate import (
    require_count,
    require_integer,
    require_path,
    require_seed,
    require_tensor,
)

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

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
    vlm: VLM,
    layers: Sequence[int],
    samples: Sequence,
    texts: Sequence[str] = (),
    batch_size: int = 32,
    store: str | Path | None = None,
    max_memory: float = MAX_MEMORY,
    order_seed: int | None = None,
    settings: Mapping | None = None,
) -> Activations | ActivationStore:
    """Each layer's MLP input and output at the real tokens of ``samples`` (scenes, through
    `VLM.prepare_samples`) and ``texts`` (plain prompts, no image), via forward hooks on the MLPs;
    ``layers`` None: every layer.

    ``store`` None: held in memory, returned as `Activations`. A folder: written there in chunks of
    at most ``max_memory`` bytes (all layers; the module's docstring), returned as the checked
    `ActivationStore`; ``settings`` (a JSON-able dict: what the data came from) go into its manifest.
    ``order_seed``: the samples, the texts and their batches are forwarded in an order drawn from it
    (so each chunk holds a seeded mix of every kind); None keeps the given order."""
    require_vlm(vlm, "collect_activations")
    layers = require_layers(vlm, layers, "collect_activations")
    layers = list(range(vlm.arch.n_layers)) if layers is None else layers
    require_count(batch_size, "batch_size")
    max_memory = require_memory(max_memory)
    order_seed = None if order_seed is None else require_seed(order_seed, "order_seed")
    try:
        settings = json.loads(json.dumps(dict(settings or {})))  # what the manifest will hold
    except (TypeError, ValueError):
        raise InputError(f"collect_activations: settings must be a JSON-able dict, got {settings!r:.60}") from None
    for name, given in (("samples", samples), ("texts", texts)):
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise InputError(f"collect_activations: {name} must be a list (or empty), got {type(given).__name__}")
    if not len(samples) and not len(texts):
        raise InputError("collect_activations got no samples and no texts; give some of either")
    if len(samples):
        check_samples(samples, "collect_activations")
    if not all(isinstance(t, str) for t in texts):
        raise InputError("collect_activations: texts must be a list of strings (plain prompts)")
    dtype = torch.float32 if store is None else store_dtype(vlm.hf.dtype)
    if store is not None:
        store = require_path(store, "store", example="'runs/tc/activations'")
        if store.exists() and not store.is_dir():
            raise InputError(f"store {store} is a file; give a folder for the activation chunks")
        writer = StoreWriter(store, vlm, layers, dtype, settings)
    got_in: dict[int, list] = {layer: [] for layer in layers}
    got_out: dict[int, list] = {layer: [] for layer in layers}
    mask: list[torch.Tensor] = []

    def hook(layer: int):
        def record(module, args, kwargs, output):
            x = args[0] if args else next(iter(kwargs.values()))
            keep = mask[-1]
            got_in[layer].append(x[keep].detach().to(dtype).cpu())
            got_out[layer].append(output[keep].detach().to(dtype).cpu())

        return record

    kinds: list[str] = []
    per_token = 2 * len(layers) * vlm.arch.d_model * dtype.itemsize
    with hooked(vlm.hf, [Hook(vlm.arch.mlp(layer), "after", hook(layer)) for layer in layers]):
        for kind, items in _jobs(samples, texts, batch_size, order_seed):
            if kind == "scenes":
                batch = vlm.prepare_samples(items)
                mask.append(batch.inputs["attention_mask"].bool())
                vlm.hf(**batch.inputs)
                kinds += [s.task for s, m in zip(items, mask[-1]) for _ in range(int(m.sum()))]
            else:
                enc = encode_texts(vlm, items)
                mask.append(enc["attention_mask"].bool())
                ids, att = enc["input_ids"].to(vlm.device), enc["attention_mask"].to(vlm.device)
                vlm.hf(input_ids=ids, attention_mask=att)
                kinds += ["text"] * int(mask[-1].sum())
            mask.clear()
            if store is not None and len(kinds) * per_token >= max_memory:
                writer.flush(got_in, got_out, kinds)
    if store is None:
        return Activations(
            {layer: torch.cat(v) for layer, v in got_in.items()},
            {layer: torch.cat(v) for layer, v in got_out.items()},
            np.array(kinds, dtype=object),
        )
    writer.flush(got_in, got_out, kinds)
    return open_store(writer.finish(), vlm, layers, settings)


def encode_texts(vlm: VLM, texts: Sequence[str]):
    """Plain prompts in the model's chat template, left-padded token ids and attention mask (no image)."""
    user = [[{"role": "user", "content": [{"type": "text", "text": t}]}] for t in texts]
    chats = [render_chat(vlm.processor, turns, vlm.name) for turns in user]
    return vlm.tokenizer(chats, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)


def estimate_tokens(vlm: VLM, mix: Mapping[str, int], seed: int) -> int:
    """The real tokens of ``mix``'s samples, from the first sample of each kind (processor only, no forward)."""
    scenes, texts = mix_samples({kind: min(n, 1) for kind, n in mix.items()}, seed)
    per = {s.task: int(vlm.prepare_samples([s]).inputs["attention_mask"].sum()) for s in scenes}
    if texts:
        per["text"] = int(encode_texts(vlm, texts[:1])["attention_mask"].sum())
    return sum(n * per.get(kind, 0) for kind, n in mix.items())


def _jobs(samples: Sequence, texts: Sequence[str], size: int, order_seed: int | None) -> list[tuple[str, list]]:
    """The forwards' batches, ("scenes", samples) and ("texts", prompts): in the given order, or
    samples, texts and batches each permuted by a generator seeded with ``order_seed``."""
    samples, texts = list(samples), list(texts)
    generator = None if order_seed is None else torch.Generator().manual_seed(order_seed)
    if generator is not None:
        samples = [samples[i] for i in torch.randperm(len(samples), generator=generator).tolist()]
        texts = [texts[i] for i in torch.randperm(len(texts), generator=generator).tolist()]
    jobs = [("scenes", samples[i : i + size]) for i in range(0, len(samples), size)]
    jobs += [("texts", texts[i : i + size]) for i in range(0, len(texts), size)]
    if generator is not None:
        jobs = [jobs[i] for i in torch.randperm(len(jobs), generator=generator).tolist()]
    return jobs


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
def fidelity(
    transcoders: TranscoderSet, activations: Activations | ActivationStore, chunk: int = 4096, device=None
) -> xr.Dataset:
    """FVU, L0 and dead features of each layer's transcoder on ``activations`` (the held-out split, in
    memory or a store, read one chunk at a time), computed on ``device`` (None: where the set is): an
    `xr.Dataset` over ``layer`` with ``fvu``, ``l0``, ``dead`` and ``dead_share``."""
    if not isinstance(transcoders, TranscoderSet):
        raise InputError(
            f"fidelity takes a TranscoderSet (train_transcoders, load_transcoders), got {transcoders!r:.60}"
        )
    if not isinstance(activations, (Activations, ActivationStore)):
        raise InputError(f"fidelity takes the Activations collect_activations returns, got {activations!r:.60}")
    require_count(chunk, "chunk")
    device = None if device is None else require_torch_device(device, "fidelity")
    rows = {"fvu": [], "l0": [], "dead": []}
    memory = isinstance(activations, Activations)
    for layer, tc in transcoders.items():
        tc = tc if device is None or tc.b_enc.device == device else copy.deepcopy(tc).to(device)
        if layer not in (activations.inputs if memory else activations.layers):
            raise InputError(
                f"fidelity: no activations of layer {layer}; collect the set's layers {list(transcoders.layers)}"
            )
        pieces = [(activations.inputs[layer], activations.outputs[layer])] if memory else activations.chunks(layer)
        active, fired = 0, torch.zeros(tc.d_transcoder, dtype=torch.bool)
        sse, s1, s2 = 0.0, 0.0, 0.0
        for x, y in pieces:
            y_hat = []
            for i in range(0, len(x), chunk):
                xi = x[i : i + chunk].to(tc.b_enc.device, tc.dtype)
                a = tc.encode(xi)
                y_hat.append(tc.decode(a, xi).float().cpu())
                nz = a != 0
                active += int(nz.sum())
                fired |= nz.any(0).cpu()
            if memory:  # one piece: the exact two-pass FVU
                rows["fvu"].append(fvu(y, torch.cat(y_hat)))
            else:
                y64 = y.double()
                sse += float(((y64 - torch.cat(y_hat).double()) ** 2).sum())
                s1, s2 = s1 + y64.sum(0), s2 + (y64 * y64).sum(0)
                del x, y, y64  # one chunk held at a time
        if not memory:
            total = float((s2 - s1 * s1 / activations.n_tokens).sum())
            if total <= 0:
                raise InputError("fvu: the outputs do not vary (all tokens equal): there is no variance to explain")
            rows["fvu"].append(sse / total)
        rows["l0"].append(active / activations.n_tokens)
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
