"""The self-check's five groups (`countlens.pipeline.selfcheck`): each a function of a `VLM` returning rows.

Each check measures one invariant on the loaded model and says, when it fails, what is wrong and
what to do; the module docstring of `countlens.pipeline.selfcheck` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from countlens import circuits
from countlens.analysis.evaluate import score
from countlens.circuits.engine.edits import Edit, cache_run, run_edits
from countlens.circuits.engine.pair_batch import prepare_pairs
from countlens.circuits.methods.patching import image_group
from countlens.circuits.sites import HeadZ, Residual, group_mask
from countlens.datasets.pairs import count_pairs
from countlens.datasets.tasks import task_samples
from countlens.errors import CountlensError
from countlens.model import memory as mem
from countlens.model.adapt import module_of
from countlens.model.answers import sequence_scores
from countlens.model.consistency import check_processor
from countlens.model.layouts import token_cells
from countlens.model.processors import useful_grid
from countlens.pipeline.config import default_prompt
from countlens.pipeline.costs import Forward, forward_bytes

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

#: Rounding budget per dtype, relative to the logits' size (see the module docstring).
REL: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass(frozen=True)
class CheckRow:
    """One check: ``passed`` None when skipped (``figure`` says why)."""

    group: str
    name: str
    passed: bool | None
    figure: str
    tolerance: str = ""
    fix: str = ""

    @property
    def status(self) -> str:
        return {True: "passed", False: "FAILED", None: "skipped"}[self.passed]


COUNTS = range(0, 21)
PATHS = "module paths"
SPEC_FIX = "the spec (countlens/model/arch.py) does not fit this checkpoint: fix its path or config name"


def _rel(vlm: VLM) -> float:
    return REL.get(vlm.hf.dtype, 1e-2)


def _tol(vlm: VLM, what: str) -> str:
    return f"{_rel(vlm):g} × {what} ({str(vlm.hf.dtype).removeprefix('torch.')} rounding)"


def _prompt(vlm: VLM) -> str:
    return default_prompt(vlm.name)


# ----------------------------------------------------------------------------------------------- spec


def spec(vlm: VLM) -> list[CheckRow]:
    arch, rows = vlm.arch, []
    missing, shapes = [], []
    paths = [arch.spec.final_norm, arch.spec.lm_head, arch.spec.vision_blocks, arch.spec.vision_tower]
    paths += [arch.spec.projector]
    for layer in range(arch.n_layers):
        paths += [arch.layer(layer), arch.attention(layer), arch.o_proj(layer)]
        paths += [arch.q_site(layer)] if arch.softmax(layer) else []  # a linear-attention layer has no q
    for path in paths:
        try:
            module_of(vlm.hf, path)
        except AttributeError:
            missing.append(path)
    rows.append(
        CheckRow(
            "spec",
            PATHS,
            not missing,
            f"{len(paths) - len(missing)}/{len(paths)} resolve",
            "all",
            "" if not missing else f"{', '.join(missing[:3])} missing: {SPEC_FIX}",
        )
    )
    if not missing:
        for layer in range(arch.n_layers):
            o = module_of(vlm.hf, arch.o_proj(layer))
            h, d = arch.heads(layer), arch.head_dim(layer)
            if getattr(o, "in_features", h * d) != h * d:
                shapes.append(f"layer {layer} ({arch.kind(layer)}) o_proj takes {o.in_features}, not {h}×{d}")
        head_rows = module_of(vlm.hf, arch.lm_head).weight.shape[0]
        try:
            top = max(i for n in COUNTS for i in vlm.answer_ids(str(n)))
        except CountlensError:  # answers that cannot be written: the end-of-answer row says why
            top = -1
        if head_rows <= top:
            shapes.append(f"lm_head has {head_rows} rows, but answer token {top} is scored")
    rows.append(
        CheckRow(
            "spec",
            "head and vocabulary shapes",
            None if missing else not shapes,
            "; ".join(shapes) or f"{_head_shapes(arch)}, answer ids < lm_head rows",
            "exact",
            f"{SPEC_FIX} (head counts come from the text config)" if shapes else "",
        )
    )
    try:
        check_processor(vlm, vlm.name)
        rows.append(
            CheckRow("spec", "processor agrees with the vision config", True, "tile size and tokens per tile", "exact")
        )
    except CountlensError as err:
        rows.append(
            CheckRow(
                "spec",
                "processor agrees with the vision config",
                False,
                str(err),
                "exact",
                "use the checkpoint's own processor files",
            )
        )
    rows.append(_end_of_answer(vlm))
    return rows


def _end_of_answer(vlm: VLM) -> CheckRow:
    """Where the vocabulary writes a count as a prefix of another, the chat template must end an
    answer with the token countlens appends (`VLM.answer_end`)."""
    name = "answers end as the chat template ends them"
    try:
        end = vlm.answer_end
    except CountlensError as err:
        return CheckRow("spec", name, False, str(err), "exact", "set tokenizer.eos_token or a chat template")
    if end is None:
        return CheckRow("spec", name, True, "numbers are whole tokens: bare answers", "exact")
    if vlm.arch.spec.plain_prompt is not None and not getattr(vlm.processor, "chat_template", None):
        token = vlm.tokenizer.convert_ids_to_tokens([end])[0]
        ok = end == vlm.tokenizer.eos_token_id
        figure = f"no chat template ({vlm.arch.name}'s own prompt): answers end with eos {token!r} ({end})"
        return CheckRow("spec", name, ok, figure, "exact", "" if ok else "set tokenizer.eos_token")
    mark = "ANSWERMARK"
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": mark}]},
    ]
    try:
        text = vlm.processor.apply_chat_template(messages, tokenize=False)
    except Exception as err:  # noqa: BLE001 — a template that cannot render an answer at all
        text, why = "", str(err)
    token = vlm.tokenizer.convert_ids_to_tokens([end])[0]
    if mark not in text:
        why = why if not text else "the answer's text is not in it"
        fix = "give the processor the checkpoint's chat template"
        return CheckRow("spec", name, False, f"the chat template cannot render an answer ({why})", "exact", fix)
    after = vlm.tokenizer(text.split(mark, 1)[1], add_special_tokens=False)["input_ids"][:1]
    written = vlm.tokenizer.convert_ids_to_tokens(after)[0] if after else "nothing"
    # A template that writes no special token after answers (LLaVA-1.5's): countlens ends them with
    # eos, the token the model ends its generation with.
    plain = not after or after[0] not in set(vlm.tokenizer.all_special_ids)
    ok = after == [end] or (plain and end == vlm.tokenizer.eos_token_id)
    figure = f"answer, then {token!r} ({end})" if after == [end] else f"the template writes {written!r} after an answer"
    figure += f"; countlens ends answers with eos {token!r}" if ok and after != [end] else ""
    fix = "" if ok else f"countlens ends answers with {token!r}, which this template does not write: fix the template"
    return CheckRow("spec", name, ok, figure, "exact", fix)


# ---------------------------------------------------------------------------------------------- image


def _image_features(vlm: VLM, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, cells) of sample 0's image tokens (or a cross-attention model's states)."""
    cross = vlm.arch.spec.cross_attention
    with torch.no_grad(), vlm.read(batch):
        site = vlm.module(cross.states).output if cross else vlm.module(vlm.arch.layer(0)).input
        x = site.save()
    x = x[0] if isinstance(x, tuple) else x
    if cross:
        return x[0].reshape(-1, x.shape[-1]).float().cpu(), batch.state_cells[0]
    return x[0, batch.image_pos[0].to(x.device)].float().cpu(), batch.image_cell[0]


def image(vlm: VLM) -> list[CheckRow]:
    g = vlm.geometry
    rows, cols = g.token_grid
    h, w = g.image_height, g.image_width
    try:
        blank = vlm.prepare([Image.new("RGB", (w, h), "white")], ["How many objects are there?"])
    except CountlensError as err:
        return [
            CheckRow(
                "image",
                "image tokens of the model's own image size",
                False,
                str(err),
                "exact",
                "the processor and the config disagree: use the checkpoint's own files",
            )
        ]
    n = len(blank.state_cells[0]) if blank.state_cells else len(blank.image_pos[0])
    out = [
        CheckRow(
            "image",
            "image tokens of the model's own image size",
            True,
            f"{n} for {h}×{w} px, a {rows}×{cols} grid",
            "exact",
        )
    ]
    base, cells = _image_features(vlm, blank)
    views = token_cells(
        vlm.arch.spec.layout, g, len(cells), 0, blank.tile_grids[0], useful_grid(vlm.processor, h, w)
    ).views
    # A quadrant, not one cell: a trained tower spreads one cell's change over the whole image (the
    # organism: a lit corner cell on black changed a token at another corner most; on black even a lit
    # quadrant, which looks like its white background), but the tokens mapped inside a darkened
    # quadrant of a white image change more, on average, than those outside, unless the map is wrong.
    ratios = []
    for top, left in ((0, 0), ((rows + 1) // 2, (cols + 1) // 2)):
        r1, c1 = (top + (rows + 1) // 2, left + (cols + 1) // 2) if top == 0 else (rows, cols)
        a = np.full((h, w, 3), 255, np.uint8)  # white, as counting scenes are
        a[top * h // rows : r1 * h // rows, left * w // cols : c1 * w // cols] = 0
        lit, _ = _image_features(vlm, vlm.prepare([Image.fromarray(a)], ["How many objects are there?"]))
        change = (lit - base).norm(dim=-1)
        inside = (cells[:, 0] >= top) & (cells[:, 0] < r1) & (cells[:, 1] >= left) & (cells[:, 1] < c1)
        placed = cells[:, 0] >= 0
        for view in views.unique():
            here = (views == view) & placed
            outside = here & ~inside
            if (here & inside).any() and outside.any():
                ratios.append(float(change[here & inside].mean() / change[outside].mean().clamp(min=1e-12)))
    worst = min(ratios)
    out.append(
        CheckRow(
            "image",
            "a darkened quadrant changes its own tokens most",
            worst > 1,
            f"inside / outside change ≥ {worst:.2f} (2 quadrants × {len(views.unique())} view(s))",
            "> 1",
            "the image-token layout does not fit this processor: check ArchSpec.layout and the processor's tiling"
            if worst <= 1
            else "",
        )
    )
    return out


# -------------------------------------------------------------------------------------------- answers


def answers(vlm: VLM) -> list[CheckRow]:
    bad = []
    for n in COUNTS:
        ids = vlm.answer_ids(str(n))
        body = ids if vlm.answer_end is None else ids[:-1]
        if vlm.tokenizer.decode(body).strip() != str(n):
            bad.append(f"{n} → {vlm.tokenizer.decode(body)!r}")
    rows = [
        CheckRow(
            "answers",
            "counts 0-20 round-trip through the tokenizer",
            not bad,
            "; ".join(bad[:3]) or "21 of 21",
            "exact",
            "the tokenizer writes numbers another way: check its pre-tokenizer" if bad else "",
        )
    ]
    samples = task_samples("count", 2, 0, image_size=vlm.geometry.image_height)
    cached = score(vlm, samples, method="candidates")["logp_gold"].values
    batch = vlm.prepare_samples(samples, teacher_force=True)
    with torch.no_grad():
        logits = vlm.forward(batch, use_cache=False).logits.float()
    width = max(len(a) for a in batch.answer_ids)
    full = sequence_scores(logits[:, -width:], batch.answer_ids)[1].cpu().numpy()
    scale = max(1.0, float(logits.abs().max()))
    err = float(np.abs(cached - full).max())
    limit = 2 * width * _rel(vlm) * scale
    rows.append(
        CheckRow(
            "answers",
            "candidate scoring (KV cache) = a full forward",
            err <= limit,
            f"|Δ log p| = {err:.2e}",
            f"{limit:.1e} = 2 × tokens × " + _tol(vlm, f"logit size {scale:.1f}"),
            "" if err <= limit else "scoring with a KV cache differs from a full forward: report it",
        )
    )
    return rows


# -------------------------------------------------------------------------------------- interventions


def interventions(vlm: VLM) -> list[CheckRow]:
    side = vlm.geometry.image_height
    pairs = count_pairs(1, 3, 5, kind="polygons", image_size=side, prompt=_prompt(vlm), seed=0)
    pb = prepare_pairs(vlm, pairs)
    with torch.no_grad():
        scale = max(
            1.0, float(vlm.forward(pb.clean).logits.abs().max()), float(vlm.forward(pb.corrupt).logits.abs().max())
        )
    rows = []
    wholes = [("image", image_group(vlm), -1)] if vlm.arch.image_in_embeddings else []
    wholes.append(("every position at the last layer", "all", vlm.arch.n_layers - 1))
    for what, group, layer in wholes:
        ds = circuits.patch_layers(vlm, pairs, groups=(group,), layers=[layer])
        gap = abs(float(ds.corrupt_logit_diff.sum() - ds.clean_logit_diff.sum()))
        effect = float(ds.effect.values.item())
        if gap == 0:
            rows.append(
                CheckRow(
                    "interventions",
                    f"patching {what} carries the whole effect",
                    None,
                    "clean and corrupt logit differences are equal: no effect to carry",
                )
            )
            continue
        limit = 2 * _rel(vlm) * scale / gap
        label = (
            "the image states where they enter"
            if group == "image_states"
            else ("every image token's embedding" if group == "image" else what)
        )
        rows.append(
            CheckRow(
                "interventions",
                f"patching {label} carries the whole effect",
                abs(effect - 1) <= limit,
                f"effect {effect:.6f}",
                f"±{limit:.1e} = 2 × " + _tol(vlm, f"logit size {scale:.1f}") + f" / gap {gap:.3g}",
                ""
                if abs(effect - 1) <= limit
                else "a patch misses part of the image: the spec's sites or layout do not fit",
            )
        )
    clean = cache_run(vlm, pb.clean, range(vlm.arch.n_layers))
    every = group_mask(pb.clean, "all")
    mid = vlm.arch.n_layers // 2
    out = run_edits(vlm, pb.clean, clean, [Edit(Residual(mid), every), Edit(HeadZ(mid, 0), every)])
    err = float((out - clean["logits"].cpu()).abs().max())
    limit = _rel(vlm) * scale
    rows.append(
        CheckRow(
            "interventions",
            "self-patching changes nothing",
            err <= limit,
            f"max |Δ logit| = {err:.2e}",
            f"{limit:.1e} = " + _tol(vlm, "logit size"),
            "" if err <= limit else "edits write somewhere else than they read: report it",
        )
    )
    # One layer of each kind (the nearest the middle): full, sliding, linear attention, cross-attention.
    by_kind: dict[str, int] = {}
    for layer in sorted(range(vlm.arch.n_layers), key=lambda la: abs(la - mid)):
        by_kind.setdefault(vlm.arch.kind(layer), layer)
    for layer in sorted(by_kind.values()):
        rows.append(_heads_sum(vlm, pb.clean, layer))
    base = vlm.forward(pb.clean).logits
    softmax = min(vlm.arch.softmax_layers, key=lambda la: abs(la - mid))
    with circuits.head_temperature(vlm, {(softmax, 0): 1.0}):
        same = torch.equal(vlm.forward(pb.clean).logits, base)
    rows.append(
        CheckRow(
            "interventions",
            "β = 1 head temperature changes nothing",
            same,
            "bit-identical" if same else "differs",
            "exact",
        )
    )
    samples = [p.clean for p in pairs]
    abl = circuits.ablate(vlm, samples, [])
    err = float(np.abs(abl["logp"].values - abl["base_logp"].values).max())
    rows.append(
        CheckRow(
            "interventions",
            "an ablation of no head changes nothing",
            err <= limit,
            f"|Δ log p| = {err:.2e}",
            f"{limit:.1e}",
        )
    )
    return rows


def _head_shapes(arch) -> str:
    """ "4 heads × 16", or per layer kind where layers differ ("full 4 × 32, sliding 4 × 16")."""
    if arch.uniform_heads:
        return f"{arch.n_heads} heads × {arch.d_head}"
    shapes = {arch.kinds[i]: (arch.head_counts[i], arch.head_dims[i]) for i in range(arch.n_layers)}
    return "heads " + ", ".join(f"{kind} {h} × {d}" for kind, (h, d) in shapes.items())


def _heads_sum(vlm: VLM, batch, layer: int) -> CheckRow:
    """Each head's z times its columns of o_proj, plus the bias, is o_proj's output."""
    o = module_of(vlm.hf, vlm.arch.o_proj(layer))
    with torch.no_grad(), vlm.read(batch):
        z = vlm.module(vlm.arch.o_proj(layer)).input.save()
        y = vlm.module(vlm.arch.o_proj(layer)).output.save()
    h, d = vlm.arch.heads(layer), vlm.arch.head_dim(layer)
    weight = o.weight.detach().float().view(-1, h, d)
    zh = z.float().view(*z.shape[:-1], h, d)
    parts = torch.einsum("bshd,ohd->bsho", zh, weight)
    total = parts.sum(-2) + (o.bias.detach().float() if o.bias is not None else 0)
    magnitude = float(torch.einsum("bshd,ohd->bso", zh.abs(), weight.abs()).max())
    err = float((total - y.float()).abs().max())
    limit = _rel(vlm) * max(1.0, magnitude)
    return CheckRow(
        "interventions",
        f"the heads' contributions sum to layer {layer}'s attention output ({vlm.arch.kind(layer)})",
        err <= limit,
        f"max |Δ| = {err:.2e}",
        f"{limit:.1e} = " + _tol(vlm, f"summed size {magnitude:.1f}"),
        "" if err <= limit else "o_proj does not read the heads in order: the head layout is wrong",
    )


# --------------------------------------------------------------------------------------------- memory


def memory(vlm: VLM) -> list[CheckRow]:
    name = "one stacked sweep forward fits the plan"
    if vlm.device.type != "cuda":
        return [CheckRow("memory", name, None, f"no device memory counter on {vlm.device.type}")]
    pairs = count_pairs(2, 3, 5, kind="polygons", image_size=vlm.geometry.image_height, prompt=_prompt(vlm), seed=0)
    pb = prepare_pairs(vlm, pairs)
    w = mem.widths(vlm)
    cache = cache_run(vlm, pb.clean, range(vlm.arch.n_layers))
    replicas = [Edit(HeadZ(layer, 0), group_mask(pb.clean, "all")) for layer in range(min(4, vlm.arch.n_layers))]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run_edits(vlm, pb.clean, cache, replicas, max_rows=len(replicas) * len(pb.clean))
    peak = torch.cuda.max_memory_allocated() - before
    seq = int(pb.clean.inputs["input_ids"].shape[1])
    planned = forward_bytes(w, Forward(len(replicas) * len(pb.clean), seq, images=0), pb.clean.patches(w.merge))
    planned += mem.replica_copy_bytes(w, seq, pb.clean.patches(w.merge)) * len(replicas) * len(pb.clean)
    return [
        CheckRow(
            "memory",
            name,
            peak <= planned,
            f"measured {peak / 2**20:.0f} MiB, planned {planned / 2**20:.0f} MiB",
            "measured ≤ planned",
            "" if peak <= planned else "the planner underestimates this model: lower --memory",
        )
    ]
