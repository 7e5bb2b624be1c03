"""DPH-RL: forward KL and Jensen-Shannon to the initial policy on its stored samples."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from rlvr.algos import DIVERGENCES
from rlvr.config import load_config
from rlvr.train.loop import train
from rlvr.train.methods.rehearsal import FILE
from rlvr.train.settings import Passes, UpdateSettings
from rlvr.train.update import update_policy
from tests.test_train import TIMING, read_metrics

F64 = torch.float64


def run(name: str, log_u: list[float], mask: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_BT, d(sum of loss)/d log π_θ) for tokens with log π_0 = -1 and log π_θ = -1 + log u."""
    lp = torch.tensor([[-1.0 + x for x in log_u]], dtype=F64, requires_grad=True)
    m = torch.tensor([mask or [1] * len(log_u)], dtype=torch.bool)
    loss, _ = DIVERGENCES[name](lp, torch.full_like(lp, -1.0), m)
    loss.sum().backward()
    assert lp.grad is not None
    return loss.detach(), lp.grad


def test_forward_kl_by_hand() -> None:
    # u = 2: 2 - log 2 - 1; gradient u - 1 = 1.  u = 1/2: 1/2 + log 2 - 1; gradient -1/2
    loss, grad = run("forward_kl", [math.log(2.0), math.log(0.5), 0.0])
    torch.testing.assert_close(loss, torch.tensor([[1 - math.log(2), math.log(2) - 0.5, 0.0]], dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([[1.0, -0.5, 0.0]], dtype=F64))


def test_jensen_shannon_by_hand() -> None:
    # f(u) = u log u - (u+1) log((u+1)/2); u = 2: 2 log 2 - 3 log 1.5; f'(u)·u = u log(2u/(u+1)) = 2 log(4/3)
    loss, grad = run("js", [math.log(2.0), 0.0])
    torch.testing.assert_close(loss, torch.tensor([[2 * math.log(2) - 3 * math.log(1.5), 0.0]], dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([[2 * math.log(4 / 3), 0.0]], dtype=F64))
    # a stored token π_θ now finds a million times less likely costs at most log 2 (forward KL: ~12.8)
    far, _ = run("js", [math.log(1e-6)])
    assert math.log(2) - 1e-4 < float(far) < math.log(2)
    assert float(run("forward_kl", [math.log(1e-6)])[0]) > 12


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_masked_positions_do_not_matter(name: str) -> None:
    lp = torch.tensor([[-1.0, float("nan")]], dtype=F64, requires_grad=True)
    loss, _ = DIVERGENCES[name](lp, torch.tensor([[-2.0, float("inf")]], dtype=F64), torch.tensor([[True, False]]))
    loss.sum().backward()
    assert lp.grad is not None
    assert loss[0, 1] == 0 and lp.grad[0, 1] == 0 and torch.isfinite(loss).all()


def even(prompt: str) -> bool:
    return sum(map(ord, prompt)) % 2 == 0


def solved_when_even(prompt: str, completion: str, **_: object) -> float:
    """"Even" prompts are always right (the rehearsal set); the others get a varying partial score."""
    return 1.0 if even(prompt) else len(set(completion)) / 16.0


def config(tiny_dir: Path, out: Path, name: str, steps: int, divergence: str = "forward_kl") -> list[str]:
    return [f'model="{tiny_dir}"', f'output_dir="{out}"', f"name={name}", "seed=3", "task.size=24",
            "task.eval_size=2", "task.params={min_terms = 2, max_terms = 2, max_digits = 1}",
            'rewards=[{fn = "tests.test_divergence:solved_when_even"}]', f"train.steps={steps}",
            "train.prompts_per_step=4", "train.micro_batch_size=8", "train.lr=1e-3", "algo.group_size=4",
            "sampling.max_new_tokens=8", f'algo.divergence="{divergence}"', "algo.divergence_kwargs.coef=1.0",
            "algo.divergence_kwargs.k=2", "algo.divergence_kwargs.batch=4"]


@pytest.mark.parametrize("divergence", sorted(DIVERGENCES))
def test_rehearsal_set_is_screened_stored_and_rehearsed(divergence: str, tiny_dir: Path, tmp_path: Path) -> None:
    train(load_config(None, config(tiny_dir, tmp_path, "dph", 2, divergence)), quiet=True)
    run_dir = tmp_path / "dph"
    lines = (run_dir / FILE).read_text().splitlines()
    assert json.loads(lines[0]) == {"screened": 24}  # every training prompt
    stored = [json.loads(line) for line in lines[1:]]
    assert stored and all(r["reward"] == 1.0 and len(r["init_logprobs"]) == len(r["token_ids"]) for r in stored)
    rows = read_metrics(run_dir)
    assert all(r["rehearsal_size"] == len(stored) for r in rows)
    assert rows[0]["divergence"] == pytest.approx(0.0, abs=1e-5)  # π_θ is still π_0
    assert rows[1]["divergence"] > 1e-4  # the first update moved it away
    # RL only sees the prompts the initial policy did not always solve
    seen = {json.loads(line)["prompt"] for line in (run_dir / "samples.jsonl").read_text().splitlines()}
    assert seen and not any(even(p) for p in seen)


def test_rehearsal_resumes_exactly(tiny_dir: Path, tmp_path: Path) -> None:
    train(load_config(None, config(tiny_dir, tmp_path, "straight", 3)), quiet=True)
    train(load_config(None, config(tiny_dir, tmp_path, "split", 2)), quiet=True)
    train(resume=tmp_path / "split", overrides=("train.steps=3",), quiet=True)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert {k: v for k, v in a[2].items() if k not in TIMING} == {k: v for k, v in b[2].items() if k not in TIMING}


@pytest.mark.parametrize("divergence", sorted(DIVERGENCES))
def test_micro_batching_does_not_change_the_divergence_gradient(divergence: str) -> None:
    """The rehearsal term is a token mean over the whole rehearsal batch, whatever the micro-batch."""
    from rlvr.train.methods.rehearsal import Divergence
    from tests.test_learner import GROUPS, SGDRecorder, assert_grads_close, exact_model, make_groups

    stored = [x for g in make_groups([[1.0, 1.0, 1.0], [1.0, 1.0]], seed=5) for x in g.samples]
    stored = [dataclasses.replace(x, completion=dataclasses.replace(x.completion,
                                                                    logprobs=(-3.0,) * len(x.completion.token_ids)))
              for x in stored]

    def grads(micro: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        recorder = SGDRecorder(exact_model(), lr=0.1)  # float64: see test_learner.EXACT
        settings = UpdateSettings(passes=Passes(micro_batch_size=micro), mini_batches=2)
        metrics = update_policy(recorder, make_groups(GROUPS), settings, pad_token_id=0,  # type: ignore[arg-type]
                                generator=torch.Generator().manual_seed(0), terms=[Divergence(stored, divergence, 1.0)]).metrics
        return recorder.grads, metrics

    whole, metrics = grads(6)
    assert metrics["divergence"] > 0 and metrics["divergence_ratio_mean"] != 1.0
    assert_grads_close(grads(1)[0], whole)
    assert_grads_close(grads(4)[0], whole)


def test_rehearsal_batches_cycle_without_repeating_a_sample() -> None:
    from rlvr.train.methods.rehearsal import Rehearsal
    from tests.test_learner import make_groups

    stored = [x for g in make_groups([[1.0, 1.0, 1.0]]) for x in g.samples]
    r = Rehearsal(stored, screened=5)
    assert r.next_batch(2) == stored[:2] and r.next_batch(2) == [stored[2], stored[0]]
    assert r.next_batch(16) == [stored[1], stored[2], stored[0]]  # the whole set, once
    assert Rehearsal([], screened=5).next_batch(4) == []


def sometimes_right(prompt: str, completion: str, **_: object) -> float:
    """Right on "even" prompts, and on the others when the completion happens to be varied."""
    return 1.0 if even(prompt) or len(set(completion)) >= 6 else 0.0


def test_rehearsal_min_correct_admits_prompts_a_weak_model_sometimes_solves(tiny_dir: Path, tmp_path: Path) -> None:
    reward = 'rewards=[{fn = "tests.test_divergence:sometimes_right"}]'
    base = [*config(tiny_dir, tmp_path, "all", 1), reward, "algo.divergence_kwargs.exclude=false"]
    train(load_config(None, base), quiet=True)
    train(load_config(None, [*config(tiny_dir, tmp_path, "one", 1), reward, "algo.divergence_kwargs.exclude=false",
                             "algo.divergence_kwargs.min_correct=1"]), quiet=True)
    strict = [json.loads(line) for line in (tmp_path / "all" / FILE).read_text().splitlines()[1:]]
    loose = [json.loads(line) for line in (tmp_path / "one" / FILE).read_text().splitlines()[1:]]
    assert len(loose) > len(strict) > 0 and all(r["reward"] == 1.0 for r in loose)
    with pytest.raises(Exception, match=r"min_correct \(3\) must be between 1 and k \(2\)"):
        load_config(None, [*base, "algo.divergence_kwargs.min_correct=3"])
    with pytest.raises(Exception, match="set algo.divergence"):
        load_config(None, ["algo.divergence_kwargs.coef=0.1"])
