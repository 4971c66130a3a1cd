"""The MAS paper's detection probes, as its code trains them, on its three taps (an optional stage:
``DiscoverConfig(probes=True)``). Trained on VOC2007's trainval list where a local copy is given
(``voc``), else on COUNTINGTRICKS scenes with the shapes as classes; scored as AP@50 per tap. The
report shows them in the attention section.
"""

from __future__ import annotations

import xarray as xr

from countlens.analysis.probes import ProbeConfig, probe_taps
from countlens.pipeline.stages.base import RunContext, Stage
from countlens.reference.counting_to_four.probe import reference_taps


def _probes(run: RunContext) -> xr.Dataset:
    train, test = run.inputs["probes"]()
    config = ProbeConfig(seed=run.config.seed)
    return probe_taps(
        run.vlm, train, test, reference_taps(run.vlm), config, batch_size=run.batch_size, recipe="counting-to-four"
    )


PROBES = Stage(
    "probes",
    inputs=("probes",),
    compute=_probes,
    enabled=lambda config: config.probes,
    optional=True,
)


def summary(ds: xr.Dataset | None) -> str | None:
    """AP@50 per tap of a ``probes`` result, for the report (None: the run has no probes)."""
    if ds is None:
        return None
    return ", ".join(f"{t} {float(v):.3f}" for t, v in zip(ds.tap.values, ds.ap50.values))
