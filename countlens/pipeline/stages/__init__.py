"""The registry of `countlens discover`'s stages and of its report's sections, in the order they run
and the order the report reads them.

`countlens.pipeline.discover` runs `STAGES`, `countlens.pipeline.plan` sizes them, `load_run` reads
their results back, and `countlens.pipeline.report` renders `SECTIONS`, numbered in this order.
Adding a stage is one module here (its `Stage`, and its `Section` if the report shows it, with the
section's template in ``templates/sections/``) and its line in each tuple below.
"""

from __future__ import annotations

from countlens.pipeline.stages import (
    ablation,
    attention,
    attention_maps,
    cases,
    classes,
    edges,
    faithfulness,
    lens,
    objects,
    patching,
    probes,
    temperature,
)
from countlens.pipeline.stages.base import ReportContext, RunContext, Section, Stage

STAGES: tuple[Stage, ...] = (
    cases.CASES,
    cases.CONFLICT_STD,
    cases.CONFLICT,
    patching.VAP,
    patching.HEADS,
    patching.ATP,
    patching.EAP_IG,
    lens.LENS,
    attention.HEADLENS,
    attention.ATTENTION,
    attention.ATTENTION_METRICS,
    attention_maps.ATTENTION_MAPS,
    objects.OBJECTS,
    ablation.ABLATION,
    temperature.TEMPERATURE,
    faithfulness.FAITHFULNESS,
    edges.EDGE_FAITHFULNESS,
    probes.PROBES,
)

SECTIONS: tuple[Section, ...] = (
    cases.SECTION,
    patching.VAP_SECTION,
    patching.HEADS_SECTION,
    lens.SECTION,
    attention.SECTION,
    attention_maps.SECTION,
    classes.SECTION,
    ablation.SECTION,
    temperature.SECTION,
    faithfulness.SECTION,
    objects.SECTION,
)

#: The stages every finished run has (`results/<name>.nc`); an optional one (the probes) may be absent.
REQUIRED: tuple[str, ...] = tuple(s.name for s in STAGES if not s.optional)

__all__ = ["REQUIRED", "SECTIONS", "STAGES", "ReportContext", "RunContext", "Section", "Stage"]
