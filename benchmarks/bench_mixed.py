"""Online and batch traffic on one engine: an online Poisson stream of short WL1-style calls and a
backlog of long WL2-style batch items (`--batch-priority`, -1) queued at t=0, the same trace for every
policy: fcfs, po, po+prio (po with `--enable-priority-scheduling`, `--online-slo-ms` = `--slo-x` x
the online-alone P99 and `--batch-min-share`) and po+prio without a target (the default step bound).
`--batch-priority 0 --online-priority 10`: a backlog at the default priority behind which more urgent
calls arrive (SGLang's order), which nothing marks as batch before the first of them. Online P50/P99 and batch items/s, each against its class
alone on the same engine; in process on the server's loop, or `--simulate` on the simulator.

    python -m benchmarks.bench_mixed --simulate    # seconds
    python -m benchmarks.bench_mixed               # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Any

from benchmarks import harness
from benchmarks.report import cells, markdown_table, prose
from benchmarks.workloads import label_ids, wl1, wl2
from po_backend.core.request import ScoreRequest
from po_backend.core.settings import DEFAULT_BATCH_MIN_SHARE
from po_backend.sched.config import SchedulerConfig
from po_backend.serving.jct_profile import startup_jct
from po_backend.serving.loop import EngineLoop, StepRecord
from po_backend.sim.radix import RadixLRU
from po_backend.sim.simulator import simulate


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = harness.parser(__doc__)  # --out: results/mixed.json, or mixed_sim.json with --simulate
    harness.flags(ap, simulate=(False, "on the simulator instead of the engine"))
    harness.flags(ap, users=(3, "online: users (one profile each)"), posts=(10, "online: calls per user"))
    harness.flags(ap, profile=(300, "online: profile tokens (shared)"), post=(40, "online: post tokens"))
    harness.flags(ap, batch=(10, "batch: backlog items"), batch_tokens=("600,900", "batch: MIN,MAX tokens"))
    harness.flags(ap, load=(0.5, "online rate as a share of its capacity"))
    harness.flags(ap, slo_x=(1.5, "online target: x the online-alone P99"))
    harness.flags(ap, cache_profiles=(2.2, "prefix pool: this many online profiles plus one batch item"))
    harness.flags(ap, batch_min_share=DEFAULT_BATCH_MIN_SHARE, seed=0)
    harness.flags(ap, batch_priority=(-1, "batch: their priority"), online_priority=(0, "online: theirs"))
    return ap.parse_args(argv)


def traces(args: argparse.Namespace, tok: Any) -> tuple[list[ScoreRequest], list[ScoreRequest], list[float]]:
    """Online requests (users interleaved), batch requests, the online unit-rate Poisson arrivals."""
    labels = label_ids(tok)
    online_items = wl1(tok, args.users, args.posts, args.profile, args.profile // 8, (1, 10**6), args.post)
    online, unit = harness.requests_and_arrivals(online_items, labels, args.seed)
    online = [dataclasses.replace(r, priority=args.online_priority) for r in online]
    lo, hi = (int(x) for x in args.batch_tokens.split(","))
    batch_items = wl2(tok, args.batch, (lo, hi), args.seed + 1)
    return online, [ScoreRequest(it.ids, labels, priority=args.batch_priority) for it in batch_items], unit


class Runner:
    """One policy over a trace of (arrival, request) pairs, arrivals ascending, on the engine or the
    simulator: each request's latency, in trace order."""

    def __init__(self, args: argparse.Namespace, pool: int) -> None:
        self.simulated, self.pool = args.simulate, pool
        self.engine = harness.load_engine(pool)
        self.model: Any
        if self.simulated:
            self.model, self.source = harness.sim_step_model(engine=self.engine)
        else:  # the server's start-up rule: a persisted profile, else a quick estimate refined online
            self.model, self.source = startup_jct(self.engine, "po"), "the server's start-up JCT model"
        self.cached: list[int] = []  # of the last run, per request: tokens read from the cache
        self.steps: list[StepRecord] = []  # of the last run on the engine

    def isolated(self, reqs: list[ScoreRequest]) -> list[float]:
        """Each request alone, in order, on a cache cold at the start: latency without queueing."""
        if self.simulated:  # 1e6 s apart on the virtual clock: none ever waits
            return self(SchedulerConfig("fcfs"), [(1e6 * i, r) for i, r in enumerate(reqs)])
        # On the engine each waits for the last to finish (arrivals 1e6 s apart would be slept)
        return harness.isolated(self.engine, self.model, reqs)["latencies"]

    def __call__(self, cfg: SchedulerConfig, trace: list[tuple[float, ScoreRequest]]) -> list[float]:
        """Latency per request of `trace`; `self.cached` keeps the tokens each read from the cache,
        `self.steps` the engine's steps (none on the simulator)."""
        if self.simulated:
            cache = RadixLRU(self.pool, self.engine.config.max_batch_tokens)
            runs = sorted(simulate(cfg, self.model, trace, cache), key=lambda r: r.rid)  # trace order
            self.cached, self.steps = [r.cached for r in runs], []
            return [r.end - r.arrival for r in runs]
        self.engine.flush_cache()
        loop = EngineLoop(self.engine, scheduler=cfg, jct=self.model, max_queue=1 << 20, start=False)
        got = harness.replay(loop, [r for _, r in trace], [a for a, _ in trace])
        self.cached, self.steps = got["cached_tokens"], loop.step_log()
        return got["latencies"]

    def diagnostics(self, reqs: list[ScoreRequest], first: int) -> dict[str, float]:
        """Of the last run: the share of the prompt tokens of `reqs[first:]` read from the cache, and
        the engine's longest step against its prediction."""
        longest = max(self.steps, key=lambda s: s.seconds, default=None)
        return {
            "online_cached_share": sum(self.cached[first:]) / sum(len(r.input_ids) for r in reqs[first:]),
            "longest_step_s": longest.seconds if longest else math.nan,
            "longest_step_predicted_s": longest.predicted if longest else math.nan,
        }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    tok = harness.tokenizer()
    online, batch, unit = traces(args, tok)
    # By default the pool holds 2 profiles (as bench_schedule's) plus one batch item (its prefix
    # steps' work): online calls lose profiles to each other and to the batch item in progress.
    pool = int(args.cache_profiles * args.profile) + max(len(r.input_ids) for r in batch)
    run = Runner(args, pool)
    info = harness.machine_info()
    where = "simulator" if args.simulate else f"{info['cpu']}, {info['cores']} cores, embedded model"
    print(f"{where}; step times: {run.source}")
    t0 = time.perf_counter()
    po, fcfs = SchedulerConfig("po"), SchedulerConfig("fcfs")
    iso = run.isolated(online)  # the online calls' capacity
    iso_mean = sum(iso) / len(iso)
    print(f"online calls alone: mean {iso_mean:.3f} s ({time.perf_counter() - t0:.0f} s)")
    rate = args.load / iso_mean
    online_trace = [(u / rate, r) for u, r in zip(unit, online, strict=True)]
    alone = {**harness.latency_summary(run(po, online_trace)), **run.diagnostics(online, 0)}
    batch_alone = len(batch) / max(run(po, [(0.0, r) for r in batch]))
    print(f"online alone P99 {alone['p99_s']:.3f} s; batch alone {batch_alone:.3f} items/s")
    slo_s = args.slo_x * alone["p99_s"]
    prio = SchedulerConfig(
        "po", enable_priority=True, online_slo_s=slo_s, batch_min_share=args.batch_min_share
    )
    no_target = SchedulerConfig("po", enable_priority=True, batch_min_share=args.batch_min_share)
    mixed = [(0.0, r) for r in batch] + online_trace
    rows = []
    for name, cfg in (("fcfs", fcfs), ("po", po), ("po+prio", prio), ("po+prio, no target", no_target)):
        lat = run(cfg, mixed)
        o, items_s = lat[len(batch) :], len(batch) / max(lat[: len(batch)])
        s = harness.latency_summary(o)
        print(f"{name}: online P99 {s['p99_s']:.3f} s, batch {items_s:.3f} items/s")
        rows.append(
            {
                "policy": name,
                "online_p50_s": s["p50_s"],
                "online_p99_s": s["p99_s"],
                "p99_vs_alone": s["p99_s"] / alone["p99_s"],
                "batch_items_s": items_s,
                "batch_vs_alone": items_s / batch_alone,
                "slo_met": sum(x <= slo_s for x in o) / len(o),
                **run.diagnostics([r for _, r in mixed], len(batch)),
            }
        )
    doc = {
        "args": vars(args),
        "machine": info,
        "where": where,
        "pool_tokens": pool,
        "online_calls": len(online),
        "online_qps": rate,
        "online_alone": alone,
        "online_isolated_mean_s": iso_mean,
        "batch_alone_items_s": batch_alone,
        "online_slo_s": slo_s,
        "batch_floor_vs_alone": 0.7 * (1 - args.load),
        "rows": rows,
        "seconds": time.perf_counter() - t0,
    }
    out = args.out or harness.RESULTS / ("mixed_sim.json" if args.simulate else "mixed.json")
    harness.save(out, doc, markdown(doc))


def markdown(doc: dict[str, Any]) -> str:
    a = doc["args"]
    sim, batch = " --simulate" if a["simulate"] else "", a["batch_tokens"].replace(",", "-")
    intro = prose("mixed", d=doc, a=a, sim=sim, batch=batch, ms=doc["online_slo_s"] * 1e3)
    head = (
        "policy | online P50 s | online P99 s | P99 / alone | within target | batch items/s | batch / alone"
    )
    spec = "policy online_p50_s:.3f online_p99_s:.3f p99_vs_alone:.2f slo_met:.0% batch_items_s:.2f batch_vs_alone:.2f"
    rows = [[c + "x" if k in (3, 6) else c for k, c in enumerate(cells(r, spec))] for r in doc["rows"]]
    return intro + "\n\n" + markdown_table(head, rows)


if __name__ == "__main__":
    main()
