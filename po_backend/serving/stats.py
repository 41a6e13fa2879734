"""What the serving loop reports: one record per engine step, and the loop's counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the loop saw it."""

    start: float  # loop clock
    seconds: float  # measured wall time of engine.step
    predicted_raw: float  # the fitted JCT model's price of the step, before calibration (nan: no JCT)
    predicted: float  # what the scheduler used: raw times the calibration factor at the time
    items: tuple[tuple[int, int], ...]  # (n_input, n_cached) per request
    policy_score: float
    error: bool = False


@dataclass(frozen=True)
class LoopStats:
    policy: str
    fairness_lambda: float
    queued: int  # waiting, not started
    running: int  # in the step being run now
    submitted: int
    completed: int
    failed: int
    cancelled: int
    rejected: int  # refused at submit, or aborted from a full queue for a more urgent call (OverloadedError)
    steps: int
    mean_batch_items: float
    step_p50_s: float
    step_p90_s: float
    step_p99_s: float
    cache_hit_rate: float  # prompt tokens served from the prefix cache (engine lifetime)
    # nan when the loop has no JCT model (fcfs / lpm without one)
    jct_fit_r: float  # held-out Pearson r of the start-up profile fit
    jct_fit_median_abs_error_s: float
    jct_calibration: float  # measured / predicted step time factor applied to predictions
    jct_online_r: float  # r of calibrated predictions vs measured over recent steps
    jct_source: str  # where the coefficients came from (JCTModel.source), "" without a JCT model
    jct_refits: int  # times the coefficients were refitted on real steps (a start-up estimate's)
    queued_by_class: dict[str, int]  # waiting per priority class (sched.config.CLASSES)
    # Predicted seconds a batch step may take now (sched.backfill); 0 when batch steps are not sized
    batch_step_budget_s: float = 0.0
