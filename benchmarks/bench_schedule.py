"""Scheduling under Poisson load, in process on the embedded model and the server's own loop (no
HTTP; bench_serving goes through HTTP), on WL1-style traces (users x posts sharing a per-user
profile prefix) and WL2-style ones (long unique histories). One module, four modes:

- sweep (default): harness.sweep per workload for each of `--configs` (CONFIGS below: scheduling
  policies, the transformers baseline, chunked prefill): isolated latency (P99 SLO = `--slo-x` x
  its mean), saturated po, then Poisson arrivals at `--mults` x the anchor QPS, the same seeded
  pattern for every point. Reported: the QPS each config sustains at the SLO, po / fcfs, and the
  JCT model's accuracy on every step (held out). The anchor (`--anchor`) is the isolated
  throughput: for WL1 the all-at-t=0 rate is far higher (a user's queued posts run as one
  multi-item step) and a sweep anchored there never finds the SLO crossing.
- `--offline`: items/s of the whole job queued at t=0 per config, and ours one request at a time.
- `--simulate`: the same traces on po_backend.sim.simulator (no machine noise), step times from
  the JCT fit of the last measured run.
- `--ablation` (paper Fig. 10/11): suffix discarding on/off (off: every computed token but the
  last is cached, so posts' suffixes take pool space and evict profiles), then a fairness lambda
  sweep of po at `--ablation-mult` x saturated QPS, fcfs on the same arrivals for reference.

The prefix pool holds `--cache-profiles` WL1 profiles: as in the paper, the cache cannot hold
every user at once. The JCT model is this machine's persisted profile (`--reprofile` times it
again). report.py renders the results.

    flock /tmp/po-bench.lock python -m benchmarks.bench_schedule      # ~25-35 min
    python -m benchmarks.bench_schedule --quick                       # ~2 min smoke run
    python -m benchmarks.bench_schedule --simulate                    # ~30 s
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks import harness, report
from benchmarks.workloads import add_trace_args, build_traces, label_ids
from po_backend.core.request import ScoreRequest
from po_backend.core.settings import POLICIES
from po_backend.engine.hf_scorer import HFScorer
from po_backend.sched.jct import CalibratedJCT, JCTModel
from po_backend.sched.scheduler import DEFAULT_FAIRNESS_LAMBDA, SchedulerConfig
from po_backend.serving.jct_profile import load_or_profile
from po_backend.sim.simulator import PrefixLRU, simulate

CONFIGS = {
    "hf": "transformers, FCFS, no prefix reuse (`--backend hf`)",
    "fcfs": "ours, FCFS + radix prefix cache",
    "chunked": "ours, FCFS + radix cache, chunked prefill (`--prefill-mode chunked`)",
    "srjf": "ours, shortest remaining job first",
    "lpm": "ours, longest prefix match",
    "po": "ours, prefix-aware SRJF + JCT calibration (`--schedule-policy po`)",
}
if not set(POLICIES) <= set(CONFIGS):
    raise RuntimeError("bench_schedule and the scheduler disagree on the policies")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny traces, 2 QPS points")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--offline", action="store_true", help="items/s of the whole job at t=0, no sweep")
    mode.add_argument("--simulate", action="store_true", help="the sweep on po_backend.sim.simulator")
    mode.add_argument("--ablation", action="store_true", help="suffix discarding on/off, lambda sweep")
    ap.add_argument("--configs", default="fcfs,srjf,lpm,po", help=f"of {','.join(CONFIGS)}")
    ap.add_argument("--mults", default="0.5,0.7,1,1.4,2,4", help="QPS as multiples of the anchor QPS")
    ap.add_argument("--mults-wl2", default="0.5,1,2,4", help="WL2's (empty: --mults)")
    ap.add_argument("--slo-extra", default="4,16", help="further SLO multiples to report")
    ap.add_argument("--baseline-items", type=int, default=6, help="--offline: requests hf runs")
    ap.add_argument("--reprofile", action="store_true", help="re-time the JCT grid even if persisted")
    ap.add_argument("--sim-mults", default="0.25,0.35,0.5,0.7,1,1.4,2,2.8,4,5.6,8")
    ap.add_argument("--sim-paper", default="20,50", help="USERS,POSTS of the paper-shaped WL1 trace")
    ap.add_argument("--lambdas", default=f"0,0.1,{DEFAULT_FAIRNESS_LAMBDA:g},2,10", help="--ablation")
    ap.add_argument("--ablation-mult", type=float, default=1.0, help="--ablation: QPS x saturated")
    harness.add_sweep_args(ap, quiet_wait=60.0)
    sizes = dict(wl1_users=6, wl1_items=12, wl1_profile=500, wl1_item_tokens=50, wl2_requests=8)
    add_trace_args(ap, **sizes, wl2_min=1500, wl2_max=2500)
    ap.add_argument("--out", type=Path, default=None, help="result JSON (.md and .png beside it)")
    args = ap.parse_args(argv)
    if args.quick:
        args.mults, args.mults_wl2, args.baseline_items = "0.5,2", "", 2
        args.wl1_users, args.wl1_items, args.wl1_profile, args.wl1_item_tokens = 2, 3, 300, 40
        args.wl2_requests, args.wl2_min, args.wl2_max = 2, 300, 500
        args.lambdas, args.quiet_wait = f"0,{DEFAULT_FAIRNESS_LAMBDA:g}", min(args.quiet_wait, 5.0)
    if args.out is None:
        stem = "ablation" if args.ablation else "schedule_sim" if args.simulate else "schedule"
        args.out = harness.RESULTS / ("tmp" if args.quick else "") / f"{stem}.json"  # tmp/: git-ignored
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.configs = [c for c in CONFIGS if c in args.configs.split(",")]
    return args


def profile_quietly(engine: Any, args: argparse.Namespace) -> tuple[JCTModel, float]:
    """The JCT profile, timed again if other processes used the CPU meanwhile: a profile timed on
    a busy CPU prices steps wrongly for the whole run. Returns the model and the seconds it took."""
    for _attempt in range(3):
        t = time.perf_counter()
        with harness.CpuShare() as cpu:
            jct = load_or_profile(engine, refresh=args.reprofile)
        seconds = time.perf_counter() - t
        if cpu.other_cores < 0.5 or seconds < 1.0:  # quiet, or loaded from disk
            break
        print(f"other processes used {cpu.other_cores:.2f} cores while profiling: waiting, then again")
        harness.wait_for_quiet(args.quiet_wait)
    return jct, seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    tok = harness.tokenizer()
    traces = build_traces(args, tok, ("WL1",) if args.ablation else tuple(args.workloads.split(",")))
    # --cache-profiles 0: the engine's default pool.
    pool = harness.pool_tokens(traces["WL1"], args.cache_profiles) if "WL1" in traces else 0
    pool = pool if args.cache_profiles else 0
    if args.simulate:
        return simulate_main(args, traces, tok, pool)
    info = harness.machine_info()
    print(f"machine: {info['cpu']} | {info['cores']} cores | torch threads {info['torch_threads']}")
    harness.wait_for_quiet(args.quiet_wait)
    engine = harness.load_engine(pool or None)
    print(f"dtype {engine.config.dtype}, max_batch_tokens {engine.config.max_batch_tokens}, pool {pool}")
    jct, profile_s = profile_quietly(engine, args)
    q = jct.quality
    print(f"JCT profile ({profile_s:.1f} s): held-out r={q.pearson_r if q else '?'}, coef {jct.coef}")
    doc: dict[str, Any] = {"machine": info, "args": vars(args), "dtype": str(engine.config.dtype)}
    doc.update(jct_fit={"profile_seconds": profile_s, "coef": jct.coef, **(asdict(q) if q else {})})
    doc.update(pool_tokens=pool, workloads={})
    if args.ablation:
        return ablation(engine, jct, traces["WL1"], tok, doc, args)
    setups: dict[str, harness.Setup] = {}
    for c in args.configs:
        if c == "hf":
            setups[c] = (HFScorer.from_pretrained("embedded", max_input_len=harness.MAX_INPUT_LEN), "fcfs")
        elif c == "chunked":  # it shares the hybrid engine's JCT model: under FCFS it only logs
            setups[c] = (harness.load_engine(pool or None, "chunked"), "fcfs")
        else:
            setups[c] = (engine, c)
    doc["configs"] = {c: CONFIGS[c] for c in args.configs}
    cal = CalibratedJCT(jct)  # one calibration for the whole benchmark, as one long-lived server
    partial = args.out.with_suffix(".partial.json")

    def keep(name: str) -> Any:
        def save(runs: list[dict[str, Any]]) -> None:  # a long run that gets killed keeps its data
            partial.write_text(json.dumps({"report": doc, "running": {name: runs}}, default=str))

        return save

    slo_xs = [args.slo_x] + [float(x) for x in args.slo_extra.split(",") if x]
    all_runs: list[dict[str, Any]] = []  # everything with a step log, in the order it ran
    for name, items in traces.items():
        print(f"\n{name}:")
        reqs, unit = harness.requests_and_arrivals(items, label_ids(tok), args.seed)
        if args.offline:
            doc["workloads"][name] = {"offline": offline(setups, engine, cal, reqs, args)}
            continue
        mults = args.mults_wl2 if name == "WL2" and args.mults_wl2 else args.mults
        mults = [float(x) for x in mults.split(",")]
        w = harness.sweep(engine, cal, setups, reqs, unit, mults, args, after_run=keep(name))
        all_runs += [w["isolated"], w["saturated"], *w["runs"]]
        at_slo = harness.slo_table(w["runs"], w["isolated_mean_s"], slo_xs)
        main_slo = at_slo[f"{args.slo_x:g}"]
        w.update(at_slo=at_slo, sustained_qps=main_slo["sustained_qps"], po_vs_fcfs=main_slo["po_vs_fcfs"])
        doc["workloads"][name] = {**w, "jct": harness.jct_quality(w["runs"])}
    if args.offline:
        return harness.save(args.out, doc)
    doc["jct_online"] = harness.jct_quality(all_runs)
    md = report.schedule_markdown(doc, args.configs)
    print("\n" + md)
    harness.save(args.out, doc, md)
    report.plot_sweeps(doc["workloads"], args.out.with_suffix(".png"), report.QPS_NAMES)
    partial.unlink(missing_ok=True)


def offline(
    setups: dict[str, harness.Setup], ours: Any, jct: CalibratedJCT, reqs: list[ScoreRequest], args: Any
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


def ablation(engine: Any, jct: JCTModel, items: list[Any], tok: Any, doc: dict[str, Any], args: Any) -> None:
    """Suffix discarding on/off under po, all requests at t=0 and Poisson at `--ablation-mult` x that
    rate (with the tokens the prefix cache inserted and evicted); then the lambda sweep."""
    reqs, unit = harness.requests_and_arrivals(items, label_ids(tok), args.seed)
    reqs_off = [replace(r, cache_prefix_len=len(r.input_ids) - 1) for r in reqs]  # all but the last

    def run(rs: list[ScoreRequest], arrivals: list[float] | None) -> dict[str, Any]:
        harness.wait_for_quiet(args.quiet_wait)
        before = engine.stats().cache
        r = harness.run_trace(engine, jct, "po", DEFAULT_FAIRNESS_LAMBDA, rs, arrivals)
        after = engine.stats().cache
        r.update(inserted_tokens=after.inserted_tokens_total - before.inserted_tokens_total)
        r.update(evicted_tokens=after.evicted_tokens_total - before.evicted_tokens_total)
        return {**r, "items_per_s": len(rs) / r["makespan_s"]}

    sat = run(reqs, None)
    qps = args.ablation_mult * sat["items_per_s"]
    arrivals = [u / qps for u in unit]
    doc.update(requests=len(reqs), qps=qps, suffix={}, args={**doc["args"], "mult": args.ablation_mult})
    for mode, rs in (("on", reqs), ("off", reqs_off)):
        s = sat if mode == "on" else run(rs, None)
        p = run(rs, arrivals)
        doc["suffix"][mode] = {"saturated": s, "poisson": p}
        print(
            f"  suffix discarding {mode:3s}: saturated {s['items_per_s']:.3f} items/s, hits {s['hit_rate']:.0%}, "
            f"inserted {s['inserted_tokens']}, evicted {s['evicted_tokens']}; at {qps:.3f} qps mean "
            f"{p['mean_s']:.2f} s P99 {p['p99_s']:.2f} s hits {p['hit_rate']:.0%}"
        )
    doc["lambda"] = []
    for policy, lam in [("fcfs", 0.0)] + [("po", float(x)) for x in args.lambdas.split(",")]:
        harness.wait_for_quiet(args.quiet_wait)
        r = {**harness.run_trace(engine, jct, policy, lam, reqs, arrivals), "lam": lam}
        doc["lambda"].append(r)
        print(f"  {policy} lambda {lam:g}: mean {r['mean_s']:.2f} s, P99 {r['p99_s']:.2f} s")
    harness.save(args.out, doc)


def simulate_main(args: argparse.Namespace, traces: dict[str, list[Any]], tok: Any, pool: int) -> None:
    """The sweep on the simulator: isolated latency (each request alone, in trace order, the cache
    carried over), then every (multiple of the isolated rate, policy)."""
    engine = harness.load_engine(pool or None)  # its batching limit and, without a measured run, its profile
    model, source = harness.sim_step_model(harness.RESULTS / "schedule.json", engine)
    print(f"step times: JCT model from {source}: coef {model.coef}")
    if "WL1" in traces:
        users, posts = (int(x) for x in args.sim_paper.split(","))
        paper = argparse.Namespace(**{**vars(args), "wl1_users": users, "wl1_items": posts})
        traces[f"WL1 {users}x{posts}"] = build_traces(paper, tok, ("WL1",))["WL1"]
    policies = [c for c in args.configs if c in POLICIES]

    def run(policy: str, reqs: list[ScoreRequest], arrivals: list[float]) -> dict[str, Any]:
        cache = PrefixLRU(pool, engine.config.max_batch_tokens)
        trace = list(zip(arrivals, reqs, strict=True))
        out = simulate(SchedulerConfig(policy, args.fairness_lambda), model, trace, cache)
        steps = max(r.step for r in out) + 1
        hits = sum(r.cached for r in out) / sum(len(r.input_ids) for r in reqs)
        lat = harness.latency_summary([r.end - r.arrival for r in out])
        return {**lat, "hit_rate": hits, "steps": steps, "mean_batch": len(out) / steps, "other_cores": 0.0}

    doc: dict[str, Any] = {"args": vars(args), "jct_source": source, "coef": model.coef, "pool_tokens": pool}
    doc["workloads"] = {}
    slo_xs = [args.slo_x] + [float(x) for x in args.slo_extra.split(",") if x]
    for name, items in traces.items():
        reqs, unit = harness.requests_and_arrivals(items, label_ids(tok), args.seed)
        t = time.perf_counter()
        iso = run("fcfs", reqs, [1e6 * i for i in range(len(reqs))])  # 1e6 s apart: none ever waits
        base = 1.0 / iso["mean_s"]
        runs = [
            {
                "config": p,
                "policy": p,
                "mult": m,
                "qps": m * base,
                **run(p, reqs, [u / (m * base) for u in unit]),
            }
            for m in [float(x) for x in args.sim_mults.split(",")]
            for p in policies
        ]
        w = {"requests": len(reqs), "isolated": iso, "isolated_mean_s": iso["mean_s"], "anchor": "isolated"}
        w.update(anchor_qps=base, runs=runs, slo_p99_s=args.slo_x * iso["mean_s"])
        w["at_slo"] = harness.slo_table(runs, iso["mean_s"], slo_xs)
        doc["workloads"][name] = w
        ratios = ", ".join(f"{x}x: {a['po_vs_fcfs']}" for x, a in w["at_slo"].items())
        print(
            f"{name}: {len(reqs)} requests simulated in {time.perf_counter() - t:.1f} s; po / fcfs {ratios}"
        )
    md = report.schedule_sim_markdown(doc, policies)
    print("\n" + md)
    harness.save(args.out, doc, md)
    report.plot_sweeps(doc["workloads"], args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
