"""Games: several roles in one episode, each played by its own player, each with its own return and
its own group-relative advantage (`env.name = "game"`; the protocol is rlvr.agents.game).

    players   the policy (trained), a scripted player (the game's own: "random", "optimal"), or an
              earlier policy from the opponent pool (frozen, not trained)
    seats     each role in a game is a seat with its own context: its opening, then its own
              sampled moves and, injected (loss mask 0), what the game told it since its last move
    groups    the policy's seats of one start position and one role, n games: one group per
              (prompt, role), so each role's advantage is relative to the same role's games

The opponent (`env.kwargs.opponent`):

    "self"      self-play: the policy plays every role, and every role is trained (SPIRAL's setting:
                Liu et al., "SPIRAL: Self-Play on Zero-Sum Games Incentivizes Reasoning via
                Multi-Agent Multi-Turn Reinforcement Learning", arXiv:2506.24119; per-role groups
                are the group-relative form of its role-conditioned advantage estimation)
    "frozen"    the policy as the run began: the policy plays the example's role against it
    "pool"      an earlier policy drawn per game from a pool: the start, then a snapshot every
                `pool_every` steps; the pool holds `pool_size`: the initial policy (always) and
                the latest `pool_size − 1`;
                fictitious-self-play-style training against a population of past selves
    a name      one of the game's scripted players (Nim: "random", "optimal")

Held-out evaluation plays `eval_opponent` (default "random": a fixed opponent) from the example's
role, so eval/accuracy is the win rate against it; in training, accuracy is the win rate against
whoever was played.

Each policy seat is a sample whose reward is its role's return. Its reward parts say "correct" =
1 for a win (the verdict accuracy counts). Every sample's metrics carry both roles' returns in its
game (env/return/<role>), its own moves and its own forfeits; a seat that never moved (its game
ended first) is kept out of the update, its result still counted in the win rate. A seat that a
limit stops before its move (turns, tokens, context) is judged by the game's ``forfeit(role)``.

Pool and frozen opponents need the policy's weights in this process (the embedded engine): the
opponent engine is a copy of the policy's model, loaded with a snapshot before its seats' turns.
The snapshots are taken by the `opponents` method (rlvr.train.methods.opponents), which also
writes them to the run directory, so that a resumed run plays the same pool.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from inspect import signature
from typing import Any

import torch

from rlvr.agents.game import Game, GameStep
from rlvr.agents.nim import Nim
from rlvr.agents.runner import ChatDelta, Ending, Episode, Limits, _Trajectory, _sample_turns, _warn_once, as_groups
from rlvr.data import Example, render_prompt
from rlvr.rewards.combine import load_callable
from rlvr.rollout.engine import EmbeddedEngine, Engine
from rlvr.types import Completion, Group, SamplingParams

GAMES: dict[str, type] = {"nim": Nim}
"""Games by name (`env.kwargs.game`); a dotted path ``package.module:Class`` names your own."""

MODEL_OPPONENTS = ("self", "frozen", "pool")


def game_class(name: Any) -> Any:
    if not isinstance(name, str) or not name:
        raise ValueError(f"env.kwargs.game must name a game ({', '.join(GAMES)}) or give package.module:Class, "
                         f"got {name!r}")
    if name in GAMES:
        return GAMES[name]
    if ":" in name or "." in name:
        return load_callable(name)
    raise ValueError(f"unknown game {name!r}; choose from {', '.join(GAMES)} or give package.module:Class")


@dataclass(frozen=True)
class Options:
    """env.kwargs of `env.name = "game"`, checked."""

    game: str = "nim"
    game_kwargs: dict[str, Any] = field(default_factory=dict)
    opponent: str = "self"
    eval_opponent: str = "random"
    pool_every: int = 5
    pool_size: int = 4

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> Options:
        known = [f for f in signature(cls).parameters]
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(f"game: unknown env.kwargs {unknown[0]!r} (it takes {', '.join(known)})")
        options = cls(**kwargs)
        kind = game_class(options.game)
        if not isinstance(options.game_kwargs, dict):
            raise ValueError(f"game: env.kwargs.game_kwargs must be a table, got {options.game_kwargs!r}")
        start = kind.start(0, **options.game_kwargs)  # the game checks its own options
        roles = tuple(kind(start, **options.game_kwargs).roles)
        if len(roles) < 2:
            raise ValueError(f"game {options.game!r} has {len(roles)} role(s); a game needs two or more")
        scripted = dict(getattr(kind, "scripted", {}))
        for name, value, allowed in (("opponent", options.opponent, [*MODEL_OPPONENTS, *scripted]),
                                     ("eval_opponent", options.eval_opponent, ["frozen", *scripted])):
            if value not in allowed:
                raise ValueError(f"game: env.kwargs.{name} = {value!r}; choose from {', '.join(allowed)}")
        for name, number in (("pool_every", options.pool_every), ("pool_size", options.pool_size)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ValueError(f"game: env.kwargs.{name} must be a whole number >= 1, got {number!r}")
        if options.pool_size < 2 and options.opponent == "pool":
            raise ValueError("game: env.kwargs.pool_size must be >= 2 for opponent = \"pool\" (the initial policy and "
                             "at least one later one); opponent = \"frozen\" plays the initial policy alone")
        return options

    @property
    def trains_every_role(self) -> bool:
        return self.opponent == "self"

    def needs_pool(self) -> bool:
        return self.opponent in ("frozen", "pool") or self.eval_opponent == "frozen"


class Pool:
    """Earlier policies, by the step after which each was taken (0: the policy the run began with),
    on the CPU; `engine` samples with one of them. The initial policy always stays; beyond it the
    last ``size − 1`` are kept. ``every``: the steps between snapshots (0: the initial one alone)."""

    def __init__(self, size: int, every: int) -> None:
        self.size, self.every = size, every
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self._engine: EmbeddedEngine | None = None
        self._loaded: int | None = None

    def steps(self) -> list[int]:
        return sorted(self.weights)

    def add(self, step: int, weights: dict[str, torch.Tensor]) -> list[int]:
        """Keep ``weights`` as the policy after ``step``; returns the steps dropped to make room."""
        self.weights[step] = weights
        dropped = []
        while len(self.weights) > self.size:
            oldest = min(s for s in self.weights if s != 0)
            del self.weights[oldest]
            dropped.append(oldest)
        if self._loaded not in self.weights:
            self._loaded = None
        return dropped

    def draw(self, rng: random.Random) -> int:
        """A snapshot's step, uniformly."""
        return rng.choice(self._filled().steps())

    def _filled(self) -> Pool:
        if not self.weights:
            raise RuntimeError("the opponent pool is empty: the `opponents` method fills it when the run opens "
                               "(resuming a run without its opponents state starts without one)")
        return self

    def engine(self, policy: Engine, step: int) -> Engine:
        """An engine sampling with the policy after ``step``: one copy of the policy's model, its
        weights swapped in when another snapshot plays."""
        self._filled()
        if self._engine is None:
            model = getattr(policy, "model", None)
            if model is None or not isinstance(policy, EmbeddedEngine):
                raise ValueError("env.kwargs.opponent = \"frozen\" or \"pool\" (and eval_opponent = \"frozen\") plays an "
                                 "earlier policy on a copy of the model in this process: it needs the embedded "
                                 f"engine, not {type(policy).__name__} (use a scripted opponent, or self-play)")
            twin = copy.deepcopy(model).eval().requires_grad_(False)
            self._engine = EmbeddedEngine(twin, policy.tokenizer, eos_token_ids=policy.eos_token_ids,
                                          max_batch_size=policy.max_batch_size, decoder=policy.decoder,  # type: ignore[arg-type]
                                          weights=policy.weights, seed=step + 1)
            names = set(twin.state_dict())
            missing = names - set(self.weights[self.steps()[0]])
            if missing:
                raise ValueError(f"the opponent pool's snapshots lack {len(missing)} of the engine's weights (e.g. "
                                 f"{sorted(missing)[0]!r}): an opponent pool does not work with this model yet")
        if self._loaded != step:
            self._engine.update_weights(self.weights[step])
            self._loaded = step
        return self._engine


@dataclass
class _Seat:
    role: str
    player: str
    """"policy", "pool:<step>" or "scripted:<name>"."""
    traj: _Trajectory | None = None
    pending: list[str] = field(default_factory=list)
    moves: int = 0
    reward: float = 0.0
    carry: float = 0.0
    """Paid before its first move: credited to that move's turn."""
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def model(self) -> bool:
        return not self.player.startswith("scripted:")


@dataclass
class _Table:
    game: Game
    seats: dict[str, _Seat]
    ending: Ending | None = None
    winner: str | None = None


def play(policy: Engine, tokenizer: Any, games: Sequence[Game], players: Sequence[dict[str, str]],
         params: SamplingParams, limits: Limits, delta: ChatDelta, *, system_prompt: str | None = None,
         pool: Pool | None = None, rng: random.Random | None = None) -> list[dict[str, Episode | None]]:
    """Play every game to its end, all moves of one player batched through its engine. ``players[k]``
    seats a player in each role of game k. Returns, for each game, each model-played role's
    episode (None for a scripted seat): its trajectory (its own opening and moves; what it was
    told injected with loss mask 0), its return, its ending and metrics."""
    rng = rng or random.Random(0)
    eos = set(int(i) for i in policy.eos_token_ids)
    tables = [_Table(g, {role: _Seat(role, p[role]) for role in g.roles}) for g, p in zip(games, players)]
    reusing = getattr(policy, "reusing_prefixes", None)
    with reusing() if reusing is not None else contextlib.nullcontext():
        active = list(tables)
        while active:
            movers: dict[int, _Seat] = {}
            for k, t in enumerate(active):
                seat = t.seats[t.game.to_move()]
                why = _ready(seat, t.game, tokenizer, limits, delta, system_prompt)
                if why is not None:  # a limit stops the seat: the game's verdict on it, where the game has one
                    t.ending = why
                    _stalled(t, seat)
                else:
                    movers[k] = seat
            actions = _actions(policy, pool, active, movers, params, limits, eos, rng)
            for k, t in enumerate(active):
                if k in actions:
                    _move(t, movers[k], actions[k])
            active = [t for t in active if t.ending is None]
    return [_episodes(t, tokenizer, system_prompt) for t in tables]


def _ready(seat: _Seat, game: Game, tokenizer: Any, limits: Limits, delta: ChatDelta,
           system_prompt: str | None) -> Ending | None:
    """Bring the seat's context up to its move (its opening, or what it was told since its last
    move); an ending instead where a limit stops it."""
    if seat.moves >= limits.max_turns:
        return "max_turns"
    told = "\n\n".join(seat.pending)
    seat.pending = []
    if not seat.model:
        return None
    if seat.traj is None:
        opening = game.opening(seat.role)
        seat.traj = _Trajectory(render_prompt(tokenizer, f"{opening}\n\n{told}" if told else opening, system_prompt))
    elif told:
        ids = delta.ids(told, seat.traj.last_action_ended)
        if len(seat.traj.context) + len(ids) + 1 > limits.max_context:
            return "context"
        seat.traj.inject(ids, tokenizer.decode(ids, skip_special_tokens=True))
    if seat.traj.sampled >= limits.max_total_tokens:
        return "budget"
    if len(seat.traj.context) >= limits.max_context:
        return "context"
    return None


def _actions(policy: Engine, pool: Pool | None, tables: list[_Table], movers: dict[int, _Seat],
             params: SamplingParams, limits: Limits, eos: set[int], rng: random.Random) -> dict[int, str]:
    """Each mover's action: a scripted player's from the game, a model's sampled by its engine
    (one batch per player)."""
    actions: dict[int, str] = {}
    by_player: dict[str, list[int]] = {}
    for k, seat in movers.items():
        if seat.model:
            by_player.setdefault(seat.player, []).append(k)
        else:
            script = tables[k].game.scripted[seat.player.removeprefix("scripted:")]
            actions[k] = script(tables[k].game, rng)
    for player in sorted(by_player):
        if player == "policy":
            engine = policy
        else:  # an earlier policy: its sampling stream drawn from the game's, so a resumed run plays the same
            assert pool is not None
            engine = pool.engine(policy, int(player.removeprefix("pool:")))
            engine.generator.manual_seed(rng.getrandbits(62))
        ks = by_player[player]
        trajs = [movers[k].traj for k in ks]
        budget = {j: min(limits.max_turn_tokens, limits.max_total_tokens - t.sampled, limits.max_context - len(t.context))
                  for j, t in enumerate(trajs) if t is not None}
        outputs = _sample_turns(engine, trajs, budget, params)  # type: ignore[arg-type]
        for j, k in enumerate(ks):
            traj = movers[k].traj
            assert traj is not None
            traj.sample(outputs[j], eos)
            traj.turns += 1
            actions[k] = outputs[j].text
    return actions


def _move(t: _Table, seat: _Seat, action: str) -> None:
    """Apply one move to its game: the rewards to every role (a role not moving is paid on its
    last move), what each role is told, and the end."""
    seat.moves += 1
    answer = _answer(t, "step", lambda: t.game.step(action))
    if answer is None:
        return
    result, rewards = answer
    for name, value in result.metrics.items():
        seat.metrics[name] = seat.metrics.get(name, 0.0) + float(value)
    _pay(t, rewards, seat)
    for role, message in result.messages.items():
        if message:
            t.seats[role].pending.append(message)
    if result.done:
        t.ending, t.winner = "done", result.winner


def _pay(t: _Table, rewards: dict[str, float], mover: _Seat | None) -> None:
    """Each role's reward, credited for turn credit (algo.credit = "turn") on its last move: the
    mover's on the move it just made, the others' on their last one (a loss dealt by the
    opponent's move is charged to the move that allowed it), before a role's first move on that."""
    for role, reward in rewards.items():
        seat = t.seats[role]
        seat.reward += reward
        if seat.traj is None or not seat.traj.turns:
            seat.carry += reward
        elif seat is mover:
            seat.traj.turn_rewards.append(reward + seat.carry)
            seat.carry = 0.0
        else:
            seat.traj.turn_rewards[-1] += reward


def _stalled(t: _Table, seat: _Seat) -> None:
    """A seat a limit stopped before its move (its turns, sampled tokens or context): the game's
    ``forfeit(role)`` verdict where it has one (else no winner, and what was paid so far), so that
    a seat cannot escape a lost position by running out the clock."""
    seat.metrics["stalled"] = 1.0
    forfeit = getattr(t.game, "forfeit", None)
    if forfeit is None:
        return
    answer = _answer(t, "forfeit", lambda: forfeit(seat.role))
    if answer is not None:
        _pay(t, answer[1], None)
        t.winner = answer[0].winner


def _answer(t: _Table, what: str, call: Callable[[], Any]) -> tuple[GameStep, dict[str, float]] | None:
    """The game's answer (its ``step`` or ``forfeit``), checked, with every role's reward; None when
    it raised or answered something a game may not (the game's fault: it ends without a verdict,
    counted in env/error, not the batch)."""
    try:
        result = call()
        if not isinstance(result, GameStep):
            raise TypeError(f"returned {type(result).__name__}, not GameStep")
        unknown = sorted((set(result.rewards) | set(result.messages)) - set(t.seats))
        if unknown:
            raise ValueError(f"named the role {unknown[0]!r}, which it does not have")
        if result.winner is not None and result.winner not in t.seats:
            raise ValueError(f"named the winner {result.winner!r}, which is not one of its roles")
        rewards = {role: float(result.rewards.get(role, 0.0)) for role in t.seats}
        if not all(r == r and abs(r) != float("inf") for r in rewards.values()):
            raise ValueError(f"paid a reward that is not finite: {rewards}")
    except Exception as err:  # noqa: BLE001 - the game's fault: this game ends, not the batch
        _warn_once(type(err).__name__ + "/game", f"a game's {what} failed ({type(err).__name__}: {err}); the game "
                   "ends, counted in env/error and excluded from the update")
        t.ending = "error"
        return None
    return result, rewards


def _episodes(t: _Table, tokenizer: Any, system_prompt: str | None) -> dict[str, Episode | None]:
    returns = {f"return/{role}": seat.reward for role, seat in t.seats.items()}
    out: dict[str, Episode | None] = {}
    for role, seat in t.seats.items():
        if not seat.model:
            out[role] = None
            continue
        won = t.ending != "error" and t.winner == role
        lost = t.ending != "error" and t.winner is not None and t.winner != role
        metrics = {**seat.metrics, **returns, "correct": float(won), "lost": float(lost), "moves": float(seat.moves)}
        if seat.traj is None or not seat.traj.turns:  # its game ended before it moved: nothing of its to train on
            opening = t.game.opening(role)
            ids = tuple(render_prompt(tokenizer, opening, system_prompt))
            # out of the loss, its result in the win rate (the opponent forfeited): "masked"
            out[role] = Episode(ids, Completion((), (), "stop", ""), seat.reward, 0, t.ending or "done",
                                {**metrics, "masked": 1.0, "unplayed": 1.0}, [], [], [], "")
            continue
        seat.traj.ending = t.ending or "done"
        seat.traj.reward = seat.reward
        seat.traj.metrics = metrics
        out[role] = seat.traj.finish(tokenizer)
    return out


class GameEpisodes:
    """The episode builder of `env.name = "game"` (rlvr.train.data.Episodes): n games of each start
    position, as one group per (position, trained role). Holds the opponent pool (`pool`), which
    the `opponents` method fills."""

    def __init__(self, env: Any, tokenizer: Any, params: SamplingParams, *, system_prompt: str | None = None) -> None:
        self.options = Options.of(dict(env.kwargs))
        self.kind = game_class(self.options.game)
        self.tokenizer, self.params, self.system_prompt = tokenizer, params, system_prompt
        self.limits = Limits(max_turns=env.max_turns, max_turn_tokens=params.max_new_tokens,
                             max_total_tokens=env.max_total_tokens, max_context=env.max_context,
                             max_void_turns=env.max_void_turns)
        self.delta = ChatDelta(tokenizer, env.observation_role, system_prompt)
        self.mask = tuple(env.mask)
        # periodic snapshots for a pool; the initial policy alone for a frozen opponent
        every = self.options.pool_every if self.options.opponent == "pool" else 0
        self.pool = Pool(self.options.pool_size, every) if self.options.needs_pool() else None

    def __call__(self, engine: Engine, examples: list[Example], indices: list[int], n: int, *,
                 sampling: SamplingParams | None = None, held_out: bool = False) -> list[Group]:
        o = self.options
        opponent = o.eval_opponent if held_out else o.opponent
        # held out, every evaluation meets the same stream of scripted moves; in training, a new stream
        # each call, drawn from the engine's (the run's seed, and checkpointed)
        rng = random.Random(0 if held_out else int(torch.randint(1 << 62, (1,), generator=engine.generator)))
        games: list[Game] = []
        players: list[dict[str, str]] = []
        trained: list[list[str]] = []
        for i in indices:
            example = examples[i]
            role = str(example.fields.get("role"))
            for _ in range(n):
                game = self.kind(example.fields["start"], **o.game_kwargs)
                if role not in game.roles:
                    raise ValueError(f"example {example.id}: its role {role!r} is not one of the game's "
                                     f"({', '.join(game.roles)})")
                games.append(game)
                if opponent == "self":
                    players.append({r: "policy" for r in game.roles})
                else:
                    other = ("pool:0" if opponent == "frozen" else
                             f"pool:{self.pool.draw(rng)}" if self.pool and opponent == "pool" else f"scripted:{opponent}")
                    players.append({r: "policy" if r == role else other for r in game.roles})
            trained.append(list(games[-1].roles) if opponent == "self" else [role])
        results = play(engine, self.tokenizer, games, players, sampling or self.params, self.limits, self.delta,
                       system_prompt=self.system_prompt, pool=self.pool, rng=rng)
        order, episodes = [], []
        for k, i in enumerate(indices):
            for role in trained[k]:
                order.append((i, role))
                for result in results[k * n : (k + 1) * n]:
                    episode = result[role]
                    assert episode is not None
                    episodes.append(episode)
        groups = as_groups(examples, [i for i, _ in order], n, episodes, mask=self.mask)
        return [Group(f"{g.prompt}, the policy as {role}", g.samples,
                      {**g.metadata, "role": role, "opponent": opponent}) for g, (_, role) in zip(groups, order)]


def game_episodes(env: Any, tokenizer: Any, rewards: list[Any], params: SamplingParams, *,
                  system_prompt: str | None = None) -> GameEpisodes:
    """The episode builder for `env.name = "game"` (rlvr.agents.openai_agent.EPISODE_BUILDERS); a
    game pays its own rewards, so the task's are not read."""
    return GameEpisodes(env, tokenizer, params, system_prompt=system_prompt)


def examples(env_kwargs: dict[str, Any], size: int) -> list[Example]:
    """`size` start positions for task.source = "env", the policy's role alternating (the first
    position's role is the game's first)."""
    o = Options.of(env_kwargs)
    kind = game_class(o.game)
    out = []
    for k in range(size):
        start = kind.start(k, **o.game_kwargs)
        roles = kind(start, **o.game_kwargs).roles
        role = roles[k % len(roles)]
        shown = ", ".join(f"{key} = {value}" for key, value in start.items())
        out.append(Example(f"{o.game} game {k} ({shown})", None, {"start": start, "role": role}, f"{o.game}/{k}"))
    return out


def check(env: Any) -> None:
    """env.kwargs checked before the model loads (Options.of)."""
    Options.of(dict(env.kwargs))
