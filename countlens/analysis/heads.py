"""Head classification: from per-head measurements to the papers' functional classes.

Inputs, all over (layer, head): HeadLens ``vgs`` (share of visual-attribute words among the decoded
top-k) and ``cter`` (share of number tokens), ``image_attention`` (share of the last position's
attention on image tokens), ``importance`` (one scale: |effect| of patching the head; `discover`
passes its head-patching effect, the papers' γ_h), ``constancy`` (how often the head's top-1
decoded token is the same across samples) and, optionally, ``alignment`` (how often its top-1
token is the sample's count) and ``difficulty`` (share of difficulty words in its top-k). Depth is
layer / (n_layers − 1). Rules, first match wins (thresholds are `countlens.settings.HeadThresholds` fields):

1. **visual grounding** — early (depth ≤ early), reads the image (image_attention ≥ image_high) and
   decodes visual attributes (vgs ≥ vgs_min);
2. **cross-modal routing** — in the routing band (routing_from ≤ depth < routing_to, default
   0 … late), reads the image (image_attention ≥ image_high), decodes numbers (cter ≥ cter_min) and
   matters (importance ≥ important);
3. **counting aggregation** — late (depth ≥ late), barely reads the image (< image_low), decodes
   numbers, matters, and (align_min > 0) its top-1 token is the count on ≥ align_min of samples;
4. **awareness** — decodes the same top-1 token on most samples (constancy ≥ constant), whatever the
   count (an existence signal), or (difficulty_min set) difficulty words (difficulty ≥ difficulty_min);
5. **other**.

The defaults are countlens's, sized for the organism; `countlens.pipeline.presets` holds the bands that class
a paper's layer ranges as the paper does.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr

from countlens.errors import InputError, RunDirError
from countlens.labels import head_label
from countlens.settings import HeadThresholds
from countlens.validate import require_dataarray

CLASSES: tuple[str, ...] = ("visual grounding", "cross-modal routing", "counting aggregation", "awareness", "other")


def constancy(top1: xr.DataArray) -> xr.DataArray:
    """Share of samples whose top-1 decoded token is the head's most common one: over (layer, head)."""

    def mode_share(v: np.ndarray) -> float:
        _, counts = np.unique(v, return_counts=True)
        return counts.max() / len(v)

    return xr.apply_ufunc(mode_share, top1, input_core_dims=[["sample"]], vectorize=True)


def classify_heads(
    vgs: xr.DataArray,
    cter: xr.DataArray,
    image_attention: xr.DataArray,
    importance: xr.DataArray,
    constancy: xr.DataArray | None = None,
    thresholds: HeadThresholds = HeadThresholds(),
    alignment: xr.DataArray | None = None,
    difficulty: xr.DataArray | None = None,
) -> pd.DataFrame:
    """One row per head: the measurements, depth and ``class``; sorted by importance."""
    for name, value in (("vgs", vgs), ("cter", cter), ("image_attention", image_attention), ("importance", importance)):
        require_dataarray(value, name)
        if not {"layer", "head"} <= set(value.dims):
            raise InputError(f"{name} must be over (layer, head), got dims {value.dims}")
    for name, value in (("constancy", constancy), ("alignment", alignment), ("difficulty", difficulty)):
        if value is not None:
            require_dataarray(value, name)
    if not isinstance(thresholds, HeadThresholds):
        raise InputError(f"thresholds must be a HeadThresholds, got {type(thresholds).__name__}")
    t = thresholds
    layers = vgs.layer.values
    n_layers = int(layers.max()) + 1
    plain = lambda da: da.reset_coords(drop=True)  # noqa: E731 - drop scalar coords such as task=…
    frame = xr.Dataset(
        {
            "vgs": plain(vgs),
            "cter": plain(cter),
            "image_attention": plain(image_attention),
            "importance": plain(abs(importance)),
        }
    )
    for name, value in (("constancy", constancy), ("alignment", alignment), ("difficulty", difficulty)):
        if value is not None:
            frame[name] = plain(value)
    df = frame.to_dataframe().reset_index()
    df = df[df["importance"].notna()].copy()  # slots beyond a layer's own heads are no heads
    df["depth"] = df["layer"] / max(1, n_layers - 1)
    for name in ("constancy", "alignment", "difficulty"):
        if name not in df:
            df[name] = np.nan
    routing_to = t.late if t.routing_to is None else t.routing_to

    def rule(r) -> str:
        numeric_and_important = r.cter >= t.cter_min and r.importance >= t.important
        if r.depth <= t.early and r.image_attention >= t.image_high and r.vgs >= t.vgs_min:
            return CLASSES[0]
        if t.routing_from <= r.depth < routing_to and r.image_attention >= t.image_high and numeric_and_important:
            return CLASSES[1]
        if (
            r.depth >= t.late
            and r.image_attention < t.image_low
            and numeric_and_important
            and (t.align_min <= 0 or r.alignment >= t.align_min)
        ):
            return CLASSES[2]
        if r.constancy >= t.constant or (t.difficulty_min is not None and r.difficulty >= t.difficulty_min):
            return CLASSES[3]
        return CLASSES[4]

    df["class"] = df.apply(rule, axis=1)
    df.insert(0, "head_id", [head_label(h) for h in zip(df["layer"], df["head"])])
    df.attrs["thresholds"] = asdict(t)
    return df.sort_values("importance", ascending=False, kind="stable").reset_index(drop=True)


def head_sites(heads: xr.Dataset) -> xr.DataArray:
    """(layer, head): True where the slot is a head — patched, so its per-pair logit diffs are numbers;
    False beyond a layer's own heads (Qwen3.5's softmax layers have fewer than its linear ones)."""
    if "logit_diff" not in heads:
        return xr.ones_like(heads.effect, dtype=bool)
    return heads.logit_diff.notnull().any("pair")


def check_effects(effect: xr.DataArray, where: str = "results/heads.nc", sites: xr.DataArray | None = None) -> None:
    """Refuse head patching effects that are not finite (the heads' importance, γ_h), naming the file;
    ``sites`` (`head_sites`): only those slots are heads.

    Patching divides by the clean − corrupt logit difference summed over the pairs: it is 0 (NaN or
    ±inf effects) when the model does not tell the pairs' counts apart, so recomputing on the same
    pairs gives the same; other pairs (more of them, another kind, a prompt the model answers) do."""
    bad = ~np.isfinite(effect.values.astype(float))
    if sites is not None:
        bad &= sites.transpose(*effect.dims).values
    if bad.any():
        raise RunDirError(
            f"{where} has {int(bad.sum())} effects that are not finite: the model gives the clean and corrupt "
            "sides of its pairs the same logit difference, so no head's share of it is defined; use pairs it "
            f"tells apart (more pairs, another pair kind or prompt) and delete {where} to recompute it"
        )


#: What `head_table` reads of each stage's result: its file, and the dims of each variable it reads.
#: The variables are aligned by dim name, so a result whose dims were renamed would broadcast into a
#: table of every head against every other — refused by `check_dims` instead.
RESULT_DIMS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "heads": ("results/heads.nc", {"effect": ("layer", "head"), "logit_diff": ("layer", "head", "pair")}),
    "ablation": ("results/ablation.nc", {"logp_drop": ("task", "layer", "head")}),
    "headlens": (
        "results/headlens.nc",
        {
            "vgs": ("layer", "head"),
            "cter": ("layer", "head"),
            "difficulty": ("layer", "head"),
            "token_id": ("layer", "head", "sample", "k"),
            "token": ("layer", "head", "sample", "k"),
            "count_token": ("sample",),
        },
    ),
    "attention": ("results/attention.nc", {"image_attention": ("layer", "head", "sample")}),
}


def check_dims(stage: str, result: xr.Dataset, optional: tuple[str, ...] = ("logit_diff",)) -> None:
    """Refuse a stage's result (`RESULT_DIMS`) that lacks a variable `head_table` reads or holds it over
    other dims (an edited or foreign file), naming the file, the variable and both dims; ``optional``
    variables may be absent."""
    file, wanted = RESULT_DIMS[stage]
    for name, dims in wanted.items():
        if name not in result:
            if name in optional:
                continue
            raise RunDirError(
                f"{file} lacks the variable {name!r}: it was edited, or not written by `countlens discover`; "
                f"delete {file} and rerun `countlens discover` with the same --out to recompute it"
            )
        if set(result[name].dims) != set(dims):
            raise RunDirError(
                f"{file}: {name!r} is over the dims {list(result[name].dims)}, not {list(dims)}: the file was "
                f"edited; delete {file} and rerun `countlens discover` with the same --out to recompute it"
            )


def head_table(
    heads: xr.Dataset, abl: xr.Dataset, hl: xr.Dataset, att: xr.Dataset, thresholds: HeadThresholds = HeadThresholds()
) -> pd.DataFrame:
    """Classify heads from a discover run's results (`countlens.pipeline.rundir.load_run`).
    ``importance`` is on one scale, the paper's γ_h: |effect| of patching the head's z (the share of
    the logit difference it carries, 0 … 1). ``ablation_drop`` is a column of its own, the counting
    task's mean drop in log p(gold) (nats) when the head is mean-ablated: a second measure, not
    mixed into the first. ``alignment``: the share of counting samples whose top-1 decoded token is
    the first token of their count; ``difficulty``: HeadLens's difficulty-word share. Both come from
    the HeadLens results (`countlens.circuits.lenses.headlens.HeadLens.decode` writes ``count_token`` and
    ``difficulty``)."""
    check_dims("heads", heads)
    missing = [name for name in ("count_token", "difficulty") if name not in hl]
    if missing:
        raise RunDirError(
            f"the run's HeadLens results (results/headlens.nc) lack {missing}: they were written "
            "by an older countlens; delete results/headlens.nc and rerun `countlens discover` "
            "with the same --out to recompute them"
        )
    for stage, result in (("ablation", abl), ("headlens", hl), ("attention", att)):
        check_dims(stage, result)
    check_effects(heads.effect, sites=head_sites(heads))
    top1 = hl.token_id.isel(k=0)
    alignment = (top1 == hl.count_token).where(hl.count_token >= 0).mean("sample")
    table = classify_heads(
        hl.vgs,
        hl.cter,
        att.image_attention.mean("sample"),
        np.abs(heads.effect),
        constancy(hl.token.isel(k=0)),
        thresholds,
        alignment=alignment,
        difficulty=hl.difficulty,
    )
    drop = abl.logp_drop.sel(task="count")
    table.insert(
        table.columns.get_loc("importance") + 1,
        "ablation_drop",
        [float(drop.sel(layer=la, head=h)) for la, h in zip(table["layer"], table["head"])],
    )
    if "kind" in heads.coords:  # each head's layer kind: full, sliding, chunked, linear or cross attention
        kinds = dict(zip(heads.layer.values.tolist(), heads.kind.values.tolist()))
        table.insert(table.columns.get_loc("class") + 1, "kind", [kinds[la] for la in table["layer"]])
    return table


HEAD_COLUMNS: tuple[str, ...] = ("layer", "head", "class", "importance")


def read_heads(circuit: str | Path):
    """A discover run's head table (``heads.csv``), checked for the columns fine-tuning reads."""
    import pandas as pd

    path = Path(circuit) / "heads.csv"
    if not path.exists():
        raise RunDirError(f"no circuit at {circuit}: {path} is missing; run `countlens discover --out {circuit}` first")
    try:
        table = pd.read_csv(path)
    except (ValueError, pd.errors.ParserError) as err:
        raise RunDirError(f"{path} is not a head table ({err}); rerun `countlens discover --out {circuit}`") from None
    missing = [c for c in HEAD_COLUMNS if c not in table.columns]
    if missing or table.empty:
        raise RunDirError(
            f"{path} is not a countlens head table: it lacks the columns {missing or list(HEAD_COLUMNS)} "
            f"or has no rows; rerun `countlens discover --out {circuit}` or `countlens classify --run {circuit}`"
        )
    try:
        table = table.astype({"layer": int, "head": int, "importance": float})
    except (ValueError, TypeError) as err:
        raise RunDirError(f"{path}: the layer, head and importance columns must be numbers ({err})") from None
    unknown = sorted(set(table["class"]) - set(CLASSES), key=str)
    nan = table.loc[~np.isfinite(table["importance"]), "head_id" if "head_id" in table else "head"].tolist()
    if unknown or nan:
        what = f"unknown classes {unknown} (use {list(CLASSES)})" if unknown else f"no finite importance at {nan[:5]}"
        raise RunDirError(
            f"{path} has {what}: it was edited or its run is incomplete; rerun `countlens classify --run {circuit}` "
            f"(or delete {path} and rerun `countlens discover --out {circuit}`)"
        )
    return table


#: The head table's columns in the order every export and the report show them.
TABLE_COLUMNS: tuple[str, ...] = (
    "head_id",
    "layer",
    "head",
    "class",
    "kind",
    "importance",
    "ablation_drop",
    "image_attention",
    "vgs",
    "cter",
    "constancy",
    "alignment",
    "difficulty",
    "depth",
)


def shown_columns(df: pd.DataFrame) -> pd.DataFrame:
    """The head table as it is shown: `TABLE_COLUMNS` in order, those it has (alignment and difficulty
    left out where no head has one), so a table read back from heads.csv shows as the one computed."""
    return df[[c for c in TABLE_COLUMNS if c in df and not (c in ("alignment", "difficulty") and df[c].isna().all())]]


def export_heads(df: pd.DataFrame, out: str | Path, stem: str = "heads") -> list[Path]:
    """Write the table as CSV, Markdown and LaTeX; returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = shown_columns(df)
    paths = [out / f"{stem}.csv", out / f"{stem}.md", out / f"{stem}.tex"]
    table.to_csv(paths[0], index=False)
    paths[1].write_text(table.to_markdown(index=False, floatfmt=".3f") + "\n")
    paths[2].write_text(table.to_latex(index=False, float_format="%.3f"))
    return paths
