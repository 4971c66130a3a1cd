"""A differentiable forward of the organism's language model in which chosen edges carry a donor's values.

Planting a circuit of edges (`countlens.toy.edge_plant`) needs what `countlens.circuits.edge_ablation`
computes — every receiver reading its own copy of the residual stream, some of its upstream terms
taken from another run — but inside training, with gradients into the weights, on the organism's
Qwen2-VL only. So this module writes the decoder out by hand from the model's own weights; the
tests check it against the model's forward (no edge ablated) and against countlens's edge engine
(edges ablated).

**Nodes** (upstream): ``IN.image`` and ``IN.text`` (the input embeddings at image and at text
positions), each head ``L{l}H{h}`` (its z through its columns of o_proj) and each MLP ``MLP{l}``.
**Receivers**: each head's query ``L{l}H{h}.q``, each key-value head's key and value ``L{l}K{g}.k`` /
``.v``, each MLP's input ``MLP{l}.in`` and ``logits`` — the labels of `countlens.labels`, which
`countlens.circuits.edges` writes too, so an edge here is named as countlens's methods name it
(``IN.image→L0K1.v``).

Ablating u → r gives receiver r the input x_r = x + Σ_{u→r ablated} (a_u − c_u): x the stream as this
forward computes it, c_u node u's output in this forward, a_u the donor's. The donor's outputs are
another forward's (`EdgeForward.__call__` returns them), reordered over the batch, and keep their
gradient: a strictness loss then also trains the model not to carry the count where the donor's
values stand in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

from countlens.circuits.engine import Hook, hooked, module_of
from countlens.circuits.sites import first_arg
from countlens.errors import InputError
from countlens.labels import LOGITS, edge_label, head_label, input_label, kv_label, mlp_in_label, mlp_label, query_label
from countlens.model.arch import resolve


@dataclass(frozen=True)
class Prepared:
    """What every forward of one batch shares: the input embeddings, the image positions, RoPE's cos/sin."""

    embeds: torch.Tensor  # (B, T, d)
    image: torch.Tensor  # (B, T) bool
    cos: torch.Tensor
    sin: torch.Tensor


class _Stop(Exception):
    pass


@dataclass(frozen=True)
class _Block:
    """One decoder layer's modules the hand-written forward calls (the family spec's)."""

    attn: torch.nn.Module
    attn_norm: torch.nn.Module
    mlp_norm: torch.nn.Module
    mlp: torch.nn.Module


def prepare(model, inputs: dict) -> Prepared:
    """Run ``model`` (a HF Qwen2-VL) on ``inputs`` up to its first decoder layer and keep what it is given.
    Prompts must share one length (no padding): the forward here is causal only."""
    if int(inputs["attention_mask"].sum(1).min()) != inputs["attention_mask"].shape[1]:
        raise InputError("the edge forward needs prompts of one length (no padding)")
    seen = {}

    def grab(_m, args, kwargs):
        seen["x"] = first_arg(args, kwargs)
        seen["pe"] = kwargs["position_embeddings"]
        raise _Stop

    try:
        with hooked(model, [Hook(resolve(model.config).layer(0), "before", grab)]):
            model.model(**inputs, use_cache=False)
    except _Stop:
        pass
    image = inputs["input_ids"] == model.config.image_token_id
    cos, sin = seen["pe"]
    return Prepared(seen["x"], image, cos, sin)


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
    """The hand-written decoder of one HF Qwen2-VL (module docstring)."""

    def __init__(self, model):
        self.model, arch = model, resolve(model.config)
        self.space = EdgeSpace.of(model)
        self.valid = self.space.valid()
        part = lambda path: module_of(model, path)  # noqa: E731 — the family spec's modules, by path
        self.blocks = [
            _Block(part(arch.attention(la)), part(arch.attn_norm(la)), part(arch.mlp_norm(la)), part(arch.mlp(la)))
            for la in range(arch.n_layers)
        ]
        projections = (arch.q_proj, arch.k_proj, arch.v_proj, arch.o_proj)
        self.projections = [tuple(part(p(la)) for p in projections) for la in range(arch.n_layers)]
        self.final_norm, self.lm_head = part(arch.final_norm), part(arch.lm_head)

    def __call__(
        self, prep: Prepared, ablate: torch.Tensor | None = None, donor: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(last-position logits (B, vocab), every node's output (B, T, d) in `EdgeSpace.nodes` order).
        ``ablate`` (receivers × nodes, `EdgeSpace.mask`) edges take ``donor``'s node outputs."""
        if ablate is not None and bool(ablate.any()):
            if donor is None or len(donor) != len(self.space.nodes):
                raise InputError("an edge forward with ablated edges needs the donor's output of every node")
            if bool((ablate & ~self.valid).any()):
                raise InputError("the ablation mask names a node that is not upstream of its receiver")
        else:
            ablate = None
        sp = self.space
        x = prep.embeds
        img = prep.image[..., None].to(x.dtype)
        outs = [x * img, x * (1 - img)]
        r = 0  # the next receiver's row
        for block, projections in zip(self.blocks, self.projections):
            n_attn = sp.heads + 2 * sp.kv_heads
            xs = self._inputs(x, outs, ablate, donor, r, n_attn)
            r += n_attn
            heads = self._heads(block.attn, projections, block.attn_norm(xs), prep)
            x = x + heads.sum(0)
            outs += list(heads.unbind(0))
            xm = self._inputs(x, outs, ablate, donor, r, 1)[0]
            r += 1
            mlp = block.mlp(block.mlp_norm(xm))
            x = x + mlp
            outs.append(mlp)
        xf = self._inputs(x[:, -1:], [o[:, -1:] for o in outs], ablate, donor, r, 1, last=True)[0]
        return self.lm_head(self.final_norm(xf))[:, -1], outs

    def _inputs(self, x, outs, ablate, donor, row: int, n: int, last: bool = False) -> torch.Tensor:
        """(n, B, T, d): receivers row…row+n's copies of the stream."""
        base = x.expand(n, *x.shape)
        if ablate is None:
            return base
        m = ablate[row : row + n, : len(outs)]
        used = m.any(0).nonzero().flatten().tolist()
        if not used:
            return base
        a = [donor[u][:, -1:] if last else donor[u] for u in used]
        diff = torch.stack([a_u - outs[u] for a_u, u in zip(a, used)])
        return base + torch.einsum("ru,ubtd->rbtd", m[:, used].to(x.dtype), diff)

    def _heads(self, attn, projections, xs: torch.Tensor, prep: Prepared) -> torch.Tensor:
        """(heads, B, T, d): each head's output, its q from xs[h], its kv head's k and v from xs' k and v rows."""
        sp = self.space
        h, g = sp.heads, sp.kv_heads
        d = xs.shape[-1]
        hd = attn.head_dim
        q_proj, k_proj, v_proj, o_proj = projections
        wq = q_proj.weight.view(h, hd, d)
        wk = k_proj.weight.view(g, hd, d)
        wv = v_proj.weight.view(g, hd, d)
        q = torch.einsum("hbtd,hed->bhte", xs[:h], wq) + q_proj.bias.view(1, h, 1, hd)
        k = torch.einsum("gbtd,ged->bgte", xs[h : h + g], wk) + k_proj.bias.view(1, g, 1, hd)
        v = torch.einsum("gbtd,ged->bgte", xs[h + g :], wv) + v_proj.bias.view(1, g, 1, hd)
        q, k = apply_rotary_pos_emb(q, k, prep.cos, prep.sin)
        k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
        wo = o_proj.weight.view(d, h, hd)
        return torch.einsum("bhte,dhe->hbtd", z, wo)
