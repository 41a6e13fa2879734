"""A scorer without a model for tests of the serving loop and the server around it: every step
answers at once with fixed log-probs, or raises while `broken` is set (a device error every step
hits). `EngineLoop` and `LoopService` take it in place of an engine (duck-typed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from po_backend.core.request import ScoreRequest, ScoreResult


class FakeScorer:
    vocab_size = 100
    tokenizer = None

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken

    def validate(self, req: ScoreRequest) -> None: ...

    def step(self, requests: Sequence[ScoreRequest], ranks: Sequence[int] | None = None) -> list[ScoreResult]:
        if self.broken:
            raise RuntimeError("device lost")
        top = [(t, -0.5 - t) for t in range(max(r.top_k for r in requests))]
        return [
            ScoreResult([-1.0] * len(r.label_token_ids), top, prompt_tokens=len(r.input_ids))
            for r in requests
        ]

    def cached_len(self, req: ScoreRequest) -> int:
        return 0

    def batchable(self, candidates: Sequence[ScoreRequest]) -> list[tuple[int, int]]:
        return [(0, 0)]

    def cache_changes(self) -> list[tuple[int, ...]]:
        return []

    def stats(self) -> Any:
        return type("S", (), {"hit_rate": 0.0})()

    def flush_cache(self) -> None: ...

    def cache_pool(self) -> None:
        return None
