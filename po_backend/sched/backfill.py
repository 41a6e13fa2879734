"""How long a batch step may run while online calls have a latency target.

An online call that arrives while a batch step runs waits for the rest of that step, then takes
what it would take alone: its own step and any online calls ahead of it. So a batch step may last
the target minus what online calls take without batch work in their way, measured: every finished
online call reports its latency and the part of it spent waiting on batch steps, and the budget is
the target minus a high quantile of the difference over the recent calls. Heavier online traffic
(longer queues among online calls, longer prompts) shrinks the batch steps; light traffic lets
them grow, within `BACKFILL_SHARE_BOUNDS` of the target.

Pure bookkeeping on the scheduler's clock (no threads, no wall clock), shared by the engine loop
and the simulator.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from po_backend.core.settings import BACKFILL_SHARE_BOUNDS, BACKFILL_SLO_SHARE, BACKFILL_WINDOW

# The tail the target is for (a P99 target): with fewer calls than 1 / (1 - q) in the window this
# is the slowest of them.
ONLINE_QUANTILE = 0.99


class BackfillBudget:
    """The predicted seconds a batch step may take, from the online calls measured so far."""

    def __init__(self, target_s: float, window: int = BACKFILL_WINDOW) -> None:
        if not (target_s > 0 and math.isfinite(target_s)):
            raise ValueError(f"the online latency target must be a finite number > 0, got {target_s}")
        self.target_s = target_s
        self._own: deque[float] = deque(maxlen=window)  # online latency minus waits on batch steps
        self._batch_steps: deque[tuple[float, float]] = deque(maxlen=window)  # (start, end)

    @property
    def budget_s(self) -> float:
        lo, hi = BACKFILL_SHARE_BOUNDS
        if not self._own:
            return self.target_s * BACKFILL_SLO_SHARE
        own = sorted(self._own)[max(0, math.ceil(ONLINE_QUANTILE * len(self._own)) - 1)]
        return min(max(self.target_s - own, lo * self.target_s), hi * self.target_s)

    def step_done(self, start: float, end: float, batch: bool, online_arrivals: Sequence[float]) -> None:
        """A step ran from `start` to `end`: a batch step (`batch`) or not, answering online calls
        that arrived at `online_arrivals`."""
        if batch:
            self._batch_steps.append((start, end))
        for arrival in online_arrivals:
            blocked = sum(max(0.0, min(e, start) - max(s, arrival)) for s, e in self._batch_steps)
            self._own.append(max(0.0, end - arrival - blocked))
