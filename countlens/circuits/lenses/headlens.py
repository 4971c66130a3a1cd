"""HeadLens: decode what each attention head writes, in the vocabulary.

Multi-head attention is additive: with z_i head i's output (d_head) and W_O split by heads, the
layer writes x̂ = Σ_i z_i·W_O,i (+ o_proj bias) — each term ĥ_i = z_i·W_O,i is head i's own
contribution to the residual stream. What a layer writes is transformed by the layers above before
the unembedding reads it, so HeadLens learns, per layer, an affine map T(x) = A·x + b from the
layer's attention output x̂ to the final residual stream (the last layer's output, before the final
norm), and decodes a head as logits_i = U·norm(T(ĥ_i)) — the model's own final norm and unembedding.

Fit: ridge least squares on every real token position of a fitting set, in closed form (one solve
per layer, deterministic; λ is relative to the mean eigenvalue of XᵀX, default 1e-2). R² is reported
per layer on a held-out fifth of the positions. Both come from float64 sums accumulated batch by
batch (XᵀX, Xᵀy, Σx, Σy, Σ|y|², for the fitting and the held-out positions), so the host keeps
4·d_model² numbers per layer, not the positions (a 7B model's default fit: 11.7 GiB instead of 94).
Scores per head, over the decoded top-k tokens at the last prompt position, averaged over samples:
VGS — the share of visual-attribute words (colours, shapes, geometry; `VISUAL_WORDS`, configurable)
— CTER — the share of number tokens (digits and number words) — and difficulty — the share of words
that say a count is hard (`DIFFICULTY_WORDS`: the paper's awareness heads write "difficult",
"impossible" at large counts). Each sample's ``count_token`` (the first token of its count written
as a number) lets a head's top-1 token be compared with the count
(`countlens.analysis.heads.head_table`'s alignment).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens.circuits.sites import head_contributions
from countlens.errors import InputError
from countlens.model.adapt import module_of
from countlens.model.arguments import require_layers, require_vlm
from countlens.model.vlm import check_samples
from countlens.results import provenance
from countlens.validate import require_count

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.model.vlm import VLM

VISUAL_WORDS: frozenset[str] = frozenset(
    "red green blue yellow purple orange black white gray grey pink brown color colour colors colours "
    "circle circles square squares triangle triangles dot dots shape shapes round ball balls box rectangle "
    "line lines edge edges corner corners left right top bottom middle center centre big small large tiny "
    "above below side".split()
)
NUMBER_WORDS: frozenset[str] = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty".split()
)


#: Words that report a count as hard rather than give it (countlens's own list, after the paper's examples).
DIFFICULTY_WORDS: frozenset[str] = frozenset(
    "difficult difficulty impossible hard many numerous countless several unclear uncertain unknown "
    "lots multiple various crowded".split()
)


def _clean(token: str) -> str:
    return re.sub(r"^[\sĠ▁]+", "", token).lower()


def is_number(token: str) -> bool:
    t = _clean(token)
    return t.isdigit() or t in NUMBER_WORDS


@dataclass
class HeadLens:
    """Per-layer affine maps to the final residual stream; `decode` reads every head through them."""

    layers: list[int]
    A: Float[Tensor, "layer d_model d_model"]
    b: Float[Tensor, "layer d_model"]
    r2: Float[Tensor, " layer"]  # held-out
    model: str = ""
    # Where the maps came from: the model, the fit samples' recipe, the ridge (`countlens.results.provenance`).
    fitted: dict = field(default_factory=dict)

    @classmethod
    @torch.no_grad()
    def fit(
        cls, vlm: VLM, samples: Sequence, layers: Sequence[int] | None = None, ridge: float = 1e-2, batch_size: int = 16
    ) -> HeadLens:
        require_vlm(vlm, "HeadLens.fit")
        check_samples(samples, "HeadLens.fit")
        require_count(batch_size, "batch_size")
        arch = vlm.arch
        layers = require_layers(vlm, layers, "HeadLens.fit")
        layers = list(range(arch.n_layers)) if layers is None else sorted(set(layers))
        chunks = [samples[i : i + batch_size] for i in range(0, len(samples), batch_size)]
        # The held-out fifth is drawn over all positions at once, so a first, forward-free pass counts them.
        sizes = [int(vlm.prepare_samples(c).inputs["attention_mask"].sum()) for c in chunks]
        n = sum(sizes)
        if n < 10:
            raise InputError(f"HeadLens.fit got only {n} token positions; give more samples")
        held = torch.zeros(n, dtype=torch.bool)
        held[torch.randperm(n, generator=torch.Generator().manual_seed(0))[: max(1, n // 5)]] = True
        # Sums over positions, not the positions: a layer keeps d_model² numbers, whatever the data size.
        fit = {layer: _Moments() for layer in layers}
        test = {layer: _Moments() for layer in layers}
        offset = 0
        for chunk in chunks:
            batch = vlm.prepare_samples(chunk)
            real = batch.inputs["attention_mask"].bool()
            outs = {}
            with vlm.read(batch):
                for layer in layers:
                    outs[layer] = vlm.module(arch.o_proj(layer)).output.save()
                final = vlm.module(arch.layer(arch.n_layers - 1)).output.save()
            y = final[real.to(final.device)].double().cpu()
            part = held[offset : offset + len(y)]
            offset += len(y)
            for layer in layers:
                x = outs[layer][real.to(outs[layer].device)].double().cpu()
                fit[layer].add(x[~part], y[~part])
                test[layer].add(x[part], y[part])
            del outs, final
        d = arch.d_model
        a_all, b_all, r2_all = torch.empty(len(layers), d, d), torch.empty(len(layers), d), []
        for i, layer in enumerate(layers):  # each layer's sums are let go once it is solved
            a, b = fit.pop(layer).ridge(ridge)
            a_all[i], b_all[i] = a, b
            r2_all.append(test.pop(layer).r2(a, b))
        fitted = provenance(
            vlm.name, arch.name, dataset={"samples": len(samples)}, samples=samples, method="HeadLens.fit", ridge=ridge
        )
        return cls(layers, a_all, b_all, torch.tensor(r2_all), vlm.name, fitted)

    def r2_array(self) -> xr.DataArray:
        """Each layer's held-out R² of its map, with the fit's provenance."""
        return xr.DataArray(
            self.r2.numpy(), dims=("layer",), coords={"layer": self.layers}, name="r2", attrs=dict(self.fitted)
        )

    @torch.no_grad()
    def head_logits(
        self, vlm: VLM, layer: int, z: Float[Tensor, "... n_heads*d_head"], bias: bool = True
    ) -> Float[Tensor, "... n_heads vocab"]:
        """Each head's decoded logits from its z."""
        i = self.layers.index(layer)
        contrib = head_contributions(vlm, layer, z.float().to(self.A.device))  # ... heads d_model
        mapped = contrib @ self.A[i].T + (self.b[i] if bias else 0.0)
        norm = module_of(vlm.hf, vlm.arch.final_norm)
        head = module_of(vlm.hf, vlm.arch.lm_head)
        dtype = head.weight.dtype
        return head(norm(mapped.to(head.weight.device, dtype))).float()

    @torch.no_grad()
    def decode(
        self,
        vlm: VLM,
        samples: Sequence,
        top_k: int = 10,
        batch_size: int = 16,
        visual_words: frozenset[str] = VISUAL_WORDS,
        bias: bool = True,
    ) -> xr.Dataset:
        """Top-k decoded tokens per (layer, head, sample) at the last prompt position; per head
        ``vgs`` / ``cter`` / ``difficulty`` (shares of visual-attribute, number and difficulty tokens,
        averaged over samples); per sample ``count_token``, the first token of its count (−1 for a
        sample without one)."""
        check_samples(samples, "HeadLens.decode")
        arch = vlm.arch
        top_ids = []
        for _, batch in vlm.batches(samples, batch_size):
            zs = {}
            with vlm.read(batch):
                for layer in self.layers:
                    zs[layer] = vlm.module(arch.o_proj(layer)).input[:, -1].save()
            # Each layer's own heads; beyond them (a layer with fewer heads than the widest) id −1.
            per_layer = torch.full((len(self.layers), len(batch), arch.n_heads, top_k), -1)
            for i, layer in enumerate(self.layers):
                top = self.head_logits(vlm, layer, zs[layer], bias).topk(top_k, -1).indices.cpu()
                per_layer[i, :, : top.shape[1]] = top
            top_ids.append(per_layer)  # layer batch heads k
        ids = torch.cat(top_ids, 1).permute(0, 2, 1, 3).numpy()  # layer head sample k
        vocab = vlm.token_strings(range(int(ids.max()) + 1))
        tokens = np.vectorize(lambda i: vocab[i] if i >= 0 else "", otypes=[object])(ids)
        visual = np.vectorize(lambda t: _clean(t) in visual_words, otypes=[bool])(tokens)
        number = np.vectorize(is_number, otypes=[bool])(tokens)
        hard = np.vectorize(lambda t: _clean(t) in DIFFICULTY_WORDS, otypes=[bool])(tokens)
        head = np.array([[h < arch.heads(layer) for h in range(arch.n_heads)] for layer in self.layers])

        def share(flags: np.ndarray) -> np.ndarray:
            return np.where(head, flags.mean((2, 3)), np.nan)  # NaN: no head there

        counts = [int((s.meta or {}).get("count", -1)) for s in samples]
        count_token = [_first_word_token(vlm, str(n)) if n >= 0 else -1 for n in counts]

        return xr.Dataset(
            {
                "token_id": (("layer", "head", "sample", "k"), ids),
                "token": (("layer", "head", "sample", "k"), tokens.astype(str)),
                "vgs": (("layer", "head"), share(visual)),
                "cter": (("layer", "head"), share(number)),
                "difficulty": (("layer", "head"), share(hard)),
                "count_token": ("sample", np.array(count_token)),
                "r2": ("layer", self.r2.numpy()),
            },
            coords={
                "layer": self.layers,
                "head": np.arange(arch.n_heads),
                "sample": np.arange(len(samples)),
                "k": np.arange(top_k),
                "kind": ("layer", [arch.kind(layer) for layer in self.layers]),
            },
            attrs={
                **provenance(vlm.name, arch.name, dataset={"samples": len(samples)}, samples=samples),
                "method": "headlens",
                "top_k": top_k,
                "bias": int(bias),
            },
        )


def _first_word_token(vlm: VLM, text: str) -> int:
    """The first token of ``text`` that is more than a word marker (SentencePiece may write "7" as
    "▁", "7"): the token a head decoding that number puts first."""
    ids = vlm.answer_ids(text)
    return next((i for i, t in zip(ids, vlm.token_strings(ids)) if _clean(t)), ids[0])


class _Moments:
    """Float64 sums over token positions of x, y, xxᵀ, xyᵀ and |y|²: enough for the ridge fit and R²."""

    def __init__(self) -> None:
        self.n, self.yy = 0, 0.0
        self.sx = self.sy = self.sxx = self.sxy = None

    def add(self, x: Tensor, y: Tensor) -> None:
        """x Float64[Tensor, "pos d_model"], y Float64[Tensor, "pos d_model"]."""
        if self.sxx is None:
            d = x.shape[1]
            self.sx, self.sy = x.new_zeros(d), y.new_zeros(y.shape[1])
            self.sxx, self.sxy = x.new_zeros(d, d), x.new_zeros(d, y.shape[1])
        self.n += len(x)
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.sxx.addmm_(x.T, x)  # in place: no d_model² temporary per batch
        self.sxy.addmm_(x.T, y)
        self.yy += float((y * y).sum())

    def ridge(self, ridge: float) -> tuple[Tensor, Tensor]:
        """A, b minimising |y − (x·Aᵀ + b)|² + λ|A|², with λ = ridge × mean eigenvalue of the centred XᵀX."""
        mx, my = self.sx / self.n, self.sy / self.n
        gram = self.sxx - self.n * torch.outer(mx, mx)
        cross = self.sxy - self.n * torch.outer(mx, my)
        gram.diagonal().add_(ridge * torch.trace(gram) / gram.shape[0])
        a = torch.linalg.solve(gram, cross).T
        return a, my - mx @ a.T

    def r2(self, a: Tensor, b: Tensor) -> float:
        """1 − Σ|y − (Ax + b)|² / Σ|y − ȳ|² over these positions, from the sums alone."""
        a = a.double()
        # tr(A·Sxy) and tr(A·Sxx·Aᵀ) as elementwise sums: one d³ product instead of three.
        resid = (
            self.yy
            - 2 * ((a * self.sxy.T).sum() + b @ self.sy)
            + ((a @ self.sxx) * a).sum()
            + 2 * b @ (a @ self.sx)
            + self.n * b @ b
        )
        total = self.yy - float(self.sy @ self.sy) / self.n
        return float(1 - resid / total)
