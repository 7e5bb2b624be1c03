"""Shared test fixtures. Nothing here downloads anything."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|im_start|>", "<|im_end|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer with a ChatML chat template, built in code.

    The vocabulary is the three special tokens (ids 0-2: pad, <|im_start|>, <|im_end|>)
    followed by the 256 byte-level symbols, with no merges: one token per byte, so any text,
    non-ASCII included, round-trips through encode and decode.
    """
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([PAD, BOS, EOS, *byte_symbols])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


@pytest.fixture
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """See make_tiny_tokenizer."""
    return make_tiny_tokenizer()
