"""Training: the loop (rlvr.train.loop) and its parts.

`rlvr.train` is both this package and the public function that runs a training job
(`rlvr.train.loop.train`, exported from `rlvr`): once anything imports the package, Python binds
the name `rlvr.train` to it, so `rlvr.train(cfg)` calls the package, which runs the job, and
`rlvr.train` is this package from the first access on (rlvr.__getattr__)."""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any


class _Callable(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from rlvr.train.loop import train

        return train(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:  # what inspect.signature shows: the job's own
        from rlvr.train.loop import train

        return inspect.signature(train)


sys.modules[__name__].__class__ = _Callable
