"""Planted circuits: organisms whose counting circuit is known in advance, to score discovery methods.

Patching, AtP, EAP-IG and HeadLens agree with independent re-implementations, which proves their
arithmetic, not that they find a circuit: the shipped organism's circuit is whatever its training
produced. A planted organism is trained so that a circuit C, named here before training, carries the
count and nothing else does — the idea of InterpBench's Strict Interchange Intervention Training
(SIIT; Gupta et al. 2024), applied to a vision-language model.

**Nodes** are the attention heads of the language model, each over every position (its z, the input
of the output projection, sliced per head). MLPs, embeddings and the vision tower are not nodes: they
are never resampled, so C is a set of heads and "what the answer needs after it" is the MLPs.

**Resampling** a node replaces its z with another sample's (the *source*), here the partner of a
clean/corrupt count pair (`countlens.datasets.pairs`): the same objects, a different count.

**Training** (`countlens.toy.plant`) starts from the shipped organism, its vision tower frozen, and
minimises, per step, the sum of three cross-entropies of the answer:
- *clean*: the plain run against the clean label, so the organism keeps counting;
- *strictness*: against the clean label with every node outside C resampled, so nothing outside C
  may matter — one term per source in `PlantedCircuit.strict_sources`: the partner, and where a
  circuit asks for it a random other sample of the batch, or another scene of a different count, too
  (other objects, as the checks resample);
- *interchange*: against the **source's** label with C resampled (on circuits whose nodes are each
  necessary, alternately all of C and one node of C in turn), so C must carry the count.
Two training-only devices fix a circuit's route beyond its node set: a node may be kept at one
position only (`PlantedNode.at`; elsewhere it is resampled too during strictness), and a layer may be
made *blind* to the image (`PlantedCircuit.blind_layers`: its keys and values at image positions come
from the source), so a later head must read the count from a text position, not from the image.
Neither device is part of the evaluation: the checks and every method see heads over all positions.
A circuit may add a second stage (`Sharpening`): more steps from the first stage's weights, at a lower
rate, with its own strictness sources and weights, and (where it names them) half the pairs drawn from
the high counts where a donor's resampling moves borderline answers.

The circuits start where the organism already moves the count — its layer-0 heads carry almost all of
exact head patching's effect (L0H0 0.31, L0H3 0.21, L0H2 0.12; every later head ≤ 0.04, on 32 pairs) —
because re-routing the count through a later layer from scratch did not start within a few hundred
steps (measured: a one-head route through L3H2 stayed at chance under strictness for 100 steps at
3e-4, and left the clean answers at loss 1.6 after 100 steps at 1e-3).

A circuit may also be a set of **edges** (`EdgeCircuit`, planted by `countlens.toy.edge_plant`): which
of a node's inputs and outputs carry the count, not only which nodes.

These circuits and checks are countlens's own construction; no paper's planted models are comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real

from countlens.errors import InputError
from countlens.labels import head_label, mlp_label

#: Where a node is kept during strictness training: every position, the last one, or <|vision_end|>.
POSITIONS: tuple[str, ...] = ("all", "last", "vision_end")
#: Whose activations strictness training resamples from: the pair's partner (the same objects, another
#: count), a random other sample of the batch (other objects too), or another scene of the batch of a
#: different or of the same count (`countlens.toy.strictness.donor_order`) — the donors the checks
#: resample from.
SOURCES: tuple[str, ...] = ("partner", "random", "different", "same")


@dataclass(frozen=True)
class PlantedNode:
    """Head ``head`` of decoder layer ``layer`` (``head`` None: the layer's MLP); ``at`` where strictness
    training keeps it (`POSITIONS`)."""

    layer: int
    head: int | None
    at: str = "all"

    @property
    def is_mlp(self) -> bool:
        return self.head is None

    @property
    def label(self) -> str:
        """``"L0H2"`` for a head, ``"MLP1"`` for an MLP: the labels of `countlens.labels`, as circuits
        write them (value-route's shipped planted.json keeps the former ``"L1MLP"``; `mlp_key` reads both)."""
        return mlp_label(self.layer) if self.is_mlp else head_label((self.layer, self.head))


@dataclass(frozen=True)
class Sharpening:
    """A second training stage, from the first stage's weights, at a lower rate on larger batches: every
    other pair drawn from ``high_counts`` where it names some (the rest from counts 1–9; the answers a
    donor of another scene takes away sit at borderline high counts, `countlens.toy.strictness.
    lost_answers`), with its own strictness sources, the different-count one weighted
    ``different_weight``, and the invariance term (`countlens.toy.plant.invariance`: the resampled runs'
    answer distributions held to the clean run's) weighted ``invariance_weight``."""

    steps: int
    lr: float
    batch_pairs: int
    seed: int
    high_counts: tuple[int, ...]
    strict_sources: tuple[str, ...]
    warmup: int = 10
    different_weight: float = 1.0
    invariance_weight: float = 0.0  # `countlens.toy.plant.invariance`'s weight


@dataclass(frozen=True)
class PlantedCircuit:
    """A circuit to plant: its heads, the layers blind to the image, and whether each node is necessary."""

    name: str
    nodes: tuple[PlantedNode, ...]
    description: str
    blind_layers: tuple[int, ...] = ()
    each_necessary: bool = True
    steps: int = 400  # the recipe's training steps for this circuit
    strict_sources: tuple[str, ...] = ("partner",)  # one strictness term per source (`SOURCES`), every step
    # Whether the MLPs are nodes too: resampled outside C like the heads (else never resampled).
    mlp_nodes: bool = False
    # Sources of `strict_sources` whose strictness term keeps C as the checks do: at every position, no
    # blind layer (the others use the training devices `PlantedNode.at` and `blind_layers`).
    checked: tuple[str, ...] = ()
    # A second stage after the first (`Sharpening`), or none.
    sharpen: Sharpening | None = None

    @property
    def heads(self) -> frozenset[tuple[int, int]]:
        """C's heads as (layer, head) pairs: what a method's ranking of heads is scored against."""
        return frozenset((n.layer, n.head) for n in self.nodes if not n.is_mlp)

    @property
    def mlps(self) -> frozenset[int]:
        """The layers whose MLP is a node of C."""
        return frozenset(n.layer for n in self.nodes if n.is_mlp)


CIRCUITS: dict[str, PlantedCircuit] = {
    c.name: c
    for c in (
        PlantedCircuit(
            "route",
            (PlantedNode(0, 2),),
            "one routing head (L0H2) moves the count from the image tokens to the last token; the MLPs after it "
            "decode it",
            steps=800,
            strict_sources=("partner", "different"),
        ),
        PlantedCircuit(
            "two-hop",
            (PlantedNode(0, 0, at="vision_end"), PlantedNode(1, 1, at="last")),
            "L0H0 moves the count from the image tokens to <|vision_end|>; L1H1, blind to the image, moves it "
            "on to the last token",
            blind_layers=(1,),
            steps=1200,
            strict_sources=("partner", "random", "different"),
            sharpen=Sharpening(
                steps=400,
                lr=3e-4,
                batch_pairs=32,
                seed=4,
                high_counts=(5, 6, 7, 8, 9),
                strict_sources=("partner", "random", "different", "same"),
                invariance_weight=4.0,
            ),
        ),
        PlantedCircuit(
            "spread",
            (PlantedNode(0, 0), PlantedNode(0, 3), PlantedNode(1, 2), PlantedNode(2, 1)),
            "four heads over three layers (L0H0, L0H3, L1H2, L2H1) carry the count together",
            each_necessary=False,
            steps=300,
            strict_sources=("partner", "different"),
        ),
        PlantedCircuit(
            "mlp",
            (PlantedNode(0, 2), PlantedNode(0, None, at="last")),
            "L0H2 moves the count from the image tokens to the last token, where layer 0's MLP decodes it; every "
            "other head and MLP is resampled",
            steps=600,
            strict_sources=("partner", "different"),
            mlp_nodes=True,
        ),
    )
}


@dataclass(frozen=True)
class EdgeCircuit:
    """A circuit of edges (labels ``u→r``), the edges the interchange loss swaps alone, and its nodes."""

    name: str
    edges: tuple[str, ...]
    swapped: tuple[str, ...]
    nodes: tuple[PlantedNode, ...]
    description: str
    steps: int = 600
    strict_sources: tuple[str, ...] = ("partner", "different")
    sharpen: Sharpening | None = None  # a second stage (`Sharpening`), or none

    @property
    def node_circuit(self) -> PlantedCircuit:
        """Its nodes as a head-and-MLP circuit, for the node-level checks and node rankings."""
        return PlantedCircuit(self.name, self.nodes, self.description, mlp_nodes=True)


EDGE_CIRCUITS: dict[str, EdgeCircuit] = {
    c.name: c
    for c in (
        EdgeCircuit(
            "value-route",
            ("IN.image→L0K1.k", "IN.image→L0K1.v", "L0H2→MLP1.in", "MLP1→logits"),
            ("IN.image→L0K1.v", "L0H2→MLP1.in", "MLP1→logits"),
            (PlantedNode(0, 2), PlantedNode(1, None)),
            "L0H2 reads the image through its key-value head and moves the count to the last token; only MLP1 "
            "reads it there, and MLP1 alone writes the answer to the logits",
            steps=800,
            sharpen=Sharpening(
                steps=300,
                lr=3e-4,
                batch_pairs=32,
                seed=4,
                high_counts=(),
                strict_sources=("partner", "different", "same"),
                different_weight=3.0,
                invariance_weight=4.0,
            ),
        ),
    )
}


def edge_circuit(name: str) -> EdgeCircuit:
    """The edge circuit ``name``; raises naming the choices."""
    if not isinstance(name, str) or name not in EDGE_CIRCUITS:
        raise InputError(f"no planted edge circuit {name!r}; choose one of {tuple(EDGE_CIRCUITS)}")
    return EDGE_CIRCUITS[name]


def planted_circuit(name: str) -> PlantedCircuit:
    """The circuit ``name`` of `CIRCUITS`; raises naming the choices."""
    if not isinstance(name, str) or name not in CIRCUITS:
        raise InputError(f"no planted circuit {name!r}; choose one of {tuple(CIRCUITS)}")
    return CIRCUITS[name]


def check_circuit(circuit: PlantedCircuit, n_layers: int, n_heads: int) -> None:
    """Raise if a field is of the wrong kind, or a node or blind layer lies outside an ``n_layers`` ×
    ``n_heads`` model."""
    check_fields(circuit)
    for n in circuit.nodes:
        head_ok = n.is_mlp or 0 <= n.head < n_heads
        if not (0 <= n.layer < n_layers and head_ok) or n.at not in POSITIONS:
            raise InputError(
                f"planted circuit {circuit.name!r}: node {n.label} at {n.at!r} is not a node of a "
                f"{n_layers}-layer, {n_heads}-head model at one of {POSITIONS}"
            )
        if n.is_mlp and not circuit.mlp_nodes:
            raise InputError(
                f"planted circuit {circuit.name!r}: node {n.label} is an MLP, but the circuit's MLPs are not nodes: "
                "set mlp_nodes=True (every MLP outside C is then resampled too)"
            )
    sources = set(circuit.strict_sources)
    if not sources or sources - set(SOURCES) or set(circuit.checked) - sources:
        raise InputError(
            f"planted circuit {circuit.name!r}: strictness sources {circuit.strict_sources} must be some of {SOURCES}, "
            f"and those checked as the checks do ({circuit.checked}) some of them"
        )
    check_sharpening(circuit.name, circuit.sharpen)
    if any(not 0 <= layer < n_layers for layer in circuit.blind_layers):
        raise InputError(
            f"planted circuit {circuit.name!r}: blind layers {circuit.blind_layers} outside 0–{n_layers - 1}"
        )


def _index(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= 0


def _listed(value, kind: type | tuple) -> bool:
    """A tuple or list of ``kind`` values."""
    return isinstance(value, (tuple, list)) and all(isinstance(v, kind) for v in value)


def check_fields(circuit: PlantedCircuit | EdgeCircuit) -> None:
    """Raise if ``circuit``'s fields are not what they hold: a name and a description, a non-empty tuple of
    `PlantedNode`s of integer layers and heads, a step count, tuples of layers, of source names and (an
    edge circuit's) of edge labels, switches True or False."""
    name = circuit.name
    if not isinstance(name, str) or not name:
        raise InputError(f"a planted circuit's name is a non-empty string, e.g. 'route'; got {name!r:.60}")
    nodes = circuit.nodes
    if not _listed(nodes, PlantedNode) or not nodes:
        raise InputError(
            f"planted circuit {name!r}: nodes is a non-empty tuple of PlantedNode(layer, head), e.g. "
            f"(PlantedNode(0, 2),); got {nodes!r:.60}"
        )
    for n in nodes:
        if not _index(n.layer) or not (n.head is None or _index(n.head)) or not isinstance(n.at, str):
            raise InputError(
                f"planted circuit {name!r}: a node is PlantedNode(layer, head, at) with integer layer and head ≥ 0 "
                f"(head None: the layer's MLP) and at one of {POSITIONS}; got {n!r:.80}"
            )
    if not isinstance(circuit.description, str):
        raise InputError(f"planted circuit {name!r}: description is a string, got {circuit.description!r:.60}")
    if not _index(circuit.steps) or not circuit.steps:
        raise InputError(f"planted circuit {name!r}: steps is an integer ≥ 1, got {circuit.steps!r:.60}")
    edge = isinstance(circuit, EdgeCircuit)
    own = {"edges": str, "swapped": str} if edge else {"blind_layers": Integral, "checked": str}
    tuples = {"strict_sources": str, **own}
    for field, kind in tuples.items():
        if not _listed(getattr(circuit, field), kind):
            what = "integers" if kind is Integral else "strings"
            raise InputError(
                f"planted circuit {name!r}: {field} is a tuple of {what}; got {getattr(circuit, field)!r:.60}"
            )
    for field in () if edge else ("each_necessary", "mlp_nodes"):
        if not isinstance(getattr(circuit, field), bool):
            raise InputError(f"planted circuit {name!r}: {field} is True or False, got {getattr(circuit, field)!r:.60}")


def check_sharpening(name: str, s: Sharpening | None) -> None:
    """Raise if circuit ``name``'s second stage ``s`` (if any) is no `Sharpening`, names unknown sources or
    counts, or has bad weights."""
    if s is None:
        return
    if not isinstance(s, Sharpening):
        raise InputError(f"planted circuit {name!r}: sharpen is a Sharpening(...) or None, got {type(s).__name__}")
    weights = (s.different_weight, s.invariance_weight)
    if (
        not _listed(s.strict_sources, str)
        or not _listed(s.high_counts, Integral)
        or not all(isinstance(w, Real) and not isinstance(w, bool) for w in weights)
    ):
        raise InputError(
            f"planted circuit {name!r}: its sharpening takes tuples of strictness sources and high counts and "
            f"numeric weights; got {s!r:.120}"
        )
    if (
        not set(s.strict_sources)
        or set(s.strict_sources) - set(SOURCES)
        or len(set(s.high_counts)) == 1
        or not set(s.high_counts) <= set(range(1, 10))
        or not s.different_weight > 0
        or not 0 <= s.invariance_weight < float("inf")
    ):
        raise InputError(
            f"planted circuit {name!r}: its sharpening's strictness sources {s.strict_sources} must be "
            f"some of {SOURCES}, its high counts {s.high_counts} none or two or more of 1–9, and its "
            f"different-count weight {s.different_weight} positive, its invariance weight "
            f"{s.invariance_weight} zero or more (finite)"
        )
