"""The engine's prefix cache for the simulator, torch-free: a token radix tree whose steps store,
read, lock and evict as `engine.Engine.step` drives `engine.cache.RadixCache`.

What it keeps and evicts is the engine's, token for token, on the same sequence of steps
(tests/engine/test_sim_radix.py): shared leading tokens are held once, a long request's prefix
steps are a chain of segments (one per step, each extending the last), and eviction frees unlocked
leaves one at a time, the less urgent class first, then never-read, then least recently used,
only as many as the step's stores need; the segments a step reads are locked while it runs. A model of
whole prefixes (one entry per declared prefix, evicted whole) drops a long batch item's every
segment where the engine trims its tail, and counts a template two prompts share twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from po_backend.core.request import common_prefix
from po_backend.sched.batching import BatchStores, Request
from po_backend.sched.eviction import LeafHeap
from po_backend.sched.reuse import Victim
from po_backend.sim.pool import DeclaredPool


class _Node:
    """One edge of the tree: `key`, the token ids it holds (as the engine's `radix.Node`)."""

    __slots__ = ("key", "parent", "children", "lock_ref", "last_access", "uid", "reused", "rank")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, uid: int, now: int, rank: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.lock_ref = 0
        self.last_access = now
        self.uid = uid
        self.reused = False
        self.rank = rank


@dataclass
class _Work:
    """One request of a step (the engine's `_Work`): where it reads from, what it stores."""

    ids: tuple[int, ...]
    rank: int
    store: int
    start: int = 0
    node: _Node | None = None  # the locked end of its cached prefix
    n_store: int = 0  # tokens it got room for (0: nothing stored)
    from_mate: bool = False
    cached_path: int = 0
    hit: int = 0


class RadixLRU(DeclaredPool):
    """A prefix pool of `capacity_tokens` tokens that stores and evicts as the engine's radix
    cache under the "declared" cache policy (only a request's declared prefix is kept), with the
    engine's batching rule (`fit_batch`: a token budget, in-batch prefix sharing). The interface
    of a simulated engine's cache: `cached_len`, `store_len`, `batchable`, `step`, and the
    scheduler's `reuse.Pool` (`free_tokens`, `capacity`, `eviction_order`) and `changes`."""

    def __init__(self, capacity_tokens: int, max_batch_tokens: int = 10**9) -> None:
        super().__init__(capacity_tokens, max_batch_tokens)
        self._uids = itertools.count()
        self._clock = 0  # the engine's operation counter: each read or store is one tick
        self.root = _Node((), None, next(self._uids), 0, 0)
        self._cached = 0  # tokens in the tree
        self._held = 0  # tokens allocated for a running step's stores, not yet in the tree
        self._locked = 0  # tokens in locked nodes
        self._nodes = 0
        self._heap: LeafHeap[_Node] = LeafHeap()

    # ---- what the scheduler reads -------------------------------------------------------------

    def __len__(self) -> int:
        return self._nodes

    def _match(self, req: Request) -> int:
        return self._match_len(tuple(req.input_ids[: req.reusable_len]))

    def free_tokens(self) -> int:
        return self.capacity_tokens - self._cached - self._held

    def cached_tokens(self) -> int:
        return self._cached

    def paths(self) -> set[tuple[int, ...]]:
        """Every cached path from the root to a leaf: what the tree holds."""
        out: set[tuple[int, ...]] = set()
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, path = stack.pop()
            path = path + node.key
            if not node.children and node is not self.root:
                out.add(path)
            stack.extend((c, path) for c in node.children.values())
        return out

    def eviction_order(self) -> Iterator[Victim]:
        """The unlocked nodes in the order eviction frees them (`RadixCache.eviction_order`)."""
        return self._heap.order(self.root, self._path_key)

    # ---- a step -------------------------------------------------------------------------------

    def step(self, reqs: Sequence[Request], ranks: Sequence[int] | None = None) -> list[int]:
        """Run a step as `Engine.step` does: each request reads and locks its cached prefix (or a
        longer one a batch-mate stores in the same forward) and gets room for what it stores,
        evicting as needed (none if even evicting every unlocked leaf would not make it: nothing
        stored); then the stores enter the tree in batch order, the most urgent class's ranks
        are set on what it read or stored, and the locks go. `ranks`: each request's class for
        the cache (`SchedulerConfig.cache_rank`; default all 0). Returns each request's tokens
        read from the cache (a batch-mate's not counted)."""
        ranks = [0] * len(reqs) if ranks is None else list(ranks)
        if len(ranks) != len(reqs):
            raise ValueError(f"{len(reqs)} requests but {len(ranks)} ranks")
        batch: list[_Work] = []
        stores = BatchStores()
        try:
            for i, (r, rank) in enumerate(zip(reqs, ranks, strict=True)):
                w = _Work(tuple(r.input_ids), rank, self.store_len(r))
                batch.append(w)
                limit = r.reusable_len
                n, node = self._read(w.ids[:limit], rank)
                if n:
                    self._lock(node)
                    w.node, w.start = node, n
                w.hit = n
                shared, _ = stores.shared(w.ids, limit)
                if shared > w.start:
                    w.start, w.from_mate = shared, True
                if w.store > w.start and self._alloc(w.store - w.start):
                    w.n_store = w.store - w.start
                    stores.add(w.ids, w.store, i)
            computed = sum(len(w.ids) - w.start for w in batch)
            if len(batch) > 1 and computed > self.max_batch_tokens:
                # A batch-mate got no room for the prefix others were to read from it: the engine
                # runs one forward per request.
                for w in batch:
                    self._release(w)
                return [h for r, k in zip(reqs, ranks, strict=True) for h in self.step([r], [k])]
            for w in batch:
                w.cached_path = w.start
                if w.n_store:
                    self._insert(w.ids[: w.start + w.n_store], w.rank)
                    self._held -= w.n_store
                    w.cached_path, w.n_store = w.start + w.n_store, 0
                if w.from_mate:
                    self._read(w.ids[: w.start], w.rank)
            if len(set(ranks)) > 1:
                top = min(ranks)
                for w in batch:
                    if w.rank == top:
                        self._set_rank(w.ids[: w.cached_path], top)
            return [w.hit for w in batch]
        finally:
            for w in batch:
                self._release(w)

    def _release(self, w: _Work) -> None:
        if w.n_store:
            self._held -= w.n_store
            w.n_store = 0
        if w.node is not None:
            self._unlock(w.node)
            w.node = None

    # ---- the tree (as `RadixCache`) -----------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self, key: tuple[int, ...], parent: _Node, rank: int) -> _Node:
        return _Node(key, parent, next(self._uids), self._clock, rank)

    def _path_key(self, node: _Node) -> tuple[int, ...]:
        parts = []
        cur: _Node | None = node
        while cur is not None:
            parts.append(cur.key)
            cur = cur.parent
        return tuple(itertools.chain.from_iterable(reversed(parts)))

    def _match_len(self, ids: tuple[int, ...]) -> int:
        node, pos = self.root, 0
        while pos < len(ids) and (child := node.children.get(ids[pos])) is not None:
            key = child.key
            if ids[pos : pos + len(key)] != key:
                return pos + common_prefix(key, ids[pos : pos + len(key)])
            pos += len(key)
            node = child
        return pos

    def _split(self, node: _Node, at: int) -> _Node:
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key), f"bad split of {len(node.key)} at {at}"
        upper = self._new_node(node.key[:at], parent, node.rank)
        upper.lock_ref, upper.last_access, upper.reused = node.lock_ref, node.last_access, node.reused
        upper.children[node.key[at]] = node
        parent.children[node.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        self._nodes += 1
        return upper

    def _descend(self, ids: tuple[int, ...], now: int, rank: int, reuse: bool) -> tuple[int, _Node]:
        node, pos = self.root, 0
        node.last_access = now
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = common_prefix(child.key, ids[pos : pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            child.rank = rank
            if reuse:
                child.reused = True
            self._candidate(child)
            node, pos = child, pos + n
        return pos, node

    def _read(self, ids: tuple[int, ...], rank: int) -> tuple[int, _Node]:
        """`RadixCache.match_prefix`: the cached length and its node; the path is touched, marked
        reused and given `rank`."""
        return self._descend(ids, self._tick(), rank, reuse=True)

    def _insert(self, ids: tuple[int, ...], rank: int) -> None:
        pos, node = self._descend(ids, self._tick(), rank, reuse=False)
        if pos < len(ids):
            leaf = self._new_node(ids[pos:], node, rank)
            node.children[ids[pos]] = leaf
            self._changed(ids[: pos + 1])
            self._cached += len(leaf.key)
            self._nodes += 1
            self._candidate(leaf)

    def _set_rank(self, ids: tuple[int, ...], rank: int) -> None:
        node, pos = self.root, 0
        while pos < len(ids) and (child := node.children.get(ids[pos])) is not None:
            n = common_prefix(child.key, ids[pos : pos + len(child.key)])
            if n < len(child.key):
                break
            child.rank = rank
            self._candidate(child)
            node, pos = child, pos + n

    def _lock(self, node: _Node) -> None:
        cur: _Node | None = node
        while cur is not None:
            if cur.lock_ref == 0:
                self._locked += len(cur.key)
            cur.lock_ref += 1
            cur = cur.parent

    def _unlock(self, node: _Node) -> None:
        cur: _Node | None = node
        while cur is not None:
            assert cur.lock_ref > 0, "unlocking below zero"
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._locked -= len(cur.key)
                self._candidate(cur)
            cur = cur.parent

    def _candidate(self, node: _Node) -> None:
        self._heap.file(node, self._nodes)

    def _evict(self, num: int) -> int:
        freed = 0
        while freed < num and (node := self._heap.pop()) is not None:
            parent = node.parent
            assert parent is not None
            self._changed(self._path_key(parent) + node.key[:1])
            del parent.children[node.key[0]]
            node.parent = None
            self._nodes -= 1
            self._cached -= len(node.key)
            freed += len(node.key)
            self._candidate(parent)
        return freed

    def _alloc(self, n: int) -> bool:
        """Room for `n` more tokens, evicting as needed (`RadixCache.alloc`); False (evicting
        nothing) when even the unlocked leaves cannot make it."""
        short = n - self.free_tokens()
        if short > 0:
            if short > self._cached - self._locked:
                return False
            self._evict(short)
        self._held += n
        return True

    def _changed(self, prefix: tuple[int, ...]) -> None:
        self._changes.append(prefix)
        self._memo.clear()
