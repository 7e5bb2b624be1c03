"""A verifiers v1 taskset: one-digit sums in a fixed order the tests know, each the packaged
example's Task (examples/verifiers_sums: rewarded for the right last number)."""

import verifiers.v1 as vf
from verifiers_sums import SumData, SumTask


class SumsConfig(vf.TasksetConfig):
    size: int = 8


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        for k in range(self.config.size):
            a, b = k % 10, (3 * k + 1) % 10
            yield SumTask(SumData(idx=k, name=f"sum-{k}", prompt=f"What is {a} + {b}? Answer with just the number.",
                                  answer=str(a + b)), self.config.task)


__all__ = ["SumsTaskset"]
