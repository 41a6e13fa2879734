"""The serving loop: one worker thread owns a scorer; any thread submits requests and gets futures.

The scorer is our `Engine` or the transformers baseline (`engine.hf_scorer.HFScorer`): anything with the
`Scorer` methods; the loop asks it what it can do (`cache_pool`), never its type. The loop is the only place requests wait and get ordered, for both.

    loop = EngineLoop(engine, policy="po", jct=startup_jct(engine, "po"))
    fut = loop.submit(req)            # validated now (typed errors raise here), queued, a Future
    res = fut.result()                # or: await loop.score(req) from asyncio
    loop.shutdown(drain=True)         # finish everything queued, then join the worker

Guarantees: every accepted request ends with a result, an error, or a cancellation, never silently
dropped. A full queue raises OverloadedError at submit; with priority scheduling it first makes
room by aborting queued requests less urgent than the call (OverloadedError on their futures). A waiting request can be cancelled
(`fut.cancel()` or `loop.cancel(fut)`); a running one completes. If a step raises, every request
of that step gets the exception and the loop goes on. `shutdown(drain=False)` fails what is still
queued with CancelledError. The worker sleeps on a condition variable when idle (no polling).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import numpy as np

from po_backend.core.errors import CancelledError, LoopClosedError, OverloadedError
from po_backend.core.request import ScoreRequest, ScoreResult, StepInfo
from po_backend.core.settings import DEFAULT_MAX_QUEUE
from po_backend.sched.jct import CalibratedJCT, JCTModel, pearson_r
from po_backend.sched.reuse import CachePool
from po_backend.sched.scheduler import (
    DEFAULT_FAIRNESS_LAMBDA,
    DEFAULT_MIN_SHARED_PREFIX,
    Scheduler,
    SchedulerConfig,
)
from po_backend.serving.stats import LoopStats, StepRecord

log = logging.getLogger(__name__)

T = TypeVar("T")
# SGLang's words for a queued request a more urgent one displaced from a full queue (a 503 there
# too), so clients and gateways that recognise it by its message recognise ours.
ABORTED_BY_PRIORITY = "The request is aborted by a higher priority request."
STEP_LOG = 4096  # recent steps kept for stats (percentiles, prediction quality)
# Steps failed in a row after which the loop reports itself failing: one bad batch is that batch's
# problem, several in a row with no success between them is the device's or the model's.
FAILING_STEPS = 3


class ScorerStats(Protocol):
    @property
    def hit_rate(self) -> float: ...


class Scorer(Protocol):
    """What the loop drives (`Engine`, `HFScorer`). Only the worker thread calls these, except
    `validate`, which is called by the submitting thread and must only read."""

    def validate(self, req: ScoreRequest) -> None:
        """Raise a typed error (po_backend.core.errors) for a request that can never run."""

    def step(self, requests: Sequence[ScoreRequest], ranks: Sequence[int] | None = None) -> list[ScoreResult]:
        """Run one step over the requests chosen by `batchable`; a result per request, in order.
        `ranks`: each request's class for the prefix cache (`SchedulerConfig.cache_rank`), for a
        cache that keeps the more urgent classes' prefixes first."""

    def cached_len(self, req: ScoreRequest) -> int:
        """Leading tokens of `req` the scorer's cache would serve now (read-only)."""

    def batchable(self, candidates: Sequence[ScoreRequest]) -> list[tuple[int, int]]:
        """The candidates (the first always included) that can share one step, each as (index,
        tokens it reads from the cache or a batch-mate instead of computing)."""

    def stats(self) -> ScorerStats: ...

    def flush_cache(self) -> None: ...

    def cache_pool(self) -> CachePool | None:
        """The scorer's prefix cache as the scheduler sees it (eviction order); None: no cache."""


# The rid of a prefix step's job (`Pick.prefix_only`): not a caller's request, so not counted.
PREFIX_STEP_RID = -1


class _Job:
    __slots__ = ("rid", "req", "future", "submitted")

    def __init__(self, rid: int, req: ScoreRequest, future: Future[ScoreResult], submitted: float) -> None:
        self.rid, self.req, self.future, self.submitted = rid, req, future, submitted


class EngineLoop:
    """A scheduler in front of one scorer, driven by one worker thread that owns the scorer."""

    def __init__(
        self,
        engine: Scorer,
        *,
        policy: str = "po",
        fairness_lambda: float = DEFAULT_FAIRNESS_LAMBDA,
        min_shared_prefix: int = DEFAULT_MIN_SHARED_PREFIX,
        max_queue: int = DEFAULT_MAX_QUEUE,
        jct: JCTModel | CalibratedJCT | None = None,
        calibrate: bool = True,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
        scheduler: SchedulerConfig | None = None,
    ) -> None:
        """engine: the scorer this loop owns (an Engine, or any `Scorer`).
        jct: the step-time model, built before the loop (`jct_profile.startup_jct`; the runtime
        factory does it), so constructing a loop measures nothing; fcfs and lpm need none, po and
        srjf raise ValueError without one. scheduler: the whole scheduler configuration (priority classes included), instead of
        policy, fairness_lambda and min_shared_prefix. A CalibratedJCT is used as is, so what an earlier
        loop learned online carries over. start=False leaves the worker stopped until `start()` (tests; submitting a
        burst that is scheduled as a whole)."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.config = scheduler or SchedulerConfig(policy, fairness_lambda, min_shared_prefix)
        if jct is None and self.config.needs_jct:
            raise ValueError(
                f"policy {self.config.policy!r} needs a JCT model: pass jct= "
                "(serving.jct_profile.startup_jct builds one for a scorer that can be timed)"
            )
        if jct is not None and not isinstance(jct, CalibratedJCT):
            jct = CalibratedJCT(jct)
        self.jct: CalibratedJCT | None = jct
        self.calibrate = calibrate
        self.max_queue = max_queue
        self.clock = clock
        self._sched = Scheduler(self.config, self.jct, clock)
        self._pool = engine.cache_pool()  # the cache's eviction order, for eviction-aware po
        self._cond = threading.Condition()  # guards everything below; RLock: callbacks re-enter
        self._jobs: dict[int, _Job] = {}  # waiting jobs by rid
        self._running: list[_Job] = []
        # Waiting requests that ran prefix-only steps -> what those steps cached, under the online
        # class (`SchedulerConfig.cache_rank`): given back to the request's own class if it
        # leaves the queue without its last step (cancelled, failed), which would have done that.
        self._prefixed: dict[int, ScoreRequest] = {}
        self._calls: deque[tuple[Callable[[Any], Any], Future[Any]]] = deque()
        self._ids = itertools.count()
        self._calls_ids = itertools.count()
        self._closing = False
        self._drain = True
        self._counts = dict.fromkeys(("submitted", "completed", "failed", "cancelled", "rejected"), 0)
        self._steps: deque[StepRecord] = deque(maxlen=STEP_LOG)
        self._n_steps = 0
        self._failed_streak = 0  # steps failed in a row since the last one that succeeded
        self._thread = threading.Thread(target=self._work, name="po-engine-loop", daemon=True)
        self._started = False
        if start:
            self.start()

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if not self._started:
                self._started = True
                self._thread.start()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests. drain=True runs everything queued first; drain=False fails
        the queued requests with CancelledError (the step running now completes). Joins the worker."""
        with self._cond:
            self._closing = True
            self._drain = self._drain and drain
            if not drain:
                self._fail_waiting(CancelledError("the engine loop shut down before this request ran"))
            self._cond.notify_all()
        if drain:
            self.start()  # a never-started loop still owes its queued requests their results
        if self._started:
            self._thread.join(timeout)
            assert not self._thread.is_alive() or timeout is not None, "engine loop worker did not stop"
        with self._cond:  # never started, or the worker died: nothing may stay pending
            self._fail_waiting(CancelledError("the engine loop shut down before this request ran"))

    def __enter__(self) -> EngineLoop:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.shutdown(drain=exc_type is None)

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def alive(self) -> bool:
        """The worker thread runs (or has not been started yet): what a liveness probe asks."""
        return not self._started or self._thread.is_alive()

    @property
    def failing(self) -> bool:
        """The last FAILING_STEPS steps all failed (a device error that every step hits): the
        worker runs but serves nothing, which a liveness probe must report too. One success
        clears it."""
        return self._failed_streak >= FAILING_STEPS

    def abandon_waiting(self, error: BaseException) -> int:
        """Fail every queued request with `error` now (the step running completes); how many.
        A server at its shutdown deadline answers them (503, retry elsewhere) instead of leaving
        them to be cut off."""
        with self._cond:
            n = len(self._jobs)
            self._fail_waiting(error)
            return n

    # ---- submitting -------------------------------------------------------------------------

    def submit(self, req: ScoreRequest) -> Future[ScoreResult]:
        return self.submit_many([req])[0]

    def submit_many(self, reqs: Sequence[ScoreRequest]) -> list[Future[ScoreResult]]:
        """Validate all (a typed error raises, nothing is queued), then queue all or none:
        OverloadedError when the queue cannot take them all. Thread-safe."""
        for r in reqs:
            self.engine.validate(r)
        futures: list[Future[ScoreResult]] = []
        with self._cond:
            if self._closing:
                raise LoopClosedError("the engine loop is shutting down and accepts no new requests")
            if len(self._sched) + len(reqs) > self.max_queue and not self._abort_for(reqs):
                self._counts["rejected"] += len(reqs)
                raise OverloadedError(
                    f"The request queue is full: {len(self._sched)} requests are queued and {len(reqs)} "
                    f"more do not fit (max_queue={self.max_queue}); retry later"
                )
            now = self.clock()
            call = next(self._calls_ids)  # one client call: its requests share one fairness credit
            for r in reqs:
                rid = next(self._ids)
                fut: Future[ScoreResult] = Future()
                self._jobs[rid] = _Job(rid, r, fut, now)
                self._sched.add(rid, r, now, call=call)
                fut.add_done_callback(self._on_done(rid))
                futures.append(fut)
            self._counts["submitted"] += len(reqs)
            self._cond.notify_all()
        return futures

    def _abort_for(self, reqs: Sequence[ScoreRequest]) -> bool:
        """With priority scheduling, a full queue admits a call by aborting queued requests less
        urgent than all of it (`Scheduler.least_urgent`), each failed with SGLang's error (a 503
        over HTTP); False, aborting nothing, if not enough of them wait (caller holds the lock)."""
        if not self.config.enable_priority:
            return False
        need = len(self._sched) + len(reqs) - self.max_queue
        victims = self._sched.least_urgent(need, max(self.config.rank(r) for r in reqs))
        if victims is None:
            return False
        error = OverloadedError(ABORTED_BY_PRIORITY)
        for w in victims:
            self._sched.remove(w.rid)
            self._forget_prefix(w.rid)
            job = self._jobs.pop(w.rid)
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
            self._counts["rejected"] += 1
        log.info("aborted %d queued requests for a more urgent call of %d", len(victims), len(reqs))
        return True

    async def score(self, req: ScoreRequest) -> ScoreResult:
        """Awaitable submit; cancelling the awaiting task cancels the request if it still waits."""
        return await asyncio.wrap_future(self.submit(req))

    async def score_many(self, reqs: Sequence[ScoreRequest]) -> list[ScoreResult]:
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in self.submit_many(reqs))))

    def cancel(self, fut: Future[ScoreResult]) -> bool:
        """Cancel a waiting request (True); a running or finished one is left alone (False)."""
        return fut.cancel()

    def _on_done(self, rid: int) -> Callable[[Future[ScoreResult]], None]:
        def done(fut: Future[ScoreResult]) -> None:
            # Runs in the thread that completed or cancelled the future. Only a cancellation has
            # book-keeping to do: take the request out of the queue so it frees its place.
            if fut.cancelled():
                with self._cond:
                    if self._sched.remove(rid):
                        self._forget_prefix(rid)
                        self._jobs.pop(rid, None)
                        self._counts["cancelled"] += 1
                        # CANCELLED -> CANCELLED_AND_NOTIFIED, as an executor does when it dequeues
                        # a cancelled item: concurrent.futures.wait() counts only the latter as done.
                        # Whoever removes the request from the queue (under the lock) does this once.
                        fut.set_running_or_notify_cancel()

        return done

    def _forget_prefix(self, rid: int) -> None:
        """`rid` left the queue without its last step: on the worker thread (it owns the cache),
        give what its prefix steps cached its own class (caller holds the lock)."""
        prefix = self._prefixed.pop(rid, None)
        if prefix is not None and self._pool is not None:
            rank = self.config.rank(prefix)
            self._calls.append((lambda e: e.cache.set_rank(e.cache_key(prefix), rank), Future()))
            self._cond.notify_all()

    def call(self, fn: Callable[[Any], T]) -> Future[T]:
        """Run fn(engine) on the worker thread between steps (the scorer is not thread-safe)."""
        fut: Future[T] = Future()
        with self._cond:
            if self._closing:
                raise LoopClosedError("the engine loop is shutting down")
            self._calls.append((fn, fut))
            self._cond.notify_all()
        return fut

    def flush_cache(self, timeout: float | None = None) -> None:
        """Drop every cached prefix, between steps. Blocks until done."""
        if not self._started or not self._thread.is_alive():
            self.engine.flush_cache()  # no worker touches the engine
            return
        self.call(lambda e: e.flush_cache()).result(timeout)

    # ---- the worker -------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._calls and not len(self._sched) and not self._closing:
                        self._cond.wait()
                    calls = list(self._calls)
                    self._calls.clear()
                    if not calls and not len(self._sched):
                        return  # closing, and (drained or failed by shutdown) nothing is left
                    waiting = [] if calls else [j.req for j in self._jobs.values()]
                for fn, fut in calls:
                    self._run_call(fn, fut)
                if calls:
                    continue
                # The cache probes (a radix walk per waiting prompt, the bulk of a pick's work) run
                # here, outside the lock, so submitters and stats readers never wait on them: only
                # this thread changes the cache, and a scorer that memoises them (the Engine, until
                # its next step) answers the pick below from the memo.
                for req in waiting:
                    self.engine.cached_len(req)
                with self._cond:
                    batch = self._next_batch()
                if batch is not None:
                    self._run_step(*batch)
        except BaseException as e:  # a bug in the loop itself: nothing may be left pending
            log.exception("engine loop worker died")
            # Clients get a 503 to retry elsewhere; the exception itself (internals) goes to the log only.
            error = LoopClosedError(
                f"the engine loop stopped after an internal error ({type(e).__name__}; see the server log)"
            )
            with self._cond:
                self._closing = True
                self._fail_waiting(error)
                for _, fut in self._calls:
                    if fut.set_running_or_notify_cancel():
                        fut.set_exception(error)
                self._calls.clear()
            raise

    def _run_call(self, fn: Callable[[Any], Any], fut: Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(self.engine))
        except Exception as e:  # the caller gets it
            fut.set_exception(e)

    def _next_batch(self) -> tuple[list[_Job], list[tuple[int, int]], float] | None:
        """Pick under the lock (the scheduler reads the cache; only this thread changes it)."""
        try:
            pick = self._sched.pick(self.engine.cached_len, self.engine.batchable, self._pool)
        except Exception as e:  # would fail again at every step: fail the queue, keep serving
            log.exception("scheduler pick failed")
            self._fail_waiting(e)
            return None
        if pick is None:
            return None
        if pick.prefix_only:  # the head stays queued; this step only caches its first tokens
            job = _Job(PREFIX_STEP_RID, pick.prefix_request(), Future(), self.clock())
            self._prefixed[pick.entries[0].rid] = job.req
            job.future.set_running_or_notify_cancel()
            self._running = [job]
            return [job], pick.items, pick.head_score
        jobs: list[_Job] = []
        items: list[tuple[int, int]] = []
        for entry, item in zip(pick.entries, pick.items, strict=True):
            job = self._jobs.pop(entry.rid)
            # False: cancelled after the pick chose it (its done-callback then finds it gone from
            # the queue). Otherwise the future is RUNNING from here on and cancel() is refused.
            # Dropping an item keeps the step valid: the engine plans the step afresh, and if the
            # dropped item was to compute a prefix the others read, they compute it themselves
            # (one forward each if together they would exceed the token budget).
            if job.future.set_running_or_notify_cancel():
                self._prefixed.pop(entry.rid, None)  # its step reads its prefix at its own class
                jobs.append(job)
                items.append(item)
            else:
                self._forget_prefix(entry.rid)
                self._counts["cancelled"] += 1
        self._running = jobs
        return (jobs, items, pick.head_score) if jobs else None

    def _run_step(self, jobs: list[_Job], items: list[tuple[int, int]], head_score: float) -> None:
        raw = self.jct.model.predict_items(items) if self.jct else math.nan
        predicted = raw * self.jct.factor if self.jct else math.nan
        start = self.clock()
        t = time.perf_counter()
        try:
            urgent = self._sched.urgent_rank
            ranks = [self.config.cache_rank(j.req, j.rid == PREFIX_STEP_RID, urgent) for j in jobs]
            results = self.engine.step([j.req for j in jobs], ranks)
            if len(results) != len(jobs):
                raise RuntimeError(
                    f"the scorer's step returned {len(results)} results for {len(jobs)} requests"
                )
        except Exception as e:
            seconds = time.perf_counter() - t
            log.warning("a step of %d requests failed: %r", len(jobs), e)
            with self._cond:
                self._running = []
                self._counts["failed"] += sum(j.rid != PREFIX_STEP_RID for j in jobs)
                self._failed_streak += 1
                self._record(StepRecord(start, seconds, raw, predicted, tuple(items), head_score, True))
            for j in jobs:
                j.future.set_exception(e)
            return
        seconds = time.perf_counter() - t
        if self.calibrate and self.jct is not None:
            self.jct.observe(items, seconds)
        with self._cond:
            self._running = []
            self._counts["completed"] += sum(j.rid != PREFIX_STEP_RID for j in jobs)
            self._failed_streak = 0
            self._record(StepRecord(start, seconds, raw, predicted, tuple(items), head_score))
            ran = [(j.req, j.submitted) for j in jobs]
            prefix = jobs[0].rid == PREFIX_STEP_RID
            self._sched.step_done(start, start + seconds, ran, predicted, prefix_step=prefix)
            index = self._n_steps
        for j, r in zip(jobs, results, strict=True):
            step = StepInfo(index, len(jobs), seconds, predicted, self.config.priority_class(j.req))
            j.future.set_result(
                dataclasses.replace(r, queue_seconds=max(0.0, start - j.submitted), step=step)
            )

    def _record(self, rec: StepRecord) -> None:
        self._steps.append(rec)
        self._n_steps += 1

    def _fail_waiting(self, error: BaseException) -> None:
        """Fail every queued request with `error` (caller holds the lock)."""
        for w in self._sched.pop_all():
            self._forget_prefix(w.rid)
            job = self._jobs.pop(w.rid)
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
                self._counts["failed" if not isinstance(error, CancelledError) else "cancelled"] += 1
            else:
                self._counts["cancelled"] += 1

    # ---- introspection ----------------------------------------------------------------------

    def step_log(self) -> list[StepRecord]:
        """The most recent steps (up to STEP_LOG), oldest first."""
        with self._cond:
            return list(self._steps)

    def stats(self) -> LoopStats:
        with self._cond:
            steps = list(self._steps)
            queued, running = len(self._sched), len(self._running)
            by_class = self._sched.waiting_by_class()
            # A prefix step's request stays in the scheduler's queue for its next step, but it is
            # being computed now: count it once, as running, so queued + running is the requests
            # accepted and unanswered.
            for j in self._running:
                if j.rid == PREFIX_STEP_RID:
                    queued -= 1
                    by_class[self.config.priority_class(j.req)] -= 1
            budget = self._sched.backfill.budget_s if self._sched.backfill else 0.0
            counts = dict(self._counts)
            n_steps = self._n_steps
        secs = np.array([s.seconds for s in steps if not s.error])
        pct = np.percentile(secs, [50, 90, 99]) if len(secs) else [math.nan] * 3
        q = self.jct.quality if self.jct else None
        ok = [s for s in steps if not s.error]
        return LoopStats(
            policy=self.config.policy,
            fairness_lambda=self.config.fairness_lambda,
            queued=queued,
            running=running,
            steps=n_steps,
            mean_batch_items=float(np.mean([len(s.items) for s in steps])) if steps else 0.0,
            step_p50_s=float(pct[0]),
            step_p90_s=float(pct[1]),
            step_p99_s=float(pct[2]),
            cache_hit_rate=self.engine.stats().hit_rate,
            jct_fit_r=q.pearson_r if q else math.nan,
            jct_fit_median_abs_error_s=q.median_abs_error_s if q else math.nan,
            jct_calibration=self.jct.factor if self.jct else math.nan,
            jct_online_r=pearson_r([s.predicted for s in ok], [s.seconds for s in ok]),
            jct_source=self.jct.model.source if self.jct else "",
            jct_refits=self.jct.refits if self.jct else 0,
            queued_by_class=by_class,
            batch_step_budget_s=budget,
            **counts,
        )
