"""Which request holds which KV-cache slot, and which slot already holds a prompt's prefix.

Pure bookkeeping (no torch): the torch engine asks ``SlotTable`` where to put a new
request and where its prompt's keys and values can be copied from, then does the copies
and the prefill itself.

A slot is one row of the engine's static KV cache (``roles.inference.model_runner``):
``max_len`` positions of one sequence. The table remembers, for every slot, the tokens
whose keys and values its first columns hold (``content``): a live row's prompt (minus
its last token, which the first decode step feeds), and once the row has finished, its
prompt and completion (minus the last token, never fed). A finished row's slot is free
but keeps that content until it is taken, so:

- a GRPO group's rollouts, which share one prompt, prefill it once: the first takes a
  free slot and is prefilled; each other one takes its own slot and copies the first's
  columns (``Placement.source``), whether it arrived in the same admission round or
  later while the first decodes;
- a multi-turn rollout's next turn, whose prompt starts with the previous turn's prompt
  and completion, goes back into the very slot that turn finished in (when it is still
  free) and prefills only the new tokens.

Lookup: every full block of ``BLOCK`` tokens of a slot's content is indexed by a chained
hash of the blocks up to it, plus the exact content as a whole; a prompt walks its
blocks to the deepest one some slot shares (checked token by token, so a hash collision
costs nothing but a miss), then extends the match token by token. A new request shares
at most ``len(prompt) - 1`` tokens: the last prompt token is always fed by a decode step.

New requests take the lowest free slot, so live rows stay packed at the front and the
decode step's batch ``[0, b)`` stays small; a free slot that holds the prefix is then a
copy source (reserved until the engine has copied from it: ``settle``), unless it is
that lowest slot itself (nothing to copy). A weights swap makes every kept content stale
(``forget``): keys and values depend on the weights.

    table = SlotTable(slots=64)
    p = table.place(prompt)            # Placement(slot, source, shared)
    ...                                # copy p.shared columns from p.source, prefill the rest
    table.release(p.slot, prompt + completion[:-1])
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK = 16  # tokens per indexed block


@dataclass(frozen=True)
class Placement:
    """Where a new request goes: its ``slot``, and the slot (``source``, possibly the same
    one, or None) whose first ``shared`` columns already hold its prompt's prefix."""

    slot: int
    source: int | None
    shared: int


def _chain(tokens: Sequence[int], blocks: int) -> list[int]:
    """Chained hashes of the first ``blocks`` full blocks of ``tokens``."""
    out, h = [], 0
    for i in range(blocks):
        h = hash((h, *tokens[i * BLOCK : (i + 1) * BLOCK]))
        out.append(h)
    return out


def common_prefix(
    a: Sequence[int], b: Sequence[int], start: int = 0, limit: int | None = None
) -> int:
    """Length of the common prefix of ``a`` and ``b`` (checked from ``start``), at most ``limit``."""
    n = min(len(a), len(b), limit if limit is not None else len(a))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotTable:
    """Slots of the KV cache: free or live, what each holds, where a prompt's prefix is."""

    def __init__(self, slots: int, *, share_prefixes: bool = True) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.share_prefixes = share_prefixes  # False: every prompt is prefilled (benchmarks)
        self.content: list[list[int]] = [[] for _ in range(slots)]
        self.live = [False] * slots
        self._free = list(range(slots))  # a min-heap of free slots
        self._blocks: dict[int, set[int]] = {}  # chained block hash -> slots holding it
        self._keys: list[list[int]] = [[] for _ in range(slots)]  # each slot's hashes
        self._whole: dict[tuple[int, ...], set[int]] = {}  # exact content -> slots
        self._reserved: set[int] = set()  # free slots a pending copy reads from

    @property
    def free(self) -> int:
        """Free slots a new request may take now."""
        return len(self._free) - len(self._reserved)

    @property
    def highest_live(self) -> int:
        """The highest live slot index, or -1 when none is live."""
        return max((i for i, x in enumerate(self.live) if x), default=-1)

    # -- content and its index ------------------------------------------------------------

    def _set_content(self, slot: int, tokens: Sequence[int]) -> None:
        old = self.content[slot]
        if old:
            self._whole.get(tuple(old), set()).discard(slot)
        for h in self._keys[slot]:
            self._blocks.get(h, set()).discard(slot)
        tokens = list(tokens)
        self.content[slot] = tokens
        self._keys[slot] = _chain(tokens, len(tokens) // BLOCK)
        for h in self._keys[slot]:
            self._blocks.setdefault(h, set()).add(slot)
        if tokens:
            self._whole.setdefault(tuple(tokens), set()).add(slot)

    def best_source(self, prompt: Sequence[int]) -> tuple[int | None, int]:
        """(slot, shared) holding the longest prefix of ``prompt[:-1]``; (None, 0) if none."""
        limit = len(prompt) - 1
        if limit <= 0 or not self.share_prefixes:
            return None, 0
        exact = self._whole.get(tuple(prompt[:limit]))
        if exact:
            return self._prefer_free(exact), limit
        best, shared = None, 0
        for depth, h in enumerate(_chain(prompt, limit // BLOCK), start=1):
            held = [
                s
                for s in self._blocks.get(h, ())
                if self.content[s][: depth * BLOCK] == list(prompt[: depth * BLOCK])
            ]
            if not held:
                break
            best, shared = held, depth * BLOCK
        if best is None:
            return None, 0
        # Extend by whole tokens past the deepest shared block; prefer a free slot on ties.
        scored = [
            (common_prefix(self.content[s], prompt, shared, limit), not self.live[s], -s)
            for s in best
        ]
        n, _, neg = max(scored)
        return -neg, n

    def _prefer_free(self, slots: set[int]) -> int:
        free = [s for s in slots if not self.live[s]]
        return min(free) if free else min(slots)

    # -- placing and releasing ------------------------------------------------------------

    def place(self, prompt: Sequence[int]) -> Placement:
        """Take a slot for a new request with ``prompt`` (the caller checked ``free``)."""
        if self.free <= 0:
            raise RuntimeError("no free slot")
        source, shared = self.best_source(prompt)
        reserved = []  # the lowest free slot that no pending copy reads from
        while (slot := heapq.heappop(self._free)) in self._reserved:
            reserved.append(slot)
        for s in reserved:
            heapq.heappush(self._free, s)
        if source is not None and source != slot and not self.live[source]:
            self._reserved.add(source)  # a free slot to copy from: nobody takes it yet
        self.live[slot] = True
        # The slot now holds the source's prefix (copied or kept) and, once prefilled, the
        # rest of the prompt but its last token.
        self._set_content(slot, list(prompt[: len(prompt) - 1]))
        return Placement(slot, source, shared)

    def settle(self) -> None:
        """The pending copies are done: reserved sources may be taken again."""
        self._reserved.clear()

    def release(self, slot: int, content: Sequence[int]) -> None:
        """A row finished: free its slot, which keeps ``content`` (tokens in its cache)."""
        if not self.live[slot]:
            raise RuntimeError(f"slot {slot} is not live")
        self.live[slot] = False
        self._set_content(slot, content)
        heapq.heappush(self._free, slot)

    def forget(self, live_too: bool = False) -> None:
        """Drop every free slot's content (its keys and values came from old weights);
        with ``live_too`` the live rows' prompts as well (a swap while they decode)."""
        for slot in range(self.slots):
            if live_too or not self.live[slot]:
                self._set_content(slot, [])
