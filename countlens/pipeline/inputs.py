"""Each stage's samples, made on demand and every one a pure function of the run's seed.

A stage names the inputs it reads (`countlens.pipeline.stages.Stage.inputs`);
`countlens.pipeline.discover.check_inputs` builds each of them small before a run writes anything,
and `countlens.pipeline.costs.Planner` sizes the stages from the same lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from countlens.datasets.countingtricks import CASES, countingtricks
from countlens.datasets.loaders import load_clevr, load_mathvista, load_voc2007
from countlens.datasets.pairs import count_pairs
from countlens.datasets.tasks import task_samples
from countlens.pipeline.config import DiscoverConfig, conflict_styles

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


def stage_inputs(vlm: VLM, c: DiscoverConfig, prompt: str) -> dict[str, Callable[[], list]]:
    """Each stage's samples, made on demand (every one a pure function of the seed): ``pairs`` for
    patching, ``tasks`` ({task: samples}) for the lens, attention and ablation, and the samples of
    ``cases``, ``conflict_std`` / ``conflict``, ``headlens_fit``, ``attention_metrics`` and
    ``temperature``."""
    grid = vlm.geometry
    size = grid.image_height
    colors = ("red", "green", "blue")

    def task(name: str, seed_offset: int) -> list:
        """A task's samples: from a local copy where the config names one (math: MathVista, spatial:
        CLEVR; its first n_samples), else procedural."""
        if name == "math" and c.math:
            return load_mathvista(c.math, limit=c.n_samples)
        if name == "spatial" and c.spatial:
            return load_clevr(c.spatial, limit=c.n_samples)
        return task_samples(name, c.n_samples, c.seed + seed_offset, image_size=size)

    def tasks(seed_offset: int = 0, names: tuple[str, ...] = c.tasks) -> dict:
        return {t: task(t, seed_offset) for t in names}

    def probe_data() -> tuple[list, list]:
        """The probes' (train, test): VOC2007's trainval and test lists (first n_samples each) when a
        copy is given, else COUNTINGTRICKS scenes of the run's design (its own seeds)."""
        if c.voc:
            return load_voc2007(c.voc, "trainval", limit=c.n_samples), load_voc2007(c.voc, "test", limit=c.n_samples)
        per_case = max(1, c.n_samples // 16)
        design = {"design": "paper-code"} if c.design == "paper-code" else {"color": colors}
        return (
            countingtricks(None, 2 * per_case, grid, seed=c.seed + 700, prompt=prompt, **design),
            countingtricks(None, per_case, grid, seed=c.seed + 800, prompt=prompt, **design),
        )

    position = [n for n, case in CASES.items() if case.family == "position"]
    base, distractor = conflict_styles(vlm.name)

    def conflict(style: str) -> list:
        return countingtricks(position, max(1, c.n_per_case // 5), grid, seed=c.seed, prompt=style, color=colors)

    return {
        "pairs": lambda: count_pairs(
            c.n_pairs, kind=c.pair_kind, grid=grid, seed=c.seed, prompt=prompt, counts=range(1, 10)
        ),
        "tasks": tasks,
        "cases": lambda: (
            countingtricks(None, c.n_per_case, grid, seed=c.seed, prompt=prompt, design="paper-code")
            if c.design == "paper-code"
            else countingtricks(None, c.n_per_case, grid, seed=c.seed, prompt=prompt, color=colors)
        ),
        "conflict_std": lambda: conflict(base),
        "conflict": lambda: conflict(distractor),
        # HeadLens learns its maps on the organism's three trained tasks, whatever the ablation compares.
        "headlens_fit": lambda: [
            s for samples in tasks(seed_offset=500, names=("count", "color", "shape")).values() for s in samples
        ],
        "attention_metrics": lambda: countingtricks(
            None, max(1, c.n_per_case // 12), grid, seed=c.seed, prompt=prompt, color=colors
        ),
        "temperature": lambda: task_samples("count", 2 * c.n_samples, c.seed + 900, image_size=size),
        "probes": probe_data,
    }
