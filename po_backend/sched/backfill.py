"""How long a batch step may run while online calls have a latency target.

An online call that arrives while a batch step runs waits for the rest of that step, then takes
what it would take alone: its own step and any online calls ahead of it. So a batch step may last
the target minus what online calls take without batch work in their way, measured: every finished
online call reports its latency and the part of it spent waiting on batch steps, and the budget is
the target minus a high quantile of the difference over the recent calls, divided by how much
recent batch steps overran their predicted time (the budget is in predicted seconds). Heavier online traffic
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
# How far batch steps may overrun their prediction: the budget is in predicted seconds, so it is
# divided by this quantile of the recent batch steps' measured / predicted times (a step the JCT
# model under-prices, e.g. a prefix step over a long cached prefix, would otherwise overrun the
# share of the target it was sized for). Not the maximum: one outlier (a page fault storm, another
# process) would shrink every batch step for a whole window.
OVERRUN_QUANTILE = 0.9


def _quantile(values: deque[float], q: float) -> float:
    """The q-quantile of `values` (non-empty): the smallest value with at least q of them at or
    below it."""
    return sorted(values)[max(0, math.ceil(q * len(values)) - 1)]


class BackfillBudget:
    """The predicted seconds a batch step may take, from the online calls measured so far."""

    def __init__(self, target_s: float, window: int = BACKFILL_WINDOW) -> None:
        if not (target_s > 0 and math.isfinite(target_s)):
            raise ValueError(f"the online latency target must be a finite number > 0, got {target_s}")
        self.target_s = target_s
        self._own: deque[float] = deque(maxlen=window)  # online latency minus waits on batch steps
        self._batch_steps: deque[tuple[float, float]] = deque(maxlen=window)  # (start, end)
        self._overrun: deque[float] = deque(maxlen=window)  # batch steps' measured / predicted

    @property
    def overrun(self) -> float:
        """What the budget is divided by: the recent batch steps' measured / predicted seconds
        (`OVERRUN_QUANTILE`), at least 1 (a model that over-prices steps leaves batch that slack)."""
        return max(1.0, _quantile(self._overrun, OVERRUN_QUANTILE)) if self._overrun else 1.0

    @property
    def budget_s(self) -> float:
        """Predicted seconds: the target minus the online calls' own time, within the bounds,
        over the batch steps' overrun."""
        lo, hi = BACKFILL_SHARE_BOUNDS
        if not self._own:
            return self.target_s * BACKFILL_SLO_SHARE / self.overrun
        own = _quantile(self._own, ONLINE_QUANTILE)
        return min(max(self.target_s - own, lo * self.target_s), hi * self.target_s) / self.overrun

    def step_done(
        self,
        start: float,
        end: float,
        batch: bool,
        online_arrivals: Sequence[float],
        predicted: float = math.nan,
    ) -> None:
        """A step ran from `start` to `end`: a batch step (`batch`) or not, answering online calls
        that arrived at `online_arrivals`; `predicted`: the seconds it was priced at (nan: unknown)."""
        if batch:
            self._batch_steps.append((start, end))
            if predicted > 0:  # nan compares False
                self._overrun.append((end - start) / predicted)
        for arrival in online_arrivals:
            blocked = sum(max(0.0, min(e, start) - max(s, arrival)) for s, e in self._batch_steps)
            self._own.append(max(0.0, end - arrival - blocked))
