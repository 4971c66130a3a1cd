"""Attribution graphs: which features, through which others, make the model's answer on one prompt.

An attribution graph (Ameisen et al. 2025, "Circuit Tracing"; decoderesearch/circuit-tracer) is built
on the **local replacement model** of one prompt: the model with

- every **attention pattern frozen** at the clean run (countlens replays each layer's clean ``q_proj``
  and ``k_proj`` outputs, so softmax(q·k) is a constant and attention is linear in its values);
- every **RMSNorm scale frozen**: ``norm(x) = weight · x · s`` with ``s = 1/rms(x_clean)`` a constant;
- every **MLP replaced** by its transcoder's reconstruction plus the clean run's **error term**
  ``y − ŷ``, both held constant: a layer's MLP output is ``Σ_f a_f W_dec[f] + b_dec + error`` (plus
  the skip path ``x @ W_skip.T``, which stays live, for a transcoder with one).

At the clean input this model computes exactly what the model computes, and it is *affine* in its
**sources**: each active feature's write ``a_f · W_dec[f]`` at its layer's MLP output and position,
each (layer, position)'s error vector there, and each position's input embedding (the input of
decoder layer 0: token embeddings, image tokens' projected vision features). What is left — ``b_dec``,
the value projections' biases through the frozen patterns — is a constant no node carries.

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
paths. Because the model is affine, each target row sums to its value: ``value_t = Σ_s A[t, s] +
constant_t`` (the graph stores ``values`` and ``constant``; ``constant_t`` is read from a run with
every source zero). Error and embedding rows are empty: they are sources only.

**Computation.** One forward of the frozen model over ``batch_size`` copies of the prompt, kept for
many backward passes: each backward injects one target's gradient per copy (a feature's encoder row at
its MLP input and position, or a logit's demeaned unembedding at the last position), so a backward
fills ``batch_size`` rows of ``A``. **Positions**: all, none zeroed (circuit-tracer zeroes the BOS
position's sources; the organism's prompts have no BOS, and countlens keeps every position).
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
from countlens.features.influence import feature_order
from countlens.features.replacement import check_graphable
from countlens.features.transcoder import TranscoderSet
from countlens.validate import require_count, require_share

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
        if token is None:
            return self.start("logit")
        hit = (self.logit_tokens == int(token)).nonzero().flatten()
        if not len(hit):
            raise InputError(
                f"token {token} is no logit node of this graph (its logits are {self.logit_tokens.tolist()}); "
                "raise max_logits / logit_prob"
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
            out = self.vlm.hf(**self.batch.inputs, use_cache=False)
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
        with frozen(self.vlm, norms=self.clamp, attention=self.clamp), hooked(self.vlm.hf, hooks):
            yield

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
        return self.unembed[tokens].float() - self.unembed.float().mean(0)


def attribution_graph(
    vlm: VLM,
    transcoders: TranscoderSet,
    sample,
    max_logits: int = 10,
    logit_prob: float = 0.95,
    max_features: int | None = None,
    batch_size: int = 64,
) -> AttributionGraph:
    """The attribution graph of ``sample`` (one sample: an image, a question, an answer) under the
    local replacement model of ``transcoders`` (a set covering every layer of ``vlm``); see the
    module's docstring. ``max_logits`` / ``logit_prob``: logit nodes are the most probable tokens
    until their probabilities sum to ``logit_prob``, at most ``max_logits``. ``max_features``: keep
    only that many features, chosen as circuit-tracer does (repeatedly, the unvisited features of
    largest influence on the logits through the rows computed so far); the dropped features' edges
    are lost, so rows no longer sum to their values. ``batch_size``: target rows per backward."""
    check_graphable(vlm, transcoders, sample, "attribution_graph")
    require_count(max_logits, "max_logits")
    require_share(logit_prob, "logit_prob", above_zero=True)
    if max_features is not None:
        require_count(max_features, "max_features")
    require_count(batch_size, "batch_size")

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
    probs = lr.logits.softmax(-1)
    top = probs.sort(descending=True)
    n_logits = min(max_logits, int(torch.searchsorted(top.values.cumsum(0), logit_prob)) + 1)
    logit_tokens, logit_probs = top.indices[:n_logits], top.values[:n_logits]

    layers = list(range(lr.n_layers))
    feats = torch.cat(
        [
            torch.cat([torch.full((len(nz), 1), layer), nz], 1)
            for layer in layers
            for nz in [lr.act[layer][0].nonzero().cpu()]
        ]
    )
    acts = (
        torch.stack([lr.act[int(layer)][0, p, f] for layer, p, f in feats.tolist()]).detach().float().cpu()
        if len(feats)
        else torch.zeros(0)
    )
    n_f, n_e = len(feats), len(layers) * seq
    n_src = n_f + n_e + seq

    # One frozen forward over batch_size copies, kept for all the backward passes.
    rows = batch_size
    embed = lr.embed.expand(rows, -1, -1).clone().requires_grad_(True)
    writes = {layer: lr.writes[layer].expand(rows, -1, -1).clone().requires_grad_(True) for layer in layers}
    with torch.enable_grad():
        got = lr.run(embed, writes)
    dev = embed.device  # the model's: gradients are injected there, rows gathered on the CPU

    def edges(targets: list[tuple]) -> torch.Tensor:
        """(len(targets), n_src): one backward; a target is ("logit", vocab id) or ("feature", l, p, f)."""
        outs, grads = [], []
        g_in = {}
        g_fin = None
        for r, t in enumerate(targets):
            if t[0] == "logit":
                g_fin = torch.zeros(rows, seq, d, device=dev) if g_fin is None else g_fin
                g_fin[r, -1] = lr.demeaned(torch.tensor([t[1]], device=lr.unembed.device))[0].to(dev)
            else:
                _, layer, p, f = t
                g = g_in.setdefault(layer, torch.zeros(rows, seq, d, device=dev))
                g[r, p] = transcoders.layer(layer).W_enc[f].detach().to(dev)
        for layer, g in g_in.items():
            outs.append(got["mlp_in"][layer])
            grads.append(g.to(got["mlp_in"][layer].dtype))
        if g_fin is not None:
            outs.append(got["final"])
            grads.append(g_fin.to(got["final"].dtype))
        inputs = [embed, *(writes[layer] for layer in layers)]
        back = torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)
        back = [torch.zeros_like(x) if g is None else g for g, x in zip(back, inputs)]
        n = len(targets)
        g_embed, g_writes = back[0][:n].float().cpu(), [g[:n].float().cpu() for g in back[1:]]
        cols = []
        for layer in layers:
            tc = transcoders.layer(layer)
            here = feats[:, 0] == layer
            through = g_writes[layer] @ tc.W_dec.detach().float().cpu().T  # (n, seq, width)
            cols.append(through[:, feats[here, 1], feats[here, 2]] * acts[here].float())
        cols += [(g_writes[layer] * lr.error[layer].float().cpu()).sum(-1) for layer in layers]
        cols.append((g_embed * lr.embed.float().cpu()).sum(-1))
        return torch.cat(cols, 1)

    with torch.no_grad():
        # Logit rows in chunks of the forward's rows, as every other row: any batch_size ≥ 1 works.
        logit_targets = [("logit", int(v)) for v in logit_tokens]
        logit_rows = torch.cat([edges(logit_targets[i : i + rows]) for i in range(0, n_logits, rows)])
        feature_rows = torch.zeros(n_f, n_src)
        order = feature_order(logit_rows, logit_probs, n_f, max_features, rows)
        visited = torch.zeros(n_f, dtype=torch.bool)
        for chunk in order:
            if callable(chunk):
                chunk = chunk(feature_rows, visited)
            if not len(chunk):
                break
            feature_rows[chunk] = edges([("feature", *feats[j].tolist()) for j in chunk])
            visited[chunk] = True
        base = lr.run(torch.zeros_like(lr.embed), lr.constant_writes())

    n = n_src + n_logits
    adjacency = torch.zeros(n, n)
    adjacency[:n_f, :n_src] = feature_rows
    adjacency[n_src:, :n_src] = logit_rows
    if not adjacency.isfinite().all():
        raise InputError("attribution_graph: edges are NaN or ±inf: the gradients overflow; run the model in float32")
    values = torch.full((n,), float("nan"))
    constant = torch.zeros(n)
    for j, (layer, p, f) in enumerate(feats.tolist()):
        tc = transcoders.layer(layer)
        values[j] = float(lr.pre[layer][0, p, f])
        constant[j] = float((tc.b_enc[f] + tc.W_enc[f] @ base["mlp_in"][layer][0, p].to(tc.W_enc)).detach())
    values[n_src:] = (lr.logits[logit_tokens] - lr.logits.mean()).float().cpu()
    constant[n_src:] = (lr.demeaned(logit_tokens) @ base["final"][0, -1].float()).cpu()

    ids = lr.batch.inputs["input_ids"][0].cpu()
    cells, objects = token_positions(lr.batch, sample, seq)
    answer = vlm.answer_ids(sample.answer)[0] if getattr(sample, "answer", None) else -1
    graph = AttributionGraph(
        adjacency=adjacency,
        features=feats.long(),
        activations=acts.detach().float(),
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
    if max_features is not None and n_f > max_features:
        keep = torch.ones(n, dtype=torch.bool)
        keep[:n_f] = visited
        graph = graph.select(keep)
    return graph


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
