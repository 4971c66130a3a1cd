"""Mean ablation of attention heads, single and joint, and the overlap of tasks' critical heads.

A head is mean-ablated by replacing its z (the input of o_proj) with its mean over a reference set,
taken separately per token group — image tokens, the last prompt token, other text — so the head
keeps its average behaviour at each kind of position but loses everything specific to the input.
`ablation_scan` ablates every head on its own (batch expansion: many heads per forward) and
reports, per task, the drop in accuracy and in the gold answer's log-probability;
`ablate` ablates a set of heads jointly; `top_heads` and `jaccard` compare tasks' top-k heads.

Multi-token answers ("12" → "1", "2") are teacher-forced: log p(gold) sums the answer tokens'
log-probabilities and a sample stays correct while each token is the arg-max given the ones before
(`countlens.model.answers.sequence_scores`); the forced tokens belong to the ``last`` group, for the means
too. Where every answer is one token (a word-level vocabulary) nothing is forced and the scan reads
the last prompt position alone, where the model writes that one token; on a digit-splitting
vocabulary every answer, even "3", ends with the end-of-answer token, so log p(gold) covers that
token too.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens import distributed
from countlens.circuits.engine.edits import Edit, run_edits
from countlens.circuits.engine.sweep import open_store, run_chunks
from countlens.circuits.sites import HeadZ, checked_heads, group_mask
from countlens.distributed import Shard
from countlens.errors import InputError
from countlens.labels import head_label, top_sites
from countlens.model.answers import answer_window, sequence_scores
from countlens.model.arguments import require_vlm
from countlens.model.vlm import check_samples
from countlens.results import provenance
from countlens.sweep_store import SweepStore, samples_digest
from countlens.validate import require_count, require_dataset

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.model.vlm import VLM, Batch

ABLATION_GROUPS: tuple[str, ...] = ("image", "last", "text")


def group_masks(batch: Batch) -> list[Tensor]:
    """Bool[Tensor, "batch seq"] per `ABLATION_GROUPS` entry; a cross-attention model's image group is
    empty (it has no image tokens: all its text is "last" or "text")."""
    return [
        torch.zeros_like(batch.inputs["attention_mask"], dtype=torch.bool)
        if g == "image" and batch.state_cells
        else group_mask(batch, g)
        for g in ABLATION_GROUPS
    ]


@torch.no_grad()
def group_means(vlm: VLM, samples: Sequence, batch_size: int = 32) -> Float[Tensor, "layer group n_heads*d_head"]:
    """Mean z per token group (`ABLATION_GROUPS`) over a reference set."""
    require_vlm(vlm, "group_means")
    check_samples(samples, "group_means")
    require_count(batch_size, "batch_size")
    arch = vlm.arch
    # One width for every layer: the widest z (layers of fewer or smaller heads fill the first columns).
    width = max(arch.heads(layer) * arch.head_dim(layer) for layer in range(arch.n_layers))
    sums = torch.zeros(arch.n_layers, len(ABLATION_GROUPS), width, dtype=torch.float64)
    counts = torch.zeros(len(ABLATION_GROUPS), dtype=torch.float64)
    for _, batch in vlm.batches(samples, batch_size, teacher_force=True):
        masks = group_masks(batch)
        zs = []
        with vlm.read(batch):
            for layer in range(arch.n_layers):
                zs.append(vlm.module(arch.o_proj(layer)).input.save())
        for layer, z in enumerate(zs):
            for g, m in enumerate(masks):
                sums[layer, g, : z.shape[-1]] += z[m.to(z.device)].double().sum(0).cpu()
        counts += torch.tensor([float(m.sum()) for m in masks], dtype=torch.float64)
    return (sums / counts.clamp(min=1)[None, :, None]).float()


def group_values(batch: Batch, per_group: Float[Tensor, "group d"]) -> tuple[Tensor, Tensor]:
    """(mask of real tokens, Float[Tensor, "batch seq d"] holding each position's group's row of
    ``per_group``, in `ABLATION_GROUPS` order): a site's mean-ablation value."""
    ids = batch.inputs["input_ids"]
    value = torch.zeros(*ids.shape, per_group.shape[-1])
    real = torch.zeros(ids.shape, dtype=torch.bool)
    for g, m in enumerate(group_masks(batch)):
        m = m.cpu()
        value[m] = per_group[g]
        real |= m
    return real, value


def _mean_edit(vlm: VLM, batch: Batch, means: Tensor, layer: int, head: int) -> Edit:
    """Head ``head`` at ``layer`` set to its group mean z at every real token."""
    site = HeadZ(layer, head)
    real, value = group_values(batch, means[layer, :, site.columns(vlm.arch)])
    return Edit(site, real, value)


def joint_ablation(vlm: VLM, samples: Sequence, batch_size: int, make_edits) -> dict[str, tuple]:
    """Per sample, ``correct`` and ``logp`` with the edits ``make_edits(batch)`` applied together, and
    ``base_correct``, ``base_logp`` without them, as xarray data over ``sample``."""
    rows = {"correct": [], "logp": [], "base_correct": [], "base_logp": []}
    for _, batch in vlm.batches(samples, batch_size, teacher_force=True):
        logits = run_edits(vlm, batch, None, [[], make_edits(batch)], keep=answer_window(batch.answer_ids))
        for key, lg in (("base_", logits[0]), ("", logits[1])):
            ok, logp = gold_scores(lg, batch.answer_ids)
            rows[key + "correct"].append(ok.numpy())
            rows[key + "logp"].append(logp.numpy())
    return {k: ("sample", np.concatenate(v)) for k, v in rows.items()}


def gold_scores(logits: Tensor, answers: list[list[int]]) -> tuple[Tensor, Tensor]:
    """(correct, log p(gold)) from one replica's `run_edits` logits: Float[Tensor, "batch vocab"] at the
    read position (single-token answers), or Float[Tensor, "batch keep vocab"] over the answer window."""
    return sequence_scores(logits.unsqueeze(-2) if answer_window(answers) == 1 else logits, answers)


def ablation_scan(
    vlm: VLM,
    tasks: dict[str, Sequence],
    means: (
        dict[str, Float[Tensor, "layer group n_heads*d_head"]] | Float[Tensor, "layer group n_heads*d_head"] | None
    ) = None,
    batch_size: int = 16,
    store=None,
    progress: bool = False,
    shard: Shard | None = None,
) -> xr.Dataset:
    """Ablate each head alone on each task: ``acc_drop`` and ``logp_drop`` over (task, layer, head).

    ``means``: per-task reference means (default: each task's own samples), or one tensor for all.
    ``store``: a directory (or `countlens.sweep_store.SweepStore`) that receives each finished chunk of
    samples, and each task's means, so a killed scan resumes where it stopped. Launched as several
    processes, the chunks are split between them (`countlens.distributed`; rank 0 computes the
    tasks' means first, the other ranks read them from the store).
    """
    require_vlm(vlm, "ablation_scan")
    if not isinstance(tasks, dict) or not tasks:
        raise InputError(f"give tasks={{'name': samples, ...}}, got {type(tasks).__name__}")
    for name, samples in tasks.items():
        check_samples(samples, f"ablation_scan (task {name!r})")
    require_count(batch_size, "batch_size")
    arch = vlm.arch
    sites = [(layer, head) for layer in range(arch.n_layers) for head in range(arch.heads(layer))]
    store = _scan_store(vlm, store, tasks, batch_size, means)
    shard = distributed.resolve(shard, store, "ablation_scan")
    acc_drop = np.full((len(tasks), arch.n_layers, arch.n_heads), np.nan)
    logp_drop = np.full_like(acc_drop, np.nan)
    base_acc = np.zeros(len(tasks))
    chunks = {
        f"{name}_{start:06d}": (name, start)
        for name, samples in tasks.items()
        for start in range(0, len(samples), batch_size)
    }
    mus: dict[str, Tensor] = {}
    if shard.sharded:
        # Every rank needs every task's means: rank 0 computes (and stores) them, the others read them.
        needed = [name for name in tasks if _given_means(means, name) is None]
        if shard.rank == 0:
            mus.update({name: _task_means(vlm, name, tasks[name], means, batch_size, store) for name in needed})
        else:
            distributed.wait_for(store, [_means_key(name) for name in needed], shard)

    def chunk_result(chunk: tuple[str, int]) -> xr.Dataset:
        name, start = chunk
        samples = tasks[name]
        if name not in mus:  # a task's means only once one of its chunks is computed
            mus[name] = _task_means(vlm, name, samples, means, batch_size, store)
        return _scan_chunk(vlm, samples[start : start + batch_size], mus[name], sites)

    done = run_chunks(chunks, chunk_result, store, shard, "mean ablation, chunks" if progress else None)
    parts: dict[str, list[xr.Dataset]] = {name: [] for name in tasks}
    for (name, _), part in zip(chunks.values(), done):
        parts[name].append(part)
    for t, name in enumerate(tasks):
        ds = xr.concat(parts[name], dim="sample")
        base = ds.base_correct.values.astype(bool)
        base_acc[t] = base.mean()
        rows, cols = zip(*sites)  # every layer's own heads; NaN beyond them
        acc_drop[t, rows, cols] = base.mean() - ds.correct.values.mean(1)
        logp_drop[t, rows, cols] = ds.logp_drop.values.mean(1)
    names = list(tasks)
    return xr.Dataset(
        {
            "acc_drop": (("task", "layer", "head"), acc_drop),
            "logp_drop": (("task", "layer", "head"), logp_drop),
            "base_acc": ("task", base_acc),
        },
        coords={
            "task": names,
            "layer": np.arange(arch.n_layers),
            "head": np.arange(arch.n_heads),
            "kind": ("layer", list(arch.kinds)),
        },
        attrs={
            **provenance(
                vlm.name,
                vlm.arch.name,
                dataset={k: len(v) for k, v in tasks.items()},
                samples=[s for v in tasks.values() for s in v],
            ),
            "method": "mean_ablation",
            "groups": ",".join(ABLATION_GROUPS),
        },
    )


def _given_means(means, name: str) -> Tensor | None:
    return means if isinstance(means, Tensor) else (means or {}).get(name)


def _means_key(name: str) -> str:
    return f"means_{name}"


def _task_means(vlm: VLM, name: str, samples: Sequence, means, batch_size: int, store) -> Tensor:
    """The task's reference means: given, stored by an earlier run, or computed (and stored)."""
    mu = _given_means(means, name)
    if mu is not None:
        return mu
    key = _means_key(name)
    if store is not None and key in store.done():
        return torch.from_numpy(store.read(key).values)
    mu = group_means(vlm, samples, batch_size)
    if store is not None:
        store.write(key, xr.DataArray(mu.numpy(), dims=("layer", "group", "unit")))
    return mu


def _scan_chunk(vlm: VLM, chunk: Sequence, mu: Tensor, sites: list[tuple[int, int]]) -> xr.Dataset:
    """One chunk of samples: per site and sample, correct and the drop in log p(gold); the baseline."""
    batch = vlm.prepare_samples(chunk, teacher_force=True)
    gold, keep = batch.answer_ids, answer_window(batch.answer_ids)
    replicas = [_mean_edit(vlm, batch, mu, layer, head) for layer, head in sites]
    base = run_edits(vlm, batch, None, [[]], keep=keep)[0]
    b_ok, b_logp = gold_scores(base, gold)
    # Reduce each replica to (correct, log p(gold)) as it comes: no full-vocabulary logits kept.
    scores = run_edits(
        vlm, batch, None, replicas, keep=keep, reduce=lambda rows: torch.stack(gold_scores(rows, gold)).float()
    )
    ok, logp = scores[:, 0].bool(), scores[:, 1]
    return xr.Dataset(
        {
            "correct": (("site", "sample"), ok.numpy()),
            "logp_drop": (("site", "sample"), (b_logp[None] - logp).numpy()),
            "base_correct": ("sample", b_ok.numpy()),
        }
    )


def _scan_store(vlm: VLM, store, tasks: dict[str, Sequence], batch_size: int, means) -> SweepStore | None:
    if store is None:
        return None
    for name in tasks:  # task names become chunk file names: refuse a bad one before any work
        if not re.fullmatch(r"[A-Za-z0-9_-]+", str(name)):
            raise InputError(f"task name {name!r} cannot name a stored chunk; use letters, digits, '_' or '-'")

    def spec() -> dict:
        given = [means] if isinstance(means, Tensor) else [means[k] for k in sorted(means or {})]
        h = hashlib.sha256()
        for m in given:  # the means' values, not only whether there were any
            h.update(m.detach().double().cpu().numpy().tobytes())
        # "tasks" names each task and its size, in order, so one digest over all samples places them.
        return {
            "sweep": "ablation_scan",
            "model": vlm.name,
            "tasks": {k: len(v) for k, v in tasks.items()},
            "batch_size": batch_size,
            "samples_digest": samples_digest(s for v in tasks.values() for s in v),
            "means_digest": h.hexdigest()[:16],
            "given_means": sorted(means) if isinstance(means, dict) else means is not None,
        }

    return open_store(store, spec)


def ablate(
    vlm: VLM,
    samples: Sequence,
    heads: Sequence[tuple[int, int] | str],
    means: Float[Tensor, "layer group n_heads*d_head"] | None = None,
    batch_size: int = 16,
) -> xr.Dataset:
    """Ablate ``heads`` jointly (each (layer, head) or a label such as "L3H2"): per sample
    ``correct`` and ``logp`` before and after."""
    require_vlm(vlm, "ablate")
    check_samples(samples, "ablate")
    heads = checked_heads(vlm.arch, heads)
    require_count(batch_size, "batch_size")
    means = group_means(vlm, samples, batch_size) if means is None else means

    data = joint_ablation(
        vlm, samples, batch_size, lambda batch: [_mean_edit(vlm, batch, means, layer, head) for layer, head in heads]
    )
    return xr.Dataset(
        data,
        coords={"sample": np.arange(len(samples))},
        attrs={
            **provenance(vlm.name, vlm.arch.name, dataset={"samples": len(samples)}, samples=samples),
            "heads": ",".join(map(head_label, heads)),
            "method": "ablate",
        },
    )


def top_heads(scan: xr.Dataset, k: int = 10, by: str = "logp_drop") -> dict[str, list[tuple[int, int]]]:
    """Per task, the ``k`` heads whose ablation hurts most by ``by`` (all the heads where ``k`` is more)."""
    require_count(k, "k")
    require_dataset(scan, "scan (an ablation_scan result)", (by,) if isinstance(by, str) else ("?",))
    out = {}
    for task in scan.task.values:
        out[str(task)] = [(layer, head) for layer, head, _ in top_sites(scan[by].sel(task=task), k)]
    return out


def jaccard(scan: xr.Dataset, k: int = 10, by: str = "logp_drop") -> xr.DataArray:
    """Jaccard overlap of tasks' top-k critical heads: (task, task).

    ``k`` larger than the model's heads is clipped to them, with a warning: every task's "top k" is
    then every head and every overlap 1, which says nothing about the tasks. ``attrs["k"]`` is the
    k used, ``attrs["k_requested"]`` the one asked for."""
    requested = require_count(k, "k")
    require_dataset(scan, "scan (an ablation_scan result)", (by,) if isinstance(by, str) else ("?",))
    heads = int(scan[by].isel(task=0).notnull().sum()) if scan.sizes.get("task") else 0
    if not heads:
        raise InputError(f"jaccard: the scan has no task with a head whose {by} is a number; scan some tasks first")
    k = min(requested, heads)
    if k < requested:
        warnings.warn(
            f"jaccard: k={requested} is more than the model's {heads} heads; compared each task's top {k} "
            "(all its heads, so every overlap is 1): give k below the number of heads",
            stacklevel=2,
        )
    tops = {t: set(v) for t, v in top_heads(scan, k, by).items()}
    names = list(tops)
    mat = np.array([[len(tops[a] & tops[b]) / len(tops[a] | tops[b]) for b in names] for a in names])
    return xr.DataArray(
        mat,
        dims=("task", "task_other"),
        coords={"task": names, "task_other": names},
        name="jaccard",
        attrs={"k": k, "k_requested": requested, "by": by},
    )
