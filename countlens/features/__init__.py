"""Features: sparse, interpretable stand-ins for a model's MLPs (per-layer transcoders).

- `countlens.features.transcoder` — `Transcoder` (encode, TopK / JumpReLU / ReLU, decode) and
  `TranscoderSet` (one per layer).
- `countlens.features.files` — `save_transcoders` / `load_transcoders` in circuit-tracer's format.
- `countlens.features.activations` — the data mix, `collect_activations`, `fvu`, `fidelity`.
- `countlens.features.activation_store` — `open_store` / `ActivationStore`: a mix's activations on disk,
  in chunks, where they do not fit the memory bound (`train_transcoders` writes and reads it).
- `countlens.features.train` — `train_transcoders` (resumable, deterministic by seed).
- `countlens.features.replacement` — `replacement` (the replacement model as hooks) and
  `replacement_accuracy`.
- `countlens.features.graph` — `attribution_graph` (one prompt's graph on the local replacement
  model, `LocalReplacement`; bounded by ``max_features``), `AttributionGraph`.
- `countlens.features.influence` — circuit-tracer's partial influence, which picks the features a graph keeps.
- `countlens.features.interventions` — `remove_feature`, `clamp_feature`, `steer_feature`: a feature edited
  inside the real model's forward (error term held), as interventions for `countlens.circuits.intervene`.
- `countlens.features.effects` — `feature_effects`: a graph's predicted removal and steering effects
  against the real model's.
- `countlens.features.prune` — `prune`, `node_influence`, `removal_effects`.
- `countlens.features.scores` — `graph_scores`: circuit-tracer's replacement and completeness scores.
- `countlens.features.cards` — `feature_cards` (a feature's top scenes, image maps, objects, effect on
  the count logits) and `draw_card`.
- `countlens.features.graph_page` — `graph_page(graph, path)`: a pruned graph as one self-contained
  HTML page (import it from the module: the name is the module's).
- `countlens.features.graph_files` — `graph_json` / `save_graph` (circuit-tracer's viewer JSON),
  `graph_dataset`.
- `countlens.features.head_paths` — `head_shares` (how much of a graph's logit, and of the image
  tokens' attribution to it, flows through each frozen head), `planted_path_recovery`.

``docs/concepts/transcoders.md`` and ``docs/concepts/attribution_graphs.md`` define every term and
give the organism's measured figures.
"""

from countlens.features.activations import DEFAULT_MIX, Activations, collect_activations, fidelity, fvu
from countlens.features.cards import draw_card, feature_cards
from countlens.features.effects import feature_effects
from countlens.features.files import load_transcoders, save_transcoders
from countlens.features.graph import AttributionGraph, LocalReplacement, attribution_graph
from countlens.features.graph_files import graph_dataset, graph_json, save_graph
from countlens.features.head_paths import head_shares, planted_path_recovery
from countlens.features.interventions import clamp_feature, remove_feature, steer_feature
from countlens.features.prune import node_influence, prune, removal_effects
from countlens.features.replacement import replacement, replacement_accuracy
from countlens.features.scores import graph_scores
from countlens.features.train import Training, train_transcoders
from countlens.features.transcoder import ACTIVATIONS, Transcoder, TranscoderSet

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_MIX",
    "Activations",
    "AttributionGraph",
    "LocalReplacement",
    "Training",
    "Transcoder",
    "TranscoderSet",
    "attribution_graph",
    "clamp_feature",
    "collect_activations",
    "draw_card",
    "feature_cards",
    "feature_effects",
    "fidelity",
    "fvu",
    "graph_dataset",
    "graph_scores",
    "graph_json",
    "load_transcoders",
    "node_influence",
    "prune",
    "remove_feature",
    "removal_effects",
    "replacement",
    "replacement_accuracy",
    "save_graph",
    "save_transcoders",
    "steer_feature",
    "train_transcoders",
    "head_shares",
    "planted_path_recovery",
]
