"""What fits: free device memory, the bytes one stacked row costs, and rows per forward.

Every batch-expanded sweep (`countlens.circuits.engine.edits.run_edits`) sizes its stacked forwards here
instead of from a constant, and the planner of discover's stages (`countlens.pipeline.plan`) builds
its estimates on the same `Widths`. A decoder forward of R rows × S tokens holds about
R·S·(3·d_ff + 4·d_model) activations at once (the MLP's three d_ff-wide tensors beside the residual
stream); a stacked row also carries its logits and its stacked inputs (`replica_copy_bytes`).
These are countlens's own estimates; ``bench/plan_rehearsal.py`` measures them against peak memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from countlens.errors import InputError
from countlens.model.vlm import VLM

#: Rows per batch-expanded forward (replicas × samples) at most; fewer where the device's free
#: memory holds fewer (`rows_per_forward`).
MAX_ROWS = 256

#: Share of the free memory a sweep's stacked forward may take (the rest: the allocator's slack).
FREE_SHARE = 0.7


@dataclass(frozen=True)
class Widths:
    """What a plan needs of a model, read off its modules."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    d_ff: int  # widest Linear output in a decoder layer
    vocab: int
    layer_linear: int  # Linear weights in all decoder layers
    vision_width: int
    vision_ff: int
    vision_blocks: int
    vision_linear: int  # Linear weights in all vision blocks
    projector_linear: int
    patch_embed: int  # patch-embedding weights (applied once per patch)
    merge: int
    weight_bytes: int  # every parameter and buffer
    act_bytes: int  # bytes per activation element (the model's dtype)

    @property
    def lm_head(self) -> int:
        return self.vocab * self.d_model


def widths_of(widths_or_vlm, what: str) -> Widths:
    """A `Widths` as given, or a `countlens.VLM`'s (loaded or meta); anything else refused, naming
    ``what`` took it."""
    if isinstance(widths_or_vlm, Widths):
        return widths_or_vlm
    if isinstance(widths_or_vlm, VLM):
        return widths(widths_or_vlm)
    raise InputError(
        f"{what} takes a Widths (countlens.model.memory.widths(vlm)) or a countlens.VLM (countlens.load, or "
        "countlens.model.loading.meta_vlm for a checkpoint's config without weights); got "
        f"{type(widths_or_vlm).__name__}"
    )


def widths(vlm: VLM) -> Widths:
    """The `Widths` of a `countlens.VLM` (a model on any device, the meta device included)."""
    hf, arch, spec = vlm.hf, vlm.arch, vlm.arch.spec
    linears = lambda m: [x for x in m.modules() if isinstance(x, torch.nn.Linear)]  # noqa: E731
    layers = hf.get_submodule(spec.layers)
    blocks = hf.get_submodule(spec.vision_blocks)
    block0 = linears(blocks[0]) if len(blocks) else []
    tower = hf.get_submodule(spec.vision_tower)
    convs = [x for x in tower.modules() if isinstance(x, torch.nn.modules.conv._ConvNd)]
    head = hf.get_submodule(spec.lm_head)
    return Widths(
        n_layers=arch.n_layers,
        n_heads=arch.n_heads,
        n_kv_heads=arch.n_kv_heads,
        d_head=arch.d_head,
        d_model=arch.d_model,
        d_ff=max(x.out_features for x in linears(layers[0])),
        vocab=head.weight.shape[0],
        layer_linear=sum(x.weight.numel() for x in linears(layers)),
        vision_width=block0[0].in_features if block0 else 0,
        vision_ff=max((x.out_features for x in block0), default=0),
        vision_blocks=len(blocks),
        vision_linear=sum(x.weight.numel() for x in linears(blocks)),
        projector_linear=sum(x.weight.numel() for x in linears(hf.get_submodule(spec.projector))),
        patch_embed=sum(x.weight.numel() for x in convs),
        merge=arch.merge_size,
        weight_bytes=sum(t.numel() * t.element_size() for t in [*hf.parameters(), *hf.buffers()]),
        act_bytes=torch.finfo(hf.dtype).bits // 8,
    )


def replica_copy_bytes(w: Widths, seq: int, patches: int = 0) -> int:
    """Bytes of the inputs a batch-expanded forward stacks per row: the input of its first layer
    run, and (the vision tower skipped, its output fed in) the row's pixel values and a copy of the
    tower's output (patch states and merged image tokens)."""
    pixel = w.patch_embed // max(1, w.vision_width)  # one patch's input values
    tokens = patches // (w.merge * w.merge)
    return (seq * w.d_model + patches * (pixel + w.vision_width) + tokens * w.d_model) * w.act_bytes


def logit_bytes(w: Widths, rows: int, keep: int = 1) -> int:
    """Bytes of ``rows`` × ``keep`` positions' logits: in the model's dtype, as float32, and a
    reduction's float32 copy (a bound: with one float32 copy the plan of a stacked forward fell
    short of its measured peak on an H200, 389 vs 390 MiB, bf16 at the 7B widths)."""
    return rows * keep * w.vocab * (w.act_bytes + 8)


def stacked_row_bytes(w: Widths, seq: int, keep: int = 1, patches: int = 0) -> int:
    """Transient bytes one more row adds to a batch-expanded forward: its activations, its logits
    (`logit_bytes`), and its stacked inputs (`replica_copy_bytes`)."""
    b = w.act_bytes
    return seq * (3 * w.d_ff + 4 * w.d_model) * b + logit_bytes(w, 1, keep) + replica_copy_bytes(w, seq, patches)


def free_bytes(device: torch.device | str) -> int:
    """Free memory where a tensor on ``device`` lives: the GPU's (``mem_get_info``), else the
    host's available memory (``/proc/meminfo``)."""
    device = torch.device(device)
    if device.type == "cuda":  # memory torch's allocator holds but does not use is free to it
        return int(
            torch.cuda.mem_get_info(device)[0]
            + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device)
        )
    try:
        with open("/proc/meminfo") as f:
            info = {k: v for k, v in (line.split(":", 1) for line in f)}
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # no /proc: the free pages
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def model_free_bytes(vlm: VLM) -> int | None:
    """The least free memory over the devices that hold ``vlm``'s weights (several GPUs under
    ``device_map="auto"``); None for a remote (NDIF) model, whose memory is not this machine's."""
    if vlm.remote:
        return None
    devices = {p.device for p in vlm.hf.parameters()}
    if any(d.type == "meta" for d in devices):
        return None
    return min(free_bytes(d) for d in devices)


def rows_per_forward(
    w: Widths, seq: int, free: int, keep: int = 1, patches: int = 0, cap: int | None = None, extra: int = 0
) -> int:
    """The most rows a batch-expanded forward of ``seq`` tokens (``patches`` vision patches a row)
    may stack: FREE_SHARE of ``free`` bytes over what a row costs (`stacked_row_bytes`, plus ``extra``
    bytes a row the caller holds), at least 1 and at most ``cap`` (`MAX_ROWS`)."""
    per_row = stacked_row_bytes(w, seq, keep, patches) + extra
    return max(1, min(cap or MAX_ROWS, int(FREE_SHARE * free) // max(1, per_row)))


def resident_bytes() -> int:
    """This process's resident set now (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
