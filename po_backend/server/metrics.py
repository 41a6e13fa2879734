"""Prometheus metrics of one app: HTTP requests and latency, scored prompts and tokens, cache hits,
cancellations and 503s, and gauges read from the backend at scrape time."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from po_backend.request import ScoreResult
from po_backend.server.backend import Backend


class Metrics:
    """Prometheus metrics in a registry of this app's own (two apps in one process do not clash)."""

    WINDOW_S = 10.0  # tokens/s is measured over this sliding window

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        r = self.registry = CollectorRegistry()
        self.requests = Counter("po_http_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.latency = Histogram(
            "po_request_latency_seconds",
            "HTTP request latency (arrival to response)",
            ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.prompts = Counter("po_scored_prompts", "Prompts scored (one prefill each)", registry=r)
        self.prompt_tokens = Counter("po_prompt_tokens", "Prompt tokens of scored prompts", registry=r)
        self.cached_tokens = Counter(
            "po_cache_hit_tokens", "Prompt tokens read from the prefix cache instead of computed", registry=r
        )
        self.cancelled = Counter(
            "po_cancelled_requests", "Prompts cancelled by a client disconnect", registry=r
        )
        self.rejected = Counter(
            "po_overloaded_rejections", "Prompts refused with 503 (queue full)", registry=r
        )
        Gauge("po_queue_length", "Prompts waiting in the scheduler queue", registry=r).set_function(
            lambda: float(self._stat("queued"))
        )
        Gauge("po_running_requests", "Prompts in the forward being run", registry=r).set_function(
            lambda: float(self._stat("running"))
        )
        Gauge(
            "po_prompt_tokens_per_second",
            f"Prompt tokens scored per second (last {self.WINDOW_S:.0f} s)",
            registry=r,
        ).set_function(self.tokens_per_second)
        Gauge(
            "po_cache_hit_rate", "Share of prompt tokens served from the prefix cache", registry=r
        ).set_function(self._hit_rate)
        self._lock = threading.Lock()
        self._window: deque[tuple[float, int]] = deque()  # (time, prompt tokens finished then)
        self._tokens = 0
        self._cached = 0

    def _stat(self, key: str) -> float:
        try:
            return float(self.backend.stats().get(key, 0) or 0)
        except Exception:  # a scrape must not fail because a stat is missing
            return 0.0

    def observe(self, results: Sequence[ScoreResult]) -> None:
        now = time.monotonic()
        tokens = sum(r.prompt_tokens for r in results)
        cached = sum(r.cached_tokens for r in results)
        self.prompts.inc(len(results))
        self.prompt_tokens.inc(tokens)
        self.cached_tokens.inc(cached)
        with self._lock:
            self._tokens += tokens
            self._cached += cached
            self._window.append((now, tokens))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._window and self._window[0][0] < now - self.WINDOW_S:
            self._window.popleft()

    def tokens_per_second(self) -> float:
        with self._lock:
            self._trim(time.monotonic())
            return sum(t for _, t in self._window) / self.WINDOW_S

    def _hit_rate(self) -> float:
        with self._lock:
            return self._cached / self._tokens if self._tokens else 0.0
