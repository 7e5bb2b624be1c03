"""A verifiers v1 taskset: one-digit sums, rewarded for the right last number."""

import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        numbers = re.findall(r"-?\d+", str(replies[-1].content or "")) if replies else []
        return float(bool(numbers) and numbers[-1] == task.answer)


class SumsConfig(vf.TasksetConfig):
    size: int = 8


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        for k in range(self.config.size):
            a, b = k % 10, (3 * k + 1) % 10
            yield SumTask(SumData(idx=k, name=f"sum-{k}", prompt=f"What is {a} + {b}? Answer with just the number.",
                                  answer=str(a + b)), self.config.task)


__all__ = ["SumsTaskset"]
