"""Methods declare themselves: each checks a config for what it cannot run beside, when a run
opens (rlvr.train.methods.registry.CHECKS), and rlvr.config compares no method's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rlvr.algos import CORRECTIONS, ESTIMATORS, LOSSES, PER_TOKEN
from rlvr.config import load_config
from rlvr.rewards.intrinsic import INTRINSIC
from rlvr.train.loop import train
from rlvr.train.methods.registry import CHECKS, check
from tests.test_train import overrides

ROOT = Path(__file__).resolve().parents[1]

REFUSED = {
    "kl": (['env.name="guess_number"', "env.summarize.at=100", "algo.kl_coef=0.1", 'algo.kl_placement="reward"'],
           "does not combine with a KL in the reward"),
    "ppo": (["lora.rank=4", 'algo.advantage="gae"'], "the critic copies the policy's trunk"),
    "remax": (['algo.advantage="remax"', "dist.rollout_workers=1", "dist.async_rollouts.steps=1"],
              "greedy baseline"),
    "expert": (['expert.mode="luffy"'], "go together"),
    "intrinsic": (['rewards=[{fn = "reasoning_gym"}, {fn = "self_certainty", weight = 0.1}]',
                   "dist.rollout_workers=1", "dist.async_rollouts.steps=1"], "computed from the policy"),
    "rlp": (['rewards=[{fn = "information_gain"}]'], "pairs task.source"),
    "turn_credit": (['env.name="guess_number"', 'algo.credit="turn"', 'algo.advantage="rloo"'],
                    "computes its own group-relative advantages"),
    "schedules": (['env.name="guess_number"', "sampling.length_schedule=[[1, 8], [2, 16]]",
                   "sampling.max_new_tokens=16"], "single completion's budget"),
    "opponents": (['env.name="game"', 'task.source="env"', 'env.kwargs={game = "nim", opponent = "self"}',
                   'sampler.rollouts="dynamic"'], "trains every role"),
}


def test_every_methods_check_is_tried() -> None:
    assert set(REFUSED) == set(CHECKS)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_method_refuses_what_it_cannot_run_beside(name: str) -> None:
    """The config loads (it compares no method's name); the method's own check refuses it, and
    is the one that does: every other check passes the same config."""
    settings, message = REFUSED[name]
    cfg = load_config(None, settings)
    with pytest.raises(ValueError, match=message):
        CHECKS[name](cfg)
    for other, other_check in CHECKS.items():
        if other != name:
            other_check(cfg)


def test_a_refused_run_stops_before_its_directory_or_model(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "refused"), 'expert.mode="luffy"'])
    with pytest.raises(ValueError, match="go together"):
        train(cfg, quiet=True)
    assert not (tmp_path / "refused").exists()
    check(load_config(None, overrides(tiny_dir, tmp_path, "fine")))  # the defaults pass every check


def _method_names() -> set[str]:
    """Names that choose a method: estimators, losses, corrections, expert modes, intrinsic and
    RLP's rewards ("none", the absence of one, aside)."""
    return ({*ESTIMATORS, *PER_TOKEN, *LOSSES, *CORRECTIONS, *INTRINSIC, "information_gain", "chord", "luffy",
             "relift"} - {"none"})


def test_config_compares_no_method_name() -> None:
    """No comparison in rlvr/config has a method's name as an operand (``==``, ``!=``, ``in``
    against a literal, or a literal set of names): methods check their own combinations."""
    names, found = _method_names(), []
    for path in sorted((ROOT / "rlvr" / "config").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            for operand in [node.left, *node.comparators]:
                literals = operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) else [operand]
                found += [f"{path.name}:{node.lineno}: {lit.value!r}" for lit in literals
                          if isinstance(lit, ast.Constant) and lit.value in names]
    assert not found, found


def test_a_choice_and_its_knobs_are_one_table() -> None:
    """algo.advantage (loss, offpolicy) takes a name or a table tagged by its type; the table is
    kept as the name and its kwargs, so a run's config.toml reads back the same."""
    import tomllib

    from rlvr.config import ConfigError, to_toml

    table = load_config(None, ['algo.advantage={type = "gae", lam = 0.9}',
                               'algo.loss={type = "cispo", max_weight = 3.0}'])
    flat = load_config(None, ['algo.advantage="gae"', "algo.advantage_kwargs={lam = 0.9}", 'algo.loss="cispo"',
                              "algo.loss_kwargs={max_weight = 3.0}"])
    assert table.algo == flat.algo and table.algo.advantage_kwargs == {"lam": 0.9}
    assert tomllib.loads(to_toml(table))["algo"]["advantage"] == "gae"
    with pytest.raises(ConfigError, match="names its choice with type"):
        load_config(None, ["algo.advantage={lam = 0.9}"])
    with pytest.raises(ConfigError, match="give them there, not in algo.advantage_kwargs too"):
        load_config(None, ['algo.advantage={type = "gae"}', "algo.advantage_kwargs={lam = 0.9}"])
    with pytest.raises(ConfigError, match="unknown keyword 'lamb'; did you mean 'lam'"):
        load_config(None, ['algo.advantage={type = "gae", lamb = 0.9}'])
