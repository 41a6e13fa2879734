"""Eviction-aware prefix-aware SRJF (`po_backend.sched.reuse`): a request's cost includes the
waiting requests' cached reuse its admission evicts, on the simulator's pool and the engine's
radix cache alike. Torch-free except the radix cache's eviction order."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import JCTModel
from po_backend.sched.reuse import CachePool, ReuseCost, Victim
from po_backend.sched.scheduler import Scheduler
from po_backend.sim.simulator import PrefixLRU, VirtualClock

JCT = JCTModel.proxy(seconds_per_ktok=1.0)  # 1 ms per computed token


@dataclass(frozen=True)
class Req:
    name: str
    input_ids: tuple[int, ...]
    cache_prefix_len: int | None = None
    priority: int | None = None

    @property
    def reusable_len(self) -> int:
        return len(self.input_ids) - 1


def _ids(tag: int, n: int) -> tuple[int, ...]:
    return tuple(tag * 100_000 + k for k in range(n))


PA, PB, PX = _ids(1, 100), _ids(2, 100), _ids(3, 100)


def _warm(cache: PrefixLRU, *prefixes: tuple[int, ...]) -> None:
    """Cache `prefixes` in order (the first is then the least recently used)."""
    for p in prefixes:
        cache.step([Req("warm", p + (0,), len(p))])


def _first_pick(sched: Scheduler, cache: PrefixLRU, aware: bool) -> str:
    pick = sched.pick(cache.cached_len, cache.batchable, cache if aware else None)
    assert pick is not None
    return str(pick.entries[0].req.name)


def _queue(reqs: list[Req], cache: PrefixLRU) -> Scheduler:
    sched = Scheduler(SchedulerConfig("po", 0.0), JCT, VirtualClock())
    for i, r in enumerate(reqs):
        sched.add(i, r, arrival=float(i))
    return sched


def test_equal_jct_the_one_that_evicts_nobody_s_profile_runs_first() -> None:
    """X and Y cost the same forward; X stores a profile, which evicts A's (the least recently
    used), and a queued request reads A's. Plain SRJF runs X first (it arrived first); the
    eviction-aware cost charges X A's recomputation and runs Y."""
    x = Req("X", PX + _ids(13, 100), 100)  # 200 tokens, stores 100
    y = Req("Y", _ids(4, 200))  # 200 tokens, stores nothing
    a = Req("A", PA + _ids(11, 500), 100)  # reads A's profile; long, so it is not the head
    for aware, first in ((False, "X"), (True, "Y")):
        cache = PrefixLRU(200)
        _warm(cache, PA, PB)
        assert _first_pick(_queue([x, y, a], cache), cache, aware) == first


def test_evicting_a_profile_nobody_waits_for_costs_nothing() -> None:
    """Same queue, but what X would evict (B's profile, now the least recently used) no queued
    request reads: plain SRJF's order."""
    x = Req("X", PX + _ids(13, 100), 100)
    y = Req("Y", _ids(4, 200))
    a = Req("A", PA + _ids(11, 500), 100)
    cache = PrefixLRU(200)
    _warm(cache, PB, PA)
    assert _first_pick(_queue([x, y, a], cache), cache, True) == "X"


def test_the_cost_is_the_readers_recomputation_in_jct_seconds() -> None:
    cache = PrefixLRU(200)
    _warm(cache, PA, PB)
    a1 = Req("A1", PA + _ids(11, 50), 100)
    a2 = Req("A2", PA + _ids(12, 80), 100)
    x = Req("X", PX + _ids(13, 10), 100)
    waiting = sorted((r.input_ids, r) for r in (a1, a2, x))
    cost = ReuseCost(cache, waiting, cache.cached_len, JCT.predict)
    per_reader = JCT.predict(150, 0) - JCT.predict(150, 100) + JCT.predict(180, 0) - JCT.predict(180, 100)
    assert cost.cost(x) == pytest.approx(per_reader)
    assert cost.cost(a1) == 0.0  # a hit stores nothing new
    # With room for X's profile nothing is evicted
    big = PrefixLRU(300)
    _warm(big, PA, PB)
    assert ReuseCost(big, waiting, big.cached_len, JCT.predict).cost(x) == 0.0


def test_a_victim_frees_at_least_one_token() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        Victim((1, 2), 2)


def _run(reqs: list[Req], capacity: int, aware: bool) -> list[list[str]]:
    cache = PrefixLRU(capacity, 10**9)
    sched = Scheduler(SchedulerConfig("po", 0.0), JCT, VirtualClock())
    for i, r in enumerate(reqs):
        sched.add(i, r, arrival=0.0)
    steps = []
    while (pick := sched.pick(cache.cached_len, cache.batchable, cache if aware else None)) is not None:
        cache.step([e.req for e in pick.entries])
        steps.append([str(e.req.name) for e in pick.entries])
    return steps


_req = st.builds(
    lambda user, post, tail: (user, post, tail),
    st.integers(0, 4),
    st.integers(0, 50),
    st.integers(1, 40),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_req, min_size=1, max_size=12))
def test_without_pressure_the_order_is_plain_srjf(spec: list[tuple[int, int, int]]) -> None:
    """A pool that holds every prefix never evicts: the eviction-aware order is plain po's."""
    reqs = [
        Req(f"{i}", _ids(user + 1, 30 + 10 * user) + _ids(100 + post, tail), 30 + 10 * user)
        for i, (user, post, tail) in enumerate(spec)
    ]
    everything = sum(30 + 10 * u for u in range(5))
    assert _run(reqs, everything, True) == _run(reqs, everything, False)


def test_radix_eviction_order_is_the_order_evict_frees() -> None:
    torch = pytest.importorskip("torch")
    from po_backend.engine.cache import KVPool, RadixCache

    pool = KVPool(num_slots=64, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache = RadixCache(pool)
    seqs = [(1, 2, 3, 4), (1, 2, 5, 6, 7), (1, 2, 5, 8), (9, 9, 9), (1, 2, 3, 4, 10)]
    for s in seqs:
        cache.insert(s, _slots(cache, s))
    cache.match_prefix((9, 9, 9))  # reused, so evicted after the never-reused ones
    order = list(cache.eviction_order())
    assert sum(v.tokens for v in order) == cache.evictable_size()
    for v in order:
        assert cache.match_len(v.key) == len(v.key)
        assert cache.evict(v.tokens) == v.tokens  # exactly that node goes next
        assert cache.match_len(v.key) == v.start
    assert cache.evictable_size() == 0
    cache.check_integrity()
    # the scheduler's view holds what the KV pool holds, cached or free (`Scheduler.prefix_room`)
    assert CachePool(cache, len).capacity() == 64 and cache.free_tokens() == 64


def _slots(cache, seq):  # type: ignore[no-untyped-def]
    """Slots for `seq`: the cached prefix's own, then fresh ones (what the engine inserts)."""
    import torch

    m = cache.match_prefix(seq)
    fresh = cache.alloc(len(seq) - m.length)
    return torch.cat([m.slots, fresh])


def test_the_engine_loop_prices_what_its_radix_cache_would_evict(tiny_model) -> None:
    """On the engine: the loop hands the scheduler its radix cache's eviction order. A pool full
    with A's and B's profiles; X (stores a profile: evicts A's, which a queued request reads) and
    Y (a token longer, declares that it stores nothing) wait. Eviction-aware po runs Y first; answers still equal
    cold runs."""
    pytest.importorskip("torch")
    from po_backend import Engine, ScoreRequest
    from po_backend.serving.loop import EngineLoop

    labels = (3, 17)
    eng = Engine.from_pretrained(
        tiny_model("llama")[0], dtype="fp32", max_input_len=512, prefix_pool_tokens=200
    )
    pa, pb, px = (tuple((7 * k + s) % 300 for k in range(100)) for s in (1, 2, 3))
    x = ScoreRequest(px + tuple(range(100)), labels, cache_prefix_len=100)
    y = ScoreRequest(tuple((k * 11) % 300 for k in range(201)), labels, cache_prefix_len=0)
    a = ScoreRequest(pa + tuple(k % 300 for k in range(5, 305)), labels, cache_prefix_len=100)
    cold = []
    for r in (x, y, a):
        eng.flush_cache()
        cold.append(eng.run([r])[0])
    eng.flush_cache()
    eng.run([ScoreRequest(pa + (1,), labels, cache_prefix_len=100)])
    eng.run([ScoreRequest(pb + (1,), labels, cache_prefix_len=100)])
    assert eng.cache is not None and eng.cache.pool.num_free < 100  # X's profile must evict
    with EngineLoop(eng, policy="po", fairness_lambda=0.0, jct=JCT, start=False) as loop:
        futs = loop.submit_many([x, y, a])
        loop.start()
        got = [f.result(30.0) for f in futs]
    first = loop.step_log()[0]
    assert first.items == ((201, 0),), first.items  # Y, not X (plain po: X, 200 tokens)
    assert got[2].cached_tokens == 100  # A read its profile
    for g, c in zip(got, cold, strict=True):
        assert max(abs(p - q) for p, q in zip(g.logprobs, c.logprobs, strict=True)) <= 1e-5


def test_radix_eviction_order_skips_locked_paths() -> None:
    """A running request's locked path is never a victim, nor is a parent that keeps a locked
    child; the rest still comes in `evict`'s order."""
    pytest.importorskip("torch")
    import torch

    from po_backend.engine.cache import KVPool, RadixCache

    cache = RadixCache(KVPool(1, 64, 1, 2, torch.float32))
    for s in [(1, 2, 3, 4), (1, 2, 5, 6), (7, 8, 9)]:
        cache.insert(s, _slots(cache, s))
    m = cache.match_prefix((1, 2, 3, 4))
    cache.lock(m.node)
    order = list(cache.eviction_order())
    # Least recently used first; (1, 2) stays with its locked child (3, 4)
    assert [v.key for v in order] == [(1, 2, 5, 6), (7, 8, 9)]
    assert [v.start for v in order] == [2, 0]
    assert sum(v.tokens for v in order) == cache.evictable_size()
    cache.unlock(m.node)
