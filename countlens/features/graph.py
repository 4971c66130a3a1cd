"""Attribution graphs: which features, through which others, make the model's answer on one prompt.

An attribution graph (Ameisen et al. 2025, "Circuit Tracing"; decoderesearch/circuit-tracer) is built
on the **local replacement model** of one prompt: the model with

- every **attention pattern frozen** at the clean run (countlens replays each layer's clean ``q_proj``
  and ``k_proj`` outputs, so softmax(q·k) is a constant and attention is linear in its values);
- every **RMSNorm scale frozen**: ``norm(x) = weight · x · s`` with ``s = 1/rms(x_clean)`` a constant;
- every **MLP replaced** by its transcoder's reconstruction plus the clean run's **error term**
  ``y − ŷ``, both held constant: a layer's MLP output is ``Σ_f a_f W_dec[f] + b_dec + error`` (plus
  the skip path ``x @ W_skip.T``, which stays live, for a transcoder with one).

At the clean input it computes what the model computes, and it is *affine* in its **sources**: each
active feature's write ``a_f · W_dec[f]`` at its layer's MLP output and position, each (layer,
position)'s error vector there, and each position's input embedding (decoder layer 0's input). What
is left — ``b_dec``, the value biases through the frozen patterns — is a constant no node carries.

**Nodes**, in this order: active features (layer, position, feature, activation; layer-major, then
position, then feature index), error nodes (layer-major, every position), embedding nodes (every
position: its token and, for an image token, its cell and the object it belongs to, else −1), logit
nodes (the most probable next tokens at the last position, up to ``logit_prob`` cumulative
probability, at most ``max_logits``).

**Edges.** ``A[target, source]`` (rows targets, columns sources) is the direct, linear effect of the
source on the target in the local replacement model: ``A[t, s] = v_s · ∂value_t/∂(write point of s)``,
``v_s`` the source vector. A feature target's value is its pre-activation ``W_enc[f] · x + b_enc[f]``
(``x`` the MLP input at its layer and position); a logit target's value is the *demeaned* logit
``(W_U[v] − mean_u W_U[u]) · h``, ``h`` the final norm's output at the last position. Gradients flow
through the residual stream, frozen attention and frozen norms but never through a feature's
nonlinearity (the MLP outputs are sources), so each edge is a direct effect; indirect effects are
paths. Each target row sums to its value: ``value_t = Σ_s A[t, s] + constant_t`` (``constant_t`` from
a run with every source zero). Error and embedding rows are empty: they are sources only.

**Computation** (circuit-tracer's). One forward of the frozen model over ``batch_size`` copies of the
prompt (the weights out of autograd), kept for many backward passes: each backward injects one
target's gradient per copy (a feature's encoder row at its MLP input and position, or a logit's
demeaned unembedding at the last position), so a backward fills ``batch_size`` rows of ``A``, computed
on the model's device (`EdgeColumns`) and written to a host buffer of ``max_features + n_logits`` rows
(logits first, then features as visited); the adjacency is then built over the kept nodes only.
**Positions**: all, none zeroed (circuit-tracer zeroes BOS's sources; the organism has no BOS).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from countlens.circuits.engine import Hook, hooked, module_of
from countlens.circuits.engine.freeze import Clamp, frozen
from countlens.circuits.sites import first_arg
from countlens.circuits.sites.positions import Objects
from countlens.errors import InputError
from countlens.features.influence import BLOCK_ELEMENTS, UPDATE_INTERVAL, next_features, partial_influence
from countlens.features.replacement import check_graphable
from countlens.features.transcoder import TranscoderSet
from countlens.validate import require_count, require_integer, require_share

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch

KINDS: tuple[str, ...] = ("feature", "error", "embedding", "logit")


@dataclass(eq=False)
class AttributionGraph:
    """One prompt's attribution graph (see the module's docstring). ``n = n_features + n_errors +
    n_embeddings + n_logits`` nodes in that order; per-position facts (``tokens``, ``cells``,
    ``objects``) are indexed by sequence position."""

    adjacency: torch.Tensor  # (n, n) float32; rows targets, columns sources
    features: torch.Tensor  # (n_features, 3) long: layer, position, feature index
    activations: torch.Tensor  # (n_features,)
    errors: torch.Tensor  # (n_errors, 2) long: layer, position
    embeddings: torch.Tensor  # (n_embeddings,) long: position
    logit_tokens: torch.Tensor  # (n_logits,) long vocab ids, most probable first
    logit_probs: torch.Tensor  # (n_logits,)
    values: torch.Tensor  # (n,) a target's value (pre-activation, demeaned logit); NaN for sources only
    constant: torch.Tensor  # (n,) the part of a target's value no node carries (biases); 0 for the others
    tokens: torch.Tensor  # (seq,) input ids
    token_strings: list[str]
    cells: torch.Tensor  # (seq, 2) an image token's (row, col), else (−1, −1)
    objects: torch.Tensor  # (seq,) the object an image token belongs to, else −1
    n_layers: int
    logit_strings: list[str] = field(default_factory=list)
    answer_token: int = -1
    prompt: str = ""
    scan: str = ""
    influence: torch.Tensor | None = None  # (n,) cumulative influence share at each node's rank (pruning)
    node_threshold: float | None = None
    edge_threshold: float | None = None

    @property
    def n_features(self) -> int:
        return len(self.features)

    @property
    def n_errors(self) -> int:
        return len(self.errors)

    @property
    def n_embeddings(self) -> int:
        return len(self.embeddings)

    @property
    def n_logits(self) -> int:
        return len(self.logit_tokens)

    @property
    def n_nodes(self) -> int:
        return self.adjacency.shape[0]

    @property
    def n_edges(self) -> int:
        return int((self.adjacency != 0).sum())

    @property
    def last(self) -> int:
        """The position the logits are read at (the last one)."""
        return len(self.tokens) - 1

    def kinds(self) -> np.ndarray:
        """Each node's kind (`KINDS`), in node order."""
        counts = (self.n_features, self.n_errors, self.n_embeddings, self.n_logits)
        return np.repeat(np.array(KINDS, dtype=object), counts)

    def start(self, kind: str) -> int:
        """The index of the first node of ``kind``."""
        counts = (self.n_features, self.n_errors, self.n_embeddings, self.n_logits)
        return int(sum(counts[: KINDS.index(kind)]))

    def logit_node(self, token: int | None = None) -> int:
        """The node index of the logit for vocab id ``token`` (default: the most probable)."""
        if not self.n_logits:
            raise InputError("this graph has no logit nodes to attribute to; build it with attribution_graph")
        if token is None:
            return self.start("logit")
        hit = (self.logit_tokens == require_integer(token, "logit (a vocab id)", low=0)).nonzero().flatten()
        if not len(hit):
            raise InputError(
                f"token {token}: no logit node ({self.logit_tokens.tolist()}); raise max_logits or logit_prob"
            )
        return self.start("logit") + int(hit[0])

    def select(self, keep: torch.Tensor, adjacency: torch.Tensor | None = None) -> AttributionGraph:
        """The graph of the nodes ``keep`` (a (n,) bool mask) marks, with ``adjacency`` (default this
        one's) restricted to them."""
        keep = torch.as_tensor(keep, dtype=torch.bool)
        if keep.shape != (self.n_nodes,):
            raise InputError(
                f"select takes a bool mask of shape ({self.n_nodes},), one per node; got {tuple(keep.shape)}"
            )
        a = self.adjacency if adjacency is None else adjacency
        f, e, m = self.start("error"), self.start("embedding"), self.start("logit")
        parts = {
            "adjacency": a[keep][:, keep],
            "features": self.features[keep[:f]],
            "activations": self.activations[keep[:f]],
            "errors": self.errors[keep[f:e]],
            "embeddings": self.embeddings[keep[e:m]],
            "logit_tokens": self.logit_tokens[keep[m:]],
            "logit_probs": self.logit_probs[keep[m:]],
            "logit_strings": [s for s, k in zip(self.logit_strings, keep[m:].tolist()) if k],
            "values": self.values[keep],
            "constant": self.constant[keep],
            "influence": None if self.influence is None else self.influence[keep],
        }
        kept = {x.name: getattr(self, x.name) for x in fields(self) if x.name not in parts}
        return AttributionGraph(**parts, **kept)


class LocalReplacement:
    """The local replacement model of one prompt (see the module's docstring), as hooks on
    ``vlm.hf``. The clean run is recorded at construction: ``embed`` (1, seq, d_model), per layer the
    MLP input ``x[l]``, output ``y[l]``, pre-activations ``pre[l]``, activations ``act[l]``, error
    ``error[l]`` and the constant write ``writes[l]`` (``y − x @ W_skip.T``); ``logits`` at the last
    position. `run` replays the frozen model with any embeddings and writes."""

    def __init__(self, vlm: VLM, transcoders: TranscoderSet, sample):
        check_graphable(vlm, transcoders, sample, "LocalReplacement")
        self.vlm, self.transcoders, self.sample, arch, hf = vlm, transcoders, sample, vlm.arch, vlm.hf
        self.n_layers, self._batches = arch.n_layers, {}
        self.batch = self.prepared(1)
        self.unembed = module_of(hf, arch.lm_head).weight.detach()
        self._record()

    def prepared(self, rows: int) -> Batch:
        """The prompt prepared ``rows`` times (one batch row per copy)."""
        if rows not in self._batches:
            self._batches[rows] = self.vlm.prepare_samples([self.sample] * rows)
        return self._batches[rows]

    @torch.no_grad()
    def _record(self) -> None:
        arch, mlp_in, mlp_out, embed = self.vlm.arch, {}, {}, {}

        def keep_mlp(layer):
            return lambda m, args, kwargs, out: (
                mlp_in.update({layer: first_arg(args, kwargs)}) or mlp_out.update({layer: out})
            )

        self.clamp = Clamp()
        hooks = [*self.clamp.hooks(self.vlm), Hook(arch.layer(0), "input", lambda x: embed.update({0: x}))]
        hooks += [Hook(arch.mlp(layer), "after", keep_mlp(layer)) for layer in range(self.n_layers)]
        with hooked(self.vlm.hf, hooks):
            out = self.vlm.hf(**self.batch.inputs, use_cache=False, logits_to_keep=1)
        self.embed = embed[0].detach()
        self.clamp.close(self.vlm)
        self.x, self.y, self.pre, self.act, self.error, self.writes = {}, {}, {}, {}, {}, {}
        for layer, tc in self.transcoders.items():
            x, y = mlp_in[layer].to(tc.dtype), mlp_out[layer].to(tc.dtype)
            self.x[layer], self.y[layer] = x, y
            self.pre[layer] = tc.pre_activations(x)
            self.act[layer] = tc.activation_function(self.pre[layer])
            self.error[layer] = y - tc.decode(self.act[layer], x)
            self.writes[layer] = y - (x @ tc.W_skip.T if tc.W_skip is not None else 0)
        self.logits = out.logits[0, -1].detach().float()

    @contextmanager
    def _hooks(self, embed: torch.Tensor, writes: dict[int, torch.Tensor], got: dict) -> Iterator[None]:
        """The frozen model (the clean run's norm scales and attention, `countlens.circuits.engine.freeze.frozen`)
        on ``embed``, each MLP writing ``writes`` plus its skip path; the final norm's output and the MLP
        inputs kept in ``got``."""
        arch = self.vlm.arch

        def mlp(layer):
            tc = self.transcoders.layer(layer)

            def hook(m, args, kwargs, out):
                x = first_arg(args, kwargs)
                got.setdefault("mlp_in", {})[layer] = x
                skip = x.to(tc.dtype) @ tc.W_skip.T if tc.W_skip is not None else 0
                return (writes[layer] + skip).to(out.dtype)

            return hook

        hooks = [Hook(arch.layer(0), "input", lambda x: embed)]
        hooks += [Hook(arch.mlp(layer), "after", mlp(layer)) for layer in range(self.n_layers)]
        hooks.append(Hook(arch.final_norm, "output", lambda y: got.update(final=y)))  # after frozen's own hook
        weights = [p for p in self.vlm.hf.parameters() if p.requires_grad]  # no graph for their gradients
        try:
            for p in weights:
                p.requires_grad_(False)
            with frozen(self.vlm, norms=self.clamp, attention=self.clamp), hooked(self.vlm.hf, hooks):
                yield
        finally:
            for p in weights:
                p.requires_grad_(True)

    def run(self, embed: torch.Tensor | None = None, writes: dict[int, torch.Tensor] | None = None) -> dict:
        """The frozen model on ``embed`` (rows, seq, d_model; default the clean one) and ``writes`` (per
        layer, what the MLP writes besides its skip path; default the clean ones): a dict with
        ``mlp_in`` (per layer, the MLP inputs) and ``final`` (the final norm's output). Gradients flow
        when the inputs require them."""
        embed = self.embed if embed is None else embed
        writes = self.writes if writes is None else {**self.writes, **writes}
        got: dict = {}
        with self._hooks(embed, writes, got):
            self.vlm.hf(**self.prepared(embed.shape[0]).inputs, use_cache=False, logits_to_keep=1)
        return got

    def constant_writes(self) -> dict[int, torch.Tensor]:
        """Per layer, the writes with every source removed: ``b_dec`` at every position."""
        return {
            layer: self.transcoders.layer(layer).b_dec.detach().expand_as(w).clone() for layer, w in self.writes.items()
        }

    def demeaned(self, tokens: torch.Tensor) -> torch.Tensor:
        """(len(tokens), d_model): ``W_U[v] − mean_u W_U[u]``, the direction a demeaned logit reads."""
        return self.unembed[tokens].float() - self.unembed.mean(0, dtype=torch.float32)


def attribution_graph(
    vlm: VLM,
    transcoders: TranscoderSet,
    sample,
    max_logits: int = 10,
    logit_prob: float = 0.95,
    max_features: int | None = None,
    batch_size: int = 64,
    update_interval: int = UPDATE_INTERVAL,
) -> AttributionGraph:
    """The attribution graph of ``sample`` (one sample: an image, a question, an answer) under the
    local replacement model of ``transcoders`` (a set covering every layer of ``vlm``); see the
    module's docstring. ``max_logits`` / ``logit_prob``: logit nodes are the most probable tokens
    until their probabilities sum to ``logit_prob``, at most ``max_logits``. ``max_features``: keep that
    many features, chosen as circuit-tracer's ``max_feature_nodes`` (every ``update_interval`` ×
    ``batch_size`` rows, the unvisited features of largest `partial_influence` on the logits); the
    dropped features' edges are lost. At or above the active count: all; above what could be active
    (layers × tokens × k for TopK): refused. ``batch_size``: target rows per backward."""
    check_graphable(vlm, transcoders, sample, "attribution_graph")
    require_count(max_logits, "max_logits")
    require_share(logit_prob, "logit_prob", above_zero=True)
    require_count(batch_size, "batch_size")
    require_count(update_interval, "update_interval")
    if max_features is not None:
        require_count(max_features, "max_features")
        seq = int(vlm.prepare_samples([sample]).inputs["input_ids"].shape[1])
        most = seq * sum(tc.k or tc.d_transcoder for tc in transcoders)
        if max_features > most:
            raise InputError(
                f"max_features={max_features} is more features than this prompt's {seq} tokens can have active in "
                f"{transcoders.n_layers} layers ({most}); give max_features ≤ {most}, or None for every active feature"
            )

    lr = LocalReplacement(vlm, transcoders, sample)
    parts = {f"activations at layer {la}": a for la, a in lr.act.items()} | {"logits": lr.logits}
    parts |= {f"errors at layer {la}": e for la, e in lr.error.items()}
    bad = [name for name, t in parts.items() if not t.isfinite().all()]
    if bad:  # before any backward: every edge through them would be NaN (and read as a cycle)
        raise InputError(
            f"attribution_graph: the replacement model's {', '.join(bad[:3])} hold NaN or ±inf on this "
            "sample: its transcoders' weights are not finite (load_transcoders refuses such a file; retrain a set "
            "that diverged), or the model overflows in its dtype"
        )
    seq, d = lr.embed.shape[1:]
    top = lr.logits.softmax(-1).sort(descending=True)
    n_logits = min(max_logits, int(torch.searchsorted(top.values.cumsum(0), logit_prob)) + 1)
    logit_tokens, logit_probs = top.indices[:n_logits], top.values[:n_logits]

    layers = list(range(lr.n_layers))
    active = [lr.act[layer][0].nonzero() for layer in layers]  # per layer (position, feature), on its device
    feats = torch.cat([torch.cat([torch.full((len(nz), 1), la), nz.cpu()], 1) for la, nz in enumerate(active)])
    acts = torch.cat([lr.act[la][0][nz[:, 0], nz[:, 1]].detach().float().cpu() for la, nz in enumerate(active)])
    n_f, n_e = len(feats), len(layers) * seq
    n_src = n_f + n_e + seq
    n_keep = n_f if max_features is None else min(max_features, n_f)

    # One frozen forward over batch_size copies, kept for all the backward passes.
    rows = batch_size
    embed = lr.embed.expand(rows, -1, -1).clone().requires_grad_(True)
    writes = {layer: lr.writes[layer].expand(rows, -1, -1).clone().requires_grad_(True) for layer in layers}
    with torch.enable_grad():
        got = lr.run(embed, writes)
    columns = EdgeColumns(lr, active)
    logit_dirs = lr.demeaned(logit_tokens)

    def edges(kind: str, idx: torch.Tensor) -> torch.Tensor:
        """(len(idx), n_src) on the host: one backward for logits ``idx`` or features ``idx``."""
        n, outs, grads = len(idx), [], []
        if kind == "logit":
            g = torch.zeros(rows, seq, d, device=got["final"].device, dtype=got["final"].dtype)
            g[:n, -1] = logit_dirs[idx].to(g)
            outs, grads = [got["final"]], [g]
        for layer in feats[idx, 0].unique().tolist() if kind == "feature" else []:
            here = idx[feats[idx, 0] == layer]
            out = got["mlp_in"][layer]
            g = torch.zeros(rows, seq, d, device=out.device, dtype=out.dtype)
            where = (feats[idx, 0] == layer).nonzero().flatten().to(out.device)
            g[where, feats[here, 1].to(out.device)] = transcoders.layer(layer).W_enc[feats[here, 2]].detach().to(g)
            outs.append(out)
            grads.append(g)
        inputs = [embed, *(writes[layer] for layer in layers)]
        back = torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)
        return columns(back, n).cpu()

    # circuit-tracer's edge_matrix / row_to_node_index: the logit rows, then features as visited.
    buffer = torch.zeros(n_keep + n_logits, n_src)
    row_nodes = torch.zeros(n_keep + n_logits, dtype=torch.long)
    row_sums = torch.zeros(n_keep + n_logits)
    visited = torch.zeros(n_f, dtype=torch.bool)
    st = 0

    def fill(kind: str, idx: torch.Tensor) -> None:
        nonlocal st
        block = edges(kind, idx)
        buffer[st : st + len(idx)] = block
        row_sums[st : st + len(idx)] = block.abs().sum(1)
        row_nodes[st : st + len(idx)] = idx + n_src if kind == "logit" else idx
        st += len(idx)

    with torch.no_grad():
        for chunk in torch.arange(n_logits).split(rows):  # batched like every row: any batch_size ≥ 1 works
            fill("logit", chunk)
        while int(visited.sum()) < n_keep:
            if n_keep == n_f:
                pending = torch.arange(n_f)
            else:
                influences = partial_influence(buffer[:st], row_nodes[:st], logit_probs, n_f, row_sums[:st])
                queue = min(update_interval * rows, n_keep - int(visited.sum()))
                pending = next_features(influences, visited, queue)
            for chunk in pending.split(rows):
                fill("feature", chunk)
                visited[chunk] = True
        got.clear()  # frees the kept forward before the constant's run
        base = lr.run(torch.zeros_like(lr.embed), lr.constant_writes())

    kept = visited.nonzero().flatten()  # node order
    m = len(kept)
    n = m + n_e + seq + n_logits
    target = torch.full((n_f + n_logits,), -1, dtype=torch.long)
    target[kept] = torch.arange(m)
    target[n_f:] = torch.arange(n - n_logits, n)
    cols = torch.cat([kept, torch.arange(n_f, n_src)])
    adjacency = torch.zeros(n, n)
    span = max(1, BLOCK_ELEMENTS // max(n_src, 1))
    for i in range(0, st, span):  # the final adjacency over the kept nodes only, a block of rows at a time
        nodes = row_nodes[i : i + span]
        adjacency[target[torch.where(nodes < n_f, nodes, nodes - n_src + n_f)], : n - n_logits] = buffer[i : i + span][
            :, cols
        ]
    if not adjacency.isfinite().all():
        raise InputError("attribution_graph: edges are NaN or ±inf: the gradients overflow; run the model in float32")
    values = torch.full((n,), float("nan"))
    constant = torch.zeros(n)
    values[:m], constant[:m] = feature_values(lr, base, feats[kept])
    values[n - n_logits :] = (lr.logits[logit_tokens] - lr.logits.mean()).float().cpu()
    constant[n - n_logits :] = (logit_dirs @ base["final"][0, -1].float()).cpu()

    ids = lr.batch.inputs["input_ids"][0].cpu()
    cells, objects = token_positions(lr.batch, sample, seq)
    answer = vlm.answer_ids(sample.answer)[0] if getattr(sample, "answer", None) else -1
    return AttributionGraph(
        adjacency=adjacency,
        features=feats[kept].long(),
        activations=acts[kept],
        errors=torch.tensor([(layer, p) for layer in layers for p in range(seq)]).long(),
        embeddings=torch.arange(seq),
        logit_tokens=logit_tokens.cpu(),
        logit_probs=logit_probs.cpu(),
        values=values.detach(),
        constant=constant.detach(),
        tokens=ids,
        token_strings=vlm.token_strings(ids.tolist()),
        cells=cells,
        objects=objects,
        n_layers=lr.n_layers,
        logit_strings=vlm.token_strings(logit_tokens.tolist()),
        answer_token=int(answer),
        prompt=sample.question,
        scan=transcoders.scan,
    )


class EdgeColumns:
    """One backward's gradients as ``n`` rows of source columns, on the model's and the transcoders'
    devices: each layer's ``a_f W_dec[f]`` (circuit-tracer's scaled decoder vectors, float32) kept
    padded by position, (seq, most active at a position, d_model), for one batched product with its
    write's gradient per layer; each error and embedding vector dotted with its gradient."""

    def __init__(self, lr: LocalReplacement, active: list[torch.Tensor]):
        self.lr, self.slots, self.decoders = lr, [], []
        for layer, nz in enumerate(active):
            tc, seq = lr.transcoders.layer(layer), lr.embed.shape[1]
            a = lr.act[layer][0][nz[:, 0], nz[:, 1]].detach().float()
            counts = torch.bincount(nz[:, 0], minlength=seq)
            slot = torch.arange(len(nz), device=nz.device) - (counts.cumsum(0) - counts)[nz[:, 0]]
            dec = torch.zeros(seq, int(counts.max()) if len(nz) else 0, tc.d_model, device=tc.W_dec.device)
            dec[nz[:, 0], slot] = tc.W_dec.detach()[nz[:, 1]].float() * a[:, None]
            self.slots.append((nz[:, 0], slot))
            self.decoders.append(dec)

    def __call__(self, back, n: int) -> torch.Tensor:
        lr, dev, seq = self.lr, self.lr.embed.device, self.lr.embed.shape[1]
        g_embed, g_writes = back[0], back[1:]
        feature_cols, error_cols = [], []
        for layer, g in enumerate(g_writes):
            dec, (pos, slot) = self.decoders[layer], self.slots[layer]
            if g is None:  # no target reads this layer's write
                feature_cols += [torch.zeros(n, len(pos), device=dev)]
                error_cols += [torch.zeros(n, seq, device=dev)]
                continue
            g = g[:n].float()
            cols = torch.bmm(g.to(dec.device).transpose(0, 1), dec.transpose(1, 2))  # (seq, n, slots)
            feature_cols.append(cols[pos, :, slot].T.to(dev))
            error_cols.append((g * lr.error[layer][0].float()).sum(-1))
        embed_cols = torch.zeros(n, seq, device=dev) if g_embed is None else (g_embed[:n].float() * lr.embed[0]).sum(-1)
        return torch.cat([*feature_cols, *error_cols, embed_cols], 1)


def feature_values(lr: LocalReplacement, base: dict, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, constant) of features ``kept`` ((m, 3): layer, position, feature): the clean pre-activation,
    ``b_enc + W_enc · x`` at the all-sources-zero run's MLP input."""
    values, constant = torch.zeros(len(kept)), torch.zeros(len(kept))
    for layer in kept[:, 0].unique().tolist():
        here = (kept[:, 0] == layer).nonzero().flatten()
        tc = lr.transcoders.layer(layer)
        p, f = kept[here, 1].to(tc.W_enc.device), kept[here, 2].to(tc.W_enc.device)
        values[here] = lr.pre[layer][0, p, f].detach().float().cpu()
        x = base["mlp_in"][layer][0, p].to(tc.W_enc)
        constant[here] = (tc.b_enc[f] + (tc.W_enc[f] * x).sum(-1)).detach().float().cpu()
    return values, constant


def token_positions(batch: Batch, sample, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: the image token's cell (row, col), and the object it belongs to
    (`countlens.circuits.sites.positions.Objects`: coverage ≥ 0.25 of the cell, or the object's peak cell;
    where several objects claim a token, the lowest index); −1 elsewhere."""
    cells = torch.full((seq, 2), -1, dtype=torch.long)
    objects = torch.full((seq,), -1, dtype=torch.long)
    pos = batch.image_pos[0]
    cells[pos] = batch.image_cell[0].long()
    scene_objects = getattr(getattr(sample, "scene", None), "objects", None) or ()
    for i in reversed(range(len(scene_objects))):
        objects[Objects(i).tokens(batch, 0, sample)] = i
    return cells, objects
