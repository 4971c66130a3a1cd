"""The intervention layer: sites are the only door to the model, and one engine opens it.

Read it in this order, each room importing only the rooms before it:

- `countlens.circuits.sites`: where you can look — every site kind (a head's z, q / k / v, the residual,
  the MLP, experts, image states, patterns) with one interface: its location (from the family spec), width,
  label and the backends that serve it; positions (groups, cells, objects) say where in the sequence.
- `countlens.circuits.engine`: how you look — the one hook backend, `record` (values and gradients into
  one `Cache`), `frozen` (norms and attention held), the interventions (`Patch` … `Replace`, `Block`),
  `effect` over pairs and `intervene` under any measurement, the stacked edits and the sweeps' runner.
- `countlens.circuits.lenses`: the logit lens, HeadLens, taps.
- `countlens.circuits.graph`: nodes and edges, attribution on them (EAP-IG on nodes, EAP / EAP-IG on
  edges), the edge-ablated forward, faithfulness of a circuit and recovery of a planted one.
- `countlens.circuits.objects`: which objects were counted.
- `countlens.circuits.methods`: one module per method (patching, AtP, AtP*, RelP, ablation, experts) and
  the registry on top, the single source of method facts.

Every function takes a `countlens.VLM` and prepared data (pairs or samples) and returns labelled
xarray results; module paths come from the family spec (`countlens.model`) only.
"""

from countlens.circuits.engine import metrics
from countlens.circuits.engine.attention import eager_attention, image_attention_share, last_token_attention
from countlens.circuits.engine.interventions import (
    Add,
    Apply,
    Block,
    Intervention,
    Mean,
    Patch,
    Replace,
    Resample,
    Scale,
    Zero,
)
from countlens.circuits.engine.metrics import Metric
from countlens.circuits.engine.pair_batch import prepare_pairs, tolerate_noise
from countlens.circuits.engine.record import mean_activation, record
from countlens.circuits.engine.run import effect, intervene, mean_difference
from countlens.circuits.engine.site_gradients import gradients
from countlens.circuits.engine.temperature import beta_from_importance, head_temperature
from countlens.circuits.graph.edge_attribution import edge_attribution, edge_attributions
from countlens.circuits.graph.edges import checked_graph, edge_graph
from countlens.circuits.graph.faithfulness import faithfulness, faithfulness_curves
from countlens.circuits.graph.integrated import node_attribution
from countlens.circuits.graph.paths import ablate_edges, keep_edges, path_patch
from countlens.circuits.lenses.headlens import HeadLens
from countlens.circuits.lenses.lens import logit_lens
from countlens.circuits.lenses.taps import tap
from countlens.circuits.methods.ablation import ablate, ablation_scan, group_means, jaccard, top_heads
from countlens.circuits.methods.experts import (
    ablate_experts,
    expert_ablation_scan,
    expert_means,
    expert_usage,
    patch_experts,
    routing,
)
from countlens.circuits.methods.patching import attribution_patch, compare, patch_heads, patch_layers
from countlens.circuits.objects.edges import object_edge_attribution
from countlens.circuits.objects.effects import object_effects
from countlens.circuits.objects.gradients import object_attribution
from countlens.circuits.sites import Expert, HeadZ, ImageStates, K, MlpIn, MlpOut, Q, Residual, V
from countlens.circuits.sites.positions import Cells, Group, Mask, Objects

__all__ = [
    "ablate_edges",
    "keep_edges",
    "path_patch",
    "metrics",
    "Add",
    "Apply",
    "Block",
    "Cells",
    "Expert",
    "Group",
    "HeadLens",
    "HeadZ",
    "ImageStates",
    "Intervention",
    "K",
    "Mask",
    "Mean",
    "Metric",
    "MlpIn",
    "MlpOut",
    "Objects",
    "Patch",
    "Q",
    "Replace",
    "Resample",
    "Residual",
    "Scale",
    "V",
    "Zero",
    "ablate",
    "ablate_experts",
    "ablation_scan",
    "attribution_patch",
    "beta_from_importance",
    "compare",
    "eager_attention",
    "edge_attribution",
    "edge_attributions",
    "checked_graph",
    "edge_graph",
    "effect",
    "expert_ablation_scan",
    "expert_means",
    "expert_usage",
    "faithfulness",
    "faithfulness_curves",
    "gradients",
    "group_means",
    "head_temperature",
    "image_attention_share",
    "intervene",
    "jaccard",
    "last_token_attention",
    "logit_lens",
    "object_effects",
    "mean_activation",
    "mean_difference",
    "node_attribution",
    "object_attribution",
    "object_edge_attribution",
    "patch_experts",
    "patch_heads",
    "patch_layers",
    "prepare_pairs",
    "record",
    "routing",
    "tap",
    "tolerate_noise",
    "top_heads",
]
