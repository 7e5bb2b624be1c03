"""Which prompts of one engine call to prefill through a shared prefix.

A multi-turn episode's context is its task prompt plus everything said since, and the G episodes
of a group start from the same prompt. Prefilling every context whole encodes that prompt G times
at every turn: on configs/guess_number.toml, 85% of a step went to prefills (docs/LOG.md). Here
the prompts are cut in two: a prefix shared by a cluster of prompts, encoded once per cluster,
and each prompt's own suffix, encoded after it with the prefix's keys and values.

The clusters are runs of the prompts in sorted order (prompts with a long common prefix sort next
to each other). `plan_prefixes` chooses the cut into runs that saves the most tokens (dynamic
programming over the sorted order), then keeps the plan only if the padded work it leaves is
clearly less than one padded prefill of the whole prompts: prefix and suffix are two batches,
each left-padded to its longest row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

WORTH_BELOW = 0.75
"""Use a plan only if its padded tokens are at most this fraction of the plain prefill's: it
costs a second forward pass and a gather of the prefix's keys and values per prompt."""


@dataclass(frozen=True)
class PrefixPlan:
    prefixes: list[list[int]]
    """One per cluster: the tokens its prompts share, encoded once."""
    owner: list[int]
    """Prompt i's cluster."""

    def cut(self, i: int) -> int:
        """Where prompt i's own suffix begins."""
        return len(self.prefixes[self.owner[i]])


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def plan_prefixes(prompts: Sequence[Sequence[int]], worth_below: float = WORTH_BELOW) -> PrefixPlan | None:
    """A shared-prefix plan for ``prompts``, or None where sharing would not clearly pay.

    Every prompt keeps at least its last token in its suffix (the next-token logits come from
    the suffix pass), so identical prompts share all but their last token."""
    n = len(prompts)
    if n < 2:
        return None
    order = sorted(range(n), key=lambda i: tuple(prompts[i]))
    # longest usable prefix shared by sorted neighbours j-1 and j
    link = [0] + [min(_common(prompts[order[j - 1]], prompts[order[j]]),
                      len(prompts[order[j - 1]]) - 1, len(prompts[order[j]]) - 1) for j in range(1, n)]
    # best[j]: most tokens saved by runs over order[:j]; a run order[i:j] of common prefix c saves (j - i - 1)·c
    best, start = [0] * (n + 1), [0] * (n + 1)
    for j in range(1, n + 1):
        best[j], start[j] = best[j - 1], j - 1  # order[j - 1] alone
        common = None
        for i in range(j - 2, -1, -1):  # the run order[i:j], i < j - 1
            common = link[i + 1] if common is None else min(common, link[i + 1])
            if common == 0:
                break
            if best[i] + (j - i - 1) * common > best[j]:
                best[j], start[j] = best[i] + (j - i - 1) * common, i
    if best[n] == 0:
        return None
    prefixes: list[list[int]] = []
    owner = [0] * n
    j = n
    while j > 0:
        i = start[j]
        members = order[i:j]
        common = min(link[k] for k in range(i + 1, j)) if j - i > 1 else len(prompts[members[0]]) - 1
        for m in members:
            owner[m] = len(prefixes)
        prefixes.append(list(prompts[members[0]][:common]))
        j = i
    if any(not p for p in prefixes):  # a one-token prompt alone: nothing to share, no prefix to encode
        return None
    plan = PrefixPlan(prefixes, owner)
    shared = len(prefixes) * max(len(p) for p in prefixes) + n * max(len(prompts[i]) - plan.cut(i) for i in range(n))
    plain = n * max(len(p) for p in prompts)
    return plan if shared <= worth_below * plain else None


STORE_BYTES = 2 * 1024**3
"""`PrefixStore`'s bound on the keys and values it keeps; the oldest calls' go first."""

IDLE_CALLS = 4
"""A stored batch none of whose rows was taken in this many calls is dropped: its episodes have
ended (the runner makes one call per distinct token budget in a turn, so a turn is a few calls)."""


@dataclass
class _Batch:
    """One prefill's keys and values (per layer, P × kv heads × T × head dim, left-padded as
    ``mask_PT``) and which prompt each row holds, by its tokens."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask_PT: torch.Tensor
    rows: dict[tuple[int, ...], int]
    used: int
    """The store's call count when it was stored or a row was last taken."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass(frozen=True)
class Stored:
    """A prompt's longest stored prefix: row ``row`` of ``batch``, ``length`` tokens."""
    batch: _Batch
    row: int
    length: int


class PrefixStore:
    """The keys and values of prompts the engine prefilled, for later prompts that extend them:
    an episode's next context is its last context, the action sampled from it and the
    environment's answer, so only those two are encoded again. The caller opens it for a run of
    calls (`EmbeddedEngine.reusing_prefixes`, around a multi-turn rollout) and it is emptied when
    closed or when the weights change (they key the stored values). A stored prompt is handed out
    once: its extension is stored in its place. Batches idle for `IDLE_CALLS` calls are dropped,
    and the oldest go first past ``budget_bytes``."""

    def __init__(self, budget_bytes: int = STORE_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.batches: list[_Batch] = []
        self.weights_key: object = None
        self.calls = 0
        self.too_big_warned = False

    def check_weights(self, key: object) -> None:
        """Forget everything stored under other weights."""
        if key != self.weights_key:
            self.batches, self.weights_key = [], key

    def take(self, prompt: Sequence[int]) -> Stored | None:
        """The longest stored proper prefix of ``prompt`` (at least its last token is left to
        encode), removed from the store; None if there is none."""
        lengths = sorted({len(key) for b in self.batches for key in b.rows if len(key) < len(prompt)}, reverse=True)
        for length in lengths:
            key = tuple(prompt[:length])
            for batch in self.batches:
                row = batch.rows.pop(key, None)
                if row is not None:
                    batch.used = self.calls
                    return Stored(batch, row, length)
        return None

    def put(self, prompts: Sequence[Sequence[int]], keys: list[torch.Tensor], values: list[torch.Tensor],
            mask_PT: torch.Tensor) -> None:
        """Keep one prefill's keys and values (references, not copies: nobody writes to them)."""
        self.calls += 1
        self.batches = [b for b in self.batches if b.rows and self.calls - b.used < IDLE_CALLS]
        batch = _Batch(keys, values, mask_PT, {tuple(p): i for i, p in enumerate(prompts)}, self.calls)
        if batch.nbytes > self.budget_bytes:
            if not self.too_big_warned:
                log.warning("one call's keys and values (%.1f GB) exceed the prefix store's %.1f GB: turns of "
                            "this rollout encode their whole contexts", batch.nbytes / 1e9, self.budget_bytes / 1e9)
                self.too_big_warned = True
            return
        self.batches.append(batch)
        while sum(b.nbytes for b in self.batches) > self.budget_bytes:
            self.batches.pop(0)
