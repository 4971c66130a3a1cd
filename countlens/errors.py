"""The error family of countlens: every message names the offending input and the fix."""


class CountlensError(Exception):
    """Base class: bad input or state that a user can fix."""


class UnsupportedArchitectureError(CountlensError):
    """A model whose Hugging Face config class has no spec in the registry of families (`countlens.model.families`)."""


class CheckpointNotFoundError(CountlensError):
    """A model name or path that is neither the organism, a local directory, nor a cached hub id."""


class CheckpointError(CountlensError):
    """A checkpoint directory whose files cannot be read (invalid config.json, truncated weights)."""


class DeviceError(CountlensError):
    """A device this torch build or machine does not have."""


class InputError(CountlensError):
    """Data that cannot be used as given: images, prompts, answers, samples, pairs, arguments of a
    function that measures them."""


class ImageTokenCountError(InputError):
    """A sample's image tokens (or image states) that do not fit the layout its model's config and
    its processor's tiles give: the processor's settings disagree with the model's."""


class NoObjectTokensError(InputError):
    """No chosen object of the scenes owns an image token: there is nothing to patch or attribute to."""


class ConfigError(CountlensError):
    """A configuration that cannot run: a `DiscoverConfig` / `FinetuneConfig` field, a preset, a
    recipe, a command-line option, a dtype or device name."""


class RunDirError(CountlensError):
    """A run directory (or store) that does not hold what the command needs: another run's spec, a
    missing or unreadable result file, a directory that is not a countlens run."""


class LayerError(CountlensError, IndexError):
    """A layer (or head) index outside the model."""
