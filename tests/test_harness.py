"""benchmarks/harness.py's replay of a trace on the engine loop: requests that arrive at the same
first instant are all queued before the loop's first pick, so the trace's order within that instant
gives none of them the engine alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import harness
from po_backend import Engine, ScoreRequest
from po_backend.sched.jct import JCTModel
from po_backend.sched.scheduler import SchedulerConfig
from po_backend.serving.loop import EngineLoop


def test_replay_queues_the_first_instant_before_the_first_pick(
    tiny_model: Callable[[str], tuple[Path, torch.nn.Module]],
) -> None:
    path, _ = tiny_model("llama")
    engine = Engine.from_pretrained(path, dtype="fp32", max_input_len=256)

    def ids(seed: int, n: int) -> tuple[int, ...]:  # the tiny model's vocabulary is 300
        return tuple(5 + (seed * 37 + i * (seed + 3)) % 290 for i in range(n))

    batch = [ScoreRequest(ids(k, 200), (1,), priority=-1) for k in range(3)]
    online, later = ScoreRequest(ids(10, 40), (1,)), ScoreRequest(ids(11, 40), (1,))
    cfg = SchedulerConfig("po", enable_priority=True)
    loop = EngineLoop(engine, scheduler=cfg, jct=JCTModel.proxy(1.0), start=False)
    # The batch backlog is listed first at t=0, as bench_mixed's trace lists it.
    got = harness.replay(loop, [*batch, online, later], [0.0, 0.0, 0.0, 0.0, 0.01])
    steps = loop.step_log()
    # With every t=0 request queued, priority puts the online call first; submitted one by one,
    # the first batch item would have been picked before the online call existed.
    assert steps[0].items == ((len(online.input_ids), 0),), steps[0]
    assert len(got["latencies"]) == 5
    assert sum(len(s.items) for s in steps) == 5  # every request ran once
