"""Training per-layer TopK transcoders on a model's own MLP activations.

For each chosen layer, `train_transcoders` fits a `Transcoder` to reconstruct the MLP's output ``y``
from its input ``x`` (`countlens.features.activations` says which tokens, from which data mix):

1. **Data.** One pass of the model over the mix's training samples records ``(x, y)`` at every real
   token of every chosen layer; a second pass records the held-out split.
2. **Initialisation** (seeded per layer): ``W_enc`` ~ N(0, 1/d_model), ``W_dec`` its rows scaled to
   unit norm (a tied start), ``b_enc = 0``, ``b_dec = ȳ`` (the training mean output).
3. **Steps.** Each step draws ``batch_tokens`` tokens at random (with replacement, from a generator
   seeded by ``seed`` and the layer) and takes one Adam step on the normalised MSE
   ``Σ‖y − ŷ‖² / (batch_tokens · Σ var(y))`` — the batch's FVU against the training variance, so one
   learning rate suits every layer's scale. After each step the decoder rows are rescaled to unit
   norm (*countlens's choice*; circuit-tracer leaves training out, and TopK needs no sparsity
   penalty, so the norm only fixes the scale between a feature's activation and its write).
   **AuxK** (Gao et al. 2024; `countlens.features.dead`) keeps features alive: a feature that has
   not fired for `DEAD_AFTER` steps counts as dead, and the largest pre-activations among dead
   features (through ReLU) must reconstruct the batch's remaining error ``y − ŷ`` through their
   decoder rows; that loss, normalised by the error's energy (``aux_norm="error"``, adapted from
   Gao et al.'s code, which divides by the error's variance over the batch; ``"variance"``: like
   the main loss, by the outputs' variance) and weighted `AUX_WEIGHT`, is added to the main one.
4. **Fidelity** on the held-out split: FVU, L0, dead features per layer (`fidelity`).

With ``out`` the run is resumable: ``out/checkpoint.pt`` holds the finished layers, the current
layer's weights, Adam state and generator state every ``checkpoint_every`` steps (written
atomically), so after an interruption the same call continues from the last saved step and ends with
the weights an uninterrupted run gets. The result is also written there: ``out/transcoders/`` (a
circuit-tracer transcoder set, `countlens.features.files`; for a run over every layer, as the format
holds layers 0 … n − 1) and ``out/fidelity.nc``. Everything is a
function of ``seed`` (data, initialisation, batches): two runs agree bit for bit on one machine.

**Streaming.** Where both splits' activations as float32 (estimated from one sample of each kind,
`countlens.features.activations.estimate_tokens`) would be more than ``max_memory`` bytes, they are
collected to activation stores (`countlens.features.activations`: ``out/activations/train`` and
``…/held_out``, or a temporary folder without ``out``, reused on resume), their samples forwarded in
an order drawn from ``seed`` so each chunk mixes every kind. Every chunk is read once, and refused on
NaN or ±inf, before the first step (the mean and variance of the outputs). Each layer then trains
chunk by chunk: the chunks are visited in passes, each pass in an order drawn from a generator seeded
by ``seed`` and the layer, ``ceil(tokens / batch_tokens)`` steps on a chunk per visit (its batches
drawn as above from that chunk alone). One chunk is the in-memory path exactly: the same batches,
the same weights.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import xarray as xr

from countlens.errors import InputError
from countlens.features.activation_store import (
    MANIFEST,
    MAX_MEMORY,
    ActivationStore,
    open_store,
    require_memory,
    streams,
)
from countlens.features.activations import (
    DATA_SEED_BASE,
    TEXT_START,
    Activations,
    check_mix,
    collect_activations,
    estimate_tokens,
    fidelity,
    held_out_mix,
    mix_samples,
)
from countlens.features.dead import AUX_K, AUX_NORM, AUX_WEIGHT, DEAD_AFTER, auxk_loss, require_aux_norm
from countlens.features.files import save_transcoders
from countlens.features.transcoder import Transcoder, TranscoderSet
from countlens.files import atomic_path, machine_errors, settings_changes
from countlens.model.arguments import require_torch_device, require_vlm
from countlens.progress import Bar
from countlens.results import provenance
from countlens.validate import require_count, require_path, require_positive, require_seed, require_share

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

CHECKPOINT = "checkpoint.pt"
#: The defaults: a few minutes for the organism's six layers on 2 CPU cores.
WIDTH, K, STEPS, BATCH_TOKENS, LR = 512, 16, 1500, 512, 2e-3


class Training(NamedTuple):
    """What `train_transcoders` returns: the set, and its held-out fidelity over ``layer`` (attrs:
    provenance — the mix, seeds, counts, hyperparameters)."""

    transcoders: TranscoderSet
    fidelity: xr.Dataset


def train_step(
    tc: Transcoder,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    scale: float,
    dead: torch.Tensor,
    aux_norm: str = AUX_NORM,
) -> tuple[float, torch.Tensor]:
    """One Adam step on ``Σ‖y − tc(x)‖² / (len(x) · scale)`` plus the AuxK term on the ``dead``
    features (`countlens.features.dead`, normalised by ``aux_norm``), then unit-norm decoder rows;
    returns (the main loss, which features fired)."""
    optimizer.zero_grad(set_to_none=True)
    pre = tc.pre_activations(x)
    a = tc.activation_function(pre)
    y_hat = tc.decode(a, x)
    loss = ((y_hat - y) ** 2).sum() / (len(x) * scale)
    aux = auxk_loss(pre, tc.W_dec, y - y_hat, dead, scale, aux_norm)
    total = loss if aux is None else loss + AUX_WEIGHT * aux
    total.backward()
    optimizer.step()
    with torch.no_grad():
        tc.W_dec /= tc.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-8)
    return float(loss.detach()), (a != 0).any(0)


def _check_layers(vlm: VLM, layers: Sequence[int] | None) -> list[int]:
    n = vlm.arch.n_layers
    if layers is None:
        return list(range(n))
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise InputError(f"layers must be a non-empty list of layer indices, e.g. [0, 1]; got {layers!r:.60}")
    bad = [x for x in layers if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < n]
    if bad:
        raise InputError(f"layers {bad} are not layers of {vlm.name or vlm.arch.name} (0 … {n - 1})")
    if sorted(set(layers)) != list(layers):
        raise InputError(f"layers {list(layers)} must be distinct and increasing, e.g. [0, 1, 2]")
    return list(layers)


def _init(tc: Transcoder, y_mean: torch.Tensor, generator: torch.Generator) -> None:
    with torch.no_grad():
        tc.W_enc.copy_(torch.randn(tc.W_enc.shape, generator=generator) / tc.d_model**0.5)
        tc.W_dec.copy_(tc.W_enc / tc.W_enc.norm(dim=1, keepdim=True))
        tc.b_enc.zero_()
        tc.b_dec.copy_(y_mean)


def _save(path: Path, state: dict) -> None:
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def train_transcoders(
    vlm: VLM,
    layers: Sequence[int] | None = None,
    width: int = WIDTH,
    k: int = K,
    steps: int = STEPS,
    batch_tokens: int = BATCH_TOKENS,
    lr: float = LR,
    seed: int = 0,
    mix: Mapping[str, int] | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    resume: bool = True,
    held_out: float = 0.25,
    checkpoint_every: int = 250,
    batch_size: int = 32,
    max_memory: float = MAX_MEMORY,
    device: str | torch.device | None = None,
    aux_norm: str = AUX_NORM,
) -> Training:
    """Train one TopK transcoder (``width`` features, ``k`` active) per layer of ``layers`` (default:
    every layer) to reconstruct the MLP's output from its input; see the module's docstring.

    ``mix``: samples per kind (`countlens.features.activations.DEFAULT_MIX`: counting scenes, the two
    other tasks' scenes, plain text prompts); ``held_out``: the share of each kind drawn again, after
    the training samples, for the fidelity table. ``out``: a folder for the checkpoint and the result;
    with ``resume`` (default) a checkpoint there of the same call is continued, without it replaced.
    ``max_memory``: the bound (bytes) on activations held in memory; above it they are
    streamed from disk (the module's docstring). Streamed, a training holds at most: while collecting,
    ``max_memory`` plus one batch's activations (all layers); while training, one layer of one chunk
    as float32, ``2 × chunk tokens × d_model × 4`` bytes — a chunk's tokens are at most
    ``(max_memory + one batch) / (2 × len(layers) × d_model × element size)`` — plus the transcoder,
    its gradients and Adam's two moments (``4 × (2 · width · d_model + width + d_model) × 4`` bytes)
    and one step's batch: bounded by the chunk, never by the number of samples.
    ``device``: where the transcoders train and are scored (None: the model's device; the batches are
    drawn on the host, so the weights do not depend on it beyond the device's arithmetic); the set
    returned is on the CPU. ``aux_norm``: how AuxK's loss is normalised, ``"error"`` (default) or
    ``"variance"`` (by the outputs' variance, like the main loss; `countlens.features.dead`). Returns
    `Training` (the set, and its fidelity over ``layer``)."""
    require_vlm(vlm, "train_transcoders")
    layers = _check_layers(vlm, layers)
    require_count(width, "width")
    require_count(k, "k")
    if k > width:
        raise InputError(f"k={k} is more than width={width} features; give k ≤ width")
    require_count(steps, "steps")
    require_count(batch_tokens, "batch_tokens")
    require_positive(lr, "lr")
    require_seed(seed)
    mix = check_mix(mix)
    require_share(held_out, "held_out", below_one=True, above_zero=True)
    require_count(checkpoint_every, "checkpoint_every")
    require_count(batch_size, "batch_size")
    aux_norm = require_aux_norm(aux_norm)
    max_memory = require_memory(max_memory)
    device = require_torch_device(vlm.device if device is None else device, "train_transcoders")
    for name, flag in (("progress", progress), ("resume", resume)):
        if not isinstance(flag, bool):
            raise InputError(f"{name} must be True or False, got {flag!r}")
    if out is not None:
        out = require_path(out, "out", example="'runs/tc'")  # "" is no folder: not the working directory
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise InputError(f"out {out} is a file; give a folder for the checkpoint and the result")
    spec = {
        "model": vlm.name or vlm.arch.name,
        "layers": layers,
        "width": width,
        "k": k,
        "steps": steps,
        "batch_tokens": batch_tokens,
        "lr": lr,
        "seed": seed,
        "mix": mix,
        "held_out": held_out,
        "aux_norm": aux_norm,
    }
    held = held_out_mix(mix, held_out)
    tokens = estimate_tokens(vlm, mix, seed) + estimate_tokens(vlm, held, seed)
    stream = streams(tokens, len(layers), vlm.arch.d_model, max_memory)
    if stream:
        spec["max_memory"] = max_memory  # the chunks shape the batches
    ckpt_path = None if out is None else Path(out) / CHECKPOINT
    state = _resumed(ckpt_path, spec) if (ckpt_path is not None and resume) else None
    folder = Path(out or tempfile.mkdtemp(prefix="countlens-activations-")) / "activations" if stream else None
    splits = {"train": (mix, {}), "held_out": (held, mix)}
    stores = {}
    for split in splits if stream else ():  # a store already there: checked before any forward
        if (folder / split / MANIFEST).is_file() and resume:
            stores[split] = open_store(folder / split, vlm, layers, _settings(spec, split, batch_size, vlm))
            stores[split].stats()  # NaN or ±inf refused now
    if ckpt_path is not None:
        ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return _run(
            device,
            vlm,
            layers,
            spec,
            splits,
            stores,
            folder,
            batch_size,
            state,
            ckpt_path,
            checkpoint_every,
            progress,
            out,
        )
    finally:
        if stream and out is None:
            shutil.rmtree(folder.parent, ignore_errors=True)


def _settings(spec: dict, split: str, batch_size: int, vlm: VLM) -> dict:
    """What a store's data came from (its manifest's settings): the training's data settings, and the
    model's dtype and image grid (the same checkpoint loaded in another dtype or at another image
    size gives other activations)."""
    keys = ("model", "layers", "seed", "mix", "held_out", "max_memory")
    g = vlm.geometry
    grid = {"image": [g.image_height, g.image_width], "patch": g.patch_size, "merge": g.merge_size}
    model = {"dtype": str(vlm.hf.dtype).removeprefix("torch."), "grid": grid}
    return {"split": split, "batch_size": batch_size, **{key: spec[key] for key in keys}, **model}


def _run(
    device, vlm, layers, spec, splits, stores, folder, batch_size, state, ckpt_path, checkpoint_every, progress, out
):
    seed, width, k = spec["seed"], spec["width"], spec["k"]
    data = {}
    for split, (counts, start) in splits.items():
        samples = mix_samples(counts, seed, start=start)
        if folder is None:
            data[split] = collect_activations(vlm, layers, *samples, batch_size=batch_size)
        elif split in stores:
            data[split] = stores[split]
        else:
            data[split] = collect_activations(
                vlm,
                layers,
                *samples,
                batch_size=batch_size,
                store=folder / split,
                max_memory=spec["max_memory"],
                order_seed=DATA_SEED_BASE + seed,
                settings=_settings(spec, split, batch_size, vlm),
            )
    train_data, test_data = data["train"], data["held_out"]
    stats = train_data.stats() if isinstance(train_data, ActivationStore) else None
    if stats is not None and "held_out" not in stores:
        test_data.stats()  # every held-out chunk checked before the first step too

    done: dict[int, dict] = dict(state["done"]) if state else {}
    transcoders = []
    for layer in layers:
        tc = Transcoder(vlm.arch.d_model, width, "topk", k=k)
        if layer in done:
            tc.load_state_dict(done[layer])
        else:
            current = state if state and state.get("layer") == layer else None
            _train_layer(
                tc.to(device), layer, train_data, stats, spec, done, current, ckpt_path, checkpoint_every, progress
            )
            tc.to("cpu")
            done[layer] = {key: v.clone() for key, v in tc.state_dict().items()}
            if ckpt_path is not None:
                _save(ckpt_path, {"spec": spec, "done": done, "layer": None})
        transcoders.append(tc)
    name = vlm.name or vlm.arch.name
    result = TranscoderSet(transcoders, layers, model_name=name, scan=f"countlens/{name}/topk-{width}-{k}-seed{seed}")
    table = fidelity(result, test_data, device=device)
    table.attrs.update(_provenance(vlm, spec, splits["held_out"][0], train_data, test_data))
    if out is not None:
        if result.layers == tuple(range(vlm.arch.n_layers)):
            save_transcoders(result, Path(out) / "transcoders")
        fidelity_file = Path(out) / "fidelity.nc"
        with atomic_path(fidelity_file) as tmp, machine_errors(fidelity_file, table.nbytes):
            table.to_netcdf(tmp)  # whole or not at all; a full disk reported as the disk's fault
    return Training(result, table)


def _resumed(path: Path, spec: dict) -> dict | None:
    if not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # a truncated or foreign file
        raise InputError(
            f"{path} is not a readable checkpoint ({err}); delete it to start over (in Python: resume=False)"
        ) from None
    saved = state.get("spec") if isinstance(state, dict) else None
    if saved != spec:
        raise InputError(
            f"{path} is the checkpoint of another training, with other settings: {settings_changes(saved, spec)} "
            f"(old → new); rerun with the old settings to resume it, give another out folder (--out), or delete "
            f"{path} to start over with the new ones (in Python: resume=False)"
        )
    return state


def schedule(chunk_tokens: Sequence[int], steps: int, batch_tokens: int, generator: torch.Generator) -> list:
    """The (chunk, steps on it) visits of a streamed layer: passes over the chunks, each pass in an order
    drawn from ``generator``, ``ceil(tokens / batch_tokens)`` steps per visit, until ``steps``; one
    chunk: ``[(0, steps)]`` (nothing drawn)."""
    if len(chunk_tokens) == 1:
        return [(0, steps)]
    visits, left = [], steps
    while left:
        for c in torch.randperm(len(chunk_tokens), generator=generator).tolist():
            n = min(left, max(1, math.ceil(chunk_tokens[c] / batch_tokens)))
            visits.append((c, n))
            left -= n
            if not left:
                break
    return visits


def _train_layer(
    tc: Transcoder,
    layer: int,
    data: Activations | ActivationStore,
    stats: dict | None,
    spec: dict,
    done: dict,
    state: dict | None,
    ckpt_path: Path | None,
    every: int,
    progress: bool,
) -> None:
    if stats is None:  # in memory: one chunk
        y = data.outputs[layer]
        mean, scale = y.mean(0), float(y.var(0, unbiased=False).sum())
        tokens, read = [len(y)], lambda c: (data.inputs[layer], data.outputs[layer])
    else:
        (mean, scale), tokens = stats[layer], data.chunk_tokens
        read = lambda c: data.read(layer, c)  # noqa: E731
    seeded = spec["seed"] * 1_000_003 + layer
    visits = schedule(tokens, spec["steps"], spec["batch_tokens"], torch.Generator().manual_seed(seeded + 500_009))
    generator = torch.Generator().manual_seed(seeded)
    optimizer = torch.optim.Adam(tc.parameters(), lr=spec["lr"])
    device = tc.b_enc.device
    start, since = 0, torch.zeros(tc.d_transcoder, dtype=torch.long, device=device)
    if state is not None:
        tc.load_state_dict(state["weights"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        start, since = state["step"], state["since"].to(device)
    else:
        _init(tc, mean, generator)
    bar = None
    if progress:
        bar = Bar(f"transcoder layer {layer}", spec["steps"]).__enter__()
    try:
        first = 1
        for c, n in visits:
            first, last = first + n, first + n - 1
            if last <= start:
                continue
            x, y = read(c)  # the only chunk held
            for step in range(max(first - n, start + 1), last + 1):
                index = torch.randint(len(x), (spec["batch_tokens"],), generator=generator)
                xb, yb = x[index].to(device), y[index].to(device)  # .to: the same tensor on the CPU
                loss, fired = train_step(tc, optimizer, xb, yb, scale, since >= DEAD_AFTER, spec["aux_norm"])
                since = torch.where(fired, 0, since + 1)
                if bar is not None:
                    bar.update(step, f"batch FVU {loss:.3f}")
                if ckpt_path is not None and step % every == 0 and step < spec["steps"]:
                    _save(
                        ckpt_path,
                        {
                            "spec": spec,
                            "done": done,
                            "layer": layer,
                            "step": step,
                            "weights": tc.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "generator": generator.get_state(),
                            "since": since,
                        },
                    )
            del x, y
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)


def _provenance(vlm: VLM, spec: dict, held: dict, train: Activations, test: Activations) -> dict:
    counts = {
        split: {kind: int((data.kinds == kind).sum()) for kind in spec["mix"]}
        for split, data in (("train", train), ("held_out", test))
    }
    return provenance(
        vlm.name,
        vlm.arch.name,
        dataset={
            "mix": spec["mix"],
            "held_out_mix": held,
            "scene_seed": DATA_SEED_BASE + spec["seed"],
            "text_start": TEXT_START,
            "tokens": counts,
            "text": "each task's question without its image, in the chat template",
        },
        seed=spec["seed"],
        layers=spec["layers"],
        width=spec["width"],
        k=spec["k"],
        steps=spec["steps"],
        batch_tokens=spec["batch_tokens"],
        lr=spec["lr"],
        held_out=spec["held_out"],
        decoder="rows unit-normalised after every step",
        auxk=f"dead after {DEAD_AFTER} steps, k {AUX_K}, weight {AUX_WEIGHT}, normalised by the {spec['aux_norm']}",
        loss="MSE normalised by the training outputs' total variance, Adam",
    )
