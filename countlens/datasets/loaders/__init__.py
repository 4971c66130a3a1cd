"""Loaders for local copies of real counting benchmarks (FSC-147, PixMo-Count, CountBench, TallyQA).

Each loader reads annotation files from disk (nothing is downloaded), validates every record when
it is called, and returns a list of `CountSample`, whose image is opened only when it is read.
"""

from countlens.datasets.loaders.common import CountSample, LoaderError
from countlens.datasets.loaders.countbench import load_countbench
from countlens.datasets.loaders.fsc147 import load_fsc147
from countlens.datasets.loaders.pixmo import load_pixmo_count
from countlens.datasets.loaders.tallyqa import load_tallyqa

__all__ = ["CountSample", "LoaderError", "load_countbench", "load_fsc147", "load_pixmo_count", "load_tallyqa"]
