"""LoRA through PEFT: the merged weights are the adapted policy, the engine samples from them after
every update, and checkpoints hold a plain merged model plus the adapter that resume puts back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlvr.config import load_config
from rlvr.lora import ADAPTER_DIR, apply_lora, is_lora, merged_state_dict
from rlvr.train.loop import setup, train, train_step
from rlvr.train.methods.registry import check
from rlvr.types import SamplingParams
from tests.test_train import FP32, TIMING, overrides, read_metrics
from tests.tiny import make_tiny_model

PROBE = torch.tensor([[5, 17, 99, 42, 7, 120, 33, 64, 8, 200]])


def logprobs(model: torch.nn.Module, ids: torch.Tensor = PROBE) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


def test_merged_weights_are_the_adapted_policy() -> None:
    base = make_tiny_model()
    plain = make_tiny_model()  # the same seed: the same base weights
    adapted = apply_lora(base, rank=4, alpha=8.0)
    assert is_lora(adapted) and not is_lora(plain)
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # B starts at zero: the adapted policy is the base
    torch.testing.assert_close(logprobs(adapted), logprobs(plain))
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    merged = merged_state_dict(adapted)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(logprobs(plain), logprobs(adapted), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logprobs(plain), logprobs(make_tiny_model()), atol=1e-3)
    # one layer by hand: W + (alpha / r) · B A
    layer = adapted.get_base_model().model.layers[0].self_attn.q_proj
    by_hand = layer.base_layer.weight + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], by_hand)


@pytest.mark.dtype_independent  # pinned to fp32
def test_after_an_update_the_engine_samples_from_the_adapted_weights(tiny_dir: Path, tmp_path: Path) -> None:
    """The bug users report most: adapter updates that never reach the rollout engine."""
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "lora"), "lora.rank=4", "train.lr=5e-2", *FP32])
    (tmp_path / "lora").mkdir()
    run = setup(cfg, tmp_path / "lora")
    assert is_lora(run.learner.model) and not is_lora(run.engine.model) and not run.updater.shared_weights
    before = logprobs(run.learner.model)
    torch.testing.assert_close(logprobs(run.engine.model), before, atol=1e-5, rtol=1e-5)
    train_step(run, 1)
    after = logprobs(run.learner.model)
    assert (after - before).abs().max() > 1e-3  # the learner moved
    torch.testing.assert_close(logprobs(run.engine.model), after, atol=1e-5, rtol=1e-5)  # and the engine with it
    # what the engine samples carries the adapted policy's log-probs
    [[c]] = run.engine.generate([PROBE[0, :4].tolist()], SamplingParams(max_new_tokens=5))
    ids = torch.tensor([PROBE[0, :4].tolist() + list(c.token_ids)])
    torch.testing.assert_close(torch.tensor(c.logprobs), logprobs(run.learner.model, ids)[3:], atol=1e-4, rtol=1e-4)


@pytest.mark.dtype_independent  # pinned to fp32
def test_lora_checkpoints_are_plain_models_and_resume_exactly(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    extra = ["lora.rank=4", "lora.alpha=8", "train.lr=5e-2", *FP32]  # compared with an fp32 model below
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "straight", train__steps=3), *extra]), quiet=True)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "resumed", train__steps=2), *extra,
                             "checkpoint_every=1"]), quiet=True)
    train(resume=tmp_path / "resumed", overrides=("train.steps=3",), quiet=True)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    for ra, rb in zip(a, b, strict=True):
        assert {k: v for k, v in ra.items() if k not in TIMING} == {k: v for k, v in rb.items() if k not in TIMING}
    checkpoint = sorted((tmp_path / "straight" / "checkpoints").glob("step_*"))[-1]
    merged = AutoModelForCausalLM.from_pretrained(checkpoint)  # a plain model: eval and export load it as is
    assert not is_lora(merged) and (checkpoint / ADAPTER_DIR / "adapter_config.json").is_file()
    adapted = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_dir), rank=4, alpha=8.0,
                         adapter=checkpoint / ADAPTER_DIR)
    torch.testing.assert_close(logprobs(merged), logprobs(adapted), atol=1e-5, rtol=1e-5)
    assert (logprobs(merged) - logprobs(AutoModelForCausalLM.from_pretrained(tiny_dir))).abs().max() > 1e-3
    with pytest.raises(ValueError, match="lora"):  # the critic's own check, when the run opens
        check(load_config(None, [*overrides(tiny_dir, tmp_path, "x"), "lora.rank=4", 'algo.advantage="gae"']))


def test_in_bf16_the_merge_is_the_exact_merge_rounded_a_few_times() -> None:
    """With bf16 weights the engine gets W + s·BA computed in bf16: the product BA and its
    scaling are each rounded once (≤ 2u|ΔW|), the sum once more (≤ u|W + ΔW|), u = 2^-8 (see
    tests/precision.py). Every merged weight must be within that of the exact float64 merge."""
    from tests.precision import U_BF16

    adapted = apply_lora(make_tiny_model(dtype=torch.bfloat16), rank=4, alpha=8.0)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.5)
    merged = {k: v.detach() for k, v in merged_state_dict(adapted).items()}
    checked = 0
    for name, module in adapted.get_base_model().named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            w = module.base_layer.weight.detach().double()
            delta = 2.0 * module.lora_B["default"].weight.detach().double() @ module.lora_A["default"].weight.detach().double()
            bound = U_BF16 * ((w + delta).abs() + 2 * delta.abs())
            error = (merged[f"{name}.weight"].double() - (w + delta)).abs()
            assert merged[f"{name}.weight"].dtype == torch.bfloat16 and bool((error <= bound).all()), name
            assert float(delta.abs().max()) > 0.1  # the adapter does move the weights
            checked += 1
    assert checked > 0
