"""Token-level radix tree mapping token-id prefixes to KV pool slots (SGLang RadixAttention style).

Ownership: every slot is either free in the pool, held by exactly one tree node, or held by a
caller (allocated and not yet inserted). `check_integrity` verifies that partition.

Eviction reads a heap of the unlocked leaves kept up to date as nodes change (an entry is pushed
whenever a node becomes an unlocked leaf or its eviction key changes; stale entries are skipped
when popped and dropped by a rebuild once they outnumber the live ones), so an allocation that
must evict costs O(log n) per victim, not a walk of the whole tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from po_backend.core.errors import CacheInUseError
from po_backend.engine.cache.kv_pool import KVPool
from po_backend.sched.eviction import LeafHeap
from po_backend.sched.reuse import Victim

_EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


class Node:
    """One edge of the tree: `key` (token ids) and the slots holding their KV, index for index."""

    __slots__ = (
        "key",
        "slots",
        "parent",
        "children",
        "lock_ref",
        "last_access",
        "uid",
        "reused",
        "rank",
        "_key_tuple",
    )

    def __init__(
        self, key: np.ndarray, slots: torch.Tensor, parent: Node | None, uid: int, now: int, rank: int = 0
    ) -> None:
        self.key = key  # int64, never mutated (splits take views)
        self.slots = slots  # int64 CPU tensor, len(slots) == len(key)
        self.parent = parent
        self.children: dict[int, Node] = {}  # keyed by the child's first token
        self.lock_ref = 0  # running requests whose prefix passes through this node
        self.last_access = now
        self.uid = uid  # creation order: a deterministic heap tie-breaker
        # Read since it was stored. Within a class, never-reused nodes are evicted first: most
        # are the unique tail of a prompt stored on speculation (a post after a profile), while
        # a reused node is a profile or document others come back to.
        self.reused = False
        # The priority class (scheduler rank: 0 online, higher less urgent) of the request that
        # last stored or read it (of a step's requests, the most urgent: the engine's step sets
        # that after its inserts). Less urgent ones are evicted first, whatever their reuse: a
        # batch job's prefix is read back by its own later steps, and reuse first would keep it
        # over a profile an online call stored and its user has not read again yet. A batch
        # prefix an online call reads is kept like an online one from then on.
        self.rank = rank
        self._key_tuple: tuple[int, ...] | None = None

    def key_tuple(self) -> tuple[int, ...]:
        """`key` as a tuple of ints, made on first use: the scheduler probes every waiting request
        (a tuple of ids) each step, and comparing tuple slices costs far less than converting each
        whole prompt to an array."""
        if self._key_tuple is None:
            self._key_tuple = tuple(self.key.tolist())
        return self._key_tuple

    def set_key(self, key: np.ndarray, slots: torch.Tensor) -> None:
        self.key, self.slots, self._key_tuple = key, slots, None

    def __repr__(self) -> str:
        return (
            f"Node(uid={self.uid}, len={len(self.key)}, lock_ref={self.lock_ref}, "
            f"reused={self.reused}, rank={self.rank}, children={len(self.children)})"
        )


class MatchResult(NamedTuple):
    length: int  # matched tokens
    slots: torch.Tensor  # int64 slots of the matched prefix, in token order
    node: Node  # deepest node; its path from the root covers exactly `length` tokens


class InsertResult(NamedTuple):
    prefix_len: int  # leading tokens that were already cached
    node: Node  # node ending exactly at the end of the inserted tokens


@dataclass(frozen=True)
class CacheStats:
    total_slots: int
    free_slots: int
    cached_tokens: int
    evictable_tokens: int
    locked_tokens: int
    reused_tokens: int  # cached tokens read since they were stored (the rest: stored on speculation)
    evicted_tokens_total: int
    inserted_tokens_total: int


def _as_tokens(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.cpu().numpy()
    tokens = np.asarray(token_ids, dtype=np.int64)
    assert tokens.ndim == 1, f"token ids must be 1-D, got shape {tokens.shape}"
    return tokens


def _common_len(key: np.ndarray, tokens: np.ndarray) -> int:
    """Length of the common prefix of `key` and `tokens` (vectorised: prompts are ~10k tokens)."""
    m = min(len(key), len(tokens))
    diff = np.flatnonzero(key[:m] != tokens[:m])
    return int(diff[0]) if len(diff) else m


# The most changes the log keeps: a reader further behind is told that anything may have changed.
MAX_CHANGES = 4096


class RadixCache:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._uids = itertools.count()
        self._clock = 0  # monotonic operation counter for LRU, not wall time: deterministic
        self.root = self._new_node(np.empty(0, dtype=np.int64), _EMPTY_SLOTS, None)
        self._evictable = 0  # tokens in unlocked nodes
        self._protected = 0  # tokens in locked nodes
        self._reused = 0  # tokens in reused nodes
        self.evicted_tokens_total = 0
        self.inserted_tokens_total = 0
        self._nodes_count = 0  # nodes in the tree, the root excluded: bounds the heap's size
        self._heap: LeafHeap[Node] = LeafHeap()  # the unlocked leaves in eviction order
        # The changes to match lengths, numbered from `_log_base` (`changes_since`); a reader
        # behind `_log_floor` (a reset, or changes dropped from the log) rereads everything.
        self._log: list[tuple[int, ...]] = []
        self._log_base = self._log_floor = 0

    def _new_node(self, key: np.ndarray, slots: torch.Tensor, parent: Node | None, rank: int = 0) -> Node:
        return Node(key, slots, parent, next(self._uids), self._clock, rank)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookup / insert ------------------------------------------------------------------

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node`'s key at `at` (0 < at < len); return the new upper node ending there."""
        assert 0 < at < len(node.key), f"split point {at} outside (0, {len(node.key)})"
        parent = node.parent
        assert parent is not None, "cannot split the root"
        upper = self._new_node(node.key[:at], node.slots[:at], parent, node.rank)
        # The upper part lies on every path the lower one does, so it inherits its locks.
        upper.lock_ref, upper.last_access, upper.reused = node.lock_ref, node.last_access, node.reused
        upper.children[int(node.key[at])] = node
        parent.children[int(node.key[0])] = upper
        node.set_key(node.key[at:], node.slots[at:])
        node.parent = upper
        self._nodes_count += 1
        return upper

    def _descend(
        self, tokens: np.ndarray, now: int, rank: int, reuse: bool = False
    ) -> tuple[int, Node, list[torch.Tensor]]:
        """Walk down as far as `tokens` match, splitting the last node at the match end; `reuse`
        marks the matched nodes as reused; each takes `rank` (the class that read it last)."""
        node, pos, parts = self.root, 0, []
        node.last_access = now
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            n = _common_len(child.key, tokens[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            child.rank = rank
            if reuse and not child.reused:
                child.reused = True
                self._reused += len(child.key)
            self._candidate(child)  # its eviction key changed
            parts.append(child.slots)
            node, pos = child, pos + n
        return pos, node, parts

    def match_prefix(
        self, token_ids: Sequence[int] | np.ndarray | torch.Tensor, rank: int = 0
    ) -> MatchResult:
        """Longest cached prefix of `token_ids`; marks its path as recently used and reused, and
        as last read by priority class `rank` (see `Node.rank`)."""
        pos, node, parts = self._descend(_as_tokens(token_ids), self._tick(), rank, reuse=True)
        return MatchResult(pos, torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64), node)

    def match_len(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> int:
        """Read-only probe of the cached prefix length: no split, no LRU touch, no slot gather.

        For a scheduler that re-scores every waiting request before each step: a request's ids
        (a tuple) are compared with each node's key as tuple slices, far cheaper than converting
        the whole prompt to an array at every probe; other inputs are converted to a tuple once.
        """
        ids = token_ids if isinstance(token_ids, tuple) else tuple(_as_tokens(token_ids).tolist())
        node, pos = self.root, 0
        while pos < len(ids) and (child := node.children.get(ids[pos])) is not None:
            key = child.key_tuple()
            if ids[pos : pos + len(key)] != key:  # the match ends inside this node
                return pos + _common_len(child.key, _as_tokens(ids[pos : pos + len(key)]))
            pos += len(key)
            node = child
        return pos

    def set_rank(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor, rank: int) -> None:
        """Give the nodes that `token_ids` cover whole priority class `rank` (see `Node.rank`),
        as if it had read them last, without touching recency or the reuse mark: for a prefix
        that items of several classes read in one forward, which keeps the most urgent's."""
        tokens, node, pos = _as_tokens(token_ids), self.root, 0
        while pos < len(tokens) and (child := node.children.get(int(tokens[pos]))) is not None:
            n = _common_len(child.key, tokens[pos:])
            if n < len(child.key):
                break  # the node goes on past these tokens: others' too
            child.rank = rank
            self._candidate(child)
            node, pos = child, pos + n

    def insert(
        self, token_ids: Sequence[int] | np.ndarray | torch.Tensor, slots: torch.Tensor, rank: int = 0
    ) -> InsertResult:
        """Cache `token_ids` with their KV in `slots`, stored by priority class `rank`; the tree
        owns the new tokens' slots after.

        For the already-cached prefix, caller slots that differ from the tree's are duplicates
        and are freed; slots equal to the tree's (the caller passed back what `match_prefix`
        gave it) are left alone. Either way the caller must not free any of `slots` afterwards.
        """
        tokens = _as_tokens(token_ids)
        slots = slots.reshape(-1).to("cpu", torch.int64)
        assert len(slots) == len(tokens), f"{len(tokens)} tokens but {len(slots)} slots"
        pos, node, parts = self._descend(tokens, self._tick(), rank)
        if pos:
            tree_slots = torch.cat(parts)
            self.pool.free(slots[:pos][slots[:pos] != tree_slots])
        if pos < len(tokens):
            # Copies: the caller may reuse its token array / slot tensor.
            leaf = self._new_node(tokens[pos:].copy(), slots[pos:].clone(), node, rank)
            node.children[int(tokens[pos])] = leaf
            self._changed(tokens[: pos + 1])
            self._evictable += len(leaf.key)
            self.inserted_tokens_total += len(leaf.key)
            self._nodes_count += 1
            self._candidate(leaf)
            node = leaf
        return InsertResult(pos, node)

    # ---- locking ----------------------------------------------------------------------------

    def _path(self, node: Node) -> Iterator[Node]:
        cur: Node | None = node
        while cur is not None:
            yield cur
            cur = cur.parent

    def lock(self, node: Node) -> None:
        """Protect the path root..node from eviction (a running request reads it).

        `node` must come from a `match_prefix`/`insert` with no eviction in between.
        """
        for n in self._path(node):
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._protected += len(n.key)
            n.lock_ref += 1

    def unlock(self, node: Node) -> None:
        for n in self._path(node):
            assert n.lock_ref > 0, f"unlocking {n} below zero"
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += len(n.key)
                self._protected -= len(n.key)
                self._candidate(n)

    # ---- eviction / allocation --------------------------------------------------------------

    def _nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _candidate(self, node: Node) -> None:
        """File `node` in the eviction heap if it is an unlocked leaf (with its current key: an
        older entry of it goes stale)."""
        self._heap.file(node, self._nodes_count)

    def evict(self, num_slots: int) -> int:
        """Free unlocked leaves until `num_slots` are freed, in `LeafHeap` order; return the
        count. Whole nodes are evicted, so more than asked may be freed."""
        freed = 0
        while freed < num_slots and (node := self._heap.pop()) is not None:
            parent = node.parent
            assert parent is not None and node.lock_ref == 0 and not node.children, f"not evictable: {node}"
            self.pool.free(node.slots)
            self._changed(
                np.concatenate([*(n.key for n in reversed(list(self._path(parent)))), node.key[:1]])
            )
            del parent.children[int(node.key[0])]
            node.parent = None
            self._nodes_count -= 1
            freed += len(node.key)
            self._evictable -= len(node.key)
            if node.reused:
                self._reused -= len(node.key)
            # A parent that just became an unlocked leaf is the next candidate in LRU order.
            self._candidate(parent)
        self.evicted_tokens_total += freed
        return freed

    def free_tokens(self) -> int:
        return self.pool.num_free

    def capacity(self) -> int:
        return self.pool.num_total

    def _changed(self, prefix: np.ndarray) -> None:
        """Every key whose `match_len` a node change moves starts with `prefix`: the tokens down
        to the changed node's first one (a key that does not reach it matches as before)."""
        self._log.append(tuple(prefix.tolist()))
        if len(self._log) > MAX_CHANGES:
            drop = len(self._log) // 2
            del self._log[:drop]
            self._log_base += drop
            self._log_floor = self._log_base

    @property
    def change_seq(self) -> int:
        """The number of the next change: what a reader passes to `changes_since` later."""
        return self._log_base + len(self._log)

    def changes_since(self, seq: int) -> list[tuple[int, ...]] | None:
        """The prefixes that every key whose `match_len` changed since `change_seq` was `seq`
        starts with; None when anything may have (a reset, or a reader too far behind). Splits,
        recency and ranks change no match length."""
        if seq < self._log_floor:
            return None
        return self._log[seq - self._log_base :]

    def eviction_order(self) -> Iterator[Victim]:
        """The unlocked nodes in the order `evict` would free them, each as its path's tokens and
        the depth it starts at; nothing is evicted. Lazy: a scheduler pricing what a request's
        admission evicts reads only the first few (from a copy of the heap, no walk of the tree)."""
        return self._heap.order(self.root, self._path_key)

    def _path_key(self, node: Node) -> tuple[int, ...]:
        return tuple(int(t) for t in np.concatenate([n.key for n in self._path(node)][::-1]))

    def alloc(self, n: int) -> torch.Tensor | None:
        """`pool.alloc(n)`, evicting first as needed; None (evicting nothing) if it cannot fit."""
        short = n - self.pool.num_free
        if short > 0:
            if short > self._evictable:
                return None  # would flush the cache for nothing
            self.evict(short)
        return self.pool.alloc(n)

    def reset(self) -> None:
        """Drop every node and return its slots to the pool (e.g. `/flush_cache`)."""
        if self.root.lock_ref:
            raise CacheInUseError(
                f"cannot flush the prefix cache: {self._protected} tokens are locked by running requests"
            )
        parts = [n.slots for n in self._nodes() if n is not self.root]
        if parts:
            self.pool.free(torch.cat(parts))
        self.root.children.clear()
        self._evictable = self._reused = self._nodes_count = 0
        self._heap.clear()
        self._log_floor = self.change_seq + 1
        self._log_base, self._log = self._log_floor, []

    # ---- introspection ----------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def stats(self) -> CacheStats:
        return CacheStats(
            total_slots=self.pool.num_total,
            free_slots=self.pool.num_free,
            cached_tokens=self._evictable + self._protected,
            evictable_tokens=self._evictable,
            locked_tokens=self._protected,
            reused_tokens=self._reused,
            evicted_tokens_total=self.evicted_tokens_total,
            inserted_tokens_total=self.inserted_tokens_total,
        )

    def check_integrity(self, held_slots: int = 0) -> None:
        """Assert the tree's invariants and free + cached + held == total, `held_slots` being the
        slots callers have allocated and not yet inserted or freed."""
        self.pool.check()
        evictable = protected = reused = 0
        parts = []
        for node in self._nodes():
            assert node.lock_ref >= 0, f"negative lock count: {node}"
            assert len(node.slots) == len(node.key), f"{node} has {len(node.slots)} slots"
            if node is not self.root:
                assert len(node.key) > 0, f"empty non-root node: {node}"
                parts.append(node.slots)
                reused += len(node.key) if node.reused else 0
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
            for first, child in node.children.items():
                assert child.parent is node, f"{child} has a wrong parent pointer"
                assert int(child.key[0]) == first, f"{child} is filed under token {first}"
                assert node.lock_ref >= child.lock_ref, f"{node} locked less than its child {child}"
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"size counters {(self._evictable, self._protected)} != actual {(evictable, protected)}"
        )
        assert reused == self._reused, f"reused counter {self._reused} != actual {reused}"
        assert len(parts) == self._nodes_count, f"node counter {self._nodes_count} != actual {len(parts)}"
        # Every unlocked leaf is filed in the eviction heap under its current key.
        filed = {id(e[-1]) for e in self._heap.current()}
        for node in self._nodes():
            if node is not self.root and not node.children and not node.lock_ref:
                assert id(node) in filed, f"{node} is an unlocked leaf missing from the eviction heap"
        cached = torch.cat(parts) if parts else _EMPTY_SLOTS
        assert self.pool.num_free + len(cached) + held_slots == self.pool.num_total, (
            f"free {self.pool.num_free} + cached {len(cached)} + held {held_slots} != total {self.pool.num_total}"
        )
        owned = torch.cat([cached, self.pool.free_slots()])
        assert owned.unique().numel() == owned.numel(), "a slot is both cached and free, or cached twice"
