"""A verifiers v1 multi-turn env: the environment answers "Go on." until the model says done."""

import verifiers.v1 as vf
from vf_sums import SumData, SumTask, SumsConfig


class TalkTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        for k in range(self.config.size):
            yield SumTask(SumData(idx=k, prompt=f"What is {k} + {k}?", answer=str(2 * k)), self.config.task)


class TalkConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    turns: int = 5
    fail_on: str = ""
    """A task whose prompt holds this fails in the env's own code (a test's broken environment)."""


class TalkEnv(vf.Env[TalkConfig]):
    async def run(self, task, agents):
        if self.config.fail_on and self.config.fail_on in task.data.prompt_text:
            raise RuntimeError("the environment broke")
        async with agents.agent.interaction(task) as talk:
            reply = await talk.turn()
            for _ in range(self.config.turns - 1):
                if reply.terminated or "done" in reply.last_reply:
                    break
                reply = await talk.turn("Go on.")


__all__ = ["TalkTaskset", "TalkEnv"]
