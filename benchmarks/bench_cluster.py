"""Prefix affinity through the real SGLang router: WL1-style users x posts over N PrefillOnly workers
(launch_cluster's commands, CPU threads split), cache_aware against round_robin in the same run, each
(traffic shape, policy) run on a fresh router and flushed worker caches. Shapes: `generate` (plain
SGLang traffic: one prompt per call, profile first, no prefix declared) and `rerank` (the profile as
the query, `--docs-per-call` posts as documents). A pass-through tap in front of each worker records
which worker got which call (the router does not say). REPORT.md describes the measures.

`--simulate`: past one machine (`po_backend.sim.cluster`), per router and N of `--sim-workers`, the
highest QPS with P99 <= `--slo-x` x the isolated mean latency (bracket, then bisection) on the
paper's WL1 (`--sim-users` x `--sim-posts`, token lengths / `--scale`). Each worker is the real
Scheduler under `po`, an LRU prefix cache of `--pool-gib` of KV, step times from the JCT fit in
results/schedule.json (else this machine's profile).

    python -m benchmarks.bench_cluster [--quick]               # ~6 min on 2 cores; --quick ~1.5 min
    python -m benchmarks.bench_cluster --simulate [--quick]    # ~3-5 min; --quick ~20 s, 1..8 workers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import random
import secrets
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from benchmarks import harness, report
from benchmarks.bench_serving import Call, make_calls, scrape, send_open_loop, summarize, warm_up
from benchmarks.harness import RESULTS, GiB
from po_backend.core.choices import ROUTER_POLICIES
from po_backend.core.settings import DEFAULT_FAIRNESS_LAMBDA
from po_backend.entrypoints import launch_cluster as lc
from po_backend.entrypoints.spawn import ServerProcess, free_port
from po_backend.sched.config import SchedulerConfig
from po_backend.sim import cluster as sim
from po_backend.sim.simulator import PrefixLRU

SHAPES = ("generate", "rerank")
POLICIES = (report.AFFINITY, report.SPREAD)  # the default pair of launch_cluster's ROUTER_POLICIES
KEY_TOKENS = 24  # a profile's first ids: "User 12 profile. Interests: ..." differ between users
KEY_CHARS = 120  # the same for text
Seen = list[tuple[int, str | tuple[int, ...], int]]  # (worker, call key, items) per forwarded call


def call_key(body: dict[str, Any]) -> str | tuple[int, ...] | None:
    """What tells a call's user from the body the router forwards (which keeps the request as the
    client sent it, minus fields it does not know): the rerank query, else the prompt's start."""
    if isinstance(body.get("query"), str):
        return body["query"]
    ids, text = body.get("input_ids"), body.get("text")
    if isinstance(ids, list) and ids:
        return tuple(ids[0] if isinstance(ids[0], list) else ids)[:KEY_TOKENS]
    if isinstance(text, str | list) and text:
        return (text[0] if isinstance(text, list) else text)[:KEY_CHARS]
    return None


def call_items(body: dict[str, Any]) -> int:
    """Prompts in a call: rerank documents, else the prompts of a /generate batch."""
    if isinstance(body.get("documents"), list):
        return len(body["documents"])
    first = body.get("input_ids") or body.get("text")
    return len(first) if isinstance(first, list) and first and isinstance(first[0], list | str) else 1


class Tap:
    """A pass-through HTTP/1.1 proxy in front of worker `index` that notes (index, call key, items)
    in `seen` for every scoring POST it forwards; everything else passes unchanged."""

    def __init__(self, index: int, target: str, seen: Seen) -> None:
        self.client = client = httpx.Client(base_url=target, timeout=900)  # thread-safe, pooled

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: the router reuses its connections

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with contextlib.suppress(ValueError):
                    call = json.loads(body) if self.command == "POST" and body else None
                    if isinstance(call, dict) and (key := call_key(call)) is not None:
                        seen.append((index, key, call_items(call)))  # list.append is atomic
                keep = ("content-type", "authorization")
                headers = {k: v for k, v in self.headers.items() if k.lower() in keep}
                try:
                    r = client.request(self.command, self.path, content=body or None, headers=headers)
                    status, ctype, data = r.status_code, r.headers.get("content-type"), r.content
                except httpx.HTTPError as e:
                    status, ctype, data = 502, "text/plain", f"tap: {e}".encode()
                self.send_response(status)
                self.send_header("content-type", ctype or "application/octet-stream")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _forward

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one line per health check would drown the benchmark's output

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()


@dataclass(frozen=True)
class Worker:
    url: str
    pid: int
    tap: Tap


@contextlib.contextmanager
def workers_up(args: argparse.Namespace, seen: Seen) -> Iterator[list[Worker]]:
    """`--workers` PrefillOnly workers as launch_cluster starts them, each behind a tap."""
    gpus = lc.visible_gpus()
    envs = [lc.worker_env(args.workers, i, gpus) for i in range(args.workers)]
    servers = [harness.our_server(args.worker_args.split(), args.model_path, env=env) for env in envs]
    taps = [Tap(i, s.url, seen) for i, s in enumerate(servers)]
    try:
        with harness.servers_up(servers, args.startup_timeout):
            yield [Worker(s.url, s.proc.pid, t) for s, t in zip(servers, taps, strict=True) if s.proc]
    finally:
        for t in taps:
            t.close()


@contextlib.contextmanager
def router_up(
    workers: Sequence[Worker], policy: str, timeout: float
) -> Iterator[tuple[str, int, list[str], dict[str, str]]]:
    """A fresh router (launch_cluster's command and keys, without the public port's gate) in front
    of the workers' taps, ready once every worker is registered and healthy (the first calls must
    not all go to the first one up); with the headers its data routes take."""
    port = free_port()
    admin, worker = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    data, control = ({"Authorization": f"Bearer {k}"} for k in (worker, admin))
    cmd = lc.router_command([w.tap.url for w in workers], "127.0.0.1", port, policy)
    router = ServerProcess(
        cmd, f"http://127.0.0.1:{port}", env=lc.keys_env(None, admin, worker), health_path="/get_model_info"
    )
    router.start()
    try:
        router.wait_ready(timeout, headers=data)
        assert router.proc is not None, "started"
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                listed = (
                    httpx.get(router.url + "/workers", headers=control, timeout=2).json().get("workers", [])
                )
                if sum(bool(w.get("is_healthy")) for w in listed) == len(workers):
                    break
            if router.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router ({policy}) not ready; its output ends:\n{router.log_text()}")
            time.sleep(0.3)
        yield router.url, router.proc.pid, cmd, data
    finally:
        router.stop()


def shape_calls(args: argparse.Namespace, tok: Any, shape: str) -> list[Call]:
    """The WL1 trace as bench_serving builds it, calls shuffled: `generate` one prompt per call, no
    `cache_prefix_len`; `rerank` the profile as the query, `--docs-per-call` posts as documents."""
    ns = argparse.Namespace(**vars(args), items=args.posts, history_tokens=0)
    ns.workload, ns.api, ns.prefix_hint = "wl1", shape, False
    ns.items_per_call = 1 if shape == "generate" else args.docs_per_call
    return make_calls(ns, tok)


def token_counters(url: str) -> tuple[float, float]:
    """(prompt tokens, tokens read from the prefix cache) a worker has scored so far."""
    m = scrape(url)
    if "po_prompt_tokens_total" not in m:
        raise RuntimeError(f"{url}/metrics has no po_prompt_tokens_total: not a PrefillOnly worker?")
    return m["po_prompt_tokens_total"], m["po_cache_hit_tokens_total"]


def run_one(
    shape: str, rate: float, policy: str, workers: list[Worker], calls: list[Call], seen: Seen, args: Any
) -> dict[str, Any]:
    """One (shape, offered posts/s, policy) run on flushed workers behind a fresh router, on the
    same unit-rate Poisson arrival pattern as every run, scaled to the rate."""
    per_call = sum(len(c.suffixes) for c in calls) / len(calls)
    qps = rate / per_call  # calls/s
    arrivals = [u / qps for u in harness.poisson_arrivals(len(calls), random.Random(args.seed + 1))]
    with router_up(workers, policy, args.startup_timeout) as (url, router_pid, cmd, headers):
        for w in workers:  # directly, not through the router: each worker must say it flushed
            httpx.post(w.url + "/flush_cache", timeout=60).raise_for_status()
        seen.clear()
        harness.wait_for_quiet(args.quiet_wait)
        before = [token_counters(w.url) for w in workers]
        # CPU of each worker and of the router, and of everything else: other users of the machine.
        pids = [*(w.pid for w in workers), router_pid]
        with contextlib.ExitStack() as stack:
            shares = [stack.enter_context(harness.CpuShare(p)) for p in pids]
            outcomes, span = asyncio.run(send_open_loop(url, calls, arrivals, args.timeout, headers))
        after = [token_counters(w.url) for w in workers]
    # Where each call went: a call the router retried counts on both workers.
    user_of = {call_key(c.body): c.user for c in calls}
    where: dict[int, set[int]] = defaultdict(set)  # user -> the workers its calls reached
    for i, key, _ in seen:
        if key in user_of:
            where[user_of[key]].add(i)
    per_worker = [
        {
            "prompt_tokens": p1 - p0,
            "cached_tokens": c1 - c0,
            "share": (c1 - c0) / (p1 - p0) if p1 > p0 else 0.0,
            "calls": sum(j == i for j, _, _ in seen),
            "items": sum(n for j, _, n in seen if j == i),
            "users": sum(i in ws for ws in where.values()),
        }
        for i, ((p1, c1), (p0, c0)) in enumerate(zip(after, before, strict=True))
    ]
    prompt = sum(w["prompt_tokens"] for w in per_worker)
    cached = sum(w["cached_tokens"] for w in per_worker)
    row: dict[str, Any] = {
        "shape": shape,
        "rate": rate,
        "policy": policy,
        "router_cmd": cmd[1:],
        **summarize(outcomes, span, qps, per_call),
        "cluster_cores": sum(s.pid_cores for s in shares),
        "other_cores": max(0.0, shares[0].other_cores - sum(s.pid_cores for s in shares[1:])),
        "workers": per_worker,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "workers_per_user": {str(u): len(ws) for u, ws in sorted(where.items())},
        "traced_calls": len(seen),
    }
    print(" | ".join(report.cluster_rows({"runs": [row]})[0]), flush=True)
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, None, "4 users x 5 posts (~1.5 min); --simulate: 200 x 20 x 1..8 workers")
    harness.flags(
        ap, model_path="embedded", workers=2, worker_args=("--max-input-len 2048", "every worker's flags")
    )
    harness.flags(ap, shapes=(",".join(SHAPES), f"of {','.join(SHAPES)}"))
    harness.flags(ap, policies=(",".join(POLICIES), "router policies, in the run's order"))
    harness.flags(ap, generate_as=(["ids", "text"], "/generate: input_ids or text"), users=16)
    harness.flags(ap, posts=(10, "posts per user"), profile_tokens=(800, "mean profile length (+-50%%)"))
    harness.flags(ap, item_tokens=(80, "tokens per post"), docs_per_call=(2, "rerank: posts per call"))
    # By default one load both routers keep up with, one between their capacities, one past both.
    harness.flags(ap, items_per_s=("4,12,30", "offered posts/s (Poisson), comma list"))
    harness.flags(ap, seed=(0, "trace, call order and arrivals"), timeout=(600.0, "per call, seconds"))
    harness.flags(ap, quiet_wait=(20.0, "max seconds to wait for an idle CPU"), startup_timeout=600.0)
    harness.flags(ap, simulate=(False, "N workers behind the router, simulated"))
    # --simulate only: the trace, each simulated worker, the P99 bound and the search for its QPS.
    harness.flags(ap, sim_workers="1,2,4,8,16,32,64", sim_users=1000, sim_posts=50)
    harness.flags(ap, scale=(8.0, "the paper's token lengths / this"), max_batch_tokens=8192)
    # 1 GiB holds ~26 of our profiles, as an 80 GB GPU holds ~30 of the paper's 14k-token ones for an 8B model.
    harness.flags(ap, pool_gib=(1.0, "prefix-KV memory per worker"), fairness_lambda=DEFAULT_FAIRNESS_LAMBDA)
    harness.flags(ap, slo_x=(8.0, "P99 bound = this x mean isolated latency"))
    # Every user's first, cold, request falls early in the trace; 0 = the whole trace, as bench_schedule.
    harness.flags(ap, warmup=(0.0, "trace share left out of the P99"))
    harness.flags(ap, balance_abs_threshold=(lc.BALANCE_ABS_THRESHOLD, "cache_aware's load rule"))
    harness.flags(ap, rel_tol=(0.05, "bisection stops within this ratio"))
    harness.flags(ap, jct=(RESULTS / "schedule.json", "bench_schedule's results"))
    args = ap.parse_args(argv)
    args.out = args.out or RESULTS / ("cluster_sim.json" if args.simulate else "cluster.json")
    if args.quick and args.simulate:
        args.sim_users, args.sim_posts, args.sim_workers = 200, 20, "1,2,4,8"
    elif args.quick:
        args.users, args.posts, args.profile_tokens, args.items_per_s = 4, 5, 600, "3"
    args.policies, args.shapes = args.policies.split(","), args.shapes.split(",")
    try:
        args.items_per_s = [float(x) for x in args.items_per_s.split(",")]
        args.sim_workers = sorted({int(n) for n in args.sim_workers.split(",")})
    except ValueError:
        ap.error("--items-per-s and --sim-workers take comma lists of numbers")
    allowed = ROUTER_POLICIES
    sizes = (args.workers, args.users, args.posts, args.docs_per_call, *args.items_per_s, *args.sim_workers)
    checks = {
        f"--policies of {allowed}": set(args.policies) <= set(allowed),
        f"--shapes of {SHAPES}": set(args.shapes) <= set(SHAPES),
        "--warmup in [0, 1)": 0 <= args.warmup < 1,
        "--workers, --users, --posts, --docs-per-call, --items-per-s, --sim-workers > 0": min(sizes) > 0,
    }
    if bad := [k for k, ok in checks.items() if not ok]:
        ap.error("; ".join(bad))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if args.simulate:
        return simulate(args)
    t0 = time.perf_counter()
    tok = harness.tokenizer(args.model_path)
    traces = {s: shape_calls(args, tok, s) for s in SHAPES}
    gen = traces["generate"]
    profiles = {c.prefix for c in gen}
    workload = {
        "users": args.users,
        "posts": args.posts,
        "mean_profile_tokens": sum(map(len, profiles)) / len(profiles),
        "mean_post_tokens": sum(len(c.suffixes[0]) for c in gen) / len(gen),
        "calls": {s: len(traces[s]) for s in args.shapes},
    }
    machine = harness.machine_info()
    print(
        f"{args.users} users x {args.posts} posts, profiles ~{workload['mean_profile_tokens']:.0f} tokens, "
        f"{args.workers} workers, {','.join(f'{r:g}' for r in args.items_per_s)} posts/s offered | {machine['cpu']}"
    )
    seen: Seen = []
    rows: list[dict[str, Any]] = []
    with workers_up(args, seen) as workers:
        for w in workers:  # one-off start-up costs (allocator, kernels) stay out of the numbers
            for calls in traces.values():
                warm_up(w.url, calls[-1], args.timeout)
        info = httpx.get(workers[0].url + "/server_info", timeout=10).json()
        for k, (shape, rate) in enumerate((s, r) for s in args.shapes for r in args.items_per_s):
            # Alternate which policy runs first, so neither always gets the later, warmer slot.
            for policy in args.policies if k % 2 == 0 else args.policies[::-1]:
                rows.append(run_one(shape, rate, policy, workers, traces[shape], seen, args))
    doc: dict[str, Any] = {
        "machine": machine,
        "args": vars(args),
        "threads_per_worker": lc.worker_threads(args.workers),
        # What the workers resolved (dtype, pool policy, scheduler, ...): /server_info minus its live state.
        "worker_settings": {k: v for k, v in info.items() if k != "internal_states"},
        "workload": workload,
        "runs": rows,
        "seconds": time.perf_counter() - t0,
    }
    doc["ratios"] = report.cluster_ratios(doc)
    harness.save(args.out, doc, report.cluster_markdown(doc))
    return 1 if sum(r["calls"] - r["ok"] for r in rows) else 0


# ---- --simulate: N workers behind the router's policies -------------------------------------------


def kv_bytes_per_token() -> tuple[int, str]:
    """What one cached token of the embedded model costs (K and V of every layer) at the CPU dtype."""
    import torch

    from po_backend.engine.cache.kv_pool import KVPool
    from po_backend.engine.config import parse_dtype
    from po_backend.engine.models.loader import read_config, resolve_model_dir

    cfg, dtype = read_config(resolve_model_dir("embedded")), parse_dtype(None, torch.device("cpu"))
    return KVPool.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype), str(dtype)


def sim_summary(
    res: sim.ClusterResult, qps: float, since: float, span_s: float, slo: float
) -> dict[str, Any]:
    """A run at `qps`: latency over the requests that arrived from `since` on, hit rate, balance."""
    lat = [r.end - r.arrival for r in res.runs if r.arrival >= since]
    return {
        "qps": qps,
        "p99_s": sim.p99(lat),
        "mean_s": sum(lat) / len(lat),
        "span_over_bound": span_s / slo,
        "hit_rate": res.hit_rate,
        "imbalance": res.imbalance,
        "busy_share": [w.busy_s / max(r.end for r in res.runs) for w in res.workers],
        "items_per_worker": [w.items for w in res.workers],
        "balanced_by_load": res.balanced_by_load,
        "by_match": res.by_match,
        "mean_batch": len(lat) / sum(w.steps for w in res.workers),
    }


def simulate(args: argparse.Namespace) -> int:
    """Per (router, N) the sustained QPS at the P99 bound (report.py: table and plot)."""
    t0 = time.perf_counter()
    model, source = harness.sim_step_model(args.jct)
    per_token, dtype = kv_bytes_per_token()
    pool = int(args.pool_gib * GiB) // per_token
    shape = sim.TraceShape(users=args.sim_users, posts=args.sim_posts, scale=args.scale, seed=args.seed)
    reqs, unit = sim.paper_trace(shape)
    prefixes = {r.input_ids[: r.cache_prefix_len] for r in reqs}
    mean_prefix = sum(map(len, prefixes)) / len(prefixes)
    print(
        f"trace: {len(reqs)} requests ({args.sim_users} users x {args.sim_posts} posts), mean prompt "
        f"{sum(len(r.input_ids) for r in reqs) / len(reqs):.0f} tokens, mean profile {mean_prefix:.0f}; "
        f"step times: {source}, coef {model.coef}; prefix pool per worker: {args.pool_gib:g} GiB / "
        f"{per_token} B per token ({dtype}) = {pool} tokens = {pool / mean_prefix:.0f} profiles"
    )
    sched = SchedulerConfig("po", args.fairness_lambda)
    cache = functools.partial(PrefixLRU, pool, args.max_batch_tokens)

    def run(
        n: int, router: str, trace: list[tuple[float, Any]], slo: float | None = None, since: float = 0.0
    ) -> sim.ClusterResult:
        config = sim.RouterConfig(router, balance_abs_threshold=args.balance_abs_threshold, seed=args.seed)
        return sim.simulate_cluster(sched, model, trace, n, config, cache, slo, since)

    iso = run(1, "round_robin", [(1e6 * i, r) for i, r in enumerate(reqs)])  # none ever waits
    iso_mean = sum(iso.latencies) / len(reqs)
    slo = args.slo_x * iso_mean
    print(f"isolated: mean {iso_mean:.3f} s, hits {iso.hit_rate:.1%}; P99 bound {slo:.2f} s")
    skip = unit[int(args.warmup * len(unit))] if args.warmup > 0 else 0.0  # unit-rate seconds
    rows: list[dict[str, Any]] = []
    for policy in args.policies:
        guess, prev_n = 1.0 / iso_mean, 1
        for n in args.sim_workers:
            guess *= n / prev_n
            found: dict[float, dict[str, Any]] = {}  # qps -> sim_summary of a complete run

            def p99_at(qps: float, n: int = n, policy: str = policy, found: dict = found) -> float:
                res = run(n, policy, [(u / qps, r) for u, r in zip(unit, reqs, strict=True)], slo, skip / qps)
                if not res.complete:  # it gave up past the bound
                    return math.inf
                found[qps] = sim_summary(res, qps, skip / qps, unit[-1] / qps, slo)
                return found[qps]["p99_s"]

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
                row = {"router": policy, "workers": n, "sustained_qps": qps, "runs": runs, **found[qps]}
            rows.append(row)
            guess, prev_n = row["sustained_qps"], n
            print(
                f"  {policy:12s} N={n:3d}: {guess:8.3f} qps ({guess / n:.3f} per worker), P99 {row['p99_s']:6.2f} s, "
                f"hits {row['hit_rate']:5.1%}, imbalance {row['imbalance']:.3f}, load-balanced "
                f"{row['balanced_by_load']}, {row['runs']} runs in {time.perf_counter() - t:.1f} s"
            )
    settings = sim.RouterConfig("cache_aware", balance_abs_threshold=args.balance_abs_threshold)
    doc = {
        # report.py reads the trace's size as users and posts, the workers simulated as workers.
        "args": {**vars(args), "users": args.sim_users, "posts": args.sim_posts, "workers": args.sim_workers},
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
            k: getattr(settings, k)
            for k in ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold")
        },
        "seconds": time.perf_counter() - t0,
    }
    harness.save(args.out, doc, report.cluster_sim_markdown(doc))
    report.plot_cluster_sim(doc, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
