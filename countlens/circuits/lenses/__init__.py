"""Lenses: reading what a site encodes, without changing the forward.

- `countlens.circuits.lenses.lens`: the logit lens (a layer's residual read through the final norm and
  the unembedding).
- `countlens.circuits.lenses.headlens`: HeadLens (a head's contribution mapped to the vocabulary).
- `countlens.circuits.lenses.taps`: taps (a site's value at each image cell, for probes and maps).
"""
