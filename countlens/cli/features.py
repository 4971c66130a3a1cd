"""``countlens features``: the commands on a model's transcoders (`countlens.features`).

- ``train``: per-layer transcoders of a model's MLPs, with a progress bar and a checkpoint a rerun
  resumes from; the fidelity table and the replacement model's counting accuracy beside the original's.
- ``graph``: the attribution graph of one counting scene
  (`countlens.datasets.tasks.count_task_sample`), pruned, written as
  circuit-tracer's viewer JSON, a Dataset and a self-contained HTML page
  (`countlens.features.graph_page`), with the feature cards of its most influential features.
- ``plan``: what the graph of a model's counting scene would cost (`countlens.pipeline.graph_cost`),
  read from its config and processor alone: nodes, GiB, backward passes, FLOPs, time, and the fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import countlens
from countlens.cli.options import Device, Dtype, Model, check_positive
from countlens.cli.paths import check_out
from countlens.errors import ConfigError
from countlens.files import refuse_output_over_input


def features_train(
    out: Annotated[
        Path, typer.Option(help="Directory for the checkpoint, the transcoder set (transcoders/) and fidelity.nc.")
    ],
    model: Model = "toy",
    width: Annotated[int, typer.Option(help="Features per layer.")] = 512,
    k: Annotated[int, typer.Option(help="Active features per token (TopK).")] = 16,
    steps: Annotated[int, typer.Option(help="Training steps per layer.")] = 1500,
    seed: Annotated[int, typer.Option(help="Seed of the data, the initialisation and the batches.")] = 0,
    n_eval: Annotated[int, typer.Option(help="Held-out counting scenes scored by the replacement model.")] = 256,
    max_memory: Annotated[
        float,
        typer.Option(
            help="GiB of activations held in memory; above it they are collected to OUT/activations and streamed."
        ),
    ] = 4.0,
    device: Device = None,
    dtype: Dtype = None,
) -> None:
    """Train one TopK transcoder per layer (rerun the same command to resume after an interruption).

    Example: countlens features train --model toy --out runs/transcoders
    """
    import math

    from countlens.datasets.tasks import task_samples
    from countlens.features import replacement_accuracy, train_transcoders

    check_positive(width=width, k=k, steps=steps, n_eval=n_eval)
    if k > width:
        raise ConfigError(f"--k {k} exceeds --width {width}: give k ≤ width")
    if not (math.isfinite(max_memory) and max_memory * 2**30 >= 1):
        raise ConfigError(f"--max-memory must be a finite number of GiB > 0, e.g. 4; got {max_memory}")
    check_out(out)  # a file, a path under a file, a folder not writable: before the model loads
    vlm = countlens.load(model, dtype=dtype, device_map=device)
    limit = max_memory * 2**30
    run = train_transcoders(vlm, width=width, k=k, steps=steps, seed=seed, out=out, progress=True, max_memory=limit)
    typer.echo(run.fidelity[["fvu", "l0", "dead"]].to_dataframe().round(4).to_string())
    acc = replacement_accuracy(vlm, run.transcoders, task_samples("count", n_eval, seed=0))
    for name in acc.model.values:
        typer.echo(f"counting accuracy, {name}: {float(acc.accuracy.sel(model=name)):.3f}")
    typer.echo(f"saved to {out / 'transcoders'}")


def top_features(graph, n: int) -> dict[tuple[int, int], int]:
    """The ``n`` distinct (layer, feature) pairs of largest node influence in the whole (unpruned)
    ``graph``, most influential first, each with its most influential node's index. Pruning keeps
    the nodes of largest influence, so those of them that survive are the pruned graph's top too."""
    from countlens.features import node_influence

    influence = node_influence(graph)[: graph.n_features]
    out: dict[tuple[int, int], int] = {}
    for j in influence.argsort(descending=True).tolist():
        layer, _, f = graph.features[j].tolist()
        out.setdefault((layer, f), j)
        if len(out) == n:
            break
    return out


def features_graph(
    transcoders: Annotated[
        Path, typer.Option(help="A circuit-tracer transcoder folder (config.yaml, layer_{i}.safetensors).")
    ],
    out: Annotated[
        Path, typer.Option(help="Directory for graph.json, graph.nc, graph.html, cards.nc and card_L{l}F{f}.png.")
    ],
    model: Model = "toy",
    count: Annotated[int, typer.Option(help="Objects in the counting scene (0 … 12).")] = 3,
    seed: Annotated[int, typer.Option(help="Seed of the scene (and of the cards' scenes).")] = 0,
    node_threshold: Annotated[float, typer.Option(help="Pruning: share of node influence kept, in (0, 1].")] = 0.8,
    edge_threshold: Annotated[float, typer.Option(help="Pruning: share of edge influence kept, in (0, 1].")] = 0.98,
    top: Annotated[int, typer.Option(help="Features (largest influence) that get a card.")] = 5,
    card_scenes: Annotated[int, typer.Option(help="Counting scenes the cards are computed over.")] = 64,
    max_features: Annotated[
        int | None,
        typer.Option(help="Features the graph keeps, chosen as circuit-tracer does (see features plan); default: all."),
    ] = None,
    batch_size: Annotated[
        int, typer.Option(help="Target rows per backward pass (see features plan: device memory).")
    ] = 64,
    device: Device = None,
    dtype: Dtype = None,
) -> None:
    """Attribution graph of one counting scene: pruned, as viewer JSON, Dataset and an HTML page,
    with cards of its top features.

    Example: countlens features graph --transcoders runs/transcoders/transcoders --count 3 --out runs/graph
    """
    check_positive(top=top, card_scenes=card_scenes, max_features=max_features, batch_size=batch_size)
    if not transcoders.is_dir():
        raise ConfigError(
            f"--transcoders {transcoders} is not a folder: give a transcoder set's folder "
            "(countlens features train writes OUT/transcoders)"
        )
    if not (transcoders / "config.yaml").is_file() and (transcoders / "transcoders" / "config.yaml").is_file():
        raise ConfigError(
            f"--transcoders {transcoders} is a training folder: give the set inside it, {transcoders / 'transcoders'}"
        )
    for name, value in (("--node-threshold", node_threshold), ("--edge-threshold", edge_threshold)):
        if not 0 < value <= 1:
            raise ConfigError(f"{name} must be in (0, 1] (a share of the influence kept), got {value:g}")
    from countlens.datasets.tasks import MAX_COUNT, count_task_sample

    if not 0 <= count <= MAX_COUNT:
        raise ConfigError(f"--count {count} is outside the counting scenes' range: give 0 … {MAX_COUNT}")
    if seed < 0:
        raise ConfigError(f"--seed must be ≥ 0, got {seed}")
    check_out(out)
    refuse_output_over_input(out, {"--transcoders": transcoders}, "--out")  # its files would join the set's
    from countlens.features import load_transcoders

    tcs = load_transcoders(transcoders)  # the folder's format, checked before the model loads
    vlm = countlens.load(model, dtype=dtype, device_map=device)
    sample = count_task_sample(count, seed)
    graph_args = {"max_features": max_features, "batch_size": batch_size}
    write_graph(vlm, tcs, sample, out, seed, node_threshold, edge_threshold, top, card_scenes, graph_args)


def write_graph(
    vlm, tcs, sample, out: Path, seed: int, node_threshold, edge_threshold, top, card_scenes, graph_args=None
) -> None:
    """Build, prune and write the graph of ``sample`` and the cards of its top features: everything is
    computed first and drawn in a scratch folder, then moved into ``out``, so a failure writes nothing."""
    import shutil
    import tempfile

    from countlens.datasets.tasks import task_samples
    from countlens.features import (
        attribution_graph,
        draw_card,
        feature_cards,
        feature_effects,
        graph_dataset,
        prune,
        save_graph,
    )
    from countlens.features.graph_page import graph_page
    from countlens.features.scores import graph_scores

    graph = attribution_graph(vlm, tcs, sample, **(graph_args or {}))
    pruned = prune(graph, node_threshold, edge_threshold)
    full, drawn = graph_scores(graph), graph_scores(pruned)
    chosen = top_features(graph, top)
    scenes = task_samples("count", card_scenes, seed=seed)
    cards = feature_cards(vlm, tcs, scenes, list(chosen), top=min(6, card_scenes)) if chosen else None
    effects = feature_effects(vlm, tcs, graph, sample, features=list(chosen.values())) if chosen else None
    slug = f"{vlm.name or vlm.arch.name}-count-{sample.meta['count']}-seed{seed}".replace("/", "-")
    with tempfile.TemporaryDirectory(prefix="countlens-graph-") as scratch:
        tmp = Path(scratch)
        save_graph(pruned, tmp / "graph.json", slug=slug)
        graph_dataset(pruned).to_netcdf(tmp / "graph.nc")
        graph_page(pruned, tmp / "graph.html", title=f"{slug}: {sample.question}", cards=cards)
        if effects is not None:
            effects.to_netcdf(tmp / "effects.nc")
        if cards is not None:
            cards.to_netcdf(tmp / "cards.nc")
            for name in cards.card.values:
                draw_card(cards, str(name), scenes, tmp / f"card_{name}.png")
        out.mkdir(parents=True, exist_ok=True)
        for file in sorted(tmp.iterdir()):
            shutil.move(str(file), str(out / file.name))
    typer.echo(
        f"scene: {sample.question} (answer {sample.answer}); graph {graph.n_nodes} nodes, {graph.n_edges} edges; "
        f"pruned {pruned.n_nodes} nodes ({pruned.n_features} features), {pruned.n_edges} edges"
    )
    typer.echo(
        f"graph scores (circuit-tracer's): replacement {full['replacement']:.3f}, completeness "
        f"{full['completeness']:.3f}; pruned graph {drawn['replacement']:.3f}, {drawn['completeness']:.3f}"
    )
    kept = {(layer, f) for layer, _, f in pruned.features.tolist()}
    typer.echo(
        "top features by influence (its most influential position, its activation there; removing it changes "
        f"the {effects.attrs['target_string']!r} logit by, graph / real model):"
        if effects is not None
        else "no active features"
    )
    for (layer, f), j in chosen.items():
        pos, act = int(graph.features[j, 1]), float(graph.activations[j])
        where = "" if (layer, f) in kept else "  (pruned away)"
        moved = effects.sel(node=j)
        typer.echo(
            f"  L{layer}F{f}  position {pos} {graph.token_strings[pos]!r}  activation {act:.3g}  "
            f"removal {float(moved.removal_graph):+.3f} / {float(moved.removal_real):+.3f}{where}"
        )
    if effects is not None:
        a = effects.attrs
        typer.echo(
            f"graph vs real model over these features: removal Spearman {a['removal_spearman']:.2f}, same sign "
            f"{a['removal_same_sign']:.0%}; steering ×2 Spearman {a['steer_spearman']:.2f}, same sign "
            f"{a['steer_same_sign']:.0%}"
        )
    extra = "effects.nc, " if effects is not None else ""
    typer.echo(f"saved graph.json, graph.nc, graph.html, {extra}and {len(chosen)} cards to {out}")


def features_plan(
    model: Annotated[
        str,
        typer.Option(help="'toy', a local checkpoint directory (its config and processor; no weights), or a hub id."),
    ] = "toy",
    image_size: Annotated[
        int | None, typer.Option(help="Square image side in pixels (dynamic processors); default: the processor's.")
    ] = None,
    k: Annotated[int, typer.Option(help="Active features per token (TopK).")] = 16,
    width: Annotated[int, typer.Option(help="Transcoder features per layer.")] = 512,
    max_features: Annotated[
        int | None, typer.Option(help="Features the graph keeps (attribution_graph's max_features); default: all.")
    ] = None,
    n_logits: Annotated[int, typer.Option(help="Logit nodes (attribution_graph's max_logits).")] = 10,
    batch_size: Annotated[
        int, typer.Option(help="Target rows per backward pass (as features graph's --batch-size).")
    ] = 64,
    memory: Annotated[
        float | None, typer.Option(help="The device's memory, GiB (e.g. 141 for an H200); default: no check.")
    ] = None,
    host_memory: Annotated[
        float | None,
        typer.Option(
            help="With --device cuda: the host's memory, GiB (graph.py's arrays live there); default: no check."
        ),
    ] = None,
    device: Annotated[
        str, typer.Option(help="Time estimate for 'cpu' (calibrated, one thread) or 'cuda' (an assumed H200 rate).")
    ] = "cpu",
    dtype: Dtype = None,
) -> None:
    """Plan an attribution graph before building it: nodes, the host's and the device's GiB step by
    step, backward passes, FLOPs and time, and whether each fits (--memory, --host-memory), else the
    knob that makes it fit; then the training of its transcoders: time, device, host and disk (config
    and processor only, no weights).

    Example: countlens features plan --model runs/qwen2.5-vl-7b --image-size 448 --k 16 --width 16384
    --max-features 8192 --memory 141 --dtype bfloat16 --device cuda
    """
    import math

    from countlens.model.loading import meta_vlm
    from countlens.pipeline.graph_cost import CPU_FLOPS, GPU_FLOPS, fitting_knob, graph_cost, prompt_length
    from countlens.progress import duration_text

    check_positive(image_size=image_size, k=k, width=width, max_features=max_features, n_logits=n_logits)
    check_positive(batch_size=batch_size)
    from countlens.pipeline.graph_cost import min_scene_side

    if image_size is not None and image_size < min_scene_side():
        side = min_scene_side()
        raise ConfigError(
            f"--image-size {image_size} px: the counting scene the graph is built on needs ≥ {side} px (smaller, "
            f"its objects shrink below the pixels that draw them); give --image-size ≥ {side}"
        )
    if k > width:
        raise ConfigError(f"--k {k} exceeds --width {width}: give k ≤ width")
    for name, value in (("--memory", memory), ("--host-memory", host_memory)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{name} must be a finite number of GiB > 0, got {value}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: plan for 'cpu' or 'cuda'")
    if host_memory is not None and device != "cuda":
        raise ConfigError("--host-memory is for --device cuda; on the CPU, --memory holds everything")
    vlm = meta_vlm(model, dtype=dtype, image_size=image_size)
    seq, patches = prompt_length(vlm)
    rate = CPU_FLOPS if device == "cpu" else GPU_FLOPS
    kwargs = dict(
        widths_or_vlm=vlm,
        seq=seq,
        k=k,
        max_features=max_features,
        n_logits=n_logits,
        batch_rows=batch_size,
        dtype_bytes=vlm.hf.dtype.itemsize,
        transcoder_width=width,
        patches=patches,
        flops_per_second=rate,
    )
    c = graph_cost(**kwargs)
    gib = 2**30
    typer.echo(
        f"{vlm.name}: {c['n_layers']} layers, d_model {c['d_model']}, {c['seq']} tokens a counting scene "
        f"({patches} patches), {vlm.hf.dtype}; transcoders width {width}, k {k}"
    )
    typer.echo(
        f"nodes {c['nodes']:,}: features {c['features']:,} (of {c['active_features']:,} active), errors "
        f"{c['errors']:,}, embeddings {c['embeddings']:,}, logits {c['logits']}"
    )
    host_lines = [
        ("row buffer: kept features' and logits' rows", c["buffer_bytes"]),
        ("max_features ranking's block of known rows", c["selection_bytes"]),
        ("adjacency over the kept nodes (the graph)", c["adjacency_bytes"]),
    ]
    device_lines = [
        ("model weights", c["weights_bytes"]),
        ("transcoders", c["transcoder_bytes"]),
        ("clean run's records and active decoders", c["records_bytes"] + c["decoder_bytes"]),
        ("activations kept for the backward passes", c["kept_bytes"]),
        ("largest transient: the forward or one backward", max(c["forward_bytes"], c["backward_bytes"])),
    ]
    for title, rows, total in (("host", host_lines, "host_bytes"), (device, device_lines, "device_bytes")):
        typer.echo(f"{title}:")
        for name, value in rows:
            typer.echo(f"  {name:<48} {value / gib:10.2f} GiB")
        typer.echo(f"  {'peak':<48} {c[total] / gib:10.2f} GiB")
    if device == "cpu":
        typer.echo(f"  {'peak on the CPU (host + model, one memory)':<48} {c['peak_bytes'] / gib:10.2f} GiB")
    where = (
        "one CPU thread, calibrated on the organism" if device == "cpu" else "an assumed 40 % of an H200's bf16 peak"
    )
    typer.echo(
        f"backward passes {c['backward_passes']:,} ({batch_size} rows each), rankings {c['rankings']:,}; "
        f"{c['flops'] / 1e12:,.1f} TFLOP (edges {c['edge_flops'] / 1e12:,.1f}); about {duration_text(c['seconds'])} "
        f"on {where}, {duration_text(c['selection_seconds'])} of it the max_features rankings on one host thread"
    )
    checks = [] if memory is None else [(memory, c["peak_bytes"] if device == "cpu" else c["device_bytes"], device)]
    if host_memory is not None:
        checks.append((host_memory, c["host_bytes"], "host"))
    for size, need, where in checks:
        verdict = "fits" if need <= size * gib else "does not fit"
        typer.echo(f"{where}: {need / gib:.3g} GiB {verdict} in {size:g} GiB")
        if need > size * gib:
            key = "host_bytes" if where == "host" else ("peak_bytes" if device == "cpu" else "device_bytes")
            typer.echo(f"  {fitting_knob(kwargs, size * gib, key)}")
    from countlens.pipeline.transcoder_cost import training_plan_lines

    typer.echo("training the transcoders these graphs read (countlens features train, every layer):")
    for line in training_plan_lines(vlm, width=width, k=k, device=device):
        typer.echo(f"  {line}")
