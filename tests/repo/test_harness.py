"""benchmarks/harness.py's replay of a trace on the engine loop: requests that arrive at the same
first instant are all queued before the loop's first pick, so the trace's order within that instant
gives none of them the engine alone. bench_schedule's `po@LAMBDA` configs: po with its own
fairness lambda beside the other configs of one sweep; several `--seed`s swept and pooled."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks import harness
from po_backend import Engine, ScoreRequest
from po_backend.core.settings import DEFAULT_FAIRNESS_LAMBDA
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import JCTModel
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
    # Every request ran; the batch ones possibly over several prefix steps (steps are sized with
    # priority scheduling on), each step one request here (nothing shares a prefix).
    assert all(len(s.items) == 1 for s in steps) and len(steps) >= 5


def test_po_variants_run_with_their_own_lambda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import bench_schedule

    args = bench_schedule.parse_args(["--configs", "po@1,fcfs,po", "--out", str(tmp_path / "s.json")])
    assert args.configs == ["fcfs", "po", "po@1"]
    with pytest.raises(SystemExit):
        bench_schedule.parse_args(["--configs", "po@fast"])
    seen: list[SchedulerConfig] = []
    real = bench_schedule.simulate

    def spy(config: SchedulerConfig, *rest: Any) -> Any:
        seen.append(config)
        return real(config, *rest)

    monkeypatch.setattr(bench_schedule, "simulate", spy)
    out = tmp_path / "sim.json"
    bench_schedule.main(
        ["--simulate", "--quick", "--workloads", "WL1", "--configs", "fcfs,po,po@1.5"]
        + ["--sim-mults", "1", "--sim-paper", "2,3", "--out", str(out)]
    )
    lam = DEFAULT_FAIRNESS_LAMBDA
    assert {(c.policy, c.fairness_lambda) for c in seen} == {("fcfs", lam), ("po", lam), ("po", 1.5)}
    runs = json.loads(out.read_text())["workloads"]["WL1"]["runs"]
    assert {(r["config"], r["policy"]) for r in runs} == {("fcfs", "fcfs"), ("po", "po"), ("po@1.5", "po")}


def test_several_seeds_are_swept_and_pooled(tmp_path: Path) -> None:
    from benchmarks import bench_schedule

    out = tmp_path / "sim.json"
    bench_schedule.main(
        ["--simulate", "--quick", "--workloads", "WL1", "--configs", "fcfs,po", "--seed", "0,3"]
        + ["--sim-mults", "0.5,2", "--sim-paper", "2,3", "--out", str(out)]
    )
    doc = json.loads(out.read_text())
    # A sweep per seed, each with its own arrivals and request order
    seeds = {s: doc["workloads"][f"WL1 seed {s}"]["runs"] for s in (0, 3)}
    assert set(doc["workloads"]) == {"WL1 seed 0", "WL1 seed 3", "WL1 2x3 seed 0", "WL1 2x3 seed 3"}
    assert seeds[0][0]["latencies"] != seeds[3][0]["latencies"]
    pooled = doc["pooled"]["WL1"]
    for mult in ("0.5", "2"):
        lat = {
            c: [
                x
                for s in seeds.values()
                for r in s
                if r["config"] == c and f"{r['mult']:g}" == mult
                for x in r["latencies"]
            ]
            for c in ("fcfs", "po")
        }
        po, fcfs = pooled[mult]["po"], pooled[mult]["fcfs"]
        assert po["seeds"] == 2 and po["requests"] == len(lat["po"]) == len(lat["fcfs"])
        assert po["mean_vs_fcfs"] == pytest.approx(
            (sum(lat["po"]) / len(lat["po"])) / (sum(lat["fcfs"]) / len(lat["fcfs"]))
        )
        assert po["p99_s"] == pytest.approx(float(np.percentile(lat["po"], 99)))
        assert po["p99_vs_fcfs"] == pytest.approx(po["p99_s"] / fcfs["p99_s"])
        assert len(po["p99_vs_fcfs_per_seed"]) == 2 and fcfs["p99_vs_fcfs_per_seed"] == [1.0, 1.0]
    assert "every seed's requests pooled" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize(
    ("shares", "step_s", "tries", "kept"),
    [
        ([0.9, 0.8, 0.1], 2.0, 3, 3),  # shared twice, then quiet: the third run is kept
        ([0.9, 0.8, 0.7], 2.0, 2, 2),  # never quiet: the last of `tries` is kept
        ([0.9, 0.1], 0.1, 3, 1),  # under a second: too short to tell, kept
    ],
)
def test_quietly_times_again_while_the_machine_is_shared(
    monkeypatch: pytest.MonkeyPatch, shares: list[float], step_s: float, tries: int, kept: int
) -> None:
    seq = iter(shares)

    class Share:  # what harness.CpuShare reports, scripted
        other_cores = 0.0

        def __enter__(self) -> Share:
            return self

        def __exit__(self, *exc: object) -> None:
            self.other_cores = next(seq)

    clock = itertools.count(0.0, step_s / 2)  # each run reads the clock twice
    waits: list[float] = []
    monkeypatch.setattr(harness, "CpuShare", Share)
    monkeypatch.setattr(harness, "wait_for_quiet", waits.append)
    monkeypatch.setattr(harness, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    runs: list[int] = []

    def run() -> int:
        runs.append(len(runs) + 1)
        return len(runs)

    out, cpu = harness.quietly(run, "testing", 7.0, tries)
    assert out == kept and runs == list(range(1, kept + 1))
    assert cpu.other_cores == shares[kept - 1]
    assert waits == [7.0] * (kept - 1)


def test_held_out_sweep_writes_the_worst_ratios(tmp_path: Path) -> None:
    import json

    from benchmarks import bench_schedule

    out = tmp_path / "h.json"
    argv = ["--held-out", "--configs", "fcfs,po", "--seed", "5,6", "--held-out-loads", "0.5,1.5"]
    bench_schedule.main([*argv, "--held-out-shapes", "few-long,mixed", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {(r["shape"], r["load"]) for r in doc["table"]} == {
        (s, x) for s in ("few-long", "mixed") for x in (0.5, 1.5)
    }
    assert set(doc["worst"]["po"]) == {"below", "above"}
    assert doc["worst"]["po"]["below"]["p99"]["load"] == 0.5  # the only load below saturation
    assert "P99 / fcfs" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        bench_schedule.parse_args(["--held-out", "--held-out-shapes", "nosuch"])


def test_seeds_take_lists_and_inclusive_ranges() -> None:
    assert harness.seeds("0") == [0]
    assert harness.seeds("0,3") == [0, 3]
    assert harness.seeds("100-103,7") == [100, 101, 102, 103, 7]


def test_untuned_shapes_burst_and_heavy_tail() -> None:
    from po_backend.sim.heldout import ALL_SHAPES, SHAPES, UNTUNED_SHAPES

    assert not set(SHAPES) & set(UNTUNED_SHAPES) and ALL_SHAPES == {**SHAPES, **UNTUNED_SHAPES}
    reqs, unit = UNTUNED_SHAPES["bursty"].trace(100)
    assert len(unit) == len(reqs) and unit == sorted(unit)
    sizes = [len(list(g)) for _, g in itertools.groupby(unit)]
    assert max(sizes) > 1 and max(sizes) <= 8  # several requests at one instant, never over `burst`
    assert 0.5 < len(unit) / unit[-1] < 2  # about one request a second
    heavy = UNTUNED_SHAPES["heavy-tail"]
    lens = [r.cache_prefix_len for s in range(100, 110) for r in heavy.trace(s)[0]]
    assert min(lens) >= heavy.profile[0] and max(lens) <= heavy.profile[1]
    assert np.percentile(lens, 95) > 4 * np.median(lens)  # a long tail of profiles
    _, few = SHAPES["few-long"].trace(5)
    assert len(set(few)) == len(few)  # the tuned shapes keep plain Poisson arrivals
