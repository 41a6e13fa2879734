"""The waiting queue in policy order, kept up to date by what changes instead of re-priced whole
before every step.

A request's score is `price - lambda * wait / siblings` (po; the other policies have no time term),
where only the price depends on the cache. Requests are filed in heaps by (priority class, call
siblings), keyed by `price + lambda * arrival / siblings`: within one heap the order does not move
with the clock, so a step re-files only the requests whose price changed (their cached prefix, the
group of requests sharing their declared prefix, their call's size), and the best request of a
class is the best of a few heap tops. A pick reads the heaps in order lazily (`Ranking.ordered`),
as far as it needs: the head, then the step's candidates. Stale entries are skipped and dropped
once they outnumber the live ones.

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

from po_backend.sched.batching import Batchable, CachedLen
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.steps import Predictor, Waiting

# What a cache reports between two picks (see the module docstring).
Changes = Sequence[tuple[int, ...]] | None
# (key, arrival, rid, version): a heap entry; live while `version` is the request's current one
Entry = tuple[float, float, int, int]
# (score, arrival, rid): the order the policy sorts a class by, lowest first
Order = tuple[float, float, int]
# A heap's key may be rounded differently from the score it stands for: bounds carry this margin.
_MARGIN = 1e-9


class Queue(Protocol):
    """What the ranking reads of the scheduler's queue."""

    config: SchedulerConfig

    @property
    def waiting(self) -> dict[int, Waiting]: ...

    @property
    def by_ids(self) -> list[tuple[tuple[int, ...], int]]: ...

    def siblings(self, w: Waiting) -> int: ...

    def sharing(self, key: tuple[int, ...]) -> set[int]: ...


class Ranking:
    """Prices and heaps of the waiting requests (module docstring). `pricing`: the model that
    prices po's and srjf's requests (None for fcfs and lpm)."""

    def __init__(self, queue: Queue, pricing: Callable[[], Predictor | None]) -> None:
        self._q = queue
        self._pricing = pricing
        self._model: Predictor | None = None  # what the current prices were computed with
        self._version: dict[int, int] = {}
        self._versions = 0
        self._price: dict[int, float] = {}  # po: jct; srjf: jct at arrival; lpm: -cached; fcfs: arrival
        self.cached: dict[int, int] = {}  # cached_len at the last probe (current after `refresh`)
        # rid -> its heap: (rank, siblings), siblings 0 for a policy without a time term
        self._where: dict[int, tuple[int, int]] = {}
        self._heaps: dict[tuple[int, int], list[Entry]] = {}
        self._live: Counter[tuple[int, int]] = Counter()
        self._ranks: Counter[int] = Counter()  # waiting requests per rank
        self._calls: dict[int, set[int]] = {}  # waiting rids per client call
        self._declared: dict[tuple[int, ...], set[int]] = {}  # shared declared prefix -> its declarers
        self._declared_lens: Counter[int] = Counter()
        self._group: dict[tuple[int, ...], dict[int, float]] = {}  # declared prefix -> rid -> per-item price
        self._probe: set[int] = set()  # to probe and price again
        self._refile: set[int] = set()  # to price again (cache unchanged)
        self._calls_changed: set[int] = set()
        self._groups_changed: set[tuple[int, ...]] = set()

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
        self._ranks[self._q.config.rank(w.req)] += 1
        if w.call >= 0:
            self._calls.setdefault(w.call, set()).add(w.rid)
            self._calls_changed.add(w.call)
        if (key := self._key(w)) is not None:
            self._declared.setdefault(key, set()).add(w.rid)
            self._declared_lens[len(key)] += 1
        self._groups_changed.update(self._groups_of(w.req.input_ids))

    def remove(self, w: Waiting) -> None:
        rid = w.rid
        self._version.pop(rid, None)
        self._price.pop(rid, None)
        self.cached.pop(rid, None)
        self._probe.discard(rid)
        self._refile.discard(rid)
        if (where := self._where.pop(rid, None)) is not None:
            self._live[where] -= 1
        rank = self._q.config.rank(w.req)
        self._ranks[rank] -= 1
        if not self._ranks[rank]:
            del self._ranks[rank]
        if w.call >= 0:
            members = self._calls[w.call]
            members.discard(rid)
            if members:
                self._calls_changed.add(w.call)
            else:
                del self._calls[w.call]
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
        heap are current."""
        model = self._pricing()
        waiting, policy = self._q.waiting, self._q.config.policy
        if model is not self._model:  # new coefficients: every price moves
            self._model = model
            self._refile.update(rid for rid in waiting if rid in self._price)
            self._groups_changed.update(self._declared)
        for call in self._calls_changed:
            self._refile.update(self._calls.get(call, ()))
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
                    self._group[key] = self._group_prices(key, batchable)
                    self._refile.update(self._declared[key])
        self._groups_changed.clear()
        for rid in self._refile:
            self._file(waiting[rid])
        self._refile.clear()

    def _group_prices(self, key: tuple[int, ...], batchable: Batchable[Any]) -> dict[int, float]:
        """po's price per request of the step the requests starting with `key` would share: the
        member with the most cached computes the prefix, the others read it from it. Empty when
        they would not share one step (each is then priced alone)."""
        assert self._model is not None, "po prices with a JCT model"
        group = sorted((self._q.waiting[r] for r in self._q.sharing(key)), key=lambda m: -self.cached[m.rid])
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
        cfg, rid, n = self._q.config, w.rid, self.cached[w.rid]
        model = self._model
        siblings = 0
        if cfg.policy == "fcfs":
            price = key = w.arrival
        elif cfg.policy == "lpm":
            price = key = -float(n)
        elif cfg.policy == "srjf":
            assert model is not None, "srjf prices with a JCT model"
            # fixed at the first pricing after arrival (the cache cannot change before it)
            price = key = self._price.get(rid, model.predict(len(w.req.input_ids), n))
        else:
            assert model is not None, "po prices with a JCT model"
            own = model.predict(len(w.req.input_ids), n)
            group = self._key(w)
            price = own if group is None else min(own, self._group.get(group, {}).get(rid, own))
            siblings = self._q.siblings(w)
            key = price + cfg.fairness_lambda * w.arrival / siblings
        self._price[rid] = price
        if (old := self._where.get(rid)) is not None:
            self._live[old] -= 1
        self._versions += 1
        self._version[rid] = self._versions
        where = (cfg.rank(w.req), siblings)
        self._where[rid] = where
        self._live[where] += 1
        heap = self._heaps.setdefault(where, [])
        heapq.heappush(heap, (key, w.arrival, rid, self._versions))
        if len(heap) > 2 * self._live[where] + 64:
            self._heaps[where] = [e for e in heap if self._version.get(e[2]) == e[3]]
            heapq.heapify(self._heaps[where])

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
        the heap's key but never subtract), then arrival, then rid. Lazy: a request's heap
        entries are read only when nothing still unread could come before it."""
        waiting = self._q.waiting
        for rank in ranks:
            heaps = [(s, h) for (r, s), h in self._heaps.items() if r == rank and h]
            frontier: list[tuple[float, float, int, int, int]] = []  # (bound, arrival, rid, heap, index)
            for j, (s, h) in enumerate(heaps):
                key, arrival, rid, _ = h[0]
                frontier.append((self._bound(key, s, now), arrival, rid, j, 0))
            heapq.heapify(frontier)
            ready: list[tuple[float, float, int]] = []
            while frontier or ready:
                if ready and (not frontier or ready[0] < frontier[0][:3]):
                    yield waiting[heapq.heappop(ready)[2]]
                    continue
                _, arrival, rid, j, i = heapq.heappop(frontier)
                s, h = heaps[j]
                if self._version.get(rid) == h[i][3]:
                    heapq.heappush(ready, (score(waiting[rid]), arrival, rid))
                for c in (2 * i + 1, 2 * i + 2):
                    if c < len(h):
                        key, arrival, rid, _ = h[c]
                        heapq.heappush(frontier, (self._bound(key, s, now), arrival, rid, j, c))
