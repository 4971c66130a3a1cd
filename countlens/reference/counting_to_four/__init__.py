"""The MAS paper's released code ("Counting to Four", leduy99/-CVPRW26-Modality-Attention-Share),
reproduced where its numbers come from the code rather than the text.

Each module follows one folder of that repository, re-implemented in countlens's own code from its
description, with every departure named in its docstring:

- its scene generator, COUNTINGTRICKS as ``vlm-count-eval/synthetic_data/generate.py`` draws it (18
  red-circle cases, counts 1–10, one layout per image shared by every case), is a data generator and
  lives with the others: `countlens.datasets.paper_generator`; ``countingtricks(design="paper-code")``.
- `parse`: the count its evaluation scripts read from an answer (``vlm-count-eval/eval_accu_count/
  run*.py``); ``generate(parser="paper-code")``.
- `attention`: its attention diagnostics at the last generation step — the 4-way modality share, VRA
  and ARS (``modality_balance/attn_dist.ipynb``, ``pixel_grounding_eval/eval.ipynb``);
  ``attention_metrics(at="generation")``.
- `probe`: its detection probe, trained and scored as ``models_probing/train_compare.py --head yolo``
  does; ``probe_taps(recipe="counting-to-four")``.

The MAS loss as the code computes it is a reduction of countlens's own loss
(`countlens.training.losses.mas_loss`, ``reduce="paper"``) and stays there. Preset
``counting-to-four`` (`countlens.pipeline.presets`) turns all of these on; docs/fidelity.md sets each
beside the paper's text and countlens's own method. The settings' values (``"paper-code"``) are the
ones runs have stored in their ``spec.json`` and keep that spelling.
"""
