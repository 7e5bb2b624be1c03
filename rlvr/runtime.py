"""Process-wide settings that make PyTorch on CPU faster, applied by rlvr's entry points.

`keep_freed_memory()`: glibc's malloc serves large requests (above 128 kB, adapting up to 32 MB)
with fresh `mmap` regions and gives them back on `free`. A training step allocates and frees
the same big tensors (activations, [chunk, vocabulary] logits, gradients) again and again, and
every fresh region costs one page fault per 4 kB page when first written: 49,152 faults for one
200 MB tensor, which made an `exp` over it take 67 ms instead of 21. Telling malloc to take
everything from its heap and never trim it lets freed memory be reused without faulting. On the
bundled model this made a learner update 1.3-1.5x faster (docs/LOG.md). The cost: the process
keeps its peak memory mapped until it exits (peak RSS is unchanged).

It also keeps glibc to one arena. Each thread that allocates would otherwise get an arena of its
own, and with trimming off each arena keeps its own peak. The rollout server's engine thread
(rlvr.serve) sampling beside the learner's main thread then held two peaks. An agent run
(configs/openai_agent.toml) reached 13.3 GB by its 8th step with the default arenas, and 6.1 GB
with one, at the same speed; a learner update ran at the same speed either way (docs/LOG.md).

Set RLVR_MALLOC_TUNING=0 to leave malloc alone.
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


def keep_freed_memory() -> bool:
    """Make glibc malloc reuse freed memory instead of unmapping it; True if it was applied."""
    global _applied
    if _applied:
        return True
    if os.environ.get("RLVR_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)) \
        and bool(mallopt(_M_ARENA_MAX, 1))
    return _applied
