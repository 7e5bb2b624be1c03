"""Shared test fixtures. Nothing here downloads anything; the builders live in tests/tiny.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
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


@pytest.fixture(autouse=True, scope="session")
def _float64_stays_float64() -> Iterator[None]:
    """Hugging Face's Llama RMSNorm computes in float32 whatever the model's dtype, so a float64
    model (the exact reference of the gradient identities in test_learner.py and
    test_shared_prompts.py) still rounds to float32 there: two computations that are equal in
    exact arithmetic but sum in a different order (e.g. one prompt pass receiving the gradient
    of G rows, against G passes) then differ by ~1e-7 relative, not float64's ~1e-15. For
    float64 inputs only, the norm here computes in float64; every other dtype runs the library's
    own code."""
    from transformers.models.llama import modeling_llama

    library = modeling_llama.LlamaRMSNorm.forward

    def forward(self: modeling_llama.LlamaRMSNorm, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dtype != torch.float64:
            return library(self, hidden)
        return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
        yield


@pytest.fixture(autouse=True)
def _skip_png_drawing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Training ends by drawing curves.png (~1 s of matplotlib); tests outside test_report.py
    don't look at it, so they get a placeholder file instead. test_report.py draws for real."""
    if request.module.__name__.endswith("test_report"):
        return
    import rlvr.report

    def placeholder(run_dir: str | Path, out: str | Path | None = None) -> Path:
        path = Path(out) if out else Path(run_dir) / "curves.png"
        path.write_bytes(b"")
        return path

    monkeypatch.setattr(rlvr.report, "write_png", placeholder)
