"""MCP tools as an episode's tools (env.kwargs.mcp of tool_math), against a server written with
the `mcp` package's FastMCP (tests/mcp_server.py), over stdio and streamable HTTP: schemas as
listed, results and the server's own errors as the model reads them, and a session that fails
ending the episode without a verdict."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from rlvr.agents import Limits  # noqa: E402
from rlvr.agents.envs import ToolMath  # noqa: E402
from rlvr.agents.mcp_tools import McpSession, mcp_tools  # noqa: E402
from rlvr.agents.runner import ChatDelta, episode_groups  # noqa: E402
from rlvr.data import Example  # noqa: E402
from rlvr.errors import InfrastructureError  # noqa: E402
from rlvr.rewards import build_rewards  # noqa: E402
from rlvr.types import SamplingParams  # noqa: E402
from tests.test_openenv import Scripted  # noqa: E402
from tests.tiny import EOS_ID, make_tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.dtype_independent  # scripted policies: no model

SERVER = str(Path(__file__).with_name("mcp_server.py"))
STDIO = {"command": sys.executable, "args": [SERVER], "timeout": 20}


def test_a_stdio_servers_tools_with_their_schemas_results_and_errors() -> None:
    tools = mcp_tools(STDIO)
    assert list(tools) == ["add", "subtract", "evaluate", "divide", "nap", "die"]
    add = tools["add"]
    assert add.description == "Add two integers." and add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    assert add.schema()["function"]["name"] == "add"
    assert add(a=2, b=40) == "42"
    # the server's own failures are output the model reads, beginning "error:"
    assert tools["divide"](a=1, b=0).startswith("error:") and "division by zero" in tools["divide"](a=1, b=0)
    assert tools["add"](a="x", b=1).startswith("error:")
    # the example's evaluate: sums and differences only, anything else refused
    assert tools["evaluate"](expression="15 - 43") == "-28" and tools["evaluate"](expression="12+30-7") == "35"
    assert all(tools["evaluate"](expression=e).startswith("error:") for e in ["1 * 2", "3 4", "1 +", "__import__('os')"])
    assert mcp_tools(dict(STDIO)) is not tools and mcp_tools(dict(STDIO))["add"](a=1, b=2) == "3"  # one session


def test_a_slow_call_is_an_infrastructure_error_and_the_session_goes_on() -> None:
    session = McpSession({**STDIO, "timeout": 1})
    try:
        with pytest.raises(InfrastructureError, match="did not answer a call to nap within 1 s"):
            session.call("nap", {"seconds": 2.5})
        time.sleep(2.5)
        assert session.call("add", {"a": 1, "b": 1}) == "2"
    finally:
        session.close()


def test_a_server_that_cannot_start_says_what_failed() -> None:
    with pytest.raises(ConnectionError, match="could not be started or reached"):
        McpSession({"command": sys.executable, "args": ["-c", "import sys; sys.exit(1)"], "timeout": 10})
    with pytest.raises(ValueError, match="needs a server"):
        McpSession({"args": ["x"]})


def test_streamable_http() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        session = McpSession({"url": f"http://127.0.0.1:{port}/mcp", "timeout": 20})
        assert session.tools()["add"](a=20, b=22) == "42"
        session.close()
    finally:
        proc.kill()
        proc.wait()


def answer_with_the_tool(context: str) -> str:
    """Call add once, then answer with what it said."""
    if "Output:" in context:
        return "<answer>" + context.rsplit("Output:\n", 1)[1].split("<|im_end|>")[0].strip() + "</answer>"
    return '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_an_episode_calls_the_servers_tool_then_answers() -> None:
    tok = make_tiny_tokenizer()
    rewards = build_rewards([{"fn": "math_verify", "kwargs": {"extract": "tag"}}])
    example = Example("What is 2 + 3?", "5", {"answer": "5"}, "sum/0")
    groups = episode_groups(Scripted(tok, answer_with_the_tool), tok, ToolMath, [example], [0], 2, rewards,
                            SamplingParams(max_new_tokens=128), Limits(max_turns=3, max_turn_tokens=128),
                            ChatDelta(tok), [EOS_ID], kwargs={"mcp": STDIO, "python": False})
    (g,) = groups
    assert g.metadata["endings"] == ["done", "done"] and [s.reward for s in g.samples] == [1.0, 1.0]
    prompt = tok.decode(g.samples[0].prompt_ids)
    assert '- add({"a": {"type": "integer"}, "b": {"type": "integer"}}): Add two integers.' in prompt
    assert "python" not in prompt
    c = g.samples[0].completion
    assert "Output:\n5" in tok.decode([t for t, m in zip(c.token_ids, c.loss_mask) if not m])  # masked


def test_a_server_that_dies_mid_episode_ends_it_without_a_verdict() -> None:
    tok = make_tiny_tokenizer()
    spec = {**STDIO, "timeout": 10, "args": [SERVER, "--dying"]}  # its own session: this one dies
    example = Example("Q", "5", {"answer": "5"}, "q/0")
    groups = episode_groups(Scripted(tok, lambda c: '<tool_call>{"name": "die", "arguments": {}}</tool_call>'), tok,
                            ToolMath, [example], [0], 1, [], SamplingParams(max_new_tokens=128),
                            Limits(max_turns=2, max_turn_tokens=128), ChatDelta(tok), [EOS_ID],
                            kwargs={"mcp": spec, "python": False})
    assert groups[0].metadata["endings"] == ["infra"] and groups[0].samples[0].excluded


def test_training_with_an_mcp_servers_tools(tiny_dir: Path, tmp_path: Path) -> None:
    import torch

    from rlvr.config import load_config
    from rlvr.models import load_model, run_checkpoint
    from rlvr.train.loop import train
    from tests.test_train import overrides, read_metrics

    mcp = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in STDIO.items()) + "}"
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "mcp", train__steps=2), 'env.name="tool_math"',
                             f'env.kwargs={{mcp = {mcp}, python = false, answer = "plain"}}', "env.max_turns=2"])
    train(cfg, quiet=True)
    rows = read_metrics(tmp_path / "mcp")
    assert len(rows) == 2 and rows[-1]["reward_std"] > 0
    before = load_model(str(tiny_dir), torch.float32).state_dict()
    after = load_model(str(run_checkpoint(tmp_path / "mcp")), torch.float32).state_dict()
    assert any(not torch.equal(before[k], after[k].to(before[k].dtype)) for k in before)
