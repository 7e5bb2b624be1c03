"""A black-box agent written with the OpenAI Agents SDK (`pip install openai-agents`), trained by
rlvr as it is, in either of two forms (docs/interop.md):

- `run_episode`, a function: `env.name = "openai_agent"` calls it once per episode with a client
  pointed at rlvr's server (`rlvr train --config configs/openai_agent.toml`);
- `calculator`, the SDK's `Agent` object as a user defines it for a hosted model: with
  `env.kwargs.entry = "rlvr.configs.agents_sdk_calculator:calculator"`, rlvr runs it with the SDK's
  Runner, the episode's client standing in for the model it names.

The agent has one tool, a sandboxed Python interpreter (rlvr.agents.tools.PythonInterpreter),
and answers arithmetic questions. Nothing here knows about rlvr's training: the SDK sends its
chat completions to whatever client it is given, and rlvr builds the trajectory from the token
ids of those calls.
"""

from __future__ import annotations

from typing import Any

from agents import Agent, function_tool

INSTRUCTIONS = "You are a careful calculator. You may run Python with the python tool. Reply with just the number."


async def run_episode(client: Any, row: dict[str, Any]) -> str:
    """One episode: the SDK's agent loop on the row's question; the final output is the answer
    (a string, which the run's [[rewards]] score against the row)."""
    from agents import Agent, MaxTurnsExceeded, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
    from agents import set_tracing_disabled

    from rlvr.agents.tools import PythonInterpreter

    set_tracing_disabled(True)  # no trace export: nothing leaves the machine
    interpreter = PythonInterpreter()

    @function_tool
    def python(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: the program; print the result.
        """
        return interpreter.run(code)

    agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[python],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(max_tokens=64))
    try:
        result = await Runner.run(agent, row["prompt"], max_turns=3)
    except MaxTurnsExceeded:  # the policy kept calling the tool: no answer, reward 0
        return ""
    return str(result.final_output)


@function_tool
def python(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: the program; print the result.
    """
    from rlvr.agents.tools import PythonInterpreter

    return PythonInterpreter().run(code)


calculator = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[python], model="gpt-4.1-mini")
