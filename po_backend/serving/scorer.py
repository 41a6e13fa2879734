"""What the engine loop drives: a scorer (`Engine`, `HFScorer`) and the statistics it reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from po_backend.core.request import ScoreRequest, ScoreResult
from po_backend.sched.reuse import CachePool


class ScorerStats(Protocol):
    @property
    def hit_rate(self) -> float: ...


class Scorer(Protocol):
    """What the loop drives (`Engine`, `HFScorer`). Only the worker thread calls these, except
    `validate`, which is called by the submitting thread and must only read."""

    def validate(self, req: ScoreRequest) -> None:
        """Raise a typed error (po_backend.core.errors) for a request that can never run."""

    def step(self, requests: Sequence[ScoreRequest], ranks: Sequence[int] | None = None) -> list[ScoreResult]:
        """Run one step over the requests chosen by `batchable`; a result per request, in order.
        `ranks`: each request's class for the prefix cache (`SchedulerConfig.cache_rank`), for a
        cache that keeps the more urgent classes' prefixes first."""

    def cached_len(self, req: ScoreRequest) -> int:
        """Leading tokens of `req` the scorer's cache would serve now (read-only)."""

    def cache_changes(self) -> Sequence[tuple[int, ...]] | None:
        """Since the last call, the token prefixes every request whose `cached_len` changed
        starts with; None when anything may have changed (`sched.ranking.Changes`)."""

    def batchable(self, candidates: Sequence[ScoreRequest]) -> list[tuple[int, int]]:
        """The candidates (the first always included) that can share one step, each as (index,
        tokens it reads from the cache or a batch-mate instead of computing)."""

    def stats(self) -> ScorerStats: ...

    def flush_cache(self) -> None: ...

    def cache_pool(self) -> CachePool | None:
        """The scorer's prefix cache as the scheduler sees it (eviction order); None: no cache."""
