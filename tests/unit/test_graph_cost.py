"""`countlens.pipeline.graph_cost` against the graph `attribution_graph` really builds on the organism
(tiny transcoders: node counts and adjacency bytes equal, with and without max_features), the
``countlens features plan`` command on a tiny config, and every refusal before any work."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from countlens.cli import app
from countlens.datasets.tasks import count_task_sample
from countlens.errors import InputError
from countlens.features import attribution_graph
from countlens.model.memory import widths
from countlens.pipeline.graph_cost import ADJACENCY_BYTES, fitting_knob, graph_cost, prompt_length

runner = CliRunner()
WIDTH, K = 32, 4


@pytest.fixture(scope="module")
def organism(small_transcoders, loaded):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    vlm = loaded("toy")
    tcs = small_transcoders
    yield vlm, tcs, count_task_sample(3, 0)
    torch.set_num_threads(before)


@pytest.mark.parametrize("max_features", [None, 100])
def test_nodes_and_adjacency_bytes_equal_the_built_graph(organism, max_features):
    vlm, tcs, sample = organism
    graph = attribution_graph(vlm, tcs, sample, max_features=max_features)
    seq, patches = prompt_length(vlm)
    assert seq == len(graph.tokens)
    c = graph_cost(vlm, seq, K, max_features, n_logits=graph.n_logits, transcoder_width=WIDTH, patches=patches)
    assert c["features"] == graph.n_features
    assert (c["errors"], c["embeddings"], c["logits"]) == (graph.n_errors, graph.n_embeddings, graph.n_logits)
    assert c["nodes"] == graph.n_nodes
    assert c["adjacency_bytes"] == graph.adjacency.numel() * graph.adjacency.element_size()
    assert c["active_features"] == vlm.arch.n_layers * seq * K
    assert c["backward_passes"] == 1 + -(-graph.n_features // 64)
    assert c["transcoder_bytes"] == sum(p.numel() * p.element_size() for p in tcs.parameters())
    assert (c["selection_bytes"] > 0) == (max_features is not None)
    # The host buffer is circuit-tracer's edge_matrix: the kept features' and the logits' rows, every source.
    assert c["buffer_bytes"] == (graph.n_features + graph.n_logits) * c["sources"] * ADJACENCY_BYTES


def test_a_widths_gives_what_the_model_gives_and_costs_grow_as_they_should(loaded):
    vlm = loaded("toy")
    w = widths(vlm)
    base = graph_cost(w, 52, 16)
    assert base == graph_cost(vlm, 52, 16)
    n = base["nodes"]
    assert base["adjacency_bytes"] == n * n * ADJACENCY_BYTES
    capped = graph_cost(w, 52, 16, max_features=500)
    assert capped["features"] == 500 and capped["adjacency_bytes"] < base["adjacency_bytes"]
    # max_features bounds the host: its buffer holds max_features + n_logits rows, not one per active feature.
    assert capped["buffer_bytes"] == (500 + 10) * base["sources"] * ADJACENCY_BYTES < base["buffer_bytes"]
    assert capped["host_bytes"] < base["host_bytes"] and capped["rankings"] == -(-500 // (64 * 4))
    assert capped["flops"] < base["flops"] and capped["selection_seconds"] > 0 == base["selection_seconds"]
    half = graph_cost(w, 52, 16, dtype_bytes=2)
    assert half["transcoder_bytes"] * 2 == base["transcoder_bytes"]
    assert half["adjacency_bytes"] == base["adjacency_bytes"]  # always float32
    assert graph_cost(w, 104, 16)["edge_flops"] > 3.9 * base["edge_flops"]  # targets × seq: quadratic


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seq": 0}, "seq"),
        ({"k": 0}, "k "),
        ({"k": 600}, "k ≤ width"),
        ({"max_features": 0}, "max_features"),
        ({"n_logits": 2.5}, "n_logits"),
        ({"batch_rows": -1}, "batch_rows"),
        ({"dtype_bytes": 3}, "bfloat16: 2"),
        ({"patches": -1}, "patches"),
        ({"flops_per_second": float("nan")}, "flops_per_second"),
    ],
)
def test_graph_cost_refuses_bad_arguments(loaded, kwargs, message):
    args = {"seq": 52, "k": 16, **kwargs}
    with pytest.raises(InputError, match=message):
        graph_cost(widths(loaded("toy")), **args)


def test_graph_cost_refuses_what_is_no_model():
    with pytest.raises(InputError, match="meta_vlm"):
        graph_cost("toy", 52, 16)


def test_the_plan_command_on_a_tiny_config(tiny_checkpoint):
    model = str(tiny_checkpoint("qwen2_5_vl"))
    args = ["features", "plan", "--model", model, "--k", "4", "--width", "64", "--max-features", "100"]
    result = runner.invoke(app, [*args, "--memory", "1", "--device", "cuda", "--host-memory", "0.0004"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "features 100 (of" in out and "backward passes" in out and "adjacency over the kept nodes" in out
    assert "cuda: " in out and "fits in 1 GiB" in out and "does not fit in 0.0004 GiB" in out
    assert "row buffer" in out and "every active feature" not in out  # the old unbounded arrays are gone
    assert "it fits with --max-features" in out  # the knob that makes the host fit, named
    # The transcoders' training is planned in the same command: its width and k, and the assumed GPU rate said.
    training = out[out.index("training the transcoders") :]
    assert "64 features (k 4)" in training and "an assumed rate, not measured" in training


def test_the_plan_names_the_knob_that_makes_each_memory_fit(loaded):
    plan = {"widths_or_vlm": widths(loaded("toy")), "seq": 52, "k": 16, "batch_rows": 4096, "max_features": 2000}
    limit = graph_cost(**plan)["device_bytes"] * 0.6
    said = fitting_knob(plan, limit, "device_bytes")
    assert said.startswith("it fits with --batch-size")
    assert graph_cost(**{**plan, "batch_rows": int(said.rsplit(" ", 1)[1])})["device_bytes"] <= limit
    plan["batch_rows"] = 16  # the host: its row buffer, max_features rows
    limit = graph_cost(**plan)["host_bytes"] * 0.5
    said = fitting_knob(plan, limit, "host_bytes")
    assert said.startswith("it fits with --max-features")
    assert graph_cost(**{**plan, "max_features": int(said.rsplit(" ", 1)[1])})["host_bytes"] <= limit
    assert "no --batch-size or --max-features" in fitting_knob(plan, 1000, "device_bytes")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--k", "0"], "--k must be ≥ 1"),
        (["--k", "65", "--width", "64"], "exceeds --width"),
        (["--max-features", "0"], "--max-features must be ≥ 1"),
        (["--batch-size", "0"], "--batch-size must be ≥ 1"),
        (["--memory", "nan"], "--memory must be a finite"),
        (["--host-memory", "-1", "--device", "cuda"], "--host-memory must be a finite"),
        (["--host-memory", "8"], "--host-memory is for --device cuda"),
        (["--device", "tpu"], "plan for 'cpu' or 'cuda'"),
        (["--image-size", "0"], "--image-size must be ≥ 1"),
    ],
)
def test_the_plan_commands_refusals_exit_2_before_reading_the_model(extra, message, monkeypatch):
    import countlens.model.loading

    def no_read(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the options were checked")

    monkeypatch.setattr(countlens.model.loading, "meta_vlm", no_read)
    result = runner.invoke(app, ["features", "plan", "--model", "toy", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
