"""The engine under the sites: how countlens reads, writes, records and freezes any site of a model.

A site (`countlens.circuits.sites`) names a component and says where it lives (its `Location`: a module,
its input or output, the site's view of that tensor, from the family spec). Everything that touches the
model goes through here (the traced sweeps' recorders, the lenses and LoRA's target list still name
modules by the spec's paths through `VLM.module` or the spec itself):

- `countlens.circuits.engine.hooks`: the torch-hook backend, the one place a hook is registered.
- `countlens.circuits.engine.record`: `record` (any sites' values in one forward) and `mean_activation`;
  `site_gradients`: `gradients` (values, gradients and input × gradient at any sites and positions).
- `countlens.circuits.engine.freeze`: `frozen(vlm, norms=..., attention=...)`, the one way a method holds
  norms' scales and attention patterns constant (RelP, the attribution graph's local replacement model).
- `countlens.circuits.engine.metrics`: what a pair's run is read as (the logit difference by default,
  log-probability, probability mass on answers, KL, any callable), the argument of every effect and
  attribution; `pair_batch` prepares pairs and normalises by the metric (the noise rule).
- `cache` (the `Cache` by site), `writes` (the traced sweeps' writer), `interventions` (`Patch` …
  `Replace`, `Block`), `donors` (a donor of another token layout, by position name), `run` (`effect`,
  `intervene`), `edits` and `sweep` (stacked edits, the sweeps' runner), `attention` (eager attention),
  `temperature` (head temperature).

**Two backends, one rule.** nnsight's trace (`countlens.model.vlm.VLM.trace`) is used where a run may be
remote (NDIF): the sweeps' stacked edits (`countlens.circuits.engine.edits`) write sites there, through
`countlens.circuits.engine.writes`. Torch hooks (`hooks`) are used for local runs, and where modules run
on stacked copies inside one forward (the edge forward). Both write a site through its `Location`.
"""

from countlens.circuits.engine.hooks import Hook, attach, hooked, module_of, on_gradient

__all__ = ["Hook", "attach", "hooked", "module_of", "on_gradient"]
