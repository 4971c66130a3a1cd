"""countlens: mechanistic interpretability of vision-language models, with counting as the probe.

    import countlens as cl
    vlm = cl.load("toy")            # the shipped organism; or a local HF checkpoint directory
    batch = vlm.prepare(images, questions, answers)

Importing countlens loads no model, touches no network, and imports neither torch nor transformers:
the subpackages and `load` / `VLM` are imported on first use, so data generation (`cl.datasets`)
and the command line's ``--help`` stay light.
"""

from __future__ import annotations

import importlib

from countlens.errors import CountlensError
from countlens.model.geometry import Geometry

__version__ = "0.1.0"

#: Names imported on first use: attribute → the module that defines it (or the subpackage itself).
_LAZY: dict[str, str] = {
    "analysis": "countlens.analysis",
    "circuits": "countlens.circuits",
    "datasets": "countlens.datasets",
    "results": "countlens.results",
    "training": "countlens.training",
    "toy": "countlens.toy",
    "load": "countlens.model.loading",
    "check": "countlens.pipeline.selfcheck",
    "VLM": "countlens.model.vlm",
    "Batch": "countlens.model.vlm",
}
__all__ = [
    "VLM",
    "Batch",
    "CountlensError",
    "Geometry",
    "analysis",
    "check",
    "circuits",
    "datasets",
    "load",
    "results",
    "toy",
    "training",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'countlens' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if module.__name__ == f"countlens.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
