"""Ablations (paper Fig. 10/11), in-process on the embedded model, WL1-style trace:

1. Suffix discarding on/off. On: only the declared prefix (the user profile) enters the prefix
   cache. Off: every computed token but the last is cached (what a cache that keeps all full KV
   blocks does), so each post's suffix also takes pool space. With the pool limited to
   `--cache-profiles` profiles, the suffixes evict profiles: hit rate and throughput drop.
   Both run `po` twice: all requests at t=0 (throughput) and Poisson at `--mult` x that rate.
2. fairness lambda sweep: `po` at `--mult` x saturated QPS for each lambda, mean vs P99 latency,
   with `fcfs` on the same arrivals as the reference point.

(Hybrid prefilling on/off is measured by bench_mil: same forward, memory and time.)

    python -m benchmarks.bench_ablation --out benchmarks/results/report/ablation.json [--quick]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.workloads import add_trace_args, build_traces, label_ids
from po_backend.core.request import ScoreRequest
from po_backend.engine.engine import Engine
from po_backend.sched.jct import JCTModel
from po_backend.sched.scheduler import DEFAULT_FAIRNESS_LAMBDA
from po_backend.serving.jct_profile import load_or_profile


def suffix_run(
    engine: Engine, jct: JCTModel, reqs: list[ScoreRequest], arrivals: list[float] | None, lam: float
) -> dict[str, Any]:
    """harness.run_trace under po, with the tokens the prefix cache inserted and evicted meanwhile."""
    before = engine.stats().cache
    r = harness.run_trace(engine, jct, "po", lam, reqs, arrivals)
    after = engine.stats().cache
    if before is None or after is None:
        raise RuntimeError("the ablation needs the prefix cache")
    r.update(
        inserted_tokens=after.inserted_tokens_total - before.inserted_tokens_total,
        evicted_tokens=after.evicted_tokens_total - before.evicted_tokens_total,
        items_per_s=len(reqs) / r["makespan_s"],
    )
    return r


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--lambdas", default=f"0,0.1,{DEFAULT_FAIRNESS_LAMBDA:g},2,10")
    ap.add_argument("--mult", type=float, default=1.0, help="Poisson QPS as a multiple of saturated")
    add_trace_args(ap)
    harness.add_sweep_args(ap, quiet_wait=30.0)  # of them: the prefix pool, arrivals, quiet waits
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.quick:
        args.lambdas = f"0,{DEFAULT_FAIRNESS_LAMBDA:g}"
        args.wl1_users, args.wl1_items, args.wl1_profile, args.wl1_item_tokens = 2, 3, 300, 40
        args.quiet_wait = min(args.quiet_wait, 5.0)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    tok = harness.tokenizer()
    items = build_traces(args, tok, ("WL1",))["WL1"]
    pool = harness.pool_tokens(items, args.cache_profiles)
    engine = harness.load_engine(pool)
    jct = load_or_profile(engine)
    reqs, unit = harness.requests_and_arrivals(items, label_ids(tok), args.seed)
    # Off: cache all but the last token of every prompt, suffix included.
    reqs_off = [replace(r, cache_prefix_len=len(r.input_ids) - 1) for r in reqs]
    lam = DEFAULT_FAIRNESS_LAMBDA
    doc: dict[str, Any] = {
        "machine": harness.machine_info(),
        "args": vars(args),  # harness.save writes paths as strings
        "pool_tokens": pool,
        "requests": len(reqs),
        "suffix": {},
        "lambda": [],
    }
    print(f"WL1: {len(reqs)} requests, prefix pool {pool} tokens")

    harness.wait_for_quiet(args.quiet_wait)
    sat = suffix_run(engine, jct, reqs, None, lam)
    qps = args.mult * sat["items_per_s"]
    arrivals = [u / qps for u in unit]
    doc["qps"] = qps
    for mode, rs in (("on", reqs), ("off", reqs_off)):
        harness.wait_for_quiet(args.quiet_wait)
        s = sat if mode == "on" else suffix_run(engine, jct, rs, None, lam)
        harness.wait_for_quiet(args.quiet_wait)
        p = suffix_run(engine, jct, rs, arrivals, lam)
        doc["suffix"][mode] = {"saturated": s, "poisson": p}
        print(
            f"  suffix discarding {mode:3s}: saturated {s['items_per_s']:.3f} items/s, hits {s['hit_rate']:.0%}, "
            f"inserted {s['inserted_tokens']}, evicted {s['evicted_tokens']}; at {qps:.3f} qps mean "
            f"{p['mean_s']:.2f} s P99 {p['p99_s']:.2f} s hits {p['hit_rate']:.0%}"
        )

    for policy, lam_x in [("fcfs", 0.0)] + [("po", float(x)) for x in args.lambdas.split(",")]:
        harness.wait_for_quiet(args.quiet_wait)
        r = harness.run_trace(engine, jct, policy, lam_x, reqs, arrivals)
        r.update(lam=lam_x)
        doc["lambda"].append(r)
        print(f"  {policy} lambda {lam_x:g}: mean {r['mean_s']:.2f} s, P99 {r['p99_s']:.2f} s")
    harness.save(args.out, doc)


if __name__ == "__main__":
    main()
