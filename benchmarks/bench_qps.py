"""Throughput-latency under Poisson load (paper Fig. 6/7): four configurations, in-process, on the
embedded model, WL1-style and WL2-style traces.

  hf       transformers, FCFS, no reuse: the scorer and loop behind `launch_server --backend hf`
  fcfs     ours, FCFS + radix prefix cache (the vLLM-with-prefix-caching analogue)
  chunked  ours, FCFS + radix cache, Sarathi-style chunked prefill (`--prefill-mode chunked`)
  po       ours, prefix-aware SRJF with continuous JCT calibration (the paper's Algorithm 1)

For each workload: isolated latency of ours (every request alone; P99 SLO = `--slo-x` x its
mean), saturated throughput of `po` (all requests at t=0), then a sweep of Poisson arrivals at
`--mults` x that throughput, the same seeded arrival pattern for every configuration and point.
The prefix pool of our engines is limited to `--cache-profiles` WL1 profiles, as in the paper
(where 20 users' profiles do not fit next to the model). The loops are the server's own
(EngineLoop / FCFSLoop) without HTTP; bench_serving.py measures the same through the server.

Writes one JSON (`--out`); benchmarks/report.py turns it into tables, QPS-at-SLO ratios and plots.
Every step of ours is logged with its JCT prediction: the report's JCT scatter comes from here.

    flock /tmp/po-bench.lock python benchmarks/bench_qps.py            # estimated ~30 min on 2 AVX2 cores
    flock /tmp/po-bench.lock python benchmarks/bench_qps.py --quick    # 2.2 min smoke run (measured)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_schedule import (  # noqa: E402
    ANCHORS,
    anchor_qps,
    isolated,
    limit_pool,
    replay,
    requests_and_arrivals,
    run_trace,
)
from common import machine_info, wait_for_quiet  # noqa: E402
from workloads import add_trace_args, build_traces, label_ids  # noqa: E402

from po_backend import Engine, ScoreRequest  # noqa: E402
from po_backend.hf_backend import FCFSLoop, HFScorer  # noqa: E402
from po_backend.jct import JCTModel, load_or_profile  # noqa: E402
from po_backend.scheduler import DEFAULT_FAIRNESS_LAMBDA  # noqa: E402

CONFIGS = {
    "hf": "transformers, FCFS, no prefix reuse (`--backend hf`)",
    "fcfs": "ours, FCFS + radix prefix cache",
    "chunked": "ours, FCFS + radix cache, chunked prefill (`--prefill-mode chunked`)",
    "po": "ours, prefix-aware SRJF + JCT calibration (`--schedule-policy po`)",
}
MAX_INPUT_LEN = 4096


# ---- engines and workloads (also used by bench_ablation.py) --------------------------------------


def load_engine(prefill_mode: str = "hybrid") -> Engine:
    # "declared": only the prefix a request declares (the user profile) enters the cache: the
    # paper's suffix discarding. bench_ablation.py turns it off per request.
    return Engine.from_pretrained(
        "embedded", cache_policy="declared", max_input_len=MAX_INPUT_LEN, prefill_mode=prefill_mode
    )


def run_trace_hf(scorer: HFScorer, reqs: list[ScoreRequest], arrivals: list[float] | None) -> dict[str, Any]:
    """The transformers baseline through its FCFS loop (one request per step, no cache)."""
    r = replay(FCFSLoop(scorer, max_queue=1 << 20), reqs, arrivals)
    return {"policy": "hf", **r, "hit_rate": 0.0, "steps": len(reqs), "mean_batch": 1.0, "step_log": []}


# ---- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny traces, 2 QPS points")
    ap.add_argument("--workloads", default="WL1,WL2")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--anchor", choices=ANCHORS, default="isolated", help="what --mults multiply")
    ap.add_argument("--mults", default="0.25,0.5,1,2,4", help="QPS as multiples of the anchor QPS")
    ap.add_argument("--fairness-lambda", type=float, default=DEFAULT_FAIRNESS_LAMBDA)
    ap.add_argument("--slo-x", type=float, default=8.0, help="P99 SLO = this x mean isolated latency")
    add_trace_args(ap, wl1_items=6, wl2_requests=8, wl2_min=1500, wl2_max=2500)
    ap.add_argument("--cache-profiles", type=float, default=2.0, help="prefix pool size in WL1 profiles")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet-wait", type=float, default=30.0, help="max seconds to wait for an idle CPU")
    ap.add_argument("--out", type=Path, required=True, help="result JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.mults = "0.5,2"
        args.wl1_users, args.wl1_items, args.wl1_profile, args.wl1_item_tokens = 2, 3, 300, 40
        args.wl2_requests, args.wl2_min, args.wl2_max = 2, 300, 500
        args.quiet_wait = min(args.quiet_wait, 5.0)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    info = machine_info()
    ours = load_engine()
    chunked = load_engine("chunked") if "chunked" in configs else None
    hf = HFScorer.from_pretrained("embedded", max_input_len=MAX_INPUT_LEN) if "hf" in configs else None
    t = time.perf_counter()
    jct: JCTModel = load_or_profile(ours)
    q = jct.quality
    print(f"dtype {ours.config.dtype}; JCT profile ready in {time.perf_counter() - t:.1f} s")
    tok = ours.tokenizer
    labels = label_ids(tok)
    traces = build_traces(args, tok, tuple(args.workloads.split(",")))
    doc: dict[str, Any] = {
        "machine": info,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "configs": {c: CONFIGS[c] for c in configs},
        "dtype": str(ours.config.dtype),
        "jct_fit": {"coef": jct.coef, "pearson_r": q.pearson_r if q else None},
        "workloads": {},
    }
    if "WL1" in traces:
        for e in (ours, chunked):
            if e is not None:
                pool = limit_pool(e, traces["WL1"], args.cache_profiles)
        doc["pool_tokens"] = pool

    def one(config: str, reqs: list[ScoreRequest], arrivals: list[float] | None) -> dict[str, Any]:
        wait_for_quiet(args.quiet_wait)
        if config == "hf":
            assert hf is not None
            return run_trace_hf(hf, reqs, arrivals)
        engine = chunked if config == "chunked" else ours
        assert engine is not None
        policy = "po" if config == "po" else "fcfs"
        # The chunked engine reuses the hybrid engine's JCT model: under FCFS it only logs
        # predictions (the profile key does not tell the two prefill modes apart).
        r = run_trace(engine, jct, policy, args.fairness_lambda, reqs, arrivals)
        r["config"] = config
        return r

    for name, items in traces.items():
        reqs, unit = requests_and_arrivals(items, labels, args.seed)
        tokens = sum(len(r.input_ids) for r in reqs)
        print(f"\n{name}: {len(reqs)} requests, {tokens} tokens")
        wait_for_quiet(args.quiet_wait)
        iso = isolated(ours, jct, reqs)
        sat = one("po", reqs, None)
        sat_qps = len(reqs) / sat["makespan_s"]
        base_qps = anchor_qps(args.anchor, iso, sat_qps)
        print(
            f"  isolated mean {iso['mean_s']:.2f} s; saturated po {sat_qps:.3f} req/s; "
            f"anchor ({args.anchor}) {base_qps:.3f} req/s"
        )
        runs = []
        for m in [float(x) for x in args.mults.split(",")]:
            qps = m * base_qps
            for config in configs:
                r = one(config, reqs, [u / qps for u in unit])
                r.update(config=config, mult=m, qps=qps)
                runs.append(r)
                print(
                    f"  {m:5.2f}x {qps:6.3f} qps {config:8s} mean {r['mean_s']:6.2f} s  P99 {r['p99_s']:6.2f} s  "
                    f"hits {r['hit_rate']:4.0%}  other cores {r['other_cores']:.2f}"
                )
        doc["workloads"][name] = {
            "requests": len(reqs),
            "tokens": tokens,
            "isolated_mean_s": iso["mean_s"],
            "isolated_p99_s": iso["p99_s"],
            "slo_p99_s": args.slo_x * iso["mean_s"],
            "saturated_qps": sat_qps,
            "anchor": args.anchor,
            "anchor_qps": base_qps,
            "runs": runs,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
