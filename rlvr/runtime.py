"""Process-wide settings that make PyTorch on CPU faster, applied by rlvr's entry points.

`keep_freed_memory()`: glibc's malloc serves large requests (above 128 kB, adapting up to 32 MB)
with fresh `mmap` regions and gives them back on `free`. A training step allocates and frees
the same big tensors (activations, [chunk, vocabulary] logits, gradients) again and again, and
every fresh region costs one page fault per 4 kB page when first written: 49,152 faults for one
200 MB tensor, which made an `exp` over it take 67 ms instead of 21. Telling malloc to take
everything from its heap and never trim it lets freed memory be reused without faulting. On the
bundled model this made a learner update 1.3-1.5x faster (docs/LOG.md). The cost: the process
keeps its peak memory mapped until it exits (peak RSS is unchanged).

`keep_freed_memory(one_arena=True)` also keeps glibc to one arena, for runs whose episodes go
through rlvr's OpenAI-compatible server in this process (env "openai_agent", "verifiers"). Each
thread that allocates would otherwise get an arena of its own, and with trimming off each arena
keeps its own peak: the server's engine thread sampling beside the learner's main thread held
two. An agent run (configs/openai_agent.toml) reached 13.3 GB by its 8th step with the default
arenas, and 6.1 GB with one, at the same speed. Other runs keep the default arenas: with bf16 on
two threads, oneDNN's worker thread allocates beside the main one, and one arena made them take
turns: a learner update took 13.5 s with the default arenas and 15.5 s with one (means of
three, Zen 4 EPYC; docs/LOG.md, sessions 13-14). The cap has
to come before those threads first allocate, so `rlvr.train.setup.setup` asks for it first thing.

Set RLVR_MALLOC_TUNING=0 to leave malloc alone, or RLVR_MALLOC_TUNING=one_arena to cap the
arenas in every run (an environment of your own that serves the policy from a thread).

`HeapWatch`: with trimming off, a heap that is never given back also fragments. When the tensors'
sizes change from step to step (completions of varying length, a curriculum's mixed prompts),
freed blocks do not fit the next requests and the heap grows: a 20-minute GRPO run on the bundled
model grew from 4.4 GB to 9.5 GB, and `malloc_trim(0)` in a 7.3 GB run gave back 4.0 GB (it was
free memory, not a leak; docs/LOG.md, session 27). Four such runs filled 24 GB. The watch reads the
resident size after every step and trims once it has grown well past the size the first steps
settled at, so a steady run pays nothing and a fragmenting one pays one round of page faults now
and then instead of growing without bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_applied = False
_one_arena = False
log = logging.getLogger(__name__)


@functools.cache
def _libc() -> Any:
    """The C library, looked up once (`find_library` runs ldconfig); None where it is not found."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def keep_freed_memory(one_arena: bool = False) -> bool:
    """Make glibc malloc reuse freed memory instead of unmapping it, and with `one_arena` (or
    RLVR_MALLOC_TUNING=one_arena) keep it to one arena; True if it was applied. A later call can
    add the arena cap to an earlier call's tuning."""
    global _applied, _one_arena
    setting = os.environ.get("RLVR_MALLOC_TUNING", "1")
    if setting == "0" or not sys.platform.startswith("linux"):
        return False
    one_arena = one_arena or setting == "one_arena"
    if _applied and (_one_arena or not one_arena):
        return True
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # no C library found, or not glibc (e.g. musl has no mallopt)
        return False
    if not _applied:
        _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    if _applied and one_arena:
        _one_arena = bool(mallopt(_M_ARENA_MAX, 1))
    return _applied


def one_arena_applied() -> bool:
    """Whether malloc is kept to one arena in this process."""
    return _one_arena


def resident_bytes() -> int | None:
    """This process's resident memory from /proc (None where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def give_back_freed_memory() -> bool:
    """Return the free pages of the heap to the system (glibc's malloc_trim(0)); False where there is
    none to give, or no glibc."""
    trim = getattr(_libc(), "malloc_trim", None)  # glibc's; None elsewhere
    return bool(trim(0)) if trim is not None else False


class HeapWatch:
    """Gives freed heap memory back to the system when fragmentation has grown the process (see the
    module docstring). After ``settle`` steps the resident size is the baseline: the model, the
    optimizer state and the heap a step reuses. After each later step, if the process holds more
    than ``max(grow_bytes, grow_fraction × baseline)`` above it, ``malloc_trim(0)`` returns the free
    pages, and the baseline becomes the larger of itself and the size after the trim (memory the
    run really keeps, such as a replay buffer, then stops triggering trims). Does nothing unless
    `keep_freed_memory` turned trimming off, or where glibc or /proc is missing."""

    def __init__(self, settle: int = 3, grow_bytes: int = 1 << 30, grow_fraction: float = 0.5,
                 trim: Callable[[], bool] = give_back_freed_memory, resident: Callable[[], int | None] = resident_bytes,
                 active: bool | None = None) -> None:
        self.settle, self.grow_bytes, self.grow_fraction = settle, grow_bytes, grow_fraction
        self.trim, self.resident = trim, resident
        self.active = _applied if active is None else active
        self.steps = 0
        self.baseline: int | None = None
        self.trims = 0

    def after_step(self) -> dict[str, float]:
        """Call once per training step; returns the step's memory metrics: ``memory_gb`` (resident
        size, after any trim) and, on a step that trimmed, ``memory_released_gb``."""
        now = self.resident()
        if now is None:
            return {}
        self.steps += 1
        out = {"memory_gb": now / 1e9}
        if not self.active:
            return out
        if self.steps == self.settle:
            self.baseline = now
        elif self.baseline is not None and now - self.baseline > max(self.grow_bytes,
                                                                     self.grow_fraction * self.baseline):
            if self.trim():
                after = self.resident() or now
                self.trims += 1
                if self.trims == 1:
                    log.info("the heap grew from %.1f to %.1f GB (fragmentation, with malloc's trimming off for "
                             "speed): gave %.1f GB back, as it will whenever it grows this far again",
                             self.baseline / 1e9, now / 1e9, (now - after) / 1e9)
                self.baseline = max(self.baseline, after)
                out = {"memory_gb": after / 1e9, "memory_released_gb": (now - after) / 1e9}
        return out
