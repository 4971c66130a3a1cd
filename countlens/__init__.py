"""countlens: mechanistic interpretability of vision-language models, with counting as the probe.

    import countlens as cl
    vlm = cl.load("toy")            # the shipped organism; or a local HF checkpoint directory
    batch = vlm.prepare(images, questions, answers)

Importing countlens loads no model and touches no network.
"""

from countlens import analysis, circuits, datasets, results, training
from countlens.errors import CountlensError
from countlens.geometry import Geometry
from countlens.loading import load
from countlens.vlm import VLM, Batch

__version__ = "0.1.0"
__all__ = ["VLM", "Batch", "CountlensError", "Geometry", "analysis", "circuits", "datasets", "load", "results", "training"]
