"""One edge forward: planting's losses and their gradients through countlens's edge engine
(`countlens.toy.edge_forward`, the engine's opt-in ``grad``) equal those through the hand-written
decoder of the organism it replaced (kept here, and only here, as an independent reference); and the
engine's gradient path is opt-in, its default the no-grad fast path."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_close
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

from countlens.circuits.engine import Hook, hooked, module_of
from countlens.circuits.sites import first_arg
from countlens.errors import InputError
from countlens.model.arch import resolve
from countlens.toy.edge_forward import EdgeForward, EdgeSpace, prepare
from countlens.toy.edge_plant import edge_losses
from countlens.toy.plant import PlantConfig
from countlens.toy.planted import EDGE_CIRCUITS
from countlens.toy.planter import pair_batch, pairs_at
from countlens.toy.recipe import ToyConfig
from countlens.toy.resample import image_features_once
from countlens.toy.train import Collator

pytestmark = pytest.mark.numeric


# -- the reference: the organism's decoder written out by hand (the edge forward before the engine's) ----


@dataclass(frozen=True)
class _Prepared:
    embeds: torch.Tensor
    image: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class _Stop(Exception):
    pass


def _prepare(model, inputs: dict) -> _Prepared:
    """The input embeddings and RoPE's cos/sin, from a run stopped at the first decoder layer."""
    seen = {}

    def grab(_m, args, kwargs):
        seen["x"], seen["pe"] = first_arg(args, kwargs), kwargs["position_embeddings"]
        raise _Stop

    try:
        with hooked(model, [Hook(resolve(model.config).layer(0), "before", grab)]):
            model.model(**inputs, use_cache=False)
    except _Stop:
        pass
    return _Prepared(seen["x"], inputs["input_ids"] == model.config.image_token_id, *seen["pe"])


class _HandWritten:
    """x_r = x + Σ_{u→r ablated}(a_u − c_u), every node's output (B, T, d) in the stream's space, the
    attention SDPA on the cached cos/sin."""

    def __init__(self, model):
        self.model, arch = model, resolve(model.config)
        self.space = EdgeSpace.of(model)
        part = lambda path: module_of(model, path)  # noqa: E731
        self.layers = [
            tuple(
                part(p(la))
                for p in (
                    arch.attention,
                    arch.attn_norm,
                    arch.mlp_norm,
                    arch.mlp,
                    arch.q_proj,
                    arch.k_proj,
                    arch.v_proj,
                    arch.o_proj,
                )
            )
            for la in range(arch.n_layers)
        ]
        self.final_norm, self.lm_head = part(arch.final_norm), part(arch.lm_head)

    def __call__(self, prep, ablate=None, donor=None):
        ablate = ablate if ablate is not None and bool(ablate.any()) else None
        sp, x = self.space, prep.embeds
        img = prep.image[..., None].to(x.dtype)
        outs, r = [x * img, x * (1 - img)], 0
        for attn, attn_norm, mlp_norm, mlp, *proj in self.layers:
            n_attn = sp.heads + 2 * sp.kv_heads
            xs = self._inputs(x, outs, ablate, donor, r, n_attn)
            r += n_attn
            heads = self._heads(attn, proj, attn_norm(xs), prep)
            x = x + heads.sum(0)
            outs += list(heads.unbind(0))
            out = mlp(mlp_norm(self._inputs(x, outs, ablate, donor, r, 1)[0]))
            r += 1
            x = x + out
            outs.append(out)
        xf = self._inputs(x[:, -1:], [o[:, -1:] for o in outs], ablate, donor, r, 1, last=True)[0]
        return self.lm_head(self.final_norm(xf))[:, -1], outs

    def _inputs(self, x, outs, ablate, donor, row, n, last=False):
        base = x.expand(n, *x.shape)
        if ablate is None:
            return base
        m = ablate[row : row + n, : len(outs)]
        used = m.any(0).nonzero().flatten().tolist()
        if not used:
            return base
        diff = torch.stack([(donor[u][:, -1:] if last else donor[u]) - outs[u] for u in used])
        return base + torch.einsum("ru,ubtd->rbtd", m[:, used].to(x.dtype), diff)

    def _heads(self, attn, proj, xs, prep):
        h, g, d, hd = self.space.heads, self.space.kv_heads, xs.shape[-1], attn.head_dim
        q_proj, k_proj, v_proj, o_proj = proj
        q = torch.einsum("hbtd,hed->bhte", xs[:h], q_proj.weight.view(h, hd, d)) + q_proj.bias.view(1, h, 1, hd)
        k = torch.einsum("gbtd,ged->bgte", xs[h : h + g], k_proj.weight.view(g, hd, d)) + k_proj.bias.view(1, g, 1, hd)
        v = torch.einsum("gbtd,ged->bgte", xs[h + g :], v_proj.weight.view(g, hd, d)) + v_proj.bias.view(1, g, 1, hd)
        q, k = apply_rotary_pos_emb(q, k, prep.cos, prep.sin)
        k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
        return torch.einsum("bhte,dhe->hbtd", z, o_proj.weight.view(d, h, hd))


# -- the checks --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_pairs(loaded):
    vlm = loaded("toy")
    inputs, answers, partner = pair_batch(Collator(ToyConfig()), pairs_at(5, 0, 3))
    return vlm, inputs, answers, partner


def test_plantings_losses_and_gradients_are_the_hand_written_decoders(toy_pairs):
    """The planting step's every loss (clean, strictness from each donor kind, invariance, interchange of
    all of E and of one edge alone) and the gradient of their sum at weights E runs through, through the
    engine and through the reference: equal within the tolerance rule. The donor's values keep their
    gradient in both (a path that detached them would move the gradients)."""
    vlm, inputs, answers, partner = toy_pairs
    model = vlm.hf  # read only: gradients by autograd.grad, no .grad written, no mode changed
    circuit = EDGE_CIRCUITS["value-route"]
    pc = PlantConfig(invariance_weight=2.0)
    text = model.model.language_model
    weights = {
        "L0 v_proj": text.layers[0].self_attn.v_proj.weight,
        "MLP1 down_proj": text.layers[1].mlp.down_proj.weight,
        "L5 q_proj": text.layers[5].self_attn.q_proj.weight,
    }
    engine, reference = EdgeForward(model), _HandWritten(model)
    for swap_edges in (circuit.edges, circuit.swapped[:1]):
        got = {}
        for name, fwd, prep in (("engine", engine, prepare(model, inputs)), ("hand", reference, None)):
            if prep is None:
                with image_features_once(model):  # the tower frozen, as planting ran it
                    prep = _prepare(model, inputs)
            gen = torch.Generator().manual_seed(3)
            clean, losses, swap = edge_losses(fwd, prep, answers, partner, circuit, fwd.space.mask(swap_edges), gen, pc)
            terms = {"clean": clean, **losses, "swap": swap}
            grads = torch.autograd.grad(sum(terms.values()), list(weights.values()))
            got[name] = (terms, dict(zip(weights, grads)))
        (terms, grads), (want_terms, want_grads) = got["engine"], got["hand"]
        assert terms.keys() == want_terms.keys() >= {"clean", "strict_partner", "strict_different", "invariance"}
        for key, value in terms.items():
            assert_close(value, want_terms[key], what=f"{key} loss, swapping {len(swap_edges)} edges")
        for key, g in grads.items():
            assert g.abs().max() > 0, key
            assert_close(g, want_grads[key], what=f"the gradient at {key}")


def test_the_engines_gradients_are_opt_in(toy_pairs):
    """edge_ablated_logits without grad: no graph, on the CPU; with it, the same numbers with a graph; an
    inputs dict without max_rows is refused before any forward."""
    from countlens.circuits.graph.edge_ablation import edge_ablated_logits
    from countlens.circuits.graph.edges import edge_graph
    from countlens.circuits.graph.nodes import record_nodes

    vlm, inputs, _, partner = toy_pairs
    graph = edge_graph(vlm)
    image = inputs["input_ids"] == vlm.hf.config.image_token_id
    values = record_nodes(vlm, inputs, graph.nodes)
    assert not values["z"][0].requires_grad
    donor = {
        "embed": values["embed"][partner],
        **{k: {la: v[partner] for la, v in values[k].items()} for k in ("z", "mlp")},
    }
    sets = [frozenset(range(0, len(graph.edges), 3))]
    fast = edge_ablated_logits(vlm, graph, inputs, sets, donor, image, max_rows=len(partner))
    assert not fast.requires_grad and fast.device.type == "cpu"
    traced = edge_ablated_logits(vlm, graph, inputs, sets, donor, image, max_rows=len(partner), grad=True)
    assert traced.grad_fn is not None
    assert_close(traced, fast, what="the grad path's logits")
    with pytest.raises(InputError, match="max_rows"):
        edge_ablated_logits(vlm, graph, inputs, sets, donor, image)
