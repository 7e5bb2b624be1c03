"""One way to build the parts: a data-parallel learner rank (rlvr.train.parts.learner_rank) is
built as the local run builds its learner, with whatever the config's methods need on every
rank (rlvr.train.methods.registry.ON_RANKS), and scale-out code names no method."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rlvr.config import load_config
from rlvr.train.methods import registry as methods
from rlvr.train.methods import Extras, RankInfo
from rlvr.train.methods.registry import rank_extras
from rlvr.train.methods.kl import Reference
from rlvr.train.methods.ppo import CriticMethod
from rlvr.train.parts import learner_rank
from rlvr.train.setup import setup
from tests.test_train import overrides

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("extra", [["algo.kl_coef=0.1", "lora.rank=2", "train.activation_checkpointing=true"],
                                   ['algo.advantage="gae"', "algo.kl_coef=0.1"]], ids=["kl-lora-checkpointing", "ppo"])
def test_a_learner_rank_holds_what_the_local_run_holds(tiny_dir: Path, tmp_path: Path, extra: list[str]) -> None:
    """KL's reference model, PPO's critic, LoRA and activation checkpointing: the rank's policy
    has the local policy's trainable parameters, and its parts are the ones the local methods use."""
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "parts"), *extra, 'train.precision="fp32"'])
    run = setup(cfg, tmp_path / "run")
    info = RankInfo(cfg.train.steps, run.tokenizer)
    learner, extras = learner_rank(cfg, info, torch.device("cpu"), torch.float32)
    local = {n: p.shape for n, p in run.learner.model.named_parameters() if p.requires_grad}
    rank = {n: p.shape for n, p in learner.model.named_parameters() if p.requires_grad}
    assert rank == local
    assert learner.model.is_gradient_checkpointing == run.learner.model.is_gradient_checkpointing
    assert any("lora" in n for n in rank) == (cfg.lora.rank > 0)
    assert isinstance(run.methods["kl"], Reference)
    assert extras.ref_model is not None and not any(p.requires_grad for p in extras.ref_model.parameters())
    for (n, a), (m, b) in zip(run.methods["kl"].ref_model.state_dict().items(), extras.ref_model.state_dict().items()):
        assert n == m and torch.equal(a, b)
    if "ppo" in run.methods:
        assert isinstance(run.methods["ppo"], CriticMethod) and type(extras.credit) is type(run.methods["ppo"].credit)
    else:
        assert extras.credit is None


def test_a_new_method_reaches_every_rank_through_its_own_entry(monkeypatch: pytest.MonkeyPatch,
                                                               tiny_model: torch.nn.Module) -> None:
    """A method's part for the ranks is one entry in ON_RANKS; two that set the same part are refused."""
    marker = torch.nn.Linear(1, 1)
    monkeypatch.setitem(methods.ON_RANKS, "mine", lambda cfg, policy, info: Extras(ref_model=marker))  # type: ignore[arg-type]
    cfg = load_config(None, ["model=x"])
    assert rank_extras(cfg, tiny_model, RankInfo(1, None)).ref_model is marker  # type: ignore[arg-type]
    monkeypatch.setitem(methods.ON_RANKS, "theirs", lambda cfg, policy, info: Extras(ref_model=marker))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ref_model.*theirs"):
        rank_extras(cfg, tiny_model, RankInfo(1, None))  # type: ignore[arg-type]


def test_scale_out_code_names_no_method() -> None:
    """The issue's check: ``grep -rn 'kl_coef\\|per_token_credit' rlvr/scaleout`` finds nothing, nor
    does any other `algo.` setting (a method's config read by scale-out code)."""
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "rlvr" / "scaleout").glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"kl_coef|per_token_credit|cfg\.algo\b", line)]
    assert not found
