"""Trace-driven simulation of the scheduler: the real `Scheduler` and policies, a prefix cache (the
engine's radix tree, `radix.RadixLRU`, or whole declared prefixes evicted whole, `PrefixLRU`, which
the held-out and cluster runs still use), and step times from a JCT model on a virtual clock.

No model, no threads, no wall clock: the same trace gives the same answer on any machine. It
separates what a policy does (order, cache hits, batching) from what the machine does (a CPU shared
with other tenants changes step times by tens of percent between runs, which swamps the
differences between policies in a measured sweep). Used by the scheduler's unit tests and by
`benchmarks/bench_schedule.py --simulate`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from po_backend.core.request import common_prefix, sorted_neighbours
from po_backend.sched.batching import Request
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.reuse import Victim
from po_backend.sched.scheduler import Scheduler
from po_backend.sim.pool import DeclaredPool
from po_backend.sim.radix import RadixLRU


class StepModel(Protocol):
    """Seconds of a step (`po_backend.sched.jct.JCTModel`): what the scheduler predicts, and here also
    what the simulated step takes."""

    def predict(self, n_input: int, n_cached: int, n_items: int = 1) -> float: ...

    def predict_items(self, items: Sequence[tuple[int, int]]) -> float: ...


class PrefixLRU(DeclaredPool):
    """A prefix cache of whole declared prefixes, least recently used evicted first, holding at
    most `capacity_tokens` tokens. `batchable` is the engine's rule (`scheduler.fit_batch`): a
    token budget, and a prefix that several requests of a step declare computed once, by the
    first (the others read it from it in the same forward).

    Cheap enough for 50,000-request runs (`cluster_sim`), where the scheduler asks `cached_len` of
    every waiting request before every step: the cached prefixes are kept sorted by token ids, so
    a lookup costs two prefix comparisons (the longest prefix a sequence shares with a set is
    shared with one of its neighbours in sorted order) instead of one per cached prefix; a
    request's answer is kept until the set of cached prefixes changes (a hit only refreshes
    recency); recency is a counter per prefix, so no step hashes a thousands-token key."""

    def __init__(self, capacity_tokens: int, max_batch_tokens: int = 10**9) -> None:
        super().__init__(capacity_tokens, max_batch_tokens)
        self._keys: list[tuple[int, ...]] = []  # sorted
        self._used: list[int] = []  # aligned with _keys: the tick it was last stored or hit
        # aligned with _keys: the priority class (scheduler rank) of the request that last stored
        # or hit it; less urgent prefixes are evicted first, as in the engine's radix cache
        self._rank: list[int] = []
        self._tick = 0
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._keys)

    def _match(self, req: Request) -> int:
        return min(self._longest_match(tuple(req.input_ids))[1], req.reusable_len)

    def _longest_match(self, ids: tuple[int, ...]) -> tuple[int, int]:
        """(index, shared ids) of the cached prefix sharing the most leading ids with `ids`;
        (0, 0) when none does."""
        return max(sorted_neighbours(self._keys, ids), key=lambda jn: jn[1], default=(0, 0))

    def free_tokens(self) -> int:
        return self.capacity_tokens - self._tokens

    def _shared(self, i: int) -> int:
        """Leading tokens `_keys[i]` shares with another cached prefix (one of its neighbours)."""
        key = self._keys[i]
        return max(
            (common_prefix(key, self._keys[j]) for j in (i - 1, i + 1) if 0 <= j < len(self._keys)), default=0
        )

    def _log(self, i: int) -> None:
        """Log `_keys[i]` as changed (about to be dropped, or just stored)."""
        self._changes.append(self._keys[i][: self._shared(i) + 1])

    def _victim_key(self, i: int) -> tuple[int, int]:
        """Eviction order: the less urgent class first, then least recently used."""
        return -self._rank[i], self._used[i]

    def eviction_order(self) -> Iterator[Victim]:
        """The cached prefixes in `step`'s eviction order (`_victim_key`), each keeping cached
        what it shares with its neighbours (`reuse.Pool`)."""
        for i in sorted(range(len(self._keys)), key=self._victim_key):
            key, shared = self._keys[i], self._shared(i)
            if shared < len(key):
                yield Victim(key, shared)

    def step(self, reqs: Sequence[Request], ranks: Sequence[int] | None = None) -> list[int]:
        """Run a step: each request's cached tokens before it, then its declared prefix cached.
        `ranks`: each request's class for the cache (`SchedulerConfig.cache_rank`; default all
        0), which the prefix it read and the one it stores take (recency: only the stored one)."""
        hits = [self.cached_len(r) for r in reqs]
        ranks = [0] * len(reqs) if ranks is None else ranks
        # Every read before any store, as in the engine: a store may evict what a mate read. The
        # engine's tree gives the reader's class to the tokens read only; a prefix here is one
        # entry, so a read of part of it (a few template tokens two prompts share) leaves its class.
        for r, rank, hit in zip(reqs, ranks, hits, strict=True):
            j = self._longest_match(tuple(r.input_ids))[0]
            if hit and hit >= len(self._keys[j]):
                self._rank[j] = rank
        for r, rank in zip(reqs, ranks, strict=True):
            key = tuple(r.input_ids[: r.cache_prefix_len or 0])
            if not key or len(key) > self.capacity_tokens:
                continue
            self._tick += 1
            i = bisect.bisect_left(self._keys, key)
            if i < len(self._keys) and self._keys[i] == key:
                self._used[i] = self._tick
                self._rank[i] = rank
                continue
            # The cached prefix this key extends (a long request's previous prefix step): the
            # engine's tree holds those tokens once, so the new key takes its place.
            j, shared = self._longest_match(key)
            if shared and shared == len(self._keys[j]):
                self._log(j)
                self._tokens -= len(self._keys.pop(j))
                del self._used[j], self._rank[j]
                i -= j < i
            self._keys.insert(i, key)
            self._used.insert(i, self._tick)
            self._rank.insert(i, rank)
            self._tokens += len(key)
            self._log(i)
            while self._tokens > self.capacity_tokens:
                old = min(range(len(self._used)), key=self._victim_key)
                self._log(old)
                self._tokens -= len(self._keys.pop(old))
                del self._used[old], self._rank[old]
            self._memo.clear()
        return hits


@dataclass(frozen=True)
class SimRun:
    """One simulated request: when it arrived, started and ended, and what it found cached."""

    rid: int  # index in the trace
    arrival: float
    start: float
    end: float
    cached: int  # tokens read from the cache or a batch-mate instead of computed
    step: int  # index of the step it ran in


class VirtualClock:
    """The scheduler's clock in a simulation: it reads `now`, which the event loop advances."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(
    config: SchedulerConfig,
    model: StepModel,
    trace: Sequence[tuple[float, Request]],
    cache: PrefixLRU | RadixLRU,
) -> list[SimRun]:
    """Run `trace` ((arrival seconds, request), any order) to the end: admit what has arrived,
    pick, advance the clock by the model's time of the step. Results in completion order."""
    clock = VirtualClock()
    sched = Scheduler(config, model, clock)
    order = sorted(range(len(trace)), key=lambda i: trace[i][0])
    out: list[SimRun] = []
    i = steps = 0
    while i < len(order) or len(sched):
        while i < len(order) and trace[order[i]][0] <= clock.now:
            rid = order[i]
            sched.add(rid, trace[rid][1], arrival=trace[rid][0])
            i += 1
        if not len(sched):
            clock.now = trace[order[i]][0]
            continue
        pick = sched.pick(cache.cached_len, cache.batchable, cache, cache.changes())
        assert pick is not None, "a non-empty queue gives a pick"
        start = clock.now
        if pick.prefix_only:  # a long batch request's leading tokens, cached; it stays queued
            prefix = pick.prefix_request()
            cache.step([prefix], [config.cache_rank(prefix)])
            clock.now += model.predict_items(pick.items)
            sched.step_done(start, clock.now, [(prefix, start)], clock.now - start, prefix_step=True)
            steps += 1
            continue
        hits = cache.step([e.req for e in pick.entries], [config.cache_rank(e.req) for e in pick.entries])
        # What the pick read covers the cache's hits; beyond them: prefixes read from batch-mates.
        assert all(h <= c for h, c in zip(hits, pick.n_cached, strict=True)), "stale cache state"
        clock.now += model.predict_items(pick.items)
        sched.step_done(start, clock.now, [(e.req, e.arrival) for e in pick.entries], clock.now - start)
        out += [
            SimRun(e.rid, e.arrival, start, clock.now, c, steps)
            for e, c in zip(pick.entries, pick.n_cached, strict=True)
        ]
        steps += 1
    return out
