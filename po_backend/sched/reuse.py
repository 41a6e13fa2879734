"""The reuse a request's admission destroys: eviction-aware pricing for prefix-aware SRJF.

A request that stores a prefix the pool has no room for evicts cached prefixes, least valuable
first by the pool's own rule. Those that waiting requests were about to read are then computed
again: that is a cost of running the request now, as real as its own forward. `ReuseCost` prices
it, in predicted seconds, from the pool's eviction order (`Pool.eviction_order`, the order the
engine's radix cache and the simulator's LRU really evict in) and the waiting requests that read
what would go. A request that fits in the free space, or only evicts what nobody waiting reads,
costs nothing more, so the policy is plain prefix-aware SRJF whenever the pool has room.

Torch-free; the engine's radix cache (through `CachePool`) and the simulator's `PrefixLRU` are
both `Pool`s, so the server and the simulator run the same policy.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Protocol, runtime_checkable

from po_backend.sched.batching import Request


@dataclass(frozen=True)
class Victim:
    """A cached segment eviction would free next: tokens `key[start:]` of the cached path `key`
    (from the first token). The first `start` tokens stay cached (other paths share them)."""

    key: tuple[int, ...]
    start: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < len(self.key):
            raise ValueError(f"a victim frees at least one token: start {self.start}, key of {len(self.key)}")

    @property
    def tokens(self) -> int:
        return len(self.key) - self.start


@runtime_checkable
class Pool(Protocol):
    """What eviction-aware pricing reads of a prefix pool (read-only: nothing is evicted)."""

    def store_len(self, req: Any) -> int:
        """Leading tokens of `req` its step keeps in the pool."""

    def free_tokens(self) -> int:
        """Tokens the pool holds without evicting anything."""

    def capacity(self) -> int:
        """Tokens the pool holds at most."""

    def eviction_order(self) -> Iterator[Victim]:
        """The unlocked cached segments in the order the pool would evict them."""


class Evictable(Protocol):
    """A prefix cache's side of a `Pool` (`engine.cache.RadixCache`)."""

    def free_tokens(self) -> int: ...

    def capacity(self) -> int: ...

    def eviction_order(self) -> Iterator[Victim]: ...


@dataclass(frozen=True)
class CachePool:
    """A `Pool` made of a cache and its owner's rule of what a request stores (the engine's
    `store_len`: suffix discarding decides it, not the cache)."""

    cache: Evictable
    store: Callable[[Any], int]

    def store_len(self, req: Any) -> int:
        return self.store(req)

    def free_tokens(self) -> int:
        return self.cache.free_tokens()

    def capacity(self) -> int:
        return self.cache.capacity()

    def eviction_order(self) -> Iterator[Victim]:
        return self.cache.eviction_order()


class ReuseCost:
    """For one pick: the predicted seconds of cache reuse each candidate's admission destroys.

    `waiting` is the queue sorted by token ids, as (ids, request) pairs: the requests reading a
    segment are then one contiguous run of it (they all start with its path up to its first
    token). Victims are drawn from the pool lazily, as far as the neediest candidate reaches, and
    each is valued once per pick."""

    def __init__(
        self,
        pool: Pool,
        waiting: Sequence[tuple[tuple[int, ...], Request]],
        cached_len: Callable[[Request], int],
        predict: Callable[[int, int], float],
    ) -> None:
        self._pool = pool
        self._waiting = waiting
        self._cached_len = cached_len
        self._predict = predict
        self._free = pool.free_tokens()
        self._order = pool.eviction_order()
        self._victims: list[Victim] = []
        self._values: list[float] = []

    def _victim(self, i: int) -> Victim | None:
        while len(self._victims) <= i:
            v = next(self._order, None)
            if v is None:
                return None
            self._victims.append(v)
            self._values.append(self._value(v))
        return self._victims[i]

    def _readers(self, v: Victim, cached: Callable[[Request], int]) -> Iterator[tuple[Request, int]]:
        """The waiting requests whose cached prefix runs into `v`'s segment, with that prefix."""
        head = v.key[: v.start + 1]
        i = bisect.bisect_left(self._waiting, head, key=itemgetter(0))
        while i < len(self._waiting) and self._waiting[i][0][: v.start + 1] == head:
            req = self._waiting[i][1]
            n = cached(req)
            if n > v.start:
                yield req, n
            i += 1

    def _value(self, v: Victim) -> float:
        """Seconds the waiting readers of `v` would spend recomputing it. Summed over a path's
        segments (a leaf, then its parent) the readers' losses add up exactly: each segment
        prices the tokens between its start and its end."""
        total = 0.0
        for req, n in self._readers(v, self._cached_len):
            n_input = len(req.input_ids)
            total += self._predict(n_input, v.start) - self._predict(n_input, min(n, len(v.key)))
        return max(0.0, total)

    def cost(self, req: Request) -> float:
        """Seconds of waiting requests' reuse that running `req` now destroys: the value of the
        segments its stored prefix evicts, beyond the pool's free space. Its own cached path is
        locked while it runs, so that is skipped, as the pool skips it."""
        cached = self._cached_len(req)
        need = self._pool.store_len(req) - cached - self._free
        if need <= 0:
            return 0.0
        ids = tuple(req.input_ids)
        freed, total, i = 0, 0.0, 0
        while freed < need:
            v = self._victim(i)
            if v is None:
                break
            if not (cached > v.start and ids[: v.start + 1] == v.key[: v.start + 1]):
                freed += v.tokens
                total += self._values[i]
            i += 1
        return total
