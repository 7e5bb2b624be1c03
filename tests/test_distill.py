"""On-policy distillation (algo.advantage = "opd"): the per-token reverse-KL advantage by hand,
the update's gradient against a hand-written loop, and a run that moves the student toward the
teacher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlvr.algos.distill import OpdOptions, reverse_kl_advantages
from rlvr.config import ConfigError, load_config
from rlvr.train.methods.distill import TeacherCredit
from rlvr.train.settings import Passes, UpdateSettings
from rlvr.train.update import update_policy
from rlvr.types import Completion, Group, Sample
from tests.test_learner import EXACT, GradRecorder, assert_grads_close, exact_model, make_groups
from tests.test_train import overrides
from tests.tiny import make_tiny_model, make_tiny_tokenizer


def test_the_advantage_is_the_teacher_minus_the_student_log_prob() -> None:
    student, teacher = torch.tensor([-1.0, -0.5, -3.0]), torch.tensor([-2.0, -0.5, -1.0])
    torch.testing.assert_close(reverse_kl_advantages(student, teacher), torch.tensor([-1.0, 0.0, 2.0]))
    torch.testing.assert_close(reverse_kl_advantages(student, teacher, coef=0.5), torch.tensor([-0.5, 0.0, 1.0]))


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="nothing to train"):
        OpdOptions(teacher="x", coef=0.0)
    with pytest.raises(ValueError, match="not an outcome estimator"):
        OpdOptions(teacher="x", outcome="gae")
    with pytest.raises(ConfigError, match="missing keyword 'teacher'"):
        load_config(None, ['algo.advantage="opd"'])


def teacher_logprobs(teacher: torch.nn.Module, sample: Sample) -> torch.Tensor:
    ids = torch.tensor([sample.prompt_ids + sample.completion.token_ids])
    logp_TV = teacher(input_ids=ids).logits[0, :-1].log_softmax(-1)
    return logp_TV.gather(-1, ids[0, 1:, None]).squeeze(-1)[len(sample.prompt_ids) - 1:].detach()


def test_the_update_is_reinforce_with_the_teachers_per_token_advantages() -> None:
    """Student and teacher are two tiny models; the engine's log-probs of the samples are -1 per
    token. Per token A_t = log π_T − (−1); the gradient must be token-mean REINFORCE with those,
    on every sample: distillation trains groups whose rewards are all equal too."""
    groups = make_groups([[1.0, 1.0, 1.0], [0.0, 1.0, 0.5]])
    teacher = make_tiny_model(seed=1, dtype=EXACT)
    credit = TeacherCredit(teacher, OpdOptions(teacher="unused"))
    recorder = GradRecorder(exact_model())
    metrics = update_policy(recorder, groups, UpdateSettings(passes=Passes(micro_batch_size=2)),  # type: ignore[arg-type]
                            pad_token_id=0, credit=credit).metrics
    samples = [x for g in groups for x in g.samples]
    model = exact_model()
    total = sum(len(x.completion.token_ids) for x in samples)
    kl = []
    for x in samples:
        ids = torch.tensor([x.prompt_ids + x.completion.token_ids])
        logp_TV = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        lp_T = logp_TV.gather(-1, ids[0, 1:, None]).squeeze(-1)[len(x.prompt_ids) - 1:]
        # advantages are float32 in rlvr (as every estimator's are): round the same way
        advantage_T = (teacher_logprobs(teacher, x).float() + 1.0).to(EXACT)
        (-(advantage_T * lp_T).sum() / total).backward()
        kl.append(float((-1.0 - teacher_logprobs(teacher, x)).mean()))
    assert_grads_close(recorder.grads, [{n: p.grad for n, p in model.named_parameters() if p.grad is not None}])
    assert metrics["opd/reverse_kl"] == pytest.approx(sum(kl) / len(kl), rel=1e-6)
    assert metrics["trained_fraction"] == 1.0


def test_under_truncated_sampling_the_policy_scores_the_student(tiny_dir: Path) -> None:
    """top_p < 1, top_k > 0 or banned tokens: the engine's log-probs are of the renormalised
    distribution (log π − log S; here -1 per token, far from the tiny student's ~-5.5), so the
    policy scores the student's tokens and A_t = log π_T − log π_θ, as on the full distribution
    (issue 50, bug 4: every advantage had shifted by −log S)."""
    groups = make_groups([[1.0, 1.0, 1.0], [0.0, 1.0, 0.5]])
    samples = [x for g in groups for x in g.samples]
    teacher, student = make_tiny_model(seed=1, dtype=EXACT), exact_model()
    credit = TeacherCredit(teacher, OpdOptions(teacher="unused"), student=student)
    advantages = credit.advantages(groups, samples, set(range(len(samples))), torch.tensor([g.rewards for g in groups]),
                                   None, UpdateSettings(), pad_token_id=0)
    for x, a in zip(samples, advantages):
        want = (teacher_logprobs(teacher, x) - teacher_logprobs(student, x)).float()
        torch.testing.assert_close(a, want, atol=1e-6, rtol=0)  # float32 advantages of float64 log-probs
    engine = TeacherCredit(teacher, OpdOptions(teacher="unused")).advantages(
        groups, samples, set(range(len(samples))), torch.tensor([g.rewards for g in groups]), None, UpdateSettings(),
        pad_token_id=0)
    assert all(not torch.allclose(a, b) for a, b in zip(engine, advantages))  # the engine's -1 differs
    # which runs score with the policy: those whose engine truncates
    policy = make_tiny_model()
    base = [f'model="{tiny_dir}"', 'algo.advantage="opd"', f'algo.advantage_kwargs={{teacher = "{tiny_dir}"}}']
    from rlvr.train.methods.distill import teacher_credit

    for extra, banned, scores in (([], False, False), (["sampling.top_p=0.9"], False, True),
                                  (["sampling.top_k=20"], False, True), ([], True, True)):
        credit_ = teacher_credit(load_config(None, base + extra), policy, banned=banned)
        assert credit_ is not None and (credit_.student is policy) == scores, extra


def test_the_outcome_advantage_mixes_in() -> None:
    """outcome_weight w adds w·A_grpo to every token of a sample; a teacher that agrees with the
    engine (the student itself, log-probs equal) leaves only that term."""
    student = make_tiny_model()
    groups = make_groups([[1.0, 0.0, 0.0]])
    samples = [x for g in groups for x in g.samples]
    agreeing = []
    for x in samples:  # the engine's log-probs are the student's own: a zero reverse KL
        c = x.completion
        lp = tuple(teacher_logprobs(student, x).tolist())
        agreeing.append(Sample(x.prompt_ids, Completion(c.token_ids, lp, c.finish_reason, c.text), x.reward,
                               x.reward_parts, x.prompt_index))
    groups = [Group(prompt=groups[0].prompt, samples=tuple(agreeing))]
    credit = TeacherCredit(student, OpdOptions(teacher="unused", outcome_weight=0.5))
    advantages = credit.advantages(groups, agreeing, set(range(3)), torch.tensor([[1.0, 0.0, 0.0]]), None,
                                   UpdateSettings(), pad_token_id=0)
    # GRPO on (1, 0, 0): mean 1/3, std 1/√3 (Bessel's), so A = (2/√3, −1/√3, −1/√3)
    expected = [0.5 * v for v in (2 / 3 ** 0.5, -1 / 3 ** 0.5, -1 / 3 ** 0.5)]
    for a, e in zip(advantages, expected):
        torch.testing.assert_close(a, torch.full_like(a, e), atol=1e-5, rtol=0)  # 1e-5: fp32 log-probs, GRPO's ε


def test_a_run_distils_the_teacher_into_the_student(tiny_dir: Path, tmp_path: Path) -> None:
    """rlvr train with advantage = "opd" and a different tiny model as the teacher: the student's
    reverse KL to the teacher on its own fresh samples falls over the run."""
    from rlvr.train.loop import train

    teacher_dir = tmp_path / "teacher"
    make_tiny_model(seed=1).save_pretrained(teacher_dir)
    make_tiny_tokenizer().save_pretrained(teacher_dir)
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "opd", train__steps=12, train__lr=1e-2),
                             'algo.advantage="opd"', f'algo.advantage_kwargs={{teacher = "{teacher_dir}"}}',
                             'train.precision="fp32"', 'engine.dtype="float32"'])
    train(cfg, quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "opd" / "metrics.jsonl").read_text().splitlines()]
    kl = [r["opd/reverse_kl"] for r in rows if "opd/reverse_kl" in r]
    assert len(kl) == 12
    # measured on this seed: 1.15 over the first three steps, 0.70 over the last three; each step's
    # estimate is a mean over 16 fresh samples of 8 tokens, noisy at ±0.15
    assert sum(kl[-3:]) / 3 < 0.8 * sum(kl[:3]) / 3, kl


def test_a_teacher_with_another_tokenizer_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    from rlvr.train.loop import train

    other = tmp_path / "other"
    make_tiny_model(vocab_size=300).save_pretrained(other)
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "bad"), 'algo.advantage="opd"',
                             f'algo.advantage_kwargs={{teacher = "{other}"}}'])
    with pytest.raises(ValueError, match="another tokenizer"):
        train(cfg, quiet=True)
