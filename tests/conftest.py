"""Shared test fixtures. Nothing here downloads anything; the builders live in tests/tiny.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rlvr.cores import usable_cores
from tests.tiny import make_tiny_model, make_tiny_tokenizer, saved_with_tokenizer

# Every Ray the tests start or join, without token authentication: Ray 2.60 turns it on for a
# local Ray where ~/.ray/auth_token exists, and a process that once used it then fails to start
# actors on the two-node cluster of tests/test_ray_nodes.py, which runs without (a node given an
# explicit address does not take the token)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_configure(config: pytest.Config) -> None:
    """Runs in the tests keep torch's thread count, as a user's RLVR_THREADS would: rlvr fits it to
    the cores other programs leave free (rlvr.cores), and a count that changed with the machine's
    load would sum some products in another order from one test run to the next. Where
    pytest-xdist runs the suite in several workers (`make test`), each takes its share of the
    cores: two workers of two threads on two cores would each wait for the other's
    (docs/performance.md). xdist's controller runs no test, and leaves the count to its workers."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "RLVR_THREADS" not in os.environ:  # the cores, a CPU quota counted (rlvr.cores)
        torch.set_num_threads(max(1, min(torch.get_num_threads(), usable_cores()) // workers))
    os.environ.setdefault("RLVR_THREADS", str(torch.get_num_threads()))


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
    return saved_with_tokenizer(make_tiny_model(), tmp_path_factory.mktemp("tiny"))  # type: ignore[no-any-return]


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


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None. `make test-vllm` sets RLVR_REQUIRE_VLLM=1, where the
    answer fails the test instead of skipping it."""
    from rlvr.log.tracking import MissingExtra
    from rlvr.rollout.vllm_engine import import_vllm

    try:
        import_vllm()
    except MissingExtra as e:
        return str(e)
    return None


def need_vllm() -> None:
    """Skip (or, under `make test-vllm`, fail) where vLLM cannot run."""
    import os

    reason = vllm_missing()
    if reason is None:
        return
    if os.environ.get("RLVR_REQUIRE_VLLM") == "1":
        pytest.fail(f"RLVR_REQUIRE_VLLM=1, and {reason}")
    pytest.skip(f"{reason} (make test-vllm runs these)")


@pytest.fixture(scope="session")
def vllm_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """engines(model, seed=0, fresh=False) → a VLLMEngine (fp32, eager) serving `model`'s weights.
    vLLM takes ~13 s to start even for the tiny model, so an engine is started once per set of
    weights and shared: each call gets a shallow copy with its own ``generator`` seeded `seed`
    (the only state a seed sets). ``fresh``: an engine of its own, closed at the end of the
    session like the others (a test that changes its weights)."""
    import copy
    import hashlib

    need_vllm()
    from rlvr.rollout.vllm_engine import VLLMEngine
    from tests.tiny import EOS_ID

    tokenizer = make_tiny_tokenizer()
    started: dict[str, VLLMEngine] = {}
    everything: list[VLLMEngine] = []

    def engines(model: LlamaForCausalLM, seed: int = 0, fresh: bool = False) -> VLLMEngine:
        digest = hashlib.sha256()
        for name, t in model.state_dict().items():
            digest.update(name.encode() + t.detach().float().numpy().tobytes())
        key = digest.hexdigest()[:16]
        if fresh or key not in started:
            folder = tmp_path_factory.mktemp(f"vllm-{key}")
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            engine = VLLMEngine(str(folder), tokenizer, eos_token_ids=[EOS_ID], seed=seed, dtype="float32",
                                enforce_eager=True, max_model_len=1024, kv_cache_memory_bytes=2**28)
            everything.append(engine)
            if fresh:
                return engine
            started[key] = engine
        engine = copy.copy(started[key])
        engine.generator = torch.Generator().manual_seed(seed)
        return engine

    yield engines
    for engine in everything:
        engine.close()


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> str:
    """A one-layer sequence classifier with one output (a Bradley-Terry reward model), untrained."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    out = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(out)
    return str(out)
