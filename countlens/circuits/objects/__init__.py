"""Which objects were counted: each object of a scene scored by its image tokens.

- `countlens.circuits.objects.effects`: the exact effect (its tokens patched from the scene without it).
- `countlens.circuits.objects.gradients`: AtP and EAP-IG per object against the scene's background.
- `countlens.circuits.objects.edges`: EAP and EAP-IG per object on the edge graph.
"""
