"""The organism's edge forward: countlens's edge engine (`countlens.circuits.graph.edge_ablation`), with gradients.

Planting a circuit of edges (`countlens.toy.edge_plant`) trains what `countlens.circuits.graph.edge_ablation`
computes: every receiver r reading its own copy of the residual stream, x_r = x − Σ_{u→r ablated}
(c_u − a_u), x the stream of this forward, c_u node u's output in it, a_u another run's. There is one
implementation of that forward, the engine's; this module puts it in the toy's terms:

- **Edges**: `EdgeSpace` names the nodes, receivers and edges of `countlens.circuits.graph.edges.edge_graph`
  (the labels of `countlens.labels`, in forward order: ``IN.image→L0K1.v``) without a model, and gives
  masks over them, (receivers × nodes) bool; `EdgeForward` refuses a model whose graph differs.
- **Node outputs** (`EdgeForward.__call__`'s second result): the engine's recording (`record_nodes`)
  as a list in `EdgeSpace.nodes` order — ``IN.image`` / ``IN.text`` the input embeddings at image /
  other positions, a head its z (its slice of o_proj's input), an MLP its output. A **donor** is such
  a list reordered over the batch, and becomes the ablated edges' values a_u.
- **Gradients** wherever torch's grad mode is on: the engine's opt-in ``grad`` (`record_nodes`,
  `edge_ablated_logits`). In training the donor's values keep theirs too, so a strictness loss also
  trains the model not to carry the count where the donor's values stand in. Under ``no_grad``
  (`countlens.toy.edge_plant.fresh_edge_strictness`) it is the engine's fast path.

What planting needs beyond the engine's other callers, and where the engine gives it: gradients (the
``grad`` above; the receivers' copies of the stream are formed in place only without them); a
Hugging Face model in training rather than a loaded `VLM` (`organism_vlm` wraps it, nnsight's trace
keeping the graph); the model's inputs dict rather than a `Batch` (both functions take it); the vision
tower run once per batch (a one-set forward runs on the inputs as given, so
`countlens.toy.resample.image_features_once`, keyed on the pixel tensor, serves every forward of it).

It replaced a hand-written decoder of the organism (now the reference in
``tests/unit/test_one_edge_forward.py``, which holds planting's losses and their gradients equal through
both). What differs is arithmetic only, equal up to rounding: the attention is the model's own (its
attention implementation and rotary module) rather than SDPA on cached cos/sin; a head's c_u − a_u is
taken on z and then mapped through its columns of o_proj rather than taken on its mapped output; a
receiver with more edges ablated than kept reads the complement, the donor's own stream plus its kept
edges' differences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from countlens.circuits.graph.edge_ablation import edge_ablated_logits
from countlens.circuits.graph.edges import edge_graph
from countlens.circuits.graph.nodes import record_nodes
from countlens.circuits.sites import heads_view
from countlens.errors import InputError
from countlens.labels import LOGITS, edge_label, head_label, input_label, kv_label, mlp_in_label, mlp_label, query_label
from countlens.model.vlm import VLM
from countlens.toy.recipe import ToyConfig, build_processor


@dataclass(frozen=True)
class Prepared:
    """One batch as every forward of it reads it: the model's inputs and where the image tokens sit."""

    inputs: dict
    image: torch.Tensor  # (B, T) bool


def prepare(model, inputs: dict) -> Prepared:
    """``inputs`` (a batch of ``model``'s, a HF Qwen2-VL) for `EdgeForward`. Prompts must share one length
    (no padding): a donor's node outputs are taken position by position from another sample."""
    if int(inputs["attention_mask"].sum(1).min()) != inputs["attention_mask"].shape[1]:
        raise InputError(
            "the edge forward needs prompts of one length (no padding): a donor's outputs are read position by "
            "position; batch prompts of one length (the short prompt, one-word shapes)"
        )
    return Prepared(inputs, inputs["input_ids"] == model.config.image_token_id)


def organism_vlm(model) -> VLM:
    """``model`` (the organism's HF model, in training or not) as a `VLM`, its processor the organism's."""
    return VLM(model, build_processor(ToyConfig()), name=str(getattr(model.config, "_name_or_path", "") or "toy"))


class EdgeSpace:
    """The nodes, receivers and edges of a ``layers`` × ``heads`` (``kv_heads`` key-value heads) decoder,
    and masks of ablated edges over them: a (receivers, nodes) bool matrix, True where u → r is ablated."""

    def __init__(self, layers: int, heads: int, kv_heads: int):
        self.layers, self.heads, self.kv_heads = layers, heads, kv_heads
        self.nodes = [input_label("image"), input_label("text")]
        self.receivers: list[str] = []
        self.upstream: list[int] = []  # per receiver: how many nodes (a prefix of `nodes`) it reads
        for layer in range(layers):
            attn = (
                [query_label((layer, h)) for h in range(heads)]
                + [kv_label((layer, g), "k") for g in range(kv_heads)]
                + [kv_label((layer, g), "v") for g in range(kv_heads)]
            )
            self.receivers += attn
            self.upstream += [len(self.nodes)] * len(attn)
            self.nodes += [head_label((layer, h)) for h in range(heads)]
            self.receivers.append(mlp_in_label(layer))
            self.upstream.append(len(self.nodes))
            self.nodes.append(mlp_label(layer))
        self.receivers.append(LOGITS)
        self.upstream.append(len(self.nodes))
        self.node_index = {n: i for i, n in enumerate(self.nodes)}
        self.receiver_index = {r: i for i, r in enumerate(self.receivers)}

    @classmethod
    def of(cls, model) -> EdgeSpace:
        text = model.config.text_config
        return cls(text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads)

    @property
    def edges(self) -> list[str]:
        """Every edge's label, ``u→r``, receivers in forward order."""
        return [edge_label(self.nodes[u], r) for r, n in zip(self.receivers, self.upstream) for u in range(n)]

    def valid(self) -> torch.Tensor:
        """(receivers, nodes): True where u is upstream of r (an edge)."""
        m = torch.zeros(len(self.receivers), len(self.nodes), dtype=torch.bool)
        for r, n in enumerate(self.upstream):
            m[r, :n] = True
        return m

    def mask(self, edges) -> torch.Tensor:
        """The (receivers, nodes) mask with exactly ``edges`` (labels ``u→r``) True; raises naming an edge
        that is not one of this space's."""
        m = torch.zeros(len(self.receivers), len(self.nodes), dtype=torch.bool)
        for label in edges:
            u, _, r = label.partition("→")
            if u not in self.node_index or r not in self.receiver_index:
                raise InputError(f"edge {label!r} is not an edge of this model: write it as 'u→r', e.g. 'L0H2→MLP1.in'")
            ui, ri = self.node_index[u], self.receiver_index[r]
            if ui >= self.upstream[ri]:
                raise InputError(f"edge {label!r}: {u} is not upstream of {r}")
            m[ri, ui] = True
        return m

    def all_but(self, edges) -> torch.Tensor:
        """Every edge ablated except ``edges``."""
        return self.valid() & ~self.mask(edges)


class EdgeForward:
    """The engine's edge-ablated forward of one organism (module docstring), with gradients where torch's
    grad mode is on."""

    def __init__(self, model):
        self.model, self.vlm = model, organism_vlm(model)
        self.graph = edge_graph(self.vlm)
        self.space = EdgeSpace.of(model)
        if self.graph.labels() != self.space.edges:
            raise InputError(
                f"{self.vlm.name}'s edge graph is not the organism's decoder (layers × heads × kv heads of its "
                "text config): plant edges into a Qwen2-VL organism (countlens.toy)"
            )
        self.valid = self.space.valid()

    def __call__(
        self, prep: Prepared, ablate: torch.Tensor | None = None, donor: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """(last-position logits (B, vocab), the run's node outputs in `EdgeSpace.nodes` order — None with
        edges ablated). ``ablate`` (receivers × nodes, `EdgeSpace.mask`) edges take ``donor``'s node outputs."""
        if ablate is not None and bool(ablate.any()):
            if donor is None or len(donor) != len(self.space.nodes):
                raise InputError("an edge forward with ablated edges needs the donor's output of every node")
            if bool((ablate & ~self.valid).any()):
                raise InputError("the ablation mask names a node that is not upstream of its receiver")
        else:
            ablate = None
        grad = torch.is_grad_enabled()
        if ablate is None:
            rec = record_nodes(self.vlm, prep.inputs, self.graph.nodes, logits=True, grad=grad)
            return rec["logits"], self._outputs(rec, prep.image)
        edges = frozenset(ablate[self.valid].nonzero().flatten().tolist())  # mask[valid] lists edges in order
        n = len(prep.image)
        logits = edge_ablated_logits(
            self.vlm, self.graph, prep.inputs, [edges], self._values(donor), prep.image, n, grad
        )
        return logits[0], None

    def _outputs(self, rec: dict, image: torch.Tensor) -> list[torch.Tensor]:
        """A `record_nodes` recording as node outputs in `EdgeSpace.nodes` order."""
        embed = rec["embed"]
        img = image[..., None].to(embed.dtype)
        outs = [embed * img, embed * (1 - img)]
        for layer in range(self.space.layers):
            outs += list(heads_view(rec["z"][layer], self.space.heads).unbind(-2))
            outs.append(rec["mlp"][layer])
        return outs

    def _values(self, donor: list[torch.Tensor]) -> dict:
        """Node outputs (`_outputs`, reordered) as the engine's ablation values."""
        h = self.space.heads
        z, mlp = {}, {}
        for layer in range(self.space.layers):
            at = 2 + layer * (h + 1)
            z[layer] = torch.cat(donor[at : at + h], -1)
            mlp[layer] = donor[at + h]
        return {"embed": donor[0] + donor[1], "z": z, "mlp": mlp}
