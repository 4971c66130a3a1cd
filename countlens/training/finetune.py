"""Circuit-guided fine-tuning (LoRA, or the whole language model): answer cross-entropy plus attention
losses at the circuit's layers.

The loss is CE(answer) + λ_focus·L_focus + λ_mas·L_mas (`countlens.training.losses`), the two
attention terms at ``target_layers`` — taken from a circuit (the layers of its visual-grounding and
cross-modal-routing heads, `target_layers_from`) or given. LoRA adapters (peft) sit on the language
model's attention projections, optionally only at the target layers — or, with ``method="full"`` (the
MAS paper's script), every language-model weight trains (the vision tower and projector frozen; the
caller's weights are copied to CPU and given back afterwards); AdamW with 3 % linear warmup then linear
or cosine decay; gradient accumulation; bf16 autocast on GPU, fp32 on CPU, through `accelerate`.
A large model spreads over several GPUs with ``device_map`` in one process; or the run is data
parallel under ``accelerate launch --num_processes N`` / ``torchrun --nproc_per_node N`` (DDP, or
FSDP with ``configs/accelerate/fsdp.yaml``): each step's global batch of ``batch_size`` samples
is split between the ranks (rank r takes samples r, r + N, …), the gradients averaged, so the
optimiser sees the global batch's gradient; rank 0 alone writes checkpoints, the adapter and the
log. The mean of the ranks' mean losses is the global mean when every sample has as many answer
tokens (single-token answers; with answers of unequal length, DDP weights the ranks equally).

Batches are a pure function of (seed, step), so a run killed at any point resumes from its last
checkpoint (adapter, optimiser, scheduler and step, written atomically every ``save_every`` steps)
and ends exactly where an uninterrupted run would (with ``lora_dropout`` 0, the default: dropout's
random state is not checkpointed). `with_adapter` loads a trained adapter merged
into a fresh copy of the model, ready for evaluation and for head temperature.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

import countlens
from countlens.analysis.heads import read_heads
from countlens.circuits.sites import group_mask
from countlens.errors import ConfigError, InputError, RunDirError
from countlens.files import read_json, refuse_older_spec, settings_changes, write_text
from countlens.model.arch import SOFTMAX_KINDS
from countlens.model.arguments import require_vlm
from countlens.model.vlm import VLM
from countlens.settings import FinetuneConfig
from countlens.sweep_store import samples_digest
from countlens.training.capture import attention_at
from countlens.training.collate import IGNORE, digit_mask, training_batch
from countlens.training.head_lora import check_heads, restrict_to_heads
from countlens.training.losses import answer_ce, focus_loss, mas_loss, object_prior, wrong_answers
from countlens.validate import require_count, require_sequence

FULL_WEIGHTS = "model.safetensors"  # a full fine-tune's trained weights, in a checkpoint and in out/adapter
FULL_MARKER = "full_finetune.json"  # marks out/adapter as a full fine-tune's weights (not a LoRA adapter)


def target_layers_from(
    circuit, classes: Sequence[str] = ("visual grounding", "cross-modal routing"), fallback_k: int = 3
) -> tuple[int, ...]:
    """Layers of the circuit's heads in ``classes``; else of its ``fallback_k`` most important heads.
    Only layers with softmax attention (a table's ``kind`` column: Qwen3.5's linear layers have no
    attention for the focus and MAS losses to shape).

    ``circuit``: a `countlens discover` run directory (its ``heads.csv``) or a head table DataFrame."""
    import pandas as pd

    if isinstance(circuit, (str, Path)):
        circuit = read_heads(circuit)
    if not isinstance(circuit, pd.DataFrame) or not {"layer", "head", "class", "importance"} <= set(circuit.columns):
        raise ConfigError(
            "circuit must be a discover run directory or its head table (a DataFrame with layer, head, class and "
            f"importance); got {type(circuit).__name__}"
        )
    require_count(fallback_k, "fallback_k")
    classes = require_sequence(classes, "classes", example="('visual grounding',)")
    if "kind" in circuit:
        circuit = circuit[circuit["kind"].isin(SOFTMAX_KINDS)]
    chosen = circuit[circuit["class"].isin(classes)]
    if chosen.empty:
        chosen = circuit.sort_values("importance", ascending=False).head(fallback_k)
    return tuple(sorted({int(x) for x in chosen["layer"]}))


def _lora_config(vlm: VLM, config: FinetuneConfig):
    from peft import LoraConfig

    spec = vlm.arch.spec
    layers = (
        config.target_layers if config.lora_target_layers_only and config.target_layers else range(vlm.arch.n_layers)
    )
    if config.target_heads is not None:  # only the heads' layers; their other heads' slices are masked afterwards
        layers = sorted({layer for layer, _ in config.target_heads})
    # A full-match regex on module names: only the language model's attention projections (and a
    # hybrid model's linear-attention projections, on its linear layers).
    sites = rf"{re.escape(spec.self_attn)}\.({'|'.join(vlm.arch.projections)})"
    if spec.linear_attention is not None:
        lin = spec.linear_attention
        sites = rf"({sites}|{re.escape(lin.attn)}\.({'|'.join(lin.projections)}))"
    pattern = rf"{re.escape(spec.layers)}\.({'|'.join(str(x) for x in layers)})\.{sites}"
    return LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=pattern,
        bias="none",
    )


def _lr_lambda(config: FinetuneConfig) -> Callable[[int], float]:
    """The learning rate's multiplier at a step: a linear warm-up, then linear or cosine decay to 0."""
    warm = max(1, math.ceil(config.warmup * config.steps))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if config.schedule == "cosine":
            done = (step - warm) / max(1, config.steps - warm)
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, done))))
        return max(0.0, (config.steps - step) / max(1, config.steps - warm))  # linear, as before the cosine

    return f


def _batch_indices(n: int, step: int, batch_size: int, seed: int) -> np.ndarray:
    """The samples of one step: a seeded permutation per epoch, so step s is the same on every run."""
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        out.extend(perm[offset : offset + batch_size - len(out)].tolist())
    return np.array(out)


def full_trainable(vlm: VLM) -> set[str]:
    """The parameters a full fine-tune trains: the language model's — those under its decoder's parent
    module (embeddings, layers, final norm) and its head — without the vision tower, the projector or a
    spec's other non-language modules (Phi-4's image and audio embedders), as the MAS paper's script
    trains Ovis2.5's LLM."""
    spec = vlm.arch.spec
    language = (f"{spec.layers.rsplit('.', 1)[0]}.", f"{spec.lm_head}.")
    frozen = (f"{spec.vision_tower}.", f"{spec.projector}.", *(f"{m}." for m in spec.not_language))
    return {n for n, _ in vlm.hf.named_parameters() if n.startswith(language) and not n.startswith(frozen)}


def _save_weights(model, state_dict: dict, where: Path, trained: set[str] | None) -> None:
    """A LoRA adapter (peft's files), or with ``trained`` (a full fine-tune) those weights alone."""
    if trained is None:
        model.save_pretrained(where, state_dict=state_dict)
        return
    from safetensors.torch import save_file

    where.mkdir(parents=True, exist_ok=True)
    # Cloned: tied weights (embeddings and head) would otherwise share storage, which safetensors refuses.
    weights = {n: w.detach().to("cpu").clone().contiguous() for n, w in state_dict.items() if n in trained}
    save_file(weights, where / FULL_WEIGHTS)
    (where / FULL_MARKER).write_text(json.dumps({"method": "full", "tensors": len(weights)}) + "\n")


def _save_checkpoint(
    model, state_dict: dict, optimizer, scheduler, step: int, log: list, out: Path, trained: set[str] | None = None
) -> None:
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    _save_weights(model, state_dict, tmp, trained)
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step}, tmp / "state.pt"
    )
    (tmp / "log.json").write_text(json.dumps(log))
    # Swap directories so that a crash leaves either the old or the new checkpoint complete.
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _latest_checkpoint(out: Path) -> Path | None:
    for name in ("checkpoint", "checkpoint.old"):
        if (out / name / "state.pt").exists():
            return out / name
    return None


def check_trainable(vlm: VLM) -> None:
    """Refuse a model countlens's fine-tune is not defined for: a cross-attention VLM."""
    if vlm.arch.spec.cross_attention is not None:
        raise ConfigError(
            f"{vlm.arch.name} reads its image through cross-attention: countlens's fine-tune (LoRA on the "
            "self-attention projections, focus and MAS over image tokens) is not defined for it yet; "
            "fine-tune a token model (e.g. qwen2_5_vl, internvl, ovis2)"
        )


def check_variant(vlm: VLM, samples: Sequence, config: FinetuneConfig) -> None:
    """What a fine-tune with ``config`` needs of the model and samples, checked before anything is
    written: samples, trainable weights, target layers inside the model and — for the focus and MAS
    losses, which read attention probabilities — softmax attention at each. `finetune` runs it, and
    `countlens finetune` runs it for every variant before its baseline, so that a variant late in
    the table cannot be refused after the earlier ones have trained."""
    if len(samples) == 0:
        raise InputError("no training samples")
    check_trainable(vlm)
    attn_terms = config.focus > 0 or config.mas > 0
    if attn_terms and not config.target_layers:
        raise ConfigError(
            "focus/MAS losses need target_layers (e.g. target_layers_from('runs/toy')); "
            "or set focus=0 and mas=0 for plain SFT"
        )
    for layer in config.target_layers:
        if attn_terms:  # the focus and MAS losses read attention probabilities
            vlm.arch.require_softmax(layer, "the focus / MAS losses at target layer")
        else:
            vlm.arch.layer(layer)
    if config.target_heads is not None:
        check_heads(vlm, config.target_heads)
    if config.ce_on == "digits":
        check_digit_answers(vlm, samples)


def finetune(
    vlm: VLM,
    samples: Sequence,
    out: str | Path,
    config: FinetuneConfig = FinetuneConfig(),
    progress: Callable[[dict], None] | None = None,
) -> Path:
    """Train a LoRA adapter on ``samples`` into ``out`` (resuming from its checkpoint); returns the
    adapter directory ``out/adapter``. ``vlm`` is left as it was (its LoRA layers are removed)."""
    require_vlm(vlm, "finetune")
    from accelerate import Accelerator, InitProcessGroupKwargs
    from peft import get_peft_model

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"output {out} is a file; give a directory")
    check_variant(vlm, samples, config)
    spec_file = out / "finetune.json"
    spec = {
        "model": vlm.name,
        "samples": len(samples),
        "digest": samples_digest(samples),
        **{k: v for k, v in asdict(config).items() if k != "save_every"},
    }
    spec = json.loads(json.dumps(spec))
    # A saved spec is compared whole: a field it lacks (a digest included) leaves unknown what that
    # fine-tune trained with, so it resumes nothing.
    fix = f"delete {out} to train this fine-tune from scratch, or fine-tune into a new directory"
    saved = read_json(spec_file, fix) if spec_file.exists() else None
    if saved is not None:
        if saved.get("target_heads") == []:  # every head, as specs wrote it before target_heads=None
            saved = {**saved, "target_heads": None}
        refuse_older_spec(saved, spec, spec_file, "fine-tune into a new directory")
        if saved != spec:
            raise RunDirError(
                f"{out} holds a fine-tune with other settings: {settings_changes(saved, spec)} (old → new; "
                f"{spec_file}); use a new directory, the old settings to resume it, or delete {out} to train it "
                "again with the new ones"
            )

    torch.manual_seed(config.seed)
    accelerator = Accelerator(
        gradient_accumulation_steps=config.grad_accum,
        cpu=not torch.cuda.is_available(),
        mixed_precision="bf16" if torch.cuda.is_available() else "no",
        # rank 0 may evaluate for long between two fine-tunes while the others wait
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(hours=4))],
    )
    if config.batch_size % accelerator.num_processes:
        raise ConfigError(
            f"batch_size {config.batch_size} is the global batch, split between "
            f"{accelerator.num_processes} processes: give a multiple of {accelerator.num_processes}"
        )
    out.mkdir(parents=True, exist_ok=True)  # every argument checked: now the folder is claimed
    write_text(spec_file, json.dumps(spec, indent=1))  # atomic: every rank writes the same spec
    frozen = {n: p.requires_grad for n, p in vlm.hf.named_parameters()}
    own = {k: vlm.hf.__dict__.get(k) for k in ("forward", "_original_forward")}  # instance attributes before
    if config.method == "full":
        # The caller's model is trained in place: its weights are copied to CPU and put back afterwards.
        trained = full_trainable(vlm)
        original = {n: p.detach().to("cpu", copy=True) for n, p in vlm.hf.named_parameters() if n in trained}
        for n, p in vlm.hf.named_parameters():
            p.requires_grad_(n in trained)
        model = vlm.hf
    else:
        trained, original = None, {}
        model = get_peft_model(vlm.hf, _lora_config(vlm, config))
        if config.target_heads is not None:
            restrict_to_heads(vlm, model, config.target_heads)
    try:
        return _train(vlm, model, accelerator, samples, out, config, progress, trained)
    finally:
        model.eval()
        if trained is None:
            model.unload()  # the caller's model without LoRA layers again, whatever happened
        else:  # accelerate's autocast wrapper sits on the caller's model itself: put its own forward back
            for name, value in own.items():
                if value is None:
                    vlm.hf.__dict__.pop(name, None)
                else:  # e.g. a device_map dispatch hook's forward, which must stay
                    vlm.hf.__dict__[name] = value
        with torch.no_grad():
            for n, p in vlm.hf.named_parameters():
                if n in original:
                    p.copy_(original[n])
                    p.grad = None  # a step cut short leaves no gradient on the caller's weights
        for n, p in vlm.hf.named_parameters():
            p.requires_grad_(frozen.get(n, p.requires_grad))


def check_digit_answers(vlm: VLM, samples: Sequence) -> None:
    """ce_on='digits' trains on the answers' digit tokens: refuse, before training, an answer without one."""
    for answer in sorted({s.answer for s in samples}):
        if not any(digit_mask(vlm, vlm.answer_ids(answer))):
            raise InputError(
                f"ce_on='digits': the answer {answer!r} has no digit token; give digit answers "
                "(a Pstd or number prompt) or train with ce_on='answer'"
            )


def _train(
    vlm: VLM, peft_model, accelerator, samples, out: Path, config: FinetuneConfig, progress, trained: set[str] | None
) -> Path:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    attn_terms = config.focus > 0 or config.mas > 0
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config))
    step, log = 0, []
    ckpt = _latest_checkpoint(out)
    if ckpt is not None:
        fix = f"delete {ckpt} (and {out}/checkpoint.old, if any) to train this fine-tune again from the start"
        try:
            state = torch.load(ckpt / "state.pt", weights_only=True)  # tensors and numbers: a file runs no code
        except Exception as err:  # truncated or corrupt: torch raises several kinds
            raise RunDirError(f"{ckpt / 'state.pt'} cannot be read ({type(err).__name__}: {err}); {fix}") from None
        if accelerator.distributed_type == "FSDP" and state["step"] < config.steps:
            raise RunDirError(
                f"{out} holds a checkpoint at step {state['step']} of {config.steps}, and resuming "
                "under FSDP is not supported: its optimiser state is rank 0's shard only. Train "
                "into a new directory, or resume without FSDP (DDP)"
            )
        try:
            if trained is None:
                set_peft_model_state_dict(peft_model, load_file(ckpt / "adapter_model.safetensors"))
            else:
                peft_model.load_state_dict(load_file(ckpt / FULL_WEIGHTS), strict=False)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
        except Exception as err:  # a checkpoint cut short, or one of other settings
            raise RunDirError(f"{ckpt} cannot be resumed ({type(err).__name__}: {err}); {fix}") from None
        step, log = state["step"], read_json(ckpt / "log.json", fix)
    # The scheduler stays outside `prepare`: accelerate would step it once per process per step.
    model, optimizer = accelerator.prepare(peft_model, optimizer)
    rank, world, lead = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    model.train()
    while step < config.steps:
        for micro in range(config.grad_accum):
            idx = _batch_indices(len(samples), step * config.grad_accum + micro, config.batch_size, config.seed)
            tb = training_batch(vlm, [samples[i] for i in idx[rank::world]], config.ce_on)
            inputs = {k: v.to(accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in tb.inputs.items()}
            with accelerator.accumulate(model), accelerator.autocast():
                if attn_terms:
                    with attention_at(vlm, config.target_layers) as attn:
                        logits = model(**inputs).logits
                    maps = [attn[layer] for layer in config.target_layers]
                else:
                    logits = model(**inputs).logits
                ce = answer_ce(logits, tb.labels)
                terms = {"ce": ce}
                if config.focus > 0:
                    priors = object_prior(tb.prompt, tb.samples, config.sigma)
                    terms["focus"] = focus_loss(maps, tb.targets, tb.prompt.image_pos, priors)
                if config.mas > 0:
                    image = torch.zeros_like(tb.targets)
                    image[:, : tb.prompt.inputs["input_ids"].shape[1]] = group_mask(tb.prompt, "image").cpu()
                    if config.mas_reduce == "paper":  # the answer tokens' own rows, wrong answers only
                        own = (tb.labels != IGNORE).to(tb.targets.device)
                        wrong = wrong_answers(logits, tb.labels, vlm.tokenizer)
                        terms["mas"] = mas_loss(maps, own, image, config.tau, "paper", wrong)
                    else:
                        terms["mas"] = mas_loss(maps, tb.targets, image, config.tau, config.mas_reduce)
                loss = ce + config.focus * terms.get("focus", 0.0) + config.mas * terms.get("mas", 0.0)
                accelerator.backward(loss)
                if config.max_grad_norm > 0 and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                scheduler.step() if accelerator.sync_gradients else None
                optimizer.zero_grad()
        # The logged losses are the global batch's: the mean over ranks of each rank's mean.
        values = torch.stack([loss.detach(), *(v.detach() for v in terms.values())]).float()
        values = accelerator.reduce(values, reduction="mean") if world > 1 else values
        row = {
            "step": step,
            "loss": float(values[0]),
            **{k: float(v) for k, v in zip(terms, values[1:])},
            "lr": scheduler.get_last_lr()[0],
        }
        log.append(row)
        step += 1
        if progress is not None and lead:
            progress(row)
        if step % config.save_every == 0 or step == config.steps:
            weights = accelerator.get_state_dict(model)  # every rank: FSDP gathers the shards here
            if lead:
                _save_checkpoint(
                    accelerator.unwrap_model(model), weights, optimizer, scheduler, step, log, out, trained
                )
            accelerator.wait_for_everyone()
    adapter = out / "adapter"
    weights = accelerator.get_state_dict(model)
    if lead:
        shutil.rmtree(adapter, ignore_errors=True)
        _save_weights(accelerator.unwrap_model(model), weights, adapter, trained)
        (out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    accelerator.wait_for_everyone()
    return adapter


def with_adapter(name_or_path: str, adapter: str | Path, **load_kw) -> VLM:
    """A fresh `VLM` of ``name_or_path`` with the LoRA ``adapter`` merged into its weights, or with a
    full fine-tune's weights (``method="full"``) loaded over them."""
    from peft import PeftModel

    adapter = Path(adapter)
    if (adapter / FULL_MARKER).exists():  # a full fine-tune's weights, loaded over a fresh model
        from safetensors.torch import load_file

        base = countlens.load(name_or_path, **load_kw)
        weights = load_file(adapter / FULL_WEIGHTS)
        unknown = base.hf.load_state_dict(weights, strict=False).unexpected_keys
        if unknown:
            raise RunDirError(
                f"{adapter / FULL_WEIGHTS} holds weights {unknown[:3]} this model lacks; is it another model's?"
            )
        base.hf.eval()
        return VLM(base.hf, base.processor, name=f"{base.name}+{adapter.parent.name}")
    if not (adapter / "adapter_config.json").exists():
        raise RunDirError(f"no LoRA adapter at {adapter} (adapter_config.json missing); train one with finetune()")
    base = countlens.load(name_or_path, **load_kw)
    merged = PeftModel.from_pretrained(base.hf, adapter).merge_and_unload()
    merged.eval()
    return VLM(merged, base.processor, name=f"{base.name}+{adapter.parent.name}")
