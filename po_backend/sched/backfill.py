"""How long a step may run while more urgent calls may arrive behind it.

A call that arrives while a less urgent step runs waits for the rest of that step, then takes
what it would take alone: its own step and any calls of its class ahead of it. So a step may
last at most `BACKFILL_ALONE_SHARE` of what the most urgent calls take without less urgent work in
their way (their P99 then stays within 1.5x of it) and, with a latency target, the target minus
that. Measured: every finished call of the most urgent class reports its latency and the part of
it spent waiting on less urgent steps; the budget uses a high quantile of the difference over the
recent calls, divided by how much recent steps overran their predicted time (the budget is in
predicted seconds). Heavier urgent traffic (longer queues among those calls, longer prompts) grows
what they take alone, and the target's part shrinks; before any is measured a step may take half
the target (`BACKFILL_SLO_SHARE`); without a target, never more than `DEFAULT_PRIORITY_STEP_S`.

Pure bookkeeping on the scheduler's clock (no threads, no wall clock), shared by the engine loop
and the simulator.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from po_backend.core.settings import (
    BACKFILL_ALONE_SHARE,
    BACKFILL_SHARE_BOUNDS,
    BACKFILL_SLO_SHARE,
    BACKFILL_WINDOW,
    DEFAULT_PRIORITY_STEP_S,
)

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
    """The predicted seconds a step may take, from the most urgent calls measured so far."""

    def __init__(self, target_s: float | None, window: int = BACKFILL_WINDOW) -> None:
        if target_s is not None and not (target_s > 0 and math.isfinite(target_s)):
            raise ValueError(f"the online latency target must be a finite number > 0, got {target_s}")
        self.target_s = target_s
        self._own: deque[float] = deque(maxlen=window)  # urgent latency minus waits on other steps
        self._batch_steps: deque[tuple[float, float]] = deque(maxlen=window)  # (start, end)
        self._overrun: deque[float] = deque(maxlen=window)  # steps' measured / predicted

    def forget_online(self) -> None:
        """A more urgent class than those measured appeared: what it takes alone is not known yet."""
        self._own.clear()

    @property
    def overrun(self) -> float:
        """What the budget is divided by: the recent batch steps' measured / predicted seconds
        (`OVERRUN_QUANTILE`), at least 1 (a model that over-prices steps leaves batch that slack)."""
        return max(1.0, _quantile(self._overrun, OVERRUN_QUANTILE)) if self._overrun else 1.0

    @property
    def budget_s(self) -> float:
        """Predicted seconds: `BACKFILL_ALONE_SHARE` of the urgent calls' own time and, with a
        target, no more than the target minus that time (within the bounds), over the overrun."""
        t = self.target_s
        if not self._own:
            return (DEFAULT_PRIORITY_STEP_S if t is None else t * BACKFILL_SLO_SHARE) / self.overrun
        own = _quantile(self._own, ONLINE_QUANTILE)
        if t is None:  # the default bound: a step cannot grow with a class that queues behind itself
            return min(BACKFILL_ALONE_SHARE * own, DEFAULT_PRIORITY_STEP_S) / self.overrun
        lo, hi = BACKFILL_SHARE_BOUNDS
        return min(BACKFILL_ALONE_SHARE * own, max(t - own, lo * t), hi * t) / self.overrun

    def step_done(
        self,
        start: float,
        end: float,
        batch: bool,
        online_arrivals: Sequence[float],
        predicted: float = math.nan,
    ) -> None:
        """A step ran from `start` to `end`: of a less urgent class than the most urgent (`batch`)
        or not, answering urgent calls that arrived at `online_arrivals`; `predicted`: the seconds
        it was priced at (nan: unknown)."""
        if batch:
            self._batch_steps.append((start, end))
            if predicted > 0:  # nan compares False
                self._overrun.append((end - start) / predicted)
        for arrival in online_arrivals:
            blocked = sum(max(0.0, min(e, start) - max(s, arrival)) for s, e in self._batch_steps)
            self._own.append(max(0.0, end - arrival - blocked))
