"""Detection probes as the MAS paper's code trains them: each rule against a hand computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from countlens.analysis.detection import average_precision
from countlens.reference.counting_to_four.probe import (
    ReferenceProbe,
    ReferenceProbeConfig,
    ciou_loss,
    class_aware_nms,
    decode,
    fit_reference_probe,
    predict_reference,
    reference_ap50,
    targets,
)


def test_decode_places_boxes_from_sigmoids():
    out = torch.zeros(1, 7, 2, 4)  # 2 classes, a 2 × 4 grid; every raw value 0: σ = 0.5
    out[0, 0, 1, 2] = math.log(3)  # σ = 0.75
    boxes, obj, cls = decode(out)
    assert torch.allclose(boxes[0, 1, 2], torch.tensor([(2 + 0.75) / 4 - 0.25, 0.5, (2 + 0.75) / 4 + 0.25, 1.0]))
    assert torch.allclose(boxes[0, 0, 0], torch.tensor([0.0, 0.0, 0.375, 0.5]))  # clamped to the image
    assert obj.shape == (1, 2, 4) and cls.shape == (1, 2, 4, 2)


def test_targets_take_the_three_by_three_block_and_the_first_object_keeps_a_cell():
    boxes = [np.array([[0.05, 0.05, 0.15, 0.15], [0.2, 0.2, 0.3, 0.3]])]  # centres in cells (0, 0) and (1, 1)
    pos, box, onehot = targets(boxes, [np.array([1, 0])], 5, 5, 2)
    assert pos[0, :2, :2].all() and pos[0].sum() == 9  # (0,0)'s block, then (1,1)'s: 4 + 5 new cells
    assert torch.equal(box[0, 1, 1], torch.tensor([0.05, 0.05, 0.15, 0.15]))  # shared cell: the first object's
    assert onehot[0, 0, 0].tolist() == [0.0, 1.0] and onehot[0, 2, 2].tolist() == [1.0, 0.0]


def test_ciou_loss_by_hand():
    p, t = torch.tensor([[0.0, 0.0, 2.0, 2.0]]), torch.tensor([[1.0, 0.0, 3.0, 1.0]])
    iou = 1 / (4 + 2 - 1)
    rho2 = (2 - 1) ** 2 + (0.5 - 1) ** 2  # centres (1, 1) and (2, 0.5)
    c2 = 3**2 + 2**2
    v = 4 / math.pi**2 * (math.atan(2 / 1) - math.atan(2 / 2)) ** 2
    alpha = v / (1 - iou + v)
    assert abs(float(ciou_loss(p, t)[0]) - (1 - (iou - rho2 / c2 - alpha * v))) < 1e-6
    assert abs(float(ciou_loss(t, t)[0])) < 1e-6


def test_class_aware_nms_keeps_overlaps_of_other_classes():
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.9], [0.0, 0.0, 1.0, 0.95]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    assert class_aware_nms(boxes, scores, torch.tensor([0, 0, 1]), 0.5).tolist() == [0, 2]
    assert class_aware_nms(boxes, scores, torch.tensor([0, 0, 0]), 0.5).tolist() == [0]


def test_code_ap50_has_no_second_choice():
    """A detection whose best ground truth is already taken is a false positive even when it overlaps
    another ground-truth box enough (countlens's own matching would give it that box)."""
    gt = [np.array([[0.0, 0.0, 10.0, 10.0], [4.0, 0.0, 14.0, 10.0]])]
    preds = [np.array([[0.0, 0.0, 10.0, 10.0, 0.9], [1.0, 0.0, 11.0, 10.0, 0.8], [4.0, 0.0, 14.0, 10.0, 0.7]])]
    # hits: yes (gt0), no (best is gt0, taken), yes (gt1): recall .5 .5 1, precision 1 .5 2/3
    want = (51 * 1.0 + 50 * (2 / 3)) / 101
    assert abs(reference_ap50(preds, gt) - want) < 1e-12
    assert average_precision(preds, gt) > reference_ap50(preds, gt)  # countlens's matching re-assigns the second


def test_the_code_probe_trains_with_a_frozen_bottleneck_and_is_seeded():
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(12, 8, 6, 6, generator=gen)
    boxes, labels = [], []
    for i in range(12):
        r, c = i % 5, (2 * i) % 5
        feats[i, :, r, c] += 4.0  # the object's evidence at its cell
        boxes.append(np.array([[c / 6, r / 6, (c + 1) / 6, (r + 1) / 6]]))
        labels.append(np.array([i % 2]))
    config = ReferenceProbeConfig(width=4, hidden=8, epochs=3)  # a tap wider than the bottleneck: 8 > 4
    a = fit_reference_probe(feats, boxes, labels, 2, config)
    b = fit_reference_probe(feats, boxes, labels, 2, config)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        fresh = ReferenceProbe(8, 2, config)
    assert torch.equal(a.bottleneck[0].weight, fresh.bottleneck[0].weight)  # never trained
    assert a.n_params == sum(p.numel() for p in a.head.parameters()) and math.isfinite(a.train_loss)
    preds = predict_reference(a, feats, config)
    assert len(preds) == 12 and all(p.shape[1] == 5 and (p[:, 4] > 0.25).all() for p in preds)
    with pytest.raises(Exception, match="fewer than one batch"):
        fit_reference_probe(feats[:2], boxes[:2], labels[:2], 2, config)


def test_voc2007_in_its_layout_letterboxed_as_the_code():
    import tempfile
    from pathlib import Path

    from benchmark_files import voc_root

    from countlens.datasets.loaders import LoaderError, load_voc2007

    with tempfile.TemporaryDirectory() as tmp:
        voc = voc_root(Path(tmp))
        test = load_voc2007(voc, "test", side=64)
        assert [s.id for s in test] == ["000004", "000005", "000006"] and test[0].labels.tolist() == [11, 14]
        # 40 × 20 → scale 1.6, 64 × 32 pasted at y 16: box (5, 2, 15, 12) → (8, 19.2, 24, 35.2)
        assert np.allclose(test[0].boxes[0], [(2 + 3) * 1.6, 2 * 1.6 + 16, (12 + 3) * 1.6, 12 * 1.6 + 16])
        image = np.asarray(test[0].image)
        assert image.shape == (64, 64, 3) and (image[0, 0] == 114).all() and not (image[32, 32] == 114).all()
        assert len(load_voc2007(voc, "trainval", limit=2)) == 2
        (voc / "Annotations" / "000005.xml").write_text("<annotation><size><width>40</width></size></annotation>")
        with pytest.raises(LoaderError, match=r"000005\.xml: no <size> with integer <width> and <height>"):
            load_voc2007(voc, "test")
        with pytest.raises(LoaderError, match=r"ImageSets/Main/val\.txt: not found"):
            load_voc2007(voc, "val")


def test_probe_taps_under_the_codes_recipe_on_scenes(loaded):
    """The organism's three code taps (second-to-last vision block, projector, second-to-last layer)."""
    from countlens.analysis.probes import probe_taps
    from countlens.datasets.countingtricks import countingtricks
    from countlens.reference.counting_to_four.probe import reference_taps

    vlm = loaded("toy")
    taps = reference_taps(vlm)
    assert taps == (
        ("vision", len(vlm.hf.get_submodule(vlm.arch.spec.vision_blocks)) - 2),
        ("projector", None),
        ("llm", vlm.arch.n_layers - 2),
    )
    train = countingtricks(["1A", "5A"], 4, vlm.geometry, seed=1, prompt="short")
    test = countingtricks(["1A", "5A"], 2, vlm.geometry, seed=2, prompt="short")
    ds = probe_taps(vlm, train, test, taps=taps[1:], recipe="counting-to-four")
    assert ds.attrs["recipe"] == "counting-to-four" and list(ds.tap.values) == [
        "projector",
        f"llm.{vlm.arch.n_layers - 2}",
    ]
    assert ((ds.ap50 >= 0) & (ds.ap50 <= 1)).all() and "ap50_case" not in ds
    with pytest.raises(Exception, match="unknown probe recipe"):
        probe_taps(vlm, train, test, taps=taps[1:2], recipe="yolo")


def test_discover_takes_voc_for_its_probes(loaded, tmp_path):
    from benchmark_files import voc_root

    from countlens.errors import ConfigError
    from countlens.pipeline.config import DiscoverConfig
    from countlens.pipeline.inputs import stage_inputs

    voc = voc_root(tmp_path)
    config = DiscoverConfig(n_samples=2, probes=True, voc=str(voc))
    train, test = stage_inputs(loaded("toy"), config, "short")["probes"]()
    assert [s.id for s in train] == ["000001", "000002"] and [s.id for s in test] == ["000004", "000005"]
    with pytest.raises(ConfigError, match="set probes=True"):
        DiscoverConfig(voc=str(voc))
    scenes_train, scenes_test = stage_inputs(loaded("toy"), DiscoverConfig(n_samples=16, probes=True), "short")[
        "probes"
    ]()
    assert len(scenes_train) == 2 * len(scenes_test) == 64  # 2 and 1 per case of the 32
