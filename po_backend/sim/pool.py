"""What the simulator's two prefix pools share (`simulator.PrefixLRU`, whole declared prefixes;
`radix.RadixLRU`, the engine's tree): the engine's "declared" cache policy, its batching rule,
a request's cached length memoised until the pool changes, and the change log the scheduler's
ranking reads (`ranking.Changes`)."""

from __future__ import annotations

from collections.abc import Sequence

from po_backend.sched.batching import Request, fit_batch


class DeclaredPool:
    def __init__(self, capacity_tokens: int, max_batch_tokens: int = 10**9) -> None:
        if capacity_tokens < 0 or max_batch_tokens < 1:
            raise ValueError(
                f"need capacity_tokens >= 0 and max_batch_tokens >= 1, got {capacity_tokens}, {max_batch_tokens}"
            )
        self.capacity_tokens = capacity_tokens
        self.max_batch_tokens = max_batch_tokens
        self._memo: dict[int, tuple[Request, int]] = {}  # id(request) -> (request, cached_len)
        self._changes: list[tuple[int, ...]] = []  # since the last `changes`

    def _match(self, req: Request) -> int:
        """Tokens of `req` the pool holds now (memoised by `cached_len`)."""
        raise NotImplementedError

    def cached_len(self, req: Request) -> int:
        memo = self._memo.get(id(req))
        if memo is not None and memo[0] is req:
            return memo[1]
        n = self._match(req)
        self._memo[id(req)] = (req, n)
        return n

    def store_len(self, req: Request) -> int:
        """Only declared prefixes enter the pool (the engine's "declared" cache policy)."""
        return min(req.cache_prefix_len or 0, len(req.input_ids))

    def batchable(self, candidates: Sequence[Request]) -> list[tuple[int, int]]:
        return fit_batch(candidates, self.cached_len, self.store_len, self.max_batch_tokens)

    def capacity(self) -> int:
        return self.capacity_tokens

    def changes(self) -> list[tuple[int, ...]]:
        """The prefixes every request whose `cached_len` changed since the last call starts with
        (`ranking.Changes`)."""
        out, self._changes = self._changes, []
        return out
