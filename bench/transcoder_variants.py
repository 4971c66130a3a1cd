"""Ways to keep a transcoder's features alive, tried on two layers of the organism against
`train_transcoders`'s default: dead features and FVU on the held-out split, and the
training time, for each variant.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/transcoder_variants.py   # writes bench/transcoder_variants.json

The data are `train_transcoders`'s (`DEFAULT_MIX`, seed 0, the same training and held-out tokens, in
memory); the loop is its in-memory loop (the same initialisation, batches and unit-norm decoder rows;
the "variance" and "error" rows reproduce `train_transcoders(vlm, layers=[…], aux_norm=…)`'s held-out
figures), with width 512, k 16, 1500 steps of 512 tokens, lr 2e-3. Layers 0 and 4: the most and the
fewest dead features under ``variance``. The variants:

- ``variance`` — AuxK (dead after 50 steps, k_aux 64, weight 1/32) normalised like the main loss, by
  the outputs' variance (``aux_norm="variance"``);
- ``error`` — AuxK normalised by the batch error's energy ``Σ‖ê − e‖² / Σ‖e‖²`` (``aux_norm="error"``,
  the default);
- ``error_centred`` — divided by the error's variance over the batch, ``Σ‖ê − e‖² / Σ‖e − ē‖²``: the
  ``normalized_mse`` of the AuxK term in openai/sparse_autoencoder's ``train.py`` (Gao et al.'s code);
- ``error_per_token`` — the ratio per token, then averaged (that repository's ``loss.py``
  ``normalized_mean_squared_error``);
- ``error`` with weight 1/16 or 1/4, with k_aux 128, or dead after 20 steps; ``variance`` with weight 1/4;
- ``variance_adam_reset`` — ``variance``, but a feature's Adam second moments are zeroed on the step
  it turns dead (the explanation's check: under ``variance`` the small AuxK gradients were divided by
  the large second moments the main loss left while the feature was alive);
- ``resample`` — Anthropic's resampling ("Towards Monosemanticity", 2023) at steps 250, 500, 750 on top
  of ``variance``: features that did not fire since the last resampling get, from a token drawn with
  probability ∝ the square of its squared error (8,192 candidates), the encoder row (the centred input, at 0.2 of
  the live rows' mean norm; ``_scaled``: at 1.0, with the live features' mean bias) and the decoder row
  (the unit error), their Adam moments zeroed;
- ``data_init`` — the encoder rows started at unit centred training inputs (instead of Gaussian).

One torch thread (the CPUs are shared); ``others_load_cores`` records what other processes used meanwhile.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import countlens
from countlens.features import Transcoder, collect_activations, fvu
from countlens.features.activations import check_mix, held_out_mix, mix_samples

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Load  # noqa: E402

LAYERS = (0, 4)
VARIANTS = {
    "variance": {"aux_norm": "variance"},
    "error": {},
    "error_centred": {"aux_norm": "error_centred"},
    "error_per_token": {"aux_norm": "error_per_token"},
    "error_weight_1/16": {"aux_w": 1 / 16},
    "error_weight_1/4": {"aux_w": 1 / 4},
    "error_k_aux_128": {"aux_k": 128},
    "error_dead_after_20": {"dead_after": 20},
    "variance_weight_1/4": {"aux_norm": "variance", "aux_w": 1 / 4},
    "variance_adam_reset": {"aux_norm": "variance", "adam_reset": True},
    "resample": {"aux_norm": "variance", "resample": (250, 500, 750)},
    "resample_scaled": {"aux_norm": "variance", "resample": (250, 500, 750), "rs_scale": 1.0, "rs_bias": True},
    "data_init": {"aux_norm": "variance", "init": "data"},
}


def train(X, Y, layer, aux_norm="error", aux_k=64, aux_w=1 / 32, dead_after=50, adam_reset=False, resample=(),
          rs_scale=0.2, rs_bias=False, init="gauss", seed=0, width=512, k=16, steps=1500, lr=2e-3, bt=512):  # fmt: skip
    """`train_transcoders`'s in-memory loop for one layer, with the variant's changes."""
    d = X.shape[1]
    mean, scale = Y.mean(0), float(Y.var(0, unbiased=False).sum())
    tc = Transcoder(d, width, "topk", k=k)
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    with torch.no_grad():
        tc.W_enc.copy_(torch.randn(tc.W_enc.shape, generator=g) / d**0.5)
        if init == "data":
            xc = X[torch.randint(len(X), (width,), generator=g)] - X.mean(0)
            tc.W_enc.copy_(xc / xc.norm(dim=1, keepdim=True))
        tc.W_dec.copy_(tc.W_enc / tc.W_enc.norm(dim=1, keepdim=True))
        tc.b_enc.zero_()
        tc.b_dec.copy_(mean)
    opt = torch.optim.Adam(tc.parameters(), lr=lr)
    since = torch.zeros(width, dtype=torch.long)
    fired_since = torch.zeros(width, dtype=torch.bool)
    resampled = 0
    for step in range(1, steps + 1):
        index = torch.randint(len(X), (bt,), generator=g)
        x, y = X[index], Y[index]
        dead = since >= dead_after
        if adam_reset and opt.state:
            for p in (tc.W_enc, tc.b_enc, tc.W_dec):
                opt.state[p]["exp_avg_sq"][since == dead_after] = 0
        opt.zero_grad(set_to_none=True)
        pre = tc.pre_activations(x)
        a = tc.activation_function(pre)
        y_hat = tc.decode(a, x)
        loss = ((y_hat - y) ** 2).sum() / (len(x) * scale)
        total, n_dead = loss, int(dead.sum())
        if n_dead:
            values, idx = pre.masked_fill(~dead, float("-inf")).topk(min(n_dead, aux_k), dim=-1)
            a_aux = torch.zeros_like(pre).scatter(-1, idx, values.relu())
            e = (y - y_hat).detach()
            r2 = (a_aux @ tc.W_dec - e) ** 2
            if aux_norm == "error":
                aux = r2.sum() / (e**2).sum()
            elif aux_norm == "error_centred":
                aux = r2.sum() / ((e - e.mean(0)) ** 2).sum()
            elif aux_norm == "error_per_token":
                aux = (r2.sum(1) / (e**2).sum(1).clamp_min(1e-12)).mean()
            else:
                aux = r2.sum() / (len(x) * scale)
            total = loss + aux_w * aux
        total.backward()
        opt.step()
        with torch.no_grad():
            tc.W_dec /= tc.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-8)
        fired = (a != 0).any(0)
        since = torch.where(fired, 0, since + 1)
        fired_since |= fired
        if step in resample:
            resampled += _resample(tc, opt, X, Y, ~fired_since, g, rs_scale, rs_bias)
            since[~fired_since] = 0
            fired_since[:] = False
    return tc, resampled


@torch.no_grad()
def _resample(tc, opt, X, Y, dead, g, rs_scale, rs_bias) -> int:
    """Anthropic's resampling of the ``dead`` features (the module's docstring); how many."""
    rows = dead.nonzero().squeeze(1)
    if not len(rows):
        return 0
    index = torch.randint(len(X), (8192,), generator=g)
    error = Y[index] - tc(X[index])
    loss = (error**2).sum(1)
    pick = torch.multinomial(loss**2, len(rows), replacement=False, generator=g)
    alive = ~dead
    xc = X[index][pick] - X.mean(0)
    tc.W_enc[rows] = xc / xc.norm(dim=1, keepdim=True) * tc.W_enc[alive].norm(dim=1).mean() * rs_scale
    tc.b_enc[rows] = tc.b_enc[alive].mean() if rs_bias else 0.0
    tc.W_dec[rows] = error[pick] / error[pick].norm(dim=1, keepdim=True)
    for p in (tc.W_enc, tc.b_enc, tc.W_dec):
        opt.state[p]["exp_avg"][rows] = 0
        opt.state[p]["exp_avg_sq"][rows] = 0
    return len(rows)


def main() -> dict:
    torch.set_num_threads(1)
    vlm = countlens.load("toy")
    mix = check_mix(None)
    held = held_out_mix(mix, 0.25)
    tr = collect_activations(vlm, list(LAYERS), *mix_samples(mix, 0))
    te = collect_activations(vlm, list(LAYERS), *mix_samples(held, 0, start=mix))
    rows = {}
    with Load() as load:
        for name, kw in VARIANTS.items():
            rows[name] = {}
            for layer in LAYERS:
                t = time.perf_counter()
                tc, resampled = train(tr.inputs[layer], tr.outputs[layer], layer, **kw)
                seconds = time.perf_counter() - t
                with torch.no_grad():
                    x, y = te.inputs[layer], te.outputs[layer]
                    a = tc.encode(x)
                    row = {"fvu": round(fvu(y, tc.decode(a, x)), 4), "dead": int((a == 0).all(0).sum())}
                    row["dead_on_training_tokens"] = int((tc.encode(tr.inputs[layer]) == 0).all(0).sum())
                row["train_seconds"] = round(seconds, 1)
                if kw.get("resample"):
                    row["resampled"] = resampled
                rows[name][layer] = row
                print(name, layer, row, flush=True)
    return {
        "model": "toy",
        "threads": 1,
        "command": "HF_HUB_OFFLINE=1 .venv/bin/python bench/transcoder_variants.py",
        "settings": {"width": 512, "k": 16, "steps": 1500, "batch_tokens": 512, "lr": 2e-3, "seed": 0},
        "held_out_tokens": te.n_tokens,
        "layers": list(LAYERS),
        "variants": rows,
        "others_load_cores": load.others,
    }


if __name__ == "__main__":
    result = main()
    text = json.dumps(result, indent=2)
    (Path(__file__).resolve().parent / "transcoder_variants.json").write_text(text + "\n")
    print(text)
