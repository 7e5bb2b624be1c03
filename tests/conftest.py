"""Shared test fixtures. Nothing here downloads anything; the builders live in tests/tiny.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from tests.tiny import make_tiny_model, make_tiny_tokenizer


@pytest.fixture
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """See tiny.make_tiny_tokenizer."""
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_model() -> LlamaForCausalLM:
    """A fresh fp32 tiny Llama (seed 0); see tiny.make_tiny_model."""
    return make_tiny_model()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model and tokenizer saved as a Hugging Face folder, for `model = <path>` runs."""
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model().save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path
