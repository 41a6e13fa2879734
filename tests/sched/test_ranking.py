"""The incremental pick (`ranking.Ranking`: heaps re-filed by what changed) equals the O(queue)
reference that re-prices every waiting request before every step (`Scheduler.scores`), over random
queues, clocks, priorities, client calls, cancellations and cache states."""

from __future__ import annotations

import math
from itertools import takewhile
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from po_backend.core.request import ScoreRequest, common_prefix
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import JCTModel
from po_backend.sched.scheduler import MAX_STEP_CANDIDATES, Scheduler
from po_backend.sched.steps import SHARE_LEAD_S, Pick, fill_step, prefix_step_len, within_budget
from po_backend.sim.simulator import PrefixLRU, VirtualClock


def reference_sharing(s: Scheduler, key: tuple[int, ...]) -> set[int]:
    """Every waiting request whose ids start with `key`, by comparing each one."""
    return {rid for rid, w in s.waiting.items() if tuple(w.req.input_ids[: len(key)]) == key}


def reference_shared_len(s: Scheduler, head: Any) -> int:
    """`Scheduler.shared_len` by listing every other request's shared length and sorting them."""
    ids, limit, floor = tuple(head.req.input_ids), head.req.reusable_len, s.config.min_shared_prefix
    lens = sorted(
        (
            min(common_prefix(ids, w.req.input_ids), limit, w.req.reusable_len)
            for w in s.waiting.values()
            if w.rid != head.rid and common_prefix(ids, w.req.input_ids) >= floor
        ),
        reverse=True,
    )
    best, saved = 0, 0
    for k, n in enumerate(lens):
        if n >= floor and (k + 1) * n > saved:
            best, saved = n, (k + 1) * n
    return best


def reference_pick(s: Scheduler, cached_len: Any, batchable: Any, pool: Any) -> Pick | None:
    """The pick as it was before the ranking: the whole queue scored and sorted (`scores`), every
    sharer listed and sorted."""
    if not len(s):
        return None
    cfg = s.config
    keyed, cached = s.scores(cached_len, pool, batchable)
    heads: dict[int, int] = {}
    for i, k in enumerate(keyed):
        heads.setdefault(cfg.rank(k[3].req), i)
    top, at = cfg.rank(keyed[0][3].req), 0
    if len(heads) > 1 and s._credit > 0:
        nxt = min((i for r, i in heads.items() if r != top), key=lambda i: (keyed[i][3].arrival, i))
        w = keyed[nxt][3]
        cost = s._step_cost([(len(w.req.input_ids), cached.get(w.rid) or cached_len(w.req))])
        if s.backfill is not None:
            cost = min(cost, s.backfill.budget_s)
        if s._credit >= cost:
            at = nxt
    head = keyed[at][3]
    rank = cfg.rank(head.req)
    if head.rid not in cached:
        cached[head.rid] = cached_len(head.req)
    shared = reference_shared_len(s, head)
    assert s.shared_len(head) == shared
    prefix = max(shared, head.req.cache_prefix_len or 0)
    strict = cfg.policy == "fcfs"
    rest = [k[3] for i, k in enumerate(keyed) if i != at and cfg.rank(k[3].req) <= rank]
    sharers = reference_sharing(s, tuple(head.req.input_ids[:prefix])) if prefix > 0 else set()
    if strict:
        base = [head, *takewhile(lambda w: w.rid in sharers, rest)]
        fill = rest[len(base) - 1 :]
    else:
        outside = [w.arrival for w in s.waiting.values() if w.rid not in sharers]
        cut = min(outside) + SHARE_LEAD_S / cfg.fairness_lambda if outside and cfg.fairness_lambda else None
        if cfg.policy != "po" or cut is None:
            cut = math.inf
        base = [head] + [w for w in rest if w.rid in sharers and w.arrival <= cut]
        fill = [w for w in rest if w.rid not in sharers]
    group = (base + fill)[: s.max_candidates]
    chosen = batchable([w.req for w in group]) if len(group) > 1 else [(0, cached[head.rid])]
    if strict:
        chosen = [c for n, c in enumerate(chosen) if c[0] == n]
    chosen = fill_step(s.jct, group, chosen, len(base))
    prefix_only = 0
    if s.backfill is not None:
        budget = s.backfill.budget_s
        if rank > s._urgent:
            chosen = within_budget(s.jct, group, chosen, budget)
        if len(chosen) == 1 and rank > min(s.urgent_rank, -1):
            room = s.prefix_room(pool, s.clock())
            prefix_only = prefix_step_len(s.jct, head, chosen[0][1], budget, s._prefix_steps, room)
    entries = tuple(group[i] for i, _ in chosen)
    if pool is not None and not prefix_only:
        s.stored(pool, entries, s.clock())
    if not prefix_only:
        for w in entries:
            s.remove(w.rid)
    pick = Pick(entries, tuple(c for _, c in chosen), keyed[at][0], credit=at > 0, prefix_only=prefix_only)
    if len(heads) == 1:
        s._credit = 0.0
    else:
        cost = s._step_cost(pick.items)
        s._credit += -cost if at else cfg.batch_min_share * cost
    return pick


PROFILES = [tuple(range(100 * p + 1, 100 * p + 1 + 12)) for p in range(4)]

add = st.tuples(
    st.just("add"),
    st.integers(0, 3),  # profile
    st.integers(0, 12),  # of its tokens
    st.lists(st.integers(1000, 1003), min_size=1, max_size=6),  # own suffix
    st.booleans(),  # declares the profile as its prefix
    st.integers(-1, 3),  # client call (-1: its own)
    st.sampled_from([None, 0, -1, 3]),  # priority
    st.integers(1, 5),  # copies
    st.sampled_from([-1, -1, 0, 5, 9]),  # prompt log-probs from (a reusable prefix that ends early)
)
op = st.one_of(
    add,
    st.tuples(st.just("tick"), st.integers(0, 16)),
    st.tuples(st.just("pick")),
    st.tuples(st.just("cancel"), st.integers(0, 60)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["fcfs", "lpm", "srjf", "po"]),
    priority=st.booleans(),
    lam=st.sampled_from([0.0, 0.125, 2.0]),
    capacity=st.sampled_from([0, 10, 30, 1000]),
    small=st.booleans(),
    ops=st.lists(op, min_size=10, max_size=60),
)
def test_the_incremental_pick_equals_the_reference(
    policy: str, priority: bool, lam: float, capacity: int, small: bool, ops: list[tuple[Any, ...]]
) -> None:
    """`small`: steps of at most 6 candidates and every group of sharers read from the ranking
    (`Scheduler.max_candidates`, `sort_up_to`), the path a call of thousands of sharers takes."""
    cfg = SchedulerConfig(policy, fairness_lambda=lam, min_shared_prefix=4, enable_priority=priority)
    model = JCTModel((0.002, 0.001, 1.0, 3.0, 0.1))
    clock = VirtualClock()
    new, ref = Scheduler(cfg, model, clock), Scheduler(cfg, model, clock)
    if small:
        for s in (new, ref):
            s.max_candidates, s.sort_up_to = 6, 0
    cache = PrefixLRU(capacity, max_batch_tokens=24)
    rid = 0
    for o in ops:
        if o[0] == "add":
            _, p, n, suffix, declare, call, prio, copies, logprobs = o
            for k in range(copies):
                ids = PROFILES[p][:n] + tuple(suffix[k:] or suffix)
                req = ScoreRequest(
                    ids,
                    cache_prefix_len=n if declare and n else None,
                    priority=prio,
                    logprob_start_len=min(logprobs, len(ids) - 1),
                )
                for s in (new, ref):
                    s.add(rid, req, call=call)
                rid += 1
        elif o[0] == "tick":
            clock.now += o[1] / 8
        elif o[0] == "cancel":
            waiting = list(ref.waiting)
            if waiting:
                gone = waiting[o[1] % len(waiting)]
                assert new.remove(gone) and ref.remove(gone)
        else:
            if len(ref):  # the whole order, as the reference sorts it
                keyed, _ = ref.scores(cache.cached_len, cache, cache.batchable)
                order = new.ordered(*new.order(cache.cached_len, cache.batchable, cache, cache.changes()))
                assert [w.rid for w in order] == [k[3].rid for k in keyed]
            want = reference_pick(ref, cache.cached_len, cache.batchable, cache)
            got = new.pick(cache.cached_len, cache.batchable, cache, cache.changes())
            if want is None:
                assert got is None
                continue
            assert got is not None
            assert [e.rid for e in got.entries] == [e.rid for e in want.entries]
            assert (got.n_cached, got.head_score, got.credit, got.prefix_only) == (
                want.n_cached,
                want.head_score,
                want.credit,
                want.prefix_only,
            )
            start = clock.now
            if got.prefix_only:
                ran = [(got.prefix_request(), start)]
                cache.step([ran[0][0]], [cfg.cache_rank(ran[0][0])])
            else:
                ran = [(e.req, e.arrival) for e in got.entries]
                cache.step([r for r, _ in ran], [cfg.rank(r) for r, _ in ran])
            clock.now += model.predict_items(got.items)
            for s in (new, ref):
                s.step_done(start, clock.now, ran, clock.now - start, prefix_step=bool(got.prefix_only))
    assert list(new.waiting) == list(ref.waiting)


def _one_call(policy: str, n: int, model: JCTModel) -> tuple[Scheduler, VirtualClock]:
    """A scheduler holding one client call of `n` distinct prompts (nothing shared)."""
    clock = VirtualClock()
    s = Scheduler(SchedulerConfig(policy, fairness_lambda=0.125), model, clock)
    for i in range(n):
        s.add(i, ScoreRequest((5000 + i, 7, 7, 7, 9 + i % 13)), call=0)
    return s, clock


@pytest.mark.parametrize("policy", ["po", "fcfs", "lpm", "srjf"])
def test_draining_one_large_call_files_each_request_a_bounded_number_of_times(policy: str) -> None:
    """A call of 2,048 items drained one item a step: its size changes every step, which moves
    the call's one cohort entry, not its members. Each request is pushed onto and popped off a
    heap a bounded number of times (O(n) heap operations of O(log n) each, O(n log n) in all;
    re-filing every member at every step would be O(n^2)), and each step reads a few entries."""
    n = 2048
    s, clock = _one_call(policy, n, JCTModel((0.002, 0.001, 1.0, 3.0, 0.1)))
    cache = PrefixLRU(1000)
    ranking = s._ranking
    while len(s):
        score, now = s.order(cache.cached_len, cache.batchable, None, cache.changes())
        head = next(ranking.ordered(ranking.ranks(), score, now))
        assert head.rid == min(s.waiting), "one call of equal prices runs in submission order"
        s.remove(head.rid)
        cache.step([head.req], [0])
        clock.now += 0.01
    assert ranking.filed <= 4 * n, f"{ranking.filed} heap operations for {n} requests"
    assert ranking.read <= 2 * n, f"{ranking.read} heap entries read over {n} steps"


def test_a_large_call_is_picked_with_bounded_ranking_work_per_finished_item() -> None:
    """`Scheduler.pick` drains a call of 4,096 items, several per step, while single calls keep
    arriving: each pick files at most a few heap entries per request it finished or that arrived,
    and reads at most its candidates' worth, however many of the call's items still wait."""
    n = 4096
    s, clock = _one_call("po", n, JCTModel((0.5, 0.001, 0.1, 0.0, 0.01)))
    cache = PrefixLRU(2000, max_batch_tokens=40)
    ranking, rid, sizes, arrived = s._ranking, n, [], n
    while len(s):
        if rid < n + 256:  # a single call arrives before each of the first picks
            s.add(rid, ScoreRequest((9000 + rid, 3, 3, 3)), call=rid)
            rid += 1
            arrived += 1
        filed, read = ranking.filed, ranking.read
        pick = s.pick(cache.cached_len, cache.batchable, cache, cache.changes())
        assert pick is not None
        finished = len(pick.entries)
        sizes.append(finished)
        assert ranking.filed - filed <= 4 * (finished + arrived) + 8, (len(s), finished)
        assert ranking.read - read <= 2 * MAX_STEP_CANDIDATES + 16, (len(s), finished)
        arrived = 0
        cache.step([e.req for e in pick.entries], [0] * finished)
        clock.now += 0.01
    assert max(sizes) > 1, "steps took several items (the per-item bound is exercised)"


def test_a_large_call_on_one_declared_prefix_refiles_only_the_members_whose_price_moved() -> None:
    """po prices the members of a declared prefix per request of the step they would share.
    Draining a call of 2,048 items on one 40-token prefix (a large rerank call), each step
    finishes ~50 and moves the next step's members into the group price; the members still priced
    alone keep their heap entries: after the pick that first caches the prefix (every member's
    cached length changes once), the picks file a few entries per request they finished
    (amortised: a heap is rebuilt once its stale entries outnumber the live ones), not the whole
    group again each time (that was ~4,000 a pick, O(n^2) for the call)."""
    n = 2048
    clock = VirtualClock()
    s = Scheduler(SchedulerConfig("po", min_shared_prefix=4), JCTModel((0.5, 0.001, 0.1, 0.0, 0.01)), clock)
    prefix = tuple(range(100, 140))
    for i in range(n):
        s.add(i, ScoreRequest((*prefix, 5000 + i, 7, 7, 9 + i % 13), cache_prefix_len=len(prefix)), call=0)
    cache = PrefixLRU(2000, max_batch_tokens=200)
    ranking, picks, finished, filed = s._ranking, 0, 0, 0
    while len(s):
        before = ranking.filed
        pick = s.pick(cache.cached_len, cache.batchable, cache, cache.changes())
        assert pick is not None
        if picks >= 2:
            finished += len(pick.entries)
            filed += ranking.filed - before
            assert ranking.filed - before <= len(s) + 4 * len(pick.entries) + 8, "at most one rebuild"
        cache.step([e.req for e in pick.entries], [0] * len(pick.entries))
        clock.now += 0.01
        picks += 1
    assert picks > 10, "several steps drained the call"
    assert filed <= 4 * finished + 8 * picks, f"{filed} heap operations for {finished} requests"


def _drain_one_prefix_call(n: int, sort_up_to: int | None = None) -> tuple[Scheduler, int, int, int]:
    """Drain a call of `n` items on one 40-token declared prefix while 64 single calls arrive;
    returns the scheduler, the picks, the candidates handed to `batchable` and the largest
    `scanned + read` of one pick."""
    clock = VirtualClock()
    s = Scheduler(SchedulerConfig("po", min_shared_prefix=4), JCTModel((0.5, 0.001, 0.1, 0.0, 0.01)), clock)
    if sort_up_to is not None:
        s.sort_up_to = sort_up_to
    prefix = tuple(range(100, 140))
    for i in range(n):
        s.add(i, ScoreRequest((*prefix, 5000 + i, 7, 7, 9 + i % 13), cache_prefix_len=len(prefix)), call=0)
    cache = PrefixLRU(2000, max_batch_tokens=200)
    handed = [0]

    def batchable(reqs: Any) -> Any:
        handed[0] += len(reqs)
        return cache.batchable(reqs)

    picks, rid, worst = 0, n, 0
    while len(s):
        if rid < n + 64:
            s.add(rid, ScoreRequest((9000 + rid, 3, 3, 3)), call=rid)
            rid += 1
        before = s.scanned + s._ranking.read
        pick = s.pick(cache.cached_len, batchable, cache, cache.changes())
        assert pick is not None
        worst = max(worst, s.scanned + s._ranking.read - before)
        cache.step([e.req for e in pick.entries], [0] * len(pick.entries))
        clock.now += 0.01
        picks += 1
    return s, picks, handed[0], worst


def test_draining_a_large_call_on_one_prefix_does_work_per_step_not_per_sharer() -> None:
    """A call of 4,096 items on one declared prefix (a large rerank call), drained ~30 items a
    step while single calls arrive: each pick's own work (sharers and neighbours examined, heap
    entries read, candidates priced and batched) is bounded by the step's candidates, not by the
    thousands of sharers still waiting, and each request is filed a bounded number of times:
    O(n log n) for the call. Sorting every sharer at every pick (what a group up to
    `sort_up_to` still gets) examines the whole group each time: the counts tell them apart."""
    n = 4096
    s, picks, handed, worst = _drain_one_prefix_call(n)
    per_pick = 3 * MAX_STEP_CANDIDATES + 64
    assert picks > 50, "many steps drained the call"
    assert worst <= 2 * per_pick, f"{worst} entries examined by one pick"
    assert s.scanned + s._ranking.read <= per_pick * picks, (s.scanned, s._ranking.read, picks)
    assert handed <= 2 * MAX_STEP_CANDIDATES * picks, "the group price and the step batch a step's candidates"
    assert s._ranking.filed <= 8 * (n + 64), f"{s._ranking.filed} sorted-list and heap operations"
    whole, _, _, whole_worst = _drain_one_prefix_call(n, sort_up_to=n + 1)
    assert whole.scanned > 2 * s.scanned and whole_worst > n, "sorting every sharer examines the group"


def test_reading_the_sharers_in_order_reads_past_cheaper_unrelated_requests() -> None:
    """With sharers read from the policy order (`sort_up_to` 0), the step's group still takes
    every sharer ahead of the unrelated requests, even when the unrelated ones come first in
    that order and fill the candidate slots: the read stops once all sharers are seen."""
    model = JCTModel((0.002, 0.001, 1.0, 3.0, 0.1))
    prefix = tuple(range(1, 9))
    picks = []
    for sort_up_to in (0, 10**6):
        s = Scheduler(SchedulerConfig("po", fairness_lambda=0.0, min_shared_prefix=4), model, VirtualClock())
        s.max_candidates, s.sort_up_to = 4, sort_up_to
        s.add(0, ScoreRequest((*prefix, 50)))  # the head: the cheapest
        for rid in range(1, 6):  # unrelated, cheaper than the sharers
            s.add(rid, ScoreRequest(tuple(range(900 * rid, 900 * rid + 12))))
        for rid in range(6, 9):  # sharing the head's 8 tokens, dear
            s.add(rid, ScoreRequest((*prefix, *range(60 * rid, 60 * rid + 20))))
        cache = PrefixLRU(1000, max_batch_tokens=1000)
        pick = s.pick(cache.cached_len, cache.batchable, cache, cache.changes())
        assert pick is not None
        picks.append([e.rid for e in pick.entries])
    assert picks[0] == picks[1] and set(picks[0]) >= {0, 6, 7, 8}, picks
