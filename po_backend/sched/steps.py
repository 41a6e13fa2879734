"""What one step holds (`Waiting`, `Pick`) and how large it is made: the unrelated requests that
fill it, the batch-mates a sized step keeps, and the prefix-only steps of a request too long for one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from po_backend.core.request import ScoreRequest
from po_backend.sched.batching import Request

# A prefix-only step (Pick.prefix_only) computes at least this many tokens (less: all overhead).
MIN_PREFIX_STEP = 64
# The most urgent class's working set in the prefix pool: the prefixes its requests stored in the
# last this many seconds (`Scheduler.prefix_room`). Chosen on the simulator's diagnosis seeds of
# the small-pool backlog (2, 201-203, 207) among 2, 4 and 8.
WORKING_SET_S = 8.0
# Unrelated requests join a step while it costs at most this fraction more than the head's group
# alone: by the JCT model's prediction (FILL_SLACK, chosen on the simulator's tuning seeds, so po's
# tail stays within fcfs's), or without one by its computed tokens plus FILL_STEP_TOKENS, what a
# step's fixed overhead is worth in tokens (FILL_SLACK_TOKENS).
FILL_SLACK = 0.05
# A request sharing the head's prefix joins its step ahead of an older request outside it only
# while po's aging values its lead at no more than this many predicted seconds (lambda x the
# seconds it arrived after the oldest outsider): otherwise a profile's step gathers every later
# post while the oldest other calls wait, the tail at and above saturation. Shorter splits a
# profile's posts over more steps, each paying the step overhead and the wait for its turn again;
# the value was chosen on the simulator's tuning seeds, as FILL_SLACK.
SHARE_LEAD_S = 1.5
FILL_SLACK_TOKENS = 0.25
FILL_STEP_TOKENS = 128


class Predictor(Protocol):
    """Predicted seconds of one request's forward (`po_backend.sched.jct.JCTModel` / `CalibratedJCT`)."""

    def predict(self, n_input: int, n_cached: int, n_items: int = 1) -> float: ...

    def predict_items(self, items: Sequence[tuple[int, int]]) -> float: ...


@dataclass(frozen=True)
class Waiting:
    """One queued request."""

    rid: int  # unique, increasing with submission: the final tie-breaker of every policy
    req: Request
    arrival: float  # scheduler clock
    call: int = -1  # the client call it came in (submitted together); -1: a call of its own


@dataclass(frozen=True)
class Pick:
    """The requests of the next step, head first, with what the policy saw when it chose them."""

    entries: tuple[Waiting, ...]
    # Tokens each entry reads instead of computing, from the cache or from a batch-mate that
    # computes them in the same step (prices the step)
    n_cached: tuple[int, ...]
    head_score: float  # the head's score under the policy (lower ran first)
    credit: bool = False  # a less urgent class ran on its starvation credit ahead of waiting work
    # > 0: a batch request too long for one sized step: this step only computes and caches its
    # first `prefix_only` tokens (`prefix_request`); it stays queued and reads them back later.
    prefix_only: int = 0

    @property
    def items(self) -> list[tuple[int, int]]:
        """(n_input, n_cached) per entry, what `JCTModel.predict_items` takes."""
        if self.prefix_only:
            return [(self.prefix_only, self.n_cached[0])]
        return [(len(e.req.input_ids), c) for e, c in zip(self.entries, self.n_cached, strict=True)]

    def prefix_request(self) -> ScoreRequest:
        """The request a `prefix_only` step runs: the head's first tokens, all kept in the cache,
        at the head's priority, pooled if the head is (a head or embedding model has no LM head
        to answer a plain request with)."""
        head = self.entries[0].req
        ids = tuple(head.input_ids[: self.prefix_only])
        return ScoreRequest(ids, cache_prefix_len=len(ids), priority=head.priority, pool=head.pool)


def step_cost(jct: Predictor | None, items: Sequence[tuple[int, int]]) -> float:
    """A step's predicted seconds; its computed tokens without a JCT model (fcfs, lpm)."""
    if jct is None:
        return float(sum(n - c for n, c in items))
    return jct.predict_items(items)


def prefix_step_len(
    jct: Predictor | None,
    w: Waiting,
    cached: int,
    budget_s: float,
    prefix_steps: dict[int, tuple[int, int]],
    room: int | None = None,
) -> int:
    """For a batch request whose one step would overrun `budget_s`: how many of its leading
    tokens a step within the budget computes (and caches, for its later steps to read), 0 to
    run it whole. At least MIN_PREFIX_STEP tokens a step; whole when what is left fits, when
    less than that would be left, when its last prefix step left it no more cached than before
    (a scorer without a prefix cache, or a pool that cannot keep it: more steps would only
    recompute the same tokens), or after as many prefix steps as it needs (a pool that cannot
    keep its prefix until it runs must not make it loop). `prefix_steps`: per request that ran
    prefix steps, how many and the tokens it had cached at the last one (updated here).

    `room`: the most tokens its prefix may hold in the pool (`Scheduler.prefix_room`). The
    prefix it has cached is locked while its next step runs, so beyond that a step would push
    out the urgent calls' own prefixes, each then recomputed in a long step while the others
    wait: the steps stop there, and the rest is computed in its last step, the request whole
    if not even MIN_PREFIX_STEP more tokens fit."""
    assert jct is not None, "sized batch steps need a JCT model"
    n = len(w.req.input_ids)
    done, before = prefix_steps.get(w.rid, (0, -1))
    if jct.predict_items([(n, cached)]) <= budget_s or done > n // MIN_PREFIX_STEP or cached <= before:
        return 0
    lo, hi = cached, w.req.reusable_len  # the largest k in (cached, reusable_len] within the budget
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if jct.predict_items([(mid, cached)]) <= budget_s:
            lo = mid
        else:
            hi = mid
    # A budget too short for MIN_PREFIX_STEP tokens still gets steps of that many: slightly over
    # the budget, far better than the whole request in one step.
    lo = max(lo, cached + MIN_PREFIX_STEP)
    if lo >= w.req.reusable_len:
        return 0
    if room is not None and lo > room:
        if room < cached + MIN_PREFIX_STEP:
            return 0
        lo = room
    prefix_steps[w.rid] = (done + 1, cached)
    return lo


def fill_step(
    jct: Predictor | None, group: Sequence[Waiting], chosen: list[tuple[int, int]], n_base: int
) -> list[tuple[int, int]]:
    """`chosen` with the unrelated requests (group index >= n_base) that join the step while it
    costs at most FILL_SLACK (FILL_SLACK_TOKENS) more than the head's group alone: each saves a step of its own
    (the JCT model's per-step and per-item terms; tokens + FILL_STEP_TOKENS without one) and
    delays the head little. Many small calls then run together, a long one still alone.
    A leading part, since a later request may read a prefix an earlier one computes."""
    items = [(len(group[i].req.input_ids), c) for i, c in chosen]
    n = sum(1 for i, _ in chosen if i < n_base)
    if n == len(chosen):
        return chosen

    def cost(k: int) -> float:
        return step_cost(jct, items[:k]) + (FILL_STEP_TOKENS if jct is None else 0.0)

    limit = (1.0 + (FILL_SLACK_TOKENS if jct is None else FILL_SLACK)) * cost(n)
    while n < len(chosen) and cost(n + 1) <= limit:
        n += 1
    return chosen[:n]


def within_budget(
    jct: Predictor | None, group: Sequence[Waiting], chosen: list[tuple[int, int]], budget_s: float
) -> list[tuple[int, int]]:
    """The leading part of `chosen` (the head always) whose step fits `budget_s` predicted
    seconds. A leading part, since a batch-mate may read a prefix an earlier one computes."""
    if jct is None:
        return chosen
    items = [(len(group[i].req.input_ids), c) for i, c in chosen]
    n = 1
    while n < len(chosen) and jct.predict_items(items[: n + 1]) <= budget_s:
        n += 1
    return chosen[:n]
