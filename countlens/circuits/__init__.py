"""The intervention layer over nnsight (patching, lenses, ablation, head temperature).

Not built yet: see the circuits issue. Module paths come from `countlens.arch` only.
"""
