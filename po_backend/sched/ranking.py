"""The waiting queue in policy order, kept up to date by what changes instead of re-priced whole
before every step.

A request's score is `price - lambda * wait / siblings` (po; the other policies have no time term),
where only the price depends on the cache. The requests of one client call that arrived together in
one priority class (a cohort) share `siblings` and arrival, so within a cohort the order is the
price's alone: each cohort keeps its members sorted by price, and the cohorts are filed in heaps
by (priority class, call siblings), keyed by their best member's `price + lambda * arrival /
siblings`. Within one heap that order does not move with the clock; a call whose size changes (its
items finishing) moves its one cohort entry, not its members. A step re-files only the requests
whose price changed (their cached prefix, the group of requests sharing their declared prefix) and
the cohorts they or the finished requests belong to. A pick reads the heaps in order lazily
(`Ranking.ordered`), as far as it needs: the head, then the step's candidates. A member priced
again or leaving is taken out of its cohort at once (a sorted list), so a read never passes stale
members; a cohort's stale entries in a class heap are popped when they reach its top and dropped in
bulk once they outnumber the live ones.

Which cached prefixes changed comes from the cache (`Changes`): the token prefixes that every
request whose cached length may have changed starts with, or None when anything may have (a
flush, an unknown cache). Those requests are the contiguous runs of the queue sorted by ids.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Protocol

from sortedcontainers import SortedList

from po_backend.sched.batching import Batchable, CachedLen
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.steps import Predictor, Waiting

# What a cache reports between two picks (see the module docstring).
Changes = Sequence[tuple[int, ...]] | None
# (call, arrival, rank): the requests of one client call queued together in one priority class;
# a request of no call is a cohort of its own (call -1 - rid)
Cohort = tuple[int, float, int]
# (price, rid): a member's entry in its cohort's sorted members
Member = tuple[float, int]
# (key, arrival, rid, version, cohort): a cohort's entry in its class heap, for its best member `rid`;
# live while `version` is the cohort's current one
Entry = tuple[float, float, int, int, Cohort]
# A heap's key may be rounded differently from the score it stands for: bounds carry this margin.
_MARGIN = 1e-9


class _Members:
    """A cohort's waiting members, by price, and where it is filed."""

    __slots__ = ("sorted", "live", "filed", "version")

    def __init__(self) -> None:
        # Sorted, not a heap: a member priced again or leaving is taken out at once, so reading
        # the cohort in order never passes entries that no longer count.
        self.sorted: SortedList[Member] = SortedList()
        self.live = 0  # waiting members
        self.filed: tuple[int, int, float, int] | None = None  # (rank, siblings, key, rid) of its live entry
        self.version = 0


class Queue(Protocol):
    """What the ranking reads of the scheduler's queue."""

    config: SchedulerConfig

    @property
    def waiting(self) -> dict[int, Waiting]: ...

    @property
    def by_ids(self) -> list[tuple[tuple[int, ...], int]]: ...

    def siblings(self, w: Waiting) -> int: ...

    @property
    def max_candidates(self) -> int: ...

    def span(self, key: tuple[int, ...]) -> tuple[int, int]: ...

    def group_step(self, key: tuple[int, ...], cached: Callable[[Waiting], int]) -> list[Waiting]: ...


class Ranking:
    """Prices and heaps of the waiting requests (module docstring). `pricing`: the model that
    prices po's and srjf's requests (None for fcfs and lpm). `filed` counts the heap entries
    pushed, popped or rebuilt and `read` those `ordered` reads: the ranking's work, for checks."""

    def __init__(self, queue: Queue, pricing: Callable[[], Predictor | None]) -> None:
        self._q = queue
        self._pricing = pricing
        self._model: Predictor | None = None  # what the current prices were computed with
        self._versions = 0
        self._price: dict[int, float] = {}  # po: jct; srjf: jct at arrival; lpm: -cached; fcfs: arrival
        self.cached: dict[int, int] = {}  # cached_len at the last probe (current after `refresh`)
        self._cohort: dict[int, Cohort] = {}  # rid -> its cohort
        self._members: dict[Cohort, _Members] = {}
        # rank -> siblings -> the cohorts' heap; siblings 0 for a policy without a time term
        self._heaps: dict[int, dict[int, list[Entry]]] = {}
        self._live: Counter[tuple[int, int]] = Counter()  # live entries per heap
        self._ranks: Counter[int] = Counter()  # waiting requests per rank
        self._calls: dict[int, set[Cohort]] = {}  # the cohorts of each client call with waiting members
        self._declared: dict[tuple[int, ...], set[int]] = {}  # shared declared prefix -> its declarers
        self._declared_lens: Counter[int] = Counter()
        self._group: dict[tuple[int, ...], dict[int, float]] = {}  # declared prefix -> rid -> per-item price
        self._probe: set[int] = set()  # to probe and price again
        self._refile: set[int] = set()  # to price again (cache unchanged)
        self._calls_changed: set[int] = set()
        self._groups_changed: set[tuple[int, ...]] = set()
        self._dirty: set[Cohort] = set()  # cohorts whose members or size changed: to file again
        self.filed = 0
        self.read = 0

    # ---- what changed ----------------------------------------------------------------------

    def _key(self, w: Waiting) -> tuple[int, ...] | None:
        """The shared prefix `w` declares (po prices it per request of its step), if any."""
        p = w.req.cache_prefix_len or 0
        if self._q.config.policy != "po" or p < self._q.config.min_shared_prefix:
            return None
        return tuple(w.req.input_ids[:p])

    def _groups_of(self, ids: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """The declared prefixes `ids` starts with: the groups whose membership it is part of."""
        for n in self._declared_lens:
            if n <= len(ids) and (key := tuple(ids[:n])) in self._declared:
                yield key

    def add(self, w: Waiting) -> None:
        self._probe.add(w.rid)
        rank = self._q.config.rank(w.req)
        self._ranks[rank] += 1
        cohort = (w.call if w.call >= 0 else -1 - w.rid, w.arrival, rank)
        self._cohort[w.rid] = cohort
        self._members.setdefault(cohort, _Members()).live += 1
        self._dirty.add(cohort)
        if w.call >= 0:
            self._calls.setdefault(w.call, set()).add(cohort)
            self._calls_changed.add(w.call)
        if (key := self._key(w)) is not None:
            self._declared.setdefault(key, set()).add(w.rid)
            self._declared_lens[len(key)] += 1
        self._groups_changed.update(self._groups_of(w.req.input_ids))

    def remove(self, w: Waiting) -> None:
        rid = w.rid
        cohort = self._cohort.pop(rid)
        if (price := self._price.pop(rid, None)) is not None:
            self._members[cohort].sorted.remove((price, rid))
            self.filed += 1
        self.cached.pop(rid, None)
        self._probe.discard(rid)
        self._refile.discard(rid)
        self._members[cohort].live -= 1
        self._dirty.add(cohort)
        rank = cohort[2]
        self._ranks[rank] -= 1
        if not self._ranks[rank]:
            del self._ranks[rank]
        if w.call >= 0:
            self._calls_changed.add(w.call)
        self._groups_changed.update(self._groups_of(w.req.input_ids))
        if (key := self._key(w)) is not None:
            self._declared[key].discard(rid)
            if not self._declared[key]:
                del self._declared[key]
                self._group.pop(key, None)
            self._declared_lens[len(key)] -= 1
            if not self._declared_lens[len(key)]:
                del self._declared_lens[len(key)]

    def cache_changed(self, changes: Changes) -> list[int]:
        """The cache changed (`Changes`): the requests it may have changed are probed again.
        Returns every request the next `refresh` probes (these and the newly added)."""
        if changes is None:
            self._probe.update(self._q.waiting)
            return list(self._probe)
        by_ids = self._q.by_ids
        for prefix in changes:
            i = bisect.bisect_left(by_ids, prefix, key=itemgetter(0))
            while i < len(by_ids) and by_ids[i][0][: len(prefix)] == prefix:
                self._probe.add(by_ids[i][1])
                i += 1
        return list(self._probe)

    # ---- pricing -----------------------------------------------------------------------------

    def refresh(self, cached_len: CachedLen[Any], batchable: Batchable[Any]) -> None:
        """Price and re-file what changed since the last refresh; after it `cached` and every
        heap are current, and every heap's top is live."""
        model = self._pricing()
        waiting, policy = self._q.waiting, self._q.config.policy
        if model is not self._model:  # new coefficients: every price moves
            self._model = model
            self._refile.update(rid for rid in waiting if rid in self._price)
            self._groups_changed.update(self._declared)
        if policy == "po":  # a call's size is in its members' score: its cohorts move
            for call in self._calls_changed:
                self._dirty.update(self._calls.get(call, ()))
        self._calls_changed.clear()
        for rid in self._probe:
            w = waiting[rid]
            n = cached_len(w.req)
            if self.cached.get(rid) != n or rid not in self._price:
                self.cached[rid] = n
                self._groups_changed.update(self._groups_of(w.req.input_ids))
                self._refile.add(rid)
        self._probe.clear()
        if policy == "po":
            for key in self._groups_changed:
                if key in self._declared:
                    # Only the members whose group price moved are filed again: the others are
                    # priced alone, as they were (a large call's step moves its next step's
                    # members, not all that still wait).
                    old, self._group[key] = self._group.get(key, {}), self._group_prices(key, batchable)
                    new = self._group[key]
                    members = self._declared[key]
                    self._refile.update(
                        r for r in old.keys() | new.keys() if r in members and old.get(r) != new.get(r)
                    )
        self._groups_changed.clear()
        for rid in self._refile:
            self._file(waiting[rid])
        self._refile.clear()
        touched: set[tuple[int, int]] = set()
        for cohort in self._dirty:
            self._file_cohort(cohort, touched)
        self._dirty.clear()
        for rank, siblings in touched:
            self._clean(rank, siblings)

    def _group_prices(self, key: tuple[int, ...], batchable: Batchable[Any]) -> dict[int, float]:
        """po's price per request of the step the requests starting with `key` would share: the
        member with the most cached computes the prefix, the others read it from it. Empty when
        they would not share one step (each is then priced alone)."""
        assert self._model is not None, "po prices with a JCT model"
        group = self._q.group_step(key, lambda m: self.cached[m.rid])
        chosen = batchable([m.req for m in group]) if len(group) > 1 else []
        if len(chosen) < 2:
            return {}
        items = [(len(group[i].req.input_ids), c) for i, c in chosen]
        price = self._model.predict_items(items) / len(chosen)
        return {group[i].rid: price for i, _ in chosen}

    def price(self, w: Waiting) -> float:
        """`w`'s price (current after `refresh`): what its score starts from."""
        return self._price[w.rid]

    def _file(self, w: Waiting) -> None:
        """Price `w` and file it in its cohort's heap."""
        cfg, rid, n = self._q.config, w.rid, self.cached[w.rid]
        model = self._model
        if cfg.policy == "fcfs":
            price = w.arrival
        elif cfg.policy == "lpm":
            price = -float(n)
        elif cfg.policy == "srjf":
            assert model is not None, "srjf prices with a JCT model"
            # fixed at the first pricing after arrival (the cache cannot change before it)
            price = self._price.get(rid, model.predict(len(w.req.input_ids), n))
        else:
            assert model is not None, "po prices with a JCT model"
            own = model.predict(len(w.req.input_ids), n)
            group = self._key(w)
            price = own if group is None else min(own, self._group.get(group, {}).get(rid, own))
        cohort = self._cohort[rid]
        members = self._members[cohort]
        if (old := self._price.get(rid)) is not None:
            if old == price:
                return
            members.sorted.remove((old, rid))
            self.filed += 1
        self._price[rid] = price
        members.sorted.add((price, rid))
        self.filed += 1
        self._dirty.add(cohort)

    def _file_cohort(self, cohort: Cohort, touched: set[tuple[int, int]]) -> None:
        """File `cohort`'s entry again, for its best live member and its call's current size:
        a stale entry's key is never reused. A cohort with no waiting member is dropped."""
        members = self._members[cohort]
        rank, arrival = cohort[2], cohort[1]
        old = None if members.filed is None else members.filed[:2]
        if not members.live:
            del self._members[cohort]
            if cohort[0] >= 0:
                calls = self._calls[cohort[0]]
                calls.discard(cohort)
                if not calls:
                    del self._calls[cohort[0]]
            if old is not None:
                self._live[old] -= 1
                touched.add(old)
            return
        if not members.sorted:  # not priced yet: filed at the refresh that prices it
            return
        price, rid = members.sorted[0]
        siblings = 0
        key = price
        if self._q.config.policy == "po":
            siblings = self._q.siblings(self._q.waiting[rid])
            key = price + self._q.config.fairness_lambda * arrival / siblings
        if members.filed == (rank, siblings, key, rid):
            return
        if old is not None:
            self._live[old] -= 1
            touched.add(old)
        self._versions += 1
        members.version = self._versions
        members.filed = (rank, siblings, key, rid)
        self._live[rank, siblings] += 1
        h = self._heaps.setdefault(rank, {}).setdefault(siblings, [])
        heapq.heappush(h, (key, arrival, rid, self._versions, cohort))
        self.filed += 1
        if len(h) > 2 * self._live[rank, siblings] + 64:
            h[:] = [e for e in h if self._live_entry(e)]
            heapq.heapify(h)
            self.filed += len(h)

    def _live_entry(self, e: Entry) -> bool:
        members = self._members.get(e[4])
        return members is not None and members.version == e[3]

    def _clean(self, rank: int, siblings: int) -> None:
        """Pop the stale entries off a heap's top; drop the heap once it holds nothing live."""
        heaps = self._heaps.get(rank, {})
        h = heaps.get(siblings)
        if h is None:
            return
        while h and not self._live_entry(h[0]):
            heapq.heappop(h)
            self.filed += 1
        if not h:
            del heaps[siblings]
            self._live.pop((rank, siblings), None)
            if not heaps:
                del self._heaps[rank]

    # ---- order -------------------------------------------------------------------------------

    def ranks(self) -> list[int]:
        """The ranks (priority classes) that have waiting requests, most urgent first."""
        return sorted(self._ranks)

    def _bound(self, key: float, siblings: int, now: float) -> float:
        """No more than the score of an entry keyed `key` in a heap of `siblings` at `now`."""
        if not siblings:
            return key
        shift = self._q.config.fairness_lambda * now / siblings
        return key - shift - _MARGIN * (abs(key) + shift + 1.0)

    def ordered(
        self, ranks: Iterable[int], score: Callable[[Waiting], float], now: float
    ) -> Iterator[Waiting]:
        """The waiting requests of `ranks` (ascending), each rank in policy order: by
        `score(w)` (the policy's exact score, called once per request reached, which may add to
        the heap's key but never subtract), then arrival, then rid. Lazy: a heap entry is read
        only when nothing still unread could come before it. Reads the heaps as `refresh` left
        them and changes nothing."""
        waiting, lam = self._q.waiting, self._q.config.fairness_lambda
        cohorts_of = self._members
        for rank in ranks:
            # the heaps read: the class's cohort heaps (cohort None), then the member heaps of
            # the cohorts reached, each with its siblings and its members' starvation credit
            heaps: list[tuple[Sequence[Any], int, float, Cohort | None]] = []
            frontier: list[tuple[float, float, int, int, int]] = []  # (bound, arrival, rid, heap, index)
            for s, cohorts in self._heaps.get(rank, {}).items():
                key, arrival, rid, _, _ = cohorts[0]
                frontier.append((self._bound(key, s, now), arrival, rid, len(heaps), 0))
                heaps.append((cohorts, s, 0.0, None))
            heapq.heapify(frontier)
            ready: list[tuple[float, float, int]] = []
            while frontier or ready:
                if ready and (not frontier or ready[0] < frontier[0][:3]):
                    yield waiting[heapq.heappop(ready)[2]]
                    continue
                _, arrival, rid, j, i = heapq.heappop(frontier)
                self.read += 1
                h, s, credit, cohort = heaps[j]
                if cohort is None:  # a cohort: its best member is read, the others join the frontier
                    e = h[i]
                    members = cohorts_of.get(e[4])
                    if members is not None and members.version == e[3]:
                        top = members.sorted[0][1]  # the entry's rid, after `refresh`
                        heapq.heappush(ready, (score(waiting[top]), arrival, top))
                        # the members' score less what `score` may add: exact, so that equal
                        # prices are read in rid order without reading them all first
                        credit = lam * max(0.0, now - arrival) / s if s else 0.0
                        if len(members.sorted) > 1:
                            price, rid = members.sorted[1]
                            heapq.heappush(frontier, (price - credit, arrival, rid, len(heaps), 1))
                            heaps.append((members.sorted, s, credit, e[4]))
                    for c in (2 * i + 1, 2 * i + 2):
                        if c < len(h):
                            key, arrival, rid, _, _ = h[c]
                            heapq.heappush(frontier, (self._bound(key, s, now), arrival, rid, j, c))
                else:  # a cohort's members in order: the next one joins the frontier
                    heapq.heappush(ready, (score(waiting[rid]), arrival, rid))
                    if i + 1 < len(h):
                        price, rid = h[i + 1]
                        heapq.heappush(frontier, (price - credit, arrival, rid, j, i + 1))
