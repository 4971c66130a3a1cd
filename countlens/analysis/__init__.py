"""Measurements on a VLM: counting evaluation (more to come: attention diagnostics, probes, head tables)."""

from countlens.analysis.evaluate import accuracy, score

__all__ = ["accuracy", "score"]
