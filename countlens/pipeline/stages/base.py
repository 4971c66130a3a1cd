"""What a discover stage is: one object that says what it reads, computes, costs and reports.

A `Stage` names its inputs (`countlens.pipeline.inputs`), computes one xarray result from a
`RunContext` (stored as ``results/<name>.nc``, so a resumed run loads it instead), plans its forwards
for `countlens plan` (`countlens.pipeline.costs`), and may check its result, loaded or computed,
before later stages read it. A `Section` is one numbered section of ``report.md``: the values its
template (``templates/sections/<template>``) shows and the figures it draws, from stored results only.
Several stages can feed one section (the heads section reads ``heads`` and ``atp``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from countlens.analysis.evaluate import generate, score
from countlens.pipeline.costs import score_rows

if TYPE_CHECKING:
    import pandas as pd
    import xarray as xr

    from countlens.distributed import Shard
    from countlens.model.vlm import VLM
    from countlens.pipeline.config import DiscoverConfig
    from countlens.pipeline.costs import Planner, StagePlan


@dataclass
class RunContext:
    """One discover run as its stages see it: the model, the configuration, the stages' inputs (made
    on demand; the pairs and the task samples made once, before the first stage), where the sweeps
    stream their chunks, this process's shard, and the results of the stages run so far."""

    vlm: VLM
    config: DiscoverConfig
    prompt: str
    inputs: dict[str, Callable]
    out: Path
    shard: Shard
    log: Callable[[str], None]
    pairs: list = field(default_factory=list)
    data: dict = field(default_factory=dict)
    results: dict[str, xr.Dataset] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    def store(self, name: str) -> Path:
        """Where the sweep ``name`` streams its chunks (`countlens.circuits.engine.sweep`)."""
        return self.out / "results" / "sweeps" / name

    def answers(self, samples: list, progress: bool = False, stage: str = "cases") -> xr.Dataset:
        """The model's answers on ``samples`` as the run's ``evaluate`` reads them: candidates scored (in
        chunks of as many samples as fit: `countlens.pipeline.costs.score_rows`, the plan's rule), or
        greedy generations parsed (`countlens.analysis.evaluate`). ``stage``: whose samples, for a refusal."""
        c = self.config
        if c.evaluate == "generate":
            return generate(
                self.vlm,
                samples,
                max_new_tokens=c.max_new_tokens,
                batch_size=c.batch_size,
                progress=progress,
                parser=c.parser,
            )
        rows = score_rows(self.vlm, stage, samples, c.batch_size)
        return score(self.vlm, samples, batch_size=rows, progress=progress)


@dataclass(frozen=True)
class Stage:
    """A resumable step of `countlens discover` (see the module docstring). ``sweep``: one of the long
    sweeps every rank of a sharded run takes its share of first. ``enabled``: whether a configuration
    runs it (an optional stage, e.g. the probes, is left out of runs that do not ask for it)."""

    name: str
    inputs: tuple[str, ...]
    compute: Callable[[RunContext], xr.Dataset]
    plan: Callable[[Planner], StagePlan] | None = None
    check: Callable[[RunContext, xr.Dataset], None] | None = None
    sweep: bool = False
    enabled: Callable[[DiscoverConfig], bool] = lambda config: True
    optional: bool = False  # a finished run may lack its result (`load_run` does not require it)
    # What its stored result must hold, {variable: dims}: a stored result is checked on read against it
    # (`countlens.pipeline.rundir.check_stored`); a result with an ``refused`` attr (the stage found
    # nothing to measure on this model) holds none.
    variables: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class ReportContext:
    """What a report section reads: the run's spec, its stored results by stage, the head table, and
    where the figures go."""

    model: str
    arch: str
    out: Path
    spec: dict
    results: dict[str, xr.Dataset]
    table: pd.DataFrame

    @property
    def figures(self) -> Path:
        return self.out / "figures"


@dataclass(frozen=True)
class Section:
    """One numbered section of ``report.md``: ``values`` computes what its template shows (every
    check that can refuse a run directory belongs here, so nothing is drawn before all have passed);
    ``draw`` writes its figures. ``stages``: the results it shows that divide by a patching normaliser;
    one whose normaliser is below the noise rule is marked under the section's heading
    (`countlens.pipeline.report_notes`)."""

    template: str
    values: Callable[[ReportContext], dict[str, Any]]
    draw: Callable[[ReportContext], None] = lambda ctx: None
    stages: tuple[str, ...] = ()
