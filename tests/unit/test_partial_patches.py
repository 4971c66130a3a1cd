"""A processor size that is whole patches and a remainder the vision tower drops (`Geometry.dropped`):
SigLIP-so400m's 384 px of 14 px patches is 27 whole patches and 6 px its stride-14 convolution never reads.

The rule (geometry, cells, data placement, the refusal of other remainders) on plain numbers, and the tiny
random-init SmolVLM and LLaVA-OneVision at 384 px / 14 px patches (`countlens.toy.tiny_models`) through
`VLM.prepare`, their forward and discover's stages. The real checkpoints' configs are in
tests/unit/test_real_configs.py (`DROPPED_384`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

import countlens
from countlens.circuits.sites.positions import Objects
from countlens.datasets.countingtricks import CASES, countingtricks
from countlens.datasets.pairs import count_pairs
from countlens.datasets.scene import Obj, Scene
from countlens.errors import CountlensError, InputError, UnsupportedArchitectureError
from countlens.model.cells import cell_edges, object_coverage, scene_edges
from countlens.model.geometry import Geometry
from countlens.model.sizing import refuse_partial_tokens

SIGLIP = Geometry.square(384, 14, 1, dropped=True)  # LLaVA-OneVision's base image and crops
SMOLVLM = Geometry.square(384, 14, 3, dropped=True)  # SmolVLM-Instruct's tiles: pixel-shuffled by 3
#: The tiny models at the real size: one 384 px tile (SmolVLM, its longest edge 768: 2 × 2 tiles and the
#: whole image) and OneVision's 384 px base image and crops.
TINY = {"smolvlm": dict(tile=384, patch=14, scale=3), "llava_onevision": dict(tile=384, patch=14)}
#: Through discover: SmolVLM one tile an image (9 × 9 tokens; its tiles are checked above). OneVision at
#: 384 px is 1,485 image tokens an image (base, one crop, newlines): every stage took 25-39 s, more than
#: the suite's budget affords; its cells and object tokens are checked above, and its real config's plan
#: prepares every stage's first batch (test_real_configs).
DISCOVER = {"smolvlm": dict(TINY["smolvlm"], tiles=1)}


def test_the_dropped_rule_keeps_whole_patches_and_the_cells_of_the_convolution():
    for g, tokens, side in ((SIGLIP, (27, 27), 14), (SMOLVLM, (9, 9), 42)):
        assert (g.patch_grid, g.token_grid, g.token_size, g.seen) == ((27, 27), tokens, side, (378, 378))
    # Cell k spans the patch convolution's own pixels, k·14 … (k+1)·14, on a scene at the image's size; the
    # strip past 378 px is in no cell. A whole grid is cut as before (round(k·n/m)).
    rows, cols = scene_edges(Scene(384, 384), SIGLIP)
    assert rows.tolist() == cols.tolist() == [14 * k for k in range(28)]
    rows, cols = scene_edges(Scene(768, 384), SMOLVLM)  # a scene twice as wide: cells twice as wide
    assert rows.tolist() == [42 * k for k in range(10)] and cols.tolist() == [84 * k for k in range(10)]
    whole = Geometry.square(192, 16, 2)
    assert scene_edges(Scene(100, 100), whole)[0].tolist() == cell_edges(100, 6, "high").tolist()
    assert Geometry(390, 384, 14, dropped=True).seen == (378, 378)  # 12 px and 6 px dropped


def test_an_object_only_in_the_dropped_strip_covers_no_cell_and_one_across_it_only_its_seen_part():
    inside = Obj("circle", "red", 381.0, 200.0, 5.0)  # pixels 379 … 382: the strip only
    across = Obj("square", "blue", 378.0, 21.0, 12.0)  # pixels 372 … 383 wide: half in cell 26, half dropped
    coverage = object_coverage(Scene(384, 384, (inside, across)), SIGLIP)
    assert coverage[0].sum() == 0
    assert np.argwhere(coverage[1] > 0).tolist() == [[1, 26]] and coverage[1, 1, 26] == 6 * 12 / 14**2


@pytest.fixture(scope="module")
def smolvlm(tiny_checkpoint):
    """The tiny SmolVLM at SmolVLM-Instruct's tile (2 × 2 tiles of 384 px and the whole image), read only."""
    return countlens.load(tiny_checkpoint("smolvlm", **TINY["smolvlm"]))


def test_object_tokens_on_the_tiny_smolvlm_at_384_px(smolvlm):
    """SmolVLM's tiny at SmolVLM-Instruct's tile: 9 × 9 tokens of 42 px (3 × 3 patches of 14 px) a tile. A
    square over pixels 84 … 126 × 42 … 84 is the thumbnail's cell (1, 2) and, on the 2 × 2 tiles (18 × 18
    tokens over the image), the 4 tokens whose centres fall in it; a dot in the dropped strip has none."""
    vlm = smolvlm
    assert vlm.geometry == SMOLVLM
    sample = SimpleNamespace(
        scene=Scene(384, 384, (Obj("square", "red", 105.0, 63.0, 42.0), Obj("circle", "blue", 200.0, 381.0, 5.0)))
    )
    batch = vlm.prepare([sample.scene.render()], ["How many?"])
    assert batch.tile_grids[0] == (2, 2) and len(batch.image_pos[0]) == 5 * 81
    mine = torch.isin(batch.image_pos[0], Objects(0).tokens(batch, 0, sample))
    assert batch.image_cell[0][mine].unique(dim=0).tolist() == [[1, 2]] and int(mine.sum()) == 4 + 1
    assert len(Objects(1, coverage=0).tokens(batch, 0, sample)) == 0
    with torch.no_grad():
        logits = vlm.forward(batch).logits
    assert torch.isfinite(logits).all()


def test_a_lit_cell_changes_most_a_token_of_that_cell_in_every_view(smolvlm):
    """As tests/unit/test_arch_matrix.py's ``test_each_image_token_sees_its_own_cell``, at 384 px: a white
    square over base cell k's own pixels (42k … 42(k+1), the strip left dark) changes most, in the
    thumbnail and in the 2 × 2 tiles, a token that `image_cell` maps to k: the last cells, beside the strip,
    too."""
    from test_arch_matrix import image_features

    def image(cell=None):
        a = np.zeros((384, 384, 3), np.uint8)
        if cell is not None:
            a[42 * cell[0] : 42 * (cell[0] + 1), 42 * cell[1] : 42 * (cell[1] + 1)] = 255
        return Image.fromarray(a)

    dark = smolvlm.prepare([image()], ["How many?"])
    base, cells, views = image_features(smolvlm, dark), dark.image_cell[0], torch.arange(5 * 81) >= 81 * 4
    for cell in [(8, 8), (4, 3)]:
        change = (image_features(smolvlm, smolvlm.prepare([image(cell)], ["How many?"])) - base).norm(dim=-1)
        for view in (views, ~views):
            top = torch.nonzero(view).flatten()[int(change[view].argmax())]
            assert tuple(cells[top].tolist()) == cell


@pytest.mark.parametrize(
    "layout, n_tokens, tiles, token, cell",
    [
        # SmolVLM, 1 × 5 tiles: tile 4's token 3 is centred at (4·384 + 3·42 + 21) / 5 = 336.6 px of the
        # thumbnail, cell 8 (its index alone says 7); token 8 at 378.6 px, in the strip: no cell.
        ("tiles_thumbnail", 6 * 81, (1, 5), 4 * 81 + 3, [0, 8]),
        ("tiles_thumbnail", 6 * 81, (1, 5), 4 * 81 + 8, [-1, -1]),
        # LLaVA-OneVision, 3 × 3 crops: column 56 (crop 2, token 2) centred at (768 + 2·14 + 7) / 3 = 267.7 px,
        # cell 19 (its index alone says 18).
        ("anyres", 729 + 81 * 82, None, 729 + 56, [0, 19]),
        ("anyres", 729 + 81 * 82, None, 729 + 80, [0, -1]),  # column 80: 379.7 px, the strip
    ],
)
def test_a_finer_view_s_tokens_sit_in_their_own_tile_s_seen_part(layout, n_tokens, tiles, token, cell):
    from countlens.model.layouts import token_cells

    geom = SMOLVLM if layout == "tiles_thumbnail" else SIGLIP
    got = token_cells(layout, geom, n_tokens, 0, tiles).cells[token].tolist()
    assert got == (cell if -1 not in cell else [-1, -1])


def test_a_remainder_the_family_does_not_drop_is_refused_before_any_forward(loaded):
    """LLaVA-1.5's CLIP (no ``drops_remainder``) at a fixed size of 4 whole 8 px patches and 2 px: refused,
    naming the size and the fix; a family that declares the rule gets ``dropped``."""
    ip = loaded("llava").processor.image_processor
    with pytest.raises(UnsupportedArchitectureError, match=r"to 34×34 px, which is 4×4 whole 8 px patches and 2×2 px"):
        refuse_partial_tokens(ip, 34, 34, 8, 1, "tiny llava", False)
    with pytest.raises(UnsupportedArchitectureError, match=r"ArchSpec\.drops_remainder"):
        refuse_partial_tokens(ip, 34, 34, 8, 1, "tiny llava", False)
    assert refuse_partial_tokens(ip, 34, 34, 8, 1, "tiny llava", False, drops=True) is True
    assert refuse_partial_tokens(ip, 32, 32, 8, 1, "tiny llava", False, drops=True) is False


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(merge_size=2),
            r"384 px high is 27 whole 14 px patches and 6 px dropped.*multiple of 2 \(e\.g\. 364 px\)",
        ),
        (dict(merge_size=4, image_height=42), r"42 px high is 3 whole 14 px patches.*merge_size 4"),
        (dict(partial=True), r"two rules; give one"),
    ],
)
def test_a_dropped_size_that_is_not_whole_tokens_is_refused(kw, match):
    args = dict(image_height=384, image_width=384, patch_size=14, merge_size=1, dropped=True) | kw
    with pytest.raises(CountlensError, match=match):
        Geometry(**args)


def test_a_size_of_no_rule_names_the_dropped_rule_and_dropped_takes_a_bool():
    with pytest.raises(CountlensError, match=r"384x384 is not a multiple of .* = 14.*dropped=True"):
        Geometry.square(384, 14)
    with pytest.raises(InputError, match="dropped must be True or False"):
        Geometry(384, 384, 14, dropped="yes")


@pytest.mark.parametrize("grid", [SIGLIP, SMOLVLM], ids=["merge1", "merge3"])
def test_generators_given_a_dropped_grid_place_objects_where_the_tower_sees(grid):
    pairs = count_pairs(6, kind="dots", grid=grid, seed=3) + count_pairs(6, kind="shapes", grid=grid, seed=4)
    scenes = [s for p in pairs for s in (p.clean.scene, p.corrupt.scene)]
    scenes += [s.scene for s in countingtricks(list(CASES), 1, grid, seed=5)]
    for scene in scenes:
        masks = scene.masks()
        assert (scene.width, scene.height) == (384, 384) and len(masks)
        assert not masks[:, 378:].any() and not masks[:, :, 378:].any()


@pytest.mark.slow
@pytest.mark.parametrize("name", DISCOVER)
def test_the_tiny_384_px_models_run_discover_s_stages(name, tiny_checkpoint, tmp_path, monkeypatch):
    """Every discover stage on SmolVLM at 384 px / 14 px patches (its released size), its figures left
    out as for most of tests/integration/test_new_architectures.py (its ``undrawn_report``)."""
    import dataclasses

    import countlens.pipeline.report as report_module
    from countlens.pipeline.config import DiscoverConfig
    from countlens.pipeline.discover import discover

    undrawn = tuple(dataclasses.replace(s, draw=lambda ctx: None) for s in report_module.SECTIONS)
    monkeypatch.setattr(report_module, "SECTIONS", undrawn)

    vlm = countlens.load(tiny_checkpoint(name, **DISCOVER[name]))
    assert vlm.geometry.dropped and vlm.geometry.seen == (378, 378)
    config = DiscoverConfig(n_per_case=1, n_pairs=2, n_samples=2, batch_size=8, tasks=("count",))
    text = discover(vlm, tmp_path / "run", config, log=lambda _: None).read_text()
    for section in ("COUNTINGTRICKS", "visual activation patching", "Logit lens", "Head classes", "Head temperature"):
        assert section in text, section
    heads = pd.read_csv(tmp_path / "run" / "heads.csv")
    assert len(heads) == sum(vlm.arch.head_counts) and heads["importance"].notna().all()


def test_an_export_spec_names_dropped_only_where_set():
    """export.json's grid: a whole grid's as before the field existed (an earlier export still resumes), a
    dropped one's with ``dropped``."""
    from countlens.datasets.export import _export_spec

    assert _export_spec(["1A"], 1, Geometry.square(192, 16), 0, {})["grid"] == {
        "image_height": 192,
        "image_width": 192,
        "patch_size": 16,
        "merge_size": 1,
        "partial": False,
    }
    assert _export_spec(["1A"], 1, SIGLIP, 0, {})["grid"]["dropped"] is True
