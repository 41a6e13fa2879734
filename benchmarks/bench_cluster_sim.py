"""Past one machine, by simulation (`po_backend.sim.cluster`): sustained QPS at a P99 bound for
1..64 workers behind the SGLang router's cache_aware policy vs round robin, on the paper's WL1
(1,000 users x 50 posts, token lengths / `--scale`). Each worker is the simulator's engine (the real
Scheduler under `po`, an LRU prefix cache sized from `--pool-gib` of KV, step times from the JCT fit
in results/schedule.json, else this machine's profile). Per (router, N): the highest QPS with P99 <=
`--slo-x` x the isolated mean latency (bracket, then bisection), and at that rate the hit rate and
the imbalance; report.py renders the table and the plot.

    python -m benchmarks.bench_cluster_sim [--quick]    # ~3-5 min; --quick ~20 s, 1..8 workers
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from benchmarks import harness, report
from benchmarks.harness import RESULTS, GiB, sim_step_model
from po_backend.entrypoints.launch_cluster import BALANCE_ABS_THRESHOLD
from po_backend.sched.scheduler import DEFAULT_FAIRNESS_LAMBDA, SchedulerConfig
from po_backend.sim import cluster as sim
from po_backend.sim.simulator import PrefixLRU


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, RESULTS / "cluster_sim.json", "200 users x 20 posts, 1..8 workers (~20 s)")
    harness.flags(
        ap, workers="1,2,4,8,16,32,64", routers=("cache_aware,round_robin", f"of {sim.ROUTER_POLICIES}")
    )
    harness.flags(ap, users=1000, posts=50, scale=(8.0, "the paper's token lengths / this"))
    # 1 GiB holds ~26 of our profiles, as an 80 GB GPU holds ~30 of the paper's 14k-token ones for an 8B model.
    harness.flags(ap, pool_gib=(1.0, "prefix-KV memory per worker"), max_batch_tokens=(8192, "the engine's"))
    harness.flags(ap, slo_x=(8.0, "P99 bound = this x mean isolated latency"))
    harness.flags(ap, fairness_lambda=DEFAULT_FAIRNESS_LAMBDA, seed=0)
    # Every user's first, cold, request falls early in the trace; 0 = the whole trace, as bench_schedule.
    harness.flags(ap, warmup=(0.0, "trace share left out of the P99"))
    harness.flags(
        ap, balance_abs_threshold=(BALANCE_ABS_THRESHOLD, "cache_aware's load rule (launch_cluster's)")
    )
    harness.flags(ap, rel_tol=(0.05, "bisection stops within this ratio"))
    harness.flags(ap, jct=(RESULTS / "schedule.json", "bench_schedule's results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.users, args.posts, args.workers = 200, 20, "1,2,4,8"
    args.routers, args.workers = args.routers.split(","), sorted({int(n) for n in args.workers.split(",")})
    if not set(args.routers) <= set(sim.ROUTER_POLICIES) or args.workers[0] < 1 or not 0 <= args.warmup < 1:
        ap.error(f"--routers of {sim.ROUTER_POLICIES}, --workers >= 1, --warmup in [0, 1); got {vars(args)}")
    return args


def kv_bytes_per_token() -> tuple[int, str]:
    """What one cached token of the embedded model costs (K and V of every layer) at the CPU dtype."""
    import torch

    from po_backend.engine.cache.kv_pool import KVPool
    from po_backend.engine.config import parse_dtype
    from po_backend.engine.models.loader import read_config, resolve_model_dir

    cfg, dtype = read_config(resolve_model_dir("embedded")), parse_dtype(None, torch.device("cpu"))
    return KVPool.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype), str(dtype)


def summary(res: sim.ClusterResult, qps: float, since: float, span_s: float, slo: float) -> dict[str, Any]:
    """A run at `qps`: latency over the requests that arrived from `since` on, hit rate, balance."""
    lat = [r.end - r.arrival for r in res.runs if r.arrival >= since]
    busy = [w.busy_s / max(r.end for r in res.runs) for w in res.workers]
    return {
        "qps": qps,
        "p99_s": sim.p99(lat),
        "mean_s": sum(lat) / len(lat),
        "span_over_bound": span_s / slo,
        "hit_rate": res.hit_rate,
        "imbalance": res.imbalance,
        "busy_share": busy,
        "items_per_worker": [w.items for w in res.workers],
        "balanced_by_load": res.balanced_by_load,
        "by_match": res.by_match,
        "mean_batch": len(lat) / sum(w.steps for w in res.workers),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    t0 = time.perf_counter()
    model, source = sim_step_model(args.jct)
    per_token, dtype = kv_bytes_per_token()
    pool = int(args.pool_gib * GiB) // per_token
    shape = sim.TraceShape(users=args.users, posts=args.posts, scale=args.scale, seed=args.seed)
    reqs, unit = sim.paper_trace(shape)
    prefixes = {r.input_ids[: r.cache_prefix_len] for r in reqs}
    mean_prefix = sum(map(len, prefixes)) / len(prefixes)
    print(
        f"trace: {len(reqs)} requests ({args.users} users x {args.posts} posts), mean prompt "
        f"{sum(len(r.input_ids) for r in reqs) / len(reqs):.0f} tokens, mean profile {mean_prefix:.0f}; "
        f"step times: {source}, coef {model.coef}; prefix pool per worker: {args.pool_gib:g} GiB / "
        f"{per_token} B per token ({dtype}) = {pool} tokens = {pool / mean_prefix:.0f} profiles"
    )
    sched = SchedulerConfig("po", args.fairness_lambda)

    def run(
        n: int, router: str, trace: list[tuple[float, Any]], slo: float | None = None, since: float = 0.0
    ) -> sim.ClusterResult:
        config = sim.RouterConfig(router, balance_abs_threshold=args.balance_abs_threshold, seed=args.seed)
        cache = lambda: PrefixLRU(pool, args.max_batch_tokens)  # noqa: E731
        return sim.simulate_cluster(sched, model, trace, n, config, cache, slo, since)

    iso = run(1, "round_robin", [(1e6 * i, r) for i, r in enumerate(reqs)])  # none ever waits
    iso_mean = sum(iso.latencies) / len(reqs)
    slo = args.slo_x * iso_mean
    print(f"isolated: mean {iso_mean:.3f} s, hits {iso.hit_rate:.1%}; P99 bound {slo:.2f} s")
    skip = unit[int(args.warmup * len(unit))] if args.warmup > 0 else 0.0  # unit-rate seconds
    rows: list[dict[str, Any]] = []
    for policy in args.routers:
        guess, prev_n = 1.0 / iso_mean, 1
        for n in args.workers:
            guess *= n / prev_n
            best: dict[float, sim.ClusterResult] = {}

            def p99_at(qps: float, n: int = n, policy: str = policy, best: dict = best) -> float:
                trace = [(u / qps, r) for u, r in zip(unit, reqs, strict=True)]
                res = best[qps] = run(n, policy, trace, slo, skip / qps)
                lat = [r.end - r.arrival for r in res.runs if r.arrival >= skip / qps]
                return sim.p99(lat) if res.complete else math.inf

            t = time.perf_counter()
            one = next((r for r in rows if r["workers"] == 1), None) if n == 1 else None
            if one is not None:  # one worker: every router sends everything to it, the same run
                row = {**one, "router": policy}
                if policy != "cache_aware":
                    row["balanced_by_load"] = row["by_match"] = 0
            else:
                qps, runs = sim.max_qps_at_p99(p99_at, slo, guess, rel_tol=args.rel_tol)
                if qps <= 0:
                    raise RuntimeError(f"{policy} x {n}: no rate found within the P99 bound")
                row = {
                    "router": policy,
                    "workers": n,
                    "sustained_qps": qps,
                    "runs": runs,
                    **summary(best[qps], qps, skip / qps, unit[-1] / qps, slo),
                }
            rows.append(row)
            guess, prev_n = row["sustained_qps"], n
            print(
                f"  {policy:12s} N={n:3d}: {guess:8.3f} qps ({guess / n:.3f} per worker), P99 {row['p99_s']:6.2f} s, "
                f"hits {row['hit_rate']:5.1%}, imbalance {row['imbalance']:.3f}, load-balanced "
                f"{row['balanced_by_load']}, {row['runs']} runs in {time.perf_counter() - t:.1f} s"
            )
    settings = sim.RouterConfig("cache_aware", balance_abs_threshold=args.balance_abs_threshold)
    doc = {
        "args": vars(args),
        "jct_source": source,
        "coef": model.coef,
        "kv_bytes_per_token": per_token,
        "dtype": dtype,
        "pool_tokens": pool,
        "mean_profile_tokens": mean_prefix,
        "requests": len(reqs),
        "isolated_mean_s": iso_mean,
        "isolated_hit_rate": iso.hit_rate,
        "slo_p99_s": slo,
        "rows": rows,
        "router_settings": {
            "cache_threshold": settings.cache_threshold,
            "balance_abs_threshold": settings.balance_abs_threshold,
            "balance_rel_threshold": settings.balance_rel_threshold,
        },
        "seconds": time.perf_counter() - t0,
    }
    harness.save(args.out, doc, report.cluster_sim_markdown(doc))
    report.plot_cluster_sim(doc, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
