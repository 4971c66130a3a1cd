"""An activation store: a mix's MLP activations on disk, in chunks, for a training that does not hold them.

Where a mix's activations do not fit the memory bound (``max_memory`` bytes,
`MAX_MEMORY` by default), `collect_activations` writes them to a folder (``store``) in chunks instead
of holding them: each chunk file (``chunk00000.safetensors`` …: tensors only, no code) holds
``in.{layer}`` and ``out.{layer}`` ``(tokens, d_model)`` for every layer, in the model's dtype where
that is bfloat16 or float16 (lossless) and float32 otherwise, and ``kinds`` (uint8 codes into
`KINDS`); ``manifest.json``, written last, names the model, its widths, the layers, the dtype, the
settings the data came from, and each chunk's tokens. A chunk is flushed as soon as the buffered
activations (all layers) reach ``max_memory``, so collecting holds at most ``max_memory`` plus one
batch's activations. `open_store` checks a folder against the model before anything reads it
(manifest, widths, every tensor's shape and dtype); `ActivationStore.stats` reads every chunk
once, refusing NaN or ±inf, before a training starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from countlens.errors import InputError
from countlens.files import atomic_path, machine_errors, settings_changes
from countlens.validate import require_positive

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

#: The mix's kinds: the organism's three tasks (scenes) and plain text prompts.
KINDS: tuple[str, ...] = ("count", "color", "shape", "text")
#: The default bound on activations held in memory (bytes): above it they are collected to disk.
MAX_MEMORY = 4 * 2**30
#: What an activation store's manifest says it is.
STORE_FORMAT = "countlens-activations/1"
MANIFEST = "manifest.json"


def require_memory(value, name: str = "max_memory") -> int:
    """A memory bound in bytes (`require_positive`), as whole bytes, at least 1; a chunk holds at least one batch."""
    return max(1, int(require_positive(value, f"{name} (bytes, e.g. {MAX_MEMORY}: 4 GiB)")))


def in_memory_bytes(tokens: int, n_layers: int, d_model: int) -> int:
    """Bytes of a mix's activations held in memory: every token's MLP input and output at each of
    ``n_layers`` layers, float32 (`countlens.features.activations.Activations`)."""
    return tokens * 2 * n_layers * d_model * 4


def streams(tokens: int, n_layers: int, d_model: int, max_memory: int) -> bool:
    """Whether a training of ``tokens`` (both splits) streams from a store: its activations held in
    memory (`in_memory_bytes`) would pass ``max_memory``. `train_transcoders` decides by it, and its
    plan (`countlens.pipeline.transcoder_cost`) follows it."""
    return in_memory_bytes(tokens, n_layers, d_model) > max_memory


def store_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The element type a store keeps: the model's where it is bfloat16 or float16 (exact), else float32."""
    return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.float32


class StoreWriter:
    """Writes a store's chunks (each whole or not at all) and, last, its manifest."""

    def __init__(self, folder: Path, vlm: VLM, layers: list[int], dtype: torch.dtype, settings: dict) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)  # unfinished until the new manifest is written
        self.folder, self.chunks = folder, []
        self.manifest = {"format": STORE_FORMAT, "model": vlm.name or vlm.arch.name, "d_model": vlm.arch.d_model}
        self.manifest |= {"n_layers": vlm.arch.n_layers, "layers": list(layers), "settings": settings}
        self.manifest["dtype"] = str(dtype).removeprefix("torch.")

    def flush(self, inputs: dict[int, list], outputs: dict[int, list], kinds: list[str]) -> None:
        if not kinds:
            return
        tensors = {f"in.{layer}": torch.cat(v).contiguous() for layer, v in inputs.items()}
        tensors |= {f"out.{layer}": torch.cat(v).contiguous() for layer, v in outputs.items()}
        tensors["kinds"] = torch.tensor([KINDS.index(kind) for kind in kinds], dtype=torch.uint8)
        path = self.folder / f"chunk{len(self.chunks):05d}.safetensors"
        with atomic_path(path) as tmp, machine_errors(path, sum(t.nbytes for t in tensors.values())):
            save_file(tensors, str(tmp))
        self.chunks.append({"file": path.name, "tokens": len(kinds)})
        for v in (*inputs.values(), *outputs.values(), kinds):
            v.clear()

    def finish(self) -> Path:
        path = self.folder / MANIFEST
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({**self.manifest, "chunks": self.chunks}, indent=1))
        return self.folder


class ActivationStore:
    """A checked activation store (`open_store`): ``layers``, ``d_model``, ``chunk_tokens`` (tokens
    per chunk), ``kinds`` (each token's source, as `Activations.kinds`). `read` loads one layer of one
    chunk as float32, checked; nothing else is held."""

    def __init__(self, folder: Path, manifest: dict) -> None:
        self.folder = folder
        self.layers = tuple(manifest["layers"])
        self.d_model = manifest["d_model"]
        self.dtype = manifest["dtype"]
        self.settings = manifest["settings"]
        self.files = [c["file"] for c in manifest["chunks"]]
        self.chunk_tokens = [c["tokens"] for c in manifest["chunks"]]
        self._kinds = self._stats = None

    def __len__(self) -> int:
        return len(self.files)

    @property
    def n_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def kinds(self) -> np.ndarray:
        if self._kinds is None:
            codes = [self._tensor(i, "kinds") for i in range(len(self))]
            self._kinds = np.array(KINDS, dtype=object)[torch.cat(codes).long().numpy()]
        return self._kinds

    def _tensor(self, index: int, name: str) -> torch.Tensor:
        path = self.folder / self.files[index]
        with safe_open(str(path), "pt") as f:
            return f.get_tensor(name)

    def read(self, layer: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``index``'s (inputs, outputs) of ``layer``, float32; an `InputError` on NaN or ±inf."""
        path = self.folder / self.files[index]
        with safe_open(str(path), "pt") as f:
            pair = f.get_tensor(f"in.{layer}").float(), f.get_tensor(f"out.{layer}").float()
        for name, t in zip(("in", "out"), pair):
            if not torch.isfinite(t).all():
                raise InputError(
                    f"{path}: {name}.{layer} holds NaN or ±inf (a damaged store); delete {self.folder} to collect "
                    "the activations again"
                )
        return pair

    def chunks(self, layer: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.read(layer, index) for index in range(len(self)))

    def stats(self) -> dict[int, tuple[torch.Tensor, float]]:
        """Per layer, (the mean output, float32; the outputs' total variance ``Σ var(y)``), from one
        read of every chunk (which refuses NaN and ±inf): what a training needs before its first step."""
        if self._stats is not None:
            return self._stats
        out = self._stats = {}
        for layer in self.layers:
            if len(self) == 1:  # the very computation of the in-memory path
                y = self.read(layer, 0)[1]
                out[layer] = (y.mean(0), float(y.var(0, unbiased=False).sum()))
                continue
            s1 = torch.zeros(self.d_model, dtype=torch.float64)
            s2 = torch.zeros(self.d_model, dtype=torch.float64)
            for index in range(len(self)):
                y = self.read(layer, index)[1].double()
                s1 += y.sum(0)
                s2 += (y * y).sum(0)
                del y
            mean = s1 / self.n_tokens
            out[layer] = (mean.float(), float((s2 / self.n_tokens - mean * mean).clamp_min(0).sum()))
        return out


def open_store(folder: str | Path, vlm: VLM, layers: Sequence[int], settings: Mapping | None = None) -> ActivationStore:
    """The activation store in ``folder``, checked against ``vlm`` (its name, d_model and layer count),
    ``layers`` and ``settings`` (where given), and every chunk's tensors' shapes and dtypes (read from
    the files' headers); an `InputError` naming what differs and the fix otherwise."""
    folder = Path(folder)
    fix = f"delete {folder} to collect this model's activations again, or give another out folder"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise InputError(
            f"{folder} is not a finished activation store (no {MANIFEST}: an interrupted collection or another "
            f"folder); {fix}"
        ) from None
    except (OSError, ValueError) as err:
        raise InputError(f"{folder / MANIFEST} is not readable JSON ({err}); {fix}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != STORE_FORMAT:
        raise InputError(f"{folder / MANIFEST} is not a countlens activation store ({STORE_FORMAT}); {fix}")
    name = vlm.name or vlm.arch.name
    mine = {"model": name, "d_model": vlm.arch.d_model, "n_layers": vlm.arch.n_layers, "layers": list(layers)}
    theirs = {key: manifest.get(key) for key in mine}
    if theirs != mine:
        raise InputError(f"{folder} holds the activations of {theirs}, not of {mine}; {fix}")
    old, new = manifest.get("settings"), None if settings is None else json.loads(json.dumps(dict(settings)))
    if new is not None and old != new:
        changes = settings_changes(old, new)
        raise InputError(f"{folder} holds activations collected with other settings: {changes} (old → new); {fix}")
    dtype = manifest.get("dtype")
    chunks = manifest.get("chunks")
    if dtype not in ("float32", "bfloat16", "float16") or not isinstance(chunks, list) or not chunks:
        raise InputError(f"{folder / MANIFEST} names no chunks or an unknown dtype {dtype!r}; {fix}")
    for chunk in chunks:
        path = folder / str(chunk.get("file") if isinstance(chunk, dict) else "")
        n = chunk.get("tokens") if isinstance(chunk, dict) else None
        if not path.is_file() or isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"{folder / MANIFEST} lists a chunk {chunk!r:.80} that is missing or empty; {fix}")
        expected = {f"{side}.{layer}": ([n, mine["d_model"]], dtype) for side in ("in", "out") for layer in layers}
        expected["kinds"] = ([n], "uint8")
        try:
            with safe_open(str(path), "pt") as f:
                got = {key: (list(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype()) for key in f.keys()}
        except Exception as err:  # a truncated or foreign file
            raise InputError(f"{path} is not a readable chunk ({err}); {fix}") from None
        got = {key: (shape, _DTYPES.get(kind, kind)) for key, (shape, kind) in got.items()}
        if got != expected:
            wrong = sorted(key for key in set(got) | set(expected) if got.get(key) != expected.get(key))
            raise InputError(
                f"{path}: tensors {wrong[:4]} are {[got.get(key) for key in wrong[:4]]}, not "
                f"{[expected.get(key) for key in wrong[:4]]} ((tokens, d_model), dtype); {fix}"
            )
    return ActivationStore(folder, manifest)


#: safetensors' dtype names, as torch spells them.
_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "U8": "uint8"}
