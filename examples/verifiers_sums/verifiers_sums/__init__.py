"""One-digit sums as a verifiers v1 taskset, packaged the way verifiers environments are (an
installable package whose `__all__` exports its Taskset; its id is the package name).

    pip install -e examples/verifiers_sums
    rlvr train --config verifiers_sums

Each task asks "What is a + b? Answer with just the number." for a pair of digits (the 100 pairs
in a fixed shuffled order, `size` of them); its reward is 1 when the reply's last number is the sum.
"""

import random
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
    size: int = 100
    seed: int = 0


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        pairs = [(a, b) for a in range(10) for b in range(10)]
        random.Random(self.config.seed).shuffle(pairs)
        for k, (a, b) in enumerate(pairs[: self.config.size]):
            yield SumTask(SumData(idx=k, name=f"{a}+{b}", prompt=f"What is {a} + {b}? Answer with just the number.",
                                  answer=str(a + b)), self.config.task)


__all__ = ["SumsTaskset"]
