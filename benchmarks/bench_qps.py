"""Throughput-latency under Poisson load (paper Fig. 6/7), in-process on the embedded model, on
WL1-style and WL2-style traces, for the CONFIGS below (transformers; ours fcfs + cache; ours with
Sarathi-style chunked prefill; ours po) on the server's own loop (bench_serving: through HTTP).

harness.sweep per workload: isolated latency of ours (P99 SLO = `--slo-x` x its mean), saturated
po, then Poisson arrivals at `--mults` x the anchor QPS, the same seeded pattern for every point.
The prefix pool holds `--cache-profiles` WL1 profiles. Writes one JSON (`--out`); report.py turns
it into tables, QPS-at-SLO ratios, plots and the JCT scatter (every step of ours is logged).

`--offline` measures an offline job instead (what bench_prefix did): items/s with every request
queued at t=0, per configuration, and ours one request at a time (prefix cache, no multi-item
steps); ratios against the transformers loop.

    python -m benchmarks.bench_qps --out benchmarks/results/report/qps.json   # ~30 min on 2 cores
    python -m benchmarks.bench_qps --quick --out /tmp/qps.json                # ~2 min smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.workloads import add_trace_args, build_traces, label_ids
from po_backend.core.request import ScoreRequest
from po_backend.engine.hf_scorer import HFScorer
from po_backend.sched.jct import JCTModel
from po_backend.serving.jct_profile import load_or_profile

CONFIGS = {
    "hf": "transformers, FCFS, no prefix reuse (`--backend hf`)",
    "fcfs": "ours, FCFS + radix prefix cache",
    "chunked": "ours, FCFS + radix cache, chunked prefill (`--prefill-mode chunked`)",
    "po": "ours, prefix-aware SRJF + JCT calibration (`--schedule-policy po`)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny traces, 2 QPS points")
    ap.add_argument("--offline", action="store_true", help="items/s of the whole job at t=0, no sweep")
    ap.add_argument("--baseline-items", type=int, default=6, help="--offline: requests hf runs")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--mults", default="0.25,0.5,1,2,4", help="QPS as multiples of the anchor QPS")
    add_trace_args(ap, wl1_items=6, wl2_requests=8, wl2_min=1500, wl2_max=2500)
    harness.add_sweep_args(ap, quiet_wait=30.0)
    ap.add_argument("--out", type=Path, required=True, help="result JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.mults, args.baseline_items = "0.5,2", 2
        args.wl1_users, args.wl1_items, args.wl1_profile, args.wl1_item_tokens = 2, 3, 300, 40
        args.wl2_requests, args.wl2_min, args.wl2_max = 2, 300, 500
        args.quiet_wait = min(args.quiet_wait, 5.0)
    return args


def offline(
    setups: dict[str, harness.Setup],
    ours: Any,
    jct: JCTModel,
    reqs: list[ScoreRequest],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Items/s of the job queued at t=0 per setup, and of ours one request at a time. hf reuses
    nothing, so every item costs it the same: it runs the first `--baseline-items` requests only."""
    iso = harness.isolated(ours, jct, reqs)
    out = {"ours, one at a time": {"items": len(reqs), "items_per_s": len(reqs) / sum(iso["latencies"])}}
    for name, (scorer, policy) in setups.items():
        part = reqs[: args.baseline_items] if name == "hf" else reqs
        r = harness.run_trace(scorer, jct, policy, args.fairness_lambda, part, None)
        out[name] = {"items": len(part), "items_per_s": len(part) / r["makespan_s"]}
        out[name].update(hit_rate=r["hit_rate"], mean_batch=r["mean_batch"])
    base = out.get("hf", {}).get("items_per_s")
    for name, o in out.items():
        vs = f" ({o['items_per_s'] / base:.1f}x hf)" if base else ""
        print(f"  {name:20s} {o['items']:4d} items: {o['items_per_s']:.3f} items/s{vs}")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    tok = harness.tokenizer()
    labels = label_ids(tok)
    traces = build_traces(args, tok, tuple(args.workloads.split(",")))
    # --cache-profiles 0: the engine's default pool (the offline job of bench_prefix had it).
    wl1 = traces.get("WL1")
    pool = harness.pool_tokens(wl1, args.cache_profiles) if wl1 and args.cache_profiles else None
    ours = harness.load_engine(pool)
    setups: dict[str, harness.Setup] = {}
    if "hf" in configs:
        setups["hf"] = (HFScorer.from_pretrained("embedded", max_input_len=harness.MAX_INPUT_LEN), "fcfs")
    if "fcfs" in configs:
        setups["fcfs"] = (ours, "fcfs")
    if "chunked" in configs:
        # It reuses the hybrid engine's JCT model: under FCFS it only logs predictions.
        setups["chunked"] = (harness.load_engine(pool, "chunked"), "fcfs")
    if "po" in configs:
        setups["po"] = (ours, "po")
    t = time.perf_counter()
    jct = load_or_profile(ours)
    q = jct.quality
    print(f"dtype {ours.config.dtype}; JCT profile ready in {time.perf_counter() - t:.1f} s; pool {pool}")
    doc: dict[str, Any] = {
        "machine": harness.machine_info(),
        "args": vars(args),  # harness.save writes paths as strings
        "configs": {c: CONFIGS[c] for c in configs},
        "dtype": str(ours.config.dtype),
        "jct_fit": {"coef": jct.coef, "pearson_r": q.pearson_r if q else None},
        "pool_tokens": pool,
        "workloads": {},
    }
    for name, items in traces.items():
        print(f"\n{name}:")
        reqs, unit = harness.requests_and_arrivals(items, labels, args.seed)
        if args.offline:
            doc["workloads"][name] = {"offline": offline(setups, ours, jct, reqs, args)}
            continue
        mults = [float(x) for x in args.mults.split(",")]
        doc["workloads"][name] = harness.sweep(ours, jct, setups, reqs, unit, mults, args)
    harness.save(args.out, doc)


if __name__ == "__main__":
    main()
