"""N simulated engines behind a router (`po_backend.sim.cluster`): one worker is `simulate`, the
fast cache and step model answer as the simulator's, cache_aware keeps a user on one worker until
the load is imbalanced, round robin spreads, nothing is lost. Small traces, no clock, no model."""

from __future__ import annotations

import math
import random
from collections import OrderedDict, defaultdict
from collections.abc import Sequence

import pytest

from po_backend.core.request import ScoreRequest, common_prefix
from po_backend.sched.batching import Request
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import JCTModel
from po_backend.sim.cluster import (
    ApproxTree,
    LinearStepModel,
    RouterConfig,
    TraceShape,
    max_qps_at_p99,
    p99,
    paper_trace,
    simulate_cluster,
)
from po_backend.sim.simulator import PrefixLRU, simulate
from tests.deps import require

MODEL = JCTModel((0.002, 0.0005, 1.0, 0.3, 0.05))  # seconds: per step, item, ktok, Mtok^2, cached ktok
PO = SchedulerConfig("po")


def user_trace(
    users: int, posts: int, *, profile: int = 60, post: int = 12, seed: int = 0
) -> list[ScoreRequest]:
    """users x posts requests, each its user's profile (declared) + a post, users interleaved."""
    rng = random.Random(seed)
    reqs = []
    for u in range(users):
        prefix = (1000 + u,) + tuple(rng.randrange(5000) for _ in range(profile - 1))
        for _ in range(posts):
            reqs.append(
                ScoreRequest(
                    prefix + tuple(rng.randrange(5000) for _ in range(post)), (1, 2), cache_prefix_len=profile
                )
            )
    rng.shuffle(reqs)
    return reqs


def poisson(n: int, qps: float, seed: int = 1) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(qps)
    return out


def users_of(reqs: list[ScoreRequest]) -> list[int]:
    return [r.input_ids[0] for r in reqs]


@pytest.mark.parametrize("router", ["cache_aware", "round_robin", "power_of_two"])
@pytest.mark.parametrize("policy", ["po", "fcfs"])
def test_one_worker_is_simulate(router: str, policy: str) -> None:
    reqs = user_trace(5, 8)
    trace = list(zip(poisson(len(reqs), 20.0), reqs, strict=True))
    config = SchedulerConfig(policy)
    want = simulate(config, MODEL, trace, PrefixLRU(130, 400))
    got = simulate_cluster(config, MODEL, trace, 1, RouterConfig(router), lambda: PrefixLRU(130, 400))
    assert list(got.runs) == want
    assert max(r.step for r in want) + 1 < len(want), "the trace must batch some steps to test batching"


def test_one_worker_is_simulate_with_priority_classes() -> None:
    """With classes and batch steps sized to an online target too: long batch requests run in
    prefix-only steps (no request finishes in them) and each request finishes once."""
    reqs = user_trace(3, 4)
    rng = random.Random(5)
    batch = [
        ScoreRequest(tuple(rng.randrange(5000) for _ in range(400)), (1,), priority=-1) for _ in range(2)
    ]
    trace = [(0.0, b) for b in batch] + list(zip(poisson(len(reqs), 20.0), reqs, strict=True))
    config = SchedulerConfig("po", enable_priority=True, online_slo_s=0.2)
    want = simulate(config, MODEL, trace, PrefixLRU(2000, 1000))
    got = simulate_cluster(
        config, MODEL, trace, 1, RouterConfig("round_robin"), lambda: PrefixLRU(2000, 1000)
    )
    assert list(got.runs) == want
    assert sorted(r.rid for r in got.runs) == list(range(len(trace)))
    assert len({r.step for r in want}) < max(r.step for r in want) + 1, "some steps were prefix-only"
    assert got.workers[0].steps == max(r.step for r in want) + 1


class NaiveLRU(PrefixLRU):
    """The rule `PrefixLRU` implements, written the obvious way (every cached prefix compared, an
    ordered dict for recency): the oracle its sorted index and memo must agree with. What a
    request stores and how a batch is fitted are inherited: they are the rule, not the index."""

    def __init__(self, capacity_tokens: int, max_batch_tokens: int) -> None:
        self.capacity_tokens, self.max_batch_tokens = capacity_tokens, max_batch_tokens
        self._cached: OrderedDict[tuple[int, ...], None] = OrderedDict()  # least recently used first
        self._tokens = 0

    def cached_len(self, req: Request) -> int:
        best = max((common_prefix(p, req.input_ids) for p in self._cached), default=0)
        return min(best, req.reusable_len)

    def step(self, reqs: Sequence[Request]) -> list[int]:
        hits = [self.cached_len(r) for r in reqs]
        for key in (tuple(r.input_ids[: self.store_len(r)]) for r in reqs):
            if key in self._cached:
                self._cached.move_to_end(key)
            elif 0 < len(key) <= self.capacity_tokens:
                self._cached[key] = None
                self._tokens += len(key)
            while self._tokens > self.capacity_tokens:
                old, _ = self._cached.popitem(last=False)
                self._tokens -= len(old)
        return hits


def test_prefix_lru_answers_as_the_naive_rule() -> None:
    rng = random.Random(3)
    reqs = user_trace(9, 6, profile=20, post=5, seed=3)
    ref, fast = NaiveLRU(70, 10**9), PrefixLRU(70, 10**9)
    for _ in range(200):
        batch = rng.sample(reqs, rng.randint(1, 4))
        assert [fast.cached_len(r) for r in reqs] == [ref.cached_len(r) for r in reqs]
        assert fast.batchable(batch) == ref.batchable(batch)
        assert fast.step(batch) == ref.step(batch)
    assert 1 < len(fast) < 9, "the cache must both hold and evict for this to test anything"


def test_linear_step_model_predicts_as_jct_model() -> None:
    fast = LinearStepModel(MODEL.coef)
    for items in ([(100, 0)], [(2000, 1700), (180, 0), (50, 49)], [(7, 3)] * 9):
        assert fast.predict_items(items) == pytest.approx(MODEL.predict_items(items), rel=1e-12)
    assert fast.predict(300, 300, 2) == pytest.approx(MODEL.predict(300, 300, 2), rel=1e-12)
    with pytest.raises(ValueError):
        fast.predict(10, 11)
    with pytest.raises(ValueError):
        LinearStepModel((1.0, -1.0, 0.0, 0.0, 0.0))


def test_approx_tree_matches_and_sizes_tenants() -> None:
    tree = ApproxTree(3)
    tree.insert((1, 2, 3, 4), 0)
    tree.insert((1, 2, 5), 1)  # splits the edge after (1, 2)
    assert tree.match((1, 2, 3, 9)) == (3, 0)
    assert tree.match((1, 2, 5, 6)) == (3, 1)
    assert tree.match((7,)) == (0, -1)
    assert tree.size == [4, 3, 0]  # tenant 1 holds (1, 2) and (5,)
    assert tree.smallest() == 2
    tree.insert((1, 2), 0)  # already held: nothing new
    assert tree.size[0] == 4
    assert tree.match((1, 2)) == (2, 0)  # (1, 2) most recently sent to 0


def test_cache_aware_keeps_each_user_on_one_worker_round_robin_spreads() -> None:
    reqs = user_trace(8, 10)
    trace = list(zip(poisson(len(reqs), 5.0), reqs, strict=True))  # light load: balanced

    def placement(router: str) -> dict[int, set[int]]:
        res = simulate_cluster(PO, MODEL, trace, 4, RouterConfig(router), lambda: PrefixLRU(400))
        where: dict[int, set[int]] = defaultdict(set)
        for u, w in zip(users_of(reqs), res.worker_of, strict=True):
            where[u].add(w)
        return where

    aff = placement("cache_aware")
    assert all(len(ws) == 1 for ws in aff.values()), aff
    assert {w for ws in aff.values() for w in ws} == {0, 1, 2, 3}, "new users go to the emptiest tree"
    rr = placement("round_robin")
    assert all(len(ws) >= 3 for ws in rr.values()), rr


def test_affinity_reuses_more_than_round_robin() -> None:
    reqs = user_trace(8, 10)
    trace = list(zip(poisson(len(reqs), 5.0), reqs, strict=True))
    # Each worker's pool holds 2 profiles: 2 users per worker fit only when they stay put.
    hit = {
        r: simulate_cluster(PO, MODEL, trace, 4, RouterConfig(r), lambda: PrefixLRU(130)).hit_rate
        for r in ("cache_aware", "round_robin")
    }
    assert hit["cache_aware"] > 0.6 > hit["round_robin"], hit


@pytest.mark.parametrize("router", ["cache_aware", "round_robin", "power_of_two"])
def test_nothing_lost(router: str) -> None:
    reqs = user_trace(6, 7)
    trace = list(zip(poisson(len(reqs), 200.0), reqs, strict=True))  # overloaded: long queues
    res = simulate_cluster(PO, MODEL, trace, 3, RouterConfig(router), lambda: PrefixLRU(130, 300))
    assert sorted(r.rid for r in res.runs) == list(range(len(reqs)))
    assert all(0 <= w < 3 for w in res.worker_of)
    assert sum(w.items for w in res.workers) == len(reqs)
    assert all(r.arrival <= r.start < r.end for r in res.runs)
    by_worker = defaultdict(list)  # a worker runs one step at a time
    for r, w in ((r, res.worker_of[r.rid]) for r in res.runs):
        by_worker[w].append((r.start, r.end, r.step))
    for steps in by_worker.values():
        spans = sorted(set(steps))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_imbalance_threshold_moves_a_hot_user() -> None:
    reqs = user_trace(1, 30)  # one user, all at once: affinity would pile everything on one worker
    trace = [(0.0, r) for r in reqs]
    stay = simulate_cluster(PO, MODEL, trace, 2, RouterConfig("cache_aware"), lambda: PrefixLRU(400))
    assert set(stay.worker_of) == {0} and stay.balanced_by_load == 0  # default threshold 64 > 30
    low = RouterConfig("cache_aware", balance_abs_threshold=4, balance_rel_threshold=1.5)
    moved = simulate_cluster(PO, MODEL, trace, 2, low, lambda: PrefixLRU(400))
    assert moved.balanced_by_load > 0
    counts = [moved.worker_of.count(w) for w in (0, 1)]
    assert min(counts) >= 10, counts  # the outstanding gap stays within the threshold
    assert moved.imbalance < stay.imbalance


def test_give_up_only_when_p99_is_past_the_bound() -> None:
    reqs = user_trace(6, 10)
    trace = list(zip(poisson(len(reqs), 60.0), reqs, strict=True))
    full = simulate_cluster(PO, MODEL, trace, 2, RouterConfig("round_robin"), lambda: PrefixLRU(130))
    worst = p99(full.latencies)
    assert full.complete
    over = simulate_cluster(
        PO,
        MODEL,
        trace,
        2,
        RouterConfig("round_robin"),
        lambda: PrefixLRU(130),
        give_up_over=worst * 0.5,
    )
    assert not over.complete and len(over.runs) < len(reqs)
    within = simulate_cluster(
        PO,
        MODEL,
        trace,
        2,
        RouterConfig("round_robin"),
        lambda: PrefixLRU(130),
        give_up_over=worst * 1.01,
    )
    assert within.complete and list(within.runs) == list(full.runs)


def test_p99_is_numpys() -> None:
    np = require("numpy")
    vals = [random.Random(5).expovariate(1.0) for _ in range(137)]
    assert p99(vals) == pytest.approx(float(np.percentile(vals, 99)))


def test_max_qps_at_p99_finds_the_crossing() -> None:
    qps, runs = max_qps_at_p99(lambda q: q * q, slo_s=4.0, guess=0.3, rel_tol=0.01)
    assert 2.0 / 1.01 <= qps <= 2.0 and runs < 24
    qps, _ = max_qps_at_p99(lambda q: math.inf, slo_s=4.0, guess=1.0, max_runs=5)
    assert qps == 0.0


def test_paper_trace_shape() -> None:
    shape = TraceShape(users=12, posts=5, seed=4)
    reqs, arrivals = paper_trace(shape)
    again, _ = paper_trace(shape)
    assert reqs == again and len(reqs) == 60
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    prefixes = defaultdict(list)
    for r in reqs:
        p = r.input_ids[: r.cache_prefix_len]
        assert 100 <= len(r.input_ids) - len(p) <= 200
        assert 11000 / 8 <= len(p) - 8 - 16 <= 17000 / 8
        prefixes[p].append(r)
    assert len(prefixes) == 12 and all(len(v) == 5 for v in prefixes.values())
    first = {r.input_ids[: r.cache_prefix_len] for r in reqs[:5]}
    assert len(first) > 1  # users interleave
    with pytest.raises(ValueError):
        TraceShape(users=0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RouterConfig("least_load")
    with pytest.raises(ValueError):
        RouterConfig(cache_threshold=1.5)
    with pytest.raises(ValueError):
        simulate_cluster(PO, MODEL, [], 0, RouterConfig(), lambda: PrefixLRU(10))
    with pytest.raises(ValueError):
        PrefixLRU(-1)


def test_warm_up_left_out_of_the_give_up_rule() -> None:
    reqs = user_trace(6, 10)
    trace = [(0.0, r) for r in reqs[:20]] + [
        (100.0 + i, r) for i, r in enumerate(reqs[20:])
    ]  # a burst, then calm
    router = RouterConfig("round_robin")
    full = simulate_cluster(PO, MODEL, trace, 1, router, lambda: PrefixLRU(130))
    burst = max(r.end - r.arrival for r in full.runs if r.arrival == 0.0)
    calm = max(r.end - r.arrival for r in full.runs if r.arrival >= 100.0)
    assert calm < burst
    bound = (calm + burst) / 2
    assert not simulate_cluster(PO, MODEL, trace, 1, router, lambda: PrefixLRU(130), bound).complete
    after = simulate_cluster(PO, MODEL, trace, 1, router, lambda: PrefixLRU(130), bound, measured_from=50.0)
    assert after.complete and list(after.runs) == list(full.runs)


def test_prefix_lru_holds_an_extended_prefix_once() -> None:
    """A key that extends a cached one (a long request's next prefix step) replaces it, as the
    engine's tree holds the shared tokens once; unrelated keys stay."""
    lru = PrefixLRU(1000)
    ids = tuple(range(1, 401))
    other = ScoreRequest(tuple(range(5000, 5100)), (1,), cache_prefix_len=100)
    lru.step([other])
    for k in (100, 200, 300):
        lru.step([ScoreRequest(ids[:k], (1,), cache_prefix_len=k)])
    assert len(lru) == 2 and lru.free_tokens() == 1000 - 300 - 100
    assert (
        lru.cached_len(ScoreRequest(ids, (1,))) == 300
        and lru.cached_len(ScoreRequest((*other.input_ids, 7), (1,))) == 100
    )


def test_a_read_of_part_of_a_cached_prefix_leaves_its_class() -> None:
    """As in the engine's tree, where only the tokens read take the reader's class: a prompt that
    shares two template tokens with a cached prefix does not lend it its (more urgent) class, so
    the less urgent prefix is still evicted first. A read of the whole prefix does."""

    def req(head: tuple[int, ...], n: int) -> ScoreRequest:
        ids = head + tuple(range(1000 + 100 * len(head) + n, 1000 + 100 * len(head) + 2 * n))
        return ScoreRequest(ids, (1, 2), cache_prefix_len=len(ids) - 2)

    lru = PrefixLRU(10**6, 10**6)
    a, c, b = req((7, 8), 20), req((9,), 20), req((7, 8), 30)
    lru.step([a], [5])  # a less urgent class's prefix
    lru.step([c], [0])
    lru.step([b], [-1])  # reads a's two template tokens only
    first = next(lru.eviction_order()).key
    assert first == tuple(a.input_ids[: a.cache_prefix_len])
    whole = ScoreRequest(a.input_ids, (1, 2), cache_prefix_len=4)  # reads all of a's prefix
    lru.step([whole], [-2])
    assert next(lru.eviction_order()).key == tuple(c.input_ids[: c.cache_prefix_len])
