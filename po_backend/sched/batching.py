"""The batching rule: which waiting requests can share one forward, and what each reads instead of
computing (from the cache or from a batch-mate that computes a shared prefix in the same forward).

Torch-free, shared by the engine's planner, the scheduler and the simulator, so a simulated step
batches as a real one. Also the request's shape every policy reads (`Request`)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from po_backend.core.request import sorted_neighbours


class Request(Protocol):
    """What the scheduler reads of a request (`po_backend.core.request.ScoreRequest` has it)."""

    @property
    def input_ids(self) -> tuple[int, ...]: ...

    @property
    def cache_prefix_len(self) -> int | None: ...

    @property
    def reusable_len(self) -> int: ...

    @property
    def priority(self) -> int | None: ...

    @property
    def pool(self) -> bool: ...  # a pooled answer (head, embedding): its prefix steps are pooled too


# The engine and the simulator pass functions of their own request type, so these are generic
# over it (a function of ScoreRequest is not a function of every Request). The Scheduler itself
# hands back to them the requests it was given, whatever their type, hence `Any` there.
R = TypeVar("R", bound=Request)
CachedLen = Callable[[R], int]  # tokens the cache serves now (read-only)
StoreLen = Callable[[R], int]  # leading tokens the request will keep in the cache
# (candidate index, tokens it reads instead of computing: from the cache or from a batch-mate)
Batchable = Callable[[Sequence[R]], list[tuple[int, int]]]


class BatchStores:
    """The prefixes that the requests of one forward compute and store, so a later request of the
    same forward can read a shared prefix from them instead of computing it again (in-batch
    prefix sharing: a user's profile sent by five waiting requests is computed once).

    Kept sorted by token ids: the stored prefix sharing the most with a new request is then one
    of its two neighbours in that order, so a lookup costs two prefix comparisons however large
    the batch. `fit_batch` and the engine's planner both ask this, so they agree on every share."""

    def __init__(self) -> None:
        self._ids: list[tuple[int, ...]] = []
        self._stores: list[tuple[int, int]] = []  # (store_len, owner), aligned with _ids

    def add(self, ids: tuple[int, ...], store_len: int, owner: int) -> None:
        """Request `owner` of this forward computes and stores ids[:store_len]."""
        i = bisect.bisect_left(self._ids, ids)
        self._ids.insert(i, ids)
        self._stores.insert(i, (store_len, owner))

    def shared(self, ids: tuple[int, ...], limit: int) -> tuple[int, int]:
        """(tokens of `ids` readable from an earlier request's store, at most `limit`; its owner),
        (0, -1) when none."""
        best, owner = 0, -1
        for j, shared in sorted_neighbours(self._ids, ids):
            store, o = self._stores[j]
            n = min(shared, store, limit)
            if n > best:
                best, owner = n, o
        return best, owner


def fit_batch(
    candidates: Sequence[R],
    cached_len: CachedLen[R],
    store_len: StoreLen[R],
    max_batch_tokens: int,
    share_in_batch: bool = True,
) -> list[tuple[int, int]]:
    """The candidates (in order, the first always included) that can share one forward, each
    with the tokens it reads instead of computing, up to max_batch_tokens of computed tokens.

    share_in_batch (the hybrid runner): a request reads the longest prefix it shares with what an
    earlier request of the forward stores, if that beats the cache, so a prefix shared by several
    waiting requests is computed once, in the same forward. Without it (the chunked baseline,
    which reads prefixes before computing anything) of requests that will store the same
    not-yet-cached prefix only the first joins; the others read it from the cache next step.

    The engine's `batchable` (cached_len = what its radix cache serves, store_len = what it will
    keep) and the simulator's both are this rule, so a simulated step batches as a real one."""
    chosen: list[tuple[int, int]] = []
    tokens = 0
    stores = BatchStores()
    computing: set[tuple[int, ...]] = set()
    for i, r in enumerate(candidates):
        ids = tuple(r.input_ids)
        hit, store = cached_len(r), store_len(r)
        reused = hit
        if share_in_batch:
            reused = max(hit, stores.shared(ids, r.reusable_len)[0])
        elif store > hit and ids[:store] in computing:
            continue
        new = len(ids) - reused
        if chosen and tokens + new > max_batch_tokens:
            continue
        if store > reused and share_in_batch:
            stores.add(ids, store, i)
        elif store > reused:
            computing.add(ids[:store])
        chosen.append((i, reused))
        tokens += new
    return chosen
