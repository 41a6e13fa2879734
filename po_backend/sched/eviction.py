"""The radix caches' eviction order, held once for the engine's tree (`engine.cache.RadixCache`)
and the simulator's torch-free copy of it (`sim.radix.RadixLRU`): the scheduler prices admissions
from that order, so both trees must evict alike.

A `LeafHeap` files the unlocked leaves by (less urgent class first, never-read before reused,
least recently used, uid). It is lazy: a node whose key changed (read, ranked, locked, given a
child) is filed again and its older entry goes stale, skipped when it reaches the top.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from po_backend.sched.reuse import Victim


class Leaf(Protocol):
    """What a tree node shows the heap (both trees' nodes have these fields)."""

    key: Any
    parent: Any
    children: dict[Any, Any]
    lock_ref: int
    rank: int
    reused: bool
    last_access: int
    uid: int


N = TypeVar("N", bound=Leaf)

# (-rank, reused, last_access, uid, push count, node): the push count keeps a node filed twice
# from being compared with itself.
Entry = tuple[int, bool, int, int, int, N]


class LeafHeap(Generic[N]):
    def __init__(self) -> None:
        self._heap: list[Entry[N]] = []
        self._pushes = itertools.count()

    def entry(self, node: N) -> Entry[N]:
        return (-node.rank, node.reused, node.last_access, node.uid, next(self._pushes), node)

    @staticmethod
    def is_current(entry: Entry[N]) -> bool:
        """Whether an entry still names an unlocked leaf in the tree with that very key."""
        node = entry[-1]
        return (
            node.parent is not None
            and not node.children
            and node.lock_ref == 0
            and entry[:3] == (-node.rank, node.reused, node.last_access)
        )

    def file(self, node: N, nodes: int) -> None:
        """File `node` if it is an unlocked leaf other than the root (whose parent is None).
        `nodes`: the tree's size; stale entries are dropped once they outnumber it (amortised)."""
        if node.children or node.lock_ref or node.parent is None:
            return
        heapq.heappush(self._heap, self.entry(node))
        if len(self._heap) > 2 * nodes + 64:
            self._heap = self.current()
            heapq.heapify(self._heap)

    def current(self) -> list[Entry[N]]:
        return [e for e in self._heap if self.is_current(e)]

    def pop(self) -> N | None:
        """The next leaf to evict (taken off the heap), or None when none is left."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self.is_current(entry):
                return entry[-1]
        return None

    def clear(self) -> None:
        self._heap = []

    def order(self, root: N, path_key: Callable[[N], tuple[int, ...]]) -> Iterator[Victim]:
        """The unlocked nodes in the order eviction frees them, each a `Victim` (its path's tokens from
        `path_key`, and the depth it starts at); nothing is evicted: a parent joins once its last
        child would be gone. Read from a copy of the heap, lazily: a scheduler pricing an
        admission reads only the first few."""
        heap = self.current()
        heapq.heapify(heap)
        seen: set[int] = set()  # a node filed twice with the same key is yielded once
        left: dict[int, int] = {}  # children not yet evicted, per parent uid
        while heap:
            node = heapq.heappop(heap)[-1]
            if node.uid in seen:
                continue
            seen.add(node.uid)
            key = path_key(node)
            yield Victim(key, len(key) - len(node.key))
            parent = node.parent
            assert parent is not None, "the root is never a victim"
            left[parent.uid] = left.get(parent.uid, len(parent.children)) - 1
            if parent is not root and not left[parent.uid] and parent.lock_ref == 0:
                heapq.heappush(heap, self.entry(parent))
