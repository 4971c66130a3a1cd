"""Features: sparse, interpretable stand-ins for a model's MLPs (per-layer transcoders).

- `countlens.features.transcoder` — `Transcoder` (encode, TopK / JumpReLU / ReLU, decode) and
  `TranscoderSet` (one per layer).
- `countlens.features.files` — `save_transcoders` / `load_transcoders` in circuit-tracer's format.
- `countlens.features.activations` — the data mix, `collect_activations`, `fvu`, `fidelity`.
- `countlens.features.train` — `train_transcoders` (resumable, deterministic by seed).
- `countlens.features.replacement` — `replacement` (the replacement model as hooks) and
  `replacement_accuracy`.

``docs/concepts/transcoders.md`` defines every term and gives the organism's measured figures.
"""

from countlens.features.activations import DEFAULT_MIX, Activations, collect_activations, fidelity, fvu
from countlens.features.files import load_transcoders, save_transcoders
from countlens.features.replacement import replacement, replacement_accuracy
from countlens.features.train import Training, train_transcoders
from countlens.features.transcoder import ACTIVATIONS, Transcoder, TranscoderSet

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_MIX",
    "Activations",
    "Training",
    "Transcoder",
    "TranscoderSet",
    "collect_activations",
    "fidelity",
    "fvu",
    "load_transcoders",
    "replacement",
    "replacement_accuracy",
    "save_transcoders",
    "train_transcoders",
]
