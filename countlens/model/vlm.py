"""VLM: a Hugging Face vision-language model wrapped for nnsight tracing, with its processor and spec.

`countlens.load` (in `countlens.model.loading`) resolves a name to a `VLM`, offline. `VLM.prepare` turns
images and questions into a `Batch`: the padded model inputs plus, per sample, where its image
tokens are, which cell of the image-token grid each one covers, the last prompt position, the read
position (the last one: the last prompt token, or the last of any answer tokens teacher-forced after
it) and the answers' token sequences (`countlens.model.answers` says how answers are written and
terminated). Everything that reads or writes activations goes through `VLM.trace` and `VLM.module`, so
the same code runs locally and, with ``remote=True``, on NDIF.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch
from PIL import Image

from countlens.errors import InputError
from countlens.model import adapt
from countlens.model.arch import Arch, resolve
from countlens.model.geometry import Geometry
from countlens.model.layouts import TILED, token_cells
from countlens.model.processors import render_chat, tile_grid, useful_grid
from countlens.model.sizing import default_size, processed_size, refuse_partial_tokens
from countlens.validate import require_count

IMAGE_SLOT = "<image>"
RECENT_BATCHES = 32


@dataclass
class Batch:
    """Model inputs plus per-sample token bookkeeping. Positions index the padded sequence.

    ``image_cell[b]`` is (n_image_tokens, 2): each image token's (row, col) on the token grid of
    ``geometry[b]``, the cell its centre falls in (several tokens share a cell where the processor
    also shows the image at a finer resolution: `countlens.model.layouts`); (-1, -1) for image tokens that
    cover no single cell (row-end newline tokens).
    ``prompt_last[b]`` is the last prompt token; ``last[b]`` the read position, the same unless
    answer tokens were teacher-forced after the prompt (``forced=`` of `VLM.prepare`).
    """

    inputs: dict[str, torch.Tensor]
    image_pos: list[torch.Tensor]
    image_cell: list[torch.Tensor]
    geometry: list[Geometry]
    last: torch.Tensor
    answer_ids: list[list[int]] | None = None
    prompts: list[str] = field(default_factory=list)
    prompt_last: torch.Tensor | None = None
    # Per sample, the (rows, cols) of tiles or crops the processor cut its image into (tiled layouts), else None.
    tile_grids: list[tuple[int, int] | None] = field(default_factory=list)
    # Cross-attention models (no image tokens): per sample, each image state's cell, as image_cell is
    # for image tokens (class tokens and padding tiles (-1, -1)); empty for token models.
    state_cells: list[torch.Tensor] = field(default_factory=list)
    # The samples the batch was prepared from (`VLM.prepare_samples`): their scenes give object positions.
    samples: Sequence | None = None

    def __post_init__(self):
        if self.prompt_last is None:
            self.prompt_last = self.last

    def __len__(self) -> int:
        return int(self.last.shape[0])

    def patches(self, merge: int) -> int:
        """The vision tower's positions for the batch's largest image: its image tokens × ``merge``²,
        or a cross-attention model's image states (every tile slot's patches and class token)."""
        if self.state_cells:
            return max(len(c) for c in self.state_cells)
        return max(len(p) for p in self.image_pos) * merge**2

    @property
    def answer_token(self) -> torch.Tensor:
        """(batch,) the first token of each answer (the token a single-token score reads)."""
        if self.answer_ids is None:
            raise InputError("this batch was prepared without answers; pass answers= to VLM.prepare")
        return torch.tensor([a[0] for a in self.answer_ids])


class VLM:
    """An nnsight-wrapped HF VLM, its processor and its `Arch`."""

    def __init__(self, hf_model, processor, name: str = "", remote: bool = False, envoy=None):
        self.hf = hf_model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.name = name
        self.remote = remote
        arch = adapt.with_expert_layers(resolve(hf_model.config), hf_model)
        self.arch: Arch = adapt.with_q_norm_layers(arch, hf_model)
        adapt.bidirectional_vision(hf_model, self.arch.spec.vision_tower)
        adapt.add_missing_output_fields(hf_model, self.arch.spec.missing_output_fields)
        if envoy is None:
            from nnsight import NNsight

            envoy = NNsight(hf_model)
        self.nn = envoy
        # Weak references to the batches prepared last (`prepared`).
        self.recent: deque = deque(maxlen=RECENT_BATCHES)

    def __repr__(self) -> str:
        return f"VLM({self.name!r}, {self.arch!r}, geometry={self.geometry})"

    # -- running -------------------------------------------------------------

    def trace(self, batch: Batch | dict, **kwargs):
        """An nnsight trace over a prepared batch (``remote=True`` models run on NDIF)."""
        inputs = batch.inputs if isinstance(batch, Batch) else batch
        if self.remote:
            kwargs.setdefault("remote", True)
        return self.nn.trace(**inputs, **kwargs)

    def read(self, batch: Batch | dict, **kwargs):
        """A trace that reads activations: no KV cache and logits at the last position only, since
        nothing read off a layer needs either (at a 152k vocabulary, full logits are
        rows × seq × 152k floats, more than the model's activations)."""
        return self.trace(batch, use_cache=False, logits_to_keep=1, **kwargs)

    def module(self, path: str):
        """The nnsight envoy at a dotted module path (``model.language_model.layers.3.self_attn``)."""
        node = self.nn
        for part in path.split("."):
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        return node

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """Logits from residual-stream states Float[Tensor, "... d_model"]: the final norm, then the
        unembedding (the logit lens), and any final logit soft-capping the text config sets (Gemma). The
        HF modules are called directly, so it works on tensors and inside an nnsight trace alike."""
        spec = self.arch.spec
        logits = self.hf.get_submodule(spec.lm_head)(self.hf.get_submodule(spec.final_norm)(h))
        cap = getattr(getattr(self.hf.config, "text_config", self.hf.config), "final_logit_softcapping", None)
        return logits if not cap else torch.tanh(logits / cap) * cap

    @property
    def device(self) -> torch.device:
        """Where inputs go: the input embeddings' device (with device_map="auto" the first layers')."""
        return self.hf.get_input_embeddings().weight.device

    @torch.no_grad()
    def forward(self, batch: Batch, **kwargs):
        """A plain HF forward (no tracing) over a prepared batch."""
        if self.remote:
            raise InputError(f"{self.name} is a remote (NDIF) model: run it through vlm.trace(batch), not forward")
        return self.hf(**batch.inputs, **kwargs)

    # -- geometry ------------------------------------------------------------

    @property
    def geometry(self) -> Geometry:
        """The patch grid for this model's native (or default) square image size (`countlens.model.sizing`)."""
        h, w = default_size(self.processor.image_processor, self.arch.patch_size * self.arch.merge_size)
        return self._geometry(h, w)

    def geometry_for(self, height: int, width: int) -> Geometry:
        """The geometry the processor will use for an input image of ``height`` × ``width`` pixels (one
        tile's, for tiling processors)."""
        unit = self.arch.patch_size * self.arch.merge_size
        return self._geometry(*processed_size(self.processor.image_processor, height, width, unit))

    def _geometry(self, h: int, w: int) -> Geometry:
        p, m, tiled = self.arch.patch_size, self.arch.merge_size, self.arch.spec.layout in (*TILED, "anyres")
        ip, name, drops = self.processor.image_processor, self.name or self.arch.name, self.arch.spec.drops_remainder
        return Geometry(h, w, p, m, dropped=refuse_partial_tokens(ip, h, w, p, m, name, tiled, drops))

    # -- inputs --------------------------------------------------------------

    def prepare_samples(
        self, samples: Sequence, *, answers: bool = False, teacher_force: bool = False, single_token: bool = False
    ) -> Batch:
        """`prepare` for samples (anything with ``image``, ``question`` and ``answer``): their images
        and questions; with ``answers`` their answers too; with ``teacher_force`` (implies answers)
        each answer's first len − 1 tokens forced after the prompt, so that the last len positions
        read the whole answer (multi-token answers: "12" → "1", "2")."""
        images, questions = [s.image for s in samples], [s.question for s in samples]
        if not (answers or teacher_force):
            batch = self.prepare(images, questions, single_token=single_token)
        else:
            given = [s.answer for s in samples]
            forced = [self.answer_ids(a)[:-1] for a in given] if teacher_force else None
            batch = self.prepare(images, questions, given, single_token=single_token, forced=forced)
        batch.samples = list(samples)
        return batch

    def batches(self, samples: Sequence, batch_size: int, **kw) -> Iterator[tuple[Sequence, Batch]]:
        """(chunk, its `prepare_samples` batch) for consecutive chunks of ``batch_size`` samples."""
        require_count(batch_size, "batch_size")
        for start in range(0, len(samples), batch_size):
            chunk = samples[start : start + batch_size]
            yield chunk, self.prepare_samples(chunk, **kw)

    def prepare(
        self,
        images: Sequence[Image.Image | np.ndarray],
        prompts: Sequence[str],
        answers: Sequence[str] | None = None,
        *,
        single_token: bool = False,
        chat: bool = True,
        forced: Sequence[Sequence[int]] | None = None,
    ) -> Batch:
        """Build a padded batch: one image and one prompt per sample.

        ``prompts`` are questions; with ``chat=True`` (default) each is wrapped in the model's chat
        template with the image before the text, or where the prompt says ``<image>``. With
        ``chat=False`` a prompt is used verbatim and must contain the processor's image token
        once. ``answers`` become token sequences (`answer_ids`); ``single_token=True`` requires
        each to be exactly one token. ``forced`` holds token ids per sample to teacher-force after
        its prompt (an answer's first tokens); the rows stay left-padded, so every row's read
        position is the last one.
        """
        for name, value in (("images", images), ("prompts", prompts), ("answers", answers), ("forced", forced)):
            single = isinstance(value, (str, Image.Image)) or (isinstance(value, np.ndarray) and value.ndim == 3)
            if single or (value is not None and not hasattr(value, "__len__")):
                raise InputError(
                    f"{name} is a single {type(value).__name__}; give a list, one per sample: [{name[:-1]}]"
                )
        if len(images) != len(prompts):
            raise InputError(f"got {len(images)} images but {len(prompts)} prompts; give one prompt per image")
        if answers is not None and len(answers) != len(prompts):
            raise InputError(f"got {len(answers)} answers for {len(prompts)} prompts; give one answer per prompt")
        if len(images) == 0:
            raise InputError("empty batch: give at least one image and prompt")
        if forced is not None and len(forced) != len(prompts):
            raise InputError(
                f"got {len(forced)} forced answer prefixes for {len(prompts)} prompts; give one per prompt"
            )
        pil = [_as_rgb(im, i) for i, im in enumerate(images)]
        texts = [self._chat_text(p, i) if chat else self._raw_text(p, i) for i, p in enumerate(prompts)]
        answer_ids = None if answers is None else [self._checked_answer(a, single_token) for a in answers]
        try:
            # One list per sample: Gemma3 reads a flat list as all the images of one prompt.
            # Left padding puts every sample's last prompt token at position -1, which single-token
            # scoring (logits_to_keep=1) and generation rely on.
            enc = self.processor(
                text=texts, images=[[im] for im in pil], padding=True, padding_side="left", return_tensors="pt"
            )
        except (ValueError, TypeError) as err:
            raise InputError(f"the {type(self.processor).__name__} rejected the batch: {err}") from err
        # Labels (PaliGemma's processor always writes them) would only add a loss, NaN without an answer.
        inputs = {k: v for k, v in enc.items() if isinstance(v, torch.Tensor) and k != "labels"}
        forcing = forced is not None and any(len(f) for f in forced)
        if forcing:
            inputs = _append_tokens(inputs, forced, self.pad_id(), self.arch.spec.answer_token_type)
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        image_pos, image_cell, geoms, grids, states = [], [], [], [], []
        cross = self.arch.spec.cross_attention is not None
        for b in range(ids.shape[0]):
            geom = self._sample_geometry(inputs, b, pil[b])
            tiles = self._tile_grid(pil[b])
            useful = useful_grid(self.processor, pil[b].height, pil[b].width)
            if cross:  # the <|image|> marker only says where the image's rows begin: no image tokens
                pos = torch.zeros(0, dtype=torch.long)
                rows, cols = geom.token_grid
                n_states = inputs["pixel_values"][b].shape[:2].numel() * (rows * cols + 1)  # images × tile slots
                states.append(token_cells(self.arch.spec.layout, geom, n_states, b, tiles).cells)
            else:
                pos = torch.nonzero(ids[b] == self.arch.image_token_id).flatten()
            image_pos.append(pos)
            image_cell.append(
                torch.zeros(0, 2, dtype=torch.long)
                if cross
                else token_cells(self.arch.spec.layout, geom, len(pos), b, tiles, useful).cells
            )
            grids.append(tiles)
            geoms.append(geom)
        last = torch.tensor([int(torch.nonzero(m).max()) for m in mask])
        device = self.device
        if device.type != "meta":  # a remote model lives on the meta device; NDIF places the inputs
            # Pixel values and any other float input (Phi-4's image attention mask) in the model's dtype.
            inputs = {
                k: v.to(device, self.hf.dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()
            }
        prompt_last = last - torch.tensor([len(f) for f in forced]) if forcing else last
        batch = Batch(inputs, image_pos, image_cell, geoms, last, answer_ids, list(texts), prompt_last, grids, states)
        self.recent.append(weakref.ref(batch))
        return batch

    def prepared(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None) -> Batch | None:
        """The batch most recently prepared whose tokens (and pixels, where given) these are, or k
        copies of it stacked (a batch-expanded forward), if it is still alive; else None. Positions
        that need a sample's image cells or objects (`countlens.circuits.sites.positions`) find it here."""

        def stacks(mine: torch.Tensor | None, given: torch.Tensor | None, k: int) -> bool:
            if mine is None or given is None:
                return True
            stacked = torch.cat([mine.to(given.device, given.dtype)] * k)
            return stacked.shape == given.shape and torch.equal(stacked, given)

        for batch in filter(None, (ref() for ref in reversed(self.recent))):
            rows, (n, seq) = input_ids.shape[0], batch.inputs["input_ids"].shape
            if seq == input_ids.shape[1] and rows % n == 0 and stacks(batch.inputs["input_ids"], input_ids, rows // n):
                if stacks(batch.inputs.get("pixel_values"), pixel_values, rows // n):
                    return batch
        return None

    def _chat_text(self, prompt: str, i: int) -> str:
        if not isinstance(prompt, str):
            raise InputError(f"prompt {i} is a {type(prompt).__name__}; give a string")
        plain = self.arch.spec.plain_prompt
        if plain is not None and not getattr(self.processor, "chat_template", None):
            if IMAGE_SLOT in prompt or not prompt.strip():
                raise InputError(
                    f"prompt {i}: {self.arch.name} writes its prompt as {plain!r} (the image first); give the "
                    "question alone, without an <image> slot"
                )
            return plain.format(image=self.processor.image_token, question=prompt.strip())
        if not prompt.replace(IMAGE_SLOT, "").strip():
            raise InputError(f"prompt {i} is empty; give the question to ask about the image")
        if prompt.count(IMAGE_SLOT) > 1:
            raise InputError(
                f"prompt {i} has {prompt.count(IMAGE_SLOT)} {IMAGE_SLOT} slots; countlens uses one image per prompt"
            )
        before, _, after = prompt.partition(IMAGE_SLOT) if IMAGE_SLOT in prompt else ("", "", prompt)
        content = [{"type": "text", "text": before.strip()}] if before.strip() else []
        content += [{"type": "image"}, {"type": "text", "text": after.strip()}]
        return render_chat(self.processor, [{"role": "user", "content": content}], self.name)

    def _raw_text(self, prompt: str, i: int) -> str:
        if not isinstance(prompt, str):
            raise InputError(f"prompt {i} is a {type(prompt).__name__}; give a string")
        token = getattr(self.processor, "image_token", None) or IMAGE_SLOT
        if prompt.count(token) != 1:
            raise InputError(
                f"prompt {i} has {prompt.count(token)} image slots ({token!r}) but needs exactly one: "
                f"put {token!r} where the image goes, or use chat=True to let the chat template place it"
            )
        return prompt

    @cached_property
    def answer_end(self) -> int | None:
        """The token appended to every answer, or None for bare answers: the end-of-answer token where
        the vocabulary writes a count as a prefix of another (`countlens.model.answers`)."""
        from countlens.model.answers import end_of_answer_id, splits_numbers

        if not splits_numbers(self.tokenizer):
            return None
        end = end_of_answer_id(self.processor)
        if end is None:
            raise InputError(
                f"{self.name or 'the model'}'s tokenizer splits numbers into digits but has no "
                "end-of-answer token (no eos token, no chat template): set tokenizer.eos_token"
            )
        return end

    def answer_ids(self, answer: str) -> list[int]:
        """``answer`` as the model writes it: its tokens (no special tokens), then `answer_end` if any."""
        if not isinstance(answer, str) or not answer.strip():
            raise InputError(f"answer {answer!r} is empty or not a string; give the answer text")
        ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
        unk = self.tokenizer.unk_token_id
        if not ids or (unk is not None and unk in ids):
            raise InputError(
                f"answer {answer!r} is not in {self.name or 'the model'}'s vocabulary; use a word it knows"
            )
        end = self.answer_end
        return ids if end is None else [*ids, end]

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The tokenizer's token for each id; "" for a row of the unembedding no token owns (Qwen
        checkpoints pad it: Qwen2.5-VL-7B has 152,064 rows and 151,665 tokens)."""
        return [t or "" for t in self.tokenizer.convert_ids_to_tokens(list(ids))]

    def pad_id(self) -> int:
        """The id that pads rows: the tokenizer's pad token, else its end-of-sequence token."""
        pad = self.tokenizer.pad_token_id
        return int(self.tokenizer.eos_token_id if pad is None else pad)

    def _checked_answer(self, answer: str, single_token: bool) -> list[int]:
        ids = self.answer_ids(answer)
        if single_token and len(ids) != 1:
            toks = self.tokenizer.convert_ids_to_tokens(ids)
            raise InputError(
                f"answer {answer!r} is {len(ids)} tokens {toks}, but a single token is required; "
                "use an answer that is one token, or pass single_token=False"
            )
        return ids

    def _tile_grid(self, image: Image.Image) -> tuple[int, int] | None:
        if self.arch.spec.layout not in TILED:
            return None
        grid = tile_grid(self.processor, image.height, image.width)
        if grid is None:
            raise InputError(
                f"{type(self.processor.image_processor).__name__} is not an image processor countlens knows the "
                f"tiling of, and {self.arch.name}'s image tokens follow its tiles; use the model's own image processor"
            )
        return int(grid[0]), int(grid[1])

    def _sample_geometry(self, inputs: dict, b: int, image: Image.Image) -> Geometry:
        thw = inputs.get("image_grid_thw")
        if thw is not None:  # Qwen family: the processor reports the patch grid it chose
            (_, gh, gw), p = (int(x) for x in thw[b]), self.arch.patch_size
            return Geometry(gh * p, gw * p, p, self.arch.merge_size)
        return self.geometry_for(image.height, image.width)


def check_samples(samples: Sequence, what: str) -> None:
    """Refuse what ``what`` cannot read as samples (each with ``image``, ``question`` and
    ``answer``): nothing, a single sample, or clean/corrupt pairs."""
    maker = "task_samples(...) or countingtricks(...)"
    _check_sequence(samples, what, "samples", maker)
    if _has(samples[0], "clean") and _has(samples[0], "corrupt"):
        raise InputError(
            f"{what} takes samples, got clean/corrupt pairs: pass [p.clean for p in pairs] (or the corrupt "
            "side), or call a patching function, which takes pairs"
        )
    _check_items(samples, what, "samples", ("image", "question", "answer"), maker)


def check_pairs(pairs: Sequence, what: str) -> None:
    """Refuse what ``what`` cannot read as clean/corrupt pairs (each with ``clean`` and ``corrupt``)."""
    _check_sequence(pairs, what, "pairs", "count_pairs(...)")
    _check_items(pairs, what, "pairs", ("clean", "corrupt"), "count_pairs(...)")


def _has(item, name: str) -> bool:
    """Whether ``item`` has attribute ``name``, without running a property (a sample's ``image``
    renders its scene)."""
    import inspect

    try:
        inspect.getattr_static(item, name)
    except AttributeError:
        return False
    return True


def _check_sequence(items: Sequence, what: str, kind: str, maker: str) -> None:
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise InputError(f"{what} takes a list of {kind}, got {type(items).__name__}; build them with {maker}")
    if len(items) == 0:
        raise InputError(f"no {kind} given to {what}; build some with {maker}")


def _check_items(items: Sequence, what: str, kind: str, attrs: tuple[str, ...], maker: str) -> None:
    for i, item in enumerate(items):
        lacking = [a for a in attrs if not _has(item, a)]
        if lacking:
            raise InputError(
                f"{what} takes {kind} (each with {', '.join(attrs)}); item {i} is a {type(item).__name__} "
                f"without {', '.join(lacking)}: build them with {maker}"
            )


def _append_tokens(
    inputs: dict[str, torch.Tensor], forced: Sequence[Sequence[int]], pad: int, answer_type: str | None = None
) -> dict:
    """Each row's real tokens followed by its ``forced`` ids, re-padded on the left. Every per-token
    tensor (input ids, attention mask, token-type ids) is extended: forced tokens are real text (type
    0, or 1 in ``answer_type``, the input that marks an answer: PaliGemma's); a per-token tensor with
    more axes (Llama-3.2-Vision's cross-attention mask: which images a token sees) repeats its last
    row for them, as generation does."""
    ids = inputs["input_ids"]
    per_token = [k for k, v in inputs.items() if v.shape[:2] == ids.shape and not v.is_floating_point()]
    real = inputs["attention_mask"].bool()
    rows = {k: [] for k in per_token}
    for b, extra in enumerate(forced):
        extra = torch.as_tensor(list(extra), dtype=ids.dtype)
        for k in per_token:
            row = inputs[k][b][real[b]]
            if row.dim() > 1:
                tail = row[-1:].expand(len(extra), *row.shape[1:])
            else:
                ones = torch.ones_like(extra)
                tail = {"input_ids": extra, "attention_mask": ones, answer_type: ones}.get(k, torch.zeros_like(extra))
            rows[k].append(torch.cat([row, tail.to(inputs[k].dtype)]))
    width = max(len(r) for r in rows["input_ids"])
    out = dict(inputs)
    for k in per_token:
        fill = pad if k == "input_ids" else 0
        out[k] = torch.stack(
            [torch.cat([torch.full((width - len(r), *r.shape[1:]), fill, dtype=r.dtype), r]) for r in rows[k]]
        )
    return out


def _as_rgb(image: Any, i: int) -> Image.Image:
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise InputError(f"image {i}: array of shape {image.shape} and dtype {image.dtype}; give H×W×3 uint8")
        return Image.fromarray(image, mode="RGB")
    if not isinstance(image, Image.Image):
        raise InputError(f"image {i} is a {type(image).__name__}; give a PIL image or an H×W×3 uint8 array")
    if image.mode != "RGB":
        raise InputError(f"image {i} has mode {image.mode!r}; convert it first: image.convert('RGB')")
    if min(image.size) < 2:
        raise InputError(
            f"image {i} is {image.width}x{image.height} pixels; give an image at least 2 pixels on each side"
        )
    return image
