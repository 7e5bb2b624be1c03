"""One GRPO update against TRL's `GRPOTrainer`, and one RLOO update against its `RLOOTrainer`,
implementations nobody here wrote: the same model, prompts, completions, rewards and settings
give the same advantages, loss and gradient (docs/interop.md maps the settings).

The batch: the tiny model, 3 prompts × 4 completions of 2-10 tokens ending in EOS, one group
with equal rewards (no signal, but in both sides' token counts). The KL cases use another random
model as the reference: GRPO's k3 in the loss, and DeepSeek-V3.2's ratio-weighted form, which
TRL 1.16 uses by default (`use_bias_correction_kl`; the two have equal losses and gradients
~30% apart on this batch). Off-policy, the sampling
log-probs are moved by up to ±0.4 nats, so 15-26% of the tokens are clipped. rlvr's std epsilon
is set to TRL's 1e-4 (docs/algorithms.md: rlvr's default is verl's 1e-6).

Tolerance: both sides sum the same float32 terms in other orders (over ~60 tokens and the
model's parameters); the comparison in session 21 found relative differences of 5e-7 to 8e-7,
so 1e-5 is float32 rounding with room, and any real difference in the formulas (the std's
divisor, a clip bound, an aggregation's denominator) is 1e-3 or more.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl", reason="the oracle is TRL's GRPOTrainer (pip install 'rlvr[test]')")

from rlvr.train.settings import AdvantageSettings, KLSettings, LossSettings, UpdateSettings  # noqa: E402
from rlvr.train.update import update_policy  # noqa: E402
from rlvr.types import Completion, Group, Sample  # noqa: E402
from tests.tiny import EOS_ID, PAD_ID, make_tiny_model, make_tiny_tokenizer  # noqa: E402

G, MAX_TOKENS = 4, 16
REWARDS = [[1.0, 0.0, 0.5, 0.0], [0.2, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
LENGTHS = [[3, 7, 5, 10], [9, 2, 6, 4], [5, 8, 3, 6]]


@pytest.fixture(scope="module")
def batch() -> dict[str, Any]:
    return make_batch()


def make_batch() -> dict[str, Any]:
    """The model, prompts, completions ending in EOS, and the model's log-probs of them."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 259, (5,), generator=gen).tolist() for _ in REWARDS]
    completions = [[torch.randint(3, 259, (n,), generator=gen).tolist()[:-1] + [EOS_ID] for n in row]
                   for row in LENGTHS]
    model = make_tiny_model()
    logprobs = []
    with torch.no_grad():
        for prompt, row in zip(prompts, completions):
            out = []
            for c in row:
                ids = torch.tensor([prompt + c])
                lp = model(input_ids=ids).logits.float().log_softmax(-1)[0, len(prompt) - 1:-1]
                out.append(lp.gather(-1, ids[0, len(prompt):, None]).squeeze(-1))
            logprobs.append(out)
    return {"model": model, "prompts": prompts, "completions": completions, "logprobs": logprobs}


def _sampling_logprobs(batch: dict[str, Any], off_policy: bool) -> list[list[torch.Tensor]]:
    if not off_policy:  # on-policy: the ratio is 1
        return batch["logprobs"]
    g = torch.Generator().manual_seed(7)
    return [[x + 0.4 * (2 * torch.rand(x.shape, generator=g) - 1) for x in row] for row in batch["logprobs"]]


REF_SEED = 1
"""The reference model of the KL cases: another random model, so the KL and its gradient are not 0."""


def _rlvr(batch: dict[str, Any], settings: UpdateSettings, off_policy: bool) -> tuple[torch.Tensor, float, torch.Tensor]:
    sampled = _sampling_logprobs(batch, off_policy)
    groups = [Group(f"p{p}", tuple(
        Sample(tuple(batch["prompts"][p]), Completion(tuple(c), tuple(float(v) for v in sampled[p][g]), "stop", ""),
               REWARDS[p][g], {"r": REWARDS[p][g]}, p) for g, c in enumerate(batch["completions"][p])),
        staleness=1 if off_policy else 0)  # stale: the ratio is taken against the sampling log-probs
        for p in range(len(REWARDS))]
    model = copy.deepcopy(batch["model"])
    grads: list[torch.Tensor] = []

    class Recorder:  # the learner's interface, keeping the gradient instead of stepping
        def __init__(self) -> None:
            self.model = model

        def step(self) -> float:
            grads.append(torch.cat([q.grad.flatten() for q in model.parameters()]))
            model.zero_grad(set_to_none=True)
            return 0.0

    ref = make_tiny_model(seed=REF_SEED) if settings.kl.coef else None
    result = update_policy(Recorder(), groups, settings, pad_token_id=PAD_ID, ref_model=ref,
                           generator=torch.Generator().manual_seed(0))
    advantages = torch.tensor([a for g in result.advantages for a in g])
    return advantages, float(result.metrics["loss"]), grads[0]


def _trl(batch: dict[str, Any], config: dict[str, Any], off_policy: bool, out: Path) -> tuple[torch.Tensor, float,
                                                                                              torch.Tensor]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = [(p, g) for p in range(len(REWARDS)) for g in range(G)]

    def reward(prompts: list[Any], completions: list[Any], row: list[int], **_: Any) -> list[float]:
        return [REWARDS[rows[r][0]][rows[r][1]] for r in row]

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:  # our completions, not TRL's samples
        return {"prompt_ids": [batch["prompts"][p] for p, _ in rows],
                "completion_ids": [batch["completions"][p][g] for p, g in rows],
                "logprobs": [batch["logprobs"][p][g].tolist() for p, g in rows]}

    args = GRPOConfig(output_dir=str(out / "trl"), num_generations=G, per_device_train_batch_size=len(rows),
                      gradient_accumulation_steps=1, max_completion_length=MAX_TOKENS, report_to="none",
                      use_cpu=True, bf16=False, save_strategy="no", temperature=1.0, **{"beta": 0.0, **config})
    policy = copy.deepcopy(batch["model"])
    if args.beta:  # TRL loads its reference from the policy's folder: the reference model's, saved
        make_tiny_model(seed=REF_SEED).save_pretrained(out / "ref")
        policy.config._name_or_path = str(out / "ref")
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["p0", "p1", "p2"], "row": [0, 0, 0]}),
                          processing_class=make_tiny_tokenizer(), rollout_func=rollout)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._generate_and_score_completions([{"prompt": f"p{p}", "row": i} for i, (p, _) in enumerate(rows)])
    if off_policy:
        sampled = _sampling_logprobs(batch, True)
        old = torch.zeros(len(rows), inputs["completion_ids"].shape[1])
        for i, (p, g) in enumerate(rows):
            old[i, : len(sampled[p][g])] = sampled[p][g]
        inputs["old_per_token_logps"] = old
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grad = torch.cat([q.grad.flatten() for q in trainer.model.parameters()])
    return inputs["advantages"].detach(), float(loss.detach()), grad


TRL_EPS = {"eps": 1e-4}
EPS = AdvantageSettings(kwargs=TRL_EPS)  # GRPO's advantages with TRL's epsilon
CASES = {
    # rlvr's defaults (clip-higher, token-mean: DAPO) against TRL's "dapo"
    "dapo": (UpdateSettings(advantage=EPS), {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28}),
    # the GRPO paper's per-sequence mean against TRL's "grpo"
    "grpo": (UpdateSettings(advantage=EPS,
                            loss=LossSettings(kwargs={"clip_high": 0.2}, aggregation="seq-mean-token-mean")),
             {"loss_type": "grpo", "epsilon": 0.2}),
    # Dr. GRPO: no std, a constant denominator
    "dr_grpo": (UpdateSettings(advantage=AdvantageSettings(name="dr_grpo"),
                               loss=LossSettings(aggregation="seq-mean-token-sum-norm", max_tokens=MAX_TOKENS)),
                {"loss_type": "dr_grpo", "epsilon": 0.2, "epsilon_high": 0.28, "scale_rewards": "none"}),
    # a batch std: Lite PPO against TRL's batch scaling
    "lite_ppo": (UpdateSettings(advantage=AdvantageSettings(name="lite_ppo", kwargs=TRL_EPS)),
                 {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "scale_rewards": "batch"}),
    # GSPO: one clipped ratio per sequence, the geometric mean of its tokens'
    "gspo": (UpdateSettings(advantage=EPS, loss=LossSettings(name="gspo", aggregation="seq-mean-token-mean")),
             {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4}),
    # CISPO: the importance weight clipped (above) and detached, times A·log π
    "cispo": (UpdateSettings(advantage=EPS, loss=LossSettings(name="cispo", kwargs={"max_weight": 1.1})),
              {"loss_type": "cispo", "epsilon_high": 1.1}),
    # SAPO: a soft gate instead of the clip
    "sapo": (UpdateSettings(advantage=EPS, loss=LossSettings(name="sapo", aggregation="seq-mean-token-mean")),
             {"loss_type": "sapo"}),
    # GRPO's k3 KL in the loss; TRL 1.16 weights it by the ratio unless told not to
    "kl": (UpdateSettings(advantage=EPS, kl=KLSettings(coef=0.04)),
           {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04, "use_bias_correction_kl": False}),
    # DeepSeek-V3.2's ratio-weighted KL, TRL's default
    "k3_ratio": (UpdateSettings(advantage=EPS, kl=KLSettings(coef=0.04, estimator="k3_ratio")),
                 {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04}),
}


@pytest.mark.dtype_independent  # float32 models on both sides
@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_update_equals_trls_grpo(batch: dict[str, Any], case: str, off_policy: bool, tmp_path: Any) -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    settings, config = CASES[case]
    a_rlvr, loss_rlvr, grad_rlvr = _rlvr(batch, settings, off_policy)
    a_trl, loss_trl, grad_trl = _trl(batch, config, off_policy, tmp_path)
    assert torch.allclose(a_rlvr, a_trl, atol=1e-5), (a_rlvr, a_trl)
    assert loss_rlvr == pytest.approx(loss_trl, rel=1e-5, abs=1e-7)
    assert float((grad_rlvr - grad_trl).norm() / grad_trl.norm()) < 1e-5
    assert grad_trl.norm() > 0


def _trl_rloo(batch: dict[str, Any], config: dict[str, Any], out: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's `RLOOTrainer` on the batch: its advantages and gradient (on-policy; it has no
    `rollout_func`, so its generation is replaced by the batch's completions)."""
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    rows = [(p, g) for p in range(len(REWARDS)) for g in range(G)]

    def reward(prompts: list[Any], completions: list[Any], row: list[int], **_: Any) -> list[float]:
        return [REWARDS[rows[r][0]][rows[r][1]] for r in row]

    args = RLOOConfig(output_dir=str(out / "trl"), num_generations=G, per_device_train_batch_size=len(rows),
                      gradient_accumulation_steps=1, max_completion_length=MAX_TOKENS, report_to="none",
                      use_cpu=True, bf16=False, save_strategy="no", temperature=1.0, **config)
    policy = copy.deepcopy(batch["model"])
    if args.beta:
        make_tiny_model(seed=REF_SEED).save_pretrained(out / "ref")
        policy.config._name_or_path = str(out / "ref")
    trainer = RLOOTrainer(model=policy, reward_funcs=reward, args=args, processing_class=make_tiny_tokenizer(),
                          train_dataset=Dataset.from_dict({"prompt": ["p0", "p1", "p2"], "row": [0, 0, 0]}))
    trainer._generate = lambda prompts: ([batch["prompts"][p] for p, _ in rows],
                                         [batch["completions"][p][g] for p, g in rows], ["x"] * len(rows))
    trainer.model.train()
    inputs = trainer._generate_and_score_completions([{"prompt": f"p{p}", "row": i} for i, (p, _) in enumerate(rows)])
    trainer.model.zero_grad(set_to_none=True)
    trainer._compute_loss(trainer.model, inputs).backward()
    return inputs["advantages"].detach(), torch.cat([q.grad.flatten() for q in trainer.model.parameters()])


RLOO_CASES = {
    # RLOO treats a completion as one action: the summed log-probs (rlvr's seq-mean-token-sum)
    "rloo": (UpdateSettings(advantage=AdvantageSettings(name="rloo"),
                            loss=LossSettings(name="pg", aggregation="seq-mean-token-sum")), {"beta": 0.0}),
    # TRL's default KL for RLOO: k1 summed over the completion, subtracted from its reward
    "rloo_kl": (UpdateSettings(advantage=AdvantageSettings(name="rloo"),
                               loss=LossSettings(name="pg", aggregation="seq-mean-token-sum"),
                               kl=KLSettings(coef=0.05, placement="reward", estimator="k1")), {"beta": 0.05}),
}


@pytest.mark.dtype_independent  # float32 models on both sides
@pytest.mark.parametrize("case", list(RLOO_CASES))
def test_one_update_equals_trls_rloo(batch: dict[str, Any], case: str, tmp_path: Path) -> None:
    """The logged losses differ by definition (TRL's is −mean A on-policy, 0 here): the
    advantages and the gradient are compared."""
    settings, config = RLOO_CASES[case]
    a_rlvr, _, grad_rlvr = _rlvr(batch, settings, off_policy=False)
    a_trl, grad_trl = _trl_rloo(batch, config, tmp_path)
    assert torch.allclose(a_rlvr, a_trl, atol=1e-5), (a_rlvr, a_trl)
    assert float((grad_rlvr - grad_trl).norm() / grad_trl.norm()) < 1e-5
