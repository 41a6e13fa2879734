"""Request priorities: the scheduler's classes on the simulator (order, enablement, backfill step
sizing, the batch class's starvation credit), and `priority` accepted on every route of a live
server. No timing: the simulator's clock is virtual, the server tests assert answers and state."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from po_backend.core.request import ScoreRequest
from po_backend.core.settings import BACKFILL_SLO_SHARE, resolve
from po_backend.sched.jct import JCTModel
from po_backend.sched.scheduler import SchedulerConfig
from po_backend.sim.simulator import PrefixLRU, SimRun, simulate

JCT = JCTModel.proxy(seconds_per_ktok=1.0)  # a step costs 1 ms per computed token


def ids(tag: int, n: int) -> tuple[int, ...]:
    return tuple(tag * 100_000 + k for k in range(n))


def req(tag: int, n: int, priority: int | None = None, prefix: tuple[int, ...] = ()) -> ScoreRequest:
    return ScoreRequest(prefix + ids(tag, n), (1,), cache_prefix_len=len(prefix) or None, priority=priority)


def run(
    config: SchedulerConfig, trace: Sequence[tuple[float, ScoreRequest]], pool: int = 10**6
) -> list[SimRun]:
    return simulate(config, JCT, trace, PrefixLRU(pool))


def order(runs: Sequence[SimRun]) -> list[int]:
    return [r.rid for r in sorted(runs, key=lambda r: (r.start, r.rid))]


# Same length, no shared prefix: the policy alone cannot tell them apart (ties: arrival order).
PRIOS = [None, 5, -3, 0]
TRACE = [(0.0, req(i + 1, 50, p)) for i, p in enumerate(PRIOS)]


def test_higher_values_first_by_default() -> None:
    cfg = SchedulerConfig("po", enable_priority=True, batch_min_share=0.0)
    assert order(run(cfg, TRACE)) == [1, 0, 3, 2]  # 5, then None and 0 (the default, in arrival order), -3


def test_low_values_first_flag() -> None:
    cfg = SchedulerConfig("po", enable_priority=True, low_priority_first=True, batch_min_share=0.0)
    assert order(run(cfg, TRACE)) == [2, 0, 3, 1]


@pytest.mark.parametrize("policy", ["fcfs", "po"])
def test_priorities_ignored_when_disabled(policy: str) -> None:
    # The long request arrived first and has the highest priority: it still runs by policy.
    trace = [(0.0, req(1, 400, priority=100)), (0.0, req(2, 50, priority=-100))]
    runs = run(SchedulerConfig(policy), trace)
    assert order(runs) == ([0, 1] if policy == "fcfs" else [1, 0])
    on = run(SchedulerConfig(policy, enable_priority=True, batch_min_share=0.0), trace)
    assert order(on) == [0, 1]


def test_srjf_within_a_class() -> None:
    trace = [(0.0, req(1, 400, 3)), (0.0, req(2, 50, 3)), (0.0, req(3, 10, -1)), (0.0, req(4, 200, 3))]
    cfg = SchedulerConfig("po", enable_priority=True, batch_min_share=0.0)
    assert order(run(cfg, trace)) == [1, 3, 0, 2]


def test_class_of_a_request() -> None:
    hi_first = SchedulerConfig(enable_priority=True)
    lo_first = SchedulerConfig(enable_priority=True, low_priority_first=True)
    assert [hi_first.priority_class(req(1, 5, p)) for p in (None, 0, 1, -1)] == ["online"] * 3 + ["batch"]
    assert [lo_first.priority_class(req(1, 5, p)) for p in (None, 0, 1, -1)] == [
        "online",
        "online",
        "batch",
        "online",
    ]
    assert SchedulerConfig().priority_class(req(1, 5, -9)) == "online"  # disabled: one class


def test_settings_reach_the_scheduler() -> None:
    s = resolve(
        "embedded",
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=True,
        online_slo_ms=250,
        batch_min_share=0.2,
    )
    cfg = SchedulerConfig.from_settings(s)
    assert (cfg.enable_priority, cfg.low_priority_first, cfg.online_slo_s, cfg.batch_min_share) == (
        True,
        True,
        0.25,
        0.2,
    )
    assert cfg.needs_jct  # sizing batch steps needs step times, whatever the policy
    assert SchedulerConfig.from_settings(resolve("embedded", schedule_policy="fcfs")).needs_jct is False
    with pytest.raises(ValueError, match="online_slo_ms"):
        resolve("embedded", online_slo_ms=0)
    with pytest.raises(ValueError, match="batch_min_share"):
        resolve("embedded", batch_min_share=1.0)


def batch_backlog(n: int = 10) -> list[tuple[float, ScoreRequest]]:
    """n batch items over one 50-token shared prefix, 20 tokens each."""
    shared = ids(9, 50)
    return [(0.0, req(100 + i, 20, -1, prefix=shared)) for i in range(n)]


def step_times(runs: Sequence[SimRun]) -> list[float]:
    by_step: dict[int, float] = {}
    for r in runs:
        by_step[r.step] = r.end - r.start
    return [by_step[k] for k in sorted(by_step)]


def test_backfill_sizes_batch_steps_to_the_online_target() -> None:
    unsized = run(SchedulerConfig("po", enable_priority=True), batch_backlog())
    assert len(step_times(unsized)) == 1  # all ten share one forward: 250 tokens, 0.25 s
    slo = 0.2
    cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=slo)
    runs = run(cfg, batch_backlog())
    steps = step_times(runs)
    assert len(runs) == 10 and len(steps) > 1
    assert max(steps) <= slo * BACKFILL_SLO_SHARE + 1e-9
    # An online call arriving during the batch work waits for one step at most.
    online = req(1, 30)
    mixed = run(cfg, [*batch_backlog(), (0.01, online)])
    o = next(r for r in mixed if r.rid == 10)
    assert o.start - o.arrival <= slo * BACKFILL_SLO_SHARE
    # Online steps are never trimmed: the target limits batch work only.
    online_batch = [(0.0, req(200 + i, 20, None, prefix=ids(8, 50))) for i in range(10)]
    assert len(step_times(run(cfg, online_batch))) == 1


def saturated(share: float) -> list[SimRun]:
    """100 online calls of one step each and one batch request, all queued at once."""
    online = [(0.0, req(1000 + k, 100)) for k in range(100)]
    return run(
        SchedulerConfig("po", enable_priority=True, batch_min_share=share), [(0.0, req(1, 100, -5)), *online]
    )


def test_batch_credit_prevents_starvation() -> None:
    strict = saturated(0.0)
    assert order(strict)[-1] == 0  # strict priority: the batch request waits for the whole stream
    runs = saturated(0.1)
    batch = next(r for r in runs if r.rid == 0)
    online_before = [r for r in runs if r.rid != 0 and r.end <= batch.start]
    # It ran on its credit while online work still waited, after the online steps that earned it:
    # 0.1 s of credit at 10% of 0.1 s per online step.
    assert any(r.start >= batch.end for r in runs if r.rid != 0)
    assert len(online_before) == 10
