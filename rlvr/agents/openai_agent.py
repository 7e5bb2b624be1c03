"""Black-box agents: train the policy through an agent's own code, which talks to rlvr's
OpenAI-compatible server (`env.name = "openai_agent"`).

    env.kwargs = {entry = "mypkg.agent:run_episode", timeout = 300}

    async def run_episode(client: openai.AsyncOpenAI, row: dict) -> float | str | None:
        ...  # any prompts, tools, frameworks, several model calls, through `client`

For each episode rlvr gives the function a client whose base URL is the episode's own
(``http://127.0.0.1:<port>/e/<episode>/v1``) and the task row (the example's fields, with
``prompt``, ``answer`` and ``id``). The server records every call made through it, and the
trajectory is built from the exact token ids of those calls (`trajectory`): the tokens the
policy sampled are trained (loss mask 1), everything else (the agent's prompts, tool outputs,
history) is masked. A call whose prompt extends the previous call's prompt and completion adds
only the new tokens, masked, then its sampled ones; a call whose prompt does not (the agent
edited or re-rendered its history differently, or a second conversation) starts a new segment.
Each segment is a (prompt, completion) pair of its own, and every segment is trained with the
episode's advantage, as SUPO's summarised segments are (rlvr.agents.runner).

What the function returns is the episode's reward:
- a number: the reward itself;
- a string: the final answer, scored by the run's `[[rewards]]` against the row;
- None: the text of the episode's last call is the final answer, scored the same way.

Inside an episode the run's sampling settings win: `sampling.temperature`, `top_p` and `top_k`
replace the agent's (the learner computes log-probs at the run's temperature, so the samples
must come from that distribution), a call samples at most `sampling.max_new_tokens` tokens and at
most what `env.max_total_tokens` leaves. `env.max_turns` bounds the calls and `env.max_context`
the prompt plus completion. `n` must be 1: the group's episodes are rlvr's to sample. Any model
name is accepted, since the policy is the only model. A call past a limit gets a 400 that names
it. If the agent then gives up (raises), the episode ends `"budget"`, `"max_turns"` or
`"context"` with reward 0: running out is the policy's doing.

An agent that raises for any other reason, returns something else, makes no call, or runs past
`timeout` seconds gives an episode without a verdict: counted in env/error, excluded from the
update, the first such failure of a step logged with its cause, and the run goes on. A step in
which every episode fails that way stops the run with the first failure, since nothing can be
learned from it and the agent is surely broken.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlvr.agents import games, harbor, openenv_env, self_correct
from rlvr.agents.contract import Agent, EpisodeContext, agent_from_entry, awaited
from rlvr.agents.env import no_verdict, timeout_seconds
from rlvr.agents.runner import FAILED, Ending, Episode, as_groups
from rlvr.errors import InfrastructureError
from rlvr.rollout.engine import Engine
from rlvr.serve.protocol import Invalid
from rlvr.types import Completion, SamplingParams, joined_versions
from rlvr.serve.protocol import Limits
from rlvr.models import context_length
from rlvr.options import check_names
from rlvr.data.tasks import render_example
from rlvr.rewards.combine import score_group

_logger = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """Every episode of a step failed in the agent's own code."""


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4
    """Model calls per episode."""
    max_total_tokens: int = 512
    """Tokens sampled per episode."""
    max_context: int = 2048
    """Prompt plus completion of one call."""
    timeout: float = 300.0
    """Seconds an episode may run."""


@dataclass
class Call:
    prompt_ids: list[int]
    completion: Completion


@dataclass
class _Episode:
    calls: list[Call] = field(default_factory=list)
    sampled: int = 0
    refused: Ending | None = None
    """The limit a call hit, if any (an agent that then gives up ends with it)."""
    server_error: str | None = None
    """Why a call could not be served (the engine failed), if one could not: the episode is then
    an infrastructure failure whatever the agent returned."""


class EpisodeRecorder:
    """The server's recorder during a step: admits each episode's calls under its limits and the
    run's sampling settings, and keeps what was sampled (rlvr.serve.app.Recorder)."""

    def __init__(self, params: SamplingParams, limits: AgentLimits, tags: Sequence[str]) -> None:
        self.params, self.limits = params, limits
        self.episodes = {tag: _Episode() for tag in tags}
        self._lock = threading.Lock()

    def admit(self, tag: str | None, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        ep = self.episodes.get(tag) if tag is not None else None
        if ep is None:
            raise Invalid("this server only serves the episodes of the running step; use the base URL "
                             "your episode was given")
        if params.n != 1:
            raise Invalid("n must be 1 inside an episode: rlvr samples the group's episodes itself", "n")
        with self._lock:
            room = {"max_turns": self.limits.max_turns - len(ep.calls),
                    "budget": self.limits.max_total_tokens - ep.sampled,
                    "context": self.limits.max_context - len(prompt_ids)}
            hit = next((why for why, left in room.items() if left < 1), None)
            if hit is not None:
                ep.refused = hit  # type: ignore[assignment]
                what = {"max_turns": f"the episode's {self.limits.max_turns} calls are used (env.max_turns)",
                        "budget": f"the episode's {self.limits.max_total_tokens} sampled tokens are used "
                                  "(env.max_total_tokens)",
                        "context": f"the prompt is {len(prompt_ids)} tokens; env.max_context is "
                                   f"{self.limits.max_context}"}[hit]
                raise Invalid(what, "messages" if hit == "context" else None)
        tokens = min(self.params.max_new_tokens, params.max_new_tokens, room["budget"], room["context"])
        return dataclasses.replace(self.params, max_new_tokens=tokens, stop=params.stop, n=1)

    def record(self, tag: str | None, prompt_ids: list[int], completions: list[Completion]) -> None:
        if tag is None or tag not in self.episodes:
            return
        with self._lock:
            ep = self.episodes[tag]
            ep.calls.append(Call(list(prompt_ids), completions[0]))
            ep.sampled += len(completions[0].token_ids)

    def failed(self, tag: str | None, why: str) -> None:
        if tag is not None and tag in self.episodes:
            with self._lock:
                self.episodes[tag].server_error = self.episodes[tag].server_error or why


def trajectory(tokenizer: Any, calls: Sequence[Call]) -> tuple[list[tuple[tuple[int, ...], Completion]], str,
                                                               list[tuple[int, int]]]:
    """The episode's segments as (prompt ids, completion) pairs, its text, and the character
    spans of that text that were not sampled (see module docstring). A completion's loss mask
    is 1 on sampled tokens and 0 on the tokens between calls; its turn index counts the calls."""
    segments: list[tuple[tuple[int, ...], Completion]] = []
    text, spans = "", []
    prompt: list[int] = []
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    turns: list[int] = []
    pieces: list[str] = []
    parts: list[tuple[int, Completion]] = []  # this segment's calls, for their weights' versions

    def close(reason: Any) -> None:
        if prompt:
            segments.append((tuple(prompt), Completion(tuple(ids), tuple(logprobs), reason, "".join(pieces),
                                                       loss_mask=tuple(mask), turn_index=tuple(turns),
                                                       **joined_versions(parts))))

    for turn, call in enumerate(calls):
        context = prompt + ids
        if prompt and call.prompt_ids[: len(context)] == context:
            between = call.prompt_ids[len(context):]
            injected = tokenizer.decode(between)
            spans.append((len(text), len(text) + len(injected)))
            text += injected
            pieces.append(injected)
            ids += between
            logprobs += [0.0] * len(between)
            mask += [0] * len(between)
            turns += [max(turn - 1, 0)] * len(between)
        else:
            close("stop")
            if prompt:
                spans.append((len(text), len(text) + len(SEGMENT_BREAK)))
                text += SEGMENT_BREAK
            prompt, ids, logprobs, mask, turns, pieces, parts = list(call.prompt_ids), [], [], [], [], [], []
        c = call.completion
        parts.append((len(ids), c))
        ids += c.token_ids
        logprobs += c.logprobs
        mask += [1] * len(c.token_ids)
        turns += [turn] * len(c.token_ids)
        pieces.append(c.text)
        text += c.text
    close(calls[-1].completion.finish_reason if calls else "stop")
    return segments, text, spans


SEGMENT_BREAK = "\n[… a new segment: the next call did not extend this one …]\n"


def row_of(example: Any) -> dict[str, Any]:
    """What the agent function gets: the example's fields, its prompt, answer and id."""
    return {**example.fields, "prompt": example.prompt, "answer": example.answer, "id": example.id}


async def _run_one(agent: Agent, base_url: str, key: str, row: dict[str, Any], timeout: float, tag: str) -> Any:
    import openai

    make = openai.AsyncOpenAI if agent.asynchronous else openai.OpenAI
    client: Any = make(base_url=base_url, api_key=key, max_retries=0, timeout=timeout)
    context = EpisodeContext(client, POLICY, dict(row), base_url, key, tag)

    async def episode() -> Any:
        # a plain function runs in a thread; a timeout abandons it there (its calls fail once the step ends)
        value = agent.call(context) if agent.asynchronous else await asyncio.to_thread(agent.call, context)
        return await awaited(value)

    try:
        return await asyncio.wait_for(episode(), timeout)  # the whole episode, a plain function's too
    finally:
        closing = client.close()
        if agent.asynchronous:
            await closing


POLICY = "policy"
"""The model name an agent is given (any name is served: the policy is the only model)."""


def agent_episode_groups(engine: Engine, tokenizer: Any, agent: Agent, examples: Sequence[Any],
                         indices: list[int], n: int, rewards: list[Any], params: SamplingParams,
                         limits: AgentLimits, *, system_prompt: str | None = None,
                         mask: Collection[str] = ()) -> list[Any]:
    """n episodes of the agent on each example index, as Groups (rlvr.agents.runner.as_groups)."""
    from rlvr.serve.app import Served
    from rlvr.serve.server import BackgroundServer

    jobs = [(i, f"{k}-{secrets.token_hex(4)}") for k, i in enumerate(j for j in indices for _ in range(n))]
    recorder = EpisodeRecorder(params, limits, [tag for _, tag in jobs])
    model = getattr(engine, "model", None)  # None where the engine holds it elsewhere (Ray workers, vLLM)
    served = Served(POLICY, tokenizer, engine, model, context_length=context_length(model, default=1 << 20))
    key = secrets.token_urlsafe(16)
    # the recorder clips each call to the episode's limits (an agent's own max_tokens is not refused)
    server_limits = Limits(max_tokens=served.context_length, max_concurrent=len(jobs) + 8)

    async def everything(root: str) -> list[Any]:
        return list(await asyncio.gather(*(_run_one(agent, f"{root}/e/{tag}/v1", key, row_of(examples[i]),
                                                    limits.timeout, tag) for i, tag in jobs), return_exceptions=True))

    with BackgroundServer(served, limits=server_limits, api_key=key, recorder=recorder) as server:
        outcomes = asyncio.run(everything(server.base_url.removesuffix("/v1")))
    judged = [_episode(tokenizer, examples[i], recorder.episodes[tag], outcome, rewards, system_prompt)
              for (i, tag), outcome in zip(jobs, outcomes)]
    episodes = [ep for ep, _ in judged]
    failures = [(ep, why) for ep, why in judged if ep.ending in FAILED]  # why: what made it fail, said below
    if failures and len(failures) == len(episodes):
        raise AgentError(f"every agent episode of this step failed; the first: {_why(failures[0][1])}") \
            from failures[0][1] if isinstance(failures[0][1], BaseException) else None
    if failures:
        _logger.warning("%d of %d agent episodes failed (counted in env/error, excluded from the update); the "
                        "first: %s", len(failures), len(episodes), _why(failures[0][1]))
    return as_groups(examples, indices, n, episodes, mask=mask)


def _why(outcome: Any) -> str:
    if isinstance(outcome, asyncio.TimeoutError | TimeoutError):
        return "it ran past env.kwargs.timeout"
    if isinstance(outcome, BaseException):
        return f"{type(outcome).__name__}: {outcome}"
    return str(outcome)


def _episode(tokenizer: Any, example: Any, ep: _Episode, outcome: Any, rewards: list[Any],
             system_prompt: str | None) -> tuple[Episode, Any]:
    """The episode from its calls and what the agent returned, and that outcome, replaced by the
    error that made the episode fail where one did (for the log and AgentError)."""

    segments, text, spans = trajectory(tokenizer, ep.calls)
    metrics = {"turns": float(len(ep.calls)), "sampled_tokens": float(ep.sampled),
               "segments": float(len(segments))}  # more than one: the agent rewrote its history
    ending: Ending = "done"
    reward = 0.0
    if ep.server_error is not None:  # the engine failed a call: whatever the agent made of it is not the model's
        ending = "infra"
        outcome = InfrastructureError(f"a call could not be served ({ep.server_error})")
    elif isinstance(outcome, BaseException):
        timed_out = isinstance(outcome, asyncio.TimeoutError | TimeoutError)
        ending = ep.refused if ep.refused is not None and not timed_out else ("timeout" if timed_out else "error")
    elif not ep.calls:
        ending = "error"
        outcome = ValueError("the agent made no call to the model")
    elif isinstance(outcome, bool) or not isinstance(outcome, int | float | str | type(None)):
        ending = "error"
        outcome = TypeError(f"the agent returned {type(outcome).__name__}; expected a number (the reward), a "
                            "string (the final answer) or None (score the last call's text)")
    elif isinstance(outcome, int | float) and not math.isfinite(outcome):  # nan would poison its group's advantages
        ending = "error"
        outcome = ValueError(f"the agent returned a reward of {outcome}")
    elif isinstance(outcome, int | float):
        reward = float(outcome)
    else:
        answer = outcome if isinstance(outcome, str) else ep.calls[-1].completion.text
        reward, parts = score_group(rewards, example.prompt, [answer], example.fields)[0]
        metrics.update({f"reward/{k}": v for k, v in parts.items()}, **no_verdict(parts))
    if ending in FAILED:
        metrics["error"] = 1.0
    if not segments:  # nothing was sampled: an empty completion of the task's prompt, excluded above
        segments = [(tuple(render_example(tokenizer, example, system_prompt)), Completion((), (), "stop", ""))]
    (prompt_ids, completion), earlier = segments[-1], segments[:-1]
    return Episode(prompt_ids, completion, reward, len(ep.calls), ending, metrics, [reward], spans, earlier, text), outcome


def agent_episodes(env: Any, tokenizer: Any, rewards: list[Any], params: SamplingParams, *,
                   system_prompt: str | None = None) -> Callable[..., list[Any]]:
    """The episode builder for `env.name = "openai_agent"` (rlvr.train.data.Episodes), from the
    env config: kwargs `entry` (required), `args` and `timeout` (seconds, default 300)."""
    agent, timeout = agent_of(env)
    return episodes_of(agent, env, timeout, tokenizer, rewards, params, system_prompt=system_prompt)


def agent_of(env: Any) -> tuple[Agent, Any]:
    """The agent env.kwargs names, its signature checked (rlvr.agents.contract), and the timeout:
    cheap, so that `rlvr train` checks it before the model loads (`check_env`)."""
    kwargs = dict(env.kwargs)
    check_names("env.kwargs for openai_agent", kwargs, ["entry", "args", "timeout"])
    entry, timeout, args = kwargs.get("entry"), kwargs.get("timeout", 300.0), kwargs.get("args", {})
    if not isinstance(entry, str):
        raise ValueError('env.name = "openai_agent" needs env.kwargs.entry = "package.module:function", the '
                         "agent's episode function (or object)")
    if not isinstance(args, dict):
        raise ValueError(f"env.kwargs.args must be a table of keyword arguments for the agent, got {args!r}")
    return agent_from_entry(entry, args, max_turns=env.max_turns), timeout


def episodes_of(agent: Agent, env: Any, timeout: Any, tokenizer: Any, rewards: list[Any],
                params: SamplingParams, *, system_prompt: str | None = None) -> Callable[..., list[Any]]:
    """The episode builder (rlvr.train.data.Episodes) running `agent`, under the env config's
    limits (max_turns, max_total_tokens, max_context, mask) and `timeout`."""
    limits = AgentLimits(env.max_turns, env.max_total_tokens, env.max_context, timeout_seconds(timeout))

    def episodes(engine: Engine, examples: list[Any], indices: list[int], n: int, *,
                 sampling: SamplingParams | None = None, held_out: bool = False) -> list[Any]:
        return agent_episode_groups(engine, tokenizer, agent, examples, indices, n, rewards, sampling or params,
                                    limits, system_prompt=system_prompt, mask=tuple(env.mask))

    return episodes


def _verifiers(*args: Any, **kwargs: Any) -> Callable[..., list[Any]]:
    from rlvr.agents.verifiers_env import verifiers_episodes

    return verifiers_episodes(*args, **kwargs)


def _verifiers_dataset(env_kwargs: dict[str, Any], size: int) -> list[Any]:
    from rlvr.agents.verifiers_env import environment_examples

    return environment_examples(env_kwargs)  # its own dataset, whatever its size


EPISODE_BUILDERS: dict[str, Callable[..., Callable[..., list[Any]]]] = {"openai_agent": agent_episodes,
                                                                        "verifiers": _verifiers,
                                                                        "game": games.game_episodes}
"""Environments whose episodes are run by something other than rlvr's turn-by-turn runner."""

SERVED_IN_PROCESS = frozenset({"openai_agent", "verifiers"})
"""Environments whose episodes run through rlvr's OpenAI-compatible server on a thread of the
training process: its engine samples beside the learner (rlvr.runtime keeps malloc to one arena
for them)."""

ENV_CHECKS: dict[str, Callable[[Any], object]] = {"openai_agent": agent_of, "openenv": openenv_env.check,
                                                  "harbor": harbor.check, "self_correct": self_correct.check,
                                                  "game": games.check}
"""Checks of an environment's config cheap enough to run before the model loads."""

ENV_DATASETS: dict[str, Callable[[dict[str, Any], int], list[Any]]] = {"verifiers": _verifiers_dataset,
                                                                        "openenv": openenv_env.examples,
                                                                        "harbor": harbor.examples,
                                                                        "game": games.examples}
"""Environments that bring their own prompts (task.source = "env"), from env.kwargs and the number
wanted (task.size + task.eval_size; an environment with a dataset of its own gives that)."""
