"""Paper presets: one name sets `countlens discover` to a paper's protocol, as far as countlens has it.

A preset is data: the `DiscoverConfig` fields and `HeadThresholds` fields it changes, and where a
value comes from. ``countlens discover --preset NAME`` (or ``DiscoverConfig(preset=NAME)`` through
`discover_config`) applies it; the run's ``spec.json`` and ``report.md`` name the preset and every
value it set. Values the papers do not give stay countlens's defaults and are listed as such in
[the fidelity table](../docs/fidelity.md).

- ``counting-circuits`` ("Counting Circuits", paper 002): black-dot count pairs (the paper's
  SynDot pairs, e.g. 3 against 5 dots), the Pstd prompt, Jaccard over the top-20 heads per task,
  and head classes by depth bands that class the paper's layer ranges on a 28-layer model as the
  paper does: visual grounding in the first tenth (its layer 1), cross-modal routing at depth
  0.6–0.9 (its layers 18–24, e.g. L19H23), counting aggregation from depth 0.8 (its layers 23–28,
  e.g. L26H26; with layers counted from 1, as "23–28" of 28 layers implies, depth ≥ 0.81; the bands
  hold both readings: routing 17–24 and aggregation 22–27 counted from 0) whose top-1 decoded token
  is the count on at least half the samples (the paper:
  "highly aligns with the final number prediction"), and awareness that includes difficulty words
  (its L23H19: "difficult", "impossible").
- ``counting-to-four`` ("Counting to Four is still a Chore", paper 000): COUNTINGTRICKS at the
  paper's 1,000 samples per case, under Pstd.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from countlens.errors import InputError


@dataclass(frozen=True)
class Preset:
    name: str
    paper: str
    discover: dict = field(default_factory=dict)  # DiscoverConfig fields
    thresholds: dict = field(default_factory=dict)  # HeadThresholds fields
    sources: dict = field(default_factory=dict)  # field → where in the paper its value comes from


PRESETS: dict[str, Preset] = {
    "counting-circuits": Preset(
        "counting-circuits", "Counting Circuits (paper 002)",
        discover={"pair_kind": "dots", "prompt": "std", "jaccard_k": 20},
        thresholds={"early": 0.1, "routing_from": 0.6, "routing_to": 0.9, "late": 0.8, "align_min": 0.5,
                    "difficulty_min": 0.1},
        sources={"pair_kind": "Key design 1: pairs of black-dot images differing only in count",
                 "prompt": "the Pstd prompt of the evaluation",
                 "jaccard_k": "Key findings: top-20 critical heads per task, Jaccard between tasks",
                 "early": "Key design 2: visual-grounding heads concentrated in layer 1",
                 "routing_from": "Key design 2: routing heads in layers 18-24 (depth 0.63-0.89 of 28 layers)",
                 "routing_to": "Key design 2: routing heads in layers 18-24",
                 "late": "Key design 2: aggregation heads in layers 23-28 (depth >= 0.81)",
                 "align_min": "Key design 2: aggregation output highly aligns with the final number "
                              "(countlens: top-1 token = the count's first token on >= half the samples)",
                 "difficulty_min": "Key design 2: awareness heads write 'difficult', 'impossible' at large counts "
                                   "(countlens: >= 10 % of the top-10 tokens are difficulty words)"},
    ),
    "counting-to-four": Preset(
        "counting-to-four", "Counting to Four is still a Chore for VLMs (paper 000)",
        discover={"n_per_case": 1000, "prompt": "std"},
        sources={"n_per_case": "Method steps: 32 cases x 1,000 samples", "prompt": "Method steps: the Pstd prompt"},
    ),
}


def get(name: str) -> Preset:
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)}")
    return PRESETS[name]


def discover_config(name: str, **overrides):
    """The `DiscoverConfig` of preset ``name``; ``overrides`` (e.g. small sizes) win over it."""
    from countlens.discover import DiscoverConfig

    known = {f.name for f in fields(DiscoverConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise InputError(f"{sorted(unknown)} are not DiscoverConfig fields; use some of {sorted(known)}")
    return DiscoverConfig(**{**get(name).discover, **overrides, "preset": name})


def thresholds(name: str = "", **overrides):
    """The `HeadThresholds` of preset ``name`` ("": countlens's defaults), with ``overrides``."""
    from countlens.analysis.heads import HeadThresholds

    base = HeadThresholds(**get(name).thresholds) if name else HeadThresholds()
    return replace(base, **overrides)
