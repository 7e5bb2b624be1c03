"""Off-policy corrections against hand-computed weights, and the mismatch metric in a real run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlvr.algos import CORRECTIONS, mismatch_metrics
from rlvr.algos.inputs import LossInputs
from rlvr.config import ConfigError, load_config
from rlvr.train.loop import train
from tests.test_train import FP32, overrides, read_metrics

# learner log-probs vs engine log-probs: token ratios 3, 1, 0.25 in row 0 (last one masked in
# the second row's layout below), and e^0.1, e^-0.1 in row 1
OLD = torch.tensor([[math.log(3.0), 0.0, math.log(0.25)], [0.1, -0.1, 7.0]])
SAMPLER = torch.zeros(2, 3)
MASK = torch.tensor([[True, True, True], [True, True, False]])
# what a correction reads: π_old, μ and the mask (these corrections read no log-probs or advantages)
X = LossInputs(logprobs=OLD, old=OLD, advantages=torch.zeros_like(OLD), mask=MASK, sampler=SAMPLER)


def test_truncated_is_by_hand() -> None:
    w, m = CORRECTIONS["tis"](X, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.25], [math.exp(0.1), math.exp(-0.1), 0.0]]))
    torch.testing.assert_close(m["is_truncated_fraction"], torch.tensor(1 / 5))
    # sequence level: row 0's product of ratios is 3·1·0.25 = 0.75, row 1's is 1
    w, _ = CORRECTIONS["tis"](X, cap=2.0, level="sequence")
    torch.testing.assert_close(w, torch.tensor([[0.75] * 3, [1.0, 1.0, 0.0]]))


def test_masked_is_by_hand() -> None:
    w, m = CORRECTIONS["mis"](X, low=0.5, high=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0], [math.exp(0.1), math.exp(-0.1), 0.0]]))
    torch.testing.assert_close(m["is_masked_fraction"], torch.tensor(2 / 5))
    with pytest.raises(ValueError, match="low"):
        CORRECTIONS["mis"](X, low=1.5)


def test_none_and_mismatch_metrics() -> None:
    w, m = CORRECTIONS["none"](X)
    torch.testing.assert_close(w, MASK.float())
    assert m == {}
    mm = mismatch_metrics(OLD, SAMPLER, MASK)
    expected = (math.log(3.0) + 0 + math.log(4.0) + 0.1 + 0.1) / 5
    torch.testing.assert_close(mm["mismatch_logratio_abs"], torch.tensor(expected))
    torch.testing.assert_close(mm["mismatch_ratio_max"], torch.tensor(3.0))  # the masked e^7 is ignored
    # ratios 3, 1, 1/4, e^±0.1 (1.105, 0.905): outside [0.9, 1.1] are 3, 1/4 and e^0.1
    torch.testing.assert_close(mm["mismatch_outside_band"], torch.tensor(3 / 5))


def test_correction_is_chosen_and_checked_in_the_config() -> None:
    with pytest.raises(ConfigError, match="did you mean 'tis'"):
        load_config(None, ['algo.offpolicy="tiss"'])
    with pytest.raises(ConfigError, match="did you mean 'cap'"):
        load_config(None, ['algo.offpolicy="tis"', "algo.offpolicy_kwargs={cpa = 3.0}"])


@pytest.mark.dtype_independent  # pinned to fp32
@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_runs_log_the_engine_learner_mismatch(correction: str, tiny_dir: Path, tmp_path: Path) -> None:
    train(load_config(None, [*overrides(tiny_dir, tmp_path, f"is-{correction}", algo__offpolicy=f'"{correction}"'),
                             *FP32]), quiet=True)
    rows = read_metrics(tmp_path / f"is-{correction}")
    for r in rows:
        # the same fp32 weights (FP32) sampled and scored: the two agree to float rounding
        assert 0 <= r["mismatch_logratio_abs"] < 1e-4 and r["mismatch_ratio_max"] == pytest.approx(1.0, abs=1e-3)
        assert r["mismatch_outside_band"] == 0.0
        if correction != "none":
            assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("decoder", ["static", "hf"])
def test_in_bf16_the_engines_logprobs_are_as_exact_as_the_learners(decoder: str) -> None:
    """bf16 engine and learner disagree by rounding (the logged mismatch is then ~1e-2, not
    ~1e-7). Against the exact log-probs of the same weights (float64), the engine's sampled-token
    log-probs must be as close as the learner's own bf16 forward is, within the factor 3 of
    tests/precision.py: a cache or position error would be off by far more than rounding."""
    from rlvr.rollout.engine import EmbeddedEngine
    from rlvr.types import SamplingParams
    from tests.precision import exact_copy, token_logprobs
    from tests.tiny import EOS_ID, make_tiny_model, make_tiny_tokenizer

    model = make_tiny_model(dtype=torch.bfloat16)
    exact = exact_copy(model)
    engine = EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[EOS_ID], seed=0, decoder=decoder)
    prompts = [[5, 17, 99, 42], [7, 120, 33, 64, 8, 200, 11]]
    engine_err, learner_err = [], []
    for prompt, group in zip(prompts, engine.generate(prompts, SamplingParams(max_new_tokens=12, n=3))):
        for c in group:
            ids, n = prompt + list(c.token_ids), len(c.token_ids)
            truth = token_logprobs(exact, ids)[-n:]
            engine_err.append((torch.tensor(c.logprobs, dtype=torch.float64) - truth).abs())
            learner_err.append((token_logprobs(model, ids)[-n:] - truth).abs())
    engine_mean, learner_mean = float(torch.cat(engine_err).mean()), float(torch.cat(learner_err).mean())
    assert 0 < learner_mean and engine_mean <= 3 * learner_mean


def test_the_offpolicy_key_names_every_correction() -> None:
    """`rlvr config` is where a user finds the corrections: algo.offpolicy's text names each one
    the registry has (it had left out geo_mask and opsm)."""
    from rlvr.algos.offpolicy import CORRECTIONS
    from rlvr.config import AlgoConfig

    text = AlgoConfig.model_fields["offpolicy"].description or ""
    assert [name for name in CORRECTIONS if f'"{name}"' not in text] == []
