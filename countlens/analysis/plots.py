"""Every figure of the report by name: ``plot_*`` writes one PNG and returns its path.

The drawing lives in `countlens.analysis.figures`, one module per kind of picture (layer × head grids,
curves along the layers, COUNTINGTRICKS and attention figures); each ``plot_*`` there has a builder
of the same name without the prefix that returns the matplotlib ``Figure`` instead (tests read it).
Layer × head maps write their numbers in the cells only up to 12 × 12 heads
(`countlens.analysis.figures.grids.ANNOTATE_MAX`); every title is wrapped to fit its image.
"""

from __future__ import annotations

from countlens.analysis.figures.counting import (
    plot_accuracy_by_count,
    plot_bars,
    plot_case_grid,
    plot_modality_share,
    plot_probe_ap,
)
from countlens.analysis.figures.curves import (
    plot_faithfulness,
    plot_layers,
    plot_lens,
    plot_rank_emergence,
    plot_scatter,
)
from countlens.analysis.figures.depth import plot_depth_classes, plot_handoff
from countlens.analysis.figures.grids import plot_head_classes, plot_heatmap, plot_matrix
from countlens.analysis.figures.objects import plot_effect_by_offset, plot_object_scenes

__all__ = [
    "plot_accuracy_by_count",
    "plot_bars",
    "plot_case_grid",
    "plot_depth_classes",
    "plot_effect_by_offset",
    "plot_faithfulness",
    "plot_handoff",
    "plot_head_classes",
    "plot_heatmap",
    "plot_layers",
    "plot_lens",
    "plot_matrix",
    "plot_modality_share",
    "plot_object_scenes",
    "plot_probe_ap",
    "plot_rank_emergence",
    "plot_scatter",
]
