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
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from po_backend.core.errors import CancelledError, LoopClosedError, OverloadedError
from po_backend.core.request import ScoreRequest, ScoreResult
from po_backend.core.settings import DEFAULT_FAIRNESS_LAMBDA, DEFAULT_MAX_QUEUE, DEFAULT_MIN_SHARED_PREFIX
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import CalibratedJCT, JCTModel, pearson_r
from po_backend.sched.scheduler import Scheduler
from po_backend.serving.scorer import Scorer
from po_backend.serving.stats import LoopStats, StepRecord
from po_backend.serving.worker import PREFIX_STEP_RID, Job, StepWorker

log = logging.getLogger(__name__)

T = TypeVar("T")
# SGLang's words for a queued request a more urgent one displaced from a full queue (a 503 there
# too), so clients and gateways that recognise it by its message recognise ours.
ABORTED_BY_PRIORITY = "The request is aborted by a higher priority request."
STEP_LOG = 4096  # recent steps kept for stats (percentiles, prediction quality)
# Steps failed in a row after which the loop reports itself failing: one bad batch is that batch's
# problem, several in a row with no success between them is the device's or the model's.
FAILING_STEPS = 3


class EngineLoop(StepWorker):
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
        self._jobs: dict[int, Job] = {}  # waiting jobs by rid
        self._running: list[Job] = []
        self._calls: deque[tuple[Callable[[Any], Any], Future[Any]]] = deque()
        self._ids = itertools.count()
        self._calls_ids = itertools.count()
        self._closing = False
        self._drain = True
        self._counts = dict.fromkeys(("submitted", "completed", "failed", "cancelled", "rejected"), 0)
        self._steps: deque[StepRecord] = deque(maxlen=STEP_LOG)
        self._n_steps = 0
        self._failed_streak = 0  # steps failed in a row since the last one that succeeded
        self._reprobe = False  # the next pick probes every waiting request (a call ran on the engine)
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
                self._jobs[rid] = Job(rid, r, fut, now)
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
                        self._jobs.pop(rid, None)
                        self._counts["cancelled"] += 1
                        # CANCELLED -> CANCELLED_AND_NOTIFIED, as an executor does when it dequeues
                        # a cancelled item: concurrent.futures.wait() counts only the latter as done.
                        # Whoever removes the request from the queue (under the lock) does this once.
                        fut.set_running_or_notify_cancel()

        return done

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
