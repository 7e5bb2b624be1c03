"""Off-policy corrections against hand-computed weights, and the mismatch metric in a real run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlvr.algos import CORRECTIONS, mismatch_metrics
from rlvr.config import ConfigError, load_config
from rlvr.train.loop import train
from tests.test_train import overrides, read_metrics

# learner log-probs vs engine log-probs: token ratios 3, 1, 0.25 in row 0 (last one masked in
# the second row's layout below), and e^0.1, e^-0.1 in row 1
OLD = torch.tensor([[math.log(3.0), 0.0, math.log(0.25)], [0.1, -0.1, 7.0]])
SAMPLER = torch.zeros(2, 3)
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_truncated_is_by_hand() -> None:
    w, m = CORRECTIONS["tis"](OLD, SAMPLER, MASK, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.25], [math.exp(0.1), math.exp(-0.1), 0.0]]))
    torch.testing.assert_close(m["is_truncated_fraction"], torch.tensor(1 / 5))
    # sequence level: row 0's product of ratios is 3·1·0.25 = 0.75, row 1's is 1
    w, _ = CORRECTIONS["tis"](OLD, SAMPLER, MASK, cap=2.0, level="sequence")
    torch.testing.assert_close(w, torch.tensor([[0.75] * 3, [1.0, 1.0, 0.0]]))


def test_masked_is_by_hand() -> None:
    w, m = CORRECTIONS["mis"](OLD, SAMPLER, MASK, low=0.5, high=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0], [math.exp(0.1), math.exp(-0.1), 0.0]]))
    torch.testing.assert_close(m["is_masked_fraction"], torch.tensor(2 / 5))
    with pytest.raises(ValueError, match="low"):
        CORRECTIONS["mis"](OLD, SAMPLER, MASK, low=1.5)


def test_none_and_mismatch_metrics() -> None:
    w, m = CORRECTIONS["none"](OLD, SAMPLER, MASK)
    torch.testing.assert_close(w, MASK.float())
    assert m == {}
    mm = mismatch_metrics(OLD, SAMPLER, MASK)
    expected = (math.log(3.0) + 0 + math.log(4.0) + 0.1 + 0.1) / 5
    torch.testing.assert_close(mm["mismatch_logratio_abs"], torch.tensor(expected))
    torch.testing.assert_close(mm["mismatch_ratio_max"], torch.tensor(3.0))  # the masked e^7 is ignored


def test_correction_is_chosen_and_checked_in_the_config() -> None:
    with pytest.raises(ConfigError, match="did you mean 'tis'"):
        load_config(None, ['algo.offpolicy="tiss"'])
    with pytest.raises(ConfigError, match="did you mean 'cap'"):
        load_config(None, ['algo.offpolicy="tis"', "algo.offpolicy_kwargs={cpa = 3.0}"])


@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_runs_log_the_engine_learner_mismatch(correction: str, tiny_dir: Path, tmp_path: Path) -> None:
    train(load_config(None, overrides(tiny_dir, tmp_path, f"is-{correction}", algo__offpolicy=f'"{correction}"')),
          quiet=True)
    rows = read_metrics(tmp_path / f"is-{correction}")
    for r in rows:
        # the same fp32 weights sampled and scored: the two agree to float rounding
        assert 0 <= r["mismatch_logratio_abs"] < 1e-4 and r["mismatch_ratio_max"] == pytest.approx(1.0, abs=1e-3)
        if correction != "none":
            assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
