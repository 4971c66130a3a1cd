"""Loaders for local copies of real benchmarks: counting (FSC-147, PixMo-Count, CountBench, TallyQA,
the MAS paper's released COUNTINGTRICKS), reasoning (CLEVR, MathVista), general reasoning (MMMU,
RealWorldQA, MathVista) and detection (VOC2007, the MAS paper's probing data).

Each loader reads annotation files from disk (nothing is downloaded), validates every record when
it is called, and returns a list of `CountSample` (counting), `QuestionSample` (reasoning) or
`DetectionSample` (detection), whose image is opened only when it is read.
"""

from countlens.datasets.loaders.clevr import load_clevr
from countlens.datasets.loaders.common import CountSample, LoaderError, QuestionSample
from countlens.datasets.loaders.countbench import load_countbench
from countlens.datasets.loaders.countingtricks_release import load_countingtricks_release
from countlens.datasets.loaders.fsc147 import load_fsc147
from countlens.datasets.loaders.mathvista import load_mathvista
from countlens.datasets.loaders.mmmu import load_mmmu
from countlens.datasets.loaders.pixmo import load_pixmo_count
from countlens.datasets.loaders.realworldqa import load_realworldqa
from countlens.datasets.loaders.tallyqa import load_tallyqa
from countlens.datasets.loaders.voc import DetectionSample, load_voc2007

__all__ = [
    "CountSample",
    "DetectionSample",
    "LoaderError",
    "QuestionSample",
    "load_clevr",
    "load_countbench",
    "load_countingtricks_release",
    "load_fsc147",
    "load_mathvista",
    "load_mmmu",
    "load_pixmo_count",
    "load_realworldqa",
    "load_tallyqa",
    "load_voc2007",
]
