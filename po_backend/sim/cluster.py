"""Past one machine, by simulation: N engines behind a routing policy on one virtual clock.

Each engine is what `po_backend.sim.simulator.simulate` runs (the real `Scheduler`, a prefix cache of
whole declared prefixes with LRU eviction, step times from a JCT model); a router in front assigns
every arriving request to one engine. A global event loop (a heap of step completions, arrivals in
time order) advances the clock. With one engine it is `simulate` exactly (tests/sched/test_cluster_sim.py).

Routers (`ROUTER_POLICIES`), as the SGLang router (sglang-router 0.3) implements them:
- cache_aware: the router keeps an approximate radix tree of what it sent to each worker (it never
  asks a worker what is cached). If the fleet is imbalanced, `max - min > balance_abs_threshold`
  and `max > balance_rel_threshold * min` over the requests outstanding per worker, the request
  goes to the least-loaded worker. Otherwise to the worker whose tree matches the longest prefix
  of the request if the match covers more than `cache_threshold` of it, else to the worker with
  the smallest tree (the most cache room). Either way the request is then inserted in the tree
  under the chosen worker. The router matches text characters; here tokens (the ratio is about
  the same). Its tree eviction is not modelled: the default `--max-tree-size` (2^26 characters)
  is above what the paper-shaped trace inserts.
- round_robin: worker i mod N.
- power_of_two: two distinct workers drawn at random (seeded), the less loaded one.

Torch-free, like the simulator. `benchmarks/bench_cluster.py --simulate` replays a paper-shaped trace
(`paper_trace`) for 1..64 workers.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from po_backend.core.choices import ROUTER_POLICIES
from po_backend.core.request import ScoreRequest, common_prefix
from po_backend.sched.batching import Batchable, Request
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import JCTModel, feature_values
from po_backend.sched.reuse import Pool
from po_backend.sched.scheduler import Scheduler
from po_backend.sim.simulator import SimRun, StepModel, VirtualClock

# ---- engines' parts ---------------------------------------------------------------------------------


class EngineCache(Protocol):
    """What the event loop needs of an engine's prefix cache (`simulator.PrefixLRU` has it)."""

    def cached_len(self, req: Request) -> int: ...

    def batchable(self, candidates: Sequence[Request]) -> list[tuple[int, int]]: ...

    def step(self, reqs: Sequence[Request], ranks: Sequence[int] | None = None) -> list[int]: ...


@dataclass(frozen=True)
class LinearStepModel(JCTModel):
    """`jct.JCTModel` (its features, checks and `predict`) with a step priced in plain Python floats
    (`jct.feature_values`): the scheduler prices every waiting request before every step, and a
    numpy call per price dominated the simulation. Same predictions up to rounding."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "coef", tuple(float(c) for c in self.coef))
        super().__post_init__()
        if not all(math.isfinite(c) for c in self.coef):
            raise ValueError(f"coefficients must be finite: {self.coef}")

    def predict_items(self, items: Sequence[tuple[int, int]]) -> float:
        return sum(c * f for c, f in zip(self.coef, feature_values(items), strict=True))


# ---- the router --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterConfig:
    """A routing policy and its parameters; the defaults are sglang-router's (`--cache-threshold`,
    `--balance-abs-threshold`, `--balance-rel-threshold` in `launch_router --help`)."""

    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    seed: int = 0  # power_of_two's draws

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {ROUTER_POLICIES}, got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or not self.balance_rel_threshold >= 1.0:
            raise ValueError(
                "need balance_abs_threshold >= 0 and balance_rel_threshold >= 1, got "
                f"{self.balance_abs_threshold}, {self.balance_rel_threshold}"
            )


class _Node:
    """An edge of the approximate tree: src[lo:hi] (a view into the request that created it, so
    inserting a request copies no tokens), children by their first token, and the workers that
    were sent a request through this edge with the time they last were."""

    __slots__ = ("children", "hi", "lo", "src", "tenants")

    def __init__(self, src: tuple[int, ...], lo: int, hi: int, tenants: dict[int, int] | None = None) -> None:
        self.src, self.lo, self.hi = src, lo, hi
        self.children: dict[int, _Node] = {}
        self.tenants: dict[int, int] = dict(tenants or {})


class ApproxTree:
    """The router's multi-tenant radix tree over what it sent to each worker (tenant), with the
    tokens each tenant holds (`size`): the cache_aware policy's view of the workers' caches."""

    def __init__(self, n_tenants: int) -> None:
        self.root = _Node((), 0, 0)
        self.size = [0] * n_tenants
        self._tick = 0

    def match(self, ids: tuple[int, ...]) -> tuple[int, int]:
        """(tokens of `ids` matched, the tenant of the deepest matched edge most recently sent
        through it); (0, -1) if nothing matches."""
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = common_prefix(child.src[child.lo : child.hi], ids[pos : pos + child.hi - child.lo])
            pos += n
            node = child
            if n < child.hi - child.lo:
                break
        if node is self.root:
            return 0, -1
        return pos, max(node.tenants, key=lambda t: (node.tenants[t], -t))

    def insert(self, ids: tuple[int, ...], tenant: int) -> None:
        self._tick += 1
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = _Node(ids, pos, len(ids), {tenant: self._tick})
                node.children[ids[pos]] = leaf
                self.size[tenant] += len(ids) - pos
                return
            edge = child.hi - child.lo
            n = common_prefix(child.src[child.lo : child.hi], ids[pos : pos + edge])
            if n < edge:  # split the edge: its first n tokens become a node of their own
                mid = _Node(child.src, child.lo, child.lo + n, child.tenants)
                child.lo += n
                mid.children[child.src[child.lo]] = child
                node.children[ids[pos]] = mid
                child = mid
            if tenant not in child.tenants:
                self.size[tenant] += n
            child.tenants[tenant] = self._tick
            pos += n
            node = child

    def smallest(self) -> int:
        """The tenant holding the fewest tokens (lowest index on ties)."""
        return min(range(len(self.size)), key=lambda t: (self.size[t], t))


class Router:
    """Assigns each arriving request to a worker from the requests outstanding per worker (routed,
    not finished: what sglang-router counts as a worker's load)."""

    def __init__(self, config: RouterConfig, n_workers: int) -> None:
        if n_workers < 1:
            raise ValueError(f"need at least one worker, got {n_workers}")
        self.config = config
        self.n = n_workers
        self._rr = 0
        self._rng = random.Random(config.seed)
        self.tree = ApproxTree(n_workers) if config.policy == "cache_aware" else None
        self.balanced_by_load = 0  # cache_aware requests sent by the imbalance rule
        self.by_match = 0  # ... to the worker with the longest match above the threshold

    def route(self, req: Request, loads: Sequence[int]) -> int:
        cfg = self.config
        if cfg.policy == "round_robin":
            w = self._rr % self.n
            self._rr += 1
            return w
        if cfg.policy == "power_of_two":
            if self.n == 1:
                return 0
            a, b = self._rng.sample(range(self.n), 2)
            return a if (loads[a], a) <= (loads[b], b) else b
        assert self.tree is not None, "cache_aware keeps a tree"
        ids = tuple(req.input_ids)
        hi, lo = max(loads), min(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            w = min(range(self.n), key=lambda i: (loads[i], i))
            self.balanced_by_load += 1
        else:
            matched, tenant = self.tree.match(ids)
            if ids and matched / len(ids) > cfg.cache_threshold:
                w = tenant
                self.by_match += 1
            else:
                w = self.tree.smallest()
        self.tree.insert(ids, w)  # in both cases: the router's view of what w has seen
        return w


# ---- the cluster ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerStats:
    items: int
    steps: int
    busy_s: float
    input_tokens: int
    reused_tokens: int  # read from the cache or a batch-mate (`Pick.n_cached`)


@dataclass(frozen=True)
class ClusterResult:
    runs: tuple[SimRun, ...]  # completion order (ties: lower worker first)
    worker_of: tuple[int, ...]  # trace index -> the worker it ran on
    workers: tuple[WorkerStats, ...]
    balanced_by_load: int  # cache_aware: requests the imbalance rule sent to the least-loaded worker
    by_match: int  # cache_aware: requests sent to the worker with the longest match
    # False: stopped early, as soon as the P99 latency was certain to exceed `give_up_over`
    complete: bool = True

    @property
    def hit_rate(self) -> float:
        """Tokens read instead of computed / input tokens, over all workers."""
        total = sum(w.input_tokens for w in self.workers)
        return sum(w.reused_tokens for w in self.workers) / total if total else 0.0

    @property
    def imbalance(self) -> float:
        """Items on the busiest worker / mean items per worker (1.0 = perfectly even)."""
        items = [w.items for w in self.workers]
        mean = sum(items) / len(items)
        return max(items) / mean if mean else 1.0

    @property
    def latencies(self) -> list[float]:
        return [r.end - r.arrival for r in self.runs]


def simulate_cluster(
    config: SchedulerConfig,
    model: StepModel,
    trace: Sequence[tuple[float, Request]],
    n_workers: int,
    router: RouterConfig,
    cache_factory: Callable[[], EngineCache],
    give_up_over: float | None = None,
    measured_from: float = 0.0,
) -> ClusterResult:
    """Run `trace` ((arrival seconds, request), any order) on `n_workers` engines, each with its
    own Scheduler (`config`), cache (`cache_factory()`) and clock, behind `router`. Arrivals at a
    time are routed and queued before the steps ending at that time pick (as `simulate` admits what
    has arrived before it picks); an idle engine picks as soon as it has work.

    give_up_over (seconds): stop as soon as more than 1% of the trace is certain to take longer
    (finished late, or still unfinished that long after arriving): the P99 latency is then above
    it whatever happens next. A search for the highest rate within a P99 bound needs no more, and
    an overloaded run would otherwise grind through a queue of thousands. Only requests arriving
    at `measured_from` seconds or later count (a warm-up left out of the P99); all run."""
    if n_workers < 1:
        raise ValueError(f"need at least one worker, got {n_workers}")
    # numpy's P99 of n values is at least the value of rank floor(0.99 (n - 1)) (ascending, from
    # 0): past the bound as soon as the n - that rank slowest are.
    measured = sum(1 for t, _ in trace if t >= measured_from)
    late_limit = measured - math.floor(0.99 * (measured - 1)) if give_up_over is not None and measured else 0
    late = aged = 0  # late: certainly above the bound; aged: arrivals checked for still running
    finished = bytearray(len(trace))
    counted = bytearray(0 if t >= measured_from else 1 for t, _ in trace)  # 1: decided, or not measured
    complete = True
    clocks = [VirtualClock() for _ in range(n_workers)]
    scheds = [Scheduler(config, model, c) for c in clocks]
    caches = [cache_factory() for _ in range(n_workers)]
    batchables: list[Batchable[Request]] = [c.batchable for c in caches]
    pools = [c if isinstance(c, Pool) else None for c in caches]  # eviction-aware po where it can
    rt = Router(router, n_workers)
    order = sorted(range(len(trace)), key=lambda i: trace[i][0])
    loads = [0] * n_workers  # outstanding: routed, not finished
    busy = [False] * n_workers
    stats = [[0, 0, 0.0, 0, 0] for _ in range(n_workers)]  # items, steps, busy_s, input, reused
    worker_of = [-1] * len(trace)
    running: dict[int, list[SimRun]] = {}
    done: list[tuple[float, int]] = []  # (end time, worker) of the steps running
    out: list[SimRun] = []
    steps = i = 0

    def start(w: int, now: float) -> None:
        nonlocal steps
        clocks[w].now = now
        pick = scheds[w].pick(caches[w].cached_len, batchables[w], pools[w])
        assert pick is not None, "a non-empty queue gives a pick"
        # As `simulate`: a prefix-only step caches a long batch request's leading tokens, and the
        # request stays queued; no request finishes in it.
        reqs: list[Request]
        if pick.prefix_only:
            reqs = [pick.prefix_request()]
            ranks = [config.cache_rank(reqs[0])]
            ran: list[tuple[Request, float]] = [(reqs[0], now)]
        else:
            reqs = [e.req for e in pick.entries]
            ranks = [config.cache_rank(r) for r in reqs]
            ran = [(e.req, e.arrival) for e in pick.entries]
        caches[w].step(reqs, ranks)  # only to update the cache: what the step reused is pick.n_cached
        seconds = model.predict_items(pick.items)
        end = now + seconds
        scheds[w].step_done(now, end, ran, seconds)
        running[w] = (
            []
            if pick.prefix_only
            else [
                SimRun(e.rid, e.arrival, now, end, c, steps)
                for e, c in zip(pick.entries, pick.n_cached, strict=True)
            ]
        )
        s = stats[w]
        s[0] += len(running[w])
        s[1] += 1
        s[2] += seconds
        s[3] += sum(n for n, _ in pick.items)
        s[4] += sum(c for _, c in pick.items)
        steps += 1
        busy[w] = True
        heapq.heappush(done, (end, w))

    while i < len(order) or done:
        t_arrival = trace[order[i]][0] if i < len(order) else math.inf
        if t_arrival <= (done[0][0] if done else math.inf):
            now, touched = t_arrival, []
            while i < len(order) and trace[order[i]][0] <= now:
                rid = order[i]
                req = trace[rid][1]
                w = rt.route(req, loads)
                if not 0 <= w < n_workers:
                    raise AssertionError(f"router chose worker {w} of {n_workers}")
                clocks[w].now = now
                scheds[w].add(rid, req, arrival=trace[rid][0])
                loads[w] += 1
                worker_of[rid] = w
                touched.append(w)
                i += 1
        else:
            now, touched = done[0][0], []
            while done and done[0][0] == now:
                _, w = heapq.heappop(done)
                ran = running.pop(w)
                out += ran
                loads[w] -= len(ran)
                busy[w] = False
                touched.append(w)
                for r in ran:
                    finished[r.rid] = 1
                    if give_up_over is not None and not counted[r.rid] and r.end - r.arrival > give_up_over:
                        counted[r.rid] = 1
                        late += 1
        if give_up_over is not None:
            while aged < i and trace[order[aged]][0] < now - give_up_over:
                rid = order[aged]
                if not finished[rid] and not counted[rid]:
                    counted[rid] = 1
                    late += 1
                aged += 1
            if measured and late >= late_limit:
                complete = False
                break
        for w in sorted(set(touched)):
            if not busy[w] and len(scheds[w]):
                start(w, now)
    return ClusterResult(
        runs=tuple(out),
        worker_of=tuple(worker_of),
        workers=tuple(WorkerStats(int(s[0]), int(s[1]), s[2], int(s[3]), int(s[4])) for s in stats),
        balanced_by_load=rt.balanced_by_load,
        by_match=rt.by_match,
        complete=complete,
    )


# ---- the paper-shaped trace -------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceShape:
    """WL1 of the paper (post recommendation: users x candidate posts, one request per pair, the
    user's profile first), with token lengths divided by `scale`. The paper's profiles are
    N(14000, 3000) tokens cut to 11k-17k, its posts 150 tokens; /8 keeps the longest prompt
    (~2.3k tokens) well inside our engine's 4k benchmark limit and a profile 12x a post."""

    users: int = 1000
    posts: int = 50
    scale: float = 8.0
    post_tokens: tuple[int, int] = (100, 200)  # uniform; the paper's 150 is the mean
    header_tokens: int = 8  # the same few tokens (a template) before every profile
    vocab: int = 49152  # SmolLM2's
    seed: int = 0

    def __post_init__(self) -> None:
        if self.users < 1 or self.posts < 1 or not self.scale > 0:
            raise ValueError(f"need users, posts >= 1 and scale > 0, got {self}")
        if not 1 <= self.post_tokens[0] <= self.post_tokens[1] or self.header_tokens < 0 or self.vocab < 2:
            raise ValueError(f"bad post_tokens / header_tokens / vocab in {self}")

    def profile_len(self, rng: random.Random) -> int:
        lo, hi = 11000 / self.scale, 17000 / self.scale
        n = min(max(rng.gauss(14000 / self.scale, 3000 / self.scale), lo), hi)
        return max(1, round(n))


def paper_trace(
    shape: TraceShape, labels: tuple[int, ...] = (1, 2)
) -> tuple[list[ScoreRequest], list[float]]:
    """Requests of `shape` in a seeded random order (users interleave, as independent clients
    would), each declaring header + profile + question as its cacheable prefix, and unit-rate
    Poisson arrival times: a run at QPS q uses `arrival / q`, so every rate sees the same pattern.
    Token ids are random: only which requests share which prefix matters to a simulation."""
    rng = random.Random(shape.seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(x % shape.vocab for x in array("I", rng.randbytes(4 * n)))

    header, question, answer = ids(shape.header_tokens), ids(16), ids(5)
    reqs: list[ScoreRequest] = []
    for _ in range(shape.users):
        prefix = header + ids(shape.profile_len(rng)) + question
        for _ in range(shape.posts):
            post = ids(rng.randint(*shape.post_tokens) - len(answer)) + answer
            reqs.append(ScoreRequest(prefix + post, labels, cache_prefix_len=len(prefix)))
    rng.shuffle(reqs)
    return reqs, poisson_arrivals(len(reqs), rng)


def poisson_arrivals(n: int, rng: random.Random, rate: float = 1.0) -> list[float]:
    """Arrival times (seconds from 0) of `n` events of a Poisson process with `rate` per second."""
    gaps = (rng.expovariate(rate) for _ in range(n - 1))
    return list(itertools.accumulate(gaps, initial=0.0))[:n]


# ---- sustained QPS ---------------------------------------------------------------------------------


def p99(values: Sequence[float]) -> float:
    """The 99th percentile, linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    v = sorted(values)
    k = 0.99 * (len(v) - 1)
    f = math.floor(k)
    return v[f] + (v[min(f + 1, len(v) - 1)] - v[f]) * (k - f)


def max_qps_at_p99(
    run: Callable[[float], float], slo_s: float, guess: float, rel_tol: float = 0.03, max_runs: int = 24
) -> tuple[float, int]:
    """The highest QPS whose P99 latency (`run(qps)`) stays within `slo_s`: bracket from `guess` by
    doubling / halving, then bisect in log space to `rel_tol`. Assumes P99 grows with the rate (a
    queue does); returns (qps, runs used). Bounded by `max_runs`: the result is then the best
    passing rate found."""
    if not (slo_s > 0 and guess > 0):
        raise ValueError(f"need slo_s > 0 and guess > 0, got {slo_s}, {guess}")
    runs = 0

    def ok(q: float) -> bool:
        nonlocal runs
        runs += 1
        return run(q) <= slo_s

    lo, hi = 0.0, math.inf
    q = guess
    while runs < max_runs and (hi == math.inf or lo == 0.0):
        if ok(q):
            lo = q
            if hi == math.inf:
                q *= 2
        else:
            hi = q
            if lo == 0.0:
                q /= 2
        if lo and hi < math.inf:
            break
    while runs < max_runs and lo and hi < math.inf and hi / lo > 1 + rel_tol:
        q = math.sqrt(lo * hi)
        if ok(q):
            lo = q
        else:
            hi = q
    return lo, runs
