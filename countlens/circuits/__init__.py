"""The intervention layer over nnsight: sites, positions and interventions (your own experiment:
`effect` over pairs, `intervene` under any measurement), patching, attribution (AtP, EAP-IG on nodes and edges),
faithfulness of a circuit, lenses, HeadLens, ablation, head temperature, and the experts of mixture-of-experts models.

Every function takes a `countlens.VLM` and prepared data (pairs or samples) and returns labelled
xarray results; module paths come from `countlens.model.arch` only.
"""

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
from countlens.circuits.engine.record import mean_activation, record
from countlens.circuits.engine.run import effect, intervene, mean_difference
from countlens.circuits.engine.temperature import beta_from_importance, head_temperature
from countlens.circuits.graph.edge_attribution import edge_attribution, edge_attributions
from countlens.circuits.graph.edges import checked_graph, edge_graph
from countlens.circuits.graph.faithfulness import faithfulness, faithfulness_curves
from countlens.circuits.graph.integrated import node_attribution
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
    "record",
    "routing",
    "tap",
    "top_heads",
]
