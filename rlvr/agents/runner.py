"""The episode runner: many episodes at once, turn by turn, token-in and token-out.

    context  = prompt tokens
    each turn: the engine samples the policy's action from the context (the turn's budget);
               the environment steps on its text; its observation is rendered as the next chat
               message and its tokens are appended, marked loss mask 0
    the trajectory = exactly the sampled and injected token ids, in order

Nothing sampled is ever decoded and re-encoded: the learner trains on the ids the engine
produced, with the log-probs it sampled them with. Only the environment's text is tokenized.
Where a chat template would re-render the history differently (some drop earlier thinking
blocks), the runner does not re-render it: it keeps the sampled tokens and appends the
template's rendering of the new message only (`ChatDelta`).

The loss mask is set in one place, `_Trajectory.inject`: injected tokens get 0, sampled ones 1.

Limits: at most ``max_turns`` actions; each action at most ``max_turn_tokens`` tokens; at most
``max_total_tokens`` sampled tokens per episode (observations do not count against it); the
context never passes ``max_context`` tokens: an action gets at most the room left, and an
observation that would not fit ends the episode before it is added. ``max_void_turns`` consecutive turns without a valid action (the environment reports
``metrics["void"] = 1``) end it too.

An environment whose step raises ``InfrastructureError`` (rlvr.errors: its sandbox could not run
the model's code) ends that episode with ending ``"infra"``: no verdict, not the policy's
failure, so the episode is counted as ``env/error`` and excluded from the update; the reason is
logged once.

Summarisation (SUPO, `Summarize`): when the working context would reach a budget, the next
observation asks for a summary instead of another action; the sampled summary closes the
segment, and the episode continues in a fresh context made of the task and the summary. Each
segment is a (prompt, completion) pair of its own, trained with the episode's one return.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import traceback
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlvr.agents.env import Env, StepResult
from rlvr.errors import InfrastructureError
from rlvr.options import Summarize
from rlvr.rollout.engine import Engine
from rlvr.sandbox import SandboxUnavailable
from rlvr.types import Completion, SamplingParams, joined_versions
from rlvr.data import render_prompt
from rlvr.types import Group, Sample

Ending = Literal["done", "max_turns", "budget", "context", "void", "infra", "error", "timeout"]


@dataclass(frozen=True)
class Limits:
    max_turns: int = 4
    max_turn_tokens: int = 128
    """Tokens one action may take."""
    max_total_tokens: int = 512
    """Sampled tokens over the whole episode; observations do not count."""
    max_context: int = 2048
    """Prompt plus everything sampled and injected."""
    max_void_turns: int = 2
    """Consecutive turns without a valid action that end the episode."""

    def __post_init__(self) -> None:
        bad = [k for k, v in self.__dict__.items() if v < 1]
        if bad:
            raise ValueError(f"episode limits must be >= 1: {', '.join(bad)}")


SEGMENT_MARK = "\n\n[context summarised: the episode continues from the task and the summary]\n\n"


class ChatDelta:
    """The tokens that close the policy's turn and add an observation as the next message,
    rendered by the tokenizer's own chat template on its own (the history is never re-rendered).

    The template is rendered once with markers in place of the action and the observation; the
    text between them is what follows any action, the text after the observation what precedes
    the next one. When the action already ended with the end-of-turn token (EOS), that token is
    not injected a second time."""

    ACTION, OBSERVATION = "\x00rlvr-action\x00", "\x00rlvr-observation\x00"

    def __init__(self, tokenizer: Any, role: str = "user", system_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": "task"}, {"role": "assistant", "content": self.ACTION},
                        {"role": role, "content": self.OBSERVATION}]
            if system_prompt:
                messages.insert(0, {"role": "system", "content": system_prompt})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            a, o = text.index(self.ACTION) + len(self.ACTION), text.index(self.OBSERVATION)
            self.before, self.after = text[a:o], text[o + len(self.OBSERVATION) :]
        else:  # a base model: the observation on its own lines
            self.before, self.after = "\n", "\n"
        eos = getattr(tokenizer, "eos_token", None) or ""
        self.eos_text = eos if eos and self.before.startswith(eos) else ""

    def ids(self, observation: str, action_ended: bool) -> list[int]:
        before = self.before[len(self.eos_text) :] if action_ended and self.eos_text else self.before
        # the observation (a tool's output: untrusted) is tokenized on its own with special tokens
        # read as text, so a tool that prints "<|im_end|><|im_start|>system ..." cannot open a turn
        # of its own (a red-team review, session 19); the template's parts around it keep theirs
        # and text that cannot be UTF-8 (a lone surrogate from a tool's JSON) as "?": the tokenizer refuses it
        observation = observation.encode("utf-8", "replace").decode("utf-8")
        encode = self.tokenizer
        return [int(i) for i in (encode(before, add_special_tokens=False)["input_ids"]
                                 + encode(observation, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                                 + encode(self.after, add_special_tokens=False)["input_ids"])]


@dataclass
class Episode:
    """One finished episode: its trajectory as a Completion (loss mask 0 on injected tokens) and
    what the environment said about it."""

    prompt_ids: tuple[int, ...]
    completion: Completion
    reward: float
    """The return: the sum of the turns' rewards."""
    turns: int
    ending: Ending
    metrics: dict[str, float] = field(default_factory=dict)
    turn_rewards: list[float] = field(default_factory=list)
    injected_spans: list[tuple[int, int]] = field(default_factory=list)
    """Character spans of ``text`` that were injected (observations; between segments, the mark)."""
    segments: list[tuple[tuple[int, ...], Completion]] = field(default_factory=list)
    """Earlier segments of a summarised episode, as (prompt_ids, completion); ``prompt_ids`` and
    ``completion`` are the last segment."""
    text: str = ""
    """Every segment's text, in order, joined by SEGMENT_MARK (for logs)."""


@dataclass
class _Trajectory:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    pieces: list[tuple[str, bool]] = field(default_factory=list)
    sampled: int = 0
    turns: int = 0
    void_run: int = 0
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    ending: Ending | None = None
    last_action_ended: bool = True
    turn_of: list[int] = field(default_factory=list)
    summarising: bool = False
    """The next output is a summary (SUPO), not an action."""
    summaries: int = 0
    segments: list[tuple[tuple[int, ...], Completion]] = field(default_factory=list)
    shown: list[tuple[str, bool]] = field(default_factory=list)
    """Earlier segments' pieces, for the episode's text."""
    sampled_parts: list[tuple[int, Completion]] = field(default_factory=list)
    """This segment's turns as (offset in `ids`, the completion sampled there): their weights' versions."""

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    def sample(self, c: Completion, eos: set[int]) -> None:
        self.sampled_parts.append((len(self.ids), c))
        self.ids += c.token_ids
        self.logprobs += c.logprobs
        self.mask += [1] * len(c.token_ids)
        self.turn_of += [self.turns] * len(c.token_ids)
        self.pieces.append((c.text, False))
        self.sampled += len(c.token_ids)
        self.last_action_ended = bool(c.token_ids) and c.token_ids[-1] in eos

    def inject(self, ids: list[int], text: str) -> None:
        """The only place a loss mask of 0 is set: tokens the policy did not sample."""
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.turn_of += [max(self.turns - 1, 0)] * len(ids)
        self.pieces.append((text, True))

    def _completion(self, finish_reason: Any) -> Completion:
        text = "".join(piece for piece, _ in self.pieces)
        return Completion(tuple(self.ids), tuple(self.logprobs), finish_reason, text, loss_mask=tuple(self.mask),
                          turn_index=tuple(self.turn_of), **joined_versions(self.sampled_parts))

    def close_segment(self, prompt_ids: list[int]) -> None:
        """The summary just sampled ends this segment; the episode goes on from ``prompt_ids``."""
        self.segments.append((tuple(self.prompt_ids), self._completion("stop")))
        self.shown += self.pieces + [(SEGMENT_MARK, True)]
        self.prompt_ids, self.ids, self.logprobs, self.mask, self.turn_of, self.pieces = prompt_ids, [], [], [], [], []
        self.sampled_parts = []
        self.summarising, self.summaries = False, self.summaries + 1

    def finish(self, tokenizer: Any) -> Episode:
        text, spans = "", []
        for piece, injected in self.shown + self.pieces:
            if injected:
                spans.append((len(text), len(text) + len(piece)))
            text += piece
        completion = self._completion("stop" if self.ending == "done" else "length")
        metrics = {**self.metrics, "turns": float(self.turns), "sampled_tokens": float(self.sampled),
                   "injected_tokens": float(len(self.ids) + sum(len(c.token_ids) for _, c in self.segments)
                                            - self.sampled)}
        if self.summaries:
            metrics["summaries"] = float(self.summaries)
        assert self.ending is not None
        return Episode(tuple(self.prompt_ids), completion, self.reward, self.turns, self.ending, metrics,
                       list(self.turn_rewards), spans, list(self.segments), text)


def run_episodes(engine: Engine, tokenizer: Any, envs: Sequence[Env], prompts: Sequence[list[int]],
                 params: SamplingParams, limits: Limits, delta: ChatDelta, eos_token_ids: Sequence[int], *,
                 summarize: Summarize | None = None,
                 restart: Callable[[int, str], list[int]] | None = None) -> list[Episode]:
    """Run one episode per environment, all turns batched through the engine. ``prompts[k]`` is
    env k's rendered initial observation (token ids). ``params`` gives temperature, top-p/k and
    stop strings; n is 1 and the token budget comes from ``limits``. With ``summarize``,
    ``restart(k, summary)`` gives env k's new prompt (token ids) after a summary."""
    if len(envs) != len(prompts):
        raise ValueError(f"{len(envs)} environments but {len(prompts)} prompts")
    if summarize is not None and restart is None:
        raise ValueError("summarisation needs restart(k, summary): the prompt an episode continues from")
    eos = set(int(i) for i in eos_token_ids)
    trajs = [_Trajectory(list(p)) for p in prompts]
    reusing = getattr(engine, "reusing_prefixes", None)  # an engine that can keep the contexts' keys and values
    with reusing() if reusing is not None else contextlib.nullcontext():
        _run_turns(engine, envs, trajs, params, limits, delta, eos, tokenizer, summarize, restart)
    return [t.finish(tokenizer) for t in trajs]


def _run_turns(engine: Engine, envs: Sequence[Env], trajs: list[_Trajectory], params: SamplingParams, limits: Limits,
               delta: ChatDelta, eos: set[int], tokenizer: Any, summarize: Summarize | None,
               restart: Callable[[int, str], list[int]] | None) -> None:
    """`run_episodes`' turns: sample every active episode's action, step its environment, and
    add the observation, until no episode is active."""
    active = list(range(len(envs)))
    while active:
        budget = {k: min(summarize.max_tokens if summarize and trajs[k].summarising else limits.max_turn_tokens,
                         limits.max_total_tokens - trajs[k].sampled, limits.max_context - len(trajs[k].context))
                  for k in active}
        for k in [k for k in active if budget[k] < 1]:  # no room left to act
            trajs[k].ending = "context"
        active = [k for k in active if budget[k] >= 1]
        if not active:
            break
        outputs = _sample_turns(engine, trajs, {k: budget[k] for k in active}, params)
        still = []
        for k in active:
            t = trajs[k]
            t.sample(outputs[k], eos)
            if not t.summarising:
                t.turns += 1
            elif t.sampled >= limits.max_total_tokens:
                t.ending = "budget"
            else:  # the summary closes the segment; the environment never sees it
                assert restart is not None
                t.close_segment(list(restart(k, outputs[k].text)))
                if len(t.context) >= limits.max_context:
                    t.ending = "context"
                else:
                    still.append(k)
        acting = [k for k in active if trajs[k].ending is None and k not in still]
        results = _step_all([envs[k] for k in acting], [outputs[k].text for k in acting])
        still += [k for k, result in zip(acting, results)
                  if _observe(trajs[k], result, limits, delta, summarize, tokenizer)]
        active = sorted(still)


def _sample_turns(engine: Engine, trajs: list[_Trajectory], budget: dict[int, int],
                  params: SamplingParams) -> dict[int, Completion]:
    """Each active trajectory's next action (the keys of ``budget``, its token budget): one
    engine call per distinct budget."""
    outputs: dict[int, Completion] = {}
    for size in sorted(set(budget.values())):
        batch = [k for k in budget if budget[k] == size]
        turn = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                              max_new_tokens=size, stop=params.stop, n=1)
        for k, group in zip(batch, engine.generate([trajs[k].context for k in batch], turn)):
            outputs[k] = group[0]
    return outputs


def _observe(t: _Trajectory, result: StepResult | InfrastructureError, limits: Limits, delta: ChatDelta,
             summarize: Summarize | None, tokenizer: Any) -> bool:
    """Take the environment's answer to the trajectory's action: its reward and metrics, then
    either an ending or the next observation (with the instruction to summarise when the context
    has grown past ``summarize.at``). Returns whether the episode goes on."""
    if isinstance(result, InfrastructureError):
        t.ending = "infra"
        return False
    if not math.isfinite(float(result.reward)):  # nan or inf would make the whole group's advantages nan
        _warn_once("non-finite", f"an environment gave a reward of {result.reward}; the episode ends, counted in "
                   "env/error and excluded from the update")
        t.ending = "error"
        return False
    t.reward += float(result.reward)
    t.turn_rewards.append(float(result.reward))
    for name, value in result.metrics.items():
        t.metrics[name] = t.metrics.get(name, 0.0) + float(value)
    t.void_run = t.void_run + 1 if result.metrics.get("void", 0) else 0
    if result.done:
        t.ending = "done"
    elif t.turns >= limits.max_turns:
        t.ending = "max_turns"
    elif t.void_run >= limits.max_void_turns:
        t.ending = "void"
    elif t.sampled >= limits.max_total_tokens:
        t.ending = "budget"
    if t.ending is not None:
        return False
    observation = result.observation or ""
    ids = delta.ids(observation, t.last_action_ended)
    if summarize and t.summaries < summarize.rounds and len(t.context) + len(ids) >= summarize.at:
        observation = f"{observation}\n\n{summarize.instruction}" if observation else summarize.instruction
        ids, t.summarising = delta.ids(observation, t.last_action_ended), True
    if len(t.context) + len(ids) + 1 > limits.max_context:
        t.ending = "context"
        return False
    t.inject(ids, tokenizer.decode(ids, skip_special_tokens=True))
    return True


_logger = logging.getLogger("rlvr.agents")
_WARNED: set[str] = set()


def _warn_once(kind: str, message: str, detail: str = "") -> None:
    if kind not in _WARNED:
        _WARNED.add(kind)
        _logger.warning("%s. Further such failures are not logged.%s", message, detail)


def _settled(value: Any) -> StepResult | InfrastructureError:
    """One environment's step as the runner takes it: its StepResult; or, for a step that raised,
    the InfrastructureError that ends its episode without a verdict (counted in env/error and
    excluded), each kind logged once. A step that raised anything else (a parser it did not
    guard, a bug) ends its episode the same way, with its traceback, not the whole batch (a
    red-team review, session 19, crashed the runner so); no sandbox on the machine, or an
    interrupt, stops the run."""
    if isinstance(value, SandboxUnavailable) or isinstance(value, BaseException) and not isinstance(value, Exception):
        raise value  # no sandbox on this machine: no episode can work, so stop and say how to fix it
    if isinstance(value, InfrastructureError):
        _warn_once(type(value).__name__, f"an environment could not carry out a step ({type(value).__name__}: "
                   f"{value}); the episode ends, counted in env/error and excluded from the update")
        return value
    if isinstance(value, Exception):
        name = type(value).__name__
        _warn_once(name + "/env", f"an environment's step raised {name}: {value}; the episode ends, counted in "
                   "env/error and excluded from the update", "\n" + "".join(traceback.format_exception(value, limit=-4)))
        return InfrastructureError(f"the environment's step raised {name}: {value}")
    if not isinstance(value, StepResult):
        raise TypeError(f"an environment's step returned {type(value).__name__}, not StepResult")
    return value


def _step_all(envs: list[Env], actions: list[str]) -> list[StepResult | InfrastructureError]:
    """Every environment's step for this turn; awaitable results are awaited together. A step
    that raises gives the error in its place (`_settled`; see the module docstring)."""
    results: list[Any] = []
    for env, action in zip(envs, actions):
        try:
            results.append(env.step(action))
        except SandboxUnavailable:
            raise  # at once, before any other environment's step
        except Exception as err:  # noqa: BLE001 - settled below, with the awaited ones
            results.append(err)
    pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
    if pending:
        async def gather() -> list[Any]:
            return list(await asyncio.gather(*(results[i] for i in pending), return_exceptions=True))

        for i, value in zip(pending, asyncio.run(gather())):
            results[i] = value
    return [_settled(r) for r in results]


def episode_groups(engine: Engine, tokenizer: Any, factory: Any, examples: Sequence[Any], indices: list[int], n: int,
                   rewards: list[Any], params: SamplingParams, limits: Limits, delta: ChatDelta,
                   eos_token_ids: Sequence[int], *, system_prompt: str | None = None,
                   kwargs: dict[str, Any] | None = None, summarize: Summarize | None = None,
                   mask: Collection[str] = ()) -> list[Any]:
    """n episodes of each example index (one fresh environment each), as Groups whose samples
    carry the episodes' trajectories. A sample's reward is its episode's return (reward part
    "env", followed by "turns" and "tool_calls", which do not count in the reward); the group's
    metadata keeps each episode's metrics, ending, turn rewards, text (all segments) and injected
    spans. ``mask`` names the episodes kept out of the loss (rlvr.agents.runner.masked_episode)."""

    envs: list[Env] = []
    try:
        for i in indices:
            envs += [factory(examples[i], rewards, **(kwargs or {})) for _ in range(n)]
        tasks = [env.initial_observation() for env in envs]
        prompts = [render_prompt(tokenizer, task, system_prompt) for task in tasks]

        def restart(k: int, summary: str) -> list[int]:
            assert summarize is not None
            return render_prompt(tokenizer, f"{tasks[k]}\n\n{summarize.header}\n{summary.strip()}", system_prompt)

        episodes = run_episodes(engine, tokenizer, envs, prompts, params, limits, delta, eos_token_ids,
                                summarize=summarize, restart=restart)
    finally:  # an environment holding something (a server session) lets it go, however the episodes ended
        for env in envs:
            close = getattr(env, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as err:  # noqa: BLE001 - one that cannot close does not stop the others
                    _warn_once(type(err).__name__ + "/close", f"an environment's close raised {err!r}")
    groups = as_groups(examples, indices, n, episodes, mask=mask)
    scales = [getattr(env, "kl_turn_scale", None) for env in envs]
    if any(scale is not None for scale in scales):  # the environment weights the KL term by turn
        for k, g in enumerate(groups):
            g.metadata["kl_turn_scale"] = scales[k * n : (k + 1) * n]
    return groups


FAILED: tuple[str, ...] = ("infra", "error", "timeout")
"""Endings that give no verdict on the policy (the environment or the agent's own code failed):
counted in env/error and excluded from the update."""


def masked_episode(episode: Episode, mask: Collection[str]) -> bool:
    """Whether ``mask`` (env.mask) keeps the episode out of the loss: "unfinished" when it ended
    without the environment saying done (SUPO's overlong masking: Lu et al., "Scaling LLM
    Multi-turn RL with End-to-end Summarization-based Context Management", arXiv:2510.06727);
    "void" when any of its turns was void, reported by the environment as ``metrics["void"]``:
    neither a valid action nor an answer (SimpleTIR's void-turn filtering: Xue et al., "SimpleTIR:
    End-to-End Reinforcement Learning for Multi-Turn Tool-Integrated Reasoning",
    arXiv:2509.02479, which drops such trajectories from the update to keep multi-turn training
    from collapsing)."""
    unknown = set(mask) - {"unfinished", "void"}
    if unknown:
        raise ValueError(f"env.mask: unknown {sorted(unknown)[0]!r} (use \"unfinished\" or \"void\")")
    return ("unfinished" in mask and episode.ending != "done") or ("void" in mask and episode.metrics.get("void", 0) > 0)


def _flags(episode: Episode, mask: Collection[str]) -> dict[str, float]:
    """An episode's flags among its reward parts. No verdict ("env/excluded"): its reward had none
    (the environment's "excluded" metric, rlvr.agents.env.no_verdict) or the episode failed
    ("env/error"); out of the loss, and out of every accuracy. Masked ("env/excluded" with
    "env/masked"): `env.mask` keeps an unfinished or void episode out of the loss, but the
    policy did fail it, so it counts as a wrong answer (rlvr.train.rollouts.has_verdict); or the
    episode says so itself (its "masked" metric: a game's seat that never moved, whose result
    stands though it has no tokens to train on)."""
    if episode.ending in FAILED:
        return {"env/error": 1.0, "env/excluded": 1.0}
    if episode.metrics.get("excluded", 0) > 0:
        return {"env/excluded": 1.0}
    if masked_episode(episode, mask) or episode.metrics.get("masked", 0) > 0:
        return {"env/excluded": 1.0, "env/masked": 1.0}
    return {}


def _verdict(episode: Episode, mask: Collection[str]) -> dict[str, float]:
    """An environment's own verdict on the episode, where it reports one (its summed ``correct``
    metric: e.g. self-correction's last attempt, whose return also holds shaping): the part
    ``correct``, which accuracy then counts instead of the return (rlvr.train.rollouts), flagged
    as the return is."""
    if "correct" not in episode.metrics:
        return {}
    return {"correct": episode.metrics["correct"], **{f"correct/{k.split('/')[1]}": v
                                                      for k, v in _flags(episode, mask).items()}}


def as_groups(examples: Sequence[Any], indices: list[int], n: int, episodes: Sequence[Episode], *,
              mask: Collection[str] = ()) -> list[Any]:
    """Episodes (n per example index, in order) as Groups (see episode_groups)."""

    groups = []
    for k, i in enumerate(indices):
        mine = episodes[k * n : (k + 1) * n]
        # "turns" and "tool_calls" ride along as weight-0 parts: advantage_kwargs.stratum can stratify by them (SAN)
        samples = tuple(Sample(ep.prompt_ids, ep.completion, ep.reward, {
            "env": ep.reward, "turns": float(ep.turns), "tool_calls": ep.metrics.get("tool_calls", 0.0),
            **_verdict(ep, mask), **_flags(ep, mask)}, i, segments=tuple(ep.segments)) for ep in mine)
        groups.append(Group(examples[i].prompt, samples, {
            "id": examples[i].id, "answer": examples[i].answer, "env_metrics": [ep.metrics for ep in mine],
            "endings": [ep.ending for ep in mine], "injected_spans": [ep.injected_spans for ep in mine],
            "turn_rewards": [ep.turn_rewards for ep in mine], "texts": [ep.text for ep in mine]}))
    return groups


def episode_metrics(groups: Sequence[Any]) -> dict[str, float]:
    """Means over a step's episodes: env/<metric> (absent = 0) and env/ending/<why> fractions."""
    metrics = [m for g in groups for m in g.metadata.get("env_metrics", [])]
    if not metrics:
        return {}
    names = sorted({k for m in metrics for k in m})
    out = {f"env/{k}": sum(m.get(k, 0.0) for m in metrics) / len(metrics) for k in names}
    endings = [e for g in groups for e in g.metadata.get("endings", [])]
    for why in sorted(set(endings)):
        out[f"env/ending/{why}"] = endings.count(why) / len(endings)
    calls, errors = out.get("env/tool_calls"), out.get("env/tool_errors")
    if calls:
        out["env/tool_error_rate"] = (errors or 0.0) / calls
    return out
