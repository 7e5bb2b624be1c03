"""Self-correction (SCoRe's two attempts) and critique tasks: the turn rewards and metrics by hand,
the episode's own verdict as accuracy, the per-turn KL scale, the critique builder and the
verdict reward against answers that hedge, and both trained end to end on the tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlvr.agents.self_correct import REVISE, SelfCorrect, check
from rlvr.data import Example
from rlvr.rewards import build_rewards

SEVEN = Example("What is 3 + 4?\n\nAnswer with just the number.", "7", {"answer": "7"}, "sum/0")


def attempts(actions: list[str], **kwargs: Any) -> tuple[list[Any], SelfCorrect]:
    env = SelfCorrect(SEVEN, build_rewards([{"fn": "exact_answer"}]), **kwargs)
    return [env.step(a) for a in actions], env


def summed(results: list[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in results:
        for k, v in r.metrics.items():
            out[k] = out.get(k, 0.0) + v
    return out


def test_scores_turn_rewards_follow_score_by_hand() -> None:
    """turn 0: first_reward·r1; turn 1: r2 + α(r2 − r1) (SCoRe's stage-II bonus, α = 2 here)."""
    fixed, env = attempts(["5", "It is 7"], bonus=2.0)
    assert env.initial_observation() == SEVEN.prompt
    assert [r.reward for r in fixed] == [0.0, 3.0] and [r.done for r in fixed] == [False, True]
    assert summed(fixed) == {"first_correct": 0.0, "correct": 1.0, "fixed": 1.0, "broken": 0.0, "changed": 1.0}
    broken, _ = attempts(["7", "5"], bonus=2.0)
    assert [r.reward for r in broken] == [1.0, -2.0]
    assert summed(broken) == {"first_correct": 1.0, "correct": 0.0, "fixed": 0.0, "broken": 1.0, "changed": 1.0}
    kept, _ = attempts(["7", "7"], bonus=2.0)
    assert [r.reward for r in kept] == [1.0, 1.0] and summed(kept)["correct"] == 1.0 and summed(kept)["changed"] == 0
    # stage I: the first attempt earns nothing, the second its own reward
    stage1, _ = attempts(["7", "7"], first_reward=0.0)
    assert [r.reward for r in stage1] == [0.0, 1.0]
    # three attempts: "correct" summed over the turns is the last attempt's
    three, _ = attempts(["7", "5", "7"], attempts=3, bonus=1.0)
    assert [r.reward for r in three] == [1.0, -1.0, 2.0] and summed(three)["correct"] == 1.0
    assert summed(three)["fixed"] == 0.0 and summed(three)["broken"] == 0.0


def test_the_request_to_revise_never_leaks_the_verdict() -> None:
    """A right and a wrong first attempt get the very same observation: the policy cannot learn to
    keep an answer only when told it was right."""
    right, _ = attempts(["7"])
    wrong, _ = attempts(["5"])
    assert right[0].observation == wrong[0].observation == REVISE
    custom, _ = attempts(["5"], revise="Check it.")
    assert custom[0].observation == "Check it."


def test_an_attempt_without_a_verdict_ends_the_episode_excluded() -> None:
    from rlvr.rewards.combine import RewardFn

    def undecided(prompt: str, completion: str, **_: Any) -> None:
        return None

    env = SelfCorrect(SEVEN, [RewardFn("undecided", undecided, 1.0, {})])
    result = env.step("7")
    assert result.done and result.metrics == {"excluded": 1.0}


def test_bad_options_are_refused_before_the_model_loads() -> None:
    for kwargs, match in [({"attempts": 1}, "attempts"), ({"attempts": True}, "attempts"), ({"bonus": -1}, "bonus"),
                          ({"bonus": "big"}, "bonus"), ({"first_kl": -1}, "first_kl"), ({"revise": " "}, "revise"), ({"alpha": 1}, "unknown")]:
        with pytest.raises((ValueError, TypeError), match=match):
            check(SimpleNamespace(kwargs=kwargs))
    check(SimpleNamespace(kwargs={"attempts": 3, "bonus": 10, "first_reward": 0}, max_turns=3))
    with pytest.raises(ValueError, match="env.max_turns = 3"):
        check(SimpleNamespace(kwargs={"attempts": 3}, max_turns=2))


def test_the_episodes_own_verdict_is_its_accuracy_and_fails_with_it() -> None:
    """The return of a shaped episode is not its verdict (r1 + r2 + α(r2 − r1) can reach 3 for a
    wrong last answer's neighbour, or 1 for a last answer that broke a right one): accuracy reads
    the environment's `correct`, which a failed episode leaves without a verdict."""
    from rlvr.agents.runner import Episode, as_groups
    from rlvr.train.rollouts import has_verdict, is_correct
    from rlvr.types import Completion

    done = Episode((1,), Completion((2,), (0.0,), "stop", "x"), 1.0, 2, "done", {"correct": 0.0}, [1.0, 0.0], [])
    right = Episode((1,), Completion((2,), (0.0,), "stop", "x"), 1.0, 2, "done", {"correct": 1.0}, [0.0, 1.0], [])
    failed = Episode((1,), Completion((2,), (0.0,), "stop", "x"), 0.0, 1, "infra", {"correct": 1.0}, [0.0], [])
    plain = Episode((1,), Completion((2,), (0.0,), "stop", "x"), 1.0, 1, "done", {}, [1.0], [])
    samples = as_groups([SEVEN], [0], 4, [done, right, failed, plain])[0].samples
    assert [is_correct(s, "exact_answer") for s in samples] == [False, True, True, True]
    assert [has_verdict(s, "exact_answer") for s in samples] == [True, True, False, True]
    assert samples[2].reward_parts["correct/excluded"] == 1.0 and "correct" not in samples[3].reward_parts


def test_kl_turn_scale_weights_each_turns_kl_by_hand() -> None:
    """β·scale[t]·KL on turn t's tokens; k3 by hand: exp(ref − lp) − (ref − lp) − 1."""
    from rlvr.algos.inputs import LossInputs
    from rlvr.train.inputs import turn_scale
    from rlvr.train.update import _penalised
    from rlvr.types import Completion

    c = Completion((5, 6, 7, 8), (0.0,) * 4, "stop", "", loss_mask=(1, 0, 1, 1), turn_index=(0, 0, 1, 2))
    assert turn_scale(c, (10.0, 1.0)).tolist() == [10.0, 10.0, 1.0, 1.0]
    assert turn_scale(Completion((5, 6), (0.0, 0.0), "stop", ""), (3.0, 1.0)).tolist() == [3.0, 3.0]
    lp, ref = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.5, -2.0, -0.25]])
    k3 = [math.exp(r - p) - (r - p) - 1 for p, r in zip(lp[0].tolist(), ref[0].tolist())]
    s = SimpleNamespace(kl=SimpleNamespace(estimator="k3", coef=0.1), loss=SimpleNamespace(entropy_coef=0.0))
    x = LossInputs(lp, lp, torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), ref=ref,
                   kl_scale=torch.tensor([[10.0, 10.0, 1.0]]))
    out = _penalised(torch.zeros(1, 3), x, s, {"kl": 0.0})  # type: ignore[arg-type]
    assert out[0].tolist() == pytest.approx([0.1 * 10 * k3[0], 0.1 * 10 * k3[1], 0.1 * k3[2]], rel=1e-6)
    plain = _penalised(torch.zeros(1, 3), LossInputs(lp, lp, torch.zeros(1, 3), x.mask, ref=ref), s,  # type: ignore[arg-type]
                       {"kl": 0.0})
    assert plain[0].tolist() == pytest.approx([0.1 * k for k in k3], rel=1e-6)


def test_the_environments_kl_scale_reaches_each_token_of_its_turn() -> None:
    """self_correct's first_kl becomes the groups' kl_turn_scale, and the update's per-token factor
    follows each token's turn; a group without it gets 1."""
    from rlvr.agents.runner import Episode, as_groups
    from rlvr.train.inputs import sample_fields
    from rlvr.types import Completion

    assert SelfCorrect(SEVEN, [], first_kl=10.0).kl_turn_scale == (10.0, 1.0)
    assert SelfCorrect(SEVEN, []).kl_turn_scale is None
    c = Completion((5, 6, 7), (0.0,) * 3, "stop", "", loss_mask=(1, 0, 1), turn_index=(0, 0, 1))
    scaled, plain = (as_groups([SEVEN], [0], 1, [Episode((1,), c, 1.0, 2, "done", {}, [0.0, 1.0], [])])[0]
                     for _ in range(2))
    scaled.metadata["kl_turn_scale"] = [(10.0, 1.0)]
    fields = sample_fields([scaled, plain], [*scaled.samples, *plain.samples], [0, 1])
    assert fields.kl_scale is not None
    assert [t.tolist() for t in fields.kl_scale] == [[10.0, 10.0, 1.0], [1.0, 1.0, 1.0]]
    assert sample_fields([plain], list(plain.samples), [0]).kl_scale is None


SELF_CORRECT = ['env.name="self_correct"', "env.kwargs={attempts = 2, bonus = 1.0, first_kl = 10.0}", "env.max_turns=2",
                'rewards=[{fn = "reasoning_gym", kwargs = {extract = "tag_or_last_number"}}]', 'algo.credit="turn"']


def test_self_correction_trains_on_the_tiny_model(tiny_dir: Path, tmp_path: Path) -> None:
    """Two steps of stage-II SCoRe with stage I's KL on the first attempt: the metrics of both
    attempts are logged in training and held-out evaluation, the request to revise is masked as
    injected in every sample, and the weights moved."""
    from safetensors.torch import load_file

    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_train import overrides, read_metrics

    with pytest.raises(ValueError, match="no KL term in the loss"):  # first_kl would weigh nothing
        train(load_config(None, [*overrides(tiny_dir, tmp_path, "nokl", train__steps=1), *SELF_CORRECT]), quiet=True)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "sc", train__steps=2), *SELF_CORRECT, "algo.kl_coef=0.05"]),
          quiet=True)
    run = tmp_path / "sc"
    rows = read_metrics(run)
    for key in ("env/first_correct", "env/correct", "env/fixed", "env/broken", "env/changed", "kl"):
        assert key in rows[-1], key
    assert rows[-1]["env/turns"] == pytest.approx(2.0) and rows[-1]["accuracy"] == rows[-1]["env/correct"]
    summary = json.loads((run / "summary.json").read_text())
    assert {"eval/env/first_correct", "eval/env/fixed"} <= set(summary["eval_after"])
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(any(REVISE in s["completion"][a:b] for a, b, why in s["masked"] if why == "injected")
                           for s in samples)
    before, after = load_file(tiny_dir / "model.safetensors"), load_file(run / "checkpoints" / "step_000002" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


# critique tasks

def pool(n: int = 40) -> list[Example]:
    return [Example(f"What is {i} + 1?", str(i + 1), {"answer": str(i + 1)}, f"p/{i}") for i in range(n)]


def test_critique_examples_pair_each_problem_with_a_labelled_candidate() -> None:
    from rlvr.data.critique import critique_examples
    from rlvr.rewards.generative import CRITIQUE_INSTRUCTION as INSTRUCTION

    made = critique_examples(pool(), seed=1, wrong_fraction=0.5)
    again = critique_examples(pool(), seed=1, wrong_fraction=0.5)
    assert made == again and len(made) == 40
    for ex, base in zip(made, pool()):
        assert ex.answer in ("correct", "incorrect") and ex.fields["answer"] == ex.answer
        assert ex.id == f"critique/{base.id}" and ex.fields["reference"] == base.answer
        assert ex.prompt == f"Problem: {base.prompt}\n\nProposed answer: {ex.fields['candidate']}\n\n{INSTRUCTION}"
        assert (ex.fields["candidate"] == base.answer) == (ex.answer == "correct")
    wrong = sum(ex.answer == "incorrect" for ex in made)
    assert 8 <= wrong <= 32  # 40 draws at 1/2: outside this is a 1-in-10^4 event
    assert {ex.answer for ex in critique_examples(pool(), seed=0, wrong_fraction=0.0)} == {"correct"}
    every = critique_examples(pool(), seed=0, wrong_fraction=1.0)
    assert {ex.answer for ex in every} == {"incorrect"}
    assert all(abs(int(ex.fields["candidate"]) - int(ex.fields["reference"])) in (1, 2, 10) for ex in every)
    words = [Example(f"Capital of {c}?", c.upper(), {}, c) for c in ("a", "b", "c")]
    assert all(ex.fields["candidate"] != ex.fields["reference"]
               for ex in critique_examples(words, seed=0, wrong_fraction=1.0))


def test_critique_examples_refuse_what_they_cannot_label() -> None:
    from rlvr.data.critique import critique_examples

    with pytest.raises(ValueError, match="no reference answer"):
        critique_examples([Example("q", None, {}, "q/0")], seed=0)
    with pytest.raises(ValueError, match="together"):
        critique_examples(pool(), seed=0, candidate_column="candidate")
    with pytest.raises(ValueError, match="between 0 and 1"):
        critique_examples(pool(), seed=0, wrong_fraction=1.5)
    with pytest.raises(ValueError, match="no wrong answer"):
        critique_examples([Example("q", "same", {}, "q/0"), Example("r", "Same", {}, "r/0")], seed=0,
                          wrong_fraction=1.0)
    graded = [Example("q", None, {"cand": "4", "ok": "maybe"}, "q/0")]
    with pytest.raises(ValueError, match="a label is"):
        critique_examples(graded, seed=0, candidate_column="cand", label_column="ok")
    with pytest.raises(ValueError, match="images"):
        critique_examples([Example("q", "1", {"images": ["x.png"]}, "q/0")], seed=0)


def test_graded_rows_bring_their_own_candidates_through_the_config(tmp_path: Path) -> None:
    from rlvr.config import load_config
    from rlvr.train.data import load_examples

    rows = [{"prompt": f"{i} + {i} = ?", "answer": str(2 * i), "candidate": str(2 * i + (i % 2)),
             "graded": ["incorrect", "correct"][i % 2 == 0]} for i in range(30)]
    path = tmp_path / "graded.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ['task.source="jsonl"', f'task.path="{path}"', "task.eval_size=4",
                             'task.transforms=[{fn = "critique", kwargs = {candidate_column = "candidate", label_column = "graded"}}]',
                             'rewards=[{fn = "verdict"}]'])
    train, held = load_examples(cfg)
    made = [*train, *held]
    assert len(made) == 30
    for ex in made:  # each row's own candidate and grade, the row's columns kept beside them
        assert ex.answer == ex.fields["graded"] and f"Proposed answer: {ex.fields['candidate']}\n" in ex.prompt
        assert "Put the final answer" not in ex.prompt  # the problem is shown without the instruction to solve it
    with pytest.raises(ValueError, match="'wrong'"):
        load_examples(load_config(None, ['task.transforms=[{fn = "critique", kwargs = {wrong = 0.2}}]']))
    with pytest.raises(ValueError, match="unknown fn 'critic'"):
        load_examples(load_config(None, ['task.transforms=[{fn = "critic"}]']))


@pytest.mark.parametrize("text, verdict", [
    ("correct", "correct"), ("Incorrect.", "incorrect"), ("The answer is not correct.", "incorrect"),
    ("It isn't correct", "incorrect"), ("<answer>correct</answer>", "correct"),
    ("I think it is incorrect. <answer>correct</answer>", "correct"),  # the tag is the answer
    ("correct or incorrect, hard to say", None), ("correct... no, incorrect", None),  # a hedge has no verdict
    ("yes", None), ("", None), ("incorrectly", None), ("<answer>maybe</answer> correct", None)])
def test_read_verdict_takes_one_verdict_and_no_hedge(text: str, verdict: str | None) -> None:
    from rlvr.rewards.builtin import read_verdict

    assert read_verdict(text) == verdict


def test_verdict_reward_scores_agreement_with_the_label() -> None:
    from rlvr.rewards.builtin import verdict_reward

    assert verdict_reward("p", "Incorrect", answer="incorrect") == 1.0
    assert verdict_reward("p", "correct", answer="incorrect") == 0.0
    assert verdict_reward("p", "correct and incorrect", answer="correct") == 0.0  # saying both never pays
    with pytest.raises(ValueError, match="must be"):
        verdict_reward("p", "correct", answer="7")


def test_critique_trains_with_rl_and_with_sft_on_the_tiny_model(tiny_dir: Path, tmp_path: Path) -> None:
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from rlvr.train.offline import sft
    from tests.test_train import overrides, read_metrics

    critique = ['task.transforms=[{fn = "critique"}]', 'rewards=[{fn = "verdict"}]']
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "crl"), *critique]), quiet=True)
    rows = read_metrics(tmp_path / "crl")
    assert len(rows) == 2 and "rewards/verdict" in rows[-1]
    samples = [json.loads(line) for line in (tmp_path / "crl" / "samples.jsonl").read_text().splitlines()]
    assert all(s["prompt"].startswith("Problem: ") and "Proposed answer: " in s["prompt"] for s in samples)
    summary = sft(load_config(None, [f'model="{tiny_dir}"', f'output_dir="{tmp_path}"', "name=cft", "task.size=40",
                           "task.eval_size=4", *critique, "sft.task_examples=8", 'sft.answer_template="{answer}"',
                           "sft.epochs=1", "sft.batch_size=4"], command="sft"), quiet=True)
    assert summary["data"]["conversations"] == 8 and summary["data"]["trained_tokens"] > 0
    assert "critique/" in next(iter(summary["held_out_after"]))  # held out: critique examples too


def test_the_packaged_configs_load_for_their_commands() -> None:
    from rlvr.config import load_config

    sc = load_config("self_correct")
    assert sc.env.name == "self_correct" and sc.env.max_turns >= sc.env.kwargs["attempts"]
    assert load_config("critique").task.transforms[0].kwargs == {"wrong_fraction": 0.5}
    assert "{answer}" in (load_config("critique_sft", command="sft").sft.answer_template or "")
