"""Process supervision (algo.advantage = "process"): step splitting, step ends in tokens, the
group-normalised step advantages by hand, the PRM interfaces, and a run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForTokenClassification

from rlvr.algos.process import ProcessOptions, process_advantages, split_steps, step_end_tokens, step_text
from rlvr.config import ConfigError, load_config
from rlvr.rewards.process import ClassifierPRM, FunctionPRM, load_prm
from rlvr.train.methods.process import ProcessCredit
from rlvr.train.update import UpdateSettings
from rlvr.types import Completion, Group, Sample
from tests.test_train import overrides, read_metrics
from tests.tiny import make_tiny_tokenizer


def test_steps_are_split_on_the_delimiter_keeping_it_with_the_step_it_closes() -> None:
    text = "a = 1\n\nb = 2\n\n\n\nso 3"
    spans = split_steps(text)
    assert [text[a:b] for a, b in spans] == ["a = 1\n\n", "b = 2\n\n\n\n", "so 3"]  # a blank piece joins its step
    assert split_steps("one step") == [(0, 8)]
    assert [("x\n\n")[a:b] for a, b in split_steps("x\n\n")] == ["x\n\n"]
    assert split_steps("") == []
    text = "\n\nfirst\n\nsecond"  # a leading delimiter joins the first step
    assert [text[a:b] for a, b in split_steps(text)] == ["\n\nfirst\n\n", "second"]
    assert split_steps("  ") == [(0, 2)]
    # what a PRM reads: bare steps, as TRL's PRM data has them (the PRM adds its separator)
    assert [step_text(text, span) for span in split_steps(text)] == ["first", "second"]
    assert [step_text(t, span, "Next:") for t in ["a Next: b Next:"] for span in split_steps(t, "Next:")] == ["a", "b"]
    assert [t[a:b] for t in ["1. a\n2. b"] for a, b in split_steps(t, "\n")] == ["1. a\n", "2. b"]
    with pytest.raises(ValueError, match="empty"):
        split_steps("x", "")


def test_step_ends_are_the_tokens_where_each_step_text_ends() -> None:
    tok = make_tiny_tokenizer()  # one token per byte
    text = "ab\n\ncd\n\nef"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    spans = split_steps(text)
    assert step_end_tokens(tok, ids, spans) == [3, 7, 10]  # the last step keeps the EOS (token 10)
    # a multi-byte character: "é" is two tokens; the step ends after both
    text = "é\n\nx"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert step_end_tokens(tok, ids, split_steps(text)) == [3, 4]


def test_process_advantages_by_hand() -> None:
    """DeepSeekMath's process supervision: R = all step rewards of the group = (1, 0, 0, 1, 1),
    mean 0.6, std (Bessel) √0.3 = 0.5477; a token's advantage sums the normalised rewards of the
    steps that end at or after it."""
    scale = math.sqrt(0.3) + 1e-6
    got = process_advantages([[1.0, 0.0], [0.0, 1.0, 1.0]], [[1, 3], [0, 2, 4]], [4, 5])
    n = [(r - 0.6) / scale for r in (1.0, 0.0, 0.0, 1.0, 1.0)]
    torch.testing.assert_close(got[0], torch.tensor([n[0] + n[1]] * 2 + [n[1]] * 2))
    torch.testing.assert_close(got[1], torch.tensor([n[2] + n[3] + n[4], n[3] + n[4], n[3] + n[4], n[4], n[4]]))
    # equal step rewards, or a single one, carry no ranking: zero advantage
    assert all(float(a.abs().sum()) == 0 for a in process_advantages([[0.7, 0.7], [0.7]], [[0, 1], [0]], [2, 1]))
    assert float(process_advantages([[0.7]], [[0]], [1])[0].abs().sum()) == 0
    with pytest.raises(ValueError, match="2 step rewards for 1 steps"):
        process_advantages([[1.0, 0.0]], [[0]], [3])
    with pytest.raises(ValueError, match="ends on token 5"):
        process_advantages([[1.0]], [[5]], [3])


def digits_are_right(prompt: str, steps: list[str], answer: str | None = None, **example: Any) -> list[float]:
    """A rule-based PRM for tests: a step scores 1 if it contains a digit, else 0."""
    return [float(any(c.isdigit() for c in step)) for step in steps]


def test_a_function_prm_is_checked() -> None:
    prm = load_prm("tests.test_process_rewards:digits_are_right")
    assert isinstance(prm, FunctionPRM)
    assert prm.score(["p"], [["a1", "b"]], [{}]) == [[1.0, 0.0]]
    with pytest.raises(ValueError, match="1 scores for 2 steps"):
        FunctionPRM(lambda prompt, steps, **e: [1.0], "short").score(["p"], [["a", "b"]], [{}])
    with pytest.raises(ValueError, match="not finite"):
        FunctionPRM(lambda prompt, steps, **e: [math.nan], "nan").score(["p"], [["a"]], [{}])


def tiny_classifier(labels: int = 2) -> LlamaForTokenClassification:
    config = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, num_labels=labels,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForTokenClassification(config).eval()


@pytest.mark.parametrize("labels", [1, 2])
def test_a_classifier_prm_reads_each_steps_label_at_its_separators_last_token(labels: int) -> None:
    """TRL's PRM layout: BOS, the prompt, then each step followed by the separator; the score is
    P(correct) there. Checked one sequence at a time against a batch with padding."""
    tok = make_tiny_tokenizer()
    prm = ClassifierPRM(tiny_classifier(labels), tok, separator="\n")
    ids, positions = prm.layout("Q?", ["s1", "step 2"])
    assert ids == [1, *tok("Q?s1\nstep 2\n", add_special_tokens=False)["input_ids"]] and positions == [5, 12]
    batch = prm.score(["Q?", "a longer prompt"], [["s1", "step 2"], ["x"]], [{}, {}])
    for (prompt, steps), got in zip([("Q?", ["s1", "step 2"]), ("a longer prompt", ["x"])], batch):
        ids, positions = prm.layout(prompt, steps)
        logits = prm.model(input_ids=torch.tensor([ids])).logits[0, positions]
        want = torch.sigmoid(logits[:, 0]) if labels == 1 else logits.softmax(-1)[:, -1]
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-6, rtol=0)


def completion(tok: Any, text: str) -> Completion:
    ids = tuple(tok(text, add_special_tokens=False)["input_ids"]) + (tok.eos_token_id,)
    return Completion(ids, (-1.0,) * len(ids), "stop", text)


def test_the_credit_gives_each_token_its_steps_normalised_scores() -> None:
    """Two samples: "1\\n\\nx" scores (1, 0), "y\\n\\n2\\n\\n3" scores (0, 1, 1): the hand example above,
    placed on tokens (one per byte, EOS in the last step); outcome_weight adds GRPO's advantage."""
    tok = make_tiny_tokenizer()
    texts = ["1\n\nx", "y\n\n2\n\n3"]
    group = Group("p", tuple(Sample((1,), completion(tok, t), r, {"r": r}, 0) for t, r in zip(texts, (1.0, 0.0))))
    credit = ProcessCredit(load_prm("tests.test_process_rewards:digits_are_right"),
                           ProcessOptions(prm="unused"), tok)
    got = credit.advantages([group], list(group.samples), {0, 1}, torch.tensor([[1.0, 0.0]]), None, UpdateSettings(), 0)
    want = process_advantages([[1.0, 0.0], [0.0, 1.0, 1.0]], [[2, 4], [2, 5, 7]], [5, 8])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert credit.summarise({}) == {"process/step_score": 0.6, "process/steps": 2.5}
    mixed = ProcessCredit(credit.scorer.prm, ProcessOptions(prm="unused", outcome_weight=0.5), tok)
    got = mixed.advantages([group], list(group.samples), {0, 1}, torch.tensor([[1.0, 0.0]]), None, UpdateSettings(), 0)
    grpo = 0.5 / math.sqrt(0.5)  # (1 − 0.5) / std(1, 0) = 0.5 / √0.5 (Bessel)
    torch.testing.assert_close(got[0], want[0] + 0.5 * grpo, atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], want[1] - 0.5 * grpo, atol=1e-5, rtol=0)
    # a sample left out of the loss (not in kept) neither gets advantages nor sets the baseline
    only = credit.advantages([group], list(group.samples), {1}, torch.tensor([[1.0, 0.0]]), None, UpdateSettings(), 0)
    torch.testing.assert_close(only[1], process_advantages([[0.0, 1.0, 1.0]], [[2, 5, 7]], [8])[0])
    assert float(only[0].abs().sum()) == 0


def test_the_prm_reads_bare_steps() -> None:
    """A classifier PRM trained on TRL's layout saw each step followed by its separator only: the
    delimiter that ended the step in the completion is not passed on."""
    tok = make_tiny_tokenizer()
    seen: list[list[str]] = []

    class Recording:
        def score(self, prompts: Any, steps: Any, examples: Any) -> list[list[float]]:
            seen.extend(steps)
            return [[1.0] * len(s) for s in steps]

    group = Group("p", (Sample((1,), completion(tok, "1 + 1 = 2\n\nso 2\n\n"), 1.0, {"r": 1.0}, 0),))
    ProcessCredit(Recording(), ProcessOptions(prm="unused"), tok).advantages(  # type: ignore[arg-type]
        [group], list(group.samples), {0}, torch.tensor([[1.0]]), None, UpdateSettings(), 0)
    assert seen == [["1 + 1 = 2", "so 2"]]


def test_process_needs_its_prm(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing keyword 'prm'"):
        load_config(None, ['algo.advantage="process"'])


@pytest.mark.parametrize("credit", ["group", "min"])
def test_a_run_with_a_process_reward_trains(tiny_dir: Path, tmp_path: Path, credit: str) -> None:
    """rlvr train with the rule-based PRM: two steps run, the PRM's metrics are logged, every
    sample with a differing step score is trained (even in a group of equal outcome rewards)."""
    from rlvr.train.loop import train

    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "prm"), 'algo.advantage="process"',
                             'algo.advantage_kwargs={prm = "tests.test_process_rewards:digits_are_right", '
                             f'delimiter = " ", credit = "{credit}"}}'])
    train(cfg, quiet=True)
    rows = read_metrics(tmp_path / "prm")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 <= r["process/step_score"] <= 1 and r["process/steps"] >= 1 for r in rows)
    samples = [json.loads(line) for line in (tmp_path / "prm" / "samples.jsonl").read_text().splitlines()]
    assert any(s["advantage"] != 0 for s in samples)


def test_a_classifier_prm_loads_from_a_folder(tmp_path: Path) -> None:
    model, tok = tiny_classifier(), make_tiny_tokenizer()
    model.save_pretrained(tmp_path / "prm")
    tok.save_pretrained(tmp_path / "prm")
    prm = load_prm(str(tmp_path / "prm"), separator="\n")
    assert isinstance(prm, ClassifierPRM)
    assert prm.score(["Q?"], [["s1"]], [{}]) == ClassifierPRM(model, tok).score(["Q?"], [["s1"]], [{}])


def test_the_arithmetic_prm_checks_equations_and_the_final_answer() -> None:
    prm = load_prm("arithmetic_steps")
    steps = ["3 + 4 = 7\n\n", "7 * 2 = 15\n\n", "so we double it\n\n", "the answer is 14"]
    assert prm.score(["p"], [steps], [{"answer": "14"}]) == [[1.0, 0.0, 0.5, 1.0]]
    assert prm.score(["p"], [["12 - 5 = 7", "7"]], [{"answer": 8}]) == [[1.0, 0.0]]
    assert prm.score(["p"], [["no number"]], [{"answer": "3"}]) == [[0.0]]


def test_gae_credit_puts_each_step_score_on_its_last_token() -> None:
    """credit = "gae": the rewards GAE sees are the raw step scores at the steps' last tokens,
    plus outcome_weight × the outcome reward on the last token."""
    from rlvr.train.methods.process import StepRewardCritic, StepScorer
    from rlvr.train.methods.ppo import CriticCredit

    tok = make_tiny_tokenizer()
    group = Group("p", tuple(Sample((1,), completion(tok, t), r, {"r": r}, 0)
                             for t, r in zip(["1\n\nx", "y\n\n2\n\n3"], (1.0, 0.0))))
    options = ProcessOptions(prm="arithmetic_steps", credit="gae", outcome_weight=0.5)
    scorer = StepScorer(load_prm("tests.test_process_rewards:digits_are_right"), options, tok)
    critic = StepRewardCritic(CriticCredit(None, None), scorer)  # type: ignore[arg-type]  # placement only
    placed = critic._placed([group], list(group.samples), {0, 1}, torch.tensor([[1.0, 0.0]]))
    assert placed == [[(2, 1.0), (4, 0.0), (4, 0.5)], [(2, 0.0), (5, 1.0), (7, 1.0), (7, 0.0)]]
    with pytest.raises(ValueError, match="credit must be"):
        ProcessOptions(prm="x", credit="turn")


def test_a_run_with_process_rewards_and_gae_trains_a_critic_and_resumes(tiny_dir: Path, tmp_path: Path) -> None:
    from rlvr.train.loop import train
    from tests.test_train import FP32, TIMING

    extra = ['algo.advantage="process"', "train.micro_batch_size=4", *FP32,
             'algo.advantage_kwargs={prm = "tests.test_process_rewards:digits_are_right", delimiter = " ", '
             'credit = "gae", gae = {lam = 0.9}}']
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "straight", train__steps=3), *extra]), quiet=True)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "resumed", train__steps=2), *extra]), quiet=True)
    train(resume=tmp_path / "resumed", overrides=("train.steps=3",), quiet=True)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert all("value_loss" in r and "process/step_score" in r for r in a)
    for ra, rb in zip(a, b, strict=True):
        assert {k: v for k, v in ra.items() if k not in TIMING} == {k: v for k, v in rb.items() if k not in TIMING}
    with pytest.raises(ValueError, match="gae: unknown keyword 'lamda'"):
        train(load_config(None, [*overrides(tiny_dir, tmp_path, "bad"), 'algo.advantage="process"',
                                 'algo.advantage_kwargs={prm = "arithmetic_steps", credit = "gae", gae = {lamda = 0.9}}']),
              quiet=True)


def test_the_arithmetic_prm_checks_every_side_by_precedence() -> None:
    """Found by a red-team review (session 19): only the first "a op b = c" of a chain was checked,
    left to right, so "2 + 2 = 4 * 10 = 7" and "2 + 3 * 4 = 12" scored 1 and "2 + 3 * 4 = 14" 0."""
    prm = load_prm("arithmetic_steps")
    steps = ["2 + 2 = 4 * 10 = 7", "2 + 3 * 4 = 12", "2 + 3 * 4 = 14", "(1 + 2) x 3 = 9", "1,000 + 2 = 1,002",
             "10 / 0 = 5", "Step 1: 5 + 5 = 10, then 10 - 3 = 7", "the answer is 1,234"]
    assert prm.score(["p"], [steps], [{"answer": "1234"}]) == [[0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]]


def test_min_form_credit_by_hand() -> None:
    """m = the lowest score from each step on; advantages normalised over the group's m."""
    out = process_advantages([[1.0, 0.0], [0.5, 1.0]], [[1, 3], [0, 2]], [4, 3], form="min")
    # m: [0, 0] and [0.5, 1]; mean 0.375, unbiased std sqrt(((.375² · 2) + .125² + .625²) / 3)
    mean, std = 0.375, math.sqrt((2 * 0.375**2 + 0.125**2 + 0.625**2) / 3)
    z = [(m - mean) / (std + 1e-6) for m in (0.0, 0.0, 0.5, 1.0)]
    assert torch.allclose(out[0], torch.tensor([z[0]] * 2 + [z[1]] * 2), atol=1e-6)
    assert torch.allclose(out[1], torch.tensor([z[2], z[3], z[3]]), atol=1e-6)
    assert [a.tolist() for a in process_advantages([[1.0], [1.0]], [[0], [1]], [1, 2], form="min")] == [[0.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="form"):
        process_advantages([[1.0]], [[0]], [1], form="max")


def test_padding_true_steps_pays_under_summed_credit_and_not_under_the_min() -> None:
    """The red-team's group: a wrong answer after 20 "1 + 1 = 2" steps, and right ones."""
    prm = load_prm("arithmetic_steps")
    texts = ["1 + 1 = 2\n\n" * 20 + "The answer is 8", "Adding them gives seven.\n\nThe answer is 7",
             "Adding them gives seven.\n\nThe answer is 7", "3 + 4 = 8\n\nThe answer is 8"]
    steps = [[step_text(t, span) for span in split_steps(t)] for t in texts]
    scores = prm.score(["3 + 4?"] * 4, steps, [{"answer": "7"}] * 4)
    ends = [list(range(len(s))) for s in steps]  # one token a step is enough to compare first tokens
    summed = process_advantages(scores, ends, [len(s) for s in steps])
    assert summed[0][0] > 5 > 0 > summed[1][0]  # the padded wrong answer leads by far
    least = process_advantages(scores, ends, [len(s) for s in steps], form="min")
    assert least[0][0] < 0 < least[1][0] and least[1][0] == least[2][0]
    assert ProcessOptions(prm="arithmetic_steps", credit="min").credit == "min"
    with pytest.raises(ValueError, match="credit"):
        ProcessOptions(prm="arithmetic_steps", credit="max")


def test_the_arithmetic_prm_reads_one_line_at_a_time_in_linear_time() -> None:
    """A second review (session 19): two equations on two lines were read as one chain (wrong),
    prose before an operator made a false equation, and a long step without "=" took seconds to
    scan (a regular expression that backtracked; a repetition loop of a few thousand tokens took
    hours). The bound is 100x what it takes now."""
    import time

    from rlvr.rewards.process import _equations_right

    assert _equations_right("2 + 2 = 4\n3 * 3 = 9") == [True, True]
    assert _equations_right("3 apples + 4 = 7") == [] and _equations_right("we get 10 - 3 = 7 so") == [True]
    start = time.perf_counter()
    _equations_right("1 " * 20000)
    _equations_right("1 + " * 5000 + "= 3")
    assert time.perf_counter() - start < 2.0
