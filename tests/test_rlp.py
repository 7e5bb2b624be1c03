"""RL on pre-training data (RLP): cuts through a corpus, the information-gain reward against a
full-sequence recompute, the EMA baseline's update, and a run on the tiny model that resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlvr.config import load_config
from rlvr.data.pretraining import text_examples
from rlvr.options import rlp_options
from rlvr.train.methods import rlp
from rlvr.train.loop import setup, train
from rlvr.train.methods.registry import check
from tests.test_train import FP32, overrides, read_metrics
from tests.tiny import make_tiny_model

CORPUS = ("The river runs past the old mill and under the stone bridge before it reaches the sea.\n\n"
          "Every morning the baker opens the shop at six and sells warm bread to the first customers.\n\n"
          "Short one.\n")


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(CORPUS)
    return path


def test_cuts_end_at_a_word_and_the_target_is_the_next_words(tmp_path: Path) -> None:
    examples = text_examples(_corpus(tmp_path), size=20, seed=1, context_chars=40, target_words=2)
    docs = CORPUS.split("\n\n")
    for ex in examples:
        context, target = ex.fields["context"], ex.fields["target"]
        whole = context + target
        assert any(whole in d for d in docs) and "Short one" not in whole  # a 2-word document has no cut
        assert len(context) <= 40 and not context[0].isspace() and not context[-1].isspace()
        assert target[0] == " " and len(target.split()) == 2
        assert len(context.split()) >= 1
    again = text_examples(_corpus(tmp_path), size=20, seed=1, context_chars=40, target_words=2)
    assert [e.id for e in again] == [e.id for e in examples]  # the same cuts every run
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"text": docs[0]}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="c.jsonl:2: needs a string column 'text'"):
        text_examples(jsonl, size=1, seed=0, context_chars=40, target_words=1)


def _rlp_config(tiny_dir: Path, tmp_path: Path, name: str, **extra: object) -> list[str]:
    return [*overrides(tiny_dir, tmp_path, name, **extra), 'task.source="text"', f'task.path="{_corpus(tmp_path)}"',
            'rewards=[{fn = "information_gain"}]', "task.params={context_chars = 60, target_words = 2}",
            'sampling.stop=["</think>"]']


@torch.no_grad()
def _summed(model: torch.nn.Module, ids: list[int], k: int) -> float:
    logp = model(input_ids=torch.tensor([ids])).logits[0, :-1].double().log_softmax(-1)
    return float(sum(logp[i - 1, ids[i]] for i in range(len(ids) - k, len(ids))))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_reward_is_the_thoughts_information_gain_over_the_ema(precision: str, tiny_dir: Path,
                                                                  tmp_path: Path) -> None:
    """Against a recompute by full forward passes of the policy and of the EMA (the initial
    model). fp32: to fp32 rounding of a sum of ~k log-probs of magnitude ~30. bf16: the run scores
    a packed batch, the recompute single rows; each of the k target tokens' log-probs may then
    differ by 3 × the network's bf16 noise (tests/precision.py), on each of the two terms."""
    from tests.precision import logprob_noise

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    cfg = load_config(None, [*_rlp_config(tiny_dir, tmp_path, "gain"), f'train.precision="{precision}"',
                             f'engine.dtype="{ {"fp32": "float32", "bf16": "bfloat16"}[precision] }"'])
    (tmp_path / "gain").mkdir()
    run = setup(cfg, tmp_path / "gain")
    with torch.no_grad():  # make the policy differ from its EMA, as it will after updates
        for p in run.learner.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    from rlvr.train.rollouts import generate_groups
    from rlvr.types import SamplingParams

    groups = generate_groups(run.engine, run.task.examples, run.task.prompt_ids, [0, 1], run.task.rewards,
                             SamplingParams(temperature=1.0, max_new_tokens=6, n=3))
    scored = rlp.score_groups(run, run.methods["rlp"].ema, groups, run.task.examples)  # type: ignore[attr-defined]
    tok = run.tokenizer
    for g in scored:
        ex = run.task.examples[g.samples[0].prompt_index]
        context = tok(ex.fields["context"])["input_ids"]
        target = tok(ex.fields["target"], add_special_tokens=False)["input_ids"]
        close = tok("</think>", add_special_tokens=False)["input_ids"]
        initial = make_tiny_model(dtype=dtype)  # the EMA is still the initial model
        baseline = _summed(initial, context + target, len(target))
        for x in g.samples:
            closed = "</think>" in x.completion.text
            ids = list(x.prompt_ids) + list(x.completion.token_ids) + ([] if closed else close) + target
            with_thought = _summed(run.learner.model, ids, len(target))
            tol = 1e-4
            if precision == "bf16":
                noise = max(logprob_noise(run.learner.model, ids), logprob_noise(initial, context + target))
                tol = 3 * len(target) * noise
            assert x.reward_parts["information_gain/no_thought"] == pytest.approx(baseline, abs=tol)
            assert x.reward_parts["information_gain/with_thought"] == pytest.approx(with_thought, abs=tol)
            assert x.reward == pytest.approx(with_thought - baseline, abs=2 * tol)
        assert list(g.samples[0].prompt_ids) == context + tok("\n<think>", add_special_tokens=False)["input_ids"]


def test_the_ema_moves_a_share_of_the_way_to_the_policy() -> None:
    ema, policy = make_tiny_model(seed=0), make_tiny_model(seed=1)
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    rlp.ema_update(ema, policy, decay=0.75)
    for name, value in ema.state_dict().items():
        torch.testing.assert_close(value, 0.75 * before[name] + 0.25 * policy.state_dict()[name])


def test_an_rlp_run_trains_thoughts_and_resumes_exactly(tiny_dir: Path, tmp_path: Path) -> None:
    train(load_config(None, _rlp_config(tiny_dir, tmp_path, "rlp", train__steps=3)), quiet=True)
    rows = read_metrics(tmp_path / "rlp")
    assert all("rewards/information_gain" in r and r["grad_norm"] > 0 for r in rows)
    train(load_config(None, _rlp_config(tiny_dir, tmp_path, "rlp-a", train__steps=1)), quiet=True)
    train(resume=tmp_path / "rlp-a", overrides=("train.steps=3",), quiet=True)
    resumed = read_metrics(tmp_path / "rlp-a")
    for a, b in zip(rows, resumed, strict=True):  # the EMA baseline was restored, so the rewards repeat
        assert b["reward"] == pytest.approx(a["reward"], abs=1e-5) and b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    with pytest.raises(ValueError, match="pairs task.source"):  # RLP's own check, when the run opens
        check(load_config(None, [*overrides(tiny_dir, tmp_path, "x"), 'rewards=[{fn = "information_gain"}]']))


def test_the_summary_line_shows_the_held_out_reward_when_accuracy_says_nothing() -> None:
    from rlvr.train.records import summary_line

    zero = {"eval_before": {"eval/accuracy": 0.0, "eval/reward": -13.4}, "eval_after": {"eval/accuracy": 0.0,
                                                                                    "eval/reward": -12.1}}
    assert "held-out reward -13.400 → -12.100" in summary_line(zero)
    some = {"eval_before": {"eval/accuracy": 0.25, "eval/reward": 0.3}, "eval_after": {"eval/accuracy": 0.5,
                                                                                   "eval/reward": 0.6}}
    assert "held-out accuracy 25.0% → 50.0%" in summary_line(some)
    # with the paired gain (rlvr.train.records.held_out_gain): its interval in points, and how many prompts
    gain = {"difference": 0.25, "se": 0.125, "ci95_low": 0.005, "ci95_high": 0.495, "prompts": 8.0}
    assert "held-out accuracy 25.0% → 50.0% (+25.0 points, 95% CI +0.5 to +49.5 over 8 prompts)" in \
        summary_line(some | {"held_out_gain": gain})


def test_rlps_knobs_are_the_text_tasks_params_and_the_rewards_kwargs() -> None:
    from rlvr.config import ConfigError, load_config

    base = ['task.source="text"', 'task.path="corpus.txt"']
    cfg = load_config(None, [*base, 'rewards=[{fn = "information_gain", kwargs = {ema_decay = 0.5}}]'])
    assert rlp_options(cfg.rewards).ema_decay == 0.5 and rlp_options(cfg.rewards).think_close == "</think>"
    with pytest.raises(ValueError, match="unknown keyword 'ema_decy'; did you mean 'ema_decay'"):  # RLP's check
        check(load_config(None, [*base, 'rewards=[{fn = "information_gain", kwargs = {ema_decy = 0.5}}]']))
    with pytest.raises(ConfigError, match=r"'rlp.context_chars' is now task.params.context_chars"):
        load_config(None, [*base, "rlp.context_chars=100"])
