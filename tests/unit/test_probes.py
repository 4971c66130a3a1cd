"""Detection probes: AP@50 on known cases, NMS, target assignment, training, and taps end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from countlens.analysis.detection import average_precision, nms
from countlens.analysis.probes import (
    DetectionProbe,
    ProbeConfig,
    _assign,
    build_targets,
    evaluate_probe,
    fit_probe,
    predict,
    probe_taps,
)
from countlens.datasets.countingtricks import countingtricks
from countlens.datasets.scene import Obj, Scene
from countlens.datasets.tasks import TaskSample
from countlens.errors import ConfigError, InputError

pytestmark = pytest.mark.usefixtures("one_thread")


GT = [np.array([[0, 0, 10, 10], [20, 20, 30, 30.0]])]


def _det(*rows) -> np.ndarray:
    return np.array(rows, dtype=float).reshape(-1, 5)


# ----------------------------------------------------------------------------- AP


def test_perfect_predictions_score_one():
    assert average_precision([_det([0, 0, 10, 10, 0.9], [20, 20, 30, 30, 0.8])], GT) == 1.0


def test_false_positive_ranked_last_costs_nothing_ranked_first_costs_a_third():
    fp_last = _det([0, 0, 10, 10, 0.9], [20, 20, 30, 30, 0.8], [50, 50, 60, 60, 0.1])
    fp_first = _det([0, 0, 10, 10, 0.9], [20, 20, 30, 30, 0.8], [50, 50, 60, 60, 0.95])
    assert average_precision([fp_last], GT) == 1.0
    # ranks: FP (p=0), TP (p=1/2, r=1/2), TP (p=2/3, r=1): the envelope is 2/3 at every recall.
    assert average_precision([fp_first], GT) == pytest.approx(2 / 3)


def test_half_recall_reads_51_of_101_points():
    assert average_precision([_det([0, 0, 10, 10, 0.9])], GT) == pytest.approx(51 / 101)


def test_no_predictions_score_zero():
    assert average_precision([np.zeros((0, 5))], GT) == 0.0


def test_duplicates_are_false_positives():
    dup = _det([0, 0, 10, 10, 0.9], [0, 0, 10, 10.5, 0.85], [20, 20, 30, 30, 0.8])
    # ranks: TP (1, r=1/2), FP (1/2), TP (2/3, r=1) → envelope 1 up to recall 1/2, 2/3 after.
    assert average_precision([dup], GT) == pytest.approx((51 + 50 * 2 / 3) / 101)


def test_iou_threshold_and_pooling_across_images():
    shifted = _det([0, 0, 10, 10, 0.9], [25, 20, 35, 30, 0.8])  # IoU 1/3 with its object: a miss at 0.5
    assert average_precision([shifted], GT) == pytest.approx(51 / 101)
    assert average_precision([shifted], GT, iou=0.3) == 1.0
    two = [_det([0, 0, 10, 10, 0.9]), _det([20, 20, 30, 30, 0.8])]
    assert average_precision(two, [GT[0][:1], GT[0][1:]]) == 1.0


def test_ap_errors():
    with pytest.raises(InputError, match="one of each per image"):
        average_precision([_det()], [])
    with pytest.raises(InputError, match="no objects"):
        average_precision([_det()], [np.zeros((0, 4))])


# ----------------------------------------------------------------------------- NMS and targets


def test_nms_keeps_the_best_of_overlapping_boxes():
    boxes = torch.tensor([[0, 0, 10, 10], [1, 0, 11, 10], [20, 20, 30, 30], [0, 0, 10, 10.0]])
    scores = torch.tensor([0.5, 0.9, 0.8, 0.5])
    assert nms(boxes, scores, 0.5).tolist() == [1, 2]
    assert nms(boxes, scores, 0.95).tolist() == [1, 2, 0]  # equal boxes 0 and 3: the earlier index wins
    assert nms(torch.zeros(0, 4), torch.zeros(0)).tolist() == []
    with pytest.raises(InputError, match="nms needs"):
        nms(boxes, scores[:2])


def test_a_shared_cell_goes_to_the_nearer_centre_and_the_other_object_moves_next_door():
    # On a 4×4 grid (cells 0.25 wide): both centres in cell (1, 1); the second nearer its right edge.
    boxes = np.array([[0.35, 0.35, 0.40, 0.40], [0.44, 0.36, 0.49, 0.41]])
    assert sorted(_assign(boxes, 4, 4)) == [(0, 1, 1), (1, 1, 2)]
    obj, box = build_targets([_sample([Obj("circle", "red", 40.0, 40.0, 16.0)])], 6, 6)
    assert obj.sum() == 1 and obj[0, 1, 1] == 1  # 40 px / 32 px cells → cell (1, 1)
    assert box[0, 1, 1].tolist() == pytest.approx([32 / 192, 32 / 192, 48 / 192, 48 / 192])


def _sample(objs, size: int = 192) -> TaskSample:
    return TaskSample(
        Scene(size, size, tuple(objs)),
        "how many circles are there in the image?",
        str(len(objs)),
        "count",
        {"count": len(objs)},
    )


# ----------------------------------------------------------------------------- training


def _synthetic(n: int, seed: int, grid: int = 6, size: int = 192) -> tuple[torch.Tensor, list[TaskSample]]:
    """Scenes of 1–4 squares one cell wide at cell centres; channel 0 marks object cells, the rest is noise."""
    rng = np.random.default_rng(seed)
    cell = size / grid
    feats = torch.from_numpy(rng.normal(size=(n, 8, grid, grid))).float()
    samples = []
    for i in range(n):
        cells = rng.choice(grid * grid, size=rng.integers(1, 5), replace=False)
        objs = [Obj("square", "red", (c % grid + 0.5) * cell, (c // grid + 0.5) * cell, cell) for c in cells]
        for c in cells:
            feats[i, 0, c // grid, c % grid] += 4.0
        samples.append(_sample(objs, size))
    return feats, samples


def test_a_probe_learns_a_channel_that_marks_object_cells():
    config = ProbeConfig(hidden=16, groups=4, epochs=30, batch_size=16, lr=1e-2)
    x, samples = _synthetic(160, seed=0)
    probe = fit_probe(x, samples, config)
    xt, test = _synthetic(60, seed=1)
    assert evaluate_probe(probe, xt, test, config) >= 0.9
    again = fit_probe(x, samples, config)  # seeded: the same weights and loss
    assert again.train_loss == probe.train_loss
    assert all(torch.equal(a, b) for a, b in zip(probe.parameters(), again.parameters()))
    dets = predict(probe, xt[:2], 192, score_threshold=0.5)
    assert len(dets) == 2 and all(d.shape[1] == 5 and (np.diff(d[:, 4]) <= 0).all() for d in dets)


def test_the_probe_architecture_is_the_same_on_every_tap():
    config = ProbeConfig(hidden=16, groups=4)
    small, wide = DetectionProbe(64, config), DetectionProbe(128, config)
    assert wide.n_params - small.n_params == 64 * 16  # only the 1×1 bottleneck grows with the width
    assert small(torch.zeros(2, 64, 12, 12)).shape == (2, 5, 12, 12)


def test_probe_input_errors():
    x, samples = _synthetic(4, seed=0)
    with pytest.raises(InputError, match="one map per sample"):
        fit_probe(x[:3], samples)
    with pytest.raises(InputError, match="sample d rows cols"):
        fit_probe(x[:, 0], samples)
    with pytest.raises(ConfigError, match="multiple of groups"):
        ProbeConfig(hidden=10, groups=4)


def test_probe_taps_end_to_end_on_the_organism(loaded):
    vlm = loaded("toy")
    data = countingtricks(["1A", "4D"], 6, grid=vlm.geometry, seed=0, prompt="short")
    config = ProbeConfig(hidden=8, groups=4, epochs=2, batch_size=4)
    train, test = [s for i, s in enumerate(data) if i % 3], data[::3]  # both hold 1A and 4D
    ds = probe_taps(vlm, train, test, taps=[("vision", 1), ("projector", None), ("llm", 2)], config=config)
    assert list(ds.tap.values) == ["vision.1", "projector", "llm.2"]
    assert list(ds.grid.values) == [12, 6, 6] and list(ds.channels.values) == [64, 128, 128]
    assert ((ds.ap50 >= 0) & (ds.ap50 <= 1)).all() and (ds.seconds > 0).all() and np.isfinite(ds.train_loss).all()
    assert int(ds.n_params.sel(tap="llm.2")) - int(ds.n_params.sel(tap="vision.1")) == 64 * 8
    assert ds.attrs["method"] == "probe_taps"
    assert ds.ap50_case.dims == ("tap", "case") and list(ds.case.values) == ["1A", "4D"]
