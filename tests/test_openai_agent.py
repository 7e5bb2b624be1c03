"""Black-box agents (env.name = "openai_agent"): agent code using the real `openai` client
drives episodes through rlvr's server; the trajectory is the calls' exact token ids, with the
policy's samples trained and everything else masked."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlvr.agents.contract import AgentSignatureError, EpisodeContext, as_agent
from rlvr.agents.openai_agent import AgentError, AgentLimits, agent_episode_groups
from rlvr.data import Example
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.types import SamplingParams
from tests.tiny import BOS, CHATML_TEMPLATE, EOS, PAD, make_tiny_model

SEEN: list[Any] = []
"""The responses the agents below received, for the tests to compare with the trajectories."""


def ascii_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (and newline), no merges: any text a model
    samples decodes to ASCII and encodes back to the same ids, so an agent that sends the
    model's replies back extends its previous call exactly (tests.tiny's byte tokenizer samples
    bytes that are not valid UTF-8, which decode to U+FFFD and do not round-trip)."""
    symbols = [byte_symbol(b) for b in [10, *range(32, 127)]]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate([PAD, BOS, EOS, *symbols])}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def byte_symbol(b: int) -> str:
    """The character byte-level BPE (GPT-2's table) writes byte b as: printable Latin-1 bytes as
    themselves, the others as 256, 257, ... in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def engine_for(tok: Any) -> EmbeddedEngine:
    model = make_tiny_model(vocab_size=len(tok))
    return EmbeddedEngine(model, tok, eos_token_ids=[tok.eos_token_id], seed=0)


async def two_turns_with_a_tool(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    """A tool-using agent: asks, runs a 'tool' on the reply, sends the output back, asks again."""
    messages: list[Any] = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="whatever-the-agent-calls-it", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "tool", "content": f"calculator says {row['answer']}"}]
    second = await client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=5, temperature=0.0)
    SEEN.append((row["id"], first, second))
    return 1.0 if row["answer"] in (second.choices[0].message.content or "") else float(len(first.choices[0].message.content or "")) / 10


def examples(k: int = 2) -> list[Example]:
    return [Example(f"What is {i} + {i}?", str(2 * i), {"answer": str(2 * i)}, f"ex{i}") for i in range(k)]


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {})[name]


def run(fn: Any, tok: Any = None, n: int = 2, limits: AgentLimits = AgentLimits(), **kw: Any) -> list[Any]:
    tok = tok or ascii_tokenizer()
    return agent_episode_groups(engine_for(tok), tok, as_agent(fn, "test", {}), examples(), [0, 1], n, [],
                                SamplingParams(temperature=1.0, max_new_tokens=8, n=n), limits, **kw)


def test_a_multi_turn_tool_agent_gives_the_exact_ids_and_masks() -> None:
    SEEN.clear()
    groups = run(two_turns_with_a_tool)
    assert [len(g.samples) for g in groups] == [2, 2] and len(SEEN) == 4
    tok = ascii_tokenizer()
    for g in groups:
        for sample in g.samples:  # the agent's calls that made it (its first reply opens the trajectory)
            (first, second), = [(f, s) for row_id, f, s in SEEN if row_id == g.metadata["id"] and
                                sample.completion.token_ids[: len(extra(f.choices[0], "token_ids"))]
                                == tuple(extra(f.choices[0], "token_ids"))]
            p1, c1 = extra(first, "prompt_token_ids"), extra(first.choices[0], "token_ids")
            p2, c2 = extra(second, "prompt_token_ids"), extra(second.choices[0], "token_ids")
            if {0, 1} & set(c1[:-1] if c1[-1] == 2 else c1):  # pad or <|im_start|> sampled: the text drops it,
                assert len(sample.segments) == 1        # so the resent history differs: a new segment
                continue
            assert p2[: len(p1) + len(c1)] == p1 + c1  # the agent sent the reply back: one segment
            between = p2[len(p1) + len(c1):]
            assert "calculator says" in tok.decode(between)
            c = sample.completion
            assert sample.prompt_ids == tuple(p1) and not sample.segments
            assert c.token_ids == tuple(c1 + between + c2)
            assert c.loss_mask == tuple([1] * len(c1) + [0] * len(between) + [1] * len(c2))
            assert c.turn_index == tuple([0] * len(c1) + [0] * len(between) + [1] * len(c2))
            logprobs = [x.logprob for x in first.choices[0].logprobs.content] if first.choices[0].logprobs else None
            assert logprobs is None  # the agent did not ask; the trajectory still has the engine's
            assert all(lp < 0 for lp, m in zip(c.logprobs, c.loss_mask) if m) and \
                all(lp == 0 for lp, m in zip(c.logprobs, c.loss_mask) if not m)
            assert len(c1) <= 6 and len(c2) <= 5  # the agent's max_tokens, under sampling.max_new_tokens = 8
            assert sample.reward_parts["turns"] == 2.0


async def edits_its_history(client: openai.AsyncOpenAI, row: dict[str, Any]) -> str:
    """Asks, then starts over with a rewritten question: the second call does not extend the first."""
    first = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
    second = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"Again: {row['prompt']} (you said {first.choices[0].message.content!r})"}])
    SEEN.append((first, second))
    return second.choices[0].message.content or ""


def test_an_agent_that_rewrites_its_history_gives_two_segments_scored_by_the_rewards() -> None:
    from rlvr.rewards import build_rewards  # the run's [[rewards]] score a returned answer

    SEEN.clear()
    tok = ascii_tokenizer()
    rewards = build_rewards([{"fn": "tests.test_train:distinct_chars"}])
    groups = agent_episode_groups(engine_for(tok), tok, as_agent(edits_its_history, "test", {}), examples(), [0], 1, rewards,
                                  SamplingParams(temperature=1.0, max_new_tokens=8), AgentLimits())
    sample = groups[0].samples[0]
    first, second = SEEN[0]
    assert len(sample.segments) == 1
    (p1, c1), = sample.segments
    assert p1 == tuple(extra(first, "prompt_token_ids")) and c1.token_ids == tuple(extra(first.choices[0], "token_ids"))
    assert set(c1.loss_mask or ()) <= {1}
    assert sample.prompt_ids == tuple(extra(second, "prompt_token_ids"))
    assert sample.completion.token_ids == tuple(extra(second.choices[0], "token_ids"))
    text = second.choices[0].message.content or ""
    assert sample.reward == pytest.approx(len(set(text)) / 8.0)  # distinct_chars of the returned answer


def test_limits_clip_and_refuse_calls_and_override_the_agents_sampling() -> None:
    outcomes: list[Any] = []

    async def greedy_talker(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
        for _ in range(10):
            try:
                r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}],
                                                         max_tokens=100, temperature=0.0)
                outcomes.append(extra(r.choices[0], "token_ids"))
            except openai.BadRequestError as e:
                outcomes.append(str(e))
                raise
        return 1.0

    groups = run(greedy_talker, n=1, limits=AgentLimits(max_turns=10, max_total_tokens=20))
    assert all(g.metadata["endings"] == ["budget"] for g in groups)  # gave up when its tokens ran out
    sampled = [o for o in outcomes if isinstance(o, list)]
    assert all(len(o) <= 8 for o in sampled)  # sampling.max_new_tokens = 8 beats the agent's 100
    assert len({tuple(o) for o in sampled}) > 1  # temperature 1 (the run's), not the agent's 0
    assert any("env.max_total_tokens" in o for o in outcomes if isinstance(o, str))
    assert all(s.reward == 0.0 and not s.excluded for g in groups for s in g.samples)

    async def asks_for_two(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2)
        return 1.0

    with pytest.raises(AgentError, match="n must be 1 inside an episode"):
        run(asks_for_two)


@pytest.mark.one_precision
def test_failing_agents_are_counted_excluded_and_the_run_goes_on(caplog: Any) -> None:
    async def flaky(client: openai.AsyncOpenAI, row: dict[str, Any]) -> Any:
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
        if row["id"] == "ex1":
            raise KeyError("the agent's own bug")
        return 0.5

    groups = run(flaky)
    assert groups[0].metadata["endings"] == ["done", "done"] and groups[1].metadata["endings"] == ["error", "error"]
    assert all(s.excluded and s.reward_parts.get("env/error") == 1.0 for s in groups[1].samples)
    assert all(not s.excluded and s.reward == 0.5 for s in groups[0].samples)
    assert "2 of 4 agent episodes failed" in caplog.text and "KeyError" in caplog.text and "own bug" in caplog.text

    async def hangs(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
        if row["id"] == "ex1":
            await asyncio.sleep(60)
        return 1.0

    groups = run(hangs, limits=AgentLimits(timeout=3.0))
    assert groups[1].metadata["endings"] == ["timeout", "timeout"] and all(s.excluded for s in groups[1].samples)

    def hangs_in_a_thread(client: openai.OpenAI, row: dict[str, Any]) -> float:  # the timeout holds it too
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
        if row["id"] == "ex1":
            time.sleep(6)
        return 1.0

    groups = run(hangs_in_a_thread, limits=AgentLimits(timeout=3.0))
    assert groups[1].metadata["endings"] == ["timeout", "timeout"]

    def sync_agent(client: openai.OpenAI, row: dict[str, Any]) -> Any:  # a plain function works too
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
        return {"reward": 1} if row["id"] == "ex1" else None  # a dict is not a reward; None scores the text

    groups = run(sync_agent)
    assert groups[1].metadata["endings"] == ["error", "error"] and groups[0].metadata["endings"] == ["done", "done"]

    async def broken(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
        raise ImportError("no module named langgraph")

    with pytest.raises(AgentError, match="every agent episode of this step failed.*langgraph"):
        run(broken)


def agent_for_training(client: openai.OpenAI, row: dict[str, Any]) -> None:
    """Two calls, the second continuing the first; None: the rewards score the last reply."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Sure? Answer again."}]
    client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]


def test_training_runs_an_agent_end_to_end(tmp_path: Path) -> None:
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_train import overrides, read_metrics

    model_dir = tmp_path / "ascii-tiny"  # replies round-trip through text, so each episode is one segment
    tok = ascii_tokenizer()
    make_tiny_model(vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    extra_args = ['env.name="openai_agent"', 'env.kwargs={entry = "tests.test_openai_agent:agent_for_training"}',
                  "env.max_total_tokens=16"]
    before = {k: v.clone() for k, v in make_tiny_model(vocab_size=len(tok)).state_dict().items()}
    train(load_config(None, [*overrides(model_dir, tmp_path, "agent", train__steps=2), *extra_args]), quiet=True)
    rows = read_metrics(tmp_path / "agent")
    assert len(rows) == 2 and rows[-1]["env/turns"] == pytest.approx(2.0)
    assert rows[-1]["env/ending/done"] == pytest.approx(1.0)
    samples = [json.loads(line) for line in (tmp_path / "agent" / "samples.jsonl").read_text().splitlines()]
    # one segment, the agent's follow-up masked; or, where the first reply held a special token
    # (pad or <|im_start|>, which the text drops, so the agent's resent history lacks it), two
    one = [s for s in samples if len(s["masked"]) == 1 and s["masked"][0][2] == "injected" and
           "Answer again" in s["completion"][s["masked"][0][0]:s["masked"][0][1]]]
    two = [s for s in samples if "a new segment" in s["completion"]]
    assert len(one) + len(two) == len(samples) and len(one) > len(samples) / 2
    from rlvr.models import load_model, run_checkpoint

    after = load_model(str(run_checkpoint(tmp_path / "agent")), torch.float32).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the policy moved


def test_bad_agent_config_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_train import overrides

    here = "tests.test_openai_agent"
    for kwargs, message in (("{}", "needs env.kwargs.entry"), (f'{{entry = "{here}:nope"}}', "could not be loaded.*nope"),
                            (f'{{entry = "{here}:agent_for_training", retries = 3}}', "unknown keyword 'retries'"),
                            (f'{{entry = "{here}:agent_for_training", args = {{k = 1}}}}', "takes no keyword k"),
                            (f'{{entry = "{here}:SEEN"}}', "(?s)is a list, not a function.*def run_episode")):
        # a model path that does not exist: the agent's error comes first
        with pytest.raises((ValueError, AgentSignatureError), match=message):
            train(load_config(None, [*overrides(tmp_path / "no-model", tmp_path, "bad"), 'env.name="openai_agent"',
                                     f"env.kwargs={kwargs}"]), quiet=True)


def test_an_openai_agents_sdk_agent_runs_unchanged() -> None:
    """rlvr/configs/agents_sdk_calculator.py: the OpenAI Agents SDK's own loop, tools and requests,
    against rlvr's server on the tiny model."""
    pytest.importorskip("agents")
    from rlvr.configs.agents_sdk_calculator import INSTRUCTIONS, run_episode
    from tests.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    model = make_tiny_model()
    model.config.max_position_embeddings = 4096  # the SDK's tool schemas are ~800 byte tokens
    engine = EmbeddedEngine(model, tok, eos_token_ids=[tok.eos_token_id], seed=0)
    groups = agent_episode_groups(engine, tok, as_agent(run_episode, "test", {}), examples(), [0, 1], 2, [],
                                  SamplingParams(temperature=1.0, max_new_tokens=8, n=2), AgentLimits(max_context=4096))
    for g in groups:
        assert g.metadata["endings"] == ["done", "done"]
        for sample in g.samples:
            prompt = tok.decode(sample.prompt_ids)
            assert INSTRUCTIONS in prompt and '"name": "python"' in prompt and g.prompt in prompt
            assert sample.completion.token_ids and set(sample.completion.loss_mask or {1}) <= {0, 1}



def test_an_episodes_calls_give_it_the_oldest_weights_version_and_where_newer_ones_took_over() -> None:
    """Rollout workers stamp each call's completion with its weights' version: the episode's is the
    oldest (its staleness counts from it), and the later calls' versions are swaps. Joined without
    them, an asynchronous run read every episode as version 0 and dropped it as stale."""
    from rlvr.agents.openai_agent import Call, trajectory
    from rlvr.types import Completion

    tok = ascii_tokenizer()
    a, b, c, d, e, f = tok.convert_tokens_to_ids(list("abcdef"))
    calls = [Call([a, b], Completion((c,), (-0.1,), "stop", "c", policy_version=3)),
             Call([a, b, c, d], Completion((e, f), (-0.2, -0.3), "stop", "ef", policy_version=4, swapped_at=(1,)))]
    (prompt, joined), = trajectory(tok, calls)[0]
    assert prompt == (a, b) and joined.token_ids == (c, d, e, f) and joined.loss_mask == (1, 0, 1, 1)
    assert joined.policy_version == 3 and joined.swapped_at == (2, 3)
    local = [Call(x.prompt_ids, Completion(x.completion.token_ids, x.completion.logprobs, "stop", x.completion.text))
             for x in calls]
    (_, unversioned), = trajectory(tok, local)[0]
    assert unversioned.policy_version is None and unversioned.swapped_at == ()


def test_a_turn_on_the_weights_the_previous_turn_swapped_to_is_no_new_swap() -> None:
    """Partial rollouts: turn 1 starts on version 3 and swaps to 4 at its second token; turn 2,
    all on 4, had been recorded as a second swap because it differed from turn 1's first version."""
    from rlvr.types import Completion, joined_versions

    first = Completion((1, 2), (-0.1, -0.2), "stop", "ab", policy_version=3, swapped_at=(1,))
    same = Completion((3,), (-0.3,), "stop", "c", policy_version=4)
    newer = Completion((4,), (-0.4,), "stop", "d", policy_version=5)
    assert joined_versions([(0, first), (2, same)]) == {"policy_version": 3, "swapped_at": (1,)}
    assert joined_versions([(0, first), (2, same), (3, newer)]) == {"policy_version": 3, "swapped_at": (1, 3)}


def context(**kw: Any) -> EpisodeContext:
    return EpisodeContext(**{"client": "C", "model": "M", "row": {"prompt": "R"}, "base_url": "U", "api_key": "K",
                             "episode_id": "E", **kw})


class RunObject:
    def run(self, client: Any, row: dict[str, Any]) -> Any:
        return ("run", client, row["prompt"])


class CallObject:
    async def __call__(self, client: Any, model: str, row: dict[str, Any]) -> Any:
        return ("call", client, model)


def test_the_agent_signatures_people_write_get_their_context() -> None:
    """The issue's `run_episode(client, model, row, **kw)` and the other common forms, matched by
    name or by position; each bound call returns what it was given."""
    async def three(client: Any, model: str, row: dict[str, Any], **kw: Any) -> Any:
        return client, model, row["prompt"], sorted(kw)

    def renamed(c: Any, r: dict[str, Any]) -> Any:
        return c, r["prompt"]

    def renamed3(c: Any, m: str, r: dict[str, Any]) -> Any:
        return c, m, r["prompt"]

    def by_name(row: dict[str, Any], client: Any, *, base_url: str, model: str = "gpt-4o", level: int = 0) -> Any:
        return row["prompt"], client, base_url, model, level

    def url_only(row: dict[str, Any], base_url: str, api_key: str) -> Any:  # makes its own client
        return row["prompt"], base_url, api_key

    cases = [(three, {}, ("C", "M", "R", ["api_key", "base_url", "episode_id"]), True),
             (three, {"level": 2}, ("C", "M", "R", ["api_key", "base_url", "episode_id", "level"]), True),
             (renamed, {}, ("C", "R"), False), (renamed3, {}, ("C", "M", "R"), False),
             (by_name, {"level": 3}, ("R", "C", "U", "M", 3), False), (url_only, {}, ("R", "U", "K"), False),
             (RunObject(), {}, ("run", "C", "R"), False), (RunObject, {}, ("run", "C", "R"), False),
             (CallObject(), {}, ("call", "C", "M"), True)]
    for fn, args, expected, asynchronous in cases:
        agent = as_agent(fn, "test", args)
        assert agent.asynchronous is asynchronous, fn
        out = agent.call(context())
        assert (asyncio.run(out) if asynchronous else out) == expected, fn


def test_an_agent_rlvr_cannot_call_is_refused_with_the_forms() -> None:
    def one(x: Any) -> None: ...
    def four(a: Any, b: Any, c: Any, d: Any) -> None: ...
    def keyword(client: Any, row: Any, *, judge: Any) -> None: ...
    def no_row(client: Any, model: str) -> None: ...

    class NeedsArgs:
        def __init__(self, path: str) -> None: ...
        def run(self, client: Any, row: Any) -> None: ...

    for fn, args, message in ((one, {}, "cannot tell which"), (four, {}, "cannot tell which"),
                              (keyword, {}, "no value for its keyword judge"), (no_row, {}, "needs the row"),
                              (one, {"x": 1}, "needs the row"), (NeedsArgs, {}, "made with no arguments"),
                              (42, {}, "int, not a function")):
        with pytest.raises(AgentSignatureError, match=message) as raised:
            as_agent(fn, "test", args)
        assert "def run_episode(client, model, row)" in str(raised.value)
    with pytest.raises(AgentSignatureError, match="takes no keyword level"):
        as_agent(RunObject(), "test", {"level": 1})


async def issue_agent(client: openai.AsyncOpenAI, model: str, row: dict[str, Any], **kw: Any) -> float:
    """The issue's agent, verbatim in shape: the model name and keyword context."""
    SEEN.append((model, sorted(kw)))
    reply = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}])
    return float(bool(reply.choices[0].message.content))


def test_the_issues_agent_signature_trains_its_episodes() -> None:
    SEEN.clear()
    groups = run(issue_agent)
    assert all(g.metadata["endings"] == ["done", "done"] for g in groups)
    assert SEEN[0] == ("policy", ["api_key", "base_url", "episode_id"])
    assert all(s.completion.token_ids for g in groups for s in g.samples)


def test_an_agents_sdk_agent_object_runs_unchanged() -> None:
    """A module-level Agents SDK `Agent` (its own model a hosted name): the SDK's Runner runs it
    with the episode's client in its place."""
    pytest.importorskip("agents")
    from rlvr.configs.agents_sdk_calculator import INSTRUCTIONS, calculator
    from tests.tiny import make_tiny_tokenizer

    assert calculator.model == "gpt-4.1-mini"  # what the user wrote, left alone
    tok = make_tiny_tokenizer()
    model = make_tiny_model()
    model.config.max_position_embeddings = 4096  # the SDK's tool schemas are ~800 byte tokens
    engine = EmbeddedEngine(model, tok, eos_token_ids=[tok.eos_token_id], seed=0)
    agent = as_agent(calculator, "test", {}, max_turns=3)
    groups = agent_episode_groups(engine, tok, agent, examples(), [0, 1], 2, [],
                                  SamplingParams(temperature=1.0, max_new_tokens=8, n=2), AgentLimits(max_context=4096))
    for g in groups:
        assert set(g.metadata["endings"]) <= {"done", "max_turns"}
        for sample in g.samples:
            prompt = tok.decode(sample.prompt_ids)
            assert INSTRUCTIONS in prompt and '"name": "python"' in prompt and g.prompt in prompt


def langgraph_agent() -> Any:
    """A LangGraph graph as people write one: nodes calling langchain's ChatOpenAI, which they
    build from the config's `configurable` values (the episode's URL, key and model name)."""
    from langchain_core.runnables import RunnableConfig
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    async def think(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        c = config["configurable"]
        llm = ChatOpenAI(model=c["model"], base_url=c["base_url"], api_key=c["api_key"], max_retries=0)
        return {"messages": [await llm.ainvoke(state["messages"])]}

    def again(state: MessagesState) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": "Check it and answer again."}]}

    graph = StateGraph(MessagesState)
    graph.add_node("think", think)
    graph.add_node("again", again)
    graph.add_node("rethink", think)
    graph.add_edge(START, "think")
    graph.add_edge("think", "again")
    graph.add_edge("again", "rethink")
    graph.add_edge("rethink", END)
    return graph.compile()


def test_a_langgraph_graph_runs_unchanged() -> None:
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    tok = ascii_tokenizer()
    graph = langgraph_agent()
    groups = agent_episode_groups(engine_for(tok), tok, as_agent(graph, "test", {}), examples(), [0, 1], 2, [],
                                  SamplingParams(temperature=1.0, max_new_tokens=8, n=2), AgentLimits())
    extended = 0
    for g in groups:
        assert g.metadata["endings"] == ["done", "done"]
        for sample in g.samples:
            assert g.prompt in tok.decode(sample.prompt_ids)
            if "a new segment" not in sample.completion.text:  # the second call extended the first
                extended += 1
                assert "Check it and answer again." in sample.completion.text
                assert 0 in sample.completion.loss_mask and 1 in sample.completion.loss_mask
    assert extended >= 2  # a new segment only where a reply held a special token the text drops
