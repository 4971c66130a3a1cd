"""What a VLM is, in one package: the wrapper, the families, and everything read off a checkpoint.

Read it in this order:

- `countlens.model.families`: one module per model family. A family's `ArchSpec` names every module a
  method touches (attention and its projections, norms, the MLP, embeddings, unembedding, the vision
  tower and projector); nothing outside this package writes a module path literal (code elsewhere
  names modules through the spec's paths, `vlm.arch.o_proj(l)`).
- `countlens.model.arch`: a family's spec resolved against a config (layers, heads, widths);
  `countlens.model.adapt`: the facts read off the loaded model itself.
- `countlens.model.vlm`: `VLM`, the loaded model with its processor and spec, and `Batch`, a prepared
  input with its token positions; `countlens.model.loading`: `load`, offline only;
  `countlens.model.consistency`: a checkpoint that disagrees with itself, refused at load.
- Inputs: `processors` / `processor_files` (building a processor from a checkpoint's files), `sizing`
  (the image each processor's tower sees), `geometry` (the patch grid, free of torch), `layouts` and
  `cells` (where each image token sits), `answers` (answers as token sequences).
- `memory` (what fits in one forward) and `arguments` (checks of arguments that name a model's parts).

Importing this package imports nothing: `countlens.model.geometry` stays free of torch for data generation.
"""

from __future__ import annotations
