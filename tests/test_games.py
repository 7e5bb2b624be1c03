"""Games (rlvr.agents.games): Nim's rules against a brute-force solution, each seat's tokens exactly
its own, per-role groups and returns, turn rewards on the loser's last move, games that fail,
the opponent pool's snapshots, and self-play and pool training end to end on the tiny model."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rlvr.agents.game import GameStep
from rlvr.agents.games import GameEpisodes, Options, Pool, examples, play
from rlvr.agents.nim import Nim, taken
from rlvr.agents.runner import ChatDelta, Limits
from rlvr.data import render_prompt
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.train.rollouts import has_verdict, is_correct
from rlvr.types import Completion, SamplingParams
from tests.tiny import EOS_ID


@functools.cache
def wins(stones: int, take: int) -> bool:
    """Whether the player to move wins with perfect play: by search over every move, not Bouton's
    rule (an independent reference for the scripted `optimal` player)."""
    return any(t == stones or not wins(stones - t, take) for t in range(1, min(take, stones) + 1))


def test_nim_scripted_optimal_player_matches_a_brute_force_solution() -> None:
    """The optimal player wins every position that search says is won, against every opponent
    line (all of them, by search), and the positions it cannot win are exactly the multiples
    of take + 1."""
    for take in (2, 3, 4):
        for stones in range(take + 1, 21):
            assert wins(stones, take) == (stones % (take + 1) != 0)

            def optimal_wins(left: int, optimal_to_move: bool) -> bool:
                game = Nim({"stones": left}, low=take + 1, high=30, take=take)
                if optimal_to_move:
                    move = int(Nim.scripted["optimal"](game, random.Random(0)))
                    return move == left or optimal_wins(left - move, False)
                return all(t != left and optimal_wins(left - t, True) for t in range(1, min(take, left) + 1))

            if wins(stones, take):
                assert optimal_wins(stones, True), (stones, take)


def test_nim_rules_returns_messages_and_forfeits_by_hand() -> None:
    game = Nim({"stones": 6})
    assert game.to_move() == "first" and "There are 6 stones" in game.opening("second")
    step = game.step("I take 2")
    assert step.messages == {"second": "Your opponent took 2. 4 stones are left. How many stones do you take (1 to 3)?"}
    assert not step.done and step.rewards == {} and game.to_move() == "second"
    assert not game.step("three").done  # a word is a number: 1 left
    assert game.step("1").winner == "first"
    # a take that is not legal forfeits: too many, none, zero, more than is left (first to move each time)
    for reply, before in (("4", []), ("pass", []), ("0", []), ("2", ["3", "2"])):
        g = Nim({"stones": 6})
        for move in before:
            g.step(move)
        end = g.step(reply)
        assert end.done and end.winner == "second" and end.rewards == {"first": -1.0, "second": 1.0}
        assert end.metrics["invalid"] == 1.0
    assert [taken(t) for t in ("7 then 2", "Someone", "TWO", "-1", "1" * 5000)] == [2, None, 2, -1, None]
    with pytest.raises(ValueError, match="must be above take"):
        Nim({"stones": 6}, low=3, take=3)


class Scripted:
    """An engine that answers each call's prompts in order from a list of replies (each tokenized,
    ended with EOS), recording the contexts it was asked to continue."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, replies: list[str]) -> None:
        self.tokenizer, self.replies, self.calls = tokenizer, list(replies), []
        self.eos_token_ids = [EOS_ID]
        self.generator = torch.Generator().manual_seed(0)

    def generate(self, prompts: list[list[int]], params: SamplingParams, progress: Any = None) -> list[list[Completion]]:
        out = []
        for p in prompts:
            text = self.replies.pop(0)
            ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + (EOS_ID,)
            out.append([Completion(ids, (-0.5,) * len(ids), "stop", text)])
            self.calls.append((list(p), ids))
        return out


def game_env(**kwargs: Any) -> SimpleNamespace:
    return SimpleNamespace(kwargs=kwargs, max_turns=8, max_total_tokens=256, max_context=4096, max_void_turns=2,
                           observation_role="user", mask=[])


def test_each_seat_is_exactly_its_own_moves_and_what_it_was_told(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """Self-play from 7 stones: first takes 2, second 2, first 2, second 2 with 1 left (a
    forfeit). Each seat's trajectory is its opening, its own sampled ids (mask 1) and, between
    them, what the game told it (mask 0): nothing of the other seat's tokens."""
    engine = Scripted(tiny_tokenizer, ["2", "I take 2", "2", "2"])
    delta = ChatDelta(tiny_tokenizer)
    (result,) = play(engine, tiny_tokenizer, [Nim({"stones": 7})], [{"first": "policy", "second": "policy"}],  # type: ignore[arg-type]
                     SamplingParams(max_new_tokens=8), Limits(max_turns=8, max_turn_tokens=8), delta)
    first, second = result["first"], result["second"]
    assert first is not None and second is not None
    assert (first.reward, second.reward, first.ending, first.turns, second.turns) == (1.0, -1.0, "done", 2, 2)
    assert first.metrics["correct"] == 1.0 and second.metrics["lost"] == 1.0 and second.metrics["invalid"] == 1.0
    assert first.metrics["return/second"] == -1.0 and second.metrics["return/first"] == 1.0
    # the first seat: its opening, "2", told "Your opponent took 2. 3 stones are left...", "2"
    assert list(first.prompt_ids) == render_prompt(tiny_tokenizer, Nim({"stones": 7}).opening("first"))
    sampled = [ids for _, ids in engine.calls]
    told = delta.ids("Your opponent took 2. 3 stones are left. How many stones do you take (1 to 3)?", True)
    assert list(first.completion.token_ids) == [*sampled[0], *told, *sampled[2]]
    assert list(first.completion.loss_mask or ()) == [1] * len(sampled[0]) + [0] * len(told) + [1] * len(sampled[2])
    # the second seat opened on the rules and the first move, then was told the third
    opening = Nim({"stones": 7}).opening("second") + "\n\nYour opponent took 2. 5 stones are left. How many " \
        "stones do you take (1 to 3)?"
    assert list(second.prompt_ids) == render_prompt(tiny_tokenizer, opening)
    told = delta.ids("Your opponent took 2. 1 stone is left. How many stones do you take (1)?", True)
    assert list(second.completion.token_ids) == [*sampled[1], *told, *sampled[3]]
    # turn rewards: the second seat's loss on its own (forfeiting) move, the first's win on its last
    assert first.turn_rewards == [0.0, 1.0] and second.turn_rewards == [0.0, -1.0]
    # the engine was asked to continue exactly each seat's context so far
    assert engine.calls[2][0] == list(first.prompt_ids) + [*sampled[0], *delta.ids(
        "Your opponent took 2. 3 stones are left. How many stones do you take (1 to 3)?", True)]


def test_a_loss_on_the_opponents_move_is_paid_on_the_losers_last_move(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """From 6 against the scripted optimal player: the policy takes 1 (5 left), optimal 1 (4), the
    policy 3 (1), optimal the last: the policy's −1 lands on its last move, and the scripted
    seat has no episode."""
    engine = Scripted(tiny_tokenizer, ["1", "3"])
    (result,) = play(engine, tiny_tokenizer, [Nim({"stones": 6})], [{"first": "policy", "second": "scripted:optimal"}],  # type: ignore[arg-type]
                     SamplingParams(max_new_tokens=8), Limits(), ChatDelta(tiny_tokenizer))
    first = result["first"]
    assert result["second"] is None and first is not None
    assert (first.reward, first.turn_rewards, first.metrics["lost"], first.metrics["return/second"]) == (
        -1.0, [0.0, -1.0], 1.0, 1.0)
    assert "Your opponent took 1. 4 stones are left" in first.text


def test_groups_are_per_prompt_and_trained_role(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """Self-play: one group per (position, role), n samples each, the role in its metadata and
    each sample's reward its role's return; against a scripted opponent: one group per position,
    the example's role. A seat whose game ended before it moved is kept out of the update."""
    exs = examples({"game": "nim"}, 4)
    assert [e.fields["role"] for e in exs] == ["first", "second", "first", "second"]
    assert len({e.prompt for e in exs}) == 4  # distinct prompts: held-out ones do not remove training ones
    params = SamplingParams(max_new_tokens=8)
    selfplay = GameEpisodes(game_env(game="nim", opponent="self"), tiny_tokenizer, params)
    # every first move forfeits ("x"): the second seat never moves
    groups = selfplay(Scripted(tiny_tokenizer, ["x"] * 6), exs, [0, 1, 2], 2)  # type: ignore[arg-type]
    assert [(g.metadata["id"], g.metadata["role"]) for g in groups] == [
        ("nim/0", "first"), ("nim/0", "second"), ("nim/1", "first"), ("nim/1", "second"), ("nim/2", "first"),
        ("nim/2", "second")]
    for g in groups:
        assert len(g.samples) == 2 and g.metadata["opponent"] == "self"
        for s in g.samples:
            if g.metadata["role"] == "first":
                assert s.reward == -1.0 and s.reward_parts["correct"] == 0.0 and "env/excluded" not in s.reward_parts
            else:  # unplayed: no tokens, out of the loss, but the win stands (the opponent forfeited)
                assert s.reward_parts["env/excluded"] == 1.0 and not s.completion.token_ids
                assert s.reward_parts["correct"] == 1.0 and s.reward_parts["correct/masked"] == 1.0
                assert has_verdict(s, "correct") and is_correct(s, "correct")
        assert g.prompt == f"nim game {g.metadata['id'].split('/')[1]} (stones = " \
            f"{exs[int(g.metadata['id'].split('/')[1])].fields['start']['stones']}), the policy as {g.metadata['role']}"
    scripted = GameEpisodes(game_env(game="nim", opponent="random"), tiny_tokenizer, params)
    groups = scripted(Scripted(tiny_tokenizer, ["x"] * 4), exs, [0, 1], 2)  # type: ignore[arg-type]
    assert [(g.metadata["role"], len(g.samples)) for g in groups] == [("first", 2), ("second", 2)]
    # the policy as second moved after the random opponent's move, and forfeited
    assert all(s.reward == -1.0 and s.completion.token_ids for s in groups[1].samples)


def test_a_seat_that_runs_out_the_clock_loses(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """From 7, the first seat pads its move ("aaaaaaaa 1": 11 tokens with EOS) past its budget of 10
    sampled tokens; the second takes 2. At its next move the first cannot act: the game's
    forfeit makes it the loser, not a draw, and the −1 lands on its last move."""
    engine = Scripted(tiny_tokenizer, ["aaaaaaaa 1", "2"])
    (result,) = play(engine, tiny_tokenizer, [Nim({"stones": 7})], [{"first": "policy", "second": "policy"}],  # type: ignore[arg-type]
                     SamplingParams(max_new_tokens=16), Limits(max_turn_tokens=16, max_total_tokens=10),
                     ChatDelta(tiny_tokenizer))
    first, second = result["first"], result["second"]
    assert first is not None and second is not None
    assert (first.ending, first.reward, first.turn_rewards, first.metrics["stalled"], first.metrics["lost"]) == (
        "budget", -1.0, [-1.0], 1.0, 1.0)
    assert (second.reward, second.turn_rewards, second.metrics["correct"]) == (1.0, [1.0], 1.0)


class Exploding(Nim):
    def step(self, action: str) -> GameStep:
        if self.stones == 9:
            raise KeyError("a bug in the game")
        return super().step(action)


def test_a_game_that_fails_ends_without_a_verdict_and_the_others_go_on(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    games = [Exploding({"stones": 9}), Exploding({"stones": 6})]
    results = play(Scripted(tiny_tokenizer, ["2", "2", "2", "2", "2"]), tiny_tokenizer, games,  # type: ignore[arg-type]
                   [{"first": "policy", "second": "scripted:random"}] * 2, SamplingParams(max_new_tokens=8), Limits(),
                   ChatDelta(tiny_tokenizer))
    assert results[0]["first"] is not None and results[0]["first"].ending == "error"
    assert results[1]["first"] is not None and results[1]["first"].ending == "done"


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"gmae": "nim"}, "unknown env.kwargs 'gmae'"),
    ({"game": "chess"}, "unknown game 'chess'"),
    ({"opponent": "strong"}, "env.kwargs.opponent = 'strong'; choose from self, frozen, pool, random, optimal"),
    ({"eval_opponent": "self"}, "eval_opponent = 'self'"),
    ({"opponent": "pool", "pool_size": 1}, "pool_size must be >= 2"),
    ({"pool_every": 0}, "pool_every must be a whole number >= 1"),
    ({"game_kwargs": {"take": 0}}, "take must be a whole number >= 1"),
])
def test_bad_options_are_clear_errors(kwargs: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("(", r"\(")):
        Options.of(kwargs)


def test_a_pool_snapshot_samples_as_that_policy_did(tiny_model: LlamaForCausalLM,
                                                   tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """The pool's engine, loaded with the snapshot of step 0, samples exactly what an engine on the
    untouched model samples (the same ids and log-probs under the same seeds), after the policy's
    own weights have moved; the oldest later snapshot is dropped first, the initial one never."""
    initial = {k: v.detach().clone() for k, v in tiny_model.state_dict().items()}
    reference = EmbeddedEngine(LlamaForCausalLM(tiny_model.config).eval(), tiny_tokenizer, eos_token_ids=[EOS_ID])
    reference.update_weights(initial)
    policy = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID])
    pool = Pool(size=3, every=1)
    pool.add(0, initial)
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.add_(0.05)
    moved = {k: v.detach().clone() for k, v in tiny_model.state_dict().items()}
    assert pool.add(1, moved) == [] and pool.add(2, moved) == [] and pool.add(3, moved) == [1]
    assert pool.steps() == [0, 2, 3]
    prompts, params = [[1, 50, 60], [1, 70]], SamplingParams(temperature=1.0, max_new_tokens=6)
    seeds = [[11], [12]]
    got = pool.engine(policy, 0).generate(prompts, params, seeds=seeds)
    want = reference.generate(prompts, params, seeds=seeds)
    assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want]
    # the same weights in two models: the products may sum in another order (a copy's layout, the
    # batch's padding), so fp32 rounding: a few units of 1.2e-7 on log-probs of magnitude < 10
    for g, w in zip(got, want):
        assert g[0].logprobs == pytest.approx(w[0].logprobs, abs=1e-5)
    assert not torch.equal(tiny_model.state_dict()["lm_head.weight"], initial["lm_head.weight"])  # the policy is its own


GAME = ['env.name="game"', 'task.source="env"', "env.max_turns=8", "env.max_total_tokens=64", "task.eval_size=4",
        "train.eval_every=0"]


def test_self_play_and_pool_training_on_the_tiny_model(tiny_dir: Path, tmp_path: Path) -> None:
    """Self-play: each role's return and the win rate are logged, both roles trained (two groups per
    prompt). Pool: the initial policy and a snapshot after every step are written to the run,
    the oldest dropped past pool_size, and a resumed run reads the pool back."""
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_train import TIMING, overrides, read_metrics

    train(load_config(None, [*overrides(tiny_dir, tmp_path, "self"), *GAME,
                             'env.kwargs={game = "nim", opponent = "self"}']), quiet=True)
    rows = read_metrics(tmp_path / "self")
    assert {"env/return/first", "env/return/second", "env/correct", "env/invalid"} <= set(rows[-1])
    assert rows[-1]["env/return/first"] == pytest.approx(-rows[-1]["env/return/second"])  # zero-sum, both seats the policy
    samples = [json.loads(line) for line in (tmp_path / "self" / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt"].split("the policy as ")[1] for s in samples} <= {"first", "second"}

    pool = ['env.kwargs={game = "nim", opponent = "pool", pool_every = 1, pool_size = 3, eval_opponent = "frozen"}']
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "pool", train__steps=3), *GAME, *pool,
                             "checkpoint_every=1"]), quiet=True)
    run = tmp_path / "pool"
    # the pool holds 0, 2, 3; step 1's file stays, for a checkpoint from before that lists it
    files = sorted(p.name for p in (run / "opponents").iterdir())
    assert files == ["step-0.safetensors", "step-1.safetensors", "step-2.safetensors", "step-3.safetensors"]
    rows = read_metrics(run)
    assert [r["opponents/pool"] for r in rows] == [2.0, 3.0, 3.0]
    from safetensors.torch import load_file

    first, last = load_file(run / "opponents" / "step-0.safetensors"), load_file(run / "opponents" / "step-3.safetensors")
    assert any(not torch.equal(first[k], last[k]) for k in first)
    train(resume=run, overrides=("train.steps=4",), quiet=True)
    assert read_metrics(run)[-1]["opponents/newest"] == 4.0 and (run / "opponents" / "step-4.safetensors").exists()
    # resumed, the pool and the games' streams come back: the same steps as a run straight through
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "straight", train__steps=4), *GAME, *pool]), quiet=True)
    for a, b in zip(read_metrics(tmp_path / "straight"), read_metrics(run), strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}


def test_self_play_refuses_what_counts_one_group_per_prompt() -> None:
    from rlvr.config import load_config
    from rlvr.train.methods.registry import check

    cfg = load_config(None, [*GAME, 'env.kwargs={game = "nim"}', 'sampler.rollouts="dynamic"'])
    with pytest.raises(ValueError, match="trains every role"):
        check(cfg)
    cfg = load_config(None, [*GAME, 'env.kwargs={game = "nim", opponent = "pool"}', 'engine.backend="vllm"'])
    with pytest.raises(ValueError, match="needs the embedded engine"):
        check(cfg)


def test_the_packaged_config_loads() -> None:
    from rlvr.config import load_config
    from rlvr.agents.openai_agent import ENV_CHECKS

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "nim.toml", [])
    ENV_CHECKS[cfg.env.name](cfg.env)

