"""What a scorer has done: requests, forwards, prompt tokens computed and read from the cache."""

from __future__ import annotations

from dataclasses import dataclass

from po_backend.engine.cache import CacheStats


@dataclass(frozen=True)
class EngineStats:
    requests: int
    forwards: int
    prompt_tokens: int
    computed_tokens: int
    cached_tokens: int  # prompt tokens read from the prefix cache instead of computed
    cache: CacheStats | None
    pool_bytes: int
    activation_budget_bytes: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @classmethod
    def from_counts(
        cls, counts: dict[str, int], cache: CacheStats | None = None, pool_bytes: int = 0, budget: int = 0
    ) -> EngineStats:
        """From a scorer's running counts (requests, forwards, prompt, computed, cached tokens)."""
        return cls(
            requests=counts["requests"],
            forwards=counts["forwards"],
            prompt_tokens=counts["prompt"],
            computed_tokens=counts["computed"],
            cached_tokens=counts["cached"],
            cache=cache,
            pool_bytes=pool_bytes,
            activation_budget_bytes=budget,
        )
