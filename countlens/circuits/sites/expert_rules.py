"""How a mixture-of-experts layer combines its experts: the two rules (`countlens.model.arch.MoESpec.rule`).

Expert e's **contribution** to token t is what it adds to the experts module's output there. The
rules differ in where that contribution can be seen, so in how it is recorded, read, replaced and
routed:

- `WeightedOutputs` (Qwen3-VL-MoE): out(x_t) = Σ_j w_j(t) · E_{i_j(t)}(x_t) over the flattened tokens.
  A contribution is not a tensor of the forward: it is computed from the experts module's input
  (x, top-k index, top-k weights) with the module's own weights (`expert_contribution`), and
  replaced by subtracting it from the output and adding the new one.
- `ScaledInputs` (Llama 4): every expert runs on every token, its input scaled by the routing weight
  (0 off the top-k), and the module returns (experts · tokens, d): the contribution is row e·T + t
  of the output, recorded and overwritten as it is.

`expert_rule` is the one place that turns the spec's rule name into its class; everything else asks
the rule object. Inside a trace (the methods that take an envoy) the tensors are nnsight proxies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from jaxtyping import Bool, Float

    from countlens.model.arch import Arch
    from countlens.model.vlm import VLM

#: One expert's new contribution inside a trace: the flattened tokens it covers (a replica's row ·
#: seq + position), the expert, and its value there, made on the device the write asks for.
ExpertWrite = tuple[Tensor, int, Callable[[torch.device], Tensor]]


def expert_contribution(
    experts, x: Float[Tensor, "tokens d_model"], index: Tensor, weights: Tensor, expert: int
) -> Float[Tensor, "tokens d_model"]:
    """Expert ``expert``'s contribution to each token under the weighted-outputs rule: its routing
    weight there (``weights`` where ``index`` chose it, Int and Float[Tensor, "tokens top_k"]; 0
    elsewhere) times its output on x, computed from the experts module's own stacked weights."""
    weight = (weights * (index == expert)).sum(-1, keepdim=True)
    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
    out = torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[expert])
    return (out * weight.to(out.dtype)).to(x.dtype)


class WeightedOutputs:
    """The experts module is called as ``experts(x, top_k_index, top_k_weights)`` and returns Σ_j w_j · E_{i_j}(x)."""

    name: ClassVar[str] = "weighted_outputs"

    def record(self, experts) -> tuple:
        """Inside a trace: what the contributions are computed from, (x, top-k index, top-k weights)."""
        return tuple(t.save() for t in experts.inputs[0][:3])

    def per_token(self, saved: tuple, rows: int, seq: int, n_experts: int) -> tuple:
        """`record`'s tensors as (rows, seq, …) each."""
        return tuple(t.view(rows, seq, -1) for t in saved)

    def cached(
        self, module, recorded: tuple, expert: int, b: Tensor, s: Tensor, device: torch.device
    ) -> Float[Tensor, "k d_model"]:
        """``expert``'s contribution in a recorded run (`per_token`) at rows b, positions s, on ``device``."""
        x, index, weights = (t[b.to(t.device), s.to(t.device)].to(device) for t in recorded)
        return expert_contribution(module, x, index, weights, expert)

    def write(self, module, experts, n_experts: int, writes: Sequence[ExpertWrite]) -> None:
        """Inside a trace: each write's expert's contribution at its tokens replaced by its value (the
        contribution is no tensor of the forward: take the current one off the output, add the new one)."""
        x, index, weights = experts.inputs[0][:3]
        out = experts.output
        for tokens, expert, value in writes:
            tokens = tokens.to(out.device)
            mine = expert_contribution(module, x[tokens], index[tokens], weights[tokens], expert)
            out[tokens] = out[tokens] - mine + value(out.device).to(out.device, out.dtype)

    def record_routing(self, vlm: VLM, layer: int) -> tuple:
        """Inside a trace: the router's choice as the experts module receives it, (top-k index, weights)."""
        args = vlm.module(vlm.arch.experts(layer)).inputs[0]
        return args[1].save(), args[2].save()

    def chosen(self, saved: tuple, top_k: int) -> tuple[Tensor, Tensor]:
        """`record_routing`'s tensors as (top-k index, top-k weights)."""
        return saved

    def add_group_sum(
        self, module, recorded: tuple, mask: Bool[Tensor, "batch seq"], sums: Float[Tensor, "experts d_model"]
    ) -> None:
        """Add each expert's contributions over the masked tokens of a recorded run to ``sums``."""
        x, index, weights = recorded
        m = mask.to(x.device)
        for e in index[m].unique().tolist():  # experts never chosen in the group add nothing
            c = expert_contribution(module, x[m], index[m], weights[m], e)
            sums[e] += c.double().sum(0).cpu()


class ScaledInputs:
    """The experts module runs every expert on its routing-weighted input and returns (experts · tokens, d)."""

    name: ClassVar[str] = "scaled_inputs"

    def record(self, experts) -> tuple:
        """Inside a trace: every expert's contribution, the module's output (experts · tokens, d)."""
        return (experts.output.save(),)

    def per_token(self, saved: tuple, rows: int, seq: int, n_experts: int) -> tuple:
        """`record`'s output as (experts, rows, seq, d)."""
        return (saved[0].view(n_experts, rows, seq, -1),)

    def cached(
        self, module, recorded: tuple, expert: int, b: Tensor, s: Tensor, device: torch.device
    ) -> Float[Tensor, "k d_model"]:
        """``expert``'s contribution in a recorded run (`per_token`) at rows b, positions s, on ``device``."""
        every = recorded[0][expert]
        return every[b.to(every.device), s.to(every.device)].to(device)

    def write(self, module, experts, n_experts: int, writes: Sequence[ExpertWrite]) -> None:
        """Inside a trace: each write's expert's rows at its tokens overwritten by its value."""
        out = experts.output.view(n_experts, -1, experts.output.shape[-1])
        for tokens, expert, value in writes:
            out[expert, tokens.to(out.device)] = value(out.device).to(out.device, out.dtype)

    def record_routing(self, vlm: VLM, layer: int) -> tuple:
        """Inside a trace: the router's (weights over every expert, logits)."""
        out = vlm.module(vlm.arch.router(layer)).output
        return out[0].save(), out[1].save()

    def chosen(self, saved: tuple, top_k: int) -> tuple[Tensor, Tensor]:
        """The top-k experts by logit, and their (sigmoid) weights."""
        weights, logits = saved
        index = logits.topk(top_k, -1).indices
        return index, weights.gather(-1, index)

    def add_group_sum(
        self, module, recorded: tuple, mask: Bool[Tensor, "batch seq"], sums: Float[Tensor, "experts d_model"]
    ) -> None:
        """Add each expert's contributions over the masked tokens of a recorded run to ``sums``."""
        (every,) = recorded
        sums += every[:, mask.to(every.device)].double().sum(1).cpu()


Rule = WeightedOutputs | ScaledInputs

_RULES: dict[str, Rule] = {rule.name: rule for rule in (WeightedOutputs(), ScaledInputs())}


def expert_rule(arch: Arch) -> Rule:
    """The rule of ``arch``'s MoE layers."""
    return _RULES[arch.spec.moe.rule]
