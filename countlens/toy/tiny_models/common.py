"""What every tiny builder shares: the sizes of a tiny model, a word-level tokenizer, a chat template
of a real model's layout, the text settings most families take, and a seeded model from a config."""

from __future__ import annotations

HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 16
V_HIDDEN = 32
V_INTERMEDIATE = 64
V_LAYERS = 2
V_HEADS = 2

# Words used by the chat templates below beyond countlens.toy.recipe.VOCAB.
_TEMPLATE_WORDS = ["model"]


def word_vocab(specials: list[str]) -> list[str]:
    from countlens.toy.recipe import VOCAB

    return list(dict.fromkeys([*specials, "[UNK]", *VOCAB, *_TEMPLATE_WORDS]))


def word_tokenizer(
    specials: list[str], *, pad: str, eos: str, bos: str | None = None, named: dict | None = None, chat_template: str
):
    """A word-level tokenizer whose vocabulary starts with ``specials`` (all added as special tokens).

    ``named`` maps model-specific attribute names (``image_token``, ``boi_token``…) to tokens; the
    tokenizer then has ``tok.image_token`` and ``tok.image_token_id`` etc., as real VLM tokenizers do.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = word_vocab(specials)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    kwargs = dict(unk_token="[UNK]", pad_token=pad, eos_token=eos)
    if bos is not None:
        kwargs["bos_token"] = bos
    named_tokens = set((named or {}).values())
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        additional_special_tokens=[t for t in specials if t not in (pad, eos, bos) and t not in named_tokens],
        model_specific_special_tokens=dict(named or {}),
        padding_side="left",
        **kwargs,
    )
    # Model-specific named tokens are set as attributes but not necessarily registered as added tokens.
    fast.add_tokens([t for t in named_tokens if t not in fast.get_added_vocab()], special_tokens=True)
    if len(fast) != len(vocab):
        raise AssertionError(f"tokenizer grew beyond its vocabulary: {len(fast)} != {len(vocab)}")
    fast.chat_template = chat_template
    return fast


def chat(turn_user: str, image: str, after_text: str, gen: str, prefix: str = "") -> str:
    """A chat template: ``prefix``, then per message ``turn_user`` (role substituted), image/text parts,
    ``after_text``; and ``gen`` for the generation prompt."""
    return (
        prefix
        + "{% for message in messages %}"
        + turn_user
        + "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}" + image + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}" + after_text + "{% endfor %}"
        "{% if add_generation_prompt %}" + gen + "{% endif %}"
    )


def seeded(model_cls, config):
    import torch

    config.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    return model_cls(config).eval()


def special_ids(tok, *tokens: str) -> list[int]:
    out = tok.convert_tokens_to_ids(list(tokens))
    if any(i is None or (i == tok.unk_token_id and t != tok.unk_token) for t, i in zip(tokens, out)):
        raise AssertionError(f"unknown special token among {tokens}")
    return out


SMALL_VISION = dict(
    hidden_size=V_HIDDEN, intermediate_size=V_INTERMEDIATE, num_hidden_layers=V_LAYERS, num_attention_heads=V_HEADS
)


def text_settings(model_type: str, tok, vocab: int | None = None, **extra) -> dict:
    return dict(
        model_type=model_type,
        vocab_size=vocab or len(tok),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id,
        tie_word_embeddings=False,
        **extra,
    )
