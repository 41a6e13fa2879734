"""What one scheduler pick costs as the queue grows: the incremental pick (`sched.ranking`) against
the whole-queue re-pricing every pick used to do (`Scheduler.scores`), at the same queue states.

    python -m benchmarks.bench_pick [--sizes 100,1000,10000] [--picks 50] [--drain 256,1024,4096]

A steady queue of `size` requests (users with shared profiles and short posts, as the held-out
many-short shape), po, the simulator's prefix cache: each round picks, runs the step on the cache and
submits as many new requests as the step took. `--drain`: one large client call alone, picked
until none waits (its size changes every step). CPU seconds of this thread (not wall time: other
processes share the cores), per pick.
"""

from __future__ import annotations

import random
import time
from typing import Any

from benchmarks import harness
from po_backend.core.request import ScoreRequest
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import JCTModel
from po_backend.sched.scheduler import Scheduler
from po_backend.sim.simulator import PrefixLRU, VirtualClock

FIT = (0.038, 0.0, 0.79, 0.36, 0.047)  # a CPU's measured step fit (as the held-out guard test)


def run(size: int, picks: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    profiles = [
        tuple(rng.randrange(1, 50_000) for _ in range(rng.randint(80, 250))) for _ in range(max(4, size // 8))
    ]

    def request() -> ScoreRequest:
        p = rng.choice(profiles)
        return ScoreRequest(
            p + tuple(rng.randrange(1, 50_000) for _ in range(rng.randint(20, 60))), cache_prefix_len=len(p)
        )

    model, clock = JCTModel(FIT), VirtualClock()
    sched = Scheduler(SchedulerConfig("po"), model, clock)
    cache = PrefixLRU(40_000, 16_384)
    rid = 0
    for _ in range(size):
        sched.add(rid, request())
        rid += 1
    pick_s = scores_s = 0.0
    sched.pick(cache.cached_len, cache.batchable, cache, cache.changes())  # the first prices everyone
    for _ in range(picks):
        t = time.thread_time()
        sched.scores(cache.cached_len, cache, cache.batchable)
        scores_s += time.thread_time() - t
        t = time.thread_time()
        pick = sched.pick(cache.cached_len, cache.batchable, cache, cache.changes())
        pick_s += time.thread_time() - t
        assert pick is not None
        cache.step([e.req for e in pick.entries])
        clock.now += model.predict_items(pick.items)
        for _ in pick.entries:
            sched.add(rid, request(), arrival=clock.now)
            rid += 1
    return {
        "queue": size,
        "pick_ms": 1e3 * pick_s / picks,
        "whole_queue_ms": 1e3 * scores_s / picks,
        "ratio": pick_s / scores_s,
    }


def drain(size: int, seed: int) -> dict[str, Any]:
    """One client call of `size` distinct prompts (a classify or score call's items), picked until
    none waits: its size changes at every step. CPU per pick over the whole drain."""
    rng = random.Random(seed)
    model, clock = JCTModel(FIT), VirtualClock()
    sched = Scheduler(SchedulerConfig("po"), model, clock)
    cache = PrefixLRU(40_000, 16_384)
    for rid in range(size):
        sched.add(
            rid, ScoreRequest(tuple(rng.randrange(1, 50_000) for _ in range(rng.randint(20, 60)))), call=0
        )
    picks, t = 0, time.thread_time()
    while (pick := sched.pick(cache.cached_len, cache.batchable, cache, cache.changes())) is not None:
        picks += 1
        cache.step([e.req for e in pick.entries])
        clock.now += model.predict_items(pick.items)
    s = time.thread_time() - t
    return {"call": size, "picks": picks, "drain_s": s, "pick_ms": 1e3 * s / picks}


def main() -> None:
    ap = harness.parser(__doc__)
    harness.flags(ap, sizes=("100,1000,10000", "queue sizes"), picks=(50, "picks per size"), seed=0)
    harness.flags(ap, drain=("256,1024,4096", "one call of this many items, picked until none waits"))
    args = ap.parse_args()
    doc: dict[str, Any] = {"machine": harness.machine_info(), "args": vars(args), "rows": []}
    for size in (int(x) for x in args.sizes.split(",")):
        r = run(size, args.picks, args.seed)
        doc["rows"].append(r)
        print(
            f"queue {size}: pick {r['pick_ms']:.2f} ms CPU, whole-queue re-pricing {r['whole_queue_ms']:.2f} ms "
            f"({r['ratio']:.3f}x)"
        )
    doc["drains"] = []
    for size in (int(x) for x in args.drain.split(",") if x):
        r = drain(size, args.seed)
        doc["drains"].append(r)
        print(
            f"one call of {size}: {r['picks']} picks, {r['pick_ms']:.2f} ms CPU per pick ({r['drain_s']:.2f} s)"
        )
    harness.save(args.out or harness.RESULTS / "pick.json", doc)


if __name__ == "__main__":
    main()
