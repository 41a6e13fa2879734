"""OpenTelemetry traces of the server's calls, exported over OTLP/HTTP (protobuf): vLLM's
`--otlp-traces-endpoint URL`, SGLang's `--enable-trace`.

One span per HTTP call (`POST /v1/score`), continuing the caller's trace when it sends a W3C
`traceparent` header, with child spans for what the call went through:

- `tokenize`: building the call's requests (tokenizing, templates), off the event loop;
- `queue`: from submission until its first engine step started, with the priority class and the
  scheduler's predicted time of the step;
- `forward`: each engine step that ran the call's requests, with the step's batch size and the
  call's cached and computed tokens in it;
- `response`: from the results to the last byte of the response sent.

The OpenTelemetry packages are the optional `[otel]` extra and are imported only here, only when an
endpoint is set: without one `create_app` never imports this module's `Tracing`, and a call costs
nothing more than a None check.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from po_backend.core.request import ScoreResult

DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"  # the OTLP/HTTP receiver's default
TRACES_PATH = "/v1/traces"


def endpoint_url(endpoint: str, enable_trace: bool) -> str:
    """The OTLP/HTTP URL spans go to ("" = tracing off): `endpoint` as given, with `http://`
    when it has no scheme and `/v1/traces` when it has no path; `enable_trace` alone sends to the
    default local receiver."""
    if not endpoint:
        return DEFAULT_ENDPOINT if enable_trace else ""
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https"):
        raise ValueError(
            f"otlp_traces_endpoint: only OTLP over HTTP is supported (http:// or https://, e.g. "
            f"http://localhost:4318/v1/traces), got {endpoint!r}"
        )
    if not parts.netloc:
        raise ValueError(f"otlp_traces_endpoint: no host in {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + TRACES_PATH


@dataclass
class _Call:
    """One traced call: its span and when its results came back."""

    span: Any
    results_ns: int | None = None
    tokenize: list[Any] = field(default_factory=list)


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("po_trace_call", default=None)


class Tracing:
    """A tracer provider of its own (no global state) exporting in batches to `endpoint`."""

    def __init__(self, endpoint: str, service_name: str) -> None:
        # Lazy: the [otel] extra, loaded only when traces are asked for.
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("prefillonly")
        self.propagator = TraceContextTextMapPropagator()

    def middleware(self, app: Any) -> Any:
        """The pure ASGI middleware that opens and closes each HTTP call's span."""
        return _TracingMiddleware(app, self)

    def _child(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None:
        call = _CALL.get()
        if call is None:
            return
        ctx = self._trace.set_span_in_context(call.span)
        span = self.tracer.start_span(name, context=ctx, start_time=start_ns, attributes=attributes)
        span.end(end_time=max(end_ns, start_ns))

    @contextlib.contextmanager
    def tokenize(self) -> Iterator[None]:
        start = time.time_ns()
        try:
            yield
        finally:
            self._child("tokenize", start, time.time_ns(), {})

    def record_run(self, submitted_ns: int, results: Sequence[ScoreResult]) -> None:
        """The queue and forward spans of one `Runtime.run`: its requests grouped by the engine step
        they ran in. Step times are placed from the submission time and each request's queue time
        (the loop's clock is not the wall clock)."""
        call = _CALL.get()
        if call is None or not results:
            return
        call.results_ns = time.time_ns()
        steps: dict[int, list[ScoreResult]] = {}
        for r in results:
            if r.step is not None:
                steps.setdefault(r.step.index, []).append(r)
        if not steps:
            return
        first = min(steps)
        head = steps[first][0]
        assert head.step is not None
        queued_ns = submitted_ns + int(min(r.queue_seconds for r in steps[first]) * 1e9)
        attrs: dict[str, Any] = {
            "po.priority_class": head.step.priority_class,
            "po.requests": len(results),
            "po.steps": len(steps),
        }
        if math.isfinite(head.step.predicted_seconds):
            attrs["po.predicted_step_seconds"] = head.step.predicted_seconds
        self._child("queue", submitted_ns, queued_ns, attrs)
        for rs in steps.values():
            step = rs[0].step
            assert step is not None
            start = submitted_ns + int(rs[0].queue_seconds * 1e9)
            cached = sum(r.cached_tokens for r in rs)
            prompt = sum(r.prompt_tokens for r in rs)
            self._child(
                "forward",
                start,
                start + int(step.seconds * 1e9),
                {
                    "po.step": step.index,
                    "po.batch_size": step.requests,
                    "po.call_requests": len(rs),
                    "po.cached_tokens": cached,
                    "po.computed_tokens": prompt - cached,
                    "po.step_seconds": step.seconds,
                },
            )

    def shutdown(self) -> None:
        """Export what is still buffered (at the server's exit)."""
        self.provider.shutdown()


class _TracingMiddleware:
    def __init__(self, app: Any, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t = self.tracing
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        parent = t.propagator.extract(headers)
        method, path = scope.get("method", ""), scope.get("path", "")
        span = t.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=t._trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )
        call = _Call(span)
        token = _CALL.set(call)
        status = 0

        async def traced_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                end = time.time_ns()
                start = call.results_ns if call.results_ns is not None else end
                t._child("response", start, end, {"http.response.status_code": status})

        try:
            await self.app(scope, receive, traced_send)
        finally:
            _CALL.reset(token)
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(t._trace.Status(t._trace.StatusCode.ERROR))
            span.end()
