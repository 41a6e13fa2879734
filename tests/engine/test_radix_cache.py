"""CPU tests of the prefix cache data structures: KVPool and RadixCache."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from po_backend.engine.cache import CacheInUseError, KVPool, Node, RadixCache


def make(num_slots: int = 64) -> tuple[KVPool, RadixCache]:
    pool = KVPool(num_layers=2, num_slots=num_slots, num_kv_heads=1, head_dim=2, dtype=torch.float64)
    return pool, RadixCache(pool)


def put(cache: RadixCache, tokens: list[int]) -> Node:
    slots = cache.alloc(len(tokens))
    assert slots is not None
    return cache.insert(tokens, slots).node


def depth(node: Node) -> int:
    n = 0
    while node.parent is not None:
        n, node = n + len(node.key), node.parent
    return n


def path_key(node: Node) -> tuple[int, ...]:
    parts: list[int] = []
    while node.parent is not None:
        parts[:0] = node.key.tolist()
        node = node.parent
    return tuple(parts)


def walked_eviction_order(cache: RadixCache) -> list[tuple[int, ...]]:
    """The eviction order by definition, from a walk of the whole tree each time (the reference
    for the incremental heap): repeatedly the unlocked leaf least in (less urgent class first,
    reused, least recently used, creation order), its parent a leaf once its children are gone."""
    gone: set[int] = set()
    order = []
    while True:
        stack, leaves = [cache.root], []
        while stack:
            node = stack.pop()
            kids = [c for c in node.children.values() if c.uid not in gone]
            stack.extend(kids)
            if node is not cache.root and not kids and node.lock_ref == 0:
                leaves.append(node)
        if not leaves:
            return order
        victim = min(leaves, key=lambda n: (-n.rank, n.reused, n.last_access, n.uid))
        gone.add(victim.uid)
        order.append(path_key(victim))


# ---- KVPool ---------------------------------------------------------------------------------


def test_pool_alloc_free_counts() -> None:
    pool = KVPool(1, 10, 1, 4, torch.float32)
    assert pool.alloc(0).numel() == 0
    a = pool.alloc(6)
    assert a.dtype == torch.int64 and a.tolist() == [0, 1, 2, 3, 4, 5]
    assert pool.alloc(5) is None and pool.num_free == 4
    pool.free(a[:3])
    assert pool.num_free == 7
    assert pool.alloc(3).tolist() == [0, 1, 2]  # freed slots come back in order
    pool.check()
    assert pool.nbytes == 2 * 10 * 4 * 4 == KVPool.bytes_per_slot(1, 1, 4, torch.float32) * 10


def test_pool_double_free_detected() -> None:
    pool = KVPool(1, 8, 1, 2, torch.float32)
    a = pool.alloc(4)
    pool.free(a[:2])
    pool.free(a[:1])  # double free: not an overflow yet, so only check() sees it
    with pytest.raises(AssertionError, match="duplicates"):
        pool.check()
    with pytest.raises(AssertionError, match="out-of-range"):
        KVPool(1, 8, 1, 2, torch.float32).free(torch.tensor([8]))
    full = KVPool(1, 2, 1, 2, torch.float32)
    with pytest.raises(AssertionError, match="overflow"):
        full.free(torch.tensor([0]))


def test_pool_read_write_roundtrip() -> None:
    pool = KVPool(3, 16, 2, 4, torch.bfloat16)
    slots = pool.alloc(5)
    k, v = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    pool.write(1, slots, k, v)
    pool.write(0, slots, -k, -v)
    order = torch.tensor([4, 0, 2])
    rk, rv = pool.read(1, slots[order])
    assert rk.dtype == torch.bfloat16 and rk.shape == (3, 2, 4)
    torch.testing.assert_close(rk, k[order].to(torch.bfloat16))
    torch.testing.assert_close(rv, v[order].to(torch.bfloat16))
    torch.testing.assert_close(pool.read(0, slots)[0], (-k).to(torch.bfloat16))


# ---- RadixCache -----------------------------------------------------------------------------


def test_match_on_empty_tree() -> None:
    _, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.length == 0 and m.slots.numel() == 0 and m.node is cache.root
    assert cache.match_prefix([]).length == 0
    cache.check_integrity()


def test_insert_then_exact_and_partial_match_splits() -> None:
    _, cache = make()
    slots = cache.alloc(6)
    res = cache.insert([5, 6, 7, 8, 9, 10], slots)
    assert res.prefix_len == 0 and depth(res.node) == 6
    m = cache.match_prefix([5, 6, 7, 8, 9, 10, 11])
    assert m.length == 6 and torch.equal(m.slots, slots) and m.node is res.node
    assert cache.match_len([5, 6, 7, 1]) == 3  # read-only probe: no split
    assert len(cache.root.children[5].key) == 6
    m = cache.match_prefix([5, 6, 7, 1])
    assert m.length == 3 and torch.equal(m.slots, slots[:3]) and depth(m.node) == 3
    assert m.node.children[8] is res.node and torch.equal(res.node.slots, slots[3:])
    assert cache.match_prefix([9]).length == 0
    cache.check_integrity()


def test_insert_existing_prefix_frees_duplicates() -> None:
    pool, cache = make(16)
    put(cache, [1, 2, 3, 4])
    free_before = pool.num_free
    dup = cache.alloc(6)
    res = cache.insert([1, 2, 3, 9, 9, 9], dup)
    assert res.prefix_len == 3
    assert pool.num_free == free_before - 3  # 3 duplicates returned, 3 new tokens kept
    assert torch.equal(cache.match_prefix([1, 2, 3, 9, 9, 9]).slots[3:], dup[3:])
    # Passing the tree's own slots back (match -> alloc the rest -> insert) frees nothing of them.
    m = cache.match_prefix([1, 2, 3, 4])
    rest = cache.alloc(2)
    free_before = pool.num_free
    res = cache.insert([1, 2, 3, 4, 7, 7], torch.cat([m.slots, rest]))
    assert res.prefix_len == 4 and pool.num_free == free_before
    assert cache.stats().inserted_tokens_total == 4 + 3 + 2
    cache.check_integrity()


def test_lock_prevents_eviction_and_unlock_below_zero() -> None:
    _, cache = make()
    a = put(cache, [1, 1, 1])
    put(cache, [2, 2])
    cache.lock(a)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 1, 1]).length == 3 and cache.match_prefix([2, 2]).length == 0
    cache.match_prefix([1, 1, 2])  # splits the locked node: the new upper part is locked too
    cache.check_integrity()
    assert cache.evict(100) == 0
    cache.unlock(a)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    with pytest.raises(AssertionError, match="below zero"):
        cache.unlock(a)


def test_lru_order() -> None:
    _, cache = make()
    put(cache, [1, 1])
    put(cache, [2, 2])
    put(cache, [3, 3])
    cache.match_prefix([1, 1])  # touch: [2, 2] is now the oldest
    assert cache.evict(1) == 2
    assert [cache.match_len(s) for s in ([1, 1], [2, 2], [3, 3])] == [2, 0, 2]
    assert cache.evict(1) == 2
    assert cache.match_len([3, 3]) == 0 and cache.stats().evicted_tokens_total == 4


def test_never_reused_nodes_are_evicted_first() -> None:
    """Tiered eviction: a tail stored on speculation (never read back) goes before an older prefix
    that another request read; within a tier, least recently used first."""
    _, cache = make()
    put(cache, [1, 2, 3])  # a profile, read back below
    put(cache, [4, 5, 6])
    put(cache, [7, 8])
    assert cache.match_prefix([1, 2, 3, 0]).length == 3
    put(cache, [9])  # the newest, but never read
    assert cache.stats().reused_tokens == 3
    assert [cache.evict(1) for _ in range(3)] == [3, 2, 1]  # [4,5,6], [7,8], then [9]
    assert cache.match_len([1, 2, 3]) == 3 and cache.match_len([9]) == 0
    assert cache.evict(1) == 3 and cache.stats().reused_tokens == 0
    cache.check_integrity()


def test_less_urgent_class_is_evicted_first() -> None:
    """Within a reuse tier, a node last used by the batch class (rank 1) goes before one last used
    by the online class (rank 0), even when the online one is older; a batch prefix an online call
    reads is kept as online from then on, and an online one a batch call reads is not; a split
    keeps the rank; eviction_order agrees with evict."""
    _, cache = make()
    for key, rank in (([1, 2, 3], 0), ([4, 5, 6], 1), ([7, 8], 1), ([9, 9], 0)):
        slots = cache.alloc(len(key))
        assert slots is not None
        cache.insert(key, slots, rank=rank)
    for key, rank in (([1, 2, 3], 0), ([4, 5, 6, 0], 1), ([7, 8, 0], 0), ([9, 9], 1)):
        cache.match_prefix(key, rank)  # every node reused: one tier; [7,8] online now, [9,9] batch
    cache.match_prefix([1, 2], rank=0)  # splits [1,2,3]: both parts online, [3] older
    assert [v.key for v in cache.eviction_order()][:2] == [(4, 5, 6), (9, 9)]
    # the batch ones, least recently used first; then the online ones: [3] (split off), then [7,8]
    assert [cache.evict(1) for _ in range(4)] == [3, 2, 1, 2]
    assert cache.match_len([1, 2, 3]) == 2 and cache.match_len([7, 8]) == 0
    cache.check_integrity()
    assert [n.rank for n in cache._nodes() if n is not cache.root] == [0]


def test_set_rank_gives_whole_covered_nodes_a_class() -> None:
    """set_rank changes the class of the nodes the tokens cover whole, and nothing else: not a
    node that goes on past them (others' tokens), not recency, not the reuse mark, no split."""
    _, cache = make()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5])  # splits: [1,2] -> [3,4], [5]
    before = {n.uid: (n.last_access, n.reused) for n in cache._nodes()}
    cache.set_rank([1, 2, 3], rank=2)
    ranks = {tuple(int(t) for t in n.key): n.rank for n in cache._nodes() if n is not cache.root}
    assert ranks == {(1, 2): 2, (3, 4): 0, (5,): 0}
    assert {n.uid: (n.last_access, n.reused) for n in cache._nodes()} == before
    cache.set_rank([9], rank=1)  # nothing cached: nothing changes
    cache.check_integrity()


def test_reuse_mark_splits_with_the_matched_part() -> None:
    """A match that ends inside a node marks only the part it read: the shared profile stays,
    the first request's own tail (stored with it) is evicted first."""
    _, cache = make()
    put(cache, [1, 2, 3, 4, 5])  # profile [1, 2, 3] + first post [4, 5], stored together
    cache.match_prefix([1, 2, 3, 9])  # the second post reads the profile
    put(cache, [6])  # a newer, unrelated, never-read entry
    st = cache.stats()
    assert (st.cached_tokens, st.reused_tokens) == (6, 3)
    cache.check_integrity()
    assert cache.evict(1) == 2  # the first post's tail [4, 5]: older than [6], same tier
    assert cache.match_len([1, 2, 3, 4]) == 3
    assert cache.evict(1) == 1 and cache.match_len([6]) == 0  # then [6], still before the profile
    assert cache.match_len([1, 2, 3]) == 3
    cache.check_integrity()


def test_evict_frees_parents_that_become_leaves() -> None:
    pool, cache = make(16)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])  # splits: [1, 2] -> {[3, 4], [5, 6]}
    put(cache, [9])
    cache.match_prefix([9])  # [9] is the most recent; the [1, 2] subtree goes first
    assert cache.evict(5) == 6  # both leaves, then their parent
    assert cache.match_len([1, 2]) == 0 and cache.match_len([9]) == 1
    assert pool.num_free == 15
    cache.check_integrity()


def test_alloc_evicts_and_returns_none_when_locked() -> None:
    pool, cache = make(8)
    a = put(cache, [1, 2, 3, 4])
    put(cache, [5, 6, 7, 8])
    assert pool.num_free == 0
    cache.lock(a)
    assert cache.alloc(5) is None  # only 4 evictable: nothing is evicted for nothing
    assert cache.evictable_size() == 4
    s = cache.alloc(3)
    assert s is not None and cache.match_len([5]) == 0 and pool.num_free == 1
    assert cache.alloc(2) is None
    pool.free(s)
    cache.check_integrity()
    cache.unlock(a)
    assert cache.alloc(8) is not None and cache.stats().cached_tokens == 0


def test_reset() -> None:
    pool, cache = make(16)
    a = put(cache, [1, 2, 3])
    put(cache, [1, 4])
    cache.lock(a)
    with pytest.raises(CacheInUseError, match="locked"):
        cache.reset()
    cache.unlock(a)
    cache.reset()
    assert pool.num_free == 16 and cache.match_len([1, 2, 3]) == 0
    assert cache.stats().cached_tokens == 0
    cache.check_integrity()


def test_long_prompt_match_is_fast_enough() -> None:
    pool, cache = make(40_000)
    base = torch.randint(0, 50_000, (10_000,)).tolist()
    put(cache, base)
    for i in range(20):  # shared 10k prefix, distinct suffixes
        put(cache, base + [i] * 500)
    m = cache.match_prefix(base + [3] * 500 + [1])
    assert m.length == 10_500 and m.slots.numel() == 10_500
    cache.check_integrity()


# ---- randomized: a hypothesis state machine -------------------------------------------------

tokens_st = st.lists(st.integers(0, 2), max_size=10)  # tiny alphabet: prefixes collide
# Every key of up to 6 tokens of that alphabet: the requests whose match length the ops may move
PROBES = [key for n in range(7) for key in itertools.product(range(3), repeat=n)]


class CacheMachine(RuleBasedStateMachine):
    """Random ops keep the invariants; matched slots hold the KV written for that exact prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.cache = make(32)
        self.prefix_ids: dict[tuple[int, ...], int] = {}  # each distinct prefix -> a unique value
        self.locked: list[Node] = []
        self.matched = dict.fromkeys(PROBES, 0)  # match_len of each probe at the last check
        self.seq = self.cache.change_seq

    def _write(self, tokens: list[int], start: int, slots: torch.Tensor) -> None:
        ids = [
            self.prefix_ids.setdefault(tuple(tokens[: p + 1]), len(self.prefix_ids) + 1)
            for p in range(start, len(tokens))
        ]
        val = torch.tensor(ids, dtype=torch.float64)
        for layer in range(self.pool.num_layers):
            k = torch.stack([val, torch.full_like(val, layer)], -1)[:, None]
            self.pool.write(layer, slots, k, -k)

    def _verify(self, tokens: list[int], length: int, slots: torch.Tensor) -> None:
        assert slots.numel() == length
        want = torch.tensor(
            [self.prefix_ids[tuple(tokens[: p + 1])] for p in range(length)], dtype=torch.float64
        )
        for layer in range(self.pool.num_layers):
            k, v = self.pool.read(layer, slots)
            assert torch.equal(k[:, 0, 0], want) and torch.equal(v[:, 0, 1], torch.full_like(want, -layer))

    @rule(tokens=tokens_st)
    def insert_fresh(self, tokens: list[int]) -> None:
        slots = self.cache.alloc(len(tokens))
        if slots is None:
            return
        self._write(tokens, 0, slots)
        res = self.cache.insert(tokens, slots)
        assert depth(res.node) == len(tokens)
        m = self.cache.match_prefix(tokens)
        assert m.length == len(tokens) and m.node is res.node
        self._verify(tokens, m.length, m.slots)

    @rule(tokens=tokens_st)
    def insert_reusing_prefix(self, tokens: list[int]) -> None:
        m = self.cache.match_prefix(tokens)
        self.cache.lock(m.node)  # keep the prefix alive while allocating the rest
        new = self.cache.alloc(len(tokens) - m.length)
        if new is not None:
            self._write(tokens, m.length, new)
            res = self.cache.insert(tokens, torch.cat([m.slots, new]))
            assert res.prefix_len == m.length
        self.cache.unlock(m.node)

    @rule(tokens=tokens_st)
    def match(self, tokens: list[int]) -> None:
        probe = self.cache.match_len(tokens)
        probe_ids = self.cache.match_len(tuple(tokens))  # a request's ids, as the engine probes
        m = self.cache.match_prefix(tokens)  # may split a node where the match ends
        assert m.length == probe == probe_ids == depth(m.node)
        self._verify(tokens, m.length, m.slots)

    @rule(tokens=tokens_st)
    def lock(self, tokens: list[int]) -> None:
        node = self.cache.match_prefix(tokens).node
        self.cache.lock(node)
        self.locked.append(node)

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        self.cache.unlock(self.locked.pop(i % len(self.locked)))

    @rule(tokens=tokens_st, rank=st.integers(0, 2))
    def set_rank(self, tokens: list[int], rank: int) -> None:
        self.cache.set_rank(tokens, rank)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        evictable = self.cache.evictable_size()
        order = walked_eviction_order(self.cache)
        leaves_before = {path_key(v) for v in self._cached_nodes()}
        freed = self.cache.evict(n)
        gone = leaves_before - {path_key(v) for v in self._cached_nodes()}
        assert gone == set(order[: len(gone)]), "evict freed nodes out of the eviction order"
        assert freed >= n or self.cache.evictable_size() == 0
        assert self.cache.evictable_size() == evictable - freed

    @rule(n=st.integers(0, 40))
    def alloc_and_free(self, n: int) -> None:
        room = self.pool.num_free + self.cache.evictable_size()
        slots = self.cache.alloc(n)
        assert (slots is None) == (n > room)
        if slots is not None:
            self.pool.free(slots)

    @rule()
    def reset(self) -> None:
        if self.locked:
            with pytest.raises(CacheInUseError):
                self.cache.reset()
        else:
            self.cache.reset()
            assert self.pool.num_free == self.pool.num_total

    def _cached_nodes(self) -> list[Node]:
        stack, out = [self.cache.root], []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.cache.root:
                out.append(node)
        return out

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity()
        assert [v.key for v in self.cache.eviction_order()] == walked_eviction_order(self.cache)
        for node in self.locked:  # locked paths are never evicted
            assert node is self.cache.root or node.parent is not None

    @invariant()
    def changes_cover_every_moved_match(self) -> None:
        """Every key whose match length changed starts with a prefix `changes` reported (what
        lets the scheduler probe only those requests)."""
        changes = self.cache.changes_since(self.seq)
        self.seq = self.cache.change_seq
        for key, before in self.matched.items():
            now = self.cache.match_len(key)
            if now != before and changes is not None:
                assert any(key[: len(p)] == p for p in changes), (key, before, now, changes)
            self.matched[key] = now


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
