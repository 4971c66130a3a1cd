"""Paper presets: one name sets countlens to a paper's protocol, as far as countlens has it.

A preset is data: the `DiscoverConfig` and `HeadThresholds` fields it changes, its fine-tune
`Recipe` (the `FinetuneConfig` fields, epochs, rows, training data and evaluation columns of
`countlens.pipeline.finetune_job.before_after`), its `ProbeConfig` fields, and where each value comes
from. ``countlens discover --preset NAME`` (`discover_config`) and ``countlens finetune --preset
NAME`` (`recipe`) apply it; the run's ``spec.json`` / ``report.md`` and the fine-tune's table name
the preset and the values it set. Values the papers do not give stay countlens's defaults and are
listed as such in [the fidelity table](../fidelity.md).

- ``counting-circuits`` ("Counting Circuits", paper 002): count pairs of black dots and of polygons
  alternating (the paper's SynDot and SynPoly, e.g. 3 against 5 dots), the Pstd prompt, Jaccard
  over the top-20 heads per task, and head classes by depth bands that class the paper's layer
  ranges on a 28-layer model as the paper does: visual grounding in the first tenth (its layer 1),
  cross-modal routing at depth 0.6–0.9 (its layers 18–24, e.g. L19H23), counting aggregation from
  depth 0.8 (its layers 23–28, e.g. L26H26; with layers counted from 1, as "23–28" of 28 layers
  implies, depth ≥ 0.81; the bands hold both readings: routing 17–24 and aggregation 22–27 counted
  from 0) whose top-1 decoded token is the count on at least half the samples (the paper: "highly
  aligns with the final number prediction"), and awareness that includes difficulty words (its
  L23H19: "difficult", "impossible"). Its fine-tune: LoRA r 64, AdamW lr 2e-5, batch 2, 3 %
  warm-up, 2 epochs on 8,000 SynDot + SynPoly-style scenes, CE on the count's digits, λ_focus 1;
  rows Baseline / +SFT / +SFT+focus / Full (β on the routing and aggregation heads), columns
  SynReal and PixMo-Count (accuracy and MAE) and, from local copies, MMMU, RealWorldQA and MathVista.
- ``counting-to-four`` ("Counting to Four is still a Chore", paper 000): COUNTINGTRICKS at the
  paper's 1,000 samples per case, under Pstd; its fine-tune SFT against SFT+MAS (τ 0.4, λ 0.1,
  10 epochs) on FSC-147's train split, columns Circles (Syn), FSC-Val, FSC-Test; probes at the
  paper's capacity (1.7 M / 2.2 M parameters at 1024 / 2048 channels).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from countlens.analysis.probes import ProbeConfig
from countlens.errors import ConfigError
from countlens.pipeline.config import DiscoverConfig
from countlens.settings import DEFAULT_RECIPE, HeadThresholds, Recipe


@dataclass(frozen=True)
class Preset:
    name: str
    paper: str
    discover: dict = field(default_factory=dict)  # DiscoverConfig fields
    thresholds: dict = field(default_factory=dict)  # HeadThresholds fields
    finetune: Recipe = DEFAULT_RECIPE
    probe: dict = field(default_factory=dict)  # ProbeConfig fields
    sources: dict = field(default_factory=dict)  # field → where in the paper its value comes from


PRESETS: dict[str, Preset] = {
    "counting-circuits": Preset(
        "counting-circuits",
        "Counting Circuits (paper 002)",
        discover={
            "pair_kind": "dots+polygons",
            "prompt": "std",
            "jaccard_k": 20,
            "tasks": ("count", "math", "spatial", "color"),
        },
        thresholds={
            "early": 0.1,
            "routing_from": 0.6,
            "routing_to": 0.9,
            "late": 0.8,
            "align_min": 0.5,
            "difficulty_min": 0.1,
        },
        finetune=Recipe(
            config={
                "lora_r": 64,
                "lora_alpha": 128,
                "lr": 2e-5,
                "batch_size": 2,
                "warmup": 0.03,
                "sigma": 1.0,
                "ce_on": "digits",
            },
            epochs=2,
            rows=("+SFT", "+SFT+focus", "+SFT+focus+temperature"),
            training="syn",
            n_train=8000,
            evaluation=("SynReal", "PixMo-Count", "color", "shape", "MMMU", "RealWorldQA", "MathVista"),
            temperature_classes=("cross-modal routing", "counting aggregation"),
            quoted="The paper's own figures (Qwen2.5-VL-7B, its evaluation; not comparable with the rows above): "
            "MMMU 54.89 → 56.33, RealWorldQA 61.96 → 64.14, MathVista 57.30 → 58.30 (baseline → counting-circuit "
            "fine-tune).",
            sources={
                "lora_r": "Training: LoRA r = 64 on every self-attention projection",
                "lora_alpha": "countlens's own (the paper gives none): 2 × r",
                "lr": "Training: AdamW, lr 2e-5, bf16",
                "batch_size": "Training: batch size 2",
                "warmup": "Training: 3 % warm-up, linear decay",
                "epochs": "Training: 2 epochs",
                "sigma": "Key design 3: Gaussian prior with sigma = 1 (cells)",
                "ce_on": "Training: L_SFT is the cross-entropy of the generated count digit tokens only",
                "focus": "Training: L = L_SFT + lambda L_focus, lambda = 1.0",
                "training": "Training: 8,000 SynDot + SynPoly images (countlens: half each, counts 1-10)",
                "rows": "Ablation table: Baseline / +SFT / +SFT+L_focus / Full (+ beta_h)",
                "evaluation": "Main table: SynReal and PixMo-Count accuracy and MAE; transfer: MMMU, RealWorldQA, "
                "MathVista (countlens: SynReal is rendered textured scenes; the three benchmarks' columns need "
                "local copies, --mmmu / --realworldqa / --mathvista; colour and shape are countlens's own columns)",
                "temperature_classes": "Key design 4: beta_h = alpha * gamma_h on the routing and "
                "aggregation heads, alpha = 1.2",
            },
        ),
        sources={
            "pair_kind": "Key design 1: pairs of synthetic images differing only in count (black dots; "
            "the SynDot and SynPoly data, alternating)",
            "prompt": "the Pstd prompt of the evaluation",
            "jaccard_k": "Key findings: top-20 critical heads per task, Jaccard between tasks",
            "tasks": "Key findings: counting against math reasoning (Jaccard 0.38), CLEVR spatial reasoning "
            "(0.33) and colour (0.18) (countlens: math and spatial are procedural stand-ins, "
            "countlens.datasets.reasoning, unless --math / --spatial give local MathVista / CLEVR copies)",
            "early": "Key design 2: visual-grounding heads concentrated in layer 1",
            "routing_from": "Key design 2: routing heads in layers 18-24 (depth 0.63-0.89 of 28 layers)",
            "routing_to": "Key design 2: routing heads in layers 18-24",
            "late": "Key design 2: aggregation heads in layers 23-28 (depth >= 0.81)",
            "align_min": "Key design 2: aggregation output highly aligns with the final number "
            "(countlens: top-1 token = the count's first token on >= half the samples)",
            "difficulty_min": "Key design 2: awareness heads write 'difficult', 'impossible' at large counts "
            "(countlens: >= 10 % of the top-10 tokens are difficulty words)",
        },
    ),
    "counting-to-four": Preset(
        "counting-to-four",
        "Counting to Four is still a Chore for VLMs (paper 000)",
        discover={
            "n_per_case": 200,
            "prompt": "std",
            "evaluate": "generate",
            "max_new_tokens": 100,
            "parser": "paper-code",
            "design": "paper-code",
            "attention_at": "generation",
            "probes": True,
        },
        finetune=Recipe(
            config={
                "tau": 0.4,
                "method": "full",
                "lr": 1e-5,
                "mas_reduce": "paper",
                "weight_decay": 0.1,
                "batch_size": 2,
                "grad_accum": 32,
                "warmup": 0.03,
                "schedule": "cosine",
                "max_grad_norm": 1.0,
            },
            epochs=10,
            rows=("+SFT", "+SFT+MAS"),
            training="fsc147",
            n_train=None,
            evaluation=("Circles (Syn)", "FSC-Val", "FSC-Test"),
            layers="all",
            sources={
                "tau": "Method steps (4): tau = 0.4 (the code's scripts/train_fsc147_with_mas_loss.sh: --mas_tau 0.4)",
                "mas_reduce": "the code's MAS_w_Ovis/ovis/model/mas_loss.py: share averaged over heads, answer "
                "positions and layers before the hinge, wrong answers only (countlens reads them shifted)",
                "weight_decay": "the code's training script: --weight_decay 0.1",
                "batch_size": "the code's training script: --per_device_train_batch_size 2",
                "grad_accum": "the code's training script: --gradient_accumulation_steps 32",
                "warmup": "the code's training script: --warmup_ratio 0.03",
                "schedule": "the code's training script: --lr_scheduler_type cosine",
                "max_grad_norm": "the code's trainer default (transformers Trainer: max_grad_norm 1.0)",
                "method": "the code's training script: --train_modules llm (the whole language model, its "
                "embeddings included; the vision tower frozen)",
                "lr": "the code's training script: --learning_rate 1e-5",
                "mas": "Method steps (4): lambda_mas = 0.1",
                "epochs": "Method steps (4): 10 epochs",
                "training": "Method steps (4): FSC-147 SFT data",
                "rows": "Table 4: SFT against SFT + MAS",
                "evaluation": "Table 4: Circles (Syn), FSC-Val, FSC-Test exact-match accuracy (countlens "
                "adds MAE; Circles (Syn) is COUNTINGTRICKS drawn in circles only)",
                "layers": "countlens's own: the paper's MAS_l, averaged over every layer",
            },
        ),
        probe={"hidden": 512, "head_hidden": 256},
        sources={
            "hidden": "Table 3: 1x1 bottleneck; 1.7-2.2 M parameters, 0.5 M apart between 1024- and "
            "2048-channel taps (countlens: 512 channels, 1.71 M / 2.23 M)",
            "head_hidden": "Table 3: a shared YOLO head (countlens: 256 channels, about 1.18 M parameters)",
            "n_per_case": "the code's config.yml: 200 images per case (the text: 32 cases x 1,000 samples)",
            "probes": "the code's models_probing/train_compare.py --head yolo: a detection probe per tap (the "
            "vision encoder's second-to-last block, the projector, the second-to-last layer), AP@50 (VOC2007 with "
            "--voc, else COUNTINGTRICKS scenes)",
            "attention_at": "the code's modality_balance/attn_dist.ipynb and pixel_grounding_eval/eval.ipynb: "
            "attention at the last generation step (with the code's 4-way share, VRA and ARS beside countlens's)",
            "design": "the code's synthetic_data/generate.py: 18 red-circle cases, counts 1-10, layouts shared "
            "across cases, drawn on the model's grid (the code draws 384 px at the model's patch, 27 or 14 px)",
            "evaluate": "the code's eval_accu_count/run*.py: greedy generation, parsed",
            "max_new_tokens": "the code's vlm-count-eval/eval_accu_count/run_ovis.py (and its siblings): 100 greedy "
            "new tokens (run.py leaves the pipeline's default)",
            "parser": "the code's run*.py: the first digit string or number word zero-fifteen, no word boundaries "
            "(countlens.reference.counting_to_four.parse)",
            "prompt": "Method steps: the Pstd prompt",
        },
    ),
}


def get(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)}")
    return PRESETS[name]


def discover_config(name: str, **overrides) -> DiscoverConfig:
    """The `DiscoverConfig` of preset ``name``; ``overrides`` (e.g. small sizes) win over it."""
    known = {f.name for f in fields(DiscoverConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ConfigError(f"{sorted(unknown)} are not DiscoverConfig fields; use some of {sorted(known)}")
    return DiscoverConfig(**{**get(name).discover, **overrides, "preset": name})


def recipe(name: str = "") -> Recipe:
    """The fine-tune `Recipe` of preset ``name`` ("": countlens's own, `DEFAULT_RECIPE`)."""
    return get(name).finetune if name else DEFAULT_RECIPE


def probe_config(name: str, **overrides) -> ProbeConfig:
    """The `ProbeConfig` of preset ``name``, with ``overrides`` (e.g. fewer epochs)."""
    return ProbeConfig(**{**get(name).probe, **overrides})


def thresholds(name: str = "", **overrides) -> HeadThresholds:
    """The `HeadThresholds` of preset ``name`` ("": countlens's defaults), with ``overrides``."""
    base = HeadThresholds(**get(name).thresholds) if name else HeadThresholds()
    return replace(base, **overrides)
