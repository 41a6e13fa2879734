"""Scheduling policies under Poisson load, on the real engine loop and the embedded model.

For each workload (WL1-style post recommendation: users x candidate posts sharing a per-user
profile prefix; WL2-style credit checks: long unique histories), in this order:

1. isolated latency: every request alone, one after another (SLO = `--slo-x` x its mean);
2. saturated throughput: all requests submitted at t=0 under po (reported);
3. a sweep: Poisson arrivals (seeded; the same shuffled order and unit-rate gaps for every
   point, scaled by 1/QPS) at `--mults` x the anchor QPS, for each policy, interleaved;
   mean / P50 / P99 latency, cache hit rate, steps.

The anchor (`--anchor`) is by default the *isolated* throughput, 1 / mean isolated latency: what
the engine sustains when requests come one at a time. For WL1 the all-at-t=0 throughput is far
higher (a user's queued posts run as one multi-item step on one profile computation), and Poisson
arrivals at even 1/4 of it overload every policy: a sweep anchored there never finds the SLO
crossing. `--anchor saturated` restores that anchor.

Reported: the highest QPS each policy sustains with P99 <= SLO (log-log interpolation between
the sweep points), the ratio po / fcfs, and the JCT model's prediction quality on every step of
the sweep (held out: none of them was used to fit it). The prefix pool is limited to
`--cache-profiles` WL1 profiles: as in the paper (20 users x 14k-token profiles do not fit in GPU
memory next to an 8B model), the cache cannot hold every user at once.

    flock /tmp/po-bench.lock python benchmarks/bench_schedule.py            # ~25-35 min
    flock /tmp/po-bench.lock python benchmarks/bench_schedule.py --quick    # ~2-3 min smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from common import CpuShare, machine_info, markdown_table, text_table, wait_for_quiet  # noqa: E402
from workloads import Item, add_trace_args, build_traces, label_ids  # noqa: E402

from po_backend import Engine, ScoreRequest  # noqa: E402
from po_backend.cache import KVPool, RadixCache  # noqa: E402
from po_backend.jct import CalibratedJCT, JCTModel, load_or_profile, pearson_r  # noqa: E402
from po_backend.loop import EngineLoop  # noqa: E402
from po_backend.scheduler import DEFAULT_FAIRNESS_LAMBDA, POLICIES, SchedulerConfig  # noqa: E402
from po_backend.simulator import PrefixLRU, SimRun, simulate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
POLICY_ORDER = ("fcfs", "srjf", "lpm", "po")
ANCHORS = ("isolated", "saturated")
assert set(POLICY_ORDER) == set(POLICIES), "benchmark and scheduler disagree on the policies"


# ---- one run --------------------------------------------------------------------------------


def _limit_prefix_pool(engine: Engine, tokens: int) -> None:
    """Replace the engine's prefix pool by one of `tokens` slots (the profile run sized the
    default for 64 full prompts, which would hold every user of our scaled-down workloads)."""
    m = engine.model_config
    pool = KVPool(m.num_layers, tokens, m.num_kv_heads, m.head_dim, engine.config.dtype, engine.config.device)
    engine.cache = RadixCache(pool)


def pool_tokens(items: list[Item], profiles: float) -> int:
    """A prefix pool of `profiles` times the longest declared prefix (+ slack for a split node)."""
    return int(profiles * max(len(it.prefix) for it in items)) + 64


def limit_pool(engine: Engine, items: list[Item], profiles: float) -> int:
    """Limit the engine's prefix pool to `pool_tokens(items, profiles)`; returns that size."""
    tokens = pool_tokens(items, profiles)
    _limit_prefix_pool(engine, tokens)
    return tokens


class Loop(Protocol):
    """What a replay needs of a serving loop (`EngineLoop`, the transformers `FCFSLoop`)."""

    def submit(self, req: ScoreRequest) -> Future: ...

    def submit_many(self, reqs: Sequence[ScoreRequest]) -> list[Future]: ...

    def shutdown(self, drain: bool = True) -> None: ...


def replay(
    loop: Loop,
    reqs: list[ScoreRequest],
    arrivals: list[float] | None,
    start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Submit `reqs` at `arrivals` (seconds from start; None: all at once, before `start` is called,
    so the first pick sees the whole burst), wait for every one, drain the loop. Latency =
    completion - submission, per request."""
    n = len(reqs)
    submitted, finished = [math.nan] * n, [math.nan] * n
    futs: list[Future] = []

    def stamp(i: int) -> Callable[[Future], None]:
        def done(_: Future) -> None:
            finished[i] = time.perf_counter()

        return done

    with CpuShare() as cpu:
        t0 = time.perf_counter()
        if arrivals is None:
            futs = loop.submit_many(reqs)
            submitted = [t0] * n
            for i, f in enumerate(futs):
                f.add_done_callback(stamp(i))
            if start is not None:
                start()
        else:
            if start is not None:
                start()
            for i, (a, r) in enumerate(zip(arrivals, reqs, strict=True)):
                delay = t0 + a - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                submitted[i] = time.perf_counter()
                f = loop.submit(r)
                f.add_done_callback(stamp(i))
                futs.append(f)
        for f in futs:
            f.result()  # a failed request fails the benchmark
        loop.shutdown(drain=True)
    lat = np.array(finished) - np.array(submitted)
    assert np.isfinite(lat).all(), "a request has no completion time"
    return {
        "latencies": lat.tolist(),
        "mean_s": float(lat.mean()),
        "p50_s": float(np.percentile(lat, 50)),
        "p99_s": float(np.percentile(lat, 99)),
        "makespan_s": float(max(finished) - t0),
        "other_cores": cpu.other_cores,
    }


def requests_and_arrivals(
    items: list[Item], labels: tuple[int, int], seed: int
) -> tuple[list[ScoreRequest], list[float]]:
    """Shuffled requests (users interleave, as independent clients would) and unit-rate Poisson
    arrival times: a point at QPS q uses arrivals / q, so every point has the same pattern."""
    rng = random.Random(seed)
    items = list(items)
    rng.shuffle(items)
    reqs = [ScoreRequest(it.ids, labels, cache_prefix_len=len(it.prefix)) for it in items]
    unit, t = [], 0.0
    for _ in reqs:
        unit.append(t)
        t += rng.expovariate(1.0)
    return reqs, unit


def run_trace(
    engine: Engine,
    jct: JCTModel | CalibratedJCT,
    policy: str,
    lam: float,
    reqs: list[ScoreRequest],
    arrivals: list[float] | None,
) -> dict[str, Any]:
    """Replay `reqs` through a fresh EngineLoop on a cold cache, with its step log and stats. A
    CalibratedJCT carries its online calibration from run to run, as one long-lived server would."""
    engine.flush_cache()
    before = engine.stats()
    loop = EngineLoop(engine, policy=policy, fairness_lambda=lam, jct=jct, max_queue=1 << 20, start=False)
    r = replay(loop, reqs, arrivals, start=loop.start)
    after = engine.stats()
    st = loop.stats()
    prompt = after.prompt_tokens - before.prompt_tokens
    return {
        "policy": policy,
        **r,
        "hit_rate": (after.cached_tokens - before.cached_tokens) / prompt if prompt else 0.0,
        "steps": st.steps,
        "mean_batch": st.mean_batch_items,
        "calibration": st.jct_calibration,
        "step_log": step_rows(loop),
    }


def step_rows(loop: EngineLoop) -> list[list[Any]]:
    """[raw prediction, calibrated prediction, measured s, items, [[n_input, n_cached], ...]] per step."""
    return [
        [s.predicted_raw, s.predicted, s.seconds, len(s.items), [list(i) for i in s.items]]
        for s in loop.step_log()
    ]


def isolated(engine: Engine, jct: JCTModel | CalibratedJCT, reqs: list[ScoreRequest]) -> dict[str, Any]:
    """Each request alone, in trace order, on a cache that starts cold: latency without queueing."""
    engine.flush_cache()
    lat = []
    with EngineLoop(engine, policy="fcfs", jct=jct) as loop:
        for r in reqs:
            t = time.perf_counter()
            loop.submit(r).result()
            lat.append(time.perf_counter() - t)
    return {
        "mean_s": float(np.mean(lat)),
        "p99_s": float(np.percentile(lat, 99)),
        "latencies": lat,
        "step_log": step_rows(loop),
    }


def anchor_qps(anchor: str, iso: dict[str, Any], sat_qps: float) -> float:
    """The QPS a sweep's multiples refer to: 1 / mean isolated latency, or the all-at-t=0 rate."""
    assert anchor in ANCHORS, f"anchor must be one of {ANCHORS}, got {anchor!r}"
    return 1.0 / iso["mean_s"] if anchor == "isolated" else sat_qps


# ---- analysis -------------------------------------------------------------------------------


def sustained_qps(points: list[tuple[float, float]], slo: float) -> tuple[float, str]:
    """Highest QPS with P99 <= slo from (qps, p99) points: interpolated (log-log) between the last
    passing and the first failing point. The mark is "" (interpolated), ">=" (every point passes:
    a lower bound) or "<" (even the lowest fails: an upper bound)."""
    pts = sorted(points)
    if pts[0][1] > slo:
        return pts[0][0], "<"
    for (q0, p0), (q1, p1) in zip(pts, pts[1:], strict=False):
        if p1 > slo:
            if p1 <= p0:
                return q0, ""
            f = (math.log(slo) - math.log(p0)) / (math.log(p1) - math.log(p0))
            return math.exp(math.log(q0) + f * (math.log(q1) - math.log(q0))), ""
    return pts[-1][0], ">="


def _ratio(po: tuple[float, str], fcfs: tuple[float, str]) -> str:
    """po / fcfs sustained QPS, marked as a bound where a policy passed or failed every point."""
    (qa, ma), (qb, mb) = po, fcfs
    if (ma == "<" and mb == "<") or (ma == ">=" and mb == ">="):
        return "n/a (same bound for both)"
    if ma == "<" or mb == ">=":
        return f"<= {qa / qb:.2f}x"
    return f"{'>= ' if ma == '>=' or mb == '<' else ''}{qa / qb:.2f}x"


def slo_table(
    runs: list[dict[str, Any]], iso_mean: float, slo_xs: list[float], policies: list[str]
) -> dict[str, Any]:
    """Per P99 SLO (x the mean isolated latency): each policy's sustained QPS and po / fcfs."""
    out = {}
    for x in slo_xs:
        sus = {
            pol: sustained_qps([(r["qps"], r["p99_s"]) for r in runs if r["policy"] == pol], x * iso_mean)
            for pol in policies
        }
        out[f"{x:g}"] = {
            "slo_p99_s": x * iso_mean,
            "sustained_qps": {p: {"qps": v, "mark": mk} for p, (v, mk) in sus.items()},
            "po_vs_fcfs": _ratio(sus["po"], sus["fcfs"]) if "po" in sus and "fcfs" in sus else "n/a",
        }
    return out


def jct_quality(runs: list[dict[str, Any]]) -> dict[str, float]:
    rows = [s for r in runs for s in r["step_log"]]
    raw, cal, meas = (np.array([s[i] for s in rows]) for i in range(3))
    return {
        "steps": len(rows),
        "r_raw": pearson_r(raw, meas),
        "r_calibrated": pearson_r(cal, meas),
        "median_rel_error_raw": float(np.median(np.abs(raw / meas - 1))),
        "median_rel_error_calibrated": float(np.median(np.abs(cal / meas - 1))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small workloads, 2 QPS points, fcfs and po")
    ap.add_argument("--workloads", default="WL1,WL2")
    ap.add_argument("--policies", default=",".join(POLICY_ORDER))
    ap.add_argument("--anchor", choices=ANCHORS, default="isolated", help="what --mults multiply")
    ap.add_argument("--mults-wl1", default="0.5,0.7,1,1.4,2,4", help="QPS as multiples of the anchor")
    ap.add_argument("--mults-wl2", default="0.5,1,2,4")
    ap.add_argument("--fairness-lambda", type=float, default=DEFAULT_FAIRNESS_LAMBDA)
    ap.add_argument("--slo-x", type=float, default=8.0, help="P99 SLO = this x mean isolated latency")
    ap.add_argument("--slo-extra", default="4,16", help="further SLO multiples to report")
    add_trace_args(
        ap,
        wl1_users=6,
        wl1_items=12,
        wl1_profile=500,
        wl1_item_tokens=50,
        wl2_requests=8,
        wl2_min=1500,
        wl2_max=2500,
    )
    ap.add_argument("--cache-profiles", type=float, default=2.0, help="prefix pool size in WL1 profiles")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reprofile", action="store_true", help="re-time the JCT grid even if persisted")
    ap.add_argument(
        "--simulate",
        action="store_true",
        help="no measurement: replay the traces on po_backend.simulator with the JCT model of the last "
        "measured run (results/schedule.json) as the step time; writes schedule_sim.{json,md,png}",
    )
    ap.add_argument("--sim-mults", default="0.25,0.35,0.5,0.7,1,1.4,2,2.8,4,5.6,8")
    ap.add_argument(
        "--sim-paper", default="20,50", help="USERS,POSTS of the paper-shaped WL1 trace simulated too"
    )
    ap.add_argument(
        "--quiet-wait", type=float, default=60.0, help="max seconds to wait for an idle CPU per run"
    )
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows up in a redirected log
    if args.quick:
        args.policies, args.mults_wl1, args.mults_wl2 = "fcfs,po", "0.25,2", "0.5,2"
        args.wl1_users, args.wl1_items, args.wl1_profile, args.wl1_item_tokens = 3, 4, 600, 80
        args.wl2_requests, args.wl2_min, args.wl2_max = 3, 600, 1200
    policies = [p for p in POLICY_ORDER if p in args.policies.split(",")]
    slo_xs = [args.slo_x] + [float(x) for x in args.slo_extra.split(",") if x]

    if args.simulate:
        simulate_main(args, policies, slo_xs)
        return
    info = machine_info()
    print(f"machine: {info['cpu']} | {info['cores']} cores | torch threads {info['torch_threads']}")
    waited, others = wait_for_quiet(args.quiet_wait)
    print(f"waited {waited:.0f} s for a quiet CPU (other processes use {others:.2f} cores)")
    engine = Engine.from_pretrained("embedded", cache_policy="declared", max_input_len=4096)
    print(f"dtype {engine.config.dtype}, max_batch_tokens {engine.config.max_batch_tokens}")
    for _attempt in range(3):
        t = time.perf_counter()
        with CpuShare() as cpu:
            jct = load_or_profile(engine, refresh=args.reprofile or not args.quick)
        profile_s = time.perf_counter() - t
        if cpu.other_cores < 0.5 or profile_s < 1.0:  # quiet, or loaded from disk
            break
        # A profile timed while other processes used the CPU prices steps wrongly for the whole run.
        print(f"other processes used {cpu.other_cores:.2f} cores while profiling: waiting, then again")
        wait_for_quiet(args.quiet_wait)
    q = jct.quality
    assert q is not None, "a fitted JCT model carries its quality"
    print(
        f"JCT profile ({profile_s:.1f} s): held-out r={q.pearson_r:.3f}, median error "
        f"{1e3 * q.median_abs_error_s:.0f} ms ({100 * q.median_rel_error:.0f}%), coef {jct.coef}"
    )

    tok = engine.tokenizer
    labels = label_ids(tok)
    workloads = build_traces(args, tok, tuple(args.workloads.split(",")))
    if "WL1" in workloads:
        pool = limit_pool(engine, workloads["WL1"], args.cache_profiles)
        print(f"prefix pool limited to {pool} tokens ({args.cache_profiles} WL1 profiles)")

    report: dict[str, Any] = {
        "machine": info,
        "args": vars(args),
        "jct_fit": {"profile_seconds": profile_s, "coef": jct.coef, **asdict(q)},
        "workloads": {},
    }
    # One calibration for the whole benchmark, as one long-lived server would have.
    cal = CalibratedJCT(jct)
    all_runs: list[dict[str, Any]] = []  # everything with a step log, in the order it ran
    partial = RESULTS / "schedule.partial.json"
    for name, items in workloads.items():
        reqs, unit = requests_and_arrivals(items, labels, args.seed)
        tokens = sum(len(r.input_ids) for r in reqs)
        print(f"\n{name}: {len(reqs)} requests, {tokens} tokens, mean {tokens / len(reqs):.0f} per request")

        wait_for_quiet(args.quiet_wait)
        iso = isolated(engine, cal, reqs)
        all_runs.append(iso)
        slo = args.slo_x * iso["mean_s"]
        print(f"  isolated: mean {iso['mean_s']:.2f} s, P99 {iso['p99_s']:.2f} s -> P99 SLO {slo:.2f} s")
        wait_for_quiet(args.quiet_wait)
        sat = run_trace(engine, cal, "po", args.fairness_lambda, reqs, None)
        sat_qps = len(reqs) / sat["makespan_s"]
        print(f"  saturated (po, all at t=0): {sat_qps:.3f} req/s, hit rate {sat['hit_rate']:.0%}")
        all_runs.append(sat)

        base_qps = anchor_qps(args.anchor, iso, sat_qps)
        print(f"  anchor ({args.anchor}): {base_qps:.3f} req/s")
        runs: list[dict[str, Any]] = []
        for m in [float(x) for x in getattr(args, f"mults_{name.lower()}").split(",")]:
            qps = m * base_qps
            arrivals = [u / qps for u in unit]
            for pol in policies:
                wait_for_quiet(args.quiet_wait)
                r = run_trace(engine, cal, pol, args.fairness_lambda, reqs, arrivals)
                r.update(mult=m, qps=qps)
                runs.append(r)
                print(
                    f"  {m:5.2f}x {qps:6.3f} qps {pol:4s}: mean {r['mean_s']:6.2f} s  P99 {r['p99_s']:6.2f} s  "
                    f"hits {r['hit_rate']:4.0%}  steps {r['steps']:3d}  other cores {r['other_cores']:.2f}"
                )
                if not args.quick:  # a long run that gets killed keeps what it measured
                    RESULTS.mkdir(exist_ok=True)
                    partial.write_text(json.dumps({"report": report, "running": {name: runs}}, default=str))
        all_runs += runs
        at_slo = slo_table(runs, iso["mean_s"], slo_xs, policies)
        report["workloads"][name] = {
            "requests": len(reqs),
            "tokens": tokens,
            "isolated": iso,
            "slo_p99_s": slo,
            "saturated_qps": sat_qps,
            "anchor": args.anchor,
            "anchor_qps": base_qps,
            "saturated": sat,
            "runs": runs,
            "sustained_qps": at_slo[f"{args.slo_x:g}"]["sustained_qps"],
            "po_vs_fcfs": at_slo[f"{args.slo_x:g}"]["po_vs_fcfs"],
            "at_slo": at_slo,
            "jct": jct_quality(runs),
        }
    report["jct_online"] = jct_quality(all_runs)

    md = render(report, policies)
    print("\n" + md["text"])
    if args.quick:
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "schedule.json").write_text(json.dumps(report, indent=1))
    (RESULTS / "schedule.md").write_text(md["markdown"])
    plot(report, policies, RESULTS / "schedule.png")
    partial.unlink(missing_ok=True)
    print(f"wrote {RESULTS / 'schedule.json'}, schedule.md, schedule.png")


# ---- simulation ---------------------------------------------------------------------------------


def simulate_sweep(
    model: JCTModel,
    reqs: list[ScoreRequest],
    unit: list[float],
    mults: list[float],
    policies: list[str],
    lam: float,
    cache_tokens: int,
    max_batch_tokens: int,
) -> dict[str, Any]:
    """The sweep of `main` on the simulator: isolated latency (each request alone, in trace
    order, the cache carried over), then every (multiple of the isolated rate, policy)."""

    def run(policy: str, arrivals: list[float]) -> list[SimRun]:
        cache = PrefixLRU(cache_tokens, max_batch_tokens)
        trace = list(zip(arrivals, reqs, strict=True))
        return simulate(SchedulerConfig(policy, lam), model, trace, cache)

    def summary(runs: list[SimRun]) -> dict[str, Any]:
        lat = np.array([r.end - r.arrival for r in runs])
        cached = sum(r.cached for r in runs)
        steps = max(r.step for r in runs) + 1
        return {
            "mean_s": float(lat.mean()),
            "p50_s": float(np.percentile(lat, 50)),
            "p99_s": float(np.percentile(lat, 99)),
            "hit_rate": cached / sum(len(r.input_ids) for r in reqs),
            "steps": steps,
            "mean_batch": len(runs) / steps,
            "other_cores": 0.0,
        }

    gap = 1e6  # seconds between requests: none ever waits
    iso = summary(run("fcfs", [gap * i for i in range(len(reqs))]))
    base = 1.0 / iso["mean_s"]
    out: list[dict[str, Any]] = []
    for m in mults:
        qps = m * base
        for pol in policies:
            out.append({"policy": pol, "mult": m, "qps": qps, **summary(run(pol, [u / qps for u in unit]))})
    return {"isolated": iso, "anchor": "isolated", "anchor_qps": base, "runs": out}


def simulate_main(args: argparse.Namespace, policies: list[str], slo_xs: list[float]) -> None:
    measured = RESULTS / "schedule.json"
    engine = Engine.from_pretrained("embedded", cache_policy="declared", max_input_len=4096)
    if measured.is_file():
        coef = json.loads(measured.read_text())["jct_fit"]["coef"]
        model, source = JCTModel(tuple(coef)), f"the fit of the measured run ({measured.name})"
    else:
        model, source = load_or_profile(engine), "this machine's persisted profile"
    print(f"step times: JCT model from {source}: coef {model.coef}")
    labels = label_ids(engine.tokenizer)
    traces = build_traces(args, engine.tokenizer, tuple(args.workloads.split(",")))
    if "WL1" in traces:
        users, posts = (int(x) for x in args.sim_paper.split(","))
        paper = argparse.Namespace(**{**vars(args), "wl1_users": users, "wl1_items": posts})
        traces[f"WL1 {users}x{posts}"] = build_traces(paper, engine.tokenizer, ("WL1",))["WL1"]
    pool = pool_tokens(traces["WL1"], args.cache_profiles) if "WL1" in traces else 0
    mults = [float(x) for x in args.sim_mults.split(",")]
    report: dict[str, Any] = {
        "args": vars(args),
        "jct_source": source,
        "coef": model.coef,
        "pool_tokens": pool,
        "workloads": {},
    }
    for name, items in traces.items():
        reqs, unit = requests_and_arrivals(items, labels, args.seed)
        t = time.perf_counter()
        w = simulate_sweep(
            model, reqs, unit, mults, policies, args.fairness_lambda, pool, engine.config.max_batch_tokens
        )
        slo = args.slo_x * w["isolated"]["mean_s"]
        at_slo = slo_table(w["runs"], w["isolated"]["mean_s"], slo_xs, policies)
        w.update(requests=len(reqs), slo_p99_s=slo, at_slo=at_slo)
        report["workloads"][name] = w
        ratios = ", ".join(f"{x}x: {a['po_vs_fcfs']}" for x, a in at_slo.items())
        print(
            f"{name}: {len(reqs)} requests simulated in {time.perf_counter() - t:.1f} s; po / fcfs {ratios}"
        )
    md = render_sim(report, policies)
    print("\n" + md)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "schedule_sim.json").write_text(json.dumps(report, indent=1))
    (RESULTS / "schedule_sim.md").write_text(md)
    plot(report, policies, RESULTS / "schedule_sim.png")
    print(f"wrote {RESULTS / 'schedule_sim.json'}, schedule_sim.md, schedule_sim.png")


def render_sim(report: dict[str, Any], policies: list[str]) -> str:
    a = report["args"]
    header = ["workload", "x isolated", "policy", "mean s", "P99 s", "hits", "items/step"]
    rows = [
        [
            name,
            f"{r['mult']:g}",
            r["policy"],
            f"{r['mean_s']:.2f}",
            f"{r['p99_s']:.2f}",
            f"{r['hit_rate']:.0%}",
            f"{r['mean_batch']:.1f}",
        ]
        for name, w in report["workloads"].items()
        for r in w["runs"]
    ]
    sum_header, sum_rows = slo_rows(report, policies)
    return (
        "# bench_schedule --simulate: the same policies on the simulator (no machine noise)\n\n"
        "`po_backend.simulator`: the real Scheduler and policies, a prefix cache of whole declared prefixes "
        f"(LRU, {report['pool_tokens']} tokens = {a['cache_profiles']:g} WL1 profiles), step time = the JCT "
        f"model ({report['jct_source']}), a virtual clock. Same traces, arrival pattern and seed as the "
        f"measured run; fairness lambda {a['fairness_lambda']}; QPS as multiples of the isolated throughput "
        "(each request alone). The paper-shaped trace has the paper's users x posts at our token lengths.\n\n"
        + markdown_table(sum_header, sum_rows)
        + "\n\n"
        + markdown_table(header, rows)
        + "\n"
    )


# ---- output ---------------------------------------------------------------------------------


def slo_rows(report: dict[str, Any], policies: list[str]) -> tuple[list[str], list[list[str]]]:
    """The sustained-QPS table: per workload and policy, the QPS at each P99 SLO, and po / fcfs."""
    first = next(iter(report["workloads"].values()))
    header = ["workload", "policy"] + [f"QPS at P99 <= {x}x isolated" for x in first["at_slo"]]
    rows = []
    for name, w in report["workloads"].items():
        for p in [*policies, "po / fcfs"]:
            cells = []
            for sl in w["at_slo"].values():
                if p == "po / fcfs":
                    cells.append(sl["po_vs_fcfs"])
                else:
                    q = sl["sustained_qps"][p]
                    cells.append(f"{q['mark']}{q['qps']:.3f} ({q['qps'] / w['anchor_qps']:.2f}x)")
            rows.append([name, p, *cells])
    return header, rows


def render(report: dict[str, Any], policies: list[str]) -> dict[str, str]:
    header = [
        "workload",
        "QPS",
        "x anchor",
        "policy",
        "mean s",
        "P50 s",
        "P99 s",
        "hits",
        "steps",
        "items/step",
    ]
    rows = []
    for name, w in report["workloads"].items():
        for r in sorted(w["runs"], key=lambda r: (r["qps"], POLICY_ORDER.index(r["policy"]))):
            flag = "*" if r["other_cores"] > 0.5 else ""
            rows.append(
                [
                    name,
                    f"{r['qps']:.3f}",
                    f"{r['mult']:g}",
                    r["policy"] + flag,
                    f"{r['mean_s']:.2f}",
                    f"{r['p50_s']:.2f}",
                    f"{r['p99_s']:.2f}",
                    f"{r['hit_rate']:.0%}",
                    r["steps"],
                    f"{r['mean_batch']:.1f}",
                ]
            )
    sum_header, summary_rows = slo_rows(report, policies)
    f = report["jct_fit"]
    o = report["jct_online"]
    lines = [
        f"JCT fit at start: {f['profile_seconds']:.1f} s to profile; held-out r = {f['pearson_r']:.3f}, "
        f"median abs error {1e3 * f['median_abs_error_s']:.0f} ms ({100 * f['median_rel_error']:.0f}%)",
        f"JCT on the {o['steps']} benchmark steps (held out): r = {o['r_raw']:.3f} raw, "
        f"{o['r_calibrated']:.3f} calibrated; median rel error {100 * o['median_rel_error_raw']:.0f}% raw, "
        f"{100 * o['median_rel_error_calibrated']:.0f}% calibrated",
    ]
    for name, w in report["workloads"].items():
        lines.append(
            f"{name}: {w['requests']} requests, saturated (all at t=0, po) {w['saturated_qps']:.3f} req/s, "
            f"anchor ({w['anchor']}) {w['anchor_qps']:.3f} req/s, isolated mean "
            f"{w['isolated']['mean_s']:.2f} s, P99 SLO {w['slo_p99_s']:.2f} s; po / fcfs QPS at the SLO: "
            f"{w['po_vs_fcfs']}"
        )
    text = (
        text_table(header, rows) + "\n\n" + text_table(sum_header, summary_rows) + "\n\n" + "\n".join(lines)
    )
    a = report["args"]
    markdown = (
        "# bench_schedule: scheduling policies under Poisson load (embedded SmolLM2-135M, CPU)\n\n"
        f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, torch "
        f"{report['machine']['torch']}. fairness lambda {a['fairness_lambda']}; P99 SLO = {a['slo_x']:g} x "
        f"mean isolated latency; prefix pool = {a['cache_profiles']:g} WL1 profiles.\n"
        f"WL1: {a['wl1_users']} users x {a['wl1_items']} posts, profiles ~{a['wl1_profile']} tokens, "
        f"posts {a['wl1_item_tokens']} tokens. WL2: {a['wl2_requests']} histories of "
        f"{a['wl2_min']}-{a['wl2_max']} tokens. Arrivals: Poisson, seed {a['seed']}, shuffled order.\n"
        "A `*` marks runs during which other processes used more than half a core. Sustained QPS: "
        "interpolated (log-log) where P99 crosses the SLO; `>=` every point passed, `<` none did; "
        f"(Nx) = as a multiple of the anchor: the {a.get('anchor', 'saturated')} throughput.\n\n"
        + markdown_table(header, rows)
        + "\n\n"
        + markdown_table(sum_header, summary_rows)
        + "\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + "\n"
    )
    return {"text": text, "markdown": markdown}


def plot(report: dict[str, Any], policies: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    names = list(report["workloads"])
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 4 * len(names)), squeeze=False)
    for row, name in zip(axes, names, strict=True):
        w = report["workloads"][name]
        for col, (key, label) in enumerate((("mean_s", "mean latency (s)"), ("p99_s", "P99 latency (s)"))):
            ax = row[col]
            for p in policies:
                pts = sorted((r["qps"], r[key]) for r in w["runs"] if r["policy"] == p)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
            if key == "p99_s":
                ax.axhline(w["slo_p99_s"], color="grey", linestyle="--", label="P99 SLO")
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):  # plain numbers at 1-2-5 steps, not 3x10^-1
                axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                axis.set_major_formatter(ticker.FormatStrFormatter("%g"))
                axis.set_minor_formatter(ticker.NullFormatter())
            ax.set_xlabel("QPS (requests/s)")
            ax.set_ylabel(label)
            ax.set_title(f"{name}: {label} (anchor {w['anchor_qps']:.2f} req/s)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
