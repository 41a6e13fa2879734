"""Held-out traces for the scheduler: shapes nobody tuned a policy on, swept over load and seeds.

Each shape is a generator of users that share a declared profile prefix and send short posts,
with Poisson arrivals at a multiple of the *sustainable* load: the rate fcfs serves the whole trace
at when it is all queued at once. `sweep` runs every policy on every (shape, seed, load) on the
simulator and `pooled` summarises the latencies of each (shape, load) over all seeds together:
mean, P95 and P99 against fcfs's. `bench_schedule --held-out` prints and saves the table; the
scheduler's tests check a few of its points.
"""

from __future__ import annotations

import itertools
import random
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from po_backend.core.request import ScoreRequest
from po_backend.sched.config import SchedulerConfig
from po_backend.sim.cluster import poisson_arrivals
from po_backend.sim.simulator import PrefixLRU, StepModel, simulate

LOADS = (0.25, 0.5, 0.7, 0.9, 1.0, 1.2, 1.5, 2.0)  # x the sustainable load
BELOW = 0.9  # loads up to this are "below saturation"


@dataclass(frozen=True)
class Shape:
    """Users with a profile each (`profile`: min, max tokens, log-uniform) and `posts` calls each
    (min, max), posts of `post` tokens (min, max, uniform); `unique`: the share of calls that are
    one-off prompts without a shared profile (`unique_len` tokens, log-uniform); `profile_alpha`
    > 0: profiles Pareto-distributed from `profile[0]` instead (capped at `profile[1]`): a heavy
    tail of long ones; `burst` > 1: arrivals in bursts of 1-`burst` requests at one instant."""

    name: str
    users: int
    profile: tuple[int, int]
    posts: tuple[int, int]
    post: tuple[int, int] = (20, 60)
    unique: float = 0.0
    unique_len: tuple[int, int] = (100, 1500)
    profile_alpha: float = 0.0
    burst: int = 1

    def trace(self, seed: int, vocab: int = 49152) -> tuple[list[ScoreRequest], list[float]]:
        """Requests in a seeded random order and unit-rate Poisson arrival times."""
        rng = random.Random(f"{self.name}/{seed}")

        def ids(n: int) -> tuple[int, ...]:
            return tuple(x % vocab for x in array("I", rng.randbytes(4 * n)))

        def loguniform(lo: int, hi: int) -> int:
            return round(lo * (hi / lo) ** rng.random())

        def profile_len() -> int:
            lo, hi = self.profile
            return (
                min(hi, round(lo * rng.paretovariate(self.profile_alpha)))
                if self.profile_alpha
                else loguniform(lo, hi)
            )

        reqs: list[ScoreRequest] = []
        for _ in range(self.users):
            prefix = ids(profile_len())
            for _ in range(rng.randint(*self.posts)):
                post = ids(rng.randint(*self.post))
                reqs.append(ScoreRequest(prefix + post, (1, 2), cache_prefix_len=len(prefix)))
        n_unique = round(self.unique * len(reqs) / (1 - self.unique)) if self.unique < 1 else 0
        reqs += [ScoreRequest(ids(loguniform(*self.unique_len)), (1, 2)) for _ in range(n_unique)]
        rng.shuffle(reqs)
        return reqs, poisson_arrivals(len(reqs), rng) if self.burst == 1 else self.bursts(len(reqs), rng)

    def bursts(self, n: int, rng: random.Random) -> list[float]:
        """`n` arrival times in bursts of 1-`burst` requests, the bursts a Poisson process whose gaps
        average one second per request of the burst before, so the mean rate stays 1 per second."""
        out: list[float] = []
        t = 0.0
        while len(out) < n:
            size = rng.randint(1, self.burst)
            out += [t] * size
            t += rng.expovariate(1.0 / size)
        return out[:n]


# The trace (5 users, ~1,000-token profiles, 40 calls), many users with short profiles,
# and a mix of profile lengths with one-off long prompts.
SHAPES = {
    s.name: s
    for s in (
        Shape("few-long", 5, (800, 1200), (6, 10)),
        Shape("many-short", 40, (80, 250), (1, 4)),
        Shape("mixed", 12, (50, 2000), (1, 8), post=(10, 300), unique=0.2),
    )
}
# Outside the default sweep (`bench_schedule --held-out-shapes`): shapes the defaults were not
# chosen on: Pareto profiles (median ~1.8x the shortest, 1 in 9 over 6x, a few near the cap),
# and the mixed shape's lengths with up to 8 requests arriving at once.
UNTUNED_SHAPES = {
    s.name: s
    for s in (
        Shape("heavy-tail", 16, (100, 6000), (1, 8), post=(10, 200), profile_alpha=1.2),
        Shape("bursty", 12, (50, 2000), (1, 8), post=(10, 300), unique=0.2, burst=8),
    )
}
ALL_SHAPES = {**SHAPES, **UNTUNED_SHAPES}


def sustainable_qps(reqs: Sequence[ScoreRequest], model: StepModel, pool: int, batch_tokens: int) -> float:
    """Requests per second fcfs serves `reqs` at when they are all queued at once."""
    runs = simulate(SchedulerConfig("fcfs"), model, [(0.0, r) for r in reqs], PrefixLRU(pool, batch_tokens))
    return len(reqs) / max(r.end for r in runs)


def sweep(
    configs: dict[str, SchedulerConfig],
    model: StepModel,
    shapes: Sequence[Shape],
    seeds: Sequence[int],
    loads: Sequence[float] = LOADS,
    pool: Callable[[list[ScoreRequest]], int] | None = None,
    batch_tokens: int = 16384,
) -> list[dict[str, Any]]:
    """Every config on every (shape, seed, load): one row each with its latencies in trace order.
    `pool`: the prefix pool's tokens for a trace (default: all of its tokens, nothing evicted);
    `batch_tokens`: a step's computed-token budget."""
    rows = []
    for shape, seed in itertools.product(shapes, seeds):
        reqs, unit = shape.trace(seed)
        cap = pool(reqs) if pool is not None else sum(len(r.input_ids) for r in reqs)
        qps = sustainable_qps(reqs, model, cap, batch_tokens)
        for load, (name, cfg) in itertools.product(loads, configs.items()):
            trace = [(u / (load * qps), r) for u, r in zip(unit, reqs, strict=True)]
            runs = sorted(simulate(cfg, model, trace, PrefixLRU(cap, batch_tokens)), key=lambda r: r.rid)
            lat = [r.end - r.arrival for r in runs]
            rows.append({"shape": shape.name, "seed": seed, "load": load, "config": name, "latencies": lat})
    return rows


def pooled(rows: Sequence[dict[str, Any]], base: str = "fcfs") -> list[dict[str, Any]]:
    """Per (shape, load, config): mean, P95 and P99 over every seed's requests together, and each
    against `base`'s on the same requests."""
    groups: dict[tuple[str, float, str], list[float]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["load"], r["config"]), []).extend(r["latencies"])
    out = []
    for (shape, load, config), lat in groups.items():
        a, b = np.asarray(lat), np.asarray(groups[(shape, load, base)])
        stats = {"mean": a.mean(), "p95": np.percentile(a, 95), "p99": np.percentile(a, 99)}
        ref = {"mean": b.mean(), "p95": np.percentile(b, 95), "p99": np.percentile(b, 99)}
        out.append(
            {
                "shape": shape,
                "load": load,
                "config": config,
                "requests": int(a.size),
                **{f"{k}_s": float(v) for k, v in stats.items()},
                **{f"{k}_vs_{base}": float(stats[k] / ref[k]) for k in stats},
            }
        )
    return out


def worst(table: Sequence[dict[str, Any]], config: str, below: bool, base: str = "fcfs") -> dict[str, Any]:
    """The worst ratio to `base` of `config` over shapes, below saturation (loads <= BELOW) or at and
    above it, per statistic, with where it was."""
    rows = [r for r in table if r["config"] == config and (r["load"] <= BELOW) == below]
    out: dict[str, Any] = {}
    if not rows:  # no load on that side was swept
        return out
    for k in ("mean", "p95", "p99"):
        r = max(rows, key=lambda r: r[f"{k}_vs_{base}"])
        out[k] = {"ratio": r[f"{k}_vs_{base}"], "shape": r["shape"], "load": r["load"]}
    return out
