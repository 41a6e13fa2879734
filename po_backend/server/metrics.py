"""Prometheus metrics of one app.

SGLang's own series first, with its names, types and labels (`model_name`, `engine_type`, and
`is_streaming` / `cache_source` where SGLang has them), so SGLang's Grafana dashboards and alerts
work on a PrefillOnly server unchanged: one scored prompt is one request whose single output token
is its first token. Then ours (`po_*`): HTTP status counts per endpoint (401/413 included), the
prefix cache in tokens, scheduler queue figures and the JCT model's quality."""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from po_backend.core.request import ScoreResult
from po_backend.sched.config import CLASSES, SchedulerConfig
from po_backend.server.service import ScoringService


class Metrics:
    """Prometheus metrics in a registry of this app's own (two apps in one process do not clash)."""

    WINDOW_S = 10.0  # tokens/s is measured over this sliding window

    # SGLang's buckets (sglang/srt/observability/metrics_collector.py), so dashboards' quantiles
    # read the same bins.
    LATENCY_BUCKETS = (
        0.1,
        0.2,
        0.4,
        0.6,
        0.8,
        1,
        2,
        4,
        6,
        8,
        10,
        20,
        40,
        60,
        80,
        100,
        200,
        400,
        600,
        1200,
        1800,
        2400,
    )

    def __init__(self, service: ScoringService, model_name: str = "") -> None:
        self.service = service
        r = self.registry = CollectorRegistry()
        self._sglang_series(r, model_name)
        self._class_series(r, model_name)
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
        self.tokenized_chars = Counter(
            "po_tokenized_chars", "Characters of text given to the tokenizer by the HTTP calls", registry=r
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
        Gauge("po_cache_tokens", "Tokens held in the prefix cache", registry=r).set_function(
            lambda: self._cache_stat("cached_tokens")
        )
        Gauge(
            "po_cache_reused_tokens",
            "Cached tokens read since they were stored (the rest were stored on speculation)",
            registry=r,
        ).set_function(lambda: self._cache_stat("reused_tokens"))
        Gauge(
            "po_jct_online_r", "Pearson r of calibrated JCT predictions vs measured step times", registry=r
        ).set_function(lambda: self._stat("jct_online_r"))
        Gauge(
            "po_jct_calibration", "Measured / predicted step time factor the JCT model applies", registry=r
        ).set_function(lambda: self._stat("jct_calibration"))
        Gauge(
            "po_batch_step_budget_seconds",
            "Predicted seconds a batch step may take beside online calls with --online-slo-ms (0 without)",
            registry=r,
        ).set_function(lambda: self._stat("batch_step_budget_s"))
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()  # one scrape at a time; not _lock, which observe() takes
        self._snapshot: dict[str, Any] | None = None
        self._window: deque[tuple[float, int]] = deque()  # (time, prompt tokens finished then)
        self._tokens = 0
        self._cached = 0

    def _sglang_series(self, r: CollectorRegistry, model_name: str) -> None:
        base = {"model_name": model_name, "engine_type": "unified"}
        stream = {**base, "is_streaming": "false"}  # every answer is one token: nothing streams

        def counter(name: str, doc: str, labels: dict[str, str]) -> Counter:
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, list(stream), buckets=self.LATENCY_BUCKETS, registry=r).labels(
                **stream
            )

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(name, doc, list(base), registry=r).labels(**base).set_function(read)

        self.sgl_prompt_tokens = counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", stream
        )
        self.sgl_generation_tokens = counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", stream
        )
        self.sgl_cached_tokens = counter(
            "sglang:cached_tokens",
            "Number of cached prompt tokens.",
            {**base, "cache_source": "device"},  # the prefix pool lives with the model
        )
        self.sgl_requests = counter("sglang:num_requests", "Number of requests processed.", stream)
        self.sgl_aborted = counter("sglang:num_aborted_requests", "Number of requests aborted.", base)
        self.sgl_e2e = histogram(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds"
        )
        self.sgl_ttft = histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds."
        )
        gauge("sglang:num_running_reqs", "The number of running requests.", lambda: self._stat("running"))
        gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            lambda: self._stat("queued"),
        )
        gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", self._hit_rate)
        gauge("sglang:token_usage", "The token usage.", self._token_usage)
        # SGLang's decode throughput; for a prefill-only server the prompt tokens it scores.
        gauge("sglang:gen_throughput", "The generation throughput (token/s).", self.tokens_per_second)

    QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

    def _class_series(self, r: CollectorRegistry, model_name: str) -> None:
        """Per priority class (online: the default priority or more urgent; batch: less urgent;
        everything is online with priority scheduling off): queue length, queueing time, call
        latency, and the online calls' attainment of --online-slo-ms."""
        s = self.service.settings
        self.classes = SchedulerConfig(
            enable_priority=bool(s.get("enable_priority_scheduling")),
            low_priority_first=bool(s.get("schedule_low_priority_values_first")),
        )
        slo_ms = s.get("online_slo_ms")
        self.online_slo_s: float | None = None if slo_ms is None else float(slo_ms) / 1e3
        queue = Gauge(
            "po_class_queue_length", "Prompts waiting, per priority class", ["priority_class"], registry=r
        )
        for c in CLASSES:
            queue.labels(c).set_function(functools.partial(self._class_queued, c))
        self.sgl_queue_time = Histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            ["model_name", "engine_type"],
            buckets=self.QUEUE_BUCKETS,
            registry=r,
        ).labels(model_name=model_name, engine_type="unified")
        self.class_queue_time = Histogram(
            "po_class_queue_time_seconds",
            "Time a prompt waited before its step, per priority class",
            ["priority_class"],
            buckets=self.QUEUE_BUCKETS,
            registry=r,
        )
        self.class_latency = Histogram(
            "po_class_request_latency_seconds",
            "Call latency (submitted to answered by the scheduling loop), per priority class",
            ["priority_class"],
            buckets=self.QUEUE_BUCKETS,
            registry=r,
        )
        self.slo_calls = Counter(
            "po_online_slo_calls",
            "Online calls by whether their latency met --online-slo-ms (none counted without it)",
            ["met"],
            registry=r,
        )
        Gauge(
            "po_online_slo_attainment",
            "Share of online calls whose latency met --online-slo-ms (1 before the first, and without a target)",
            registry=r,
        ).set_function(self._attainment)
        self._slo_counts = [0, 0]  # online calls within the target, all online calls

    def _class_queued(self, c: str) -> float:
        try:
            return float((self._stats().get("queued_by_class") or {}).get(c, 0) or 0)
        except Exception:  # a scrape must not fail because a stat is missing
            return 0.0

    def _attainment(self) -> float:
        met, n = self._slo_counts
        return met / n if n else 1.0

    def render(self) -> bytes:
        """The exposition text. The gauges read one snapshot of the service's stats, taken here:
        each read takes the loop's lock and summarises its step log, and a scrape reads a dozen."""
        with self._stats_lock:
            self._snapshot = self.service.stats()
            try:
                return bytes(generate_latest(self.registry))
            finally:
                self._snapshot = None

    def _stats(self) -> dict[str, Any]:
        return self._snapshot if self._snapshot is not None else self.service.stats()

    def _token_usage(self) -> float:
        """Share of the prefix pool's slots in use (SGLang: of the KV cache)."""
        try:
            cache = self._stats().get("cache") or {}
            total = float(cache.get("total_slots", 0) or 0)
            return 1.0 - float(cache.get("free_slots", 0)) / total if total else 0.0
        except Exception:  # a scrape must not fail because a stat is missing
            return 0.0

    def _cache_stat(self, key: str) -> float:
        try:
            return float((self._stats().get("cache") or {}).get(key, 0) or 0)
        except Exception:  # a scrape must not fail because a stat is missing
            return 0.0

    def _stat(self, key: str) -> float:
        try:
            return float(self._stats().get(key, 0) or 0)
        except Exception:  # a scrape must not fail because a stat is missing
            return 0.0

    def observe(
        self,
        results: Sequence[ScoreResult],
        seconds: float = 0.0,
        output_tokens: int = 0,
        priority: int | None = None,
    ) -> None:
        """A finished call: its prompts' results, the call's wall time (each prompt's end-to-end
        latency and, with one output token, its time to first token), its output tokens and its
        priority."""
        now = time.monotonic()
        cls = self.classes.class_of(priority)
        self.class_latency.labels(cls).observe(seconds)
        for res in results:
            self.sgl_queue_time.observe(res.queue_seconds)
            self.class_queue_time.labels(cls).observe(res.queue_seconds)
        if cls == CLASSES[0] and self.online_slo_s is not None:
            met = seconds <= self.online_slo_s
            self.slo_calls.labels(str(met).lower()).inc()
            with self._lock:
                self._slo_counts[0] += met
                self._slo_counts[1] += 1
        tokens = sum(r.prompt_tokens for r in results)
        cached = sum(r.cached_tokens for r in results)
        self.sgl_requests.inc(len(results))
        self.sgl_prompt_tokens.inc(tokens)
        self.sgl_cached_tokens.inc(cached)
        self.sgl_generation_tokens.inc(output_tokens)
        for _ in results:
            self.sgl_e2e.observe(seconds)
            self.sgl_ttft.observe(seconds)
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
