"""A verifiers v1 Env with a second seat that is not the policy (a critic) but, unpinned, calls the
policy's own endpoint: rlvr must refuse it, since its calls would be trained as the policy's."""

import verifiers.v1 as vf
from vf_talk import TalkTaskset


class DuoConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    critic: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})


class DuoEnv(vf.Env[DuoConfig]):
    async def setup(self, agents):
        agents.critic.trainable = False

    async def run(self, task, agents):
        await agents.agent.run(task)
        await agents.critic.run(task)


__all__ = ["TalkTaskset", "DuoEnv"]
