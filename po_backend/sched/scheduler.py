"""Which waiting requests run next: fcfs, srjf, lpm, and po (the paper's Algorithm 1).

Pure logic: no torch, no threads, no wall clock unless one is injected. The engine is reached only
through two callables handed to `pick` (in production `engine.cached_len` / `engine.batchable`,
in tests fakes), so every policy can be checked with a fake executor and a fake clock.

Algorithm 1 (prefix-aware SRJF with continuous JCT calibration): before every step, for each
waiting request recompute n_cached against the *current* cache and score it
`jct(n_input, n_cached) - lambda * t_queue`; run the lowest. A request whose prefix was just
cached jumps ahead (more hits, fewer evictions); lambda bounds starvation: a request waiting for
t seconds beats every request that arrived more than (jct - jct_min) / lambda seconds after it.
Given the pool's eviction order (`reuse.Pool`), a request's jct also counts the waiting requests'
reuse its admission would evict (`reuse.ReuseCost`): with a small pool, a cold request that would
push out a prefix others are queued to read waits until they have read it.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from itertools import islice, takewhile
from operator import itemgetter
from typing import Any

from po_backend.core.request import common_prefix, sorted_neighbours
from po_backend.sched.backfill import BackfillBudget
from po_backend.sched.batching import Batchable, CachedLen, Request
from po_backend.sched.config import CLASSES, SchedulerConfig
from po_backend.sched.jct import CalibratedJCT
from po_backend.sched.ranking import Changes, Ranking
from po_backend.sched.reuse import Pool, ReuseCost
from po_backend.sched.steps import (
    SHARE_LEAD_S,
    WORKING_SET_S,
    Pick,
    Predictor,
    Waiting,
    fill_step,
    prefix_step_len,
    step_cost,
    within_budget,
)

# The most waiting requests one step's batching considers (`batchable` fills the token budget from
# them in order): bounds a pick's batching work in a long queue.
MAX_STEP_CANDIDATES = 256
# A head's sharers up to this many are sorted whole; more are read from the ranking in policy
# order, as far as the step needs (`Scheduler.pick`).
SORT_SHARERS_UP_TO = 2 * MAX_STEP_CANDIDATES


class _WaitingByIds(Sequence[tuple[tuple[int, ...], Request]]):
    """The waiting queue sorted by ids as (ids, request) pairs (what `ReuseCost` bisects), read
    in place instead of copied at every pick."""

    def __init__(self, sched: Scheduler) -> None:
        self._by_ids, self._waiting = sched.by_ids, sched.waiting

    def __len__(self) -> int:
        return len(self._by_ids)

    def __getitem__(self, i: Any) -> Any:
        ids, rid = self._by_ids[i]
        return ids, self._waiting[rid].req


class Scheduler:
    """A waiting queue and a policy. Not thread-safe: the engine loop calls it under its lock."""

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        jct: Predictor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or SchedulerConfig()
        if jct is None and self.config.needs_jct:
            raise ValueError(f"policy {self.config.policy!r} needs a JCT predictor")
        self.jct = jct
        self.clock = clock
        self._waiting: dict[int, Waiting] = {}  # insertion order == rid order
        # The waiting requests sorted by token ids (a flattened radix over the queue): the ones
        # sharing the most leading tokens with a request are its neighbours in this order.
        self._by_ids: list[tuple[tuple[int, ...], int]] = []
        self._by_arrival: list[tuple[float, int]] = []  # (arrival, rid), sorted
        # Per arrival instant, its waiting requests sorted by ids: how many share a prefix is then
        # two bisections (`_oldest_outside`).
        self._at: dict[float, list[tuple[tuple[int, ...], int]]] = {}
        # The waiting requests whose reusable prefix ends before their last token but one (prompt
        # log-probs from an earlier start), sorted by ids: `shared_len` counts them one by one.
        self._short: list[tuple[tuple[int, ...], int]] = []
        # Steps take at most this many candidates, and sharers up to `sort_up_to` are sorted whole
        # (module constants; tests lower them to reach both paths with small queues).
        self.max_candidates = MAX_STEP_CANDIDATES
        self.sort_up_to = SORT_SHARERS_UP_TO
        # Queue entries a pick examined outside the ranking's heaps (sharers, neighbours,
        # arrivals): the pick's own work, for checks.
        self.scanned = 0
        self._call_waiting: Counter[int] = Counter()  # waiting requests per client call
        # srjf's JCT "at arrival": set at the first pick after arrival (the first moment the loop
        # may read the cache; the cache cannot change between an arrival and that pick).
        self._arrival_jct: dict[int, float] = {}
        self._class_waiting: Counter[str] = Counter()  # waiting requests per priority class
        # The classes behind the most urgent one waiting, all together: predicted step seconds
        # earned and not yet used (`pick`), their share of the steps run while they waited. One
        # credit however many priority values they use, so spreading work over many values earns
        # it no more than one value does.
        self._credit = 0.0
        # The class whose latency the step sizing protects: the most urgent rank submitted so
        # far, or the default priority's (0) while nothing more urgent was: a less urgent backlog
        # queued first is sized for the online calls that come after it.
        self._urgent = 0
        # The least urgent rank submitted so far: once one below the default priority was, the
        # default priority's class is the online one, not a backlog that may yet be overtaken.
        self._least = 0
        # Per waiting request that ran prefix-only steps: how many, and the tokens it had cached
        # when the last one was picked (no more than that at its next pick: nothing was kept).
        self._prefix_steps: dict[int, tuple[int, int]] = {}
        # The prefixes the requests of each class stored in the pool, when last (`prefix_room`)
        self._stored: dict[tuple[int, ...], tuple[float, int]] = {}
        # Steps sized for the most urgent calls (to their latency target, if any), from those measured.
        self.backfill = BackfillBudget(self.config.online_slo_s) if self.config.sizes_batch_steps else None
        self._ranking = Ranking(self, self._pricing)

    @staticmethod
    def _is_short(req: Request) -> bool:
        return req.reusable_len < len(req.input_ids) - 1

    # ---- queue ------------------------------------------------------------------------------

    def add(self, rid: int, req: Request, arrival: float | None = None, call: int = -1) -> Waiting:
        if rid in self._waiting:
            raise ValueError(f"request id {rid} is already waiting")
        if not req.input_ids:
            raise ValueError("cannot schedule an empty request")
        w = Waiting(rid, req, self.clock() if arrival is None else arrival, call)
        self._waiting[rid] = w
        entry = (tuple(req.input_ids), rid)
        bisect.insort(self._by_ids, entry)
        bisect.insort(self._by_arrival, (w.arrival, rid))
        bisect.insort(self._at.setdefault(w.arrival, []), entry)
        if self._is_short(req):
            bisect.insort(self._short, entry)
        if call >= 0:
            self._call_waiting[call] += 1
        self._class_waiting[self.config.priority_class(req)] += 1
        self._ranking.add(w)
        self._least = max(self._least, rank := self.config.rank(req))
        if rank < self._urgent:
            self._urgent = rank
            if self.backfill is not None:
                self.backfill.forget_online()
        return w

    def remove(self, rid: int) -> bool:
        """Drop a waiting request (cancelled, or picked); False if it is not waiting."""
        self._arrival_jct.pop(rid, None)
        self._prefix_steps.pop(rid, None)
        w = self._waiting.pop(rid, None)
        if w is None:
            return False
        entry = (tuple(w.req.input_ids), rid)
        i = bisect.bisect_left(self._by_ids, entry)
        assert self._by_ids[i][1] == rid, "the sorted queue lost a request"
        del self._by_ids[i]
        del self._by_arrival[bisect.bisect_left(self._by_arrival, (w.arrival, rid))]
        at = self._at[w.arrival]
        del at[bisect.bisect_left(at, entry)]
        if not at:
            del self._at[w.arrival]
        if self._is_short(w.req):
            del self._short[bisect.bisect_left(self._short, entry)]
        self._class_waiting[self.config.priority_class(w.req)] -= 1
        self._ranking.remove(w)
        if w.call >= 0:
            self._call_waiting[w.call] -= 1
            if not self._call_waiting[w.call]:
                del self._call_waiting[w.call]
        return True

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def waiting(self) -> dict[int, Waiting]:
        """The waiting requests by rid, in submission order (read-only)."""
        return self._waiting

    @property
    def by_ids(self) -> list[tuple[tuple[int, ...], int]]:
        """(ids, rid) of the waiting requests sorted by ids (read-only)."""
        return self._by_ids

    def siblings(self, w: Waiting) -> int:
        """The waiting requests of `w`'s client call (1 for a call of its own)."""
        return self._call_waiting.get(w.call, 1) if w.call >= 0 else 1

    @property
    def urgent_rank(self) -> int:
        """The class the step sizing protects: the most urgent submitted so far."""
        return self._urgent

    def least_urgent(self, n: int, rank: int) -> list[Waiting] | None:
        """Queued requests to abort so that `n` more fit (a full queue admitting a more urgent
        call, as SGLang does): the least urgent first, the newest first among equals, only of a
        class less urgent than `rank`, each with the rest of its client call (half a call is of no
        use to its client). None if that many are not waiting: nothing is to be aborted then."""
        rank_of = self.config.rank
        cands = sorted(
            (w for w in self._waiting.values() if rank_of(w.req) > rank),
            key=lambda w: (rank_of(w.req), w.rid),
            reverse=True,
        )
        calls: dict[int, list[Waiting]] = {}
        for w in cands:
            calls.setdefault(w.call if w.call >= 0 else -1 - w.rid, []).append(w)
        out: dict[int, Waiting] = {}
        for w in cands:
            if len(out) >= n:
                break
            out.update((m.rid, m) for m in calls[w.call if w.call >= 0 else -1 - w.rid])
        return list(out.values()) if len(out) >= n else None

    def waiting_by_class(self) -> dict[str, int]:
        """Waiting requests per priority class (`CLASSES`)."""
        return {c: self._class_waiting[c] for c in CLASSES}

    def pop_all(self) -> list[Waiting]:
        out = list(self._waiting.values())
        self._waiting.clear()
        self._by_ids.clear()
        self._by_arrival.clear()
        self._at.clear()
        self._short.clear()
        self._arrival_jct.clear()
        self._call_waiting.clear()
        self._class_waiting.clear()
        self._prefix_steps.clear()
        self._stored.clear()
        self._ranking = Ranking(self, self._pricing)
        return out

    # ---- policy -----------------------------------------------------------------------------

    def _predict(self, req: Request, n_cached: int) -> float:
        return self._predict_len(len(req.input_ids), n_cached)

    def _pricing(self) -> Predictor | None:
        """The model requests are priced with: a calibrated model's coefficients without its
        running factor, which moves at every step and would re-price the whole queue each time
        (the fairness term is weighed against the profile's seconds)."""
        return self.jct.model if isinstance(self.jct, CalibratedJCT) else self.jct

    def _predict_len(self, n_input: int, n_cached: int) -> float:
        model = self._pricing()
        assert model is not None, "this policy needs a JCT predictor"
        return model.predict(n_input, n_cached)

    def scores(
        self, cached_len: CachedLen[Any], pool: Pool | None = None, batchable: Batchable[Any] | None = None
    ) -> tuple[list[tuple[float, float, int, Waiting]], dict[int, int]]:
        """Every waiting request's sort key (lowest runs first), and the cached_len values read to
        get them: the whole queue re-priced, O(queue) cache probes. The reference of the order
        `pick` reads incrementally (`ranking.Ranking`), which must equal it. With a `pool`,
        po adds to a request's JCT the waiting requests' reuse its admission would evict; with
        `batchable`, po prices a request that shares a declared prefix with others per request of
        the step they would share."""
        cfg, now = self.config, self.clock()
        cached: dict[int, int] = {}
        reuse = None
        if pool is not None and cfg.policy == "po":
            waiting = [(ids, self._waiting[rid].req) for ids, rid in self._by_ids]
            reuse = ReuseCost(pool, waiting, cached_len, self._predict_len)

        def n_cached(w: Waiting) -> int:
            if w.rid not in cached:
                cached[w.rid] = cached_len(w.req)
            return cached[w.rid]

        per_item: dict[tuple[int, ...], dict[int, float]] = {}  # a declared prefix -> rid -> price

        def jct(w: Waiting) -> float:
            """po's price of running `w` now: its step's predicted seconds per request answered.
            The waiting requests that declare the same prefix run in its step (as far as
            `batchable` lets them share one forward) and compute that prefix once, so a cold
            profile that k requests wait for costs each of them 1/k of it (Smith's rule: the most
            requests answered per second of engine time first). Priced alone, a cold profile lost
            to every shorter cold prompt that came after it, while all its readers waited."""
            own = self._predict(w.req, n_cached(w))
            p = w.req.cache_prefix_len or 0
            if batchable is None or p < cfg.min_shared_prefix:
                return own
            key = tuple(w.req.input_ids[:p])
            if key not in per_item:
                group = self.group_step(key, n_cached)
                chosen = batchable([m.req for m in group]) if len(group) > 1 else []
                if len(chosen) < 2:
                    per_item[key] = {}
                else:
                    items = [(len(group[i].req.input_ids), c) for i, c in chosen]
                    price = step_cost(self._pricing(), items) / len(chosen)
                    per_item[key] = {group[i].rid: price for i, _ in chosen}
            return min(own, per_item[key].get(w.rid, own))

        keyed: list[tuple[float, float, int, Waiting]] = []
        for w in self._waiting.values():
            if cfg.policy == "fcfs":
                score = w.arrival
            elif cfg.policy == "lpm":
                score = -float(n_cached(w))  # longest cached prefix first
            elif cfg.policy == "srjf":
                if w.rid not in self._arrival_jct:
                    self._arrival_jct[w.rid] = self._predict(w.req, n_cached(w))
                score = self._arrival_jct[w.rid]
            else:  # po: Algorithm 1, recomputed against the current cache at every step
                wait = max(0.0, now - w.arrival)
                # The starvation credit belongs to a client call, not to each of its items: a call
                # of 150 items ages like one request, so its early arrival cannot hand all 150
                # priority over a short call that came a moment later.
                score = jct(w) - cfg.fairness_lambda * wait / self.siblings(w)
                if reuse is not None:
                    score += reuse.cost(w.req)
            keyed.append((score, w.arrival, w.rid, w))
        # Priority class first (all 0 with priority scheduling off); ties: earlier arrival, then
        # submission order
        rank = cfg.rank
        keyed.sort(key=lambda k: (rank(k[3].req), *k[:3]))
        return keyed, cached

    def _score(self, w: Waiting, price: float, now: float, reuse: ReuseCost | None) -> float:
        """The policy's sort key of `w` from its price (`ranking.Ranking.price`), as `scores`
        computes it."""
        if self.config.policy != "po":
            return price
        score = price - self.config.fairness_lambda * max(0.0, now - w.arrival) / self.siblings(w)
        if reuse is not None:
            score += reuse.cost(w.req)
        return score

    def group_step(self, key: tuple[int, ...], cached: Callable[[Waiting], int]) -> list[Waiting]:
        """The candidates of the step the requests starting with `key` would share, what po
        prices them by: the first `max_candidates` of them in id order (a step takes no more),
        the one with the most cached first (it computes the prefix, the others read it from it),
        ties in id order."""
        lo, hi = self.span(key)
        hi = min(hi, lo + self.max_candidates)
        self.scanned += hi - lo
        return sorted((self._waiting[self._by_ids[j][1]] for j in range(lo, hi)), key=lambda m: -cached(m))

    def span(self, key: tuple[int, ...]) -> tuple[int, int]:
        """[lo, hi) of the waiting requests whose ids start with `key` in the queue sorted by ids:
        in that order they are one run, found by two bisections instead of a walk."""
        p = len(key)
        lo = bisect.bisect_left(self._by_ids, key, key=itemgetter(0))
        return lo, bisect.bisect_right(self._by_ids, key, lo=lo, key=lambda e: e[0][:p])

    def shared_len(self, head: Waiting) -> int:
        """The prefix length to group the waiting requests by for `head`'s step: of the lengths
        that at least `min_shared_prefix` tokens long other waiting requests share with it, the
        one that saves the most computed tokens (sharers x length); 0 if none shares that much.
        Another request shares min(its common prefix with the head, each one's reusable length).

        Sharers are contiguous around the head in token order and share less the further away
        they are: the requests sharing at least c tokens are one run (`span`), so the lengths are
        counted per distinct common prefix (a few bisections each), not per sharer. A request
        that is all a prefix of the head's ids shares one token less than its common prefix; the
        few whose reusable length ends earlier still (`_short`) are counted one by one."""
        ids, limit, floor = tuple(head.req.input_ids), head.req.reusable_len, self.config.min_shared_prefix
        by_ids = self._by_ids
        counts: Counter[int] = Counter()  # shared length -> other waiting requests sharing it

        def common(j: int) -> int:
            return common_prefix(ids, by_ids[j][0]) if 0 <= j < len(by_ids) else 0

        at = bisect.bisect_left(by_ids, (ids, head.rid))
        lo, hi, c = at, at + 1, max(common(at - 1), common(at + 1))
        while c >= floor:
            inside = hi - lo
            lo, hi = self.span(ids[:c])
            whole = bisect.bisect_right(by_ids, ids[:c], key=itemgetter(0)) - bisect.bisect_left(
                by_ids, ids[:c], key=itemgetter(0)
            )
            whole -= c == len(ids)  # the head itself
            counts[min(c - 1, limit)] += whole
            counts[min(c, limit)] += hi - lo - inside - whole
            self.scanned += 1
            c = max(common(lo - 1), common(hi))
        for j, c in sorted_neighbours(self._short, ids, floor, key=itemgetter(0)):
            other, rid = self._short[j]
            if rid == head.rid:
                continue
            self.scanned += 1
            counts[min(c - (len(other) == c), limit)] -= 1
            counts[min(c, limit, self._waiting[rid].req.reusable_len)] += 1
        best, saved, k = 0, 0, 0
        for n in sorted(counts, reverse=True):
            if counts[n] <= 0:
                continue
            k += counts[n]
            if n >= floor and k * n > saved:
                best, saved = n, k * n
        return best

    def to_probe(self, changes: Changes) -> list[Any]:
        """Take what changed in the cache since the last pick (`ranking.Changes`, then passed to
        `pick` no more) and return the waiting requests the next pick probes: a caller whose
        scorer memoises `cached_len` may probe them first, outside its lock."""
        return [self._waiting[rid].req for rid in self._ranking.cache_changed(changes)]

    def order(
        self, cached_len: CachedLen[Any], batchable: Batchable[Any], pool: Pool | None, changes: Changes
    ) -> tuple[Callable[[Waiting], float], float]:
        """Bring the ranking up to date with what changed (`ranking.Changes`) and return the
        policy's score of a waiting request (`scores`' key, computed once per request: the
        reuse cost walks the pool's victims) and the clock it was read at: what
        `ranking.Ranking.ordered` sorts this pick's requests by."""
        ranking = self._ranking
        ranking.cache_changed(changes)
        ranking.refresh(cached_len, batchable)
        now = self.clock()
        reuse = None
        if pool is not None and self.config.policy == "po":
            reuse = ReuseCost(pool, _WaitingByIds(self), cached_len, self._predict_len)
        scores: dict[int, float] = {}

        def score(w: Waiting) -> float:
            if w.rid not in scores:
                scores[w.rid] = self._score(w, ranking.price(w), now, reuse)
            return scores[w.rid]

        return score, now

    def ordered(self, score: Callable[[Waiting], float], now: float) -> list[Waiting]:
        """Every waiting request in policy order (`order`'s score): what `scores` sorts, read
        from the ranking (O(queue): for checks; a pick reads only as far as it needs)."""
        return list(self._ranking.ordered(self._ranking.ranks(), score, now))

    def pick(
        self,
        cached_len: CachedLen[Any],
        batchable: Batchable[Any],
        pool: Pool | None = None,
        changes: Changes = None,
    ) -> Pick | None:
        """Choose and remove the next step's requests: the policy's head plus the waiting requests
        that share its prefix (declared, or the longest worth sharing: `shared_len`), then the
        unrelated ones, each in policy order, as far as `batchable` lets them share one forward
        (its token budget). None if nothing waits.

        fcfs is strict, as in SGLang and vLLM: only the requests right behind the head in arrival
        order join it, up to the first that does not fit, so requests start in arrival order.
        Pulling a later request of the same prefix past earlier ones is a prefix-aware reordering,
        which is what lpm and po are for.

        Priority classes (`SchedulerConfig.enable_priority`): the most urgent class waiting runs
        first, the policy orders within it, and a step takes no less urgent request. The classes
        behind it earn together one credit, `batch_min_share` of each step's predicted time while
        any of them waits, and the longest-waiting of their best requests runs once that credit
        pays for it: no class is ever starved, and spreading work over many priority values earns
        it no larger share. A step of a class less urgent than the most urgent submitted so far
        (or than the default, while nothing more urgent was)
        takes batch-mates only while its predicted time stays within `backfill.BackfillBudget`,
        and a request too long for it computes its prompt over several prefix-only steps, of any
        class but the most urgent once it is known to be the online one (`splits`: a more urgent
        call may arrive during any other step; that class has nobody to yield to, and splitting
        its calls only adds a step's overhead and the other calls' steps to each).

        `pool` (the cache's eviction order, `reuse.Pool`): po's cost includes the reuse a
        request's admission destroys (`reuse.ReuseCost`); without it, plain prefix-aware SRJF.
        `changes`: what the cache reports changed since the last pick (`ranking.Changes`): only
        the requests under those prefixes are probed again; None (unknown) probes every one.

        A request sharing the head's prefix joins ahead of an older request outside the step only
        within `SHARE_LEAD_S` (po)."""
        if not self._waiting:
            return None
        cfg, ranking = self.config, self._ranking
        score, now = self.order(cached_len, batchable, pool, changes)
        ranks = ranking.ranks()
        head = next(ranking.ordered(ranks[:1], score, now))
        credit = False
        if len(ranks) > 1 and self._credit > 0:
            # The credit pays for the longest-waiting best request of the classes behind: however
            # many there are, each one's turn comes, and none gets more than the one share.
            heads = (next(ranking.ordered([r], score, now)) for r in ranks[1:])
            nxt = min(heads, key=lambda w: (w.arrival, cfg.rank(w.req)))
            cost = self._step_cost([(len(nxt.req.input_ids), ranking.cached[nxt.rid])])
            if self.backfill is not None:  # a sized step costs no more than the budget
                cost = min(cost, self.backfill.budget_s)
            if self._credit >= cost:
                head, credit = nxt, True
        rank = cfg.rank(head.req)
        prefix = max(self.shared_len(head), head.req.cache_prefix_len or 0)
        strict = cfg.policy == "fcfs"
        # Policy order; equally or more urgent requests only
        rest = (w for w in ranking.ordered([r for r in ranks if r <= rank], score, now) if w.rid != head.rid)
        key = tuple(head.req.input_ids[:prefix])
        lo, hi = self.span(key) if prefix > 0 else (0, 0)

        def shares(w: Waiting) -> bool:
            return prefix > 0 and tuple(w.req.input_ids[:prefix]) == key

        limit = self.max_candidates
        if strict:  # only the run right behind the head: nobody overtakes an earlier arrival
            group = [head, *islice(rest, limit - 1)]
            n_base = 1 + sum(1 for _ in takewhile(shares, group[1:]))
        else:
            cut = math.inf
            if cfg.policy == "po" and cfg.fairness_lambda > 0:
                # the oldest request outside the step: the first in arrival order not sharing
                oldest = self._oldest_outside(key) if prefix > 0 else self._by_arrival[0][0]
                if oldest is not None:
                    cut = oldest + SHARE_LEAD_S / cfg.fairness_lambda
            if hi - lo <= self.sort_up_to or rank != ranks[-1]:
                self.scanned += hi - lo
                mates = (self._waiting[self._by_ids[j][1]] for j in range(lo, hi))
                base = [head] + sorted(
                    (w for w in mates if w.rid != head.rid and w.arrival <= cut and cfg.rank(w.req) <= rank),
                    key=lambda w: (cfg.rank(w.req), score(w), w.arrival, w.rid),
                )
                fill = (w for w in rest if not shares(w))
                group = [*base, *islice(fill, max(0, limit - len(base)))][:limit]
                n_base = len(base)
            else:
                # Many sharers, every one of them in the policy order read (no class behind the
                # head's waits): the step's are the first ones read, as far as the step needs.
                group, n_base = self._read_step(head, rest, shares, hi - lo - 1, cut)
        # Unrelated requests (each attends only to itself) fill the step behind the head's group,
        # as SGLang and vLLM batch unrelated prefills, while it stays short (`steps.fill_step`).
        chosen = batchable([w.req for w in group]) if len(group) > 1 else [(0, ranking.cached[head.rid])]
        assert chosen and chosen[0][0] == 0, f"batchable must keep the head first, got {chosen[:5]}"
        if strict:  # stop at the first request batchable leaves out: it must run before the rest
            chosen = [c for n, c in enumerate(chosen) if c[0] == n]
        chosen = fill_step(self.jct, group, chosen, n_base)
        prefix_only = 0
        if self.backfill is not None:
            budget = self.backfill.budget_s
            # The most urgent class keeps its batch-mates (trimming them would only delay it);
            # a request too long for the budget is split unless nothing can be more urgent.
            if rank > self._urgent:
                chosen = within_budget(self.jct, group, chosen, budget)
            if len(chosen) == 1 and self.splits(rank):
                room = self.prefix_room(pool, now)
                prefix_only = prefix_step_len(self.jct, head, chosen[0][1], budget, self._prefix_steps, room)
        entries = tuple(group[i] for i, _ in chosen)
        if pool is not None and not prefix_only:
            self.stored(pool, entries, now)
        if not prefix_only:
            for w in entries:
                self.remove(w.rid)
        pick = Pick(
            entries,
            tuple(reused for _, reused in chosen),
            score(head),
            credit=credit,
            prefix_only=prefix_only,
        )
        # Nothing behind the most urgent class waits: it is owed nothing (idle time is not banked).
        # Otherwise the less urgent classes spend their credit on this step, or earn a share of it.
        if len(ranks) == 1:
            self._credit = 0.0
        else:
            cost = self._step_cost(pick.items)
            self._credit += -cost if credit else cfg.batch_min_share * cost
        return pick

    def _read_step(
        self,
        head: Waiting,
        rest: Iterator[Waiting],
        shares: Callable[[Waiting], bool],
        sharers: int,
        cut: float,
    ) -> tuple[list[Waiting], int]:
        """A step's candidates read from the policy order `rest` (the head left out): the head,
        the sharers that arrived by `cut` in that order, then the others, `max_candidates` in
        all, with how many the head's group is. `sharers`: how many requests besides the head
        `shares` holds for; once all are read only the others are left to read."""
        limit = self.max_candidates
        base, fill, seen = [head], [], 0
        for w in rest:
            self.scanned += 1
            if not shares(w):
                fill.append(w)
            else:
                seen += 1
                if w.arrival <= cut:
                    base.append(w)
            if len(base) >= limit or (seen == sharers and len(base) + len(fill) >= limit):
                break
        return [*base, *fill][:limit], len(base)

    def _oldest_outside(self, key: tuple[int, ...]) -> float | None:
        """The arrival of the oldest waiting request whose ids do not start with `key`, read per
        arrival instant: the requests of one instant are sorted by ids, so those starting with
        `key` are one run of them (two bisections). A large call on one prefix is one instant to
        skip, not a walk over its requests."""
        by_arrival, p, i = self._by_arrival, len(key), 0
        while i < len(by_arrival):
            arrival = by_arrival[i][0]
            at = self._at[arrival]
            self.scanned += 1
            lo = bisect.bisect_left(at, key, key=itemgetter(0))
            if bisect.bisect_right(at, key, lo=lo, key=lambda e: e[0][:p]) - lo < len(at):
                return arrival
            i += len(at)
        return None

    def stored(self, pool: Pool, entries: Sequence[Waiting], now: float) -> None:
        """`entries` run now and store their prefixes in `pool` (`prefix_room` counts them)."""
        for w in entries:
            if n := pool.store_len(w.req):
                self._stored[tuple(w.req.input_ids[:n])] = (now, self.config.rank(w.req))

    def prefix_room(self, pool: Pool | None, now: float) -> int | None:
        """The most tokens a less urgent request's prefix steps may keep in `pool` (each step
        locks what the last ones cached, so it evicts the urgent calls' prefixes beyond it):
        what the most urgent class's working set leaves, the distinct prefixes its requests stored in the last
        `WORKING_SET_S` seconds. None without a pool."""
        if pool is None:
            return None
        for key in [k for k, (t, _) in self._stored.items() if t < now - WORKING_SET_S]:
            del self._stored[key]
        urgent = sum(len(k) for k, (_, r) in self._stored.items() if r <= self._urgent)
        return pool.capacity() - urgent

    def splits(self, rank: int) -> bool:
        """Whether a request of `rank` too long for the step budget runs in prefix-only steps:
        unless it is of the most urgent class submitted and that class is known to be the online
        one, that is more urgent than the default priority's (0), or of the default priority with a
        less urgent class submitted beside it. A default-priority class alone is the backlog
        queued before any urgent call, sized for the calls that may come after it."""
        if rank > self._urgent:
            return True
        return rank == 0 and self._least == 0

    def step_done(
        self,
        start: float,
        end: float,
        ran: Sequence[tuple[Request, float]],
        predicted: float = math.nan,
        prefix_step: bool = False,
    ) -> None:
        """A step picked here ran from `start` to `end` (the scheduler's clock); `ran`: (request,
        arrival) of each request it computed, the head first; `predicted`: the seconds the JCT
        model priced it at before it ran (nan: none); `prefix_step`: a `Pick.prefix_only` step,
        which answers nobody. Feeds the step sizing: the most urgent class
        submitted so far is the one measured, every step of a less urgent one may delay it."""
        if self.backfill is None or not ran:
            return
        rank, top = self.config.rank, self._urgent
        urgent = [] if prefix_step else [a for r, a in ran if rank(r) <= top]
        self.backfill.step_done(start, end, rank(ran[0][0]) > top, urgent, predicted)

    def _step_cost(self, items: Sequence[tuple[int, int]]) -> float:
        return step_cost(self.jct, items)
