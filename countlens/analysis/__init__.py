"""Measurements on a VLM: counting evaluation (scoring, generation, parsing, the papers' metrics),
case tables, attention diagnostics (MAS, VRA, Attention-IoU, ARS), detection probes on taps,
last-token representations, head classification and plots (`countlens.analysis.plots`), and finished
runs compared side by side on relative depth (`compare_runs`)."""

from countlens.analysis.attention_metrics import attention_metrics
from countlens.analysis.compare import compare_runs
from countlens.analysis.evaluate import generate, score
from countlens.analysis.heads import HeadThresholds, classify_heads, export_heads
from countlens.analysis.metrics import accuracy, digit_in_conflict, number_avoidance, summary
from countlens.analysis.object_misses import object_misses
from countlens.analysis.parse import parse_count, parse_shape_count
from countlens.analysis.probes import probe_taps
from countlens.analysis.representations import representation_view
from countlens.analysis.tables import case_table

__all__ = [
    "HeadThresholds",
    "accuracy",
    "attention_metrics",
    "case_table",
    "classify_heads",
    "compare_runs",
    "digit_in_conflict",
    "export_heads",
    "generate",
    "number_avoidance",
    "object_misses",
    "parse_count",
    "parse_shape_count",
    "probe_taps",
    "representation_view",
    "score",
    "summary",
]
