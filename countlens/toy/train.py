"""Train the model organism from scratch: `countlens toy train --seed 0 --out DIR`.

The recipe: a random-init `ToyConfig` Qwen2-VL (init std 0.1) whose vision tower is pretrained
first, like the encoder of a real VLM: optionally on the shape of one object in small crops
(`vision_pretrain`, off in the shipped recipe), then on what each image token's cell holds in full
scenes (`vision_warmup`). Optionally the tower's patch embedding and blocks are then frozen
(`freeze_vision`). The model then trains with AdamW, linear warmup and cosine decay on the
cross-entropy of the single answer token at the last prompt position, on an endless stream of task
scenes from `countlens.datasets.tasks` (training seeds ≥ `TRAIN_SEED_BASE`, so evaluation seeds
are never seen). Every step's batch is a pure function of (seed, step), and torch is seeded, so a rerun
with the same seed and thread count reproduces the weights.

Batches skip the HF processor on purpose: rendering and patchifying 64 images through the PIL
processor costs more than the training step. `collate` builds the same tensors with numpy/torch;
a test checks that they equal the processor's output.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from countlens.datasets.scene import OBJECT_COLORS, SHAPES, Obj, Scene, place_objects
from countlens.datasets.tasks import TASKS, TRAIN_SEED_BASE, TaskSample, object_sizes, sample_rng, task_sample
from countlens.errors import ConfigError, CountlensError
from countlens.files import claim_directory
from countlens.toy.recipe import (
    ToyConfig,
    TrainConfig,
    build_image_processor,
    build_model,
    build_tokenizer,
    save_recipe,
)
from countlens.validate import require_callback, require_path


def training_sample(seed: int, index: int, cfg: ToyConfig, tc: TrainConfig) -> TaskSample:
    """The ``index``-th training sample: its task drawn from the mix, its scene from a training seed."""
    tasks = list(tc.task_mix)
    p = np.array([tc.task_mix[t] for t in tasks], dtype=float)
    task = tasks[sample_rng(seed, "mix", index).choice(len(tasks), p=p / p.sum())]
    return task_sample(task, TRAIN_SEED_BASE + seed, index, image_size=cfg.image_size)


class Collator:
    """Samples → model inputs for a fixed-size Qwen2-VL processor, without PIL round-trips."""

    def __init__(self, cfg: ToyConfig, tokenizer=None, image_processor=None):
        self.cfg = cfg
        self.tok = tokenizer or build_tokenizer()
        ip = image_processor or build_image_processor(cfg)
        self.mean = torch.tensor(ip.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(ip.image_std, dtype=torch.float32).view(1, 3, 1, 1)
        self.t_patch = ip.temporal_patch_size
        rows, cols = cfg.geometry.token_grid
        self.n_image_tokens = rows * cols
        self._prompt_cache: dict[str, list[int]] = {}

    def prompt_ids(self, question: str) -> list[int]:
        if question not in self._prompt_cache:
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            text = text.replace("<|image_pad|>", "<|image_pad|>" * self.n_image_tokens)
            self._prompt_cache[question] = self.tok(text, add_special_tokens=False)["input_ids"]
        return self._prompt_cache[question]

    def pixel_values(self, images: np.ndarray) -> torch.Tensor:
        """(B, H, W, 3) uint8 → (B·patches, 3·T·P·P) in the Qwen2-VL processor's patch order."""
        c, p, m, t = 3, self.cfg.patch_size, self.cfg.merge_size, self.t_patch
        x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
        x = (x - self.mean) / self.std
        b, _, h, w = x.shape
        gh, gw = h // p, w // p
        x = x.reshape(b, c, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
        x = x.unsqueeze(6).expand(*x.shape[:6], t, p, p)
        return x.reshape(b * gh * gw, c * t * p * p).contiguous()

    def __call__(self, samples: list[TaskSample]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids = [self.prompt_ids(s.question) for s in samples]
        longest = max(len(i) for i in ids)
        pad = self.tok.pad_token_id
        input_ids = torch.tensor([[pad] * (longest - len(i)) + i for i in ids])
        attention = torch.tensor([[0] * (longest - len(i)) + [1] * len(i) for i in ids])
        image_id = self.tok.convert_tokens_to_ids("<|image_pad|>")
        images = np.stack([s.scene.render_array() for s in samples])
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention,
            "mm_token_type_ids": (input_ids == image_id).long(),
            "pixel_values": self.pixel_values(images),
            "image_grid_thw": torch.tensor([[1, *self.cfg.geometry.patch_grid]] * len(samples)),
        }
        answers = torch.tensor([self.tok.convert_tokens_to_ids(s.answer) for s in samples])
        return inputs, answers


def pretraining_crops(seed: int, step: int, cfg: ToyConfig, tc: TrainConfig) -> list[Scene]:
    """The crops of one `vision_pretrain` step: one object each at the organism's object sizes, with
    random shape, colour, rotation and position (so it straddles patch borders as in full scenes)."""
    lo, hi = object_sizes(cfg.image_size)
    out = []
    for i in range(step * tc.crop_batch, (step + 1) * tc.crop_batch):
        rng = sample_rng(TRAIN_SEED_BASE + seed, "crop", i)
        spec = (
            SHAPES[rng.integers(len(SHAPES))],
            OBJECT_COLORS[rng.integers(len(OBJECT_COLORS))],
            float(rng.uniform(lo, hi)),
        )
        out.append(Scene(tc.crop_size, tc.crop_size, place_objects(rng, tc.crop_size, tc.crop_size, [spec])))
    return out


def vision_pretrain(model, cfg: ToyConfig, tc: TrainConfig) -> list[float]:
    """Teach the vision tower shapes on small one-object crops first.

    A throw-away linear head must name the crop's object's shape from the features that
    ``tc.pretrain_reads`` picks: ``"centre"``, the merged image token whose cell holds the object's
    centre (tower and merger train); ``"tokens"``, the merged tokens max-pooled feature by feature
    (tower and merger train); or ``"patches"``, the blocks' patch features before the merger,
    max-pooled (the merger does not train here), with a second head naming the colour. The
    language model counts an object at the token of its centre, so that is where shape must be:
    with 8 px patches and the tower then frozen for the dense warmup (`freeze_vision`), a linear
    probe reads it there at 0.96 after "centre", 0.92 after "tokens" and 0.65 after "patches"
    (which puts it into the patches instead: 0.99 max-pooled). Measured: `docs/organism/cell_shape.py`.
    Asking the colour too from the pooled tokens cut shape from 0.98 to 0.79 in a one-off run, so
    only "patches" asks it. Crops are cheap (a 64 px crop has a ninth of a 192 px scene's pixels),
    so the tower sees many objects per second. Why small patches and crops: `docs/organism/organism_vision.py`.
    """
    patches = tc.pretrain_reads == "patches"
    crop_cfg = replace(cfg, image_size=tc.crop_size)
    arange = torch.arange(tc.crop_batch)
    pixels = Collator(crop_cfg).pixel_values
    grid = torch.tensor([[1, *crop_cfg.geometry.patch_grid]] * tc.crop_batch)
    dim = cfg.vision_dim if patches else cfg.hidden
    heads = {"shape": torch.nn.Linear(dim, len(SHAPES))}
    if patches:
        heads["color"] = torch.nn.Linear(dim, len(OBJECT_COLORS))
    visual = model.model.visual
    trained = [visual.patch_embed, visual.blocks, *heads.values()] + ([] if patches else [visual.merger])
    opt = torch.optim.AdamW([p for m in trained for p in m.parameters()], lr=tc.lr)
    losses = []
    for step in range(tc.vision_pretrain):
        scenes = pretraining_crops(tc.seed, step, cfg, tc)
        out = visual(pixels(np.stack([sc.render_array() for sc in scenes])), grid_thw=grid)
        feats = (out.last_hidden_state if patches else out.pooler_output).view(len(scenes), -1, dim)
        if tc.pretrain_reads == "centre":
            read = feats[arange, torch.tensor([token_index(sc.objects[0], crop_cfg) for sc in scenes])]
        else:
            read = feats.max(1).values
        loss = torch.nn.functional.cross_entropy(
            heads["shape"](read), torch.tensor([SHAPES.index(sc.objects[0].shape) for sc in scenes])
        )
        if patches:
            color = torch.tensor([OBJECT_COLORS.index(sc.objects[0].color) for sc in scenes])
            loss = loss + torch.nn.functional.cross_entropy(heads["color"](read), color)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def token_cell(o: Obj, cfg: ToyConfig) -> tuple[int, int]:
    """(row, col) of the image-token cell that holds the object's centre."""
    cell, (rows, cols) = cfg.geometry.token_size, cfg.geometry.token_grid
    return min(int(o.cy // cell), rows - 1), min(int(o.cx // cell), cols - 1)


def token_index(o: Obj, cfg: ToyConfig) -> int:
    """Index, among an image's merged tokens (row-major over the token grid), of the object's centre token."""
    r, c = token_cell(o, cfg)
    return r * cfg.geometry.token_grid[1] + c


def cell_targets(samples: list[TaskSample], cfg: ToyConfig) -> torch.Tensor:
    """(B·cells, 3) per image-token cell: object centres in it (0–3), colour and shape of the first (or none)."""
    side, _ = cfg.geometry.token_grid
    out = torch.zeros(len(samples), side, side, 3, dtype=torch.long)
    out[..., 1], out[..., 2] = len(OBJECT_COLORS), len(SHAPES)  # "none" classes
    for b, s in enumerate(samples):
        for o in s.scene.objects:
            r, c = token_cell(o, cfg)
            if out[b, r, c, 0] == 0:
                out[b, r, c, 1], out[b, r, c, 2] = OBJECT_COLORS.index(o.color), SHAPES.index(o.shape)
            out[b, r, c, 0] = min(3, int(out[b, r, c, 0]) + 1)
    return out.reshape(-1, 3)


# Classes of `cell_targets`' three columns: centres in the cell (0–3), colour or none, shape or none.
CELL_CLASSES = (4, len(OBJECT_COLORS) + 1, len(SHAPES) + 1)


def cell_loss(head: torch.nn.Linear, feats: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of a per-token head (``sum(CELL_CLASSES)`` outputs) against `cell_targets`."""
    logits = head(feats).split(CELL_CLASSES, dim=-1)
    return sum(torch.nn.functional.cross_entropy(lg, target[:, k]) for k, lg in enumerate(logits))


def vision_warmup(model, collate: Collator, cfg: ToyConfig, tc: TrainConfig) -> list[float]:
    """Pretrain the vision tower and merger on dense scene labels before the language model sees them.

    Real VLMs start from a pretrained vision encoder; the organism's gets ``tc.vision_warmup`` steps
    of supervised pretraining: a throw-away linear head on each image token predicts how many
    object centres lie in its cell and their colour and shape. Without it the language model learns
    the answer prior first and then, for thousands of steps, ignores objects that cover part of one
    token (measured: no progress beyond the prior in 1,100 steps).
    """
    head = torch.nn.Linear(cfg.hidden, sum(CELL_CLASSES))
    opt = torch.optim.AdamW(list(model.model.visual.parameters()) + list(head.parameters()), lr=tc.lr)
    losses = []
    for step in range(tc.vision_warmup):
        idx = range(step * tc.batch_size, (step + 1) * tc.batch_size)
        samples = [task_sample("count", TRAIN_SEED_BASE + tc.seed + 500, i, image_size=cfg.image_size) for i in idx]
        inputs, _ = collate(samples)
        feats = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
        loss = cell_loss(head, feats, cell_targets(samples, cfg))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def freeze_tower(model) -> None:
    """Freeze the tower's patch embedding and blocks, like a real VLM's pretrained encoder; the
    merger (the projector) still trains."""
    visual = model.model.visual
    for p in list(visual.patch_embed.parameters()) + list(visual.blocks.parameters()):
        p.requires_grad_(False)


def training_batch(
    collate: Collator, step: int, cfg: ToyConfig, tc: TrainConfig
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Model inputs and answer ids of main-training step ``step``: a pure function of (seed, step)."""
    idx = range(step * tc.batch_size, (step + 1) * tc.batch_size)
    return collate([training_sample(tc.seed, i, cfg, tc) for i in idx])


def answer_step(
    model, opt: torch.optim.Optimizer, inputs: dict[str, torch.Tensor], answers: torch.Tensor
) -> torch.Tensor:
    """One optimiser step on the cross-entropy of the answer token at the last prompt position; returns the loss."""
    logits = model(**inputs, logits_to_keep=1).logits[:, -1]
    loss = torch.nn.functional.cross_entropy(logits, answers)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def quick_accuracy(model, collate: Collator, samples: list[TaskSample], batch_size: int = 64) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(samples), batch_size):
        inputs, answers = collate(samples[i : i + batch_size])
        logits = model(**inputs, logits_to_keep=1).logits[:, -1]
        correct += (logits.argmax(-1) == answers).sum().item()
    model.train()
    return correct / len(samples)


def train(out: Path, cfg: ToyConfig = ToyConfig(), tc: TrainConfig = TrainConfig(), progress=None) -> dict:
    """Train and save the organism to ``out`` (HF format + recipe + log). Returns the last log row."""
    out, progress = require_path(out, "out", example="'weights'"), require_callback(progress)
    if not isinstance(cfg, ToyConfig) or not isinstance(tc, TrainConfig):
        raise ConfigError(
            f"train takes cfg=ToyConfig(...) and tc=TrainConfig(...) (countlens.toy.recipe, countlens.toy.schedule), "
            f"got {type(cfg).__name__} and {type(tc).__name__}"
        )
    if tc.vision_pretrain and tc.crop_size % cfg.geometry.token_size:
        raise CountlensError(
            f"crop_size {tc.crop_size} is not a multiple of the organism's token size "
            f"{cfg.geometry.token_size} px; choose e.g. {4 * cfg.geometry.token_size}"
        )
    claim_directory(
        out,
        "countlens toy train",
        {
            "config": json.loads(json.dumps(asdict(cfg), default=str)),
            "train": json.loads(json.dumps(asdict(tc), default=str)),
        },
    )
    torch.set_num_threads(tc.threads)
    tokenizer, image_processor = build_tokenizer(), build_image_processor(cfg)
    collate = Collator(cfg, tokenizer, image_processor)
    model = build_model(cfg, seed=tc.seed).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(0.9, 0.98),
    )
    start = time.time()
    crops = vision_pretrain(model, cfg, tc) if tc.vision_pretrain else []
    if tc.freeze_vision and tc.vision_pretrain:
        freeze_tower(model)  # the dense warmup then trains the merger alone and cannot wear shape down
    warm = vision_warmup(model, collate, cfg, tc) if tc.vision_warmup else []
    if tc.freeze_vision:
        freeze_tower(model)
    held_out = [task_sample("count", 1, i, image_size=cfg.image_size) for i in range(256)]
    held_out += [task_sample(t, 1, i, image_size=cfg.image_size) for t in TASKS if t != "count" for i in range(64)]
    row: dict = {}

    # Batches are built in this loop, not prefetched in a thread: on 2 cores a prefetch thread
    # competes with torch's two threads and made each step 1.3× slower (bench/train_step.py).
    # The weights are written only after the last step, so an interrupted run leaves no checkpoint.
    with (out / "train_log.jsonl").open("w") as log:
        for step in range(0, len(crops), 100):
            log.write(
                json.dumps({"vision_pretrain_step": step, "loss": round(float(np.mean(crops[step : step + 100])), 4)})
                + "\n"
            )
        for step in range(0, len(warm), 50):
            log.write(
                json.dumps({"vision_warmup_step": step, "loss": round(float(np.mean(warm[step : step + 50])), 4)})
                + "\n"
            )
        for step in range(tc.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, tc)
            loss = answer_step(model, opt, *training_batch(collate, step, cfg, tc))
            if step % 50 == 0 or step == tc.steps - 1:
                row = {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "lr": lr_at(step, tc),
                    "elapsed_s": round(time.time() - start, 1),
                }
                if step % 250 == 0 or step == tc.steps - 1:
                    row["held_out_acc"] = round(quick_accuracy(model, collate, held_out), 4)
                log.write(json.dumps(row) + "\n")
                log.flush()
                if progress:
                    progress(row)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    save_recipe(out, cfg, tc)
    return row
