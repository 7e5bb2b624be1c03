"""`rlvr rm`: reward-model training (Bradley–Terry and PRM), its data layouts and its report's
numbers, worked by hand; a tiny model learns a preference it starts without, and what it saves
plugs into the reward_model reward and the PRM loader."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from rlvr.data.chat import ChatDataError
from rlvr.rewards.reward_model import reward_model_reward
from rlvr.rewards.process import load_prm
from rlvr.rewards.rm_train import (Options, Pair, calibration, labelled_of, pair_of, pairwise_report, split,
                                   step_report, train_reward_model)


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_preference_layouts() -> None:
    plain = pair_of({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "f:1")
    assert plain == Pair((("user", "2+2?"),), "4", "5")
    explicit = pair_of({"prompt": [{"role": "user", "content": "2+2?"}],
                        "chosen": [{"role": "assistant", "content": "4"}],
                        "rejected": [{"role": "assistant", "content": "5"}]}, "f:2")
    implicit = pair_of({"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
                        "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]}, "f:3")
    assert explicit == implicit == plain
    with_system = pair_of({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                           "chosen": "Hi.", "rejected": "Hello there, how are you?", "margin": 2}, "f:4")
    assert with_system.context[0] == ("system", "Be brief.") and with_system.margin == 2.0
    with pytest.raises(ChatDataError, match="f:5: a preference row needs \"prompt\""):
        pair_of({"chosen": "Human: hi Assistant: hello", "rejected": "Human: hi Assistant: go away"}, "f:5")
    with pytest.raises(ChatDataError, match="share every turn"):
        pair_of({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                 "rejected": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "f:6")
    with pytest.raises(ChatDataError, match="margin"):
        pair_of({"prompt": "q", "chosen": "a", "rejected": "b", "margin": float("nan")}, "f:7")


def test_step_layout() -> None:
    row = labelled_of({"prompt": "1+1?", "completions": ["1+1=2", "so 2"], "labels": [True, True]}, "f:1")
    assert row.steps == ("1+1=2", "so 2") and row.labels == (True, True)
    with pytest.raises(ChatDataError, match="2 steps, 1 labels"):
        labelled_of({"prompt": "q", "completions": ["a", "b"], "labels": [True]}, "f:2")


def test_pairwise_report_by_hand() -> None:
    report = pairwise_report([2.0, -1.0, 0.0])
    assert report["accuracy"] == pytest.approx(1.5 / 3)  # right, wrong, a tie counts half
    assert report["mean_margin"] == pytest.approx(1 / 3)
    assert report["log_loss"] == pytest.approx(-(math.log(sig(2)) + math.log(sig(-1)) + math.log(0.5)) / 3)
    assert report["brier"] == pytest.approx(((sig(2) - 1) ** 2 + (sig(-1) - 1) ** 2 + 0.25) / 3)
    # confidences 0.881 (right), 0.731 (wrong: it preferred the rejected answer), 0.5 (counted right),
    # each alone in its bin: ECE = mean |confidence - accuracy|
    assert report["ece"] == pytest.approx(((1 - sig(2)) + sig(1) + 0.5) / 3)


def test_calibration_of_a_perfectly_calibrated_forecast_is_zero() -> None:
    probs = [0.8] * 10 + [0.3] * 10
    outcomes = [True] * 8 + [False] * 2 + [False] * 7 + [True] * 3
    assert calibration(probs, outcomes)["ece"] == pytest.approx(0.0)


def test_step_report_by_hand() -> None:
    report = step_report([[0.9, 0.2], [0.7]], [[True, True], [True]])
    assert report["step_accuracy"] == pytest.approx(2 / 3)
    assert report["solution_accuracy"] == pytest.approx(1 / 2)  # the first solution is called wrong, is right


def test_split_keeps_a_prompts_rows_together() -> None:
    pairs = [Pair((("user", f"q{k % 20}"),), "a", "b") for k in range(200)]
    train, held = split(pairs, lambda p: p.context[0][1], 0.25, seed=0)
    assert not {p.context for p in train} & {p.context for p in held} and held and train
    with pytest.raises(ValueError, match="eval_fraction"):
        split(pairs[:1], lambda p: p.context[0][1], 0.5, seed=0)


def _preference_file(path: Path, count: int) -> None:
    """Pairs where the chosen answer says yes and the rejected says no: a preference the fresh
    head cannot have before training."""
    rng = random.Random(0)
    with path.open("w") as f:
        for k in range(count):
            prompt = f"question {k}: is {rng.randint(0, 99)} a number?"
            f.write(json.dumps({"prompt": prompt, "chosen": "yes yes", "rejected": "no no"}) + "\n")


def test_a_bradley_terry_model_learns_a_preference_and_plugs_into_the_reward(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "pairs.jsonl"
    _preference_file(data, 120)
    out = tmp_path / "rm"
    report = train_reward_model(str(data), str(tiny_dir), out, Options(epochs=3, lr=1e-3, batch_size=8,
                                                                      eval_fraction=0.2), say=lambda _: None)
    assert report["held_out"]["accuracy"] == 1.0 and report["held_out"]["mean_margin"] > 1.0
    assert report["held_out"]["log_loss"] < report["held_out_before"]["log_loss"]
    assert json.loads((out / "report.json").read_text())["kind"] == "outcome"
    scores = reward_model_reward("question 7: is 3 a number?", ["yes yes", "no no"], model=str(out))
    assert scores[0] > scores[1]


def test_a_process_reward_model_learns_step_labels_and_loads_as_a_prm(tiny_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(0)
    data = tmp_path / "steps.jsonl"
    with data.open("w") as f:
        for k in range(120):
            labels = [rng.random() < 0.5 for _ in range(3)]
            steps = [("good step" if ok else "bad step") for ok in labels]
            f.write(json.dumps({"prompt": f"problem {k}", "completions": steps, "labels": labels}) + "\n")
    out = tmp_path / "prm"
    report = train_reward_model(str(data), str(tiny_dir), out, Options(epochs=3, lr=1e-3, batch_size=8,
                                                                      eval_fraction=0.2), say=lambda _: None)
    assert report["kind"] == "process" and report["held_out"]["step_accuracy"] == 1.0
    (probs,) = load_prm(str(out), separator="\n").score(["problem 1"], [["good step", "bad step"]], [{}])
    assert probs[0] > 0.5 > probs[1]


def test_rows_of_the_wrong_kind_are_refused(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "pairs.jsonl"
    _preference_file(data, 4)
    with pytest.raises(ValueError, match="holds outcome rows"):
        train_reward_model(str(data), str(tiny_dir), tmp_path / "x", Options(), kind="process")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ChatDataError, match="bad.jsonl:1: neither a preference row"):
        train_reward_model(str(tmp_path / "bad.jsonl"), str(tiny_dir), tmp_path / "y", Options())


def odd_length(prompt: str, completion: str, **_: object) -> float:
    """A verifier the tiny model's random samples pass about half the time."""
    return float(len(completion.strip()) % 2)


def test_pairs_and_critique_rows_come_from_the_models_own_samples_and_train_prompts_only(
        tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`rlvr rm pairs` and `rlvr rm verdicts` sample the config's training prompts (never its
    held-out ones), judged by its rewards. Verdict rows are distinct, labelled by the first
    reward, balanced unless asked not to be, and are what the critique transform trains a
    generative verifier on."""
    from rlvr.cli import main
    from rlvr.config import load_config
    from rlvr.train.data import load_examples

    task = [f'model="{tiny_dir}"', "task.size=40", "task.eval_size=4", "sampling.max_new_tokens=6",
            'rewards=[{fn = "tests.test_rm_train:odd_length"}]']
    held = {ex.prompt for ex in load_examples(load_config("demo", task))[1]}
    common = ["--config", "demo", "--model", str(tiny_dir), "--prompts", "12", "-n", "4"]
    pairs, verdicts, every = tmp_path / "p.jsonl", tmp_path / "v.jsonl", tmp_path / "all.jsonl"
    assert main(["rm", "pairs", *common, "--out", str(pairs), *task]) == 0
    assert main(["rm", "verdicts", *common, "--out", str(verdicts), *task]) == 0
    assert main(["rm", "verdicts", *common, "--no-balance", "--out", str(every), *task]) == 0
    made = [json.loads(line) for line in pairs.read_text().splitlines()]
    assert made and all(odd_length("", p["chosen"]) == 1.0 and odd_length("", p["rejected"]) == 0.0 for p in made)
    rows, unbalanced = ([json.loads(line) for line in f.read_text().splitlines()] for f in (verdicts, every))
    for table in (rows, unbalanced):
        assert all(r["label"] == bool(len(r["candidate"]) % 2) for r in table)
        assert len({(r["prompt"], r["candidate"]) for r in table}) == len({r["id"] for r in table}) == len(table)
        assert not held & {r["prompt"] for r in table} and not held & {p["prompt"] for p in made}
    right = sum(r["label"] for r in rows)
    assert right and 2 * right == len(rows)
    assert len(unbalanced) >= len(rows) and min(sum(r["label"] for r in unbalanced),
                                                 sum(not r["label"] for r in unbalanced)) == right
    judge = load_config("judge_sft", [f'model="{tiny_dir}"', 'task.source="jsonl"', f'task.path="{verdicts}"',
                                      'task.params={answer_column = "label"}', 'task.instruction=""', "task.eval_size=2",
                                      'task.transforms=[{fn = "critique", kwargs = {candidate_column = "candidate", '
                                      'label_column = "label"}}]'], command="sft")
    train, _ = load_examples(judge)
    by_prompt = {(r["prompt"], r["candidate"]): r["label"] for r in rows}
    for ex in train:
        assert ex.prompt.startswith("Problem: ") and ex.answer == ("correct" if by_prompt[ex.fields["problem"], ex.fields[
            "candidate"]] else "incorrect")
    capsys.readouterr()
    assert main(["rm", "verdicts", *common, "--extract", "boxes", "--out", str(tmp_path / "x.jsonl"), *task]) == 2
    err = capsys.readouterr().err
    assert "unknown answer format 'boxes'" in err and "sampling prompts" not in err  # refused before sampling
