"""The engine loop's worker: the one thread that owns the scorer, picks each step from the scheduler,
runs it, and answers its requests' futures (`EngineLoop` is built on it)."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from po_backend.core.errors import CancelledError, LoopClosedError
from po_backend.core.request import ScoreRequest, ScoreResult, StepInfo
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import CalibratedJCT
from po_backend.sched.reuse import CachePool
from po_backend.sched.scheduler import Scheduler
from po_backend.serving.scorer import Scorer
from po_backend.serving.stats import StepRecord

# The loop's log, whichever half of it writes: one logger for operators to filter.
log = logging.getLogger("po_backend.serving.loop")


# The rid of a prefix step's job (`Pick.prefix_only`): not a caller's request, so not counted.
PREFIX_STEP_RID = -1


class Job:
    __slots__ = ("rid", "req", "future", "submitted")

    def __init__(self, rid: int, req: ScoreRequest, future: Future[ScoreResult], submitted: float) -> None:
        self.rid, self.req, self.future, self.submitted = rid, req, future, submitted


class StepWorker:
    """The worker half of `EngineLoop`: its state is set up by `EngineLoop.__init__`, and every
    method here runs on the worker thread or with `_cond` held."""

    engine: Scorer
    config: SchedulerConfig
    jct: CalibratedJCT | None
    calibrate: bool
    clock: Callable[[], float]
    _sched: Scheduler
    _pool: CachePool | None
    _cond: threading.Condition
    _jobs: dict[int, Job]
    _running: list[Job]
    _calls: deque[tuple[Callable[[Any], Any], Future[Any]]]
    _closing: bool
    _counts: dict[str, int]
    _steps: deque[StepRecord]
    _n_steps: int
    _failed_streak: int
    _reprobe: bool

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
                    # Only the requests whose cached prefix changed are probed again (a radix walk
                    # each): the cache says which prefixes changed since the last pick.
                    changes = None if self._reprobe else self.engine.cache_changes()
                    self._reprobe = False
                    probe = [] if calls else self._sched.to_probe(changes)
                for fn, fut in calls:
                    self._run_call(fn, fut)
                if calls:
                    # a call (a flush, an adapter loaded) may change what any request reads
                    self._reprobe = True
                    continue
                # The probes run here, outside the lock, so submitters and stats readers never
                # wait on them: only this thread changes the cache, and a scorer that memoises
                # them (the Engine, until the cache changes on their path) answers the pick below.
                for req in probe:
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

    def _next_batch(self) -> tuple[list[Job], list[tuple[int, int]], float] | None:
        """Pick under the lock (the scheduler reads the cache; only this thread changes it)."""
        try:
            # what changed in the cache since the last pick was taken by `to_probe`
            pick = self._sched.pick(self.engine.cached_len, self.engine.batchable, self._pool, ())
        except Exception as e:  # would fail again at every step: fail the queue, keep serving
            log.exception("scheduler pick failed")
            self._fail_waiting(e)
            return None
        if pick is None:
            return None
        if pick.prefix_only:  # the head stays queued; this step only caches its first tokens
            job = Job(PREFIX_STEP_RID, pick.prefix_request(), Future(), self.clock())
            job.future.set_running_or_notify_cancel()
            self._running = [job]
            return [job], pick.items, pick.head_score
        jobs: list[Job] = []
        items: list[tuple[int, int]] = []
        for entry, item in zip(pick.entries, pick.items, strict=True):
            job = self._jobs.pop(entry.rid)
            # False: cancelled after the pick chose it (its done-callback then finds it gone from
            # the queue). Otherwise the future is RUNNING from here on and cancel() is refused.
            # Dropping an item keeps the step valid: the engine plans the step afresh, and if the
            # dropped item was to compute a prefix the others read, they compute it themselves
            # (one forward each if together they would exceed the token budget).
            if job.future.set_running_or_notify_cancel():
                jobs.append(job)
                items.append(item)
            else:
                self._counts["cancelled"] += 1
        self._running = jobs
        return (jobs, items, pick.head_score) if jobs else None

    def _run_step(self, jobs: list[Job], items: list[tuple[int, int]], head_score: float) -> None:
        raw = self.jct.model.predict_items(items) if self.jct else math.nan
        predicted = raw * self.jct.factor if self.jct else math.nan
        start = self.clock()
        t = time.perf_counter()
        try:
            ranks = [self.config.cache_rank(j.req) for j in jobs]
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
            job = self._jobs.pop(w.rid)
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
                self._counts["failed" if not isinstance(error, CancelledError) else "cancelled"] += 1
            else:
                self._counts["cancelled"] += 1
