"""What each row of ``bench/gpu.py --all`` runs (`gpu_rows` times them, reads their peaks and writes them):
the trace, discover's stages, transcoder steps, the graph, fine-tune steps, and the head sweep beside
the peer's loop. Each takes the (cut) model and the mode's `gpu_rows.Sizes` and returns the row's fields."""

from __future__ import annotations

import tempfile
import time

import torch
from _rehearsal import random_transcoders
from wide_model import interleaved, sync


def trace_row(vlm, pairs, s, device: str) -> dict:
    """P1: an nnsight trace saving the middle layer's output beside the plain forward of the same batch."""
    from countlens.circuits.engine.pair_batch import prepare_pairs

    pb = prepare_pairs(vlm, pairs)
    layer = vlm.arch.layer(vlm.arch.n_layers // 2)

    def plain():
        with torch.no_grad():
            vlm.forward(pb.clean, logits_to_keep=1)

    def traced():
        with torch.no_grad(), vlm.trace(pb.clean, logits_to_keep=1):
            vlm.module(layer).output.save()

    t = interleaved({"plain": plain, "traced": traced}, s.repeats, device, s.warmup)
    rows, seq = (int(x) for x in pb.clean.inputs["input_ids"].shape)
    return {
        "rows": rows,
        "seq": seq,
        "plain_s": round(t["plain"], 4),
        "traced_s": round(t["traced"], 4),
        "ratio": round(t["traced"] / t["plain"], 3),
    }


def discover_rows(rec, vlm, s, device: str, flops_per_s: float) -> None:
    """One row per discover stage: the registry's stages in discover's order, each ``compute`` then its
    ``check`` on one `RunContext`, as discover's own loop runs them (no report, nothing saved but the
    sweeps' chunk stores, in a temporary folder). Planned: `countlens.pipeline.plan.plan` of the same
    configuration here (on a GPU: its whole memory). The stages share one budget (``discover``): the
    stage running when it is spent is stopped, the later ones are recorded as not run."""
    from countlens import distributed
    from countlens.circuits.engine.pair_batch import tolerate_noise
    from countlens.pipeline import plan
    from countlens.pipeline.config import DiscoverConfig, resolved_prompt
    from countlens.pipeline.inputs import stage_inputs
    from countlens.pipeline.stages import STAGES, RunContext

    c = DiscoverConfig(**s.discover)
    memory = torch.cuda.get_device_properties(0).total_memory if device.startswith("cuda") else None
    where = "cuda" if device.startswith("cuda") else "cpu"
    try:  # the plan's rows are another helper's to change: read by stage name, never required
        planned = plan.plan(vlm, c, memory=memory, device=where).to_dict().get("stages", {})
    except Exception as err:  # noqa: BLE001 — recorded in the header; the stages still run
        planned = {}
        rec.record["discover_plan_error"] = f"{type(err).__name__}: {err}"[:600]
    chosen = [st for st in STAGES if st.enabled(c) and (s.stages is None or st.name in s.stages)]
    budget = s.budgets.get("discover")
    end = None if budget is None else time.perf_counter() + budget
    with tempfile.TemporaryDirectory() as out, tolerate_noise():
        prompt = resolved_prompt(vlm, c)
        inputs = stage_inputs(vlm, c, prompt)
        from pathlib import Path

        run = RunContext(vlm, c, prompt, inputs, Path(out), distributed.current(), lambda line: None)
        run.pairs, run.data = inputs["pairs"](), inputs["tasks"]()
        for stage in chosen:
            q = planned.get(stage.name, {})
            flops, peak = q.get("flops"), q.get("peak_bytes")
            left = None if end is None else end - time.perf_counter()
            if left is not None and left <= 0:
                rec.record["rows"].append(
                    {"name": f"discover/{stage.name}", "status": "not_run", "error": "budget spent"}
                )
                rec.failed.append(f"discover/{stage.name}")
                continue

            def one(stage=stage):
                result = stage.compute(run)
                if stage.check is not None:
                    stage.check(run, result)
                run.results[stage.name] = result
                return {"rows": q.get("rows"), "forwards": q.get("forwards"), "planned_flops": flops}

            seconds = None if flops is None else round(flops / flops_per_s, 2)
            rec.row(f"discover/{stage.name}", one, left, (seconds, peak))
    rec.write()


def transcoder_row(vlm, s, device: str) -> dict:
    """A few `train_transcoders` steps at the middle layer (width ``tc_width``, TopK k, a small mix), and
    `countlens.pipeline.transcoder_cost`'s plan of them (its own rates: the CPU's measured, a GPU's
    assumed); planned peak: the model's weights plus the plan's training bytes (on the CPU its host
    bytes too: one memory)."""
    from countlens.features import train_transcoders

    layer = vlm.arch.n_layers // 2
    out: dict = {"layer": layer, "width": s.tc_width, "k": s.k, "steps": s.tc_steps}
    try:  # another helper's module: read by key, never required
        from countlens.model.memory import widths
        from countlens.pipeline.transcoder_cost import mix_forwards, transcoder_cost

        m = mix_forwards(vlm, s.tc_mix)
        gpu = device.startswith("cuda")
        c = transcoder_cost(
            vlm,
            m["tokens"],
            width=s.tc_width,
            k=s.k,
            steps=s.tc_steps,
            layers=1,
            collection_flops=m["flops"],
            device="cuda" if gpu else "cpu",
            seq=m["seq"],
            held_out_tokens=m["held_out_tokens"],
        )
        peak = widths(vlm).weight_bytes + c["device_bytes"] + (0 if gpu else c["host_bytes"])
        out |= {"planned_seconds": c.get("seconds"), "planned_peak_bytes": peak, "tokens": m["tokens"]}
    except Exception as err:  # noqa: BLE001 — the steps still run
        out["plan_error"] = f"{type(err).__name__}: {err}"[:300]
    training = train_transcoders(
        vlm,
        layers=[layer],
        width=s.tc_width,
        k=s.k,
        steps=s.tc_steps,
        mix=s.tc_mix,
        progress=False,
        batch_size=4,
        device=device,
    )
    # train_transcoders trains on the device given and returns the set on the CPU: record what it was given.
    return out | {"fvu": training.fidelity.fvu.values.tolist(), "trained_on": device}


def graph_row(vlm, s, device: str, flops_per_s: float) -> dict:
    """One `attribution_graph` of the 3-object counting scene ``countlens features graph`` draws, with
    ``max_features``, and `graph_cost`'s plan of it (on a GPU its device bytes; on the CPU all bytes)."""
    from countlens.datasets.tasks import count_task_sample
    from countlens.features import attribution_graph
    from countlens.pipeline.graph_cost import graph_cost, prompt_length

    sample = count_task_sample(3, 0)
    seq, patches = prompt_length(vlm)
    out: dict = {"seq": seq, "width": s.graph_width, "k": s.k, "max_features": s.graph_max_features}
    try:
        cost = graph_cost(
            vlm,
            seq,
            s.k,
            max_features=s.graph_max_features,
            batch_rows=s.graph_batch,
            dtype_bytes=vlm.hf.dtype.itemsize,
            transcoder_width=s.graph_width,
            patches=patches,
            flops_per_second=flops_per_s,
        )
        peak = cost.get("device_bytes") if device.startswith("cuda") else cost.get("peak_bytes")
        out |= {"planned_seconds": cost.get("seconds"), "planned_peak_bytes": peak}
        out |= {"planned_host_bytes": cost.get("host_bytes"), "planned_flops": cost.get("flops")}
    except Exception as err:  # noqa: BLE001 — the plan's signature is another helper's; the graph still runs
        out["plan_error"] = f"{type(err).__name__}: {err}"[:300]
    tcs = random_transcoders(vlm, s.graph_width, s.k)
    graph = attribution_graph(vlm, tcs, sample, max_features=s.graph_max_features, batch_size=s.graph_batch)
    n = int(graph.adjacency.shape[0])
    return out | {"nodes": n, "features": int(len(graph.features)), "finite": bool(graph.adjacency.isfinite().all())}


def finetune_row(vlm, s) -> dict:
    """``ft_steps`` focus fine-tune steps (`countlens.training.finetune.finetune`: LoRA, CE + λ_focus 1 at
    the middle layer) on counting scenes, into a temporary folder. No plan exists (written null)."""
    from countlens.datasets.tasks import task_samples
    from countlens.settings import FinetuneConfig
    from countlens.training.finetune import finetune

    layer = vlm.arch.n_layers // 2
    config = FinetuneConfig(
        steps=s.ft_steps, batch_size=s.ft_batch, focus=1.0, target_layers=(layer,), save_every=s.ft_steps
    )
    losses: list = []
    with tempfile.TemporaryDirectory() as out:
        finetune(vlm, task_samples("count", 4 * s.ft_batch, seed=0), out, config, progress=losses.append)
    last = losses[-1] if losses else {}
    return {"steps": s.ft_steps, "batch_size": s.ft_batch, "target_layer": layer, "last": last}


def peer_rows(rec, vlm, pairs, s, device: str) -> None:
    """``patch_heads`` over every head, then the peer's loop (one full forward per head, that head's z
    patched from the corrupt run at every position) for ``peer_seconds`` (at least one head), scaled to
    every head: its setup (the pairs prepared, the corrupt run cached) plus the heads' mean × all heads."""
    from countlens.circuits.engine.edits import Edit, cache_run, run_edits
    from countlens.circuits.methods.patching import patch_heads, prepare_pairs
    from countlens.circuits.sites import HeadZ, group_mask

    arch, n = vlm.arch, len(pairs)
    heads = [(la, h) for la in range(arch.n_layers) for h in range(arch.n_heads)]
    if s.warmup:  # first calls compile and allocate: outside the timed rows
        patch_heads(vlm, pairs[:1], layers=[0], batch_size=1)
    swept = rec.row(
        "patch_heads",
        lambda: {"heads": len(heads), "pairs": n} | _timed(lambda: patch_heads(vlm, pairs, batch_size=n), device),
        s.budgets.get("patch_heads"),
    )

    def peer() -> dict:
        t0 = time.perf_counter()
        b = prepare_pairs(vlm, pairs)
        cache = cache_run(vlm, b.corrupt, range(arch.n_layers))
        mask = group_mask(b.clean, "all")
        sync(device)
        setup, done, t1 = time.perf_counter() - t0, 0, time.perf_counter()
        for la, h in heads:
            run_edits(vlm, b.clean, cache, [Edit(HeadZ(la, h), mask)], max_rows=n)
            sync(device)
            done += 1
            if time.perf_counter() - t1 >= s.peer_seconds:
                break
        per_head = (time.perf_counter() - t1) / done
        all_heads = setup + per_head * len(heads)
        row = {"heads": len(heads), "heads_run": done, "setup_s": round(setup, 3), "per_head_s": round(per_head, 4)}
        row["all_heads_s"] = round(all_heads, 2)
        if swept:
            row["speedup_patch_heads"] = round(all_heads / swept["sweep_s"], 2)
        return row

    rec.row("peer_head_loop", peer, s.budgets.get("peer_head_loop"))


def _timed(fn, device: str) -> dict:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return {"sweep_s": round(time.perf_counter() - t, 3)}
