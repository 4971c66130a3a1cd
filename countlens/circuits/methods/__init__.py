"""The attribution methods, one module each, and `registry` on top: what each scores, where it runs and
what it costs (`countlens.circuits.methods.registry.METHODS`, the single source of method facts).

- `patching` (exact head and layer patching, AtP), `atp_star` (AtP*), `relp` (RelP), `ablation` (mean
  ablation and its overlap across tasks), `experts` (expert patching and ablation);
- EAP-IG on nodes and EAP / EAP-IG on edges live with the graph (`countlens.circuits.graph`), the object
  rankers with the objects (`countlens.circuits.objects`); the registry lists them all.

Adding a method is one module here and one `Method` entry in `registry`.
"""
