"""The main jobs, built from the packages below: `discover` (a model → its counting circuit, stage by
stage, into a run directory: `config`, `rundir`, `report`), `plan` (what those stages need of a
device, planned before they run), `finetune_job` (the circuit-guided fine-tune's before/after table)
and `presets` (the papers' protocols as data). Nothing here is imported with ``countlens``."""
