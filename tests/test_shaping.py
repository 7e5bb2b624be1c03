"""Length-based reward shaping against hand-computed values, and in a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlvr.algos import SHAPING
from rlvr.config import ConfigError, load_config
from rlvr.train.loop import train
from tests.test_train import overrides, read_metrics

REWARDS = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
CORRECT = REWARDS > 0.5


def test_overlong_by_hand() -> None:
    # budget 20, cache 8: no penalty up to 12 tokens, then (12 - len)/8, -1 at 20
    lengths = torch.tensor([[10, 12, 16, 20]])
    shaped, m = SHAPING["overlong"](REWARDS, lengths, CORRECT, 20, cache=8)
    torch.testing.assert_close(shaped, torch.tensor([[1.0, 0.0, 1.0 - 0.5, 0.0 - 1.0]]))
    assert m["shaping/overlong_fraction"] == 0.5
    with pytest.raises(ValueError, match="cache"):
        SHAPING["overlong"](REWARDS, lengths, CORRECT, 20, cache=30)


def test_kimi_length_penalty_by_hand() -> None:
    # lengths 10..40: λ = 0.5 - (len - 10)/30 = 0.5, 1/6, -1/6, -0.5; wrong answers keep min(0, λ)
    lengths = torch.tensor([[10, 20, 30, 40]])
    shaped, _ = SHAPING["kimi_length"](REWARDS, lengths, CORRECT, 64)
    torch.testing.assert_close(shaped, torch.tensor([[1.5, 0.0, 1.0 - 1 / 6, -0.5]]))
    same, _ = SHAPING["kimi_length"](REWARDS, torch.full((1, 4), 7), CORRECT, 64)
    torch.testing.assert_close(same, REWARDS)  # equal lengths: λ = 0


def test_shaping_specs_are_checked() -> None:
    with pytest.raises(ConfigError, match="did you mean 'overlong'"):
        load_config(None, ['algo.shaping=[{fn = "overlng"}]'])
    with pytest.raises(ConfigError, match="did you mean 'cache'"):
        load_config(None, ['algo.shaping=[{fn = "overlong", kwargs = {cahce = 4}}]'])


def test_a_run_with_shaping(tiny_dir: Path, tmp_path: Path) -> None:
    shaping = '[{fn = "overlong", kwargs = {cache = 8}}, {fn = "kimi_length"}]'
    train(load_config(None, overrides(tiny_dir, tmp_path, "shaped", algo__shaping=shaping)), quiet=True)
    rows = read_metrics(tmp_path / "shaped")
    # budget 8 and cache 8: the zone starts at 0, so a completion of L tokens loses L/8
    for r in rows:
        assert r["shaping/overlong_fraction"] == 1.0
        expected = r["reward"] - r["response_length"] / 8 + r["shaping/length_reward_mean"]
        assert r["shaping/reward_mean"] == pytest.approx(expected, abs=1e-5)
    assert 'fn = "overlong"' in (tmp_path / "shaped" / "config.toml").read_text()
