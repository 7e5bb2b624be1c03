"""SFT+RL hybrids with expert demonstrations (rlvr.train.expert): CHORD's schedule and LUFFY's
loss by hand, the demonstration's tokens, and each mode end to end on the tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlvr.algos import LOSSES
from rlvr.algos.inputs import LossInputs
from rlvr.algos.supervised import chord_mu
from rlvr.config import load_config
from rlvr.train.methods.expert import demonstration
from rlvr.train.loop import setup, train
from rlvr.train.methods.registry import check
from tests.test_train import overrides, read_metrics

EXPERT = ['expert.template="{expression} = {answer}"']


def test_chord_mu_warms_up_then_decays_by_cosine() -> None:
    mu = [chord_mu(t, mu_peak=0.5, mu_valley=0.05, warmup_steps=2, decay_steps=4) for t in range(8)]
    expected = [0.0, 0.25, 0.5, 0.05 + 0.45 * 0.5 * (1 + math.cos(math.pi / 4)), 0.275,
                0.05 + 0.45 * 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.05, 0.05]
    assert mu == pytest.approx(expected)


def test_luffy_loss_by_hand() -> None:
    logprobs = torch.tensor([[0.0, math.log(0.5)]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0]])  # the on-policy token at ratio 1; the demonstration's π_expert = 1
    adv = torch.tensor([[1.0, 2.0]])
    mask = torch.tensor([[True, True]])
    off = torch.tensor([[0.0, 1.0]])
    loss, metrics = LOSSES["luffy"](LossInputs(logprobs, old, adv, mask, offpolicy=off), shaping_gamma=0.1)
    # on-policy: -A·ratio = -1; off-policy: -A·r/(r + γ) = -2·0.5/0.6
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -2 * 0.5 / 0.6]]))
    loss.sum().backward()
    # d/d logp of -A·f(r), r = e^logp: -A·γ·r/(r + γ)² = -2·0.1·0.5/0.36
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -2 * 0.1 * 0.5 / 0.36]]))
    assert metrics["offpolicy_fraction"] == 0.5 and metrics["offpolicy_prob_mean"] == pytest.approx(0.5)


def test_a_demonstration_is_the_template_after_the_engines_prompt(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "demo"), 'expert.mode="chord"', *EXPERT])
    (tmp_path / "demo").mkdir()
    run = setup(cfg, tmp_path / "demo")
    demo = demonstration(run, 0, tuple(run.task.prompt_ids[0]))
    example = run.task.examples[0]
    text = f"{example.fields['entry']['metadata']['expression']} = {example.answer}"
    assert demo.completion.text == text and demo.off_policy
    assert run.tokenizer.decode(list(demo.completion.token_ids)) == text + "<|im_end|>"
    assert demo.prompt_ids == tuple(run.task.prompt_ids[0]) and set(demo.completion.logprobs) == {0.0}
    assert demo.reward == pytest.approx(len(set(text)) / 8.0)  # scored by the run's reward (distinct_chars)


def test_chord_weighs_rl_against_sft_on_the_demonstrations(tiny_dir: Path, tmp_path: Path) -> None:
    extra = ['expert.mode="chord"', *EXPERT, "expert.kwargs.mu_peak=0.8", "expert.kwargs.mu_valley=0.2", "train.steps=3",
             'expert.kwargs.weighting="none"']  # φ = p(1 - p) barely moves a random model: p is ~1/259
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "chord"), *extra]), quiet=True)
    rows = read_metrics(tmp_path / "chord")
    assert [r["expert/mu"] for r in rows] == pytest.approx([0.8, 0.65, 0.35])  # cosine over train.steps
    assert rows[-1]["expert/nll"] < rows[0]["expert/nll"]  # the demonstrations became likelier


def test_luffy_mixes_a_demonstration_into_every_group(tiny_dir: Path, tmp_path: Path) -> None:
    extra = ['expert.mode="luffy"', 'algo.loss="luffy"', *EXPERT]
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "luffy"), *extra]), quiet=True)
    rows = read_metrics(tmp_path / "luffy")
    assert all(r["offpolicy_fraction"] > 0 for r in rows)
    samples = [json.loads(line) for line in (tmp_path / "luffy" / "samples.jsonl").read_text().splitlines()]
    experts = [s for s in samples if s.get("expert")]
    assert len(experts) == 2 * 4 and len(samples) == 2 * 4 * 5  # one per group of 4 policy samples
    assert all(" = " in s["completion"] for s in experts)
    assert rows[0]["response_length"] <= 8  # metrics count the policy's own samples only (max_new_tokens 8)
    # the sampler observes the policy's own groups, with one advantage per own sample
    from rlvr.train.loop import train_step

    (tmp_path / "spy").mkdir()
    run = setup(load_config(None, [*overrides(tiny_dir, tmp_path, "spy"), *extra]), tmp_path / "spy")
    seen: list = []
    run.rollouts.sampler.observe = seen.extend  # type: ignore[method-assign]
    _, groups = train_step(run, 1)
    assert [len(g.samples) for g in seen] == [4] * 4 and [len(g.samples) for g in groups] == [5] * 4
    assert all(g.advantages is not None and len(g.advantages) == len(g.samples) for g in seen + groups)
    with pytest.raises(ValueError, match="go together"):  # LUFFY's own check, when a run opens
        check(load_config(None, [*overrides(tiny_dir, tmp_path, "x"), 'expert.mode="luffy"']))


def test_relift_fine_tunes_on_the_prompts_rl_fails(tiny_dir: Path, tmp_path: Path) -> None:
    # every prompt counts as hard (accuracy <= 1): step 1 fills the buffer with 4, which a batch of 4 takes
    extra = ['expert.mode="relift"', *EXPERT, "expert.kwargs.max_accuracy=1.0", "expert.kwargs.batch=6",
             "train.steps=3"]
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "relift"), *extra]), quiet=True)
    rows = read_metrics(tmp_path / "relift")
    assert [r["expert/relift_sft"] for r in rows] == [0, 1, 1]  # 4 waiting, then 8 (6 taken), then 6
    assert [r["expert/relift_pending"] for r in rows] == [4, 2, 0]
    assert "expert/sft_nll" in rows[1] and rows[1]["expert/sft_grad_norm"] > 0
    # the buffer is saved with the run: resuming from the end of step 1 repeats steps 2 and 3 exactly
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "relift-a"), *extra, "train.steps=1",
                             "keep_checkpoints=5"]), quiet=True)
    train(resume=tmp_path / "relift-a", overrides=("train.steps=3",), quiet=True)
    resumed = read_metrics(tmp_path / "relift-a")
    assert [r["expert/relift_pending"] for r in resumed] == [4, 2, 0]
    assert resumed[-1]["loss"] == pytest.approx(rows[-1]["loss"], rel=1e-5)


def never_right(prompt: str, completion: str, **_: object) -> float:
    return 0.0


def test_warm_start_fine_tunes_once_when_the_groups_are_unsolved(tiny_dir: Path, tmp_path: Path) -> None:
    # every group unsolved: the window of 2 steps fills at step 2, whose update is followed by 3 epochs
    # of one SFT step each on the same 4 demonstrations
    extra = ['expert.mode="warm_start"', *EXPERT, "expert.kwargs.window=2", "expert.kwargs.examples=4",
             "expert.kwargs.epochs=3", "expert.kwargs.batch=4", "train.steps=3",
             'rewards=[{fn = "tests.test_expert:never_right", name = "chars"}]']
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "ws"), *extra, "keep_checkpoints=5"]), quiet=True)
    rows = read_metrics(tmp_path / "ws")
    assert (tmp_path / "ws" / "checkpoints" / "step_000002").is_dir()  # kept at once, with checkpoint_every = 0
    assert rows[0]["expert/warm_start_unsolved"] == 1.0 and "expert/warm_start_steps" not in rows[0]
    assert rows[1]["expert/warm_start_steps"] == 3
    assert rows[1]["expert/warm_start_nll_last"] < rows[1]["expert/warm_start_nll_first"]  # the same 4, likelier
    assert not any(k.startswith("expert/warm_start") for k in rows[2])  # once
    # done is saved with the run: resumed after step 2, step 3 does not fine-tune again, and matches
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "ws-a"), *extra, "train.steps=2",
                             "keep_checkpoints=5"]), quiet=True)
    train(resume=tmp_path / "ws-a", overrides=("train.steps=3",), quiet=True)
    resumed = read_metrics(tmp_path / "ws-a")
    assert not any(k.startswith("expert/warm_start") for k in resumed[2])
    assert resumed[-1]["loss"] == pytest.approx(rows[-1]["loss"], rel=1e-5)
    # "start": after the first step, whatever the groups showed (here distinct_chars, which is often right)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "ws-start"), 'expert.mode="warm_start"', *EXPERT,
                             'expert.kwargs.when="start"', "expert.kwargs.examples=6", "expert.kwargs.epochs=2"]),
          quiet=True)
    rows = read_metrics(tmp_path / "ws-start")
    assert rows[0]["expert/warm_start_steps"] == 2 * 2 and "expert/warm_start_steps" not in rows[1]  # ⌈6/4⌉ a pass


def test_the_expert_modes_knobs_are_checked_against_their_options() -> None:
    from rlvr.config import ConfigError, load_config

    chord = load_config(None, ['expert.mode="chord"', "expert.kwargs.mu_peak=0.3"]).expert.options()
    assert chord.mu_peak == 0.3 and chord.mu_valley == 0.05 and chord.weighting == "chord_phi"
    with pytest.raises(ConfigError, match="unknown keyword 'mu_peek'; did you mean 'mu_peak'"):
        load_config(None, ['expert.mode="chord"', "expert.kwargs.mu_peek=0.3"])
    with pytest.raises(ConfigError, match="mu_peak must be between 0 and 1"):
        load_config(None, ['expert.mode="chord"', "expert.kwargs.mu_peak=1.5"])
    with pytest.raises(ConfigError, match="unknown keyword 'mu_peak'.*it takes batch, max_accuracy"):
        load_config(None, ['expert.mode="relift"', "expert.kwargs.mu_peak=0.3"])  # another mode's knob
    with pytest.raises(ConfigError, match="when: Input should be 'unsolved' or 'start'"):
        load_config(None, ['expert.mode="warm_start"', 'expert.kwargs.when="later"'])
    with pytest.raises(ConfigError, match="set one"):
        load_config(None, ["expert.kwargs.batch=2"])
    with pytest.raises(ConfigError, match="'expert.relift_batch' is now expert.kwargs.batch"):
        load_config(None, ['expert.mode="relift"', "expert.relift_batch=2"])
