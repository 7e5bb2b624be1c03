"""A verifiers v1 taskset whose tasks come with a calculator, an MCP toolset shared by the taskset."""

import verifiers.v1 as vf
from vf_calc.tools import CalcToolset
from vf_sums import SumData, SumTask


class CalcConfig(vf.TasksetConfig):
    size: int = 4


class CalcTaskset(vf.Taskset[SumTask, CalcConfig]):
    def load(self):
        for k in range(self.config.size):
            a, b = 10 + k, 20 + 2 * k
            yield SumTask(SumData(idx=k, prompt=f"What is {a} + {b}? Use the add tool.", answer=str(a + b)),
                          self.config.task)

    @classmethod
    def toolsets(cls, config):
        return [CalcToolset(vf.SharedToolsetConfig())]


__all__ = ["CalcTaskset"]
