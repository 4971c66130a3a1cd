"""A memory and time plan for `countlens discover`: per stage, its forwards, peak memory and FLOPs.

Nothing runs on the model: the plan reads the model's modules (a loaded model, or one built on the
meta device from a checkpoint's config), and each stage of the registry (`countlens.pipeline.stages`)
counts its forwards from one prepared batch of its own samples. How a forward's FLOPs and memory are
counted (the cost model, and the `Planner` the stages use): `countlens.pipeline.costs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from countlens.errors import ConfigError
from countlens.model.memory import Widths, free_bytes, resident_bytes, widths
from countlens.pipeline.config import DiscoverConfig
from countlens.pipeline.costs import Planner, StagePlan, forward_bytes, forward_flops
from countlens.pipeline.discover import check_preset
from countlens.pipeline.stages import STAGES
from countlens.validate import require_integer

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


@dataclass
class Plan:
    """Per-stage plans for one model, configuration and memory budget (`plan`)."""

    model: str
    widths: Widths
    image_size: int
    patches: int  # vision patches per image
    base: int  # the runtime's own memory (CPU: the resident set less the weights)
    free: int  # memory the sweeps' rows were sized from
    device: str
    stages: list[StagePlan]
    memory: int  # the device's memory in all

    def over(self) -> list[str]:
        """Stages whose planned peak exceeds the device's memory, or that not even one row a chunk fits
        (`countlens.pipeline.costs.Planner.chunk`)."""
        return [s.name for s in self.stages if self.peak(s) > self.memory or not s.fits]

    def knobs(self) -> dict[str, str]:
        """For each stage `over` names, what makes it fit (a stage whose rows a chunk are already chosen
        down to one: a device with more memory, a smaller dtype or smaller images)."""
        by = {s.name: s for s in self.stages}
        return {name: by[name].knob for name in self.over()}

    def require_fit(self) -> None:
        """Refuse (`ConfigError`) a plan with a stage `over` the memory, naming each such stage and
        what makes it fit: `countlens plan` after its table, `countlens discover` on a GPU before
        the first forward."""
        over = self.knobs()
        if over:
            stages = "; ".join(f"{name}: {knob}" for name, knob in over.items())
            raise ConfigError(f"over {self.memory / (1 << 30):.1f} GiB: {stages}")

    def peak(self, s: StagePlan) -> int:
        """Peak bytes of stage ``s`` on the model's device (on the CPU, host memory included)."""
        transient = max(forward_bytes(self.widths, f, self.patches) for f in s.forwards)
        host = s.host if self.device == "cpu" else 0
        return self.widths.weight_bytes + self.base + s.kept + host + transient

    def flops(self, s: StagePlan) -> float:
        return sum(f.count * forward_flops(self.widths, f, self.patches) for f in s.forwards)

    def table(self):
        """A pandas DataFrame, one row per stage."""
        import pandas as pd

        gib = 1 << 30
        rows = [
            {
                "stage": s.name,
                "forwards": sum(f.count for f in s.forwards),
                "rows": max(f.rows for f in s.forwards),
                "tokens": max(f.seq for f in s.forwards),
                "batch": s.batch,
                "kept_gib": round(s.kept / gib, 3),
                "host_gib": round(s.host / gib, 3),
                "peak_gib": round(self.peak(s) / gib, 2),
                "tflop": round(self.flops(s) / 1e12, 3),
            }
            for s in self.stages
        ]
        return pd.DataFrame(rows).set_index("stage")

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {
            "model": self.model,
            "device": self.device,
            "memory_bytes": self.memory,
            "image_size": self.image_size,
            "patches": self.patches,
            "weights_bytes": self.widths.weight_bytes,
            "base_bytes": self.base,
            "free_bytes": self.free,
            "widths": asdict(self.widths),
            "stages": {
                s.name: {
                    "peak_bytes": self.peak(s),
                    "flops": self.flops(s),
                    "kept_bytes": s.kept,
                    "host_bytes": s.host,
                    "rows": max(f.rows for f in s.forwards),
                    "batch": s.batch,
                    "fits": s.fits,
                    "forwards": sum(f.count for f in s.forwards),
                    "notes": s.notes,
                }
                for s in self.stages
            },
        }


def plan(vlm: VLM, config=None, memory: int | None = None, device: str | None = None, base: int | None = None) -> Plan:
    """The `Plan` of `countlens discover` on ``vlm`` with ``config`` (a `DiscoverConfig`).

    ``vlm`` may be loaded (the plan of running here, now) or built on the meta device (`meta_vlm`:
    the plan for a device that has ``memory`` bytes in all). ``memory``: the device's total memory
    (default: a loaded model's free memory now plus its weights; for a meta model, this host's
    available memory). ``device``: "cpu" or "cuda", where a meta model would run (default "cpu").
    ``base``: the runtime's own bytes (default: on the CPU this process's resident set less the
    loaded weights; on a GPU 0, the CUDA context being outside the allocator's count).
    """
    return plans(vlm, config, [memory], device, base)[0]


def plans(
    vlm: VLM, config=None, memories: Sequence[int | None] = (None,), device: str | None = None, base: int | None = None
) -> list[Plan]:
    """`plan` for each of several devices' ``memories`` (bytes in all; None: `plan`'s default), in
    order. The stages' samples are made and their batches prepared once for all of them: only the
    rows a sweep stacks depend on the memory."""
    if isinstance(memories, (str, bytes)) or not isinstance(memories, Sequence) or not memories:
        raise ConfigError(f"memories: a list of device sizes in bytes (None: this device's), got {memories!r:.60}")
    for memory in memories:
        if memory is not None:
            require_integer(memory, "memory (bytes)", ConfigError, low=1)
    c = config or DiscoverConfig()
    check_preset(c)
    w = widths(vlm)
    loaded = vlm.device.type != "meta"
    where = device or ("cpu" if vlm.device.type in ("cpu", "meta") else vlm.device.type)
    if where not in ("cpu", "cuda"):
        raise ConfigError(f"device {where!r}: plan for 'cpu' or 'cuda'")
    if base is None:
        base = max(0, resident_bytes() - (w.weight_bytes if loaded else 0)) if where == "cpu" else 0
    sized = []
    for memory in memories:
        if memory is None:
            held = w.weight_bytes + base if loaded else 0
            memory = free_bytes(vlm.device if loaded else "cpu") + held
        free = memory - w.weight_bytes - base
        if free <= 0:
            raise ConfigError(
                f"{vlm.name}'s weights ({w.weight_bytes / 2**30:.1f} GiB) and the runtime "
                f"({base / 2**30:.1f} GiB) do not fit {memory / 2**30:.1f} GiB; give a device with more "
                "memory, a smaller dtype, or several devices (device_map='auto')"
            )
        sized.append((memory, free))
    out, p = [], Planner(vlm, c, sized[0][1], sized[0][0])
    for memory, free in sized:
        p.free, p.memory = free, memory  # the one input that differs between the memories (and its total)
        stages = [stage.plan(p) for stage in STAGES if stage.plan is not None and stage.enabled(c)]
        out.append(Plan(vlm.name, w, vlm.geometry.image_height, p.patches, base, free, where, stages, memory))
    return out
