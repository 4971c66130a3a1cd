"""The circuit as a graph: its nodes (heads, MLPs, inputs, experts) and edges, attribution on them, the
edge-ablated forward, and the measures that say whether a set of them is a circuit.

- `nodes` (the node sites, their recorded values and node ablation), `edges` (the edge graph and its
  receivers), `edge_ablation` (a forward in which chosen edges carry their ablation values; opt-in
  gradients), `integrated` (EAP-IG on nodes) and `edge_attribution` (EAP, EAP-IG on edges);
- `paths` (the exact metric of chosen edges: `path_patch` from senders to receivers, `ablate_edges`,
  `keep_edges`);
- `faithfulness` (MIB's CPR / CMD curves of heads, experts and edges) and `recovery` (rankings scored
  against a planted circuit).
"""
