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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_applied = False
_one_arena = False


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
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    if not _applied:
        _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    if _applied and one_arena:
        _one_arena = bool(mallopt(_M_ARENA_MAX, 1))
    return _applied


def one_arena_applied() -> bool:
    """Whether malloc is kept to one arena in this process."""
    return _one_arena
